//! The pair cache (`calix_common::POLICY_PAIRS_MAP`): for two endpoints of this node, whether
//! both endpoints' rules allow every TCP packet between them, both ways. When they do, an
//! established connection's segments between them (no SYN, FIN or RST) need no flow lookup:
//! whatever flow they belong to, its packets pass either way, as its remembered entry would
//! let them (a revoked flow needs a change that refuses one of those directions, and a change
//! makes the entry stale). A connection's first segment still goes through the flows (the
//! opener's entry says who opened it when a later change asks; the other side writes none and
//! adopts the opener's then), so do its FINs and RSTs (they end the entry: the opener's own
//! FIN at the opener's verdict alone, the other side having no entry to end), and every packet
//! once either endpoint's generation moves on.
//!
//! Two endpoints either of which keeps established flows after a change
//! (`POL_KEEP_ESTABLISHED`) are never passed: their connections' entries are refreshed by
//! every packet, so that a change keeps exactly the connections that are not idle.
//!
//! Each CPU has its own cache, learnt by the first packet between the two that passes both
//! verdicts on that CPU: no reader meets a half-written entry (a program runs to completion
//! on its CPU).

use core::ptr::{addr_of, addr_of_mut};

use aya_ebpf::{bindings::__sk_buff, maps::lpm_trie::Key, programs::TcContext};
use calix_common::{
    policy_pair_index, policy_pair_slots, PolicyKey, PolicyPair, PolicyScratch, PolicyState,
    PAIR_RECORDED, POLICY_ANY_PEER, POLICY_KEY_PROTO_BITS, POL_DIR_EGRESS, POL_DIR_INGRESS,
    POL_KEEP_ESTABLISHED, PS_KEYED,
};

use super::{
    identity_of_addr, isolated_in, read, scratch, IPPROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN,
};
use crate::maps::{CALIX_POLICY, CALIX_POL_PAIRS, CALIX_POL_STATE};
use crate::packet;

/// What the pair cache says of a TCP packet from one endpoint of this node to another.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Pair {
    /// Not asked: the packet is not TCP to a pod of this node.
    Unasked,
    /// Neither endpoint is isolated: no verdict to give.
    Open,
    /// Not known at the endpoints' generations: learnt once a packet passes both verdicts.
    Stale,
    /// Known: not every TCP packet between them passes; the flows decide.
    Checked,
    /// Every TCP packet between them passes both endpoints' rules, both ways.
    Allowed,
    /// As [`Pair::Allowed`], and their connections keep no flow entry
    /// (`calix_common::PAIR_RECORDED`).
    Recorded,
}

impl Pair {
    /// Whether every TCP packet between the two passes both endpoints' rules, both ways.
    #[inline(always)]
    pub fn passes(self) -> bool {
        matches!(self, Pair::Allowed | Pair::Recorded)
    }
}

/// The entry of `src` → `dst` when it is of their current generations; else what to do.
#[inline(always)]
fn entry(src: u32, dst: u32) -> Result<&'static PolicyPair, Pair> {
    let (Some(a), Some(b)) = (CALIX_POL_STATE.get(src), CALIX_POL_STATE.get(dst)) else {
        return Err(Pair::Open);
    };
    if a.flags | b.flags == 0 {
        return Err(Pair::Open);
    }
    let Some(p) = CALIX_POL_PAIRS.get_ptr(policy_pair_index(src, dst)) else {
        return Err(Pair::Stale);
    };
    // SAFETY: this CPU's value, from a successful lookup, valid until the program returns;
    // only this CPU writes it, never while this program runs.
    let p = unsafe { &*p };
    if p.slots != policy_pair_slots(src, dst)
        || p.generation != a.generation
        || p.peer_generation != b.generation
    {
        return Err(Pair::Stale);
    }
    Ok(p)
}

/// The entry's verdict, its address found equal to the packet's (`same`).
#[inline(always)]
fn verdict(p: &PolicyPair, same: bool, family: u32) -> Pair {
    match p.family {
        _ if !same => Pair::Stale,
        0 => Pair::Checked,
        f if f == family => Pair::Allowed,
        f if f == family | PAIR_RECORDED => Pair::Recorded,
        _ => Pair::Stale,
    }
}

/// The entry's address as four words.
#[inline(always)]
fn words(p: &PolicyPair) -> [u32; 4] {
    let w = |i: usize| u32::from_ne_bytes([p.peer[i], p.peer[i + 1], p.peer[i + 2], p.peer[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

/// What the cache says of a TCP packet from the endpoint in `src` to the one in `dst` at
/// IPv4 address `dst_addr`.
#[inline(always)]
pub fn v4(src: u32, dst: u32, dst_addr: &[u8; 4]) -> Pair {
    match entry(src, dst) {
        Ok(p) => {
            let w = words(p);
            let same = w[0] == u32::from_ne_bytes(*dst_addr) && w[1] | w[2] | w[3] == 0;
            verdict(p, same, 4)
        }
        Err(v) => v,
    }
}

/// As [`v4`], to IPv6 address `dst_addr`.
#[inline(always)]
pub fn v6(src: u32, dst: u32, dst_addr: &[u8; 16]) -> Pair {
    match entry(src, dst) {
        Ok(p) => {
            let w = words(p);
            let a = |i: usize| {
                u32::from_ne_bytes([
                    dst_addr[i],
                    dst_addr[i + 1],
                    dst_addr[i + 2],
                    dst_addr[i + 3],
                ])
            };
            let same = w[0] == a(0) && w[1] == a(4) && w[2] == a(8) && w[3] == a(12);
            verdict(p, same, 6)
        }
        Err(v) => v,
    }
}

/// Whether the TCP segment whose header starts `AT` bytes into the frame (`l4_len` bytes of
/// IP payload) may skip the flows, between a pair that passes every TCP packet (`pair`): it is
/// neither a new connection's SYN nor a RST, nor a FIN unless the pair's connections keep no
/// entry for it to end ([`Pair::Recorded`]: their openers are in the pair's record; an entry
/// written anyway, when the record was full or after a change, goes when idle or to the LRU).
#[inline(always)]
pub fn plain_segment<const AT: usize>(ctx: &TcContext, l4_len: usize, pair: Pair) -> bool {
    if !pair.passes() || l4_len < 14 {
        return false;
    }
    let ends = if pair == Pair::Recorded {
        TCP_RST
    } else {
        TCP_RST | TCP_FIN
    };
    match packet::load::<u8>(ctx, AT + 13) {
        Ok(f) => f & ends == 0 && f & (TCP_SYN | TCP_ACK) != TCP_SYN,
        Err(_) => false,
    }
}

/// Whether the rules of the endpoint in `slot` (state `st`) allow every TCP packet in `dir`
/// to or from a peer of `identity`: an entry for all its TCP ports or all its protocols, or
/// one for any peer.
#[inline(always)]
fn all_tcp(s: &mut PolicyScratch, slot: u32, st: &PolicyState, dir: u8, identity: u32) -> bool {
    if !isolated_in(st, dir) {
        return true;
    }
    // A key cut after the protocol: only entries that leave the port open (or the protocol
    // too) match it.
    s.rule_len = POLICY_KEY_PROTO_BITS;
    s.rule = PolicyKey::new(slot, dir, identity, IPPROTO_TCP, [0; 2]);
    // SAFETY: `rule_len` then `rule` are laid out as the entry trie's key.
    let k = unsafe { &*(&s.rule_len as *const u32 as *const Key<PolicyKey>) };
    if CALIX_POLICY.get(k).is_some() {
        return true;
    }
    s.rule.identity = POLICY_ANY_PEER.to_be_bytes();
    CALIX_POLICY.get(k).is_some()
}

/// Writes this CPU's entry of `slot` → `peer_slot` (states `st`, `peer_st`), the peer's
/// address in `addr` (`family`: 4 or 6 when every TCP packet passes, else 0).
#[inline(always)]
fn write(
    slot: u32,
    st: &PolicyState,
    peer_slot: u32,
    peer_st: &PolicyState,
    addr: &[u8; 16],
    family: u32,
) {
    let Some(p) = CALIX_POL_PAIRS.get_ptr_mut(policy_pair_index(slot, peer_slot)) else {
        return;
    };
    // SAFETY: this CPU's value, from a successful lookup; nothing else uses it meanwhile.
    let p = unsafe { &mut *p };
    // SAFETY: both are 16 plain bytes, 4-byte aligned (a field of a map value after nothing;
    // a field of the scratch at a 4-byte aligned offset).
    unsafe { packet::copy_words(&mut p.peer, addr) };
    p.slots = policy_pair_slots(slot, peer_slot);
    p.generation = st.generation;
    p.peer_generation = peer_st.generation;
    p.family = family;
}

/// Learns the pair of the endpoint in `src` and the one in `dst`, from the TCP packet in `skb`
/// that `src` sent to `dst` and that just passed both verdicts: both ways in this CPU's
/// cache. The endpoints' states are read first: a change meanwhile leaves the entries stale.
#[inline(never)]
pub fn learn(skb: *mut __sk_buff, src: u32, dst: u32) {
    let (Some(a), Some(b)) = (CALIX_POL_STATE.get(src), CALIX_POL_STATE.get(dst)) else {
        return;
    };
    let (a, b) = (*a, *b);
    let Some(s) = scratch() else {
        return;
    };
    let ctx = TcContext::new(skb);
    if !read(&ctx, s, true) || s.flags & PS_KEYED == 0 || s.flow.proto != IPPROTO_TCP {
        return;
    }
    // The flow as `src` sent it: the pod is `src`, the peer `dst`.
    // SAFETY (both): 16 plain bytes each, 4-byte aligned fields of the scratch.
    unsafe { packet::copy_words(addr_of_mut!(s.addr), addr_of!(s.flow.peer)) };
    let to = identity_of_addr(s);
    unsafe { packet::copy_words(addr_of_mut!(s.addr), addr_of!(s.flow.pod)) };
    let from = identity_of_addr(s);
    let all = all_tcp(s, src, &a, POL_DIR_EGRESS, to)
        && all_tcp(s, src, &a, POL_DIR_INGRESS, to)
        && all_tcp(s, dst, &b, POL_DIR_INGRESS, from)
        && all_tcp(s, dst, &b, POL_DIR_EGRESS, from);
    // Either keeping established flows: never passed. A kept connection is kept until it
    // goes idle, and only its entry, refreshed by its packets, says when: segments passed on
    // the pair would leave it as its SYN wrote it, idle to a change an hour later however busy.
    let keep = (a.flags | b.flags) & POL_KEEP_ESTABLISHED != 0;
    // Both isolated: every packet between them meets the sender's verdict, which keeps the
    // record; neither keeping established flows: the record is enough after a change.
    let recorded = a.flags != 0 && b.flags != 0;
    let family = match (all && !keep, recorded) {
        (false, _) => 0,
        (true, false) => u32::from(s.flow.family),
        (true, true) => u32::from(s.flow.family) | PAIR_RECORDED,
    };
    write(src, &a, dst, &b, &s.flow.peer, family);
    write(dst, &b, src, &a, &s.flow.pod, family);
}
