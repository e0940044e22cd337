use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use super::cluster::{Change, Cluster, SetDelta};
use super::endpoint::{compute, Allow, PeerMatch, PortRange, Ports};
use super::model::*;
use super::sets::{Member, SetKey};
use crate::selector::{LabelSelector, Operator, Requirement};

fn labels(kv: &[(&str, &str)]) -> Labels {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn sel(kv: &[(&str, &str)]) -> LabelSelector {
    LabelSelector {
        match_labels: labels(kv),
        match_expressions: Vec::new(),
    }
}

fn pod(ns: &str, name: &str, kv: &[(&str, &str)], ip: &str) -> Pod {
    Pod {
        key: PodKey {
            namespace: ns.into(),
            name: name.into(),
        },
        labels: labels(kv),
        ips: vec![ip.parse().expect("ip")],
        ports: Vec::new(),
        host_network: false,
    }
}

fn key(ns: &str, name: &str) -> PolicyKey {
    PolicyKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

fn policy(
    ns: &str,
    name: &str,
    selector: LabelSelector,
    ingress: Option<Vec<Rule>>,
    egress: Option<Vec<Rule>>,
) -> Policy {
    Policy {
        key: key(ns, name),
        pod_selector: selector,
        ingress,
        egress,
        unreadable_selector: None,
    }
}

fn pods_in(ns: &str, kv: &[(&str, &str)]) -> Peer {
    Peer::Pods {
        namespaces: Namespaces::Named(ns.into()),
        pods: sel(kv),
    }
}

fn tcp(port: u16) -> PortMatch {
    PortMatch {
        protocol: Protocol::Tcp,
        port: Some(PortRef::Number(port)),
        end_port: None,
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("net")
}

fn addr(s: &str) -> Member {
    let ip: IpAddr = s.parse().expect("ip");
    Member {
        net: IpNet::from(ip),
        port: None,
        excluded: false,
    }
}

fn cluster(changes: Vec<Change>) -> Cluster {
    let mut c = Cluster::new();
    for ch in changes {
        c.apply(ch);
    }
    c
}

fn ns(name: &str, kv: &[(&str, &str)]) -> Change {
    Change::Namespace {
        name: name.into(),
        labels: labels(kv),
    }
}

fn pk(ns: &str, name: &str) -> PodKey {
    PodKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

#[test]
fn a_pod_no_policy_selects_is_open_and_a_default_deny_isolates_it() {
    let web = pod("a", "web", &[("app", "web")], "10.0.0.1");
    assert_eq!(compute(&web, []).expect("subject").ingress, None);
    // Default deny for ingress: isolated, nothing allowed; egress untouched.
    let deny = policy("a", "deny", LabelSelector::default(), Some(vec![]), None);
    let e = compute(&web, [&deny]).expect("subject");
    assert_eq!(e.ingress, Some(vec![]));
    assert_eq!(e.egress, None);
    assert_eq!(e.policies, vec![key("a", "deny")]);
    // A policy of another namespace, or whose selector does not match, does nothing.
    let other_ns = policy("b", "deny", LabelSelector::default(), Some(vec![]), None);
    let other_pod = policy("a", "db", sel(&[("app", "db")]), Some(vec![]), Some(vec![]));
    let e = compute(&web, [&other_ns, &other_pod]).expect("subject");
    assert_eq!((e.ingress, e.egress), (None, None));
    // A host-network pod is not subject to policy at all.
    let host = Pod {
        host_network: true,
        ..web.clone()
    };
    assert_eq!(compute(&host, [&deny]), None);
}

#[test]
fn several_policies_allow_the_union_of_their_rules() {
    let web = pod("a", "web", &[("app", "web")], "10.0.0.1");
    let p1 = policy(
        "a",
        "from-fe",
        sel(&[("app", "web")]),
        Some(vec![Rule {
            peers: vec![pods_in("a", &[("app", "fe")])],
            ports: vec![tcp(80)],
            ..Default::default()
        }]),
        None,
    );
    let p2 = policy(
        "a",
        "egress-dns",
        LabelSelector::default(),
        Some(vec![Rule::default()]),
        Some(vec![Rule {
            peers: vec![],
            ports: vec![PortMatch {
                protocol: Protocol::Udp,
                port: Some(PortRef::Number(53)),
                end_port: None,
            }],
            ..Default::default()
        }]),
    );
    let e = compute(&web, [&p1, &p2]).expect("subject");
    let ingress = e.ingress.expect("isolated");
    // p2's empty rule opens everything; p1's still stands beside it (a union).
    assert_eq!(ingress.len(), 2);
    assert!(ingress
        .iter()
        .any(|a| a.peer == PeerMatch::Any && a.ports == Ports::Any));
    assert!(ingress.iter().any(|a| a.policy == key("a", "from-fe")
        && a.ports
            == Ports::Ranges(vec![PortRange {
                protocol: Protocol::Tcp,
                first: 80,
                last: 80
            }])));
    assert_eq!(
        e.egress.expect("isolated"),
        vec![Allow {
            peer: PeerMatch::Any,
            ports: Ports::Ranges(vec![PortRange {
                protocol: Protocol::Udp,
                first: 53,
                last: 53
            }]),
            policy: key("a", "egress-dns"),
            rule: 0,
        }]
    );
}

#[test]
fn ports_ranges_protocols_and_named_ports_on_ingress() {
    let mut db = pod("a", "db", &[("app", "db")], "10.0.0.2");
    db.ports = vec![NamedPort {
        name: "sql".into(),
        protocol: Protocol::Tcp,
        port: 5432,
    }];
    let rule = |ports: Vec<PortMatch>| Rule {
        peers: vec![],
        ports,
        ..Default::default()
    };
    let p = policy(
        "a",
        "p",
        LabelSelector::default(),
        Some(vec![
            rule(vec![PortMatch {
                protocol: Protocol::Tcp,
                port: Some(PortRef::Number(8000)),
                end_port: Some(8080),
            }]),
            rule(vec![PortMatch {
                protocol: Protocol::Sctp,
                port: None,
                end_port: None,
            }]),
            rule(vec![PortMatch {
                protocol: Protocol::Tcp,
                port: Some(PortRef::Name("sql".into())),
                end_port: None,
            }]),
            // A name the pod does not have (or has for another protocol) opens nothing.
            rule(vec![PortMatch {
                protocol: Protocol::Udp,
                port: Some(PortRef::Name("sql".into())),
                end_port: None,
            }]),
        ]),
        None,
    );
    let e = compute(&db, [&p]).expect("subject");
    let got: BTreeSet<(usize, Ports)> = e
        .ingress
        .expect("isolated")
        .into_iter()
        .map(|a| (a.rule, a.ports))
        .collect();
    let r = |protocol, first, last| {
        Ports::Ranges(vec![PortRange {
            protocol,
            first,
            last,
        }])
    };
    assert_eq!(
        got,
        BTreeSet::from([
            (0, r(Protocol::Tcp, 8000, 8080)),
            (1, r(Protocol::Sctp, 0, u16::MAX)),
            (2, r(Protocol::Tcp, 5432, 5432)),
        ])
    );
}

#[test]
fn a_rule_that_cannot_be_enforced_allows_nothing_and_is_reported() {
    let web = pod("a", "web", &[], "10.0.0.1");
    let bad = [
        Rule {
            peers: vec![Peer::Block {
                cidr: net("10.0.0.0/24"),
                except: vec![net("10.1.0.0/28")],
            }],
            ports: vec![],
            ..Default::default()
        },
        Rule {
            peers: vec![],
            ports: vec![PortMatch {
                protocol: Protocol::Tcp,
                port: Some(PortRef::Number(90)),
                end_port: Some(80),
            }],
            ..Default::default()
        },
        Rule {
            peers: vec![Peer::Pods {
                namespaces: Namespaces::Selected(LabelSelector {
                    match_labels: BTreeMap::new(),
                    match_expressions: vec![Requirement {
                        key: "x".into(),
                        operator: Operator::In,
                        values: vec![],
                    }],
                }),
                pods: LabelSelector::default(),
            }],
            ports: vec![],
            ..Default::default()
        },
        Rule {
            peers: vec![],
            ports: vec![PortMatch {
                protocol: Protocol::Tcp,
                port: Some(PortRef::Name("http".into())),
                end_port: Some(90),
            }],
            ..Default::default()
        },
        // What the adapter could not read (e.g. an operator Kubernetes does not have).
        Rule {
            peers: vec![],
            ports: vec![],
            unreadable: Some("namespaceSelector: operator \"Like\"".into()),
        },
    ];
    for (i, rule) in bad.into_iter().enumerate() {
        let p = policy(
            "a",
            "p",
            LabelSelector::default(),
            Some(vec![rule.clone()]),
            Some(vec![rule]),
        );
        let e = compute(&web, [&p]).expect("subject");
        assert_eq!(e.ingress, Some(vec![]), "rule {i}");
        assert_eq!(e.egress, Some(vec![]), "rule {i}");
        assert_eq!(e.problems.len(), 2, "rule {i}: {:?}", e.problems);
    }
    // A policy whose own selector cannot be read isolates every pod of its namespace.
    let p = policy(
        "a",
        "broken",
        LabelSelector {
            match_labels: labels(&[("", "x")]),
            match_expressions: vec![],
        },
        Some(vec![Rule::default()]),
        None,
    );
    let e = compute(&web, [&p]).expect("subject");
    assert!(e.ingress.is_some());
    assert!(e.problems[0].to_string().contains("podSelector"), "{e:?}");
}

#[test]
fn pod_sets_follow_labels_namespaces_and_addresses() {
    let allow_fe = policy(
        "a",
        "fe",
        sel(&[("app", "web")]),
        Some(vec![Rule {
            peers: vec![
                pods_in("a", &[("app", "fe")]),
                Peer::Pods {
                    namespaces: Namespaces::Selected(sel(&[("team", "x")])),
                    pods: LabelSelector::default(),
                },
                Peer::Pods {
                    namespaces: Namespaces::Selected(sel(&[("team", "y")])),
                    pods: sel(&[("app", "fe")]),
                },
            ],
            ports: vec![],
            ..Default::default()
        }]),
        None,
    );
    let mut c = cluster(vec![
        ns("a", &[]),
        ns("b", &[("team", "x")]),
        Change::Pod(pod("a", "web", &[("app", "web")], "10.0.0.1")),
        Change::Pod(pod("a", "fe", &[("app", "fe")], "10.0.0.2")),
        Change::Pod(pod("b", "any", &[], "10.0.0.3")),
        // Namespace c is not known yet: nothing of it matches a namespace selector.
        Change::Pod(pod("c", "fe", &[("app", "fe")], "10.0.0.4")),
        Change::Pod(Pod {
            host_network: true,
            ..pod("a", "hostnet", &[("app", "fe")], "192.168.0.1")
        }),
        Change::Policy(allow_fe.clone()),
    ]);
    let same_ns = SetKey::of(&pods_in("a", &[("app", "fe")]));
    let team_x = SetKey::of(&allow_fe.ingress.as_ref().expect("i")[0].peers[1]);
    let team_y_fe = SetKey::of(&allow_fe.ingress.as_ref().expect("i")[0].peers[2]);
    assert_eq!(c.members(&same_ns), BTreeSet::from([addr("10.0.0.2")]));
    assert_eq!(c.members(&team_x), BTreeSet::from([addr("10.0.0.3")]));
    assert!(c.members(&team_y_fe).is_empty());

    // Namespace c appears with team=y: its fe pod joins that set, and only that set.
    let t = c.apply(ns("c", &[("team", "y")]));
    assert!(t.endpoints.is_empty());
    assert_eq!(
        t.sets,
        BTreeMap::from([(
            team_y_fe.clone(),
            SetDelta {
                added: BTreeSet::from([addr("10.0.0.4")]),
                removed: BTreeSet::new(),
            }
        )])
    );

    // A label change of the fe pod: out of its set; the only endpoint touched is its own.
    let t = c.apply(Change::Pod(pod("a", "fe", &[("app", "other")], "10.0.0.2")));
    assert_eq!(t.endpoints, BTreeSet::from([pk("a", "fe")]));
    assert_eq!(t.sets[&same_ns].removed, BTreeSet::from([addr("10.0.0.2")]));
    assert!(c.members(&same_ns).is_empty());
    // The web endpoint's rules name sets, not addresses: they did not change.
    let web = c.endpoint(&pk("a", "web")).expect("web");
    assert_eq!(web.ingress.expect("isolated").len(), 3);
}

#[test]
fn ip_blocks_keep_their_excepts_and_match_any_address() {
    let block = Peer::Block {
        cidr: net("10.0.0.0/16"),
        except: vec![net("10.0.5.0/24")],
    };
    let set = SetKey::of(&block);
    assert!(set.contains_address("10.0.4.9".parse().expect("ip")));
    assert!(!set.contains_address("10.0.5.9".parse().expect("ip")));
    assert!(!set.contains_address("10.1.0.1".parse().expect("ip")));
    let c = cluster(vec![Change::Policy(policy(
        "a",
        "p",
        LabelSelector::default(),
        None,
        Some(vec![Rule {
            peers: vec![block],
            ports: vec![],
            ..Default::default()
        }]),
    ))]);
    assert_eq!(
        c.members(&set),
        BTreeSet::from([
            Member {
                net: net("10.0.0.0/16"),
                port: None,
                excluded: false
            },
            Member {
                net: net("10.0.5.0/24"),
                port: None,
                excluded: true
            },
        ])
    );
}

#[test]
fn egress_to_a_named_port_resolves_on_each_destination() {
    let with_port = |name: &str, ip: &str, port: u16, app: &str| {
        let mut p = pod("a", name, &[("app", app)], ip);
        p.ports = vec![NamedPort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port,
        }];
        p
    };
    let named = PortMatch {
        protocol: Protocol::Tcp,
        port: Some(PortRef::Name("http".into())),
        end_port: None,
    };
    let p = policy(
        "a",
        "p",
        sel(&[("app", "client")]),
        None,
        Some(vec![
            Rule {
                peers: vec![pods_in("a", &[("app", "srv")])],
                ports: vec![named.clone()],
                ..Default::default()
            },
            Rule {
                peers: vec![Peer::Block {
                    cidr: net("10.0.0.0/24"),
                    except: vec![],
                }],
                ports: vec![named],
                ..Default::default()
            },
        ]),
    );
    let c = cluster(vec![
        ns("a", &[]),
        Change::Pod(pod("a", "client", &[("app", "client")], "10.0.0.1")),
        Change::Pod(with_port("s1", "10.0.0.2", 8080, "srv")),
        Change::Pod(with_port("s2", "10.0.0.3", 9090, "srv")),
        Change::Pod(with_port("other", "10.0.0.4", 7070, "other")),
        Change::Pod(with_port("far", "10.9.0.4", 6060, "other")),
        Change::Pod(pod("a", "noport", &[("app", "srv")], "10.0.0.5")),
        Change::Policy(p),
    ]);
    let e = c.endpoint(&pk("a", "client")).expect("client");
    let egress = e.egress.expect("isolated");
    assert_eq!(egress.len(), 2);
    let member = |ip: &str, port| Member {
        port: Some(port),
        ..addr(ip)
    };
    let sets: Vec<BTreeSet<Member>> = egress
        .iter()
        .map(|a| {
            assert_eq!(a.ports, Ports::OfMember(Protocol::Tcp));
            let PeerMatch::Set(s) = &a.peer else {
                panic!("a set: {a:?}")
            };
            c.members(s)
        })
        .collect();
    // Rule 0: the srv pods that have the port, each with its own number.
    assert!(sets.contains(&BTreeSet::from([
        member("10.0.0.2", 8080),
        member("10.0.0.3", 9090)
    ])));
    // Rule 1: the pods inside the block that have the port.
    assert!(sets.contains(&BTreeSet::from([
        member("10.0.0.2", 8080),
        member("10.0.0.3", 9090),
        member("10.0.0.4", 7070)
    ])));
}

#[test]
fn an_address_taken_over_by_another_pod_stays_in_the_set() {
    let p = policy(
        "a",
        "p",
        LabelSelector::default(),
        Some(vec![Rule {
            peers: vec![pods_in("a", &[("app", "fe")])],
            ports: vec![],
            ..Default::default()
        }]),
        None,
    );
    let set = SetKey::of(&pods_in("a", &[("app", "fe")]));
    let mut c = cluster(vec![
        Change::Policy(p),
        Change::Pod(pod("a", "old", &[("app", "fe")], "10.0.0.7")),
        // The new pod has the address before the old one's deletion is seen.
        Change::Pod(pod("a", "new", &[("app", "fe")], "10.0.0.7")),
    ]);
    let t = c.apply(Change::PodGone(pk("a", "old")));
    assert!(!t.sets.contains_key(&set), "{t:?}");
    assert_eq!(c.members(&set), BTreeSet::from([addr("10.0.0.7")]));
}

#[test]
fn a_policy_change_touches_the_endpoints_it_selected_or_selects() {
    let mut c = cluster(vec![
        Change::Pod(pod("a", "web", &[("app", "web")], "10.0.0.1")),
        Change::Pod(pod("a", "db", &[("app", "db")], "10.0.0.2")),
        Change::Pod(pod("b", "web", &[("app", "web")], "10.0.0.3")),
    ]);
    let p = |app| policy("a", "p", sel(&[("app", app)]), Some(vec![]), None);
    let t = c.apply(Change::Policy(p("web")));
    assert_eq!(t.endpoints, BTreeSet::from([pk("a", "web")]));
    let t = c.apply(Change::Policy(p("db")));
    assert_eq!(t.endpoints, BTreeSet::from([pk("a", "web"), pk("a", "db")]));
    let t = c.apply(Change::PolicyGone(key("a", "p")));
    assert_eq!(t.endpoints, BTreeSet::from([pk("a", "db")]));
    assert_eq!(c.endpoint(&pk("a", "db")).expect("db").ingress, None);
}

/// The incremental state against one built from scratch, after every step of a sequence of
/// changes; and the deltas, applied in order, give the members.
#[test]
fn every_change_leaves_the_sets_as_a_fresh_calculation_would() {
    let fe = pods_in("a", &[("app", "fe")]);
    let team = Peer::Pods {
        namespaces: Namespaces::Selected(sel(&[("team", "x")])),
        pods: sel(&[("tier", "1")]),
    };
    let p1 = policy(
        "a",
        "p1",
        LabelSelector::default(),
        Some(vec![Rule {
            peers: vec![fe.clone(), team.clone()],
            ports: vec![tcp(80)],
            ..Default::default()
        }]),
        None,
    );
    let p2 = policy(
        "a",
        "p2",
        LabelSelector::default(),
        Some(vec![Rule {
            peers: vec![fe],
            ports: vec![],
            ..Default::default()
        }]),
        Some(vec![Rule {
            peers: vec![team],
            ports: vec![PortMatch {
                protocol: Protocol::Tcp,
                port: Some(PortRef::Name("http".into())),
                end_port: None,
            }],
            ..Default::default()
        }]),
    );
    let mut named = pod("b", "n", &[("tier", "1")], "10.0.1.9");
    named.ports = vec![NamedPort {
        name: "http".into(),
        protocol: Protocol::Tcp,
        port: 81,
    }];
    let steps = vec![
        Change::Policy(p1.clone()),
        Change::Pod(pod("a", "f1", &[("app", "fe")], "10.0.0.1")),
        ns("b", &[("team", "x")]),
        Change::Pod(pod("b", "t1", &[("tier", "1")], "10.0.1.1")),
        Change::Policy(p2),
        Change::Pod(named),
        ns("b", &[("team", "z")]),
        Change::Pod(pod("a", "f1", &[("app", "be")], "10.0.0.1")),
        ns("b", &[("team", "x")]),
        Change::PolicyGone(key("a", "p1")),
        Change::Pod(pod("a", "f2", &[("app", "fe")], "10.0.0.2")),
        Change::PodGone(pk("b", "t1")),
        Change::Policy(p1),
        Change::NamespaceGone("b".into()),
        Change::PolicyGone(key("a", "p2")),
        Change::PolicyGone(key("a", "p1")),
    ];
    let mut c = Cluster::new();
    let mut seen: Vec<Change> = Vec::new();
    let mut shadow: BTreeMap<SetKey, BTreeSet<Member>> = BTreeMap::new();
    for step in steps {
        seen.push(step.clone());
        let t = c.apply(step);
        for (set, d) in &t.sets {
            let m = shadow.entry(set.clone()).or_default();
            for r in &d.removed {
                assert!(m.remove(r), "{set:?}: removed {r:?} it did not have");
            }
            for a in &d.added {
                assert!(m.insert(*a), "{set:?}: added {a:?} it had");
            }
        }
        for g in &t.gone {
            assert!(shadow.remove(g).is_some_and(|m| m.is_empty()), "{g:?}");
        }
        let fresh = cluster(seen.clone());
        let sets: BTreeSet<&SetKey> = c.sets().collect();
        assert_eq!(sets, fresh.sets().collect(), "after {:?}", seen.last());
        for s in sets {
            assert_eq!(
                c.members(s),
                fresh.members(s),
                "{s:?} after {:?}",
                seen.last()
            );
            assert_eq!(
                c.members(s),
                shadow.get(s).cloned().unwrap_or_default(),
                "{s:?}: the deltas"
            );
        }
        // Every set an endpoint names is kept.
        for pod in ["f1", "f2"] {
            if let Some(e) = c.endpoint(&pk("a", pod)) {
                for s in e.sets() {
                    assert!(c.sets().any(|k| k == s), "{s:?}");
                }
            }
        }
    }
    assert_eq!(c.counts().3, 0, "no policy left, no set left");
}

#[test]
fn the_report_names_each_rule_whom_it_opens_to_and_how_many_are_in_its_set() {
    use super::report::EndpointReport;
    let allow_web = policy(
        "a",
        "web",
        sel(&[("app", "web")]),
        Some(vec![Rule {
            peers: vec![
                pods_in("a", &[("role", "client")]),
                Peer::Block {
                    cidr: net("10.9.0.0/16"),
                    except: vec![net("10.9.1.0/24")],
                },
            ],
            ports: vec![
                tcp(80),
                PortMatch {
                    protocol: Protocol::Udp,
                    port: Some(PortRef::Number(5000)),
                    end_port: Some(5010),
                },
            ],
            ..Rule::default()
        }]),
        None,
    );
    let c = cluster(vec![
        ns("a", &[]),
        Change::Pod(pod("a", "web", &[("app", "web")], "10.0.0.1")),
        Change::Pod(pod("a", "c1", &[("role", "client")], "10.0.0.2")),
        Change::Pod(pod("a", "c2", &[("role", "client")], "10.0.0.3")),
        Change::Policy(allow_web),
    ]);
    let r = EndpointReport::of(&c, &pk("a", "web"), true).expect("known pod");
    assert_eq!(r.policies, ["a/web"]);
    assert_eq!(r.egress, None, "not isolated for egress");
    let ingress = r.ingress.expect("isolated for ingress");
    let shown: Vec<(&str, &str, Option<usize>)> = ingress
        .iter()
        .map(|x| (x.peer.as_str(), x.ports.as_str(), x.members))
        .collect();
    assert!(
        shown.contains(&("pods role=client in a", "TCP/80,UDP/5000-5010", Some(2))),
        "{shown:?}"
    );
    assert!(
        shown.contains(&(
            "10.9.0.0/16 except 10.9.1.0/24",
            "TCP/80,UDP/5000-5010",
            Some(1)
        )),
        "{shown:?}"
    );
    assert!(ingress.iter().all(|x| x.policy == "a/web" && x.rule == 0));
    // A pod no policy selects: known, not isolated.
    let open = EndpointReport::of(&c, &pk("a", "c1"), false).expect("known pod");
    assert_eq!((open.ingress, open.egress, open.local), (None, None, false));
    assert!(EndpointReport::of(&c, &pk("a", "nobody"), true).is_none());
}
