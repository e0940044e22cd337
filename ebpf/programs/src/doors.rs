//! The calix agents' doors, closed to pods (issue 20): TCP from a pod to one of the agents'
//! ports (`CALIX_AGENT_PORTS`: Routes, metrics) on a node's address — this node's own
//! (`CALIX_HOST_V4/V6`, every address of its interfaces) or another node's
//! (`CALIX_PEERS_V4/V6`) — is dropped in `from_pod`, before the fast path, the host stack or
//! SNAT could take it: with `natOutgoing` another node would see it come from this node's
//! address, a known node. Checked for what is not headed to a pod (a pod's own ports are its
//! business).
//!
//! The port is looked at first (one array lookup, which the verifier inlines, and a few
//! compares), the address only for a guarded port. A TCP header that cannot be read (a first
//! fragment too short to hold the ports, an IPv6 chain too long to follow) to a node's
//! address is dropped too; a later fragment holds no header and passes, since without its
//! first one nothing is reassembled.
use aya_ebpf::programs::TcContext;
use calix_common::MAX_AGENT_PORTS;

use crate::maps::{
    CALIX_AGENT_PORTS, CALIX_HOST_V4, CALIX_HOST_V6, CALIX_PEERS_V4, CALIX_PEERS_V6,
};
use crate::packet::{self, v6, Ipv4, Ipv6, ETH_HLEN, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP};

/// Whether `dport` (network byte order) is one of the agents' ports.
#[inline(always)]
fn guarded(dport: u16) -> bool {
    let Some(ports) = CALIX_AGENT_PORTS.get(0) else {
        return false;
    };
    let mut i = 0;
    while i < MAX_AGENT_PORTS {
        let p = ports.tcp[i];
        if p != 0 && p == dport {
            return true;
        }
        i += 1;
    }
    false
}

/// Whether the destination port at `l4` (TCP, `l4_len` bytes of IP payload) is a guarded
/// one; `None` when it cannot be read.
#[inline(always)]
fn guarded_at(ctx: &TcContext, l4: usize, l4_len: usize) -> Option<bool> {
    if l4_len < 4 {
        return None;
    }
    let p: [u8; 2] = ctx.load(l4 + 2).ok()?;
    Some(guarded(u16::from_ne_bytes(p)))
}

/// Whether the pod's IPv4 packet `ip` is TCP to an agent's port on a node's address.
#[inline(always)]
pub fn v4(ctx: &TcContext, ip: &Ipv4) -> bool {
    if ip.proto != IPPROTO_TCP || ip.later_fragment() {
        return false;
    }
    let l4_len = usize::from(ip.tot_len).saturating_sub(ip.ihl);
    if guarded_at(ctx, ETH_HLEN + ip.ihl, l4_len) == Some(false) {
        return false;
    }
    CALIX_HOST_V4.get_ptr(&ip.dst).is_some() || CALIX_PEERS_V4.get_ptr(&ip.dst).is_some()
}

/// Whether the pod's IPv6 packet `ip` is TCP (behind any extension headers) to an agent's
/// port on a node's address.
#[inline(always)]
pub fn v6(ctx: &TcContext, ip: &Ipv6) -> bool {
    let end = ETH_HLEN + v6::LEN + usize::from(ip.payload_len);
    let l4 = match ip.next_hdr {
        IPPROTO_TCP => Some(ETH_HLEN + v6::LEN),
        IPPROTO_UDP | IPPROTO_ICMPV6 => return false,
        next => {
            let read = |off: usize| ctx.load::<[u8; 4]>(off).ok();
            match packet::v6_upper(next, ETH_HLEN + v6::LEN, end, read) {
                Some(up) if up.proto == IPPROTO_TCP => Some(up.off),
                Some(_) => return false,
                None => None,
            }
        }
    };
    let port = l4.and_then(|l4| guarded_at(ctx, l4, end.saturating_sub(l4)));
    if port == Some(false) {
        return false;
    }
    CALIX_HOST_V6.get_ptr(&ip.dst).is_some() || CALIX_PEERS_V6.get_ptr(&ip.dst).is_some()
}
