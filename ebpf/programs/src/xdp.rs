//! XDP on the node's uplink: the prefilter, run before the host stack allocates anything.
//!
//! - An IPv4 or IPv6 header that is truncated or invalid (version, IHL, a total/payload length
//!   past the end of the frame) is dropped: the stack would drop it a little later anyway.
//! - A packet whose source is in the deny list (`CALIX_DENY_V4` / `CALIX_DENY_V6`, LPM tries
//!   the agent fills from its config) is dropped, unless it is TCP or UDP to a failsafe
//!   destination port (`CALIX_FAILSAFE`: ssh, the agent's own ports) of the node itself (a
//!   destination in `CALIX_HOST_V4` / `CALIX_HOST_V6`, the node's own addresses, which the
//!   agent keeps current), which always passes so a deny list can never lock the operator
//!   out; the same port on a pod or anything else the node forwards to gets no such pass. IPv6
//!   extension headers are followed to the ports (`packet::v6_upper`). ICMPv6 neighbour
//!   discovery passes too (the IPv6 counterpart of ARP, which passes as non-IP): a denied
//!   host must still be able to resolve the node's address to reach those ports.
//! - Everything else passes: other EtherTypes (ARP, LLDP...), IP from anywhere else.
//!
//! Every drop is counted by (ingress ifindex, reason) in `CALIX_DROPS`, like the tc programs'.
//! One 802.1Q/802.1ad tag is looked through. Reads are direct packet accesses, each behind one
//! bounds check against `data_end` (the verifier checks them); the frame is never changed.
//!
//! The program is `frags`-aware (multi-buffer XDP): headers are read from the first buffer
//! (`data`..`data_end`), lengths are checked against the whole frame (`bpf_xdp_get_buff_len`).
//! So jumbo frames pass as they are, and native mode stays possible on drivers that refuse a
//! single-buffer program above a page-sized MTU.

use aya_ebpf::{
    bindings::xdp_action::XDP_PASS, helpers::bpf_xdp_get_buff_len, maps::lpm_trie::Key,
    programs::XdpContext,
};
use calix_common::{DropReason, FailsafePort};

use crate::counters;
use crate::maps::{CALIX_DENY_V4, CALIX_DENY_V6, CALIX_FAILSAFE, CALIX_HOST_V4, CALIX_HOST_V6};
use crate::packet::{
    self, v4, v6, ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMPV6,
    IPPROTO_TCP, IPPROTO_UDP, VLAN_HLEN,
};

/// The `N` bytes at `off` into the frame, if its first buffer holds them all.
#[inline(always)]
fn bytes<const N: usize>(ctx: &XdpContext, off: usize) -> Option<&[u8; N]> {
    let start = ctx.data();
    if start + off + N > ctx.data_end() {
        return None;
    }
    // SAFETY: the frame holds these N bytes (checked just above, and by the verifier), they
    // stay valid until the program returns, and a byte array needs no alignment.
    Some(unsafe { &*((start + off) as *const [u8; N]) })
}

pub fn try_xdp_host_dev(ctx: &XdpContext) -> u32 {
    // Shorter than an Ethernet header: nothing to judge (drivers do not deliver such frames).
    let Some(&ethertype) = bytes::<2>(ctx, 12) else {
        return XDP_PASS;
    };
    let mut ethertype = u16::from_be_bytes(ethertype);
    let mut l3 = ETH_HLEN;
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        let Some(&inner) = bytes::<2>(ctx, ETH_HLEN + 2) else {
            return XDP_PASS;
        };
        ethertype = u16::from_be_bytes(inner);
        l3 += VLAN_HLEN;
    }
    match ethertype {
        ETH_P_IP => ipv4(ctx, l3, frame_len(ctx)),
        ETH_P_IPV6 => ipv6(ctx, l3, frame_len(ctx)),
        _ => XDP_PASS,
    }
}

/// The whole frame's length: the first buffer and any fragments.
#[inline(always)]
fn frame_len(ctx: &XdpContext) -> usize {
    // SAFETY: a helper that only reads the context.
    unsafe { bpf_xdp_get_buff_len(ctx.ctx) as usize }
}

/// The IP header at `l3`, when the first buffer holds it. `Err`: the verdict when it does
/// not — a drop when the whole frame is too short for it, else a pass (a header split across
/// buffers is not this program's to judge; drivers do not split that early).
#[inline(always)]
fn header<const N: usize>(
    ctx: &XdpContext,
    l3: usize,
    len: usize,
    malformed: DropReason,
) -> Result<&[u8; N], u32> {
    match bytes::<N>(ctx, l3) {
        Some(h) => Ok(h),
        None if len < l3 + N => Err(drop(ctx, malformed, len)),
        None => Err(XDP_PASS),
    }
}

#[inline(always)]
fn ipv4(ctx: &XdpContext, l3: usize, len: usize) -> u32 {
    let malformed = DropReason::XdpMalformedV4;
    let h = match header::<{ v4::MIN_LEN }>(ctx, l3, len, malformed) {
        Ok(h) => h,
        Err(verdict) => return verdict,
    };
    let ihl = usize::from(h[0] & 0x0f) * 4;
    let tot_len = usize::from(u16::from_be_bytes([h[2], h[3]]));
    // (A total length of 0 is also what IPv4 BIG TCP writes into packets over 64 KiB; those
    // only exist when the operator raises the uplink's gro_ipv4_max_size: malformed here.)
    if h[0] >> 4 != 4 || ihl < v4::MIN_LEN || tot_len < ihl || l3 + tot_len > len {
        return drop(ctx, malformed, len);
    }
    let src = [h[12], h[13], h[14], h[15]];
    if CALIX_DENY_V4.get(&Key::new(32, src)).is_none() {
        return XDP_PASS;
    }
    // Only the first fragment (or an unfragmented packet) carries the ports.
    let offset = u16::from_be_bytes([h[6], h[7]]) & 0x1fff;
    let dst = [h[16], h[17], h[18], h[19]];
    if offset == 0 && failsafe(ctx, h[9], l3 + ihl) && CALIX_HOST_V4.get_ptr(&dst).is_some() {
        return XDP_PASS;
    }
    drop(ctx, DropReason::XdpDenied, len)
}

#[inline(always)]
fn ipv6(ctx: &XdpContext, l3: usize, len: usize) -> u32 {
    let malformed = DropReason::XdpMalformedV6;
    let h = match header::<{ v6::LEN }>(ctx, l3, len, malformed) {
        Ok(h) => h,
        Err(verdict) => return verdict,
    };
    // (A payload length of 0 is a jumbogram or IPv6 BIG TCP: the frame says how long it is.)
    let payload_len = usize::from(u16::from_be_bytes([h[4], h[5]]));
    if h[0] >> 4 != 6 || l3 + v6::LEN + payload_len > len {
        return drop(ctx, malformed, len);
    }
    let mut src = [0u8; 16];
    src.copy_from_slice(&h[8..24]);
    if CALIX_DENY_V6.get(&Key::new(128, src)).is_none() {
        return XDP_PASS;
    }
    // The transport header, past any extension headers (a jumbogram's payload runs to the
    // end of the frame).
    let end = match payload_len {
        0 => len,
        n => l3 + v6::LEN + n,
    };
    let read = |off: usize| bytes::<4>(ctx, off).copied();
    let Some(up) = packet::v6_upper(h[6], l3 + v6::LEN, end, read) else {
        return drop(ctx, DropReason::XdpDenied, len);
    };
    if !up.fragmented && neighbour_discovery(ctx, up.proto, up.off) {
        return XDP_PASS;
    }
    let mut dst = [0u8; 16];
    dst.copy_from_slice(&h[24..40]);
    if failsafe(ctx, up.proto, up.off) && CALIX_HOST_V6.get_ptr(&dst).is_some() {
        return XDP_PASS;
    }
    drop(ctx, DropReason::XdpDenied, len)
}

/// Whether the packet is TCP or UDP (`proto`, header at `l4`) to a failsafe destination port
/// (read from the first buffer).
#[inline(always)]
fn failsafe(ctx: &XdpContext, proto: u8, l4: usize) -> bool {
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return false;
    }
    // The destination port: bytes 2..4 of both headers.
    let Some(&dport) = bytes::<2>(ctx, l4 + 2) else {
        return false;
    };
    let key = FailsafePort {
        port: u16::from_ne_bytes(dport),
        proto,
        _pad: 0,
    };
    CALIX_FAILSAFE.get_ptr(&key).is_some()
}

/// Whether the packet is ICMPv6 neighbour discovery (router/neighbour solicitation and
/// advertisement, redirect: types 133–137). Like ARP for IPv4 it passes whatever the source:
/// without it a denied host could not resolve the node's address, and its failsafe ports
/// would be unreachable over IPv6.
#[inline(always)]
fn neighbour_discovery(ctx: &XdpContext, next_hdr: u8, l4: usize) -> bool {
    if next_hdr != IPPROTO_ICMPV6 {
        return false;
    }
    matches!(bytes::<1>(ctx, l4), Some(&[133..=137]))
}

/// Counts the frame (`len` bytes) under (ingress ifindex, `reason`) and drops it.
#[inline(always)]
fn drop(ctx: &XdpContext, reason: DropReason, len: usize) -> u32 {
    // SAFETY: a plain context read the verifier checks.
    let ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    counters::drop_xdp(ifindex, reason, len as u64)
}
