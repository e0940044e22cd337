//! Who opened a passed pair's connections (`calix_common::POLICY_OPENERS_MAP`). Between two
//! endpoints of this node whose pair passes every TCP packet, a connection keeps no flow
//! entry: its SYN notes here the port it went to, on the side that opened it, and nothing
//! else (its segments and FINs pass on the pair cache). Only a change asks who opened it: a
//! segment that then finds no entry at its end reads the record, and the opener's entry is
//! written as if its SYN had written it, checked against the direction that opened it.
//!
//! A record is shared by every CPU: a port goes into its word with a compare-and-exchange
//! (BPF cpu v3), so two SYNs on two CPUs never lose each other's port. When the map or the
//! record is full, the SYN writes its entry as before: slower, never inexact. A stack never
//! picks a port it listens on as a connection's ephemeral one, so a real connection is
//! explained one way only; a segment explained both ways, or neither, meets the rules as a
//! flow the LRU let go does.

use core::intrinsics::{atomic_cxchg, AtomicOrdering};

use aya_ebpf::{bindings::__sk_buff, programs::TcContext};
use calix_common::{
    policy_opener_word, policy_pair_slots, PolicyOpeners, PolicyScratch, PF_FROM_POD, PF_PAIRED,
    PF_TO_POD, PS_KEYED, PS_SYN,
};

use super::flows::{flow_get, flow_insert, swap_ends};
use super::{read, scratch, state, IPPROTO_TCP};
use crate::maps::CALIX_POL_OPENERS;

const BPF_NOEXIST: u64 = 1;

// A new record is built in the scratch's `addr` (free but for the identity lookup and the
// IPv4 flow key, both built again before each use).
const _: () = assert!(
    core::mem::size_of::<PolicyOpeners>() == 16
        && core::mem::align_of::<PolicyOpeners>() == 4
        && core::mem::offset_of!(PolicyScratch, addr) % 4 == 0
);

/// The record's key in the scratch's `why` and the SYN's or segment's ports in its `addr`,
/// each read back from there after a helper call: the verdict's frame has no room to keep
/// them (`from_pod`'s and the verdict's take the 512 bytes). `why` is only read after a
/// denial, which writes it first.
#[inline(always)]
fn prepare(s: &mut PolicyScratch, slot: u32, peer: u32, first: u32, second: u32) {
    s.why = if slot < peer {
        policy_pair_slots(slot, peer)
    } else {
        policy_pair_slots(peer, slot)
    };
    let v = record(s);
    // SAFETY: 16 plain bytes, aligned for it (checked above).
    unsafe { (*v).ports = [first, second, 0, 0] };
}

/// The scratch's `addr` as a record.
#[inline(always)]
fn record(s: &mut PolicyScratch) -> *mut PolicyOpeners {
    core::ptr::addr_of_mut!(s.addr) as *mut PolicyOpeners
}

/// The record's key (see [`prepare`]).
#[inline(always)]
fn key(s: &PolicyScratch) -> &'static u32 {
    // SAFETY: the scratch is a per-CPU map value, valid until the program returns.
    unsafe { &*core::ptr::addr_of!(s.why) }
}

/// The ports [`prepare`] left in the scratch, read again.
#[inline(always)]
fn prepared(s: &mut PolicyScratch, i: usize) -> u32 {
    let v = record(s);
    // SAFETY: as in `prepare`.
    unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*v).ports[i])) }
}

/// Word `i` (0 or 1) of the record at `rec`: two ports.
#[inline(always)]
fn word(rec: *mut PolicyOpeners, i: usize) -> *mut u64 {
    // A map value is 8-byte aligned: so are its words.
    rec.cast::<u64>().wrapping_add(i)
}

/// Whether the endpoints in `slot` and `peer` have a record.
#[inline(always)]
fn exists(slot: u32, peer: u32) -> bool {
    let k = if slot < peer {
        policy_pair_slots(slot, peer)
    } else {
        policy_pair_slots(peer, slot)
    };
    CALIX_POL_OPENERS.get_ptr(&k).is_some()
}

/// Whether 64-bit word `w` holds port `p` in either half.
#[inline(always)]
fn holds(w: u64, p: u32) -> bool {
    w as u32 == p || (w >> 32) as u32 == p
}

/// Notes that the endpoint in `slot` opened the connection of the SYN in `s` (seen from it)
/// to the endpoint in `peer`; false when the record cannot hold it (the caller writes the
/// flow's entry instead). Uses the scratch's `why` and `addr`.
#[inline(always)]
fn note(s: &mut PolicyScratch, slot: u32, peer: u32) -> bool {
    if slot == peer {
        return false;
    }
    let want = policy_opener_word(slot < peer, s.flow.family, s.flow.peer_port);
    // A new record: the SYN's port first.
    prepare(s, slot, peer, want, 0);
    let rec = match CALIX_POL_OPENERS.get_ptr_mut(key(s)) {
        Some(r) => r,
        None => {
            // SAFETY: as in `prepare`.
            let new = unsafe { &*record(s) };
            // Two CPUs may both try: one insert wins, the other adds its port below.
            if CALIX_POL_OPENERS.insert(key(s), new, BPF_NOEXIST).is_ok() {
                return true;
            }
            match CALIX_POL_OPENERS.get_ptr_mut(key(s)) {
                Some(r) => r,
                None => return false,
            }
        }
    };
    let want = prepared(s, 0);
    for i in 0..2 {
        // A map value from a successful lookup, valid until the program returns; an aligned
        // u64 of it, written only by the exchange below.
        let p = word(rec, i);
        // SAFETY: as above.
        let w = unsafe { core::ptr::read_volatile(p) };
        if holds(w, want) {
            return true;
        }
        let add = if w as u32 == 0 {
            u64::from(want)
        } else if w >> 32 == 0 {
            u64::from(want) << 32
        } else {
            continue;
        };
        // SAFETY: as above; BPF's compare-and-exchange (cpu v3).
        let (now, _) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
                p,
                w,
                w | add,
            )
        };
        // Another CPU's port went in first: one more look at the word, then the next.
        if now == w || holds(now, want) {
            return true;
        }
    }
    false
}

/// Who opened the TCP connection of the segment in `s` (seen from the endpoint in `slot`)
/// with the endpoint in `peer`, as the record says: `Some(true)` the endpoint, `Some(false)`
/// the peer; `None` when the record explains it neither way or both. Uses the scratch's `why`
/// and `addr`.
#[inline(always)]
fn opened_by_pod(s: &mut PolicyScratch, slot: u32, peer: u32) -> Option<bool> {
    if slot == peer {
        return None;
    }
    let lower = slot < peer;
    let by_pod = policy_opener_word(lower, s.flow.family, s.flow.peer_port);
    let by_peer = policy_opener_word(!lower, s.flow.family, s.flow.pod_port);
    prepare(s, slot, peer, by_pod, by_peer);
    let rec = CALIX_POL_OPENERS.get_ptr_mut(key(s))?;
    let (by_pod, by_peer) = (prepared(s, 0), prepared(s, 1));
    let (mut pod, mut other) = (false, false);
    for i in 0..2 {
        // SAFETY: as in `note`.
        let w = unsafe { core::ptr::read_volatile(word(rec, i)) };
        pod |= holds(w, by_pod);
        other |= holds(w, by_peer);
    }
    match (pod, other) {
        (true, false) => Some(true),
        (false, true) => Some(false),
        _ => None,
    }
}

/// Notes in the pair's record that the endpoint in `slot` opened the connection whose SYN its
/// egress verdict just let through to the endpoint in `peer` ([`super::ALLOW_NOTE`]: the SYN's flow
/// and its entry are in this CPU's scratch); when the record cannot hold it, the entry is
/// written instead. A function of its own: the verdict's frame has no room for it.
#[inline(never)]
pub fn note_opener(slot: u32, peer: u32) {
    let Some(s) = scratch() else {
        return;
    };
    if note(s, slot, peer) {
        // The next SYN between the two to this port need not look.
        super::syns::note_recorded(slot, peer, s);
    } else {
        // A full LRU table evicts its oldest flow; a flow that is gone is checked again.
        flow_insert(s);
    }
}

/// Before the verdicts on a TCP segment the endpoint in `slot` sends to the endpoint in `peer`
/// of this node while their pair does not pass every TCP packet (stale after a change, not yet
/// learnt on this CPU, or learnt since as one whose rules name ports): when the pair has a
/// record of openers, neither end has an entry for the segment's connection and the record
/// says who opened it, the sender's entry as its opener's SYN would have written it, as of
/// long ago, so that the sender's verdict checks it against the direction that opened it, and
/// the receiver's verdict adopts it (`PF_PAIRED`), also when the sender is no longer isolated
/// and gives no verdict. A function of its own, called by the program: the verdict's frame
/// has no room for it. A pair with no record pays one lookup.
#[inline(never)]
pub fn recall_opener(skb: *mut __sk_buff, slot: u32, peer: u32) {
    if !exists(slot, peer) {
        return;
    }
    let ctx = TcContext::new(skb);
    let Some(s) = scratch() else {
        return;
    };
    if !read(&ctx, s, true)
        || s.flags & (PS_KEYED | PS_SYN) != PS_KEYED
        || s.flow.proto != IPPROTO_TCP
        || flow_get(s).is_some()
    {
        return;
    }
    swap_ends(s);
    let other = flow_get(s).is_some();
    swap_ends(s);
    if other {
        return;
    }
    let Some(by_pod) = opened_by_pod(s, slot, peer) else {
        return;
    };
    s.value.last_seen_ns = 0;
    s.value.generation = state(slot).map_or(0, |st| st.generation.wrapping_add(1));
    s.value.flags = PF_PAIRED | if by_pod { PF_FROM_POD } else { PF_TO_POD };
    flow_insert(s);
}
