//! The scratch's flow key and the tables of remembered flows (`calix_common::policy`): IPv4
//! flows in `CALIX_POL_FLOWS_V4` under 16-byte keys, IPv6 flows in `CALIX_POL_FLOWS` under
//! the flow key itself, and what an entry goes through: written, closed, adopted by the other
//! end. Each copy here is of aligned words: the BPF target compiles copies of byte arrays to
//! one load and one store per byte, or to a call of `memset`.

use calix_common::{
    FlowKey, PolicyFlow, PolicyFlowKeyV4, PolicyScratch, PolicyState, PF_ADOPTED, PF_FIN_PEER,
    PF_FIN_POD, PF_FROM_POD, PF_PAIRED, PF_TO_POD, POL_DIR_EGRESS, PS_FIN, PS_PAIR, PS_RST,
};

use crate::{
    bits::FlagField,
    maps::{CALIX_POL_FLOWS, CALIX_POL_FLOWS_V4},
};

const BPF_ANY: u64 = 0;

/// [`PolicyFlow::flags`]: both ends' packets of a connection (its two FINs) may reach one
/// entry on two CPUs at once, so its bits are set and cleared atomically.
const PF_FLAGS: FlagField = FlagField::at(
    core::mem::offset_of!(PolicyFlow, flags),
    core::mem::size_of::<u32>(),
);
const _: () = assert!(core::mem::align_of::<PolicyFlow>() == 8);

/// Sets `bits` in the flags of the entry `f` (atomically), when one of them is missing.
#[inline(always)]
pub(super) fn set_flags(f: &mut PolicyFlow, bits: u32) {
    if f.flags & bits != bits {
        // SAFETY: `f` is a map value from a successful lookup (8-byte aligned: above).
        unsafe { PF_FLAGS.set(f as *mut PolicyFlow, u64::from(bits)) };
    }
}

/// Clears `bits` in the flags of the entry `f` (atomically), when one of them is set.
#[inline(always)]
pub(super) fn clear_flags(f: &mut PolicyFlow, bits: u32) {
    if f.flags & bits != 0 {
        // SAFETY: as in `set_flags`.
        unsafe { PF_FLAGS.clear(f as *mut PolicyFlow, u64::from(bits)) };
    }
}

/// Zeroes the scratch's flow key in five 8-byte stores: `s.flow = FlowKey::default()` compiles
/// to a call of the byte-wise `memset` (a BPF function of its own), ~25 ns a packet.
#[inline(always)]
pub(super) fn clear_flow(s: &mut PolicyScratch) {
    // The scratch is a map value (8-byte aligned) and the flow its first field.
    const _: () = assert!(core::mem::offset_of!(PolicyScratch, flow) == 0);
    // SAFETY: `s.flow` is plain data at the start of an 8-byte aligned map value (checked
    // above).
    unsafe { crate::packet::zero_words(&mut s.flow) }
}

/// The 16-byte key of `s.flow` when it is an IPv4 flow (`CALIX_POL_FLOWS_V4`), built in
/// `s.addr` (free but for the identity lookup of [`rules_verdict`], so built again before
/// each use): four aligned 4-byte copies. `None` for IPv6 (`CALIX_POL_FLOWS`, keyed by
/// `s.flow` itself).
#[inline(always)]
fn key_v4(s: &mut PolicyScratch) -> Option<*const PolicyFlowKeyV4> {
    use core::mem::{offset_of, size_of};
    const POD: usize = offset_of!(PolicyScratch, flow) + offset_of!(FlowKey, pod);
    const PEER: usize = offset_of!(PolicyScratch, flow) + offset_of!(FlowKey, peer);
    const PORTS: usize = offset_of!(PolicyScratch, flow) + offset_of!(FlowKey, pod_port);
    const AT: usize = offset_of!(PolicyScratch, addr);
    // The key: the pod's address, the peer's, both ports (as in `FlowKey`), the protocol and
    // three zeroes; each part a 4-byte aligned word of the 8-byte aligned scratch.
    const _: () = assert!(
        size_of::<PolicyFlowKeyV4>() == 16
            && offset_of!(PolicyFlowKeyV4, peer) == 4
            && offset_of!(PolicyFlowKeyV4, pod_port) == 8
            && offset_of!(PolicyFlowKeyV4, peer_port) == 10
            && offset_of!(FlowKey, peer_port) == offset_of!(FlowKey, pod_port) + 2
            && offset_of!(PolicyFlowKeyV4, proto) == 12
            && POD % 4 == 0
            && PEER % 4 == 0
            && PORTS % 4 == 0
            && AT % 4 == 0
            && core::mem::align_of::<PolicyScratch>() >= 4
    );
    if s.flow.family != 4 {
        return None;
    }
    let proto = u32::from_ne_bytes([s.flow.proto, 0, 0, 0]);
    let base = s as *mut PolicyScratch as *mut u8;
    // SAFETY: every offset is within the scratch and 4-byte aligned (checked above); the
    // words are plain data.
    unsafe {
        let word = |off: usize| (base.add(off) as *const u32).read();
        let (pod, peer, ports) = (word(POD), word(PEER), word(PORTS));
        let key = base.add(AT) as *mut u32;
        key.write(pod);
        key.add(1).write(peer);
        key.add(2).write(ports);
        key.add(3).write(proto);
        Some(key as *const PolicyFlowKeyV4)
    }
}

/// The remembered flow of `s.flow`, if any.
#[inline(always)]
pub(super) fn flow_get(s: &mut PolicyScratch) -> Option<*mut PolicyFlow> {
    match key_v4(s) {
        // SAFETY: a key just built in the scratch.
        Some(k) => CALIX_POL_FLOWS_V4.get_ptr_mut(unsafe { &*k }),
        None => CALIX_POL_FLOWS.get_ptr_mut(&s.flow),
    }
}

/// Forgets the flow of `s.flow`.
#[inline(always)]
pub(super) fn flow_remove(s: &mut PolicyScratch) {
    let _ = match key_v4(s) {
        // SAFETY: as in `flow_get`.
        Some(k) => CALIX_POL_FLOWS_V4.remove(unsafe { &*k }),
        None => CALIX_POL_FLOWS.remove(&s.flow),
    };
}

/// Remembers `s.value` for the flow of `s.flow` (a full LRU table evicts its oldest flow).
#[inline(always)]
pub(super) fn flow_insert(s: &mut PolicyScratch) {
    let _ = match key_v4(s) {
        // SAFETY: as in `flow_get`.
        Some(k) => CALIX_POL_FLOWS_V4.insert(unsafe { &*k }, &s.value, BPF_ANY),
        None => CALIX_POL_FLOWS.insert(&s.flow, &s.value, BPF_ANY),
    };
}

/// Turns `s.flow` around (seen from the other end): the addresses swapped in 8-byte words, the
/// ports as one 4-byte word (`mem::swap` of the byte arrays compiled to 64 byte loads and
/// stores).
#[inline(always)]
pub(super) fn swap_ends(s: &mut PolicyScratch) {
    use core::mem::offset_of;
    const POD: usize = offset_of!(FlowKey, pod);
    const PEER: usize = offset_of!(FlowKey, peer);
    const PORTS: usize = offset_of!(FlowKey, pod_port);
    const _: () = assert!(
        offset_of!(PolicyScratch, flow) == 0
            && POD % 8 == 0
            && PEER % 8 == 0
            && PORTS % 4 == 0
            && offset_of!(FlowKey, peer_port) == PORTS + 2
            && core::mem::align_of::<PolicyScratch>() >= 8
    );
    let base = s as *mut PolicyScratch as *mut u8;
    // SAFETY: the flow is the first field of the 8-byte aligned scratch; every word is
    // within it and aligned (checked above); plain data.
    unsafe {
        let (pod, peer) = (base.add(POD) as *mut u64, base.add(PEER) as *mut u64);
        for i in 0..2 {
            let a = pod.add(i).read();
            pod.add(i).write(peer.add(i).read());
            peer.add(i).write(a);
        }
        let ports = base.add(PORTS) as *mut u32;
        ports.write(ports.read().rotate_left(16));
    }
}

/// The entry of a TCP connection the endpoint (state `st`) has none of because the other end,
/// an endpoint of this node, opened it while the pair passed every TCP packet (its entry, the
/// flow in `s` turned around, is `PF_PAIRED`: this endpoint's verdict allowed the SYN and kept
/// nothing, `PS_SENT`): the connection as its opener remembered it, seen from here, at no
/// generation of this endpoint's, so checked again against the direction that opened it (or
/// kept, with `POL_KEEP_ESTABLISHED`: this endpoint allowed it) before it is used. This is how
/// the other end learns who opened the connection once a change makes the pair stale. `None`
/// otherwise: only a connection this endpoint allowed is adopted, anything else meets the
/// rules as before. The opener's entry is marked `PF_ADOPTED`: its FINs are then judged at
/// both ends again, so that they end this entry too.
#[inline(always)]
pub(super) fn adopt(s: &mut PolicyScratch, st: &PolicyState) -> Option<*mut PolicyFlow> {
    swap_ends(s);
    let found = match flow_get(s) {
        Some(o) => {
            // SAFETY: a pointer from a successful lookup, valid until the program returns;
            // racing writers store the same kind of values (benign).
            let o = unsafe { &mut *o };
            s.value.last_seen_ns = o.last_seen_ns;
            s.value.flags = mirrored(o.flags);
            let paired = o.flags & PF_PAIRED != 0;
            if paired {
                set_flags(o, PF_ADOPTED);
            }
            paired
        }
        None => false,
    };
    swap_ends(s);
    if !found {
        return None;
    }
    s.value.generation = st.generation.wrapping_add(1);
    flow_insert(s);
    flow_get(s)
}

/// The `PF_*` bits of a flow's entry, seen from the other end: who opened it and who sent a
/// FIN, swapped; the other end's revocation (and `PF_PAIRED`, `PF_ADOPTED`) is its own.
#[inline(always)]
fn mirrored(f: u32) -> u32 {
    let mut m = 0;
    if f & PF_FROM_POD != 0 {
        m |= PF_TO_POD;
    }
    if f & PF_TO_POD != 0 {
        m |= PF_FROM_POD;
    }
    if f & PF_FIN_POD != 0 {
        m |= PF_FIN_PEER;
    }
    if f & PF_FIN_PEER != 0 {
        m |= PF_FIN_POD;
    }
    m
}

/// Notes a TCP packet's closing flags (`s_flags`: `PS_*`) sent in `dir` on its remembered
/// flow `f`; true once the connection is over and its entry can go: a RST, or the first
/// segment without FIN after both ends sent theirs (the last ACK); between two endpoints
/// whose pair cache passes that last ACK without a lookup (`PS_PAIR`), the second FIN. A new
/// flow's insertion into a full table evicts the oldest entry, and a closed connection's
/// entry is the one to go first: left in place, a busy node's table stays full of them and
/// every new connection pays an eviction of a cold entry. Other protocols are left to the
/// table's LRU order.
#[inline(always)]
pub(super) fn closed(f: &mut PolicyFlow, dir: u8, s_flags: u32) -> bool {
    if s_flags & PS_RST != 0 {
        return true;
    }
    if s_flags & PS_FIN != 0 {
        let fin = if dir == POL_DIR_EGRESS {
            PF_FIN_POD
        } else {
            PF_FIN_PEER
        };
        set_flags(f, fin);
        return s_flags & PS_PAIR != 0
            && f.flags & (PF_FIN_POD | PF_FIN_PEER) == PF_FIN_POD | PF_FIN_PEER;
    }
    f.flags & (PF_FIN_POD | PF_FIN_PEER) == PF_FIN_POD | PF_FIN_PEER
}

/// Remembers the flow in `s` as allowed now (`flags`: `PF_*`, who opened it).
#[inline(always)]
pub(super) fn remember(s: &mut PolicyScratch, st: &PolicyState, flags: u32, now: u64) {
    s.value.last_seen_ns = now;
    s.value.generation = st.generation;
    s.value.flags = flags;
    // A full LRU table evicts its oldest flow; a flow that is gone is checked again.
    flow_insert(s);
}
