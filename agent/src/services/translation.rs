//! What the socket programs translate, from the calculation's plans: each admitted frontend
//! and its backends for clients inside the cluster; NodePorts as one entry per family on
//! every node's address, and a `Local` NodePort's other nodes.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use calix_core::services::choose::Choice;
use calix_core::services::model::Protocol;
use calix_core::services::state::State;
use calix_core::services::ServicePlan;
use calix_dataplane::ebpf::services::{Front, Frontends, Target, Translation, TCP, UDP};

use super::ServicesService;

impl ServicesService {
    /// `calixctl trace`'s Service step for a packet to `address`:`port` (`proto`: 6, 17 or
    /// 132) from `client`, which `outside` says is beyond the cluster (no pod's, no pool's;
    /// a node's address counts as inside whatever the caller says): the Service and where its
    /// connections go from here; `None` when no frontend of a Service is there. `.0`: the
    /// connection is refused or dropped.
    pub fn trace_step(
        &self,
        address: IpAddr,
        proto: u8,
        port: u16,
        client: IpAddr,
        outside: bool,
    ) -> Option<(bool, String)> {
        let protocol = match proto {
            6 => Protocol::Tcp,
            17 => Protocol::Udp,
            132 => Protocol::Sctp,
            _ => return None,
        };
        let inner = self.lock();
        let is_node = |a: &IpAddr| {
            inner.nodes.values().any(|v| v.contains(a))
                || inner.state.rules().node_addresses.contains(a)
        };
        let owner = inner
            .nodes
            .iter()
            .find(|(_, a)| a.contains(&address))
            .map(|(n, _)| n.clone());
        let node_address = owner.is_some() || inner.state.rules().node_addresses.contains(&address);
        let outside = outside && !is_node(&client);
        let (key, p) = calix_core::services::frontend_for(
            inner.state.plans(),
            address,
            protocol,
            port,
            node_address,
        )?;
        let elsewhere = owner.as_deref().filter(|n| *n != self.node);
        let local_there =
            |n: &str, by_node: &std::collections::BTreeMap<String, _>| match by_node.get(n) {
                Some(v) => Choice::To(Vec::clone(v)),
                None => Choice::Drop,
            };
        let what = format!(
            "{key} ({:?} {address}:{port}/{protocol:?})",
            p.frontend.kind
        );
        let (choice, by) = if outside {
            let per_packet = "calix translates it per packet where it arrives (the uplink's tc \
                              program; a backend on that node sees the client's address, one on \
                              another node the node's)";
            let choice = match &p.external {
                None => {
                    return Some((
                        false,
                        format!(
                            "{what}: a cluster IP, not translated for a client outside the cluster"
                        ),
                    ))
                }
                Some(external) => match (&p.local_at, elsewhere) {
                    (Some(by_node), Some(n)) => local_there(n, by_node),
                    _ => external.clone(),
                },
            };
            // Per packet, the backends of the address's family only: none (a single-stack
            // Service at a node's address of the other family) and the stack refuses.
            let choice = match choice {
                Choice::To(v) => {
                    let v: Vec<_> = v
                        .into_iter()
                        .filter(|(a, _)| a.is_ipv4() == address.is_ipv4())
                        .collect();
                    if v.is_empty() {
                        Choice::Reject
                    } else {
                        Choice::To(v)
                    }
                }
                other => other,
            };
            (choice, per_packet)
        } else {
            let by = if inner.programmed {
                "calix translates it at the client's socket"
            } else {
                "calix does not translate it here ([services] translate off, or not programmed): kube-proxy's"
            };
            match (&p.local_at, elsewhere) {
                (Some(by_node), Some(n)) => (local_there(n, by_node), by),
                _ => (p.internal.clone(), by),
            }
        };
        let by = if !inner.programmed && outside {
            "calix does not translate it here ([services] translate off, or not programmed): kube-proxy's"
        } else {
            by
        };
        let what = format!("{what}: {by}");
        Some(match choice {
            Choice::To(v) => {
                let mut to: Vec<String> = v
                    .iter()
                    .take(8)
                    .map(|(a, p)| match a {
                        IpAddr::V6(_) => format!("[{a}]:{p}"),
                        IpAddr::V4(_) => format!("{a}:{p}"),
                    })
                    .collect();
                if v.len() > 8 {
                    to.push(format!("and {} more", v.len() - 8));
                }
                let affinity = match (p.affinity_secs, outside) {
                    (Some(_), true) => "; the client's address picks its backend".to_string(),
                    (Some(s), false) => format!("; a client keeps its backend {s} s"),
                    (None, _) => String::new(),
                };
                (
                    false,
                    format!("{what}, to one of {}{affinity}", to.join(", ")),
                )
            }
            Choice::Reject if outside => (
                true,
                format!("{what}: no endpoint, refused by the node's stack (a RST, or ICMP port unreachable)"),
            ),
            Choice::Reject => (true, format!("{what}: no endpoint, refused (ECONNREFUSED)")),
            Choice::Drop if outside => (
                true,
                format!("{what}: a Local traffic policy and no endpoint on that node, dropped there (counted: service_no_local_endpoint)"),
            ),
            Choice::Drop => (
                true,
                format!("{what}: a Local traffic policy and no endpoint on that node, refused"),
            ),
        })
    }

    /// What the sockets translate: every admitted frontend of TCP or UDP (SCTP: not at the
    /// sockets) and where it sends connections from inside the cluster ([`expand`], each
    /// Service in key order: a frontend two Services name is the later one's), `whole`.
    pub fn translation(&self, own: &[IpAddr]) -> Translation {
        let inner = self.lock();
        let (w, nodes) = Where::of(&inner.state, &inner.nodes, &self.node, own);
        let mut frontends = Frontends::new();
        for plan in inner.state.plans().values() {
            frontends.extend(expand(plan, &w));
        }
        Translation {
            frontends,
            gone: BTreeSet::new(),
            whole: true,
            nodes,
        }
    }

    /// What changed since the last translation this returned was programmed
    /// ([`ServicesService::programmed`] with `Ok`): the frontends of the Services changes
    /// touched since, re-expanded. `whole` ([`ServicesService::translation`]) the first time,
    /// after the nodes' addresses or the admission rules changed, and after a programming
    /// failed.
    pub fn next_translation(&self, own: &[IpAddr]) -> Translation {
        let mut guard = self.lock();
        let super::Inner {
            state,
            nodes,
            expanded,
            ..
        } = &mut *guard;
        let (w, addresses) = Where::of(state, nodes, &self.node, own);
        expanded.next(state.plans(), &w, addresses, own)
    }
}

/// Where a Service's frontends answer beyond what its plan says: the nodes' addresses.
pub(super) struct Where<'a> {
    /// This node's name.
    node: &'a str,
    /// The unspecified address of each family some node has: a NodePort's entry.
    any: Vec<IpAddr>,
    /// This node's own addresses.
    mine: BTreeSet<IpAddr>,
    /// The cluster's Nodes and their addresses.
    nodes: &'a BTreeMap<String, Vec<IpAddr>>,
}

impl<'a> Where<'a> {
    /// From the calculation's `state`, the cluster's `nodes` and this node's `own` addresses
    /// (known before its Node is listed); and every node's addresses, where NodePorts answer.
    pub(super) fn of(
        state: &State,
        nodes: &'a BTreeMap<String, Vec<IpAddr>>,
        node: &'a str,
        own: &[IpAddr],
    ) -> (Self, BTreeSet<IpAddr>) {
        let by_node = nodes;
        let mut nodes: BTreeSet<IpAddr> = state.rules().node_addresses.iter().copied().collect();
        nodes.extend(own.iter().copied());
        let any: Vec<IpAddr> = [
            nodes
                .iter()
                .any(IpAddr::is_ipv4)
                .then_some(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            nodes
                .iter()
                .any(IpAddr::is_ipv6)
                .then_some(IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
        ]
        .into_iter()
        .flatten()
        .collect();
        let mine: BTreeSet<IpAddr> = own
            .iter()
            .chain(by_node.get(node).into_iter().flatten())
            .copied()
            .collect();
        let w = Where {
            node,
            any,
            mine,
            nodes: by_node,
        };
        (w, nodes)
    }
}

/// One Service's frontends at the sockets, and where each sends connections from inside the
/// cluster. A NodePort is one frontend per family (the unspecified address) answering on
/// every node's addresses. A pod reaching any node's NodePort meets the backends kube-proxy
/// would give it there: its internal choice (pods are inside the cluster), but at another
/// node's address with `externalTrafficPolicy: Local` that node's own endpoints (an entry for
/// each of its addresses), refused where it has none, as kube-proxy judges the connection
/// arriving there. For clients outside, per packet where they arrive (`external`): a NodePort
/// at this node's own addresses, an external or LoadBalancer address as it is.
pub(super) fn expand(plan: &ServicePlan, w: &Where) -> Frontends {
    let mut out = Frontends::new();
    for p in &plan.frontends {
        let proto = match p.frontend.protocol {
            Protocol::Tcp => TCP,
            Protocol::Udp => UDP,
            Protocol::Sctp => continue,
        };
        let to = |backends: &Vec<(IpAddr, u16)>| Target::To {
            backends: backends.clone(),
            affinity_secs: p.affinity_secs.unwrap_or(0),
        };
        let target = match &p.internal {
            Choice::To(v) => to(v),
            Choice::Reject | Choice::Drop => Target::Refuse,
        };
        // Clients outside: a NodePort at this node's own addresses (of both families: the
        // backends of the address's family, none of a single-stack Service's other family,
        // which the stack refuses).
        if let Some(external) = &p.external {
            let at: Vec<IpAddr> = match p.frontend.address {
                Some(a) => vec![a],
                None => w.mine.iter().copied().collect(),
            };
            let t = match external {
                Choice::To(v) => to(v),
                Choice::Reject => Target::Refuse,
                Choice::Drop => Target::Drop,
            };
            for address in at {
                let f = Front {
                    address,
                    port: p.frontend.port,
                    proto,
                    external: true,
                };
                out.insert(f, t.clone());
            }
        }
        let mut put = |address: IpAddr, t: Target| {
            let f = Front {
                address,
                port: p.frontend.port,
                proto,
                external: false,
            };
            out.insert(f, t);
        };
        let Some(local_at) = &p.local_at else {
            match p.frontend.address {
                Some(a) => put(a, target),
                None => {
                    for a in &w.any {
                        put(*a, target.clone());
                    }
                }
            }
            continue;
        };
        // `externalTrafficPolicy: Local`: another node's addresses get its own endpoints,
        // those of a node with none are refused (the wildcard); this node's get the internal
        // choice. Entries: this node's addresses and those of the nodes with endpoints, never
        // one per node.
        for a in &w.any {
            put(*a, Target::Refuse);
        }
        for a in &w.mine {
            put(*a, target.clone());
        }
        for (node, backends) in local_at.iter().filter(|(n, _)| *n != w.node) {
            for a in w.nodes.get(node).into_iter().flatten() {
                if !w.mine.contains(a) {
                    put(*a, to(backends));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use calix_core::services::admit::Admission;
    use calix_core::services::model::TrafficPolicy;
    use calix_core::services::state::{Change, Limits};

    use super::*;
    use crate::services::tests::{service, slice};

    /// The Services of node n1, no admission rule, room for 16 frontends and backends.
    fn on_n1() -> ServicesService {
        let limits = Limits {
            frontends: 16,
            backends: 16,
        };
        ServicesService::new("n1", None, Admission::default(), limits)
    }

    #[test]
    fn a_nodeport_answers_on_every_nodes_address_from_one_entry_per_family() {
        let rules = Admission {
            node_addresses: vec![
                "192.0.2.2".parse().expect("ip"),
                "fd00::2".parse().expect("ip"),
            ],
            ..Admission::default()
        };
        let limits = Limits {
            frontends: 8,
            backends: 8,
        };
        let svc = ServicesService::new("n1", None, rules, limits);
        let mut web = service("web", "10.96.0.10", &[]);
        web.ports[0].node_port = Some(30080);
        svc.apply(Change::Service(web));
        svc.apply(Change::Slice(slice("web-1", "web", &["10.244.1.5"])));
        let t = svc.translation(&["192.0.2.1".parse().expect("ip")]);
        let nodes: Vec<String> = t.nodes.iter().map(|a| a.to_string()).collect();
        assert_eq!(
            nodes,
            ["192.0.2.1", "192.0.2.2", "fd00::2"],
            "the cluster's and this one's"
        );
        let fronts: Vec<String> = t
            .frontends
            .keys()
            .map(|f| {
                let outside = if f.external { " (outside)" } else { "" };
                format!("{}:{}{outside}", f.address, f.port)
            })
            .collect();
        assert_eq!(
            fronts,
            [
                "0.0.0.0:30080",
                "10.96.0.10:80",
                "192.0.2.1:30080 (outside)",
                ":::30080"
            ],
            "clients outside: at this node's own address only"
        );
        let backends = Target::To {
            backends: vec![("10.244.1.5".parse().expect("ip"), 8080)],
            affinity_secs: 0,
        };
        assert!(t.frontends.values().all(|v| *v == backends), "{t:?}");
    }

    /// n1 of nodes n1–n3 (192.0.2.1–3), Service shop/web a `Local` NodePort 30080 (with
    /// `affinity` seconds of session affinity), its endpoints 10.244.1.5 on n1 and 10.244.2.5
    /// on n2.
    fn local_nodeport_on_three_nodes(affinity: Option<u32>) -> ServicesService {
        let svc = on_n1();
        svc.set_nodes(BTreeMap::from([
            ("n1".to_string(), vec!["192.0.2.1".parse().expect("ip")]),
            ("n2".to_string(), vec!["192.0.2.2".parse().expect("ip")]),
            ("n3".to_string(), vec!["192.0.2.3".parse().expect("ip")]),
        ]));
        let mut web = service("web", "10.96.0.10", &[]);
        web.ports[0].node_port = Some(30080);
        web.external_policy = TrafficPolicy::Local;
        web.affinity_secs = affinity;
        svc.apply(Change::Service(web));
        let mut s = slice("web-1", "web", &["10.244.1.5", "10.244.2.5"]);
        s.endpoints[0].node = Some("n1".into());
        s.endpoints[1].node = Some("n2".into());
        svc.apply(Change::Slice(s));
        svc
    }

    /// `externalTrafficPolicy: Local`: a pod reaching another node's NodePort gets that
    /// node's endpoints, refused at a node with none; at this node's, every endpoint.
    #[test]
    fn a_local_nodeport_at_another_node_gets_that_nodes_endpoints() {
        let svc = local_nodeport_on_three_nodes(None);
        let t = svc.translation(&["192.0.2.1".parse().expect("ip")]);
        let to = |a: &str| Target::To {
            backends: vec![(a.parse().expect("ip"), 8080)],
            affinity_secs: 0,
        };
        let both = Target::To {
            backends: vec![
                ("10.244.1.5".parse().expect("ip"), 8080),
                ("10.244.2.5".parse().expect("ip"), 8080),
            ],
            affinity_secs: 0,
        };
        let at = |t: &Translation, external: bool| -> Vec<(String, Target)> {
            t.frontends
                .iter()
                .filter(|(f, _)| f.port == 30080 && f.external == external)
                .map(|(f, t)| (f.address.to_string(), t.clone()))
                .collect()
        };
        assert_eq!(
            at(&t, false),
            [
                ("0.0.0.0".to_string(), Target::Refuse),
                ("192.0.2.1".to_string(), both),
                ("192.0.2.2".to_string(), to("10.244.2.5")),
            ],
            "n3 has no endpoint: the wildcard refuses; no entry per node"
        );
        assert_eq!(
            at(&t, true),
            [("192.0.2.1".to_string(), to("10.244.1.5"))],
            "clients outside reaching this node: its own endpoint only"
        );
        // Its endpoint gone, clients outside are dropped here (kube-proxy's Local).
        let mut s = slice("web-1", "web", &["10.244.2.5"]);
        s.endpoints[0].node = Some("n2".into());
        svc.apply(Change::Slice(s));
        let t = svc.translation(&["192.0.2.1".parse().expect("ip")]);
        assert_eq!(at(&t, true), [("192.0.2.1".to_string(), Target::Drop)]);
    }

    /// `externalTrafficPolicy: Cluster`: clients outside get every endpoint, at this node's
    /// addresses and at an external address the operator allows.
    #[test]
    fn clients_outside_get_the_external_choice_at_this_nodes_addresses() {
        let rules = Admission {
            external_cidrs: vec!["203.0.113.0/24".parse().expect("cidr")],
            ..Admission::default()
        };
        let limits = Limits {
            frontends: 16,
            backends: 16,
        };
        let svc = ServicesService::new("n1", None, rules, limits);
        let mut web = service("web", "10.96.0.10", &[]);
        web.ports[0].node_port = Some(30080);
        web.external_ips = vec!["203.0.113.7".parse().expect("ip")];
        svc.apply(Change::Service(web));
        svc.apply(Change::Slice(slice(
            "web-1",
            "web",
            &["10.244.1.5", "10.244.2.5"],
        )));
        let own: Vec<IpAddr> = vec![
            "192.0.2.1".parse().expect("ip"),
            "fd00::1".parse().expect("ip"),
        ];
        let t = svc.translation(&own);
        let outside: Vec<String> = t
            .frontends
            .iter()
            .filter(|(f, _)| f.external)
            .map(|(f, t)| match t {
                Target::To { backends, .. } => {
                    format!("{}:{} {}", f.address, f.port, backends.len())
                }
                other => format!("{}:{} {other:?}", f.address, f.port),
            })
            .collect();
        assert_eq!(
            outside,
            ["192.0.2.1:30080 2", "203.0.113.7:80 2", "fd00::1:30080 2"],
            "both families of this node's addresses (the dataplane keeps the backends of each \
             address's family): {t:?}"
        );
        assert!(
            t.frontends
                .keys()
                .any(|f| !f.external && f.address.to_string() == "203.0.113.7"),
            "pods reach the external address at their sockets too"
        );
    }

    #[test]
    fn the_trace_step_names_the_service_and_its_backends() {
        let svc = on_n1();
        let pod: IpAddr = "10.244.1.9".parse().expect("ip");
        svc.apply(Change::Service(service("web", "10.96.0.10", &[])));
        let at = "10.96.0.10".parse().expect("ip");
        let (refused, detail) = svc
            .trace_step(at, 6, 80, pod, false)
            .expect("a Service's address");
        assert!(refused, "no endpoint yet: {detail}");
        assert!(
            detail.contains("shop/web") && detail.contains("refused"),
            "{detail}"
        );
        svc.apply(Change::Slice(slice("web-1", "web", &["10.244.1.5"])));
        let (refused, detail) = svc
            .trace_step(at, 6, 80, pod, false)
            .expect("a Service's address");
        assert!(!refused);
        assert!(detail.contains("to one of 10.244.1.5:8080"), "{detail}");
        assert_eq!(
            svc.trace_step(at, 6, 81, pod, false),
            None,
            "no frontend on that port"
        );
        assert_eq!(svc.trace_step(at, 17, 80, pod, false), None, "nor for UDP");
        let (refused, detail) = svc
            .trace_step(at, 6, 80, pod, true)
            .expect("a Service's address");
        assert!(
            !refused && detail.contains("not translated for a client outside"),
            "{detail}"
        );
    }

    /// A client outside the cluster reaching a `Local` NodePort: translated per packet where it
    /// arrives, to that node's endpoints, dropped at a node with none.
    #[test]
    fn the_trace_step_of_a_client_outside_is_the_per_packet_choice() {
        let svc = local_nodeport_on_three_nodes(Some(600));
        svc.programmed(Ok(()));
        let client: IpAddr = "198.51.100.9".parse().expect("ip");
        let ip = |a: &str| -> IpAddr { a.parse().expect("ip") };
        let (refused, here) = svc
            .trace_step(ip("192.0.2.1"), 6, 30080, client, true)
            .expect("a NodePort");
        assert!(!refused, "{here}");
        assert!(here.contains("per packet"), "{here}");
        assert!(
            here.contains("to one of 10.244.1.5:8080;"),
            "this node's endpoint only: {here}"
        );
        assert!(here.contains("the client's address picks"), "{here}");
        let (_, there) = svc
            .trace_step(ip("192.0.2.2"), 6, 30080, client, true)
            .expect("a NodePort");
        assert!(
            there.contains("to one of 10.244.2.5:8080"),
            "n2's endpoint: {there}"
        );
        let (refused, none) = svc
            .trace_step(ip("192.0.2.3"), 6, 30080, client, true)
            .expect("a NodePort");
        assert!(refused && none.contains("dropped there"), "{none}");
        // A node's address is no client outside, whatever the caller says; a pod at this
        // node's NodePort gets the internal choice (both endpoints).
        let (_, inside) = svc
            .trace_step(ip("192.0.2.1"), 6, 30080, ip("192.0.2.2"), true)
            .expect("a NodePort");
        assert!(
            inside.contains("at the client's socket") || inside.contains("kube-proxy"),
            "{inside}"
        );
        assert!(inside.contains("10.244.2.5:8080"), "{inside}");
        // IPv6 at this node's IPv6 address: translated per packet too, to the backends of
        // that family, of which this single-stack Service has none: refused by the stack.
        let mut nodes = BTreeMap::new();
        nodes.insert("n1".to_string(), vec![ip("192.0.2.1"), ip("fd00::1")]);
        nodes.insert("n2".to_string(), vec![ip("192.0.2.2")]);
        nodes.insert("n3".to_string(), vec![ip("192.0.2.3")]);
        svc.set_nodes(nodes);
        let (refused, v6) = svc
            .trace_step(ip("fd00::1"), 6, 30080, ip("2001:db8::9"), true)
            .expect("a NodePort");
        assert!(
            refused && v6.contains("per packet") && v6.contains("refused by the node's stack"),
            "{v6}"
        );
    }
}
