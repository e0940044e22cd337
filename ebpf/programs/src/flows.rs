//! Flows the host stack handled. The stack may have NATed them (a portmap hostPort, a
//! kube-proxy service); only the stack can undo that on the replies, so the replies of such a
//! flow must not take the fast path. `to_pod` records flows the stack delivered to a pod (the
//! fast path skips that hook) and `from_pod` checks them; `to_host_dev` records pod flows the
//! stack routed out of the node (fast-path packets carry a mark) and `from_host_dev` checks.
//!
//! The flow lookup costs about as much as the rest of the fast path together (a 40-byte key
//! hashed into a large LRU table), so the programs also mark the endpoint itself
//! (`CALIX_STACK_EPS`) and the fast path looks flows up only for marked endpoints: a pod that
//! never had a flow through the stack pays one small hash lookup instead. Packets the stack
//! sends from the node itself (a socket of the node: kubelet probes, hostNetwork clients) are
//! not recorded: their replies go to the node's own address, which the fast path never takes.

use aya_ebpf::programs::TcContext;
use calix_common::FlowKey;

use crate::maps::{CALIX_STACK_EPS, CALIX_STACK_FLOWS};
use crate::packet::{self, Ipv4, Ipv6, ETH_HLEN};

/// The flow key of an IPv4 packet, seen from the pod `pod_is_src` names; `None` when the
/// packet has no ports to key on (fragments, other protocols): those never take the fast path.
#[inline(always)]
pub fn key_v4(ctx: &TcContext, ip: &Ipv4, pod_is_src: bool) -> Option<FlowKey> {
    if ip.fragment {
        return None;
    }
    let l4_len = usize::from(ip.tot_len).saturating_sub(ip.ihl);
    let (sport, dport) = packet::ports(ctx, ETH_HLEN + ip.ihl, l4_len, ip.proto)?;
    let mut k = FlowKey {
        proto: ip.proto,
        family: 4,
        ..FlowKey::default()
    };
    let (pod, peer, pod_port, peer_port) = if pod_is_src {
        (ip.src, ip.dst, sport, dport)
    } else {
        (ip.dst, ip.src, dport, sport)
    };
    k.pod[..4].copy_from_slice(&pod);
    k.peer[..4].copy_from_slice(&peer);
    k.pod_port = pod_port;
    k.peer_port = peer_port;
    Some(k)
}

/// As [`key_v4`] for IPv6 (no extension headers: anything else has no key).
#[inline(always)]
pub fn key_v6(ctx: &TcContext, ip: &Ipv6, pod_is_src: bool) -> Option<FlowKey> {
    let l4_len = usize::from(ip.payload_len);
    let (sport, dport) = packet::ports(ctx, ETH_HLEN + packet::v6::LEN, l4_len, ip.next_hdr)?;
    let (pod, peer, pod_port, peer_port) = if pod_is_src {
        (ip.src, ip.dst, sport, dport)
    } else {
        (ip.dst, ip.src, dport, sport)
    };
    Some(FlowKey {
        pod,
        peer,
        pod_port,
        peer_port,
        proto: ip.next_hdr,
        family: 6,
        _pad: [0; 2],
    })
}

/// Remembers that the stack handled this flow of the pod whose host-side veth is `ifindex`.
#[inline(always)]
pub fn record(key: &FlowKey, ifindex: u32) {
    if CALIX_STACK_FLOWS.get_ptr(key).is_none() {
        let _ = CALIX_STACK_FLOWS.insert(key, &0, 0);
    }
    if CALIX_STACK_EPS.get_ptr(&ifindex).is_none() {
        let _ = CALIX_STACK_EPS.insert(&ifindex, &0, 0);
    }
}

/// Whether an IPv4 packet carries TCP or UDP ports inside its payload: such a packet has a
/// flow key, which then need not be built unless its endpoint is marked.
#[inline(always)]
pub fn has_ports_v4(ip: &Ipv4) -> bool {
    !ip.fragment
        && matches!(ip.proto, packet::IPPROTO_TCP | packet::IPPROTO_UDP)
        && usize::from(ip.tot_len) >= ip.ihl + 4
}

/// As [`has_ports_v4`] for IPv6.
#[inline(always)]
pub fn has_ports_v6(ip: &Ipv6) -> bool {
    matches!(ip.next_hdr, packet::IPPROTO_TCP | packet::IPPROTO_UDP) && ip.payload_len >= 4
}

/// Whether the fast path may take this packet of the pod whose host-side veth is `ifindex`:
/// it has a flow key (`has_ports` says so without reading it; else `key` builds it) and the
/// stack did not handle the flow's other direction. The key is built only when needed.
#[inline(always)]
pub fn fast_path_ok(ifindex: u32, has_ports: bool, key: impl FnOnce() -> Option<FlowKey>) -> bool {
    let marked = CALIX_STACK_EPS.get_ptr(&ifindex).is_some();
    if !marked && has_ports {
        return true;
    }
    match key() {
        Some(k) => !marked || CALIX_STACK_FLOWS.get_ptr(&k).is_none(),
        None => false,
    }
}
