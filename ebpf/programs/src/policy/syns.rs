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
    POL_DIR_EGRESS, PS_PEER, PS_PEER_SHIFT, PS_SYN, SYN_EGRESS, SYN_INGRESS,
};

use crate::maps::CALIX_POL_SYNS;

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

/// The rule that lets the SYN in `s`, which the endpoint in `slot` sends to the other
/// endpoint (`PS_PEER`, of generation `peer_generation`), into that endpoint, when the memo
/// knows it: what the receiver's verdict would count.
#[inline(always)]
pub fn receiver_rule(slot: u32, peer_generation: u32, s: &PolicyScratch) -> Option<u32> {
    if !asks(s) {
        return None;
    }
    let m = CALIX_POL_SYNS.get(index(slot, POL_DIR_EGRESS, s))?;
    if m.slots != slots(slot, POL_DIR_EGRESS, s) || m.port != port(POL_DIR_EGRESS, s) {
        return None;
    }
    (m.known & SYN_INGRESS != 0 && m.peer_generation == peer_generation).then_some(m.ingress_rule)
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
