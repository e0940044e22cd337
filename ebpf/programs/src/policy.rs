//! NetworkPolicy: the verdict on a packet of an isolated endpoint (`calix_common::policy`).
//!
//! An endpoint isolated in no direction costs one array lookup (its state, inlined by the
//! verifier). For an isolated one, a packet of a flow it let through passes on one flow
//! lookup, as long as the endpoint's generation has not changed since; otherwise the rules
//! decide: the peer's identity (longest match), then an entry for that identity or for any
//! peer, and an allowed flow is remembered. After a change (a new generation) a remembered
//! flow is checked again against the direction that opened it, and marked revoked if that no
//! longer allows it: a revoked flow is refused from its next packet on, both ways, for as
//! long as its packets keep coming (and let through again if a later change allows it). An
//! endpoint with `POL_KEEP_ESTABLISHED` keeps its remembered flows instead, until they go idle.
//!
//! IPv6 neighbour discovery and MLD are never subject to policy. Packets with no ports to key
//! on (fragments, IPv6 behind extension headers, protocols other than TCP, UDP, SCTP and ICMP
//! echo) are judged alone, as protocol `proto` port 0: only a rule that allows every protocol
//! lets them through. Fail closed: a packet whose headers cannot be read is denied.
//!
//! Between two endpoints of this node whose pair passes every TCP packet, a connection keeps
//! only its opener's entry, marked `PF_PAIRED` ([`PS_SENT`]). A TCP segment without SYN that
//! matches no remembered flow of its endpoint's, where the other end holds such a `PF_PAIRED`
//! entry, takes it as its own (mirrored, checked again against the direction that opened it);
//! no other entry of another endpoint's is ever taken (`flows::adopt`).
//! Otherwise a TCP segment without SYN that matches no remembered flow (an established
//! connection that predates the endpoint's isolation, or a flow the LRU table let go) passes
//! when either direction's rules allow the flow, and is remembered as opened by that side; a
//! SYN is always checked as a new connection in its own direction.
//!
//! The verdict runs as functions of their own (BPF-to-BPF calls), each building its keys in a
//! per-CPU scratch value rather than on the stack: the 512 bytes of stack are shared by every
//! frame of a call chain, and the fast path's frame takes most of them.

// The bench-floor build uses none of this.
#![cfg_attr(feature = "bench-floor", allow(dead_code))]

use aya_ebpf::{
    bindings::__sk_buff,
    helpers::{bpf_ktime_get_coarse_ns, bpf_skb_load_bytes},
    maps::lpm_trie::Key,
    programs::TcContext,
};
use calix_common::{
    PolicyKey, PolicyScratch, PolicyState, DENIED_NO_RULE, DENIED_REVOKED, DENIED_UNREADABLE,
    PF_ADOPTED, PF_FROM_POD, PF_PAIRED, PF_REVOKED, PF_SERVICE, PF_TO_POD, POLICY_ANY_PEER,
    POLICY_EVENTS_BURST, POLICY_EVENTS_PER_SEC, POLICY_FLOW_OTHER_NS, POLICY_FLOW_TCP_NS,
    POLICY_KEY_BITS, POLICY_SERVICE, POLICY_WORLD, POL_DIR_EGRESS, POL_DIR_INGRESS,
    POL_ISOLATED_EGRESS, POL_ISOLATED_INGRESS, POL_KEEP_ESTABLISHED, PS_EXEMPT, PS_FIN, PS_KEYED,
    PS_PAIR, PS_RECORD, PS_RST, PS_SENT, PS_SYN,
};

mod flows;
mod hits;
mod openers;
mod pairs;
mod syns;

use flows::{
    adopt, clear_flags, clear_flow, closed, flow_get, flow_remove, remember, set_flags, swap_ends,
};
use hits::hit;
pub use openers::{note_opener, recall_opener};
pub use pairs::{learn as learn_pair, plain_segment, v4 as pair_v4, v6 as pair_v6, Pair};

use crate::maps::{
    CALIX_POLICY, CALIX_POL_EVBUDGET, CALIX_POL_EVENTS, CALIX_POL_IDS_V4, CALIX_POL_IDS_V6,
    CALIX_POL_SCRATCH, CALIX_POL_STATE,
};
use crate::packet::{self, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMPV6, IPPROTO_TCP};

const IPPROTO_UDP: u8 = 17;
const IPPROTO_SCTP: u8 = 132;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// A remembered flow's time is refreshed when older than this (fewer writes per packet).
const REFRESH_NS: u64 = 1_000_000_000;

/// A verdict: the packet is denied.
pub const DENY: u8 = 0;
/// A verdict: the packet is allowed.
pub const ALLOW: u8 = 1;
/// An egress verdict: the packet goes to a Service address; the verdict waits for the host
/// stack's DNAT, against the backend it chooses (`calix_common::POLICY_PENDING_MARK`).
pub const DEFER: u8 = 2;
/// A verdict: the packet is allowed, and its flow, as the verdict read it, is in this CPU's
/// scratch: [`ingress_of_sent`] judges the same packet for a receiver on this node without
/// reading it again.
pub const ALLOW_READ: u8 = 3;
/// An egress verdict: the packet is allowed, and the receiver's verdict, an endpoint of this
/// node, is known to allow it too and to have nothing to note: the packet is a segment of a
/// connection the pod opened to it while their pair passed every TCP packet (its entry
/// `PF_PAIRED`), and the receiver kept no entry of it (not `PF_ADOPTED`); or the SYN of such
/// a connection, whose hit of the receiver's rule the SYN memo knew and counted (also one
/// between endpoints whose connections keep no entry, `PS_RECORD`, when the memo says the
/// pair's record of openers holds its port already: nothing to note).
pub const ALLOW_BOTH: u8 = 4;

/// An egress verdict: as [`ALLOW_BOTH`], for the SYN of a new connection between two
/// isolated endpoints of this node whose pair passes every TCP packet and whose connections
/// keep no entry (`PS_RECORD`): the program calls [`note_opener`] once it is delivered.
pub const ALLOW_NOTE: u8 = 5;
/// An egress verdict: as [`ALLOW_NOTE`], for a SYN whose receiver's verdict is still to come
/// (as after [`ALLOW_READ`]: its flow is in the scratch). [`note_opener`] comes first: it
/// leaves the flow as it was.
pub const ALLOW_NOTE_READ: u8 = 6;

/// Whether verdict `v` lets the packet through.
#[inline(always)]
fn passes(v: u8) -> bool {
    matches!(
        v,
        ALLOW | ALLOW_READ | ALLOW_BOTH | ALLOW_NOTE | ALLOW_NOTE_READ
    )
}

/// Whether the endpoint in `slot` is isolated in some direction: the one check every packet
/// pays (an array lookup the verifier inlines); the verdict itself is a function of its own
/// ([`ingress`], [`egress`], [`from_node`]).
#[inline(always)]
pub fn isolated(slot: u32) -> bool {
    CALIX_POL_STATE.get(slot).is_some_and(|s| s.flags != 0)
}

/// The state of the endpoint in `slot`: `None` when it is isolated in no direction.
#[inline(always)]
fn state(slot: u32) -> Option<PolicyState> {
    let s = CALIX_POL_STATE.get(slot)?;
    (s.flags != 0).then_some(*s)
}

/// This CPU's scratch value.
#[inline(always)]
fn scratch() -> Option<&'static mut PolicyScratch> {
    // SAFETY: a per-CPU value from a successful lookup; a program runs to completion on its
    // CPU without migrating, so nothing else uses it meanwhile.
    CALIX_POL_SCRATCH.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

/// Copies 16 bytes of the packet at `off` into `dst` (a constant length, for the verifier).
#[inline(always)]
fn load16(ctx: &TcContext, off: usize, dst: &mut [u8; 16]) -> bool {
    // SAFETY: `dst` is 16 writable bytes; the helper checks the packet's bounds.
    unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            off as u32,
            dst.as_mut_ptr() as *mut _,
            16,
        ) == 0
    }
}

/// Reads the packet in `ctx` into `s.flow` (seen from the pod: `pod_is_src`, the pod sent it)
/// and `s.flags`; false when it is neither IPv4 nor IPv6, or its header cannot be read.
#[inline(always)]
fn read(ctx: &TcContext, s: &mut PolicyScratch, pod_is_src: bool) -> bool {
    clear_flow(s);
    s.flags = 0;
    let (l4, l4_len) = match packet::ethertype(ctx) {
        Ok(ETH_P_IP) => {
            let Some(ip) = packet::ipv4(ctx) else {
                return false;
            };
            let (pod, peer) = if pod_is_src {
                (ip.src, ip.dst)
            } else {
                (ip.dst, ip.src)
            };
            s.flow.pod[..4].copy_from_slice(&pod);
            s.flow.peer[..4].copy_from_slice(&peer);
            s.flow.proto = ip.proto;
            s.flow.family = 4;
            if ip.fragment() {
                return true;
            }
            (
                ETH_HLEN + ip.ihl,
                usize::from(ip.tot_len).saturating_sub(ip.ihl),
            )
        }
        Ok(ETH_P_IPV6) => {
            // Version, payload length, next header: the addresses are read in place.
            let Ok(h) = packet::load::<[u8; 8]>(ctx, ETH_HLEN) else {
                return false;
            };
            let payload = usize::from(u16::from_be_bytes([h[4], h[5]]));
            if h[0] >> 4 != 6 || ETH_HLEN + packet::v6::LEN + payload > ctx.len() as usize {
                return false;
            }
            let (pod_at, peer_at) = if pod_is_src { (8, 24) } else { (24, 8) };
            if !load16(ctx, ETH_HLEN + pod_at, &mut s.flow.pod)
                || !load16(ctx, ETH_HLEN + peer_at, &mut s.flow.peer)
            {
                return false;
            }
            s.flow.proto = h[6];
            s.flow.family = 6;
            let l4 = ETH_HLEN + packet::v6::LEN;
            if h[6] == IPPROTO_ICMPV6
                && payload >= 8
                && ctx
                    .load::<u8>(l4)
                    .is_ok_and(|t| matches!(t, 130..=137 | 143))
            {
                s.flags = PS_EXEMPT;
                return true;
            }
            (l4, payload)
        }
        _ => return false,
    };
    // Nearly every packet: TCP or UDP right after a fixed-size IP header (no IPv4 options, no
    // IPv6 extension headers), read directly at a constant offset; the rest through the
    // helpers.
    let direct = match (s.flow.family, l4) {
        (4, x) if x == ETH_HLEN + 20 => {
            transport_at::<{ ETH_HLEN + 20 }>(ctx, l4_len, s.flow.proto)
        }
        (6, x) if x == ETH_HLEN + packet::v6::LEN => {
            transport_at::<{ ETH_HLEN + packet::v6::LEN }>(ctx, l4_len, s.flow.proto)
        }
        _ => None,
    };
    let (sport, dport, tcp) = match direct {
        Some(t) => t,
        None => {
            let Some((sport, dport)) = ports(ctx, l4, l4_len, s.flow.proto) else {
                return true;
            };
            let tcp = if s.flow.proto == IPPROTO_TCP && l4_len >= 14 {
                ctx.load::<u8>(l4 + 13).unwrap_or(0)
            } else {
                0
            };
            (sport, dport, tcp)
        }
    };
    (s.flow.pod_port, s.flow.peer_port) = if pod_is_src {
        (sport, dport)
    } else {
        (dport, sport)
    };
    s.flags = PS_KEYED | tcp_bits(tcp);
    true
}

/// The `PS_*` bits of a TCP header's flags byte (0 for other protocols).
#[inline(always)]
fn tcp_bits(f: u8) -> u32 {
    let mut bits = 0;
    if f & (TCP_SYN | TCP_ACK) == TCP_SYN {
        bits |= PS_SYN;
    }
    if f & TCP_FIN != 0 {
        bits |= PS_FIN;
    }
    if f & TCP_RST != 0 {
        bits |= PS_RST;
    }
    bits
}

/// The ports (network order) and TCP flags (0 for UDP) of a TCP or UDP header at `AT` bytes
/// into the frame (`l4_len` bytes of IP payload), read directly; `None` for other protocols
/// or a short header (the helpers' path then decides).
#[inline(always)]
fn transport_at<const AT: usize>(
    ctx: &TcContext,
    l4_len: usize,
    proto: u8,
) -> Option<(u16, u16, u8)> {
    match proto {
        IPPROTO_TCP if l4_len >= 14 => {
            let h = packet::load::<[u8; 14]>(ctx, AT).ok()?;
            Some((
                u16::from_ne_bytes([h[0], h[1]]),
                u16::from_ne_bytes([h[2], h[3]]),
                h[13],
            ))
        }
        IPPROTO_UDP if l4_len >= 8 => {
            let h = packet::load::<[u8; 4]>(ctx, AT).ok()?;
            Some((
                u16::from_ne_bytes([h[0], h[1]]),
                u16::from_ne_bytes([h[2], h[3]]),
                0,
            ))
        }
        _ => None,
    }
}

/// Source and destination ports (network order) of TCP, UDP and SCTP, or an ICMP echo's
/// identifier as both; `None` for anything else.
#[inline(always)]
fn ports(ctx: &TcContext, l4: usize, l4_len: usize, proto: u8) -> Option<(u16, u16)> {
    if proto == IPPROTO_SCTP {
        if l4_len < 4 {
            return None;
        }
        let p: [u8; 4] = ctx.load(l4).ok()?;
        return Some((
            u16::from_ne_bytes([p[0], p[1]]),
            u16::from_ne_bytes([p[2], p[3]]),
        ));
    }
    packet::ports(ctx, l4, l4_len, proto)
}

/// The identity of the address in `s.addr` (of family `s.flow.family`): its longest match in
/// the identity tries, [`POLICY_WORLD`] under none.
#[inline(always)]
fn identity_of_addr(s: &mut PolicyScratch) -> u32 {
    if s.flow.family == 4 {
        s.addr_len = 32;
        // SAFETY: `addr_len` then `addr` are laid out as an LPM key (a length, then the
        // address; the IPv4 trie reads its first 4 bytes).
        let k = unsafe { &*(&s.addr_len as *const u32 as *const Key<[u8; 4]>) };
        CALIX_POL_IDS_V4.get(k).copied()
    } else {
        s.addr_len = 128;
        // SAFETY: as above.
        let k = unsafe { &*(&s.addr_len as *const u32 as *const Key<[u8; 16]>) };
        CALIX_POL_IDS_V6.get(k).copied()
    }
    .unwrap_or(POLICY_WORLD)
}

/// Whether the rules of the endpoint in `slot` allow, in `dir`, the flow in `s`.
#[inline(always)]
fn rules_allow(slot: u32, st: &PolicyState, dir: u8, s: &mut PolicyScratch) -> bool {
    rules_verdict(slot, st, dir, s) == ALLOW
}

/// The rules' verdict on the flow in `s`, in `dir`, for the endpoint in `slot`: [`DEFER`]
/// for egress to a Service address.
#[inline(always)]
fn rules_verdict(slot: u32, st: &PolicyState, dir: u8, s: &mut PolicyScratch) -> u8 {
    if !isolated_in(st, dir) {
        return ALLOW;
    }
    // A SYN between two endpoints of this node: the rules that let the last one to the same
    // port through, while both keep their generations.
    if let Some(rule) = syns::recall(slot, st, dir, s) {
        hit(s, slot, rule);
        return ALLOW;
    }
    // The peer's identity: longest match on its address.
    s.addr = s.flow.peer;
    let identity = identity_of_addr(s);
    s.identity = identity;
    if identity == POLICY_SERVICE && dir == POL_DIR_EGRESS {
        return DEFER;
    }
    let keyed = s.flags & PS_KEYED != 0;
    let ported = keyed && matches!(s.flow.proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP);
    let port = match (ported, dir == POL_DIR_INGRESS) {
        (false, _) => [0; 2],
        (true, true) => s.flow.pod_port.to_ne_bytes(),
        (true, false) => s.flow.peer_port.to_ne_bytes(),
    };
    s.rule_len = POLICY_KEY_BITS;
    s.rule = PolicyKey::new(slot, dir, identity, s.flow.proto, port);
    // SAFETY: `rule_len` then `rule` are laid out as the entry trie's key.
    let k = unsafe { &*(&s.rule_len as *const u32 as *const Key<PolicyKey>) };
    let rule = match CALIX_POLICY.get(k) {
        Some(rule) => *rule,
        None => {
            s.rule.identity = POLICY_ANY_PEER.to_be_bytes();
            match CALIX_POLICY.get(k) {
                Some(rule) => *rule,
                None => {
                    s.why = u32::from(DENIED_NO_RULE);
                    return DENY;
                }
            }
        }
    };
    hit(s, slot, rule);
    syns::note(slot, st, dir, s, rule);
    ALLOW
}

/// Whether the endpoint of state `st` is isolated in `dir`.
#[inline(always)]
fn isolated_in(st: &PolicyState, dir: u8) -> bool {
    let bit = if dir == POL_DIR_INGRESS {
        POL_ISOLATED_INGRESS
    } else {
        POL_ISOLATED_EGRESS
    };
    st.flags & bit != 0
}

/// Sends the packet a verdict just denied (its flow in this CPU's scratch) to the drop
/// events, within the rate limit; what the limit leaves out is counted in the next event
/// sent. Called by the program itself, after the verdict returned: the verdict's frame and
/// this one's do not fit the 512 bytes of stack together with the fast path's.
#[inline(never)]
pub fn report_denied(slot: u32, dir: u8) {
    const COST_NS: u64 = 1_000_000_000 / POLICY_EVENTS_PER_SEC;
    const MAX_NS: u64 = COST_NS * POLICY_EVENTS_BURST;
    let (Some(s), Some(b)) = (scratch(), CALIX_POL_EVBUDGET.get_ptr_mut(0)) else {
        return;
    };
    // SAFETY: this CPU's value, from a successful lookup (see `scratch`).
    let b = unsafe { &mut *b };
    // SAFETY: a plain helper call.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let credit = b
        .credit_ns
        .saturating_add(now.wrapping_sub(b.last_ns))
        .min(MAX_NS);
    b.last_ns = now;
    if credit < COST_NS {
        b.credit_ns = credit;
        b.suppressed = b.suppressed.wrapping_add(1);
        return;
    }
    b.event.ktime_ns = now;
    // SAFETY: both flows are plain data at 8-byte aligned offsets of 8-byte aligned map
    // values (the scratch's first field; the event's after its `u64`).
    unsafe { crate::packet::copy_words(&mut b.event.flow, &s.flow) };
    b.event.slot = slot;
    b.event.identity = s.identity;
    b.event.suppressed = b.suppressed.min(u64::from(u32::MAX)) as u32;
    b.event.dir = dir;
    b.event.why = s.why as u8;
    if CALIX_POL_EVENTS.output(&b.event, 0).is_err() {
        // Nobody reads (or not fast enough): nothing waits for it.
        b.credit_ns = credit;
        b.suppressed = b.suppressed.wrapping_add(1);
        return;
    }
    b.credit_ns = credit - COST_NS;
    b.suppressed = 0;
}

/// The verdict of the endpoint in `slot` (state `st`) on the packet in `s` in `dir`
/// ([`POL_DIR_INGRESS`]: to the pod): [`ALLOW`], [`DENY`], or [`DEFER`] (egress to a Service
/// address: every packet of such a flow waits for the DNAT; the flow is remembered so that
/// its replies, from the Service address, come back in).
#[inline(always)]
fn allows(slot: u32, st: &PolicyState, dir: u8, s: &mut PolicyScratch) -> u8 {
    if s.flags & PS_EXEMPT != 0 {
        return ALLOW;
    }
    if s.flags & PS_KEYED == 0 {
        return rules_verdict(slot, st, dir, s);
    }
    // SAFETY: a plain helper call.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let syn = s.flags & PS_SYN != 0;
    if !syn {
        let found = match flow_get(s) {
            Some(f) => Some(f),
            // Every TCP packet between the two passes both ways: the connection's entry is
            // the side's that opened it (`PS_SENT`), and this side needs none.
            None if s.flags & PS_PAIR != 0 => return ALLOW,
            None if s.flow.proto == IPPROTO_TCP => adopt(s, st),
            None => None,
        };
        if let Some(f) = found {
            // SAFETY: a pointer from a successful lookup, valid until the program returns;
            // racing writers store the same kind of values (benign).
            let f = unsafe { &mut *f };
            let tcp = s.flow.proto == IPPROTO_TCP;
            let ttl = if tcp {
                POLICY_FLOW_TCP_NS
            } else {
                POLICY_FLOW_OTHER_NS
            };
            let fresh = now.wrapping_sub(f.last_seen_ns) <= ttl;
            // An idle TCP flow is still the connection whose SYN wrote it (a new one's SYN
            // writes its own): checked again, against the direction that opened it. (The
            // pair cache passes a connection's segments without refreshing its entries.)
            if fresh || (tcp && f.flags & PF_SERVICE == 0) {
                if f.flags & PF_SERVICE != 0 {
                    if now.wrapping_sub(f.last_seen_ns) > REFRESH_NS {
                        f.last_seen_ns = now;
                    }
                    return if dir == POL_DIR_EGRESS { DEFER } else { ALLOW };
                }
                if f.generation != st.generation || !fresh {
                    let opened = if f.flags & PF_FROM_POD != 0 {
                        POL_DIR_EGRESS
                    } else {
                        POL_DIR_INGRESS
                    };
                    // Kept flows are kept until they go idle.
                    let allowed = (fresh
                        && st.flags & POL_KEEP_ESTABLISHED != 0
                        && f.flags & PF_REVOKED == 0)
                        || rules_allow(slot, st, opened, s);
                    f.generation = st.generation;
                    if allowed {
                        clear_flags(f, PF_REVOKED);
                    } else {
                        set_flags(f, PF_REVOKED);
                    }
                }
                if now.wrapping_sub(f.last_seen_ns) > REFRESH_NS {
                    f.last_seen_ns = now;
                }
                // A revoked flow stays remembered as such while its packets keep coming: the
                // mid-connection rule below must not let it in again by the other direction.
                if f.flags & PF_REVOKED != 0 {
                    s.why = u32::from(DENIED_REVOKED);
                    return DENY;
                }
                // The receiver would find no entry of its own and pass the segment on the pair.
                let both = dir == POL_DIR_EGRESS
                    && s.flags & PS_PAIR != 0
                    && f.flags & (PF_PAIRED | PF_ADOPTED) == PF_PAIRED;
                if closed(f, dir, s.flags) {
                    flow_remove(s);
                }
                return if both { ALLOW_BOTH } else { ALLOW };
            }
        }
    }
    let other = if dir == POL_DIR_INGRESS {
        POL_DIR_EGRESS
    } else {
        POL_DIR_INGRESS
    };
    let flags = match rules_verdict(slot, st, dir, s) {
        DEFER => {
            remember(s, st, PF_FROM_POD | PF_SERVICE, now);
            return DEFER;
        }
        // The receiver keeps no entry of a new connection of a passed pair (`PS_SENT`).
        ALLOW if dir == POL_DIR_EGRESS && syn && s.flags & PS_PAIR != 0 => PF_FROM_POD | PF_PAIRED,
        ALLOW if dir == POL_DIR_EGRESS => PF_FROM_POD,
        ALLOW => PF_TO_POD,
        // Mid-connection: a segment of a connection the other side opened.
        _ if s.flow.proto == IPPROTO_TCP && !syn && rules_allow(slot, st, other, s) => {
            if other == POL_DIR_EGRESS {
                PF_FROM_POD
            } else {
                PF_TO_POD
            }
        }
        _ => {
            s.why = u32::from(DENIED_NO_RULE);
            return DENY;
        }
    };
    // A RST ends whatever it belongs to: nothing to remember. Nor does the receiver of a
    // new connection between two endpoints whose pair passes every TCP packet, when the
    // sender's verdict just remembered it: one entry per connection, the opener's; and the
    // opener's only when the pair's record of openers cannot say who opened it.
    let settled = if flags & PF_PAIRED != 0 {
        syns::settles_receiver(slot, st, s)
    } else {
        syns::UNSETTLED
    };
    let both = settled != syns::UNSETTLED;
    if s.flags & PS_RST == 0 && s.flags & (PS_SENT | PS_PAIR) != PS_SENT | PS_PAIR {
        if flags & PF_PAIRED != 0 && s.flags & PS_RECORD != 0 {
            // The record holds the port already (the SYN memo says so): nothing to note.
            if settled == syns::SETTLED_RECORDED {
                return ALLOW_BOTH;
            }
            // The opener goes into the pair's record instead, when it can (`note_opener`,
            // called by the program: this frame has no room for it); the entry is ready in
            // the scratch for when it cannot.
            s.value.last_seen_ns = now;
            s.value.generation = st.generation;
            s.value.flags = flags;
            return if both { ALLOW_NOTE } else { ALLOW_NOTE_READ };
        }
        remember(s, st, flags, now);
    }
    if both {
        return ALLOW_BOTH;
    }
    ALLOW
}

/// The verdict in `dir` on the frame in `skb` for the endpoint in `slot`; `extra`: `PS_*`
/// bits the caller knows of the packet ([`PS_PAIR`]).
#[inline(always)]
fn verdict(skb: *mut __sk_buff, slot: u32, dir: u8, extra: u32) -> u8 {
    let ctx = TcContext::new(skb);
    let Some(st) = state(slot) else {
        return ALLOW;
    };
    let Some(s) = scratch() else {
        return DENY;
    };
    s.identity = POLICY_WORLD;
    s.why = 0;
    if !read(&ctx, s, dir == POL_DIR_EGRESS) {
        s.why = u32::from(DENIED_UNREADABLE);
        return DENY;
    }
    s.flags |= extra;
    match allows(slot, &st, dir, s) {
        ALLOW => ALLOW_READ,
        v => v,
    }
}

/// The egress verdict on the frame in `skb`, sent by the pod in `slot` (its source already
/// checked): [`ALLOW`] when the endpoint is not isolated for egress, [`ALLOW_READ`] when its
/// policy lets the frame out ([`ALLOW_BOTH`] when the receiver's verdict has nothing to add);
/// [`DEFER`] for a frame to a Service address (judged after the DNAT: [`after_nat`]); else
/// [`DENY`]. A frame whose header cannot be read is denied. `extra`: as in `verdict`.
#[inline(never)]
pub fn egress(skb: *mut __sk_buff, slot: u32, extra: u32) -> u8 {
    verdict(skb, slot, POL_DIR_EGRESS, extra)
}

/// The egress verdict, after the host stack's DNAT, on a frame the pod in `slot` sent to a
/// Service address: true when its policy lets it out to where it goes now. Still a Service
/// address (nothing translated it): denied.
#[inline(never)]
pub fn after_nat(skb: *mut __sk_buff, slot: u32) -> bool {
    passes(verdict(skb, slot, POL_DIR_EGRESS, 0))
}

/// The ingress verdict on the frame in `skb` for the endpoint in `slot`: true when it is not
/// isolated for ingress, or its policy lets the frame in. A frame that is neither IPv4 nor
/// IPv6, or whose header cannot be read, is denied to an isolated endpoint.
#[inline(never)]
pub fn ingress(skb: *mut __sk_buff, slot: u32, extra: u32) -> bool {
    passes(verdict(skb, slot, POL_DIR_INGRESS, extra))
}

/// As [`ingress`], for a packet whose sender's egress verdict just returned [`ALLOW_READ`]
/// (same node): its flow is taken from the scratch, seen from the receiver, instead of read
/// from the packet again. `extra`: as in `verdict`, in place of the sender's.
#[inline(never)]
pub fn ingress_of_sent(slot: u32, extra: u32) -> bool {
    let Some(st) = state(slot) else {
        return true;
    };
    let Some(s) = scratch() else {
        return false;
    };
    swap_ends(s);
    s.flags = (s.flags & (PS_KEYED | PS_SYN | PS_EXEMPT | PS_FIN | PS_RST)) | extra | PS_SENT;
    s.identity = POLICY_WORLD;
    s.why = 0;
    allows(slot, &st, POL_DIR_INGRESS, s) == ALLOW
}

/// Remembers the flow of a frame the node itself sends to the endpoint in `slot` (always
/// allowed, so that probes work): the pod's replies then pass its egress policy.
#[inline(never)]
pub fn from_node(skb: *mut __sk_buff, slot: u32) {
    let ctx = TcContext::new(skb);
    let (Some(st), Some(s)) = (state(slot), scratch()) else {
        return;
    };
    if !read(&ctx, s, false) || s.flags & PS_KEYED == 0 {
        return;
    }
    // SAFETY: a plain helper call.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    if let Some(old) = flow_get(s) {
        // SAFETY: as in `allows`.
        let old = unsafe { &mut *old };
        if old.flags & PF_REVOKED == 0 && closed(old, POL_DIR_INGRESS, s.flags) {
            flow_remove(s);
            return;
        }
        if old.generation == st.generation && now.wrapping_sub(old.last_seen_ns) <= REFRESH_NS {
            return;
        }
    }
    remember(s, &st, PF_TO_POD, now);
}
