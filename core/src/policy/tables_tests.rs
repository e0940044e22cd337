//! The tables against the calculation they compile: for random clusters, every probe's
//! verdict through identities and entries is the one the endpoint's rules give over the sets'
//! members; and a plan, applied one step at a time, never denies a flow allowed both before and
//! after it.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use super::cluster::{Change, Cluster};
use super::compiler::Compiler;
use super::endpoint::{Direction, EndpointPolicy, PeerMatch, Ports};
use super::model::*;
use super::sets::SetKey;
use super::tables::*;
use crate::selector::LabelSelector;
use crate::test_rng::Rng;

const NAMESPACES: [&str; 3] = ["a", "b", "c"];
const LOCAL: [(&str, &str); 3] = [("a", "l0"), ("a", "l1"), ("b", "l2")];

fn labels(r: &mut Rng) -> Labels {
    let mut l = Labels::new();
    for k in ["app", "tier"] {
        if r.chance(70) {
            l.insert(k.into(), r.pick(&["x", "y", "z"]).to_string());
        }
    }
    l
}

fn selector(r: &mut Rng) -> LabelSelector {
    let mut s = LabelSelector::default();
    if r.chance(70) {
        let k = *r.pick(&["app", "tier"]);
        s.match_labels
            .insert(k.into(), r.pick(&["x", "y", "z"]).to_string());
    }
    s
}

fn pod(r: &mut Rng, ns: &str, name: &str, index: usize) -> Pod {
    let mut ips: Vec<IpAddr> = vec![format!("10.0.{}.{}", index / 200, index % 200 + 1)
        .parse()
        .expect("v4")];
    if r.chance(50) {
        ips.push(format!("fd00::{:x}", index + 1).parse().expect("v6"));
    }
    let ports = if r.chance(60) {
        vec![NamedPort {
            name: "http".into(),
            protocol: *r.pick(&[Protocol::Tcp, Protocol::Udp]),
            port: *r.pick(&[80, 81, 8080]),
        }]
    } else {
        Vec::new()
    };
    Pod {
        key: PodKey {
            namespace: ns.into(),
            name: name.into(),
        },
        labels: labels(r),
        ips,
        ports,
        host_network: r.chance(5),
    }
}

fn peer(r: &mut Rng) -> Peer {
    match r.below(4) {
        0 => Peer::Pods {
            namespaces: Namespaces::Named(r.pick(&NAMESPACES).to_string()),
            pods: selector(r),
        },
        1 => Peer::Pods {
            namespaces: Namespaces::Selected(selector(r)),
            pods: selector(r),
        },
        2 => Peer::Block {
            cidr: net(r.pick::<&str>(&["10.0.0.0/16", "10.0.0.0/24", "0.0.0.0/0", "fd00::/64"])),
            except: if r.chance(60) {
                vec![net(r.pick::<&str>(&[
                    "10.0.0.0/28",
                    "10.0.0.4/30",
                    "10.0.0.7/32",
                    "fd00::/124",
                ]))]
            } else {
                Vec::new()
            },
        },
        _ => Peer::Block {
            cidr: net(r.pick::<&str>(&["10.0.0.0/29", "10.0.0.5/32", "192.168.0.0/16"])),
            except: Vec::new(),
        },
    }
}

fn port(r: &mut Rng) -> PortMatch {
    let protocol = *r.pick(&[Protocol::Tcp, Protocol::Udp, Protocol::Sctp]);
    let (port, end_port) = match r.below(4) {
        0 => (None, None),
        1 => (Some(PortRef::Number(*r.pick(&[80, 81, 443]))), None),
        2 => (
            Some(PortRef::Number(1000)),
            Some(*r.pick(&[1000, 1003, 1030])),
        ),
        _ => (Some(PortRef::Name("http".into())), None),
    };
    PortMatch {
        protocol,
        port,
        end_port,
    }
}

fn rules(r: &mut Rng) -> Option<Vec<Rule>> {
    if r.chance(30) {
        return None;
    }
    Some(
        (0..r.below(3))
            .map(|_| Rule {
                peers: (0..r.below(3)).map(|_| peer(r)).collect(),
                ports: (0..r.below(3)).map(|_| port(r)).collect(),
                unreadable: None,
            })
            .collect(),
    )
}

fn policy(r: &mut Rng, name: &str) -> Policy {
    Policy {
        key: PolicyKey {
            namespace: r.pick(&NAMESPACES[..2]).to_string(),
            name: name.into(),
        },
        pod_selector: selector(r),
        ingress: rules(r),
        egress: rules(r),
        unreadable_selector: None,
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("net")
}

fn key(ns: &str, name: &str) -> PodKey {
    PodKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

/// A random cluster: namespaces, 12 remote pods, the local ones, 4 policies.
fn changes(r: &mut Rng) -> Vec<Change> {
    let mut out: Vec<Change> = NAMESPACES
        .iter()
        .map(|n| Change::Namespace {
            name: n.to_string(),
            labels: labels(r),
        })
        .collect();
    for (i, (ns, name)) in LOCAL.iter().enumerate() {
        let mut p = pod(r, ns, name, i);
        p.host_network = false;
        out.push(Change::Pod(p));
    }
    for i in 0..12 {
        let ns = r.pick(&NAMESPACES).to_string();
        out.push(Change::Pod(pod(r, &ns, &format!("p{i}"), i + 10)));
    }
    for i in 0..4 {
        out.push(Change::Policy(policy(r, &format!("np{i}"))));
    }
    out
}

/// One more random change to a cluster made by [`changes`].
fn churn(r: &mut Rng, c: &Cluster) -> Change {
    match r.below(5) {
        0 => Change::Namespace {
            name: r.pick(&NAMESPACES).to_string(),
            labels: labels(r),
        },
        1 => {
            // Another pod, or the same one moved or relabelled (a pod's namespace is part of
            // its key: a move is another pod, the old one stays).
            let i = r.below(12);
            let ns = r.pick(&NAMESPACES).to_string();
            let gone = c.pod(&key(&ns, &format!("p{i}"))).is_some() && r.chance(30);
            if gone {
                Change::PodGone(key(&ns, &format!("p{i}")))
            } else {
                Change::Pod(pod(r, &ns, &format!("p{i}"), i + 10))
            }
        }
        2 => {
            let (ns, name) = *r.pick(&LOCAL);
            let index = LOCAL.iter().position(|l| l.1 == name).unwrap_or(0);
            let mut p = pod(r, ns, name, index);
            p.host_network = false;
            Change::Pod(p)
        }
        3 => {
            let name = format!("np{}", r.below(5));
            Change::Policy(policy(r, &name))
        }
        _ => {
            let ns = *r.pick(&NAMESPACES[..2]);
            Change::PolicyGone(PolicyKey {
                namespace: ns.into(),
                name: format!("np{}", r.below(5)),
            })
        }
    }
}

fn endpoints(c: &Cluster) -> BTreeMap<PodKey, EndpointPolicy> {
    LOCAL
        .iter()
        .filter_map(|(ns, n)| Some((key(ns, n), c.endpoint(&key(ns, n))?)))
        .collect()
}

/// The ports `ip` has in `set` (None: not a named-port member), by the set's longest member
/// covering it; empty when it is not in the set.
fn membership(c: &Cluster, set: &SetKey, ip: IpAddr) -> Vec<Option<u16>> {
    let members = c.members(set);
    let covering: Vec<_> = members.iter().filter(|m| m.net.contains(&ip)).collect();
    let Some(longest) = covering.iter().map(|m| m.net.prefix_len()).max() else {
        return Vec::new();
    };
    let at: Vec<_> = covering
        .into_iter()
        .filter(|m| m.net.prefix_len() == longest)
        .collect();
    if at.iter().any(|m| m.excluded) {
        return Vec::new();
    }
    at.iter().map(|m| m.port).collect()
}

/// What the endpoint's rules say, straight from the calculation.
fn oracle(c: &Cluster, e: &EndpointPolicy, d: Direction, ip: IpAddr, proto: u8, port: u16) -> bool {
    let Some(allows) = e.direction(d) else {
        return true;
    };
    allows.iter().any(|a| {
        let ports = match &a.peer {
            PeerMatch::Any => vec![None],
            PeerMatch::Set(s) => membership(c, s, ip),
        };
        !ports.is_empty()
            && match &a.ports {
                Ports::Any => true,
                Ports::Ranges(rs) => rs
                    .iter()
                    .any(|r| r.protocol.number() == proto && (r.first..=r.last).contains(&port)),
                Ports::OfMember(p) => p.number() == proto && ports.contains(&Some(port)),
            }
    })
}

/// Peers worth probing: every pod address, and addresses in and around the blocks.
fn probe_peers(c: &Cluster) -> Vec<IpAddr> {
    let mut out: BTreeSet<IpAddr> = BTreeSet::new();
    for (ns, n) in LOCAL {
        if let Some(p) = c.pod(&key(ns, n)) {
            out.extend(p.ips.iter().copied());
        }
    }
    for i in 0..40 {
        out.insert(format!("10.0.0.{i}").parse().expect("v4"));
    }
    for s in [
        "10.0.1.1",
        "10.1.0.1",
        "192.168.3.4",
        "8.8.8.8",
        "fd00::1",
        "fd00::5",
        "fd00::11",
        "fd00::1:0:0:1",
        "2001:db8::1",
    ] {
        out.insert(s.parse().expect("ip"));
    }
    out.into_iter().collect()
}

const PROBES: [(u8, u16); 12] = [
    (6, 80),
    (6, 81),
    (6, 443),
    (6, 1000),
    (6, 1003),
    (6, 1004),
    (17, 80),
    (17, 8080),
    (17, 1029),
    (132, 80),
    (132, 443),
    (1, 0),
];

fn allowed(v: Verdict) -> bool {
    v != Verdict::Denied
}

fn check_against_oracle(c: &Cluster, t: &Tables, seed: u64, step: usize) {
    let eps = endpoints(c);
    for (k, e) in &eps {
        for d in [Direction::Ingress, Direction::Egress] {
            for ip in probe_peers(c) {
                for (proto, port) in PROBES {
                    let want = oracle(c, e, d, ip, proto, port);
                    let got = allowed(t.verdict(k, d, ip, proto, port));
                    assert_eq!(
                        got, want,
                        "seed {seed} step {step}: {k} {d} peer {ip} {proto}/{port}\n{e:#?}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_tables_give_every_probe_the_verdict_of_the_rules() {
    for seed in 1..=40u64 {
        let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut c = Cluster::new();
        for ch in changes(&mut r) {
            c.apply(ch);
        }
        let mut compiler = Compiler::new();
        let t = compiler.compile(&endpoints(&c), |s| c.members(s));
        check_against_oracle(&c, &t, seed, 0);
        // Each rule an entry names is a rule of a policy selecting that endpoint.
        for (k, et) in &t.endpoints {
            let e = &endpoints(&c)[k];
            for r in [&et.ingress, &et.egress]
                .into_iter()
                .flatten()
                .flat_map(|m| m.values())
            {
                assert!(
                    e.policies.contains(&t.rules[r].policy),
                    "{k}: {:?}",
                    t.rules[r]
                );
            }
        }
    }
}

/// The dataplane as a plan leaves it mid-way: isolation apart from the entries.
#[derive(Clone, Default)]
struct Mid {
    prefixes: BTreeMap<IpNet, Identity>,
    entries: BTreeMap<(PodKey, Direction), BTreeMap<EntryKey, RuleId>>,
    isolation: BTreeMap<PodKey, (bool, bool)>,
}

impl Mid {
    fn of(t: &Tables) -> Self {
        let mut m = Self {
            prefixes: t.prefixes.clone(),
            ..Self::default()
        };
        for (k, e) in &t.endpoints {
            m.isolation.insert(k.clone(), e.isolation());
            for d in [Direction::Ingress, Direction::Egress] {
                if let Some(es) = e.direction(d) {
                    m.entries.insert((k.clone(), d), es.clone());
                }
            }
        }
        m
    }

    fn tables(&self) -> Tables {
        let mut t: Tables = Tables {
            prefixes: self.prefixes.clone(),
            ..Tables::default()
        };
        for (k, (i, e)) in &self.isolation {
            let of = |d| {
                self.entries
                    .get(&(k.clone(), d))
                    .cloned()
                    .unwrap_or_default()
            };
            t.endpoints.insert(
                k.clone(),
                EndpointTables {
                    ingress: i.then(|| of(Direction::Ingress)),
                    egress: e.then(|| of(Direction::Egress)),
                },
            );
        }
        t
    }

    /// Applies `plan` step by step, calling `each` with the tables after each step.
    fn apply(&mut self, plan: &Plan, mut each: impl FnMut(&Tables)) {
        for (k, i) in &plan.open {
            self.isolation.insert(k.clone(), *i);
            each(&self.tables());
        }
        for (e, r) in &plan.add_entries {
            self.entries
                .entry((e.endpoint.clone(), e.direction))
                .or_default()
                .insert(e.key, *r);
            each(&self.tables());
        }
        for (n, id) in &plan.set_prefixes {
            self.prefixes.insert(*n, *id);
            each(&self.tables());
        }
        for n in &plan.remove_prefixes {
            self.prefixes.remove(n);
            each(&self.tables());
        }
        for (k, i) in &plan.isolation {
            self.isolation.insert(k.clone(), *i);
            each(&self.tables());
        }
        for e in &plan.remove_entries {
            if let Some(m) = self.entries.get_mut(&(e.endpoint.clone(), e.direction)) {
                m.remove(&e.key);
            }
            each(&self.tables());
        }
    }
}

/// The tables less their rule names and open endpoints: what the dataplane holds.
fn normal(t: &Tables) -> Tables {
    let mut t = t.clone();
    t.rules.clear();
    t.endpoints.retain(|_, e| *e != EndpointTables::default());
    t
}

#[test]
fn a_plan_never_denies_a_flow_allowed_before_and_after_it() {
    for seed in 1..=12u64 {
        let mut r = Rng(seed.wrapping_mul(0xd1b5_4a32_d192_ed03) | 1);
        let mut c = Cluster::new();
        for ch in changes(&mut r) {
            c.apply(ch);
        }
        let mut compiler = Compiler::new();
        let mut old = compiler.compile(&endpoints(&c), |s| c.members(s));
        let mut mid = Mid::of(&old);
        for step in 1..=10 {
            let ch = churn(&mut r, &c);
            c.apply(ch);
            let new = compiler.compile(&endpoints(&c), |s| c.members(s));
            check_against_oracle(&c, &new, seed, step);
            let p = plan(&old, &new);
            // The flows allowed before and after, probed at every step of the plan.
            let keys: Vec<PodKey> = new.endpoints.keys().cloned().collect();
            let mut both = Vec::new();
            for k in &keys {
                for d in [Direction::Ingress, Direction::Egress] {
                    for ip in probe_peers(&c) {
                        for (proto, port) in PROBES {
                            if allowed(old.verdict(k, d, ip, proto, port))
                                && allowed(new.verdict(k, d, ip, proto, port))
                            {
                                both.push((k.clone(), d, ip, proto, port));
                            }
                        }
                    }
                }
            }
            mid.apply(&p, |t| {
                for (k, d, ip, proto, port) in &both {
                    assert!(
                        allowed(t.verdict(k, *d, *ip, *proto, *port)),
                        "seed {seed} step {step}: {k} {d} {ip} {proto}/{port} denied mid-plan\nold {:?} new {:?}\n{p:#?}\nold {old:#?}\nnew {new:#?}", old.identity_of(*ip), new.identity_of(*ip)
                    );
                }
            });
            // Endpoints gone from the node: the dataplane forgets them with the endpoint.
            mid.isolation.retain(|k, _| new.endpoints.contains_key(k));
            mid.entries
                .retain(|(k, _), _| new.endpoints.contains_key(k));
            assert_eq!(
                normal(&mid.tables()),
                normal(&new),
                "seed {seed} step {step}"
            );
            old = new;
        }
    }
}

#[test]
fn port_ranges_become_the_fewest_aligned_blocks() {
    assert_eq!(port_blocks(0, u16::MAX), vec![(0, 0)]);
    assert_eq!(port_blocks(80, 80), vec![(80, 16)]);
    assert_eq!(port_blocks(1000, 1003), vec![(1000, 14)]);
    assert_eq!(
        port_blocks(1000, 1030),
        vec![(1000, 13), (1008, 12), (1024, 14), (1028, 15), (1030, 16)]
    );
    assert_eq!(port_blocks(65535, 65535), vec![(65535, 16)]);
    assert_eq!(port_blocks(1, u16::MAX).len(), 16);
    // Every port of a range is covered once, and no other.
    for (first, last) in [(3u16, 17u16), (1, 1024), (32768, 65535), (5, 5)] {
        let blocks = port_blocks(first, last);
        for p in 0..=u16::MAX {
            let n = blocks
                .iter()
                .filter(|(b, bits)| {
                    EntryKey {
                        identity: 1,
                        proto: Some(6),
                        port: *b,
                        port_bits: *bits,
                    }
                    .covers(1, 6, p)
                })
                .count();
            assert_eq!(
                n,
                usize::from((first..=last).contains(&p)),
                "{first}-{last}: {p}"
            );
        }
    }
}

#[test]
fn identities_and_rules_keep_their_numbers_while_they_live() {
    let mut r = Rng(7);
    let mut c = Cluster::new();
    for ch in changes(&mut r) {
        c.apply(ch);
    }
    let mut compiler = Compiler::new();
    let a = compiler.compile(&endpoints(&c), |s| c.members(s));
    let b = compiler.compile(&endpoints(&c), |s| c.members(s));
    assert_eq!(a, b);
    assert!(plan(&a, &b).is_empty());
}

/// The Service ranges become one identity of their own, which no rule names: an ipBlock inside
/// a range is left out, one around it stops at it, and the other addresses keep theirs.
#[test]
fn service_ranges_take_their_addresses_out_of_every_rule() {
    let t: Tables = Tables {
        prefixes: [
            (net("10.0.0.0/8"), 3),
            (net("10.96.4.0/24"), 4),
            (net("10.244.1.7/32"), 5),
            (net("fd00:96::1/128"), 6),
        ]
        .into(),
        ..Tables::default()
    };
    let t = t.with_services(&[
        net("10.96.0.0/12"),
        net("fd00:96::/108"),
        net("10.96.3.9/12"),
    ]);
    let id = |a: &str| t.identity_of(a.parse().expect("ip"));
    assert_eq!(id("10.96.0.10"), SERVICE);
    assert_eq!(
        id("10.96.4.1"),
        SERVICE,
        "an ipBlock inside the range is gone"
    );
    assert_eq!(id("fd00:96::1"), SERVICE);
    assert_eq!(
        id("10.1.2.3"),
        3,
        "the ipBlock around it still covers the rest"
    );
    assert_eq!(id("10.244.1.7"), 5);
    assert_eq!(id("192.0.2.1"), WORLD);
    assert!(!t.prefixes.contains_key(&net("10.96.4.0/24")));
    assert_eq!(
        t.prefixes.len(),
        4,
        "10/8, the pod, and the two ranges (the third repeats one)"
    );
}

/// `t` with each identity named by its first prefix (numbers differ between compilers of
/// different histories) and each rule by what it stands for.
type Canonical = (
    BTreeMap<IpNet, String>,
    BTreeSet<(PodKey, Direction, String, Option<u8>, u16, u8, String)>,
);

fn canonical(t: &Tables) -> Canonical {
    let mut first: BTreeMap<Identity, IpNet> = BTreeMap::new();
    for (net, id) in &t.prefixes {
        first.entry(*id).or_insert(*net);
    }
    let name = |id: Identity| match id {
        WORLD => "world".to_string(),
        ANY_PEER => "any".to_string(),
        x => first
            .get(&x)
            .map_or_else(|| format!("unnamed {x}"), ToString::to_string),
    };
    let prefixes = t.prefixes.iter().map(|(n, id)| (*n, name(*id))).collect();
    let mut entries = BTreeSet::new();
    for (k, e) in &t.endpoints {
        for d in [Direction::Ingress, Direction::Egress] {
            for (ek, r) in e.direction(d).iter().flat_map(|m| m.iter()) {
                entries.insert((
                    k.clone(),
                    d,
                    name(ek.identity),
                    ek.proto,
                    ek.port,
                    ek.port_bits,
                    format!("{:?}", t.rules.get(r)),
                ));
            }
        }
        // Isolation without entries.
        for d in [Direction::Ingress, Direction::Egress] {
            if e.direction(d).as_ref().is_some_and(|m| m.is_empty()) {
                entries.insert((k.clone(), d, "isolated".into(), None, 0, 0, String::new()));
            }
        }
    }
    (prefixes, entries)
}

#[test]
fn a_compilation_from_the_last_gives_what_a_fresh_one_does() {
    for seed in 1..=40u64 {
        let mut r = Rng(seed.wrapping_mul(0xa076_1d64_78bd_642f) | 1);
        let mut c = Cluster::new();
        for ch in changes(&mut r) {
            c.apply(ch);
        }
        let (mut inc, mut full) = (Compiler::new(), Compiler::new());
        let mut changed: BTreeSet<SetKey> = BTreeSet::new();
        let a = inc.compile_changed(&endpoints(&c), &changed, |s| c.members(s));
        let b = full.compile(&endpoints(&c), |s| c.members(s));
        assert_eq!(canonical(&a), canonical(&b), "seed {seed}, first");
        for step in 1..=30 {
            let ch = churn(&mut r, &c);
            changed.extend(c.apply(ch).sets.into_keys());
            // Sometimes a burst of changes, compiled once.
            if r.chance(40) {
                continue;
            }
            let a = inc.compile_changed(&endpoints(&c), &changed, |s| c.members(s));
            changed.clear();
            let b = full.compile(&endpoints(&c), |s| c.members(s));
            assert_eq!(canonical(&a), canonical(&b), "seed {seed}, step {step}");
            check_against_oracle(&c, &a, seed, step);
            // The identities of the prefixes are numbers the entries name, and only those.
            let ids: BTreeSet<Identity> = a.prefixes.values().copied().collect();
            for e in a.endpoints.values() {
                for k in [&e.ingress, &e.egress]
                    .into_iter()
                    .flatten()
                    .flat_map(|m| m.keys())
                {
                    assert!(
                        k.identity == ANY_PEER || ids.contains(&k.identity),
                        "seed {seed}"
                    );
                }
            }
        }
    }
}
