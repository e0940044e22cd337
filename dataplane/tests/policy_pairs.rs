//! NetworkPolicy's pair cache (`CALIX_POL_PAIRS`) in the tc programs, run with
//! BPF_PROG_TEST_RUN on one CPU (each CPU has its own cache): two pods of one node whose rules
//! allow every TCP packet between them pass their connections' later segments without the
//! flows, and everything the flows decide still holds: a change refuses a revoked
//! connection, a pair whose rules name ports is never passed, closed connections leave no
//! entry, and an idle connection is checked against the side that opened it. Between two
//! isolated pods that keep no established flows after a change, such a connection has no
//! entry: the pair's record of openers (`CALIX_POL_OPENERS`) says who opened it when a change
//! asks; with `keep_established`, it has one, its opener's, which the other side adopts after
//! a change. A new
//! connection between two pods the cache knows takes its rules from the SYN memo
//! (`CALIX_POL_SYNS`) while both keep their generations. Needs root.
mod common;

#[path = "common/harness.rs"]
mod harness;
#[path = "common/policed.rs"]
mod policed;

use aya::maps::{Array, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap};
use calix_common::{
    policy_pair_index, policy_pair_slots, policy_syn_port, PolicyFlow, PolicyFlowKeyV4,
    PolicyHitKey, PolicyKey, PolicyOpeners, PolicyPair, PolicyState, PolicySyn, PAIR_RECORDED,
    POLICY_FLOWS_V4_MAP, POLICY_HITS_MAP, POLICY_MAP, POLICY_OPENERS_MAP, POLICY_PAIRS_MAP,
    POLICY_STATE_MAP, POLICY_SYNS_MAP, SYN_EGRESS, SYN_INGRESS, SYN_RECORDED,
};
use calix_core::policy::cluster::Change;
use calix_core::policy::model::{Policy, PortMatch, Rule};
use calix_dataplane::ebpf::policy::entry_of;
use common::*;
use harness::*;
use policed::*;

const FIN_ACK: u8 = 0x11;

/// Runs the test on CPU 0 only: the programs' pair cache is per CPU.
fn on_one_cpu(test: impl FnOnce() + Send + 'static) {
    in_netns(|| {
        let mut cpus = nix::sched::CpuSet::new();
        cpus.set(0).expect("CPU 0");
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpus)
            .expect("sched_setaffinity");
        test();
    });
}

/// Pods A and B isolated both ways by rules that pass every TCP packet between them (A: in
/// from B and out to B, anything; B: in from anyone and out to A, anything), with
/// `keep_established` as given: the harness, the pods and their policy.
fn passed_pair(keep_established: bool) -> (Harness, Pod, Pod, Policed) {
    isolated_pair(keep_established, policy(vec![], Some(vec![to_a(vec![])])))
}

/// As [`passed_pair`], with B's policy `b` instead.
fn isolated_pair(keep_established: bool, b: Policy) -> (Harness, Pod, Pod, Policed) {
    let (mut h, pod_a, pod_b) = setup();
    let mut p = Policed::new(&mut h, &pod_a, &pod_b);
    p.programmer
        .set_keep_established(keep_established)
        .expect("keep established");
    p.apply(Change::Policy(a_with_b()));
    p.apply(Change::Policy(b));
    (h, pod_a, pod_b, p)
}

/// A rule for B's egress: to A, on `ports` (empty: all).
fn to_a(ports: Vec<PortMatch>) -> Rule {
    app_rule("a", ports)
}

/// Whether `pod` remembers the IPv4 TCP flow between its port `port` and `peer`'s port
/// `peer_port`.
fn remembers(h: &mut Harness, pod: &Pod, port: u16, peer: &Pod, peer_port: u16) -> bool {
    let key = PolicyFlowKeyV4 {
        pod: pod.v4,
        peer: peer.v4,
        pod_port: port.to_be(),
        peer_port: peer_port.to_be(),
        proto: TCP,
        _pad: [0; 3],
    };
    flows_v4(h).get(&key, 0).is_ok()
}

/// A's FIN to B, then B's to A (each on the given port): both pass, and the flows remembered
/// after each are `after`.
fn close(h: &Harness, (a, pa): (&Pod, u16), (b, pb): (&Pod, u16), after: [usize; 2]) {
    assert_eq!(send(h, a, b, TCP, tcp(pa, pb, FIN_ACK)), TC_ACT_REDIRECT);
    assert_eq!(remembered(h), after[0], "after A's FIN");
    assert_eq!(send(h, b, a, TCP, tcp(pb, pa, FIN_ACK)), TC_ACT_REDIRECT);
    assert_eq!(remembered(h), after[1], "after B's FIN");
}

/// CPU 0's pair entry of `from` → `to`.
fn pair(h: &Harness, from: &Pod, to: &Pod) -> PolicyPair {
    let map = h.bpf.map(POLICY_PAIRS_MAP).expect("CALIX_POL_PAIRS");
    let pairs: PerCpuArray<_, PolicyPair> = PerCpuArray::try_from(map).expect("a per-CPU array");
    pairs
        .get(&policy_pair_index(from.slot, to.slot), 0)
        .expect("the pair's entry")[0]
}

/// CPU 0's SYN memo entry of connections `opener` opens to `other`.
fn syn_memo(h: &Harness, opener: &Pod, other: &Pod) -> PolicySyn {
    let map = h.bpf.map(POLICY_SYNS_MAP).expect("CALIX_POL_SYNS");
    let syns: PerCpuArray<_, PolicySyn> = PerCpuArray::try_from(map).expect("a per-CPU array");
    syns.get(&policy_pair_index(opener.slot, other.slot), 0)
        .expect("the memo's entry")[0]
}

/// The ports the pair of `a` and `b` records as opened (`CALIX_POL_OPENERS`): (whether `a`
/// opened it, port), in the record's order.
fn openers(h: &Harness, a: &Pod, b: &Pod) -> Vec<(bool, u16)> {
    let records: aya::maps::HashMap<_, u32, PolicyOpeners> =
        aya::maps::HashMap::try_from(Map::HashMap(pinned(h, POLICY_OPENERS_MAP)))
            .expect("a hash map");
    let (lo, hi) = (a.slot.min(b.slot), a.slot.max(b.slot));
    let Ok(r) = records.get(&policy_pair_slots(lo, hi), 0) else {
        return vec![];
    };
    r.ports
        .iter()
        .filter(|w| **w != 0)
        .map(|w| {
            let lower_opened = (w >> 24) & 1 == 1;
            (lower_opened == (a.slot < b.slot), u16::from_be(*w as u16))
        })
        .collect()
}

/// A pinned map of the harness (the policy programmer took the object's own handles).
fn pinned(h: &Harness, name: &str) -> MapData {
    MapData::from_pin(h.pins.0.join(name)).expect("a pinned map")
}

/// How often each rule decided for `pod`: (rule, count), on CPU 0.
fn hits(h: &Harness, pod: &Pod) -> Vec<(u32, u64)> {
    let hits: PerCpuHashMap<_, PolicyHitKey, u64> =
        PerCpuHashMap::try_from(Map::PerCpuHashMap(pinned(h, POLICY_HITS_MAP)))
            .expect("a per-CPU hash");
    let mut all: Vec<(u32, u64)> = hits
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| k.slot == pod.slot)
        .map(|(k, v)| (k.rule, v[0]))
        .collect();
    all.sort_unstable();
    all
}

/// Takes `pod`'s entries out of the entry trie behind the programmer's back (no new
/// generation).
fn remove_entries(h: &Harness, pod: &Pod) {
    let mut trie: LpmTrie<_, PolicyKey, u32> =
        LpmTrie::try_from(Map::LpmTrie(pinned(h, POLICY_MAP))).expect("an LPM trie");
    let keys: Vec<_> = trie
        .keys()
        .filter_map(Result::ok)
        .filter(|k| entry_of(k).is_some_and(|(slot, _, _)| slot == pod.slot))
        .collect();
    assert!(!keys.is_empty(), "the pod has entries");
    for k in keys {
        trie.remove(&k).expect("remove an entry");
    }
}

/// Gives `pod`'s state a new generation, as a change does.
fn next_generation(h: &Harness, pod: &Pod) {
    let mut states: Array<_, PolicyState> =
        Array::try_from(Map::Array(pinned(h, POLICY_STATE_MAP))).expect("an array");
    let mut st = states.get(&pod.slot, 0).expect("the pod's state");
    st.generation += 1;
    states.set(pod.slot, st, 0).expect("write the state");
}

/// CPU 0's pair entries of `a` and `b` brought to the endpoints' current generations.
fn pairs_current(h: &mut Harness, a: &Pod, b: &Pod) {
    let states: Array<_, PolicyState> =
        Array::try_from(Map::Array(pinned(h, POLICY_STATE_MAP))).expect("an array");
    let generation = |p: &Pod| states.get(&p.slot, 0).expect("a state").generation;
    let (ga, gb) = (generation(a), generation(b));
    let map = h.bpf.map_mut(POLICY_PAIRS_MAP).expect("CALIX_POL_PAIRS");
    let mut pairs: PerCpuArray<_, PolicyPair> =
        PerCpuArray::try_from(map).expect("a per-CPU array");
    for (from, to, g, peer_g) in [(a, b, ga, gb), (b, a, gb, ga)] {
        let at = policy_pair_index(from.slot, to.slot);
        let mut values: Vec<PolicyPair> = pairs.get(&at, 0).expect("the pair's entries").to_vec();
        values[0].generation = g;
        values[0].peer_generation = peer_g;
        pairs
            .set(
                at,
                aya::maps::PerCpuValues::try_from(values).expect("values"),
                0,
            )
            .expect("write the pair's entries");
    }
}

/// The IPv4 flows' table.
fn flows_v4(
    h: &mut Harness,
) -> aya::maps::HashMap<&mut aya::maps::MapData, PolicyFlowKeyV4, PolicyFlow> {
    let map = h
        .bpf
        .map_mut(POLICY_FLOWS_V4_MAP)
        .expect("CALIX_POL_FLOWS_V4");
    aya::maps::HashMap::try_from(map).expect("a hash map")
}

/// Every remembered IPv4 flow forgotten.
fn forget_flows(h: &mut Harness) {
    let mut flows = flows_v4(h);
    let keys: Vec<_> = flows.keys().filter_map(Result::ok).collect();
    for k in keys {
        flows.remove(&k).expect("remove a flow");
    }
}

/// Every remembered IPv4 flow made idle since long before the TCP timeout.
fn age_flows(h: &mut Harness) {
    let mut flows = flows_v4(h);
    let all: Vec<_> = flows.iter().filter_map(Result::ok).collect();
    for (k, mut f) in all {
        f.last_seen_ns = 1;
        flows.insert(k, f, 0).expect("age a flow");
    }
}

#[test]
fn a_pair_that_allows_everything_passes_segments_without_the_flows_and_a_change_still_revokes() {
    on_one_cpu(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        // B takes everything from A; its egress and A are not isolated.
        p.apply(Change::Policy(policy(vec![], None)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        let (ab, ba) = (pair(&h, &a, &b), pair(&h, &b, &a));
        assert_eq!(ab.family, 4, "learnt from the SYN: {ab:?}");
        assert_eq!(ba.family, 4, "both ways: {ba:?}");
        assert_eq!(&ab.peer[..4], &b.v4);
        assert_eq!(&ba.peer[..4], &a.v4);
        assert_eq!(remembered(&h), 1, "the SYN still remembered (B's side)");
        // With no remembered flow, a segment that the flows would judge (and remember, by the
        // mid-connection rule) passes on the pair alone: nothing is remembered.
        forget_flows(&mut h);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(81, 40000, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_REDIRECT);
        assert_eq!(remembered(&h), 0, "no flow lookup, no flow remembered");
        // A new connection, remembered from its SYN; then B's ingress narrowed to port 80:
        // the pair is stale, the flows decide, and the connection to 81 is refused both ways.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_REDIRECT);
        p.apply(Change::Policy(policy(vec![tcp_port(80)], None)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40001, ACK)), TC_ACT_SHOT);
        // Port 80 passes, and the pair is learnt again: not everything passes now.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 80, SYN)), TC_ACT_REDIRECT);
        let ab = pair(&h, &a, &b);
        assert_eq!(ab.family, 0, "port 80 only: {ab:?}");
        forget_flows(&mut h);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 80, ACK)), TC_ACT_REDIRECT);
        assert_eq!(
            remembered(&h),
            1,
            "judged by the flows (mid-connection), remembered"
        );
    });
}

#[test]
fn a_pair_whose_rules_name_ports_or_one_direction_is_never_passed() {
    on_one_cpu(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        // B takes everything from A, and may answer, but not open anything to A: the pair
        // does not allow every packet both ways.
        p.apply(Change::Policy(policy(vec![], Some(vec![]))));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(pair(&h, &a, &b).family, 0);
        assert_eq!(pair(&h, &b, &a).family, 0);
        // B opening a connection of its own to A: refused as before.
        assert_eq!(send(&h, &b, &a, TCP, tcp(40009, 82, SYN)), TC_ACT_SHOT);
        // B's egress to A on TCP 81 only: still not every packet.
        p.apply(Change::Policy(policy(
            vec![],
            Some(vec![to_a(vec![tcp_port(81)])]),
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(pair(&h, &a, &b).family, 0);
        // To A on every port: now everything passes both ways.
        p.apply(Change::Policy(policy(vec![], Some(vec![to_a(vec![])]))));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(pair(&h, &a, &b).family, 4);
    });
}

/// A connection between a pair the cache passes ends its entries at the second FIN: its last
/// ACK passes without a lookup.
#[test]
fn a_closed_connection_of_a_passed_pair_leaves_no_remembered_flow() {
    on_one_cpu(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![], Some(vec![to_a(vec![])]))));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(81, 40000, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_REDIRECT);
        assert_eq!(remembered(&h), 1, "B's side");
        // Half closed: still there; both FINs: gone.
        close(&h, (&a, 40000), (&b, 81), [1, 0]);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_REDIRECT);
        assert_eq!(remembered(&h), 0, "the last ACK remembers nothing");
    });
}

/// A connection the pair cache passed for longer than the TCP timeout (its entries never
/// refreshed) is still the one its SYN opened: after a change, it is checked against the
/// side that opened it, not let in by the other side's rules.
#[test]
fn an_idle_connection_is_checked_against_the_side_that_opened_it() {
    on_one_cpu(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![], Some(vec![to_a(vec![])]))));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_REDIRECT);
        age_flows(&mut h);
        // A's connection to B's port 81 is no longer allowed; B may still open anything to
        // A (so the mid-connection rule would let the segment in).
        p.apply(Change::Policy(policy(
            vec![tcp_port(80)],
            Some(vec![to_a(vec![])]),
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40000, ACK)), TC_ACT_SHOT);
        // An idle connection the rules still allow goes on.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 80, SYN)), TC_ACT_REDIRECT);
        age_flows(&mut h);
        p.apply(Change::Policy(policy(
            vec![tcp_port(80), tcp_port(82)],
            Some(vec![to_a(vec![])]),
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 80, ACK)), TC_ACT_REDIRECT);
    });
}

/// A SYN between two pods whose pair entry is current takes the rules that let the last one
/// to that port through from the memo (each direction's rule under its endpoint's
/// generation), and counts their hits as the tries would; a new generation sends it to the
/// tries again.
#[test]
fn a_new_connection_between_known_pods_takes_its_rules_from_the_syn_memo() {
    on_one_cpu(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        // B takes A in on TCP 81 and may open TCP 90 to A; A is not isolated.
        p.apply(Change::Policy(policy(
            vec![tcp_port(81)],
            Some(vec![to_a(vec![tcp_port(90)])]),
        )));
        // The first SYN learns the pair (not known yet: no memo); the second, the memo.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(syn_memo(&h, &a, &b).known, 0, "the pair was not known yet");
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, SYN)), TC_ACT_REDIRECT);
        let m = syn_memo(&h, &a, &b);
        assert_eq!(
            m.known, SYN_INGRESS,
            "B's ingress rule, A not isolated: {m:?}"
        );
        assert_eq!(m.port, policy_syn_port(4, 81u16.to_be()));
        let into_b = m.ingress_rule;
        assert_eq!(hits(&h, &b), [(into_b, 2)]);
        assert_eq!(send(&h, &b, &a, TCP, tcp(40100, 90, SYN)), TC_ACT_REDIRECT);
        let m = syn_memo(&h, &b, &a);
        assert_eq!(m.known, SYN_EGRESS, "B's egress rule: {m:?}");
        let out_of_b = m.egress_rule;
        assert_ne!(out_of_b, into_b);
        // B's entries gone behind the programs' back, its generation the same: SYNs to the
        // ports the memo knows pass on it, and are counted; another port meets the tries.
        remove_entries(&h, &b);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(40101, 90, SYN)), TC_ACT_REDIRECT);
        let mut counted = vec![(into_b, 3), (out_of_b, 2)];
        counted.sort_unstable();
        assert_eq!(hits(&h, &b), counted);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40003, 82, SYN)), TC_ACT_SHOT);
        // A new generation of B's, and the pair entries current at it (as a packet that
        // passed would leave them): the memo's rules are of the generation before.
        next_generation(&h, &b);
        pairs_current(&mut h, &a, &b);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40004, 81, SYN)), TC_ACT_SHOT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(40102, 90, SYN)), TC_ACT_SHOT);
        assert_eq!(hits(&h, &b), counted, "denied SYNs count no rule");
    });
}

/// The memo over IPv6: its own family in the stamp.
#[test]
fn the_syn_memo_answers_ipv6_connections_too() {
    on_one_cpu(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![tcp_port(81)], None)));
        assert_eq!(send6(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send6(&h, &a, &b, TCP, tcp(40001, 81, SYN)), TC_ACT_REDIRECT);
        let m = syn_memo(&h, &a, &b);
        assert_eq!(m.known, SYN_INGRESS, "{m:?}");
        assert_eq!(m.port, policy_syn_port(6, 81u16.to_be()));
        remove_entries(&h, &b);
        assert_eq!(send6(&h, &a, &b, TCP, tcp(40002, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(hits(&h, &b), [(m.ingress_rule, 3)]);
        // The same port over IPv4 is another stamp: the tries, now empty, refuse it.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40003, 81, SYN)), TC_ACT_SHOT);
    });
}

/// Between two isolated pods whose pair passes every TCP packet (and neither keeps established
/// flows), a connection keeps no entry: its SYN notes the port it went to in the pair's record
/// of openers, and its FINs pass on the pair. A change that makes the pair stale has both ends
/// learn who opened it from the record, so a revoked connection is refused both ways, not let
/// in by the other direction's rules.
#[test]
fn a_connection_of_a_passed_pair_keeps_no_entry_and_a_change_still_revokes_it() {
    on_one_cpu(|| {
        let (mut h, a, b, mut p) = passed_pair(false);
        // The first SYN learns the pair: both sides remember it.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(pair(&h, &a, &b).family, 4 | PAIR_RECORDED);
        assert_eq!(remembered(&h), 2);
        assert!(openers(&h, &a, &b).is_empty());
        // The pair known: no entry, the port in the record.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(openers(&h, &a, &b), [(true, 81)], "A opened one to B's 81");
        assert_eq!(
            openers(&h, &b, &a),
            [(false, 81)],
            "the same record, seen from B"
        );
        assert_eq!(remembered(&h), 2);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(81, 40001, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_REDIRECT);
        // Closed from both ends: nothing to end.
        close(&h, (&a, 40001), (&b, 81), [2, 2]);
        // A third connection; then B's ingress narrowed to port 80. B may still open anything
        // to A, so B's egress rules would let the segments of A's connection through (the
        // mid-connection rule): the record says A opened it, and B's ingress refuses it,
        // both ways.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 81, ACK)), TC_ACT_REDIRECT);
        assert_eq!(openers(&h, &a, &b), [(true, 81)], "one port, noted once");
        assert!(!remembers(&mut h, &b, 81, &a, 40002));
        p.apply(Change::Policy(policy(
            vec![tcp_port(80)],
            Some(vec![to_a(vec![])]),
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 81, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40002, ACK)), TC_ACT_SHOT);
        assert!(
            remembers(&mut h, &a, 40002, &b, 81),
            "A's entry, from the record"
        );
        assert!(remembers(&mut h, &b, 81, &a, 40002), "B's entry, revoked");
        // A connection to port 80 still passes both ways.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40003, 80, SYN)), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(80, 40003, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert_eq!(send(&h, &a, &b, TCP, tcp(40003, 80, ACK)), TC_ACT_REDIRECT);
        // B gone: the pair's record goes with it.
        assert!(!openers(&h, &a, &b).is_empty());
        p.programmer.detached(b.slot);
        assert!(openers(&h, &a, &b).is_empty());
    });
}

/// A recorded connection is refused after a change that revokes it whatever its pair became
/// since: learnt again as one whose rules name ports (by another connection's packet that
/// passed both verdicts), or with the opener no longer isolated at all (it gives no verdict;
/// the other end still learns from the record who opened the connection).
#[test]
fn a_recorded_connection_is_revoked_whatever_the_pair_became() {
    on_one_cpu(|| {
        let (h, a, b, mut p) = passed_pair(false);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        for port in [40001, 40002] {
            assert_eq!(send(&h, &a, &b, TCP, tcp(port, 81, SYN)), TC_ACT_REDIRECT);
        }
        assert_eq!(openers(&h, &a, &b), [(true, 81)]);
        // B's ingress to port 80 only, its egress to A still anything; a connection to 80
        // learns the pair again, as one whose rules name ports.
        p.apply(Change::Policy(policy(
            vec![tcp_port(80)],
            Some(vec![to_a(vec![])]),
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40009, 80, SYN)), TC_ACT_REDIRECT);
        assert_eq!(pair(&h, &a, &b).family, 0, "learnt again: ports named");
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40001, ACK)), TC_ACT_SHOT);
        // A's own policy gone: A isolated no more, B's rules alone decide.
        p.apply(Change::PolicyGone(a_with_b().key));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 81, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40002, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40010, 80, SYN)), TC_ACT_REDIRECT);
    });
}

/// A record holds four ports: a connection to a fifth keeps its opener's entry, as before the
/// record, and a change still revokes it; connections both ways are told apart by port.
#[test]
fn a_full_record_leaves_the_next_ports_to_entries() {
    on_one_cpu(|| {
        let (mut h, a, b, mut p) = passed_pair(false);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, SYN)), TC_ACT_REDIRECT);
        let learnt = remembered(&h);
        for (i, port) in [81, 82, 83].into_iter().enumerate() {
            assert_eq!(
                send(&h, &a, &b, TCP, tcp(40001 + i as u16, port, SYN)),
                TC_ACT_REDIRECT
            );
        }
        assert_eq!(send(&h, &b, &a, TCP, tcp(41000, 90, SYN)), TC_ACT_REDIRECT);
        assert_eq!(
            openers(&h, &a, &b),
            [(true, 81), (true, 82), (true, 83), (false, 90)]
        );
        assert_eq!(remembered(&h), learnt, "no entry for any of them");
        assert_eq!(send(&h, &a, &b, TCP, tcp(40009, 84, SYN)), TC_ACT_REDIRECT);
        assert!(
            remembers(&mut h, &a, 40009, &b, 84),
            "the fifth port: an entry"
        );
        assert_eq!(openers(&h, &a, &b).len(), 4);
        // B's ingress narrowed to port 82, its egress to A still anything: A's connections to
        // 81 and 84 are refused (84 by its entry, 81 by the record), 82's goes on, and B's own
        // connection to A's 90 goes on.
        p.apply(Change::Policy(policy(
            vec![tcp_port(82)],
            Some(vec![to_a(vec![])]),
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(84, 40009, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40002, 82, ACK)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(41000, 90, ACK)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(90, 41000, ACK)), TC_ACT_REDIRECT);
    });
}

/// Pods that keep established flows are never passed on the pair (their rules let every
/// TCP packet between them through): each end keeps its own entry of a connection, refreshed
/// by its packets, so that a change that refuses it keeps it when it is busy, also hours after
/// its SYN, and refuses new ones.
#[test]
fn a_kept_connection_goes_on_at_both_ends_however_long_ago_it_opened() {
    on_one_cpu(|| {
        let (mut h, a, b, mut p) = passed_pair(true);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(pair(&h, &a, &b).family, 0, "never passed");
        assert!(remembers(&mut h, &b, 81, &a, 40001), "B keeps its own");
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(81, 40001, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_REDIRECT);
        // Opened long ago, busy since: its segments refresh both entries.
        age_flows(&mut h);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40001, ACK)), TC_ACT_REDIRECT);
        // Neither of B's directions allows the connection now (its egress to A only to 90).
        p.apply(Change::Policy(policy(
            vec![tcp_port(80)],
            Some(vec![to_a(vec![tcp_port(90)])]),
        )));
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40001, ACK)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &a, &b, TCP, tcp(40002, 81, SYN)),
            TC_ACT_SHOT,
            "a new connection meets the new rules"
        );
        // Idle since: the next change refuses it.
        age_flows(&mut h);
        p.apply(Change::Policy(policy(
            vec![tcp_port(80)],
            Some(vec![to_a(vec![tcp_port(91)])]),
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, ACK)), TC_ACT_SHOT);
    });
}

/// Only a connection the other side let in without an entry is adopted: an entry A wrote for
/// segments of no connection B ever allowed gives B nothing to keep, and B's rules refuse
/// them (neither of B's directions allows them).
#[test]
fn an_entry_the_other_side_never_allowed_is_not_adopted() {
    on_one_cpu(|| {
        let (mut h, a, b, _policy) = isolated_pair(true, policy(vec![tcp_port(80)], Some(vec![])));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_SHOT);
        assert!(
            remembers(&mut h, &a, 40000, &b, 81),
            "A's egress let it out"
        );
        assert!(!remembers(&mut h, &b, 81, &a, 40000), "nothing of B's");
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_SHOT);
    });
}

/// After a change that leaves a recorded connection allowed, both ends write its entry from
/// the record (the opener's verdict first, the other end adopting it); once the pair passes
/// every TCP packet again, its FINs pass on the pair and the entries stay until they go idle
/// (or to the LRU): connections that outlive a change are few.
#[test]
fn a_recorded_connection_gets_its_entries_back_after_a_change() {
    on_one_cpu(|| {
        let (mut h, a, b, _policy) = passed_pair(false);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40001, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(remembered(&h), 2);
        // B's generation moves on (nothing its rules say changes): the next segment writes
        // both ends' entries and learns the pair again.
        next_generation(&h, &b);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(81, 40001, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert!(remembers(&mut h, &b, 81, &a, 40001), "B's, from the record");
        assert!(remembers(&mut h, &a, 40001, &b, 81), "A's, adopted");
        assert_eq!(remembered(&h), 4);
        assert_eq!(pair(&h, &a, &b).family, 4 | PAIR_RECORDED, "passes again");
        close(&h, (&a, 40001), (&b, 81), [4, 4]);
    });
}

/// A new connection between two isolated pods whose pair passes every TCP packet counts a hit
/// of each side's rule per SYN, also once the SYN memo knows both (the receiver's verdict is
/// then settled by the opener's: its rule's hit is counted there); a new generation of the
/// receiver's sends its side to the tries again.
#[test]
fn a_new_connection_of_a_passed_pair_counts_both_sides_rules() {
    on_one_cpu(|| {
        let (mut h, a, b, _policy) = passed_pair(false);
        for port in 40000..40004 {
            assert_eq!(send(&h, &a, &b, TCP, tcp(port, 81, SYN)), TC_ACT_REDIRECT);
        }
        let m = syn_memo(&h, &a, &b);
        assert_eq!(m.known, SYN_EGRESS | SYN_INGRESS | SYN_RECORDED, "{m:?}");
        // The first SYN learnt the pair; the second the memo; the last two took both rules
        // from it.
        assert_eq!(hits(&h, &a), [(m.egress_rule, 4)]);
        assert_eq!(hits(&h, &b), [(m.ingress_rule, 4)]);
        assert_eq!(
            remembered(&h),
            2,
            "the first SYN's two; the others in the record"
        );
        // B's entries gone at a new generation (the pair entries current at it, as a packet
        // that passed would leave them): the memo's rule of B's is of the generation before,
        // so B's own verdict decides, from the tries.
        next_generation(&h, &b);
        pairs_current(&mut h, &a, &b);
        remove_entries(&h, &b);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40004, 81, SYN)), TC_ACT_SHOT);
        assert_eq!(hits(&h, &b), [(m.ingress_rule, 4)]);
    });
}

/// A SYN the memo settles both ways, to a port the pair's record holds as noted under both
/// endpoints' generations, does not look at the record again; once either generation moves,
/// or for another port, the next SYN notes its port again. (A record only goes when a slot
/// opens, under a new generation: here it is taken out by hand to see which SYNs look.)
#[test]
fn a_port_the_record_holds_is_noted_once_per_generation() {
    on_one_cpu(|| {
        let (mut h, a, b, _policy) = passed_pair(false);
        // The first SYN learns the pair, the second the memo's ingress rule (after its note
        // in the record: the receiver's verdict comes last); the third is settled by the
        // memo both ways, and the record holds its port.
        for port in 40000..40003 {
            assert_eq!(send(&h, &a, &b, TCP, tcp(port, 81, SYN)), TC_ACT_REDIRECT);
        }
        assert_eq!(openers(&h, &a, &b), [(true, 81)]);
        let m = syn_memo(&h, &a, &b);
        assert_ne!(m.known & SYN_RECORDED, 0, "noted in the record: {m:?}");
        let mut records: aya::maps::HashMap<_, u32, PolicyOpeners> =
            aya::maps::HashMap::try_from(Map::HashMap(pinned(&h, POLICY_OPENERS_MAP)))
                .expect("a hash map");
        let (lo, hi) = (a.slot.min(b.slot), a.slot.max(b.slot));
        let key = policy_pair_slots(lo, hi);
        let mut take_out = || records.remove(&key).expect("remove the record");
        // Same port, same generations: the SYN passes without a look.
        take_out();
        assert_eq!(send(&h, &a, &b, TCP, tcp(40003, 81, SYN)), TC_ACT_REDIRECT);
        assert!(openers(&h, &a, &b).is_empty(), "not looked at");
        assert_eq!(remembered(&h), 2, "the first SYN's two, no more");
        // B with a new generation: noted again, and known again from the next SYN on.
        next_generation(&h, &b);
        pairs_current(&mut h, &a, &b);
        for port in [40004, 40005] {
            assert_eq!(send(&h, &a, &b, TCP, tcp(port, 81, SYN)), TC_ACT_REDIRECT);
            assert_eq!(openers(&h, &a, &b), [(true, 81)], "noted by {port}");
        }
        let m = syn_memo(&h, &a, &b);
        assert_ne!(m.known & SYN_RECORDED, 0, "noted again: {m:?}");
        // A with a new generation: noted again.
        take_out();
        next_generation(&h, &a);
        pairs_current(&mut h, &a, &b);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40006, 81, SYN)), TC_ACT_REDIRECT);
        assert_eq!(openers(&h, &a, &b), [(true, 81)]);
        // Another port: noted.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40007, 82, SYN)), TC_ACT_REDIRECT);
        assert_eq!(openers(&h, &a, &b), [(true, 81), (true, 82)]);
    });
}
