//! The policy programmer over in-memory maps: what it leaves pinned across a restart, the
//! identities it writes, endpoints that come and go.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use calix_common::{PolicyState, POL_ISOLATED_EGRESS, POL_ISOLATED_INGRESS, POL_KEEP_ESTABLISHED};
use calix_core::policy::endpoint::Direction;
use calix_core::policy::model::PodKey;
use calix_core::policy::tables::{EndpointTables, EntryKey, RuleId, Tables};
use ipnet::IpNet;

use super::policy::{PolicyMaps, PolicyProgrammer};
use crate::DataplaneError;

#[derive(Default)]
struct Held {
    prefixes: BTreeMap<IpNet, u32>,
    entries: BTreeMap<(u32, Direction, EntryKey), RuleId>,
    states: BTreeMap<u32, PolicyState>,
    /// The entry map's size (None: unbounded).
    capacity: Option<usize>,
    /// Hit counts by (slot, rule).
    hits: BTreeMap<(u32, RuleId), u64>,
    /// Slots whose records of openers were forgotten.
    forgot_openers: Vec<u32>,
    /// Walks of the records (one per call that forgets any).
    walks: usize,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Held>>);

impl Fake {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.0.lock().expect("lock")
    }
}

impl PolicyMaps for Fake {
    fn set_prefix(&mut self, net: IpNet, identity: u32) -> Result<(), DataplaneError> {
        self.held().prefixes.insert(net, identity);
        Ok(())
    }
    fn remove_prefix(&mut self, net: &IpNet) {
        self.held().prefixes.remove(net);
    }
    fn set_entry(
        &mut self,
        slot: u32,
        d: Direction,
        e: &EntryKey,
        rule: RuleId,
    ) -> Result<(), DataplaneError> {
        let mut h = self.held();
        let full = h
            .capacity
            .is_some_and(|c| h.entries.len() >= c && !h.entries.contains_key(&(slot, d, *e)));
        if full {
            return Err(DataplaneError::Driver("no space left in the map".into()));
        }
        h.entries.insert((slot, d, *e), rule);
        Ok(())
    }
    fn remove_entry(&mut self, slot: u32, d: Direction, e: &EntryKey) {
        self.held().entries.remove(&(slot, d, *e));
    }
    fn set_state(&mut self, slot: u32, s: PolicyState) -> Result<(), DataplaneError> {
        if s == PolicyState::default() {
            self.held().states.remove(&slot);
        } else {
            self.held().states.insert(slot, s);
        }
        Ok(())
    }
    fn remove_hits(&mut self, slot: u32, rule: RuleId) {
        self.held().hits.remove(&(slot, rule));
    }
    fn clear_hits(&mut self) {
        self.held().hits.clear();
    }
    fn forget_openers(&mut self, slots: &[u32]) {
        let mut h = self.held();
        h.forgot_openers.extend_from_slice(slots);
        h.walks += 1;
    }
    fn read_back(&self) -> (Tables<u32>, BTreeMap<u32, PolicyState>) {
        let h = self.held();
        let mut t = Tables {
            prefixes: h.prefixes.clone(),
            ..Tables::default()
        };
        for (slot, s) in &h.states {
            let e = t.endpoints.entry(*slot).or_default();
            if s.flags & POL_ISOLATED_INGRESS != 0 {
                e.ingress = Some(BTreeMap::new());
            }
            if s.flags & POL_ISOLATED_EGRESS != 0 {
                e.egress = Some(BTreeMap::new());
            }
        }
        for ((slot, d, k), r) in &h.entries {
            let e = t.endpoints.entry(*slot).or_default();
            let m = match d {
                Direction::Ingress => &mut e.ingress,
                Direction::Egress => &mut e.egress,
            };
            m.get_or_insert_with(BTreeMap::new).insert(*k, *r);
        }
        (t, h.states.clone())
    }
}

fn pod(name: &str) -> PodKey {
    PodKey {
        namespace: "ns".into(),
        name: name.into(),
    }
}

fn entry(identity: u32) -> EntryKey {
    EntryKey {
        identity,
        proto: Some(6),
        port: 80,
        port_bits: 16,
    }
}

/// Tables in which `web` lets identity 1 (`net`) in on TCP 80.
fn tables(net: &str) -> Tables {
    let mut t = Tables::default();
    t.prefixes.insert(net.parse().expect("net"), 1);
    t.endpoints.insert(
        pod("web"),
        EndpointTables {
            ingress: Some([(entry(1), 1)].into()),
            egress: None,
        },
    );
    t
}

#[test]
fn the_pins_stay_until_the_agent_says_and_its_identities_never_reuse_theirs() {
    let fake = Fake::default();
    // What an earlier agent left: slot 3 isolated, identity 7 let in.
    {
        let mut h = fake.held();
        h.prefixes.insert("10.0.0.9/32".parse().expect("net"), 7);
        h.entries.insert((3, Direction::Ingress, entry(7)), 4);
        h.states.insert(
            3,
            PolicyState {
                flags: POL_ISOLATED_INGRESS,
                generation: 12,
            },
        );
        // The pods of slots 9 and 10 were deleted while no agent ran: their states are
        // still there.
        for slot in [9, 10] {
            h.states.insert(
                slot,
                PolicyState {
                    flags: POL_ISOLATED_INGRESS | POL_ISOLATED_EGRESS,
                    generation: 11,
                },
            );
        }
    }
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    // An endpoint attached before the agent has computed anything: the pins stay.
    p.attached(&[(pod("web"), 3)]).expect("attach");
    assert_eq!(fake.held().entries.len(), 1);
    assert_eq!(fake.held().prefixes.len(), 1);
    // The agent's first tables (its identity 1): written above every pinned identity, the
    // old ones gone, a new generation so established flows are checked again.
    p.set(tables("10.0.0.5/32"), &[(pod("web"), 3)])
        .expect("set");
    let h = fake.held();
    assert_eq!(
        h.prefixes,
        [("10.0.0.5/32".parse().expect("net"), 8)].into(),
        "identity 1 shifted past 7"
    );
    assert_eq!(
        h.entries.keys().copied().collect::<Vec<_>>(),
        vec![(3, Direction::Ingress, entry(8))]
    );
    assert_eq!(h.states[&3].flags, POL_ISOLATED_INGRESS);
    assert!(h.states[&3].generation > 12, "{:?}", h.states[&3]);
    // The slots no endpoint holds are open, and their records of openers are forgotten (one
    // walk of the records): a pod that gets one next inherits neither.
    for slot in [9, 10] {
        assert_eq!(h.states[&slot].flags, 0);
        assert!(h.states[&slot].generation > 12, "{:?}", h.states[&slot]);
    }
    assert_eq!(h.forgot_openers, [9, 10]);
    assert_eq!(h.walks, 1);
}

/// Generations are what the programs keep their caches by (the SYN memo's rules, flows not to
/// be checked again): a restarted agent never hands out one that an endpoint before it had,
/// also when that endpoint was the last to get one and is gone.
#[test]
fn a_restarted_agent_never_hands_out_a_generation_again() {
    let fake = Fake::default();
    let mut t = tables("10.0.0.5/32");
    t.endpoints.insert(
        pod("db"),
        EndpointTables {
            ingress: Some([(entry(1), 2)].into()),
            egress: None,
        },
    );
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    // db comes last: the highest generation is its.
    p.set(t, &[(pod("web"), 7)]).expect("set");
    p.attached(&[(pod("web"), 7), (pod("db"), 4)])
        .expect("attach");
    let handed: Vec<u32> = fake.held().states.values().map(|s| s.generation).collect();
    assert_eq!(handed.len(), 2);
    // db goes; then the agent restarts.
    p.detached(4);
    let gone = fake.held().states.get(&4).copied().unwrap_or_default();
    assert_eq!(gone.flags, 0, "slot 4 is open");
    drop(p);
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    // A new pod in db's slot, isolated: a generation no endpoint had.
    let mut t2 = tables("10.0.0.5/32");
    t2.endpoints.insert(
        pod("cache"),
        EndpointTables {
            ingress: Some([(entry(1), 2)].into()),
            egress: None,
        },
    );
    p.set(t2, &[(pod("web"), 7), (pod("cache"), 4)])
        .expect("set");
    let now = fake.held().states[&4];
    assert_eq!(now.flags, POL_ISOLATED_INGRESS);
    let before = handed.iter().chain([&gone.generation]).max().copied();
    assert!(
        Some(now.generation) > before,
        "{now:?} after {handed:?} and {gone:?}"
    );
}

#[test]
fn endpoints_get_their_pods_entries_when_attached_and_lose_them_when_gone() {
    let fake = Fake::default();
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    // Desired before the endpoint exists: nothing to write for it yet.
    p.set(tables("10.0.0.5/32"), &[]).expect("set");
    assert!(fake.held().entries.is_empty());
    assert!(fake.held().states.is_empty());
    // Attached in slot 5: its pod's entries and isolation.
    p.attached(&[(pod("web"), 5)]).expect("attach");
    assert_eq!(fake.held().entries.len(), 1);
    assert_eq!(fake.held().states[&5].flags, POL_ISOLATED_INGRESS);
    // Gone: entries, state and records of openers go, the slot is open for whoever gets it
    // next.
    p.detached(5);
    assert!(fake.held().entries.is_empty());
    assert_eq!(fake.held().states[&5].flags, 0);
    assert_eq!(fake.held().forgot_openers, [5]);
    // A pod the calculation knows and no policy names is attached: nothing isolates it.
    let mut t = tables("10.0.0.5/32");
    t.endpoints.insert(pod("other"), EndpointTables::default());
    p.set(t, &[]).expect("set");
    p.attached(&[(pod("other"), 6)]).expect("attach");
    let isolated = |slot| fake.held().states.get(&slot).map_or(0, |s| s.flags);
    assert_eq!((isolated(5), isolated(6)), (0, 0));
    // A pod it does not know yet (its CNI ADD ahead of the watch): isolated both ways, no
    // entry; once known, as its policy says.
    p.attached(&[(pod("other"), 6), (pod("new"), 7)])
        .expect("attach");
    assert_eq!(
        fake.held().states[&7].flags,
        POL_ISOLATED_INGRESS | POL_ISOLATED_EGRESS
    );
    assert!(fake.held().entries.is_empty());
    let mut t = tables("10.0.0.5/32");
    t.endpoints.insert(pod("other"), EndpointTables::default());
    t.endpoints.insert(pod("new"), EndpointTables::default());
    p.set(t, &[(pod("other"), 6), (pod("new"), 7)])
        .expect("set");
    let flags = |slot| fake.held().states.get(&slot).map_or(0, |s| s.flags);
    assert_eq!((flags(6), flags(7)), (0, 0), "neither isolated");
}

#[test]
fn an_endpoint_whose_entries_do_not_fit_denies_what_is_missing_and_the_others_are_untouched() {
    let fake = Fake::default();
    fake.held().capacity = Some(3);
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    let mut t = tables("10.0.0.5/32");
    // web: three entries; db: one more, which does not fit.
    let web = t.endpoints.get_mut(&pod("web")).expect("web");
    let ingress = web.ingress.as_mut().expect("isolated");
    ingress.insert(
        EntryKey {
            port: 81,
            ..entry(1)
        },
        1,
    );
    ingress.insert(
        EntryKey {
            port: 82,
            ..entry(1)
        },
        1,
    );
    t.endpoints.insert(
        pod("db"),
        EndpointTables {
            ingress: Some([(entry(1), 2)].into()),
            egress: None,
        },
    );
    let slots = [(pod("web"), 1), (pod("db"), 2)];
    let err = p.set(t.clone(), &slots).expect_err("the map is full");
    match &err {
        DataplaneError::PolicyIncomplete { slots, pods, .. } => {
            assert_eq!(slots, &vec![2]);
            assert_eq!(pods, &vec![pod("db")], "the error names the pod");
        }
        other => panic!("{other}"),
    }
    {
        let h = fake.held();
        assert_eq!(
            h.entries.keys().filter(|(s, _, _)| *s == 1).count(),
            3,
            "web whole"
        );
        assert_eq!(h.entries.keys().filter(|(s, _, _)| *s == 2).count(), 0);
        // db is isolated all the same: it denies what could not be written.
        assert_eq!(h.states[&2].flags, POL_ISOLATED_INGRESS);
        assert_eq!(h.states[&1].flags, POL_ISOLATED_INGRESS);
    }
    // Room again: the next call writes what is missing.
    fake.held().capacity = None;
    p.set(t, &slots).expect("set");
    assert_eq!(fake.held().entries.len(), 4);
}

/// The bench's sequence on one node: a policy isolating `server` always in force, `allow`
/// (pods labelled `access: yes` may come in) deleted and written again, the tables compiled
/// by one compiler as the agent does: after every programming, what the maps hold gives the
/// client the verdict the tables do.
#[test]
fn a_policy_deleted_and_written_again_is_enforced_again() {
    use calix_core::policy::cluster::{Change, Cluster};
    use calix_core::policy::compiler::Compiler;
    use calix_core::policy::model::{Namespaces, Peer, Pod, Policy, PolicyKey, Rule};
    use calix_core::policy::tables::Verdict;
    use calix_core::selector::LabelSelector;
    let sel = |k: &str, v: &str| LabelSelector {
        match_labels: [(k.to_string(), v.to_string())].into(),
        ..Default::default()
    };
    let pod_at = |name: &str, labels: &[(&str, &str)], ip: &str| Pod {
        key: pod(name),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ips: vec![ip.parse().expect("ip")],
        ports: Vec::new(),
        host_network: false,
    };
    let policy = |name: &str, ingress: Vec<Rule>| Policy {
        key: PolicyKey {
            namespace: "ns".into(),
            name: name.into(),
        },
        pod_selector: sel("lat", "server"),
        ingress: Some(ingress),
        egress: None,
        unreadable_selector: None,
    };
    let allow = policy(
        "allow",
        vec![Rule {
            peers: vec![Peer::Pods {
                namespaces: Namespaces::Named("ns".into()),
                pods: sel("access", "yes"),
            }],
            ports: Vec::new(),
            unreadable: None,
        }],
    );
    let mut c = Cluster::new();
    c.apply(Change::Namespace {
        name: "ns".into(),
        labels: Default::default(),
    });
    c.apply(Change::Pod(pod_at(
        "client",
        &[("access", "yes")],
        "10.0.0.1",
    )));
    c.apply(Change::Pod(pod_at(
        "server",
        &[("lat", "server")],
        "10.0.0.2",
    )));
    c.apply(Change::Policy(policy("isolate", Vec::new())));
    c.apply(Change::Policy(allow.clone()));
    let fake = Fake::default();
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    let mut compiler = Compiler::new();
    let slots = [(pod("client"), 1), (pod("server"), 2)];
    let client: std::net::IpAddr = "10.0.0.1".parse().expect("ip");
    let mut program = |c: &Cluster, want_open: bool, step: &str| {
        let computed = [pod("client"), pod("server")]
            .into_iter()
            .filter_map(|k| Some((k.clone(), c.endpoint(&k)?)))
            .collect();
        let t = compiler.compile(&computed, |s| c.members(s));
        let wanted = t.verdict(&pod("server"), Direction::Ingress, client, 6, 7100);
        assert_eq!(wanted != Verdict::Denied, want_open, "{step}: the tables");
        p.set(t, &slots).expect("set");
        let (held, _) = fake.read_back();
        let got = held.verdict(&2, Direction::Ingress, client, 6, 7100);
        assert_eq!(
            got != Verdict::Denied,
            want_open,
            "{step}: the maps hold {got:?}"
        );
    };
    program(&c, true, "allow in force");
    for round in 0..3 {
        c.apply(Change::PolicyGone(allow.key.clone()));
        program(&c, false, &format!("round {round}: allow deleted"));
        c.apply(Change::Policy(allow.clone()));
        program(&c, true, &format!("round {round}: allow written again"));
    }
}

/// `keep_established` marks every isolated endpoint's state, and only those; changing it
/// (a restart with the option changed) rewrites them with a new generation, so that their
/// flows are checked again under the new setting.
#[test]
fn keep_established_marks_isolated_endpoints_and_a_change_rechecks_their_flows() {
    let fake = Fake::default();
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    p.set_keep_established(true).expect("keep");
    let mut t = tables("10.0.0.5/32");
    t.endpoints.insert(pod("open"), EndpointTables::default());
    p.set(t, &[(pod("web"), 3), (pod("open"), 4)]).expect("set");
    let before = fake.held().states.clone();
    assert_eq!(
        before[&3].flags,
        POL_ISOLATED_INGRESS | POL_KEEP_ESTABLISHED
    );
    assert!(!before.contains_key(&4), "an open endpoint stays zeroed");
    // Restarted with the option off.
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    p.set_keep_established(false).expect("keep off");
    let after = fake.held().states.clone();
    assert_eq!(after[&3].flags, POL_ISOLATED_INGRESS);
    assert!(after[&3].generation > before[&3].generation, "{after:?}");
    // The same setting again: nothing moves.
    p.set_keep_established(false).expect("keep off again");
    assert_eq!(fake.held().states, after);
}

#[test]
fn hit_counts_go_with_their_rules_entries_and_endpoints_and_start_over_with_the_agent() {
    let fake = Fake::default();
    // Counts an agent before left: its rule numbers mean nothing to this one.
    fake.held().hits.insert((9, 4), 7);
    let mut p = PolicyProgrammer::restore(Box::new(fake.clone()));
    p.set(tables("10.0.0.5/32"), &[(pod("web"), 5)])
        .expect("set");
    assert!(fake.held().hits.is_empty(), "cleared at the first tables");
    // The programs count: rule 1 decided for slot 5 (and for slot 6, another endpoint).
    fake.held().hits.insert((5, 1), 3);
    // Another rule number for the same entry, and a second entry of rule 1: the count of
    // (5, 1) stays while one of its entries does.
    let mut t = tables("10.0.0.5/32");
    t.endpoints.insert(
        pod("web"),
        EndpointTables {
            ingress: Some([(entry(1), 1), (entry(2), 2)].into()),
            egress: None,
        },
    );
    t.prefixes.insert("10.0.0.6/32".parse().expect("net"), 2);
    p.set(t, &[(pod("web"), 5)]).expect("set");
    assert_eq!(fake.held().hits.get(&(5, 1)), Some(&3));
    fake.held().hits.insert((5, 2), 1);
    // Rule 1's entry goes: its count goes; rule 2's stays.
    let mut t = tables("10.0.0.6/32");
    t.prefixes.clear();
    t.prefixes.insert("10.0.0.6/32".parse().expect("net"), 2);
    t.endpoints.insert(
        pod("web"),
        EndpointTables {
            ingress: Some([(entry(2), 2)].into()),
            egress: None,
        },
    );
    p.set(t, &[(pod("web"), 5)]).expect("set");
    assert_eq!(
        fake.held().hits.keys().copied().collect::<Vec<_>>(),
        vec![(5, 2)]
    );
    // The endpoint goes: every count of its slot goes.
    p.detached(5);
    assert!(fake.held().hits.is_empty());
}
