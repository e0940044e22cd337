//! Flows the host stack handled. The stack may have NATed them (a portmap hostPort, a
//! kube-proxy service); only the stack can undo that on the replies, so the replies of such a
//! flow must not take the fast path. `to_pod` records flows the stack delivered to a pod (the
//! fast path skips that hook) and `from_pod` checks them; `to_host_dev` records pod flows the
//! stack routed out of the node (fast-path packets carry a mark) and `from_host_dev` checks.

use aya_ebpf::programs::TcContext;
use calix_common::FlowKey;

use crate::maps::CALIX_STACK_FLOWS;
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

/// Remembers that the stack delivered this flow to the pod.
#[inline(always)]
pub fn record(key: &FlowKey) {
    if CALIX_STACK_FLOWS.get_ptr(key).is_none() {
        let _ = CALIX_STACK_FLOWS.insert(key, &0, 0);
    }
}

/// Whether the fast path may take this packet (the pod sending): it has a key and the stack
/// did not deliver the flow's other direction.
#[inline(always)]
pub fn fast_path_ok(key: Option<FlowKey>) -> bool {
    match key {
        Some(k) => CALIX_STACK_FLOWS.get_ptr(&k).is_none(),
        None => false,
    }
}
