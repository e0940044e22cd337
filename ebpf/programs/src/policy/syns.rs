//! The SYN memo (`calix_common::POLICY_SYNS_MAP`): for two endpoints of this node, the rules
//! that let the last new TCP connection one opened to the other through, and its port. A SYN
//! between two endpoints whose pair entry is current (`PS_PEER`: the receiver's address
//! checked, both generations as the entry's) to the same port meets the same rules as long
//! as both endpoints keep their generations: it takes them from here instead of the peer's
//! identity and the entry tries, and the rules' hit counts count it all the same. Only rules
//! that allowed are kept: a denied SYN goes through the tries (and its drop event) every time.
//!
//! Each CPU has its own memo, as the pair cache: no reader meets a half-written entry.

use calix_common::{
    policy_pair_index, policy_pair_slots, policy_syn_port, PolicyScratch, PolicyState,
    POL_DIR_EGRESS, POL_DIR_INGRESS, PS_PEER, PS_PEER_SHIFT, PS_SYN, SYN_EGRESS, SYN_INGRESS,
    SYN_RECORDED,
};

use super::{hit, isolated_in};
use crate::maps::{CALIX_POL_STATE, CALIX_POL_SYNS};

/// Whether the packet in `s` is a SYN to or from another endpoint of this node whose pair
/// entry is current.
#[inline(always)]
fn asks(s: &PolicyScratch) -> bool {
    s.flags & (PS_SYN | PS_PEER) == PS_SYN | PS_PEER
}

/// `policy_pair_slots` of the SYN's opener and the other endpoint, for the verdict in `dir`
/// of the endpoint in `slot`.
#[inline(always)]
fn slots(slot: u32, dir: u8, s: &PolicyScratch) -> u32 {
    let peer = s.flags >> PS_PEER_SHIFT;
    if dir == POL_DIR_EGRESS {
        policy_pair_slots(slot, peer)
    } else {
        policy_pair_slots(peer, slot)
    }
}

/// The SYN's entry: the pair's index.
#[inline(always)]
fn index(slot: u32, dir: u8, s: &PolicyScratch) -> u32 {
    let slots = slots(slot, dir, s);
    policy_pair_index(slots >> 16, slots & 0xffff)
}

/// The SYN's `PolicySyn::port`: its family and the port it goes to.
#[inline(always)]
fn port(dir: u8, s: &PolicyScratch) -> u32 {
    let port = if dir == POL_DIR_EGRESS {
        s.flow.peer_port
    } else {
        s.flow.pod_port
    };
    policy_syn_port(s.flow.family, port)
}

// The values after each map lookup are read again from the scratch rather than kept across
// it: the verdict's frame has no room for more than its own (`from_pod`'s takes the rest of
// the 512 bytes).

/// The rule that lets the SYN in `s` through in `dir` for the endpoint in `slot` (state
/// `st`), when the memo knows it. Each direction's rule is kept with its own endpoint's
/// generation: what the tries say in `dir` moves only with that endpoint's entries and the
/// identities of addresses, and either change gives it a new generation.
#[inline(always)]
pub fn recall(slot: u32, st: &PolicyState, dir: u8, s: &PolicyScratch) -> Option<u32> {
    if !asks(s) {
        return None;
    }
    let m = CALIX_POL_SYNS.get(index(slot, dir, s))?;
    if m.slots != slots(slot, dir, s) || m.port != port(dir, s) {
        return None;
    }
    let (bit, generation, rule) = if dir == POL_DIR_EGRESS {
        (SYN_EGRESS, m.generation, m.egress_rule)
    } else {
        (SYN_INGRESS, m.peer_generation, m.ingress_rule)
    };
    (m.known & bit != 0 && generation == st.generation).then_some(rule)
}

/// The rule that lets the SYN in `s`, which the endpoint in `slot` (of generation
/// `generation`) sends to the other endpoint (`PS_PEER`, of generation `peer_generation`),
/// into that endpoint, when the memo knows it: what the receiver's verdict would count; and
/// whether the pair's record of openers holds the SYN's port ([`SYN_RECORDED`], under both
/// generations).
#[inline(always)]
pub fn receiver_rule(
    slot: u32,
    generation: u32,
    peer_generation: u32,
    s: &PolicyScratch,
) -> Option<(u32, bool)> {
    if !asks(s) {
        return None;
    }
    let m = CALIX_POL_SYNS.get(index(slot, POL_DIR_EGRESS, s))?;
    if m.slots != slots(slot, POL_DIR_EGRESS, s) || m.port != port(POL_DIR_EGRESS, s) {
        return None;
    }
    let recorded = m.known & SYN_RECORDED != 0 && m.generation == generation;
    (m.known & SYN_INGRESS != 0 && m.peer_generation == peer_generation)
        .then_some((m.ingress_rule, recorded))
}

/// Notes that the pair's record of openers holds the port of the SYN in `s`, which the
/// endpoint in `slot` opened to the endpoint in `peer` ([`SYN_RECORDED`]), when the memo's
/// entry is this SYN's and names both endpoints' generations as they are.
#[inline(always)]
pub fn note_recorded(slot: u32, peer: u32, s: &PolicyScratch) {
    let Some(m) = CALIX_POL_SYNS.get_ptr_mut(policy_pair_index(slot, peer)) else {
        return;
    };
    // SAFETY: this CPU's value, from a successful lookup; nothing else uses it meanwhile.
    let m = unsafe { &mut *m };
    if m.slots != policy_pair_slots(slot, peer)
        || m.port != policy_syn_port(s.flow.family, s.flow.peer_port)
    {
        return;
    }
    let generation = |x: u32| CALIX_POL_STATE.get(x).map_or(0, |st| st.generation);
    if m.generation == generation(slot) && m.peer_generation == generation(peer) {
        m.known |= SYN_RECORDED;
    }
}

/// Notes that rule `rule` let the SYN in `s` through in `dir` for the endpoint in `slot`
/// (state `st`): the tries said so.
#[inline(always)]
pub fn note(slot: u32, st: &PolicyState, dir: u8, s: &PolicyScratch, rule: u32) {
    if !asks(s) {
        return;
    }
    let Some(m) = CALIX_POL_SYNS.get_ptr_mut(index(slot, dir, s)) else {
        return;
    };
    // SAFETY: this CPU's value, from a successful lookup; nothing else uses it meanwhile.
    let m = unsafe { &mut *m };
    let (slots, port) = (slots(slot, dir, s), port(dir, s));
    if m.slots != slots || m.port != port {
        m.slots = slots;
        m.port = port;
        m.known = 0;
    }
    // A generation written again: what the record held under the old ones is not known.
    m.known &= !SYN_RECORDED;
    if dir == POL_DIR_EGRESS {
        m.generation = st.generation;
        m.egress_rule = rule;
        m.known |= SYN_EGRESS;
    } else {
        m.peer_generation = st.generation;
        m.ingress_rule = rule;
        m.known |= SYN_INGRESS;
    }
}

/// [`settles_receiver`]: the receiver's verdict is still to come.
pub const UNSETTLED: u8 = 0;
/// [`settles_receiver`]: the receiver's verdict has nothing to add.
pub const SETTLED: u8 = 1;
/// [`settles_receiver`]: as [`SETTLED`], and the SYN memo says the pair's record of openers
/// holds the SYN's port already (`calix_common::SYN_RECORDED`).
pub const SETTLED_RECORDED: u8 = 2;

/// Whether the receiver's verdict on the SYN in `s`, which the endpoint in `slot` (state
/// `st`) just let out to another endpoint of this node (`PS_PEER`) while their pair passes
/// every TCP packet, has nothing to add ([`SETTLED`], [`SETTLED_RECORDED`]): it would allow the
/// SYN (the pair) and keep no entry (`PS_SENT`); what it would count, the hit of its ingress
/// rule, the SYN memo knows, and it is counted here.
#[inline(always)]
pub fn settles_receiver(slot: u32, st: &PolicyState, s: &mut PolicyScratch) -> u8 {
    let peer = s.flags >> PS_PEER_SHIFT;
    let Some(pst) = CALIX_POL_STATE.get(peer) else {
        return UNSETTLED;
    };
    if !isolated_in(pst, POL_DIR_INGRESS) {
        return SETTLED;
    }
    match receiver_rule(slot, st.generation, pst.generation, s) {
        Some((rule, recorded)) => {
            hit(s, peer, rule);
            if recorded {
                SETTLED_RECORDED
            } else {
                SETTLED
            }
        }
        None => UNSETTLED,
    }
}
