//! Flows the host stack handled. The stack may have NATed them (a portmap hostPort, a
//! kube-proxy service); only the stack can undo that on the replies, so the replies of such a
//! flow must not take the fast path. `to_pod` records flows the stack delivered to a pod (the
//! fast path skips that hook) and `from_pod` checks them; `to_host_dev` records pod flows the
//! stack routed out of the node (fast-path packets carry a mark) and `from_host_dev` checks.
//!
//! The flow lookup costs about as much as the rest of the fast path together (a 40-byte key
//! hashed into a large table), so the programs also mark the endpoint itself
//! (`CALIX_STACK_EPS`, an array indexed by the endpoint's slot) and the fast path looks flows
//! up only for marked endpoints: a pod that never had a flow through the stack pays one array
//! lookup (inlined by the verifier) instead. Packets the stack
//! sends from the node itself (a socket of the node: kubelet probes, hostNetwork clients) are
//! not recorded: their replies go to the node's own address, which the fast path never takes.
//!
//! Fail safe: the table is a plain hash (nothing is evicted silently); a flow that finds it
//! full marks its endpoint as overflowing, and an overflowing endpoint's packets never take
//! the fast path where a flow check would apply, until the agent clears the mark (once every
//! flow that could have been missed is one the host's conntrack has forgotten). The agent
//! also removes entries the host's conntrack has forgotten.

use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use calix_common::{stack_overflow_mark, FlowKey, StackFlow, SF_CLOSING, STACK_MARKED};

use crate::maps::{CALIX_STACK_CLEARED, CALIX_STACK_EPS, CALIX_STACK_FLOWS, CALIX_STACK_OVF};
use crate::packet::{self, Ipv4, Ipv6, ETH_HLEN};

const BPF_NOEXIST: u64 = 1;
/// An entry's `last_seen_ns` is refreshed when older than this (fewer writes per packet).
const REFRESH_NS: u64 = 1_000_000_000;
/// TCP header flag bits.
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;

/// The flow key of an IPv4 packet, seen from the pod `pod_is_src` names; `None` when the
/// packet has no ports to key on (fragments, other protocols): those never take the fast path.
#[inline(always)]
pub fn key_v4(ctx: &TcContext, ip: &Ipv4, pod_is_src: bool) -> Option<FlowKey> {
    if ip.fragment() {
        return None;
    }
    let l4_len = usize::from(ip.tot_len).saturating_sub(ip.ihl);
    let (sport, dport) = packet::ports(ctx, ETH_HLEN + ip.ihl, l4_len, ip.proto)?;
    let (pod, peer, pod_port, peer_port) = if pod_is_src {
        (ip.src, ip.dst, sport, dport)
    } else {
        (ip.dst, ip.src, dport, sport)
    };
    Some(FlowKey {
        pod: packet::v4_addr16(pod),
        peer: packet::v4_addr16(peer),
        pod_port,
        peer_port,
        proto: ip.proto,
        family: 4,
        _pad: [0; 2],
    })
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

/// Whether an IPv4 packet is a TCP FIN or RST (its flow is closing).
#[inline(always)]
pub fn closing_v4(ctx: &TcContext, ip: &Ipv4) -> bool {
    !ip.fragment()
        && ip.proto == packet::IPPROTO_TCP
        && usize::from(ip.tot_len) >= ip.ihl + 14
        && tcp_closing(ctx, ETH_HLEN + ip.ihl)
}

/// As [`closing_v4`] for IPv6.
#[inline(always)]
pub fn closing_v6(ctx: &TcContext, ip: &Ipv6) -> bool {
    ip.next_hdr == packet::IPPROTO_TCP
        && ip.payload_len >= 14
        && tcp_closing(ctx, ETH_HLEN + packet::v6::LEN)
}

#[inline(always)]
fn tcp_closing(ctx: &TcContext, l4: usize) -> bool {
    ctx.load::<u8>(l4 + 13)
        .is_ok_and(|f| f & (TCP_FIN | TCP_RST) != 0)
}

/// Refreshes a flow's entry: its time when stale, the closing bit when it is new.
#[inline(always)]
fn refresh(f: *mut StackFlow, flags: u32, now: u64) {
    // SAFETY: `f` comes from a successful lookup and stays valid until the program returns;
    // racing writers store newer times or add bits (benign).
    unsafe {
        if now.wrapping_sub((*f).last_seen_ns) > REFRESH_NS {
            (*f).last_seen_ns = now;
        }
        if (*f).flags & flags != flags {
            (*f).flags |= flags;
        }
    }
}

/// Remembers that the stack handled this flow (closing: a FIN or RST) of the pod whose
/// endpoint slot is `slot`, and marks the endpoint. When the table is full, marks the
/// endpoint as overflowing.
#[inline(always)]
pub fn record(key: &FlowKey, slot: u32, closing: bool) {
    // SAFETY: a plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let flags = if closing { SF_CLOSING } else { 0 };
    match CALIX_STACK_FLOWS.get_ptr_mut(key) {
        Some(f) => refresh(f, flags, now),
        None => {
            let f = StackFlow {
                last_seen_ns: now,
                flags,
                _pad: 0,
            };
            if CALIX_STACK_FLOWS.insert(key, &f, BPF_NOEXIST).is_err()
                && CALIX_STACK_FLOWS.get_ptr(key).is_none()
            {
                // Full: this flow is unknown to the fast path, so its endpoint's traffic
                // must all go to the stack. The overflow mark first: a reader that sees the
                // endpoint marked then reads it.
                set(CALIX_STACK_OVF.get_ptr_mut(slot), stack_overflow_mark(now));
            }
        }
    }
    set(CALIX_STACK_EPS.get_ptr_mut(slot), STACK_MARKED);
}

/// Stores `v` at `p` (an array value) unless it holds it already (no needless write to a line
/// other CPUs read).
#[inline(always)]
fn set(p: Option<*mut u32>, v: u32) {
    if let Some(p) = p {
        // SAFETY: a pointer from a successful array lookup, valid until the program returns;
        // volatile: the stores keep their order (overflow mark, then the mark).
        unsafe {
            if core::ptr::read_volatile(p) != v {
                core::ptr::write_volatile(p, v);
            }
        }
    }
}

/// Whether an IPv4 packet carries TCP or UDP ports inside its payload: such a packet has a
/// flow key, which then need not be built unless its endpoint is marked.
#[inline(always)]
pub fn has_ports_v4(ip: &Ipv4) -> bool {
    !ip.fragment()
        && matches!(ip.proto, packet::IPPROTO_TCP | packet::IPPROTO_UDP)
        && usize::from(ip.tot_len) >= ip.ihl + 4
}

/// As [`has_ports_v4`] for IPv6.
#[inline(always)]
pub fn has_ports_v6(ip: &Ipv6) -> bool {
    matches!(ip.next_hdr, packet::IPPROTO_TCP | packet::IPPROTO_UDP) && ip.payload_len >= 4
}

/// Whether the fast path may take this packet of the pod whose endpoint slot is `slot`: it
/// has a flow key (`has_ports` says so without reading it; else `key` builds it) and the
/// stack did not handle the flow's other direction. The key is built only when needed.
/// An endpoint that overflowed the table sends everything the check covers to the stack.
#[inline(always)]
pub fn fast_path_ok(slot: u32, has_ports: bool, key: impl FnOnce() -> Option<FlowKey>) -> bool {
    let read = |p: Option<*const u32>| {
        // SAFETY: a pointer from a successful array lookup, valid until the program returns.
        p.map_or(0, |p| unsafe { core::ptr::read_volatile(p) })
    };
    let marked = read(CALIX_STACK_EPS.get_ptr(slot)) != 0;
    if !marked && has_ports {
        return true;
    }
    if marked {
        let overflow = read(CALIX_STACK_OVF.get_ptr(slot));
        if overflow != 0 && read(CALIX_STACK_CLEARED.get_ptr(slot)) != overflow {
            return false;
        }
    }
    match key() {
        Some(k) => !marked || !stack_handled(&k),
        None => false,
    }
}

/// Whether the stack handled the flow `k`; refreshes its entry (the flow is in use).
#[inline(always)]
fn stack_handled(k: &FlowKey) -> bool {
    match CALIX_STACK_FLOWS.get_ptr_mut(k) {
        Some(f) => {
            // SAFETY: a plain helper call.
            refresh(f, 0, unsafe { bpf_ktime_get_ns() });
            true
        }
        None => false,
    }
}
