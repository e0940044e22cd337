//! Which backends a frontend sends to, from where the traffic comes (kube-proxy's rules, so a
//! cluster behaves the same with calix as with kube-proxy):
//! - the usable endpoints are the ready ones; when none is ready, those serving and
//!   terminating (a rollout's last pods keep serving until they are gone);
//! - topology: with `trafficDistribution` set and every usable endpoint hinted, those hinted
//!   for this node, else for its zone (when there are any);
//! - `internalTrafficPolicy: Local` for traffic from inside the cluster and
//!   `externalTrafficPolicy: Local` for traffic from outside: only this node's usable
//!   endpoints; none here: dropped (the client may be sent here only by mistake);
//! - no usable endpoint at all: rejected (an ICMP unreachable, as kube-proxy does), never a
//!   silent drop.
use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::model::{Distribution, Service, TrafficPolicy};
use super::slices::Backend;

/// Where a packet to a frontend comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Traffic {
    /// A pod or a node of the cluster (ClusterIP; also a pod reaching an external address).
    Internal,
    /// From outside the cluster (NodePort, external and LoadBalancer addresses).
    External,
}

/// This node, as topology sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Here {
    pub node: String,
    pub zone: Option<String>,
}

/// What a frontend does with a new connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Choice {
    /// Translate to one of these (address, port), never empty.
    To(Vec<(IpAddr, u16)>),
    /// No usable endpoint anywhere: ICMP unreachable (TCP: port unreachable), as kube-proxy.
    Reject,
    /// A `Local` policy and no usable endpoint on this node.
    Drop,
}

/// The usable ones of `all`: ready, else serving and terminating. `fallback`: the second.
fn usable(all: &[&Backend]) -> (Vec<Backend>, bool) {
    let ready: Vec<Backend> = all
        .iter()
        .filter(|b| b.ready)
        .map(|b| (*b).clone())
        .collect();
    if !ready.is_empty() {
        return (ready, false);
    }
    let terminating: Vec<Backend> = all
        .iter()
        .filter(|b| b.serving && b.terminating)
        .map(|b| (*b).clone())
        .collect();
    let fallback = !terminating.is_empty();
    (terminating, fallback)
}

/// Topology's narrowing: only when every usable endpoint is hinted, and some are for here.
fn close(usable: Vec<Backend>, here: &Here) -> Vec<Backend> {
    let hinted = |b: &Backend| !b.for_zones.is_empty() || !b.for_nodes.is_empty();
    if usable.is_empty() || !usable.iter().all(hinted) {
        return usable;
    }
    let same_node: Vec<Backend> = usable
        .iter()
        .filter(|b| b.for_nodes.contains(&here.node))
        .cloned()
        .collect();
    if !same_node.is_empty() {
        return same_node;
    }
    if let Some(zone) = &here.zone {
        let same_zone: Vec<Backend> = usable
            .iter()
            .filter(|b| b.for_zones.contains(zone))
            .cloned()
            .collect();
        if !same_zone.is_empty() {
            return same_zone;
        }
    }
    usable
}

/// The choice for `service`'s port `port_name` (of `backends`, that Service's) for `traffic`
/// arriving at `here`. Also whether the terminating fallback is in use.
pub fn choose(
    service: &Service,
    port_name: &str,
    backends: &[Backend],
    traffic: Traffic,
    here: &Here,
) -> (Choice, bool) {
    let of_port: Vec<&Backend> = backends
        .iter()
        .filter(|b| b.port_name == port_name)
        .collect();
    let policy = match traffic {
        Traffic::Internal => service.internal_policy,
        Traffic::External => service.external_policy,
    };
    let (cluster, cluster_fallback) = usable(&of_port);
    if cluster.is_empty() {
        return (Choice::Reject, false);
    }
    let (picked, fallback) = match policy {
        TrafficPolicy::Cluster => {
            let picked = match service.distribution {
                Distribution::Any => cluster,
                Distribution::PreferClose => close(cluster, here),
            };
            (picked, cluster_fallback)
        }
        TrafficPolicy::Local => {
            let local: Vec<&Backend> = of_port
                .iter()
                .copied()
                .filter(|b| b.node.as_deref() == Some(here.node.as_str()))
                .collect();
            usable(&local)
        }
    };
    if picked.is_empty() {
        return (Choice::Drop, false);
    }
    let to = picked.iter().map(|b| (b.address, b.port)).collect();
    (Choice::To(to), fallback)
}

/// For `externalTrafficPolicy: Local`: what a client reaching each node from outside gets on
/// `service`'s port `port_name`: that node's usable endpoints (ready, else serving and
/// terminating), by node name; a node with none is absent (its clients are refused). A pod
/// reaching another node's NodePort is such a client there (kube-proxy judges it on arrival,
/// and the upstream suite checks it is refused where that node has no endpoint).
pub fn local_at_each_node(
    port_name: &str,
    backends: &[Backend],
) -> BTreeMap<String, Vec<(IpAddr, u16)>> {
    let mut by_node: BTreeMap<&str, Vec<&Backend>> = BTreeMap::new();
    for b in backends.iter().filter(|b| b.port_name == port_name) {
        if let Some(node) = b.node.as_deref() {
            by_node.entry(node).or_default().push(b);
        }
    }
    by_node
        .into_iter()
        .filter_map(|(node, of_node)| {
            let (picked, _) = usable(&of_node);
            (!picked.is_empty()).then(|| {
                let to = picked.iter().map(|b| (b.address, b.port)).collect();
                (node.to_string(), to)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::fixtures::{backend, service};

    fn here() -> Here {
        Here {
            node: "n1".into(),
            zone: Some("z1".into()),
        }
    }

    fn to(c: &Choice) -> Vec<String> {
        match c {
            Choice::To(v) => v.iter().map(|(a, p)| format!("{a}:{p}")).collect(),
            other => vec![format!("{other:?}")],
        }
    }

    #[test]
    fn each_nodes_own_usable_endpoints_for_a_local_external_policy() {
        let a = backend("10.244.1.5", "n1");
        let mut b = backend("10.244.2.5", "n2");
        let mut c = backend("10.244.2.6", "n2");
        let mut d = backend("10.244.3.5", "n3");
        // n2: one ready, one terminating (not taken while one is ready); n3: only a
        // terminating one that still serves (taken); n4: none at all.
        c.ready = false;
        c.terminating = true;
        d.ready = false;
        d.terminating = true;
        b.port = 8081;
        let by_node = local_at_each_node("http", &[a, b, c, d]);
        let got: Vec<(String, Vec<String>)> = by_node
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    v.iter().map(|(a, p)| format!("{a}:{p}")).collect(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("n1".to_string(), vec!["10.244.1.5:8080".to_string()]),
                ("n2".to_string(), vec!["10.244.2.5:8081".to_string()]),
                ("n3".to_string(), vec!["10.244.3.5:8080".to_string()]),
            ]
        );
        assert!(local_at_each_node("metrics", &[backend("10.244.1.5", "n1")]).is_empty());
    }

    #[test]
    fn ready_first_then_serving_terminating_then_reject() {
        let svc = service("web", &[("http", 80)]);
        let mut a = backend("10.244.1.5", "n1");
        let mut b = backend("10.244.2.5", "n2");
        let (c, fb) = choose(
            &svc,
            "http",
            &[a.clone(), b.clone()],
            Traffic::Internal,
            &here(),
        );
        assert_eq!(to(&c), ["10.244.1.5:8080", "10.244.2.5:8080"]);
        assert!(!fb);
        a.ready = false;
        a.terminating = true;
        let (c, _) = choose(
            &svc,
            "http",
            &[a.clone(), b.clone()],
            Traffic::Internal,
            &here(),
        );
        assert_eq!(
            to(&c),
            ["10.244.2.5:8080"],
            "a terminating one goes while one is ready"
        );
        b.ready = false;
        b.serving = false;
        let (c, fb) = choose(
            &svc,
            "http",
            &[a.clone(), b.clone()],
            Traffic::Internal,
            &here(),
        );
        assert_eq!(to(&c), ["10.244.1.5:8080"], "the terminating fallback");
        assert!(fb);
        a.serving = false;
        let (c, _) = choose(&svc, "http", &[a, b], Traffic::Internal, &here());
        assert_eq!(c, Choice::Reject);
        let (c, _) = choose(&svc, "http", &[], Traffic::Internal, &here());
        assert_eq!(c, Choice::Reject, "no endpoints: rejected, not dropped");
    }

    #[test]
    fn local_policies_take_this_nodes_endpoints_or_drop() {
        let mut svc = service("web", &[("http", 80)]);
        svc.external_policy = TrafficPolicy::Local;
        let all = [backend("10.244.1.5", "n1"), backend("10.244.2.5", "n2")];
        let (c, _) = choose(&svc, "http", &all, Traffic::External, &here());
        assert_eq!(to(&c), ["10.244.1.5:8080"]);
        let (c, _) = choose(&svc, "http", &all, Traffic::Internal, &here());
        assert_eq!(
            to(&c).len(),
            2,
            "externalTrafficPolicy leaves internal traffic alone"
        );
        let elsewhere = Here {
            node: "n3".into(),
            zone: None,
        };
        let (c, _) = choose(&svc, "http", &all, Traffic::External, &elsewhere);
        assert_eq!(c, Choice::Drop, "no local endpoint: dropped");
        svc.internal_policy = TrafficPolicy::Local;
        let (c, _) = choose(&svc, "http", &all, Traffic::Internal, &elsewhere);
        assert_eq!(c, Choice::Drop);
        let (c, _) = choose(&svc, "http", &all, Traffic::Internal, &here());
        assert_eq!(to(&c), ["10.244.1.5:8080"]);
    }

    #[test]
    fn prefer_close_uses_hints_only_when_all_carry_them() {
        let mut svc = service("web", &[("http", 80)]);
        svc.distribution = Distribution::PreferClose;
        let mut a = backend("10.244.1.5", "n1");
        let mut b = backend("10.244.2.5", "n2");
        a.for_zones = vec!["z1".into()];
        let (c, _) = choose(
            &svc,
            "http",
            &[a.clone(), b.clone()],
            Traffic::Internal,
            &here(),
        );
        assert_eq!(to(&c).len(), 2, "one unhinted: hints ignored");
        b.for_zones = vec!["z2".into()];
        let (c, _) = choose(
            &svc,
            "http",
            &[a.clone(), b.clone()],
            Traffic::Internal,
            &here(),
        );
        assert_eq!(to(&c), ["10.244.1.5:8080"], "this zone's");
        let z3 = Here {
            node: "n9".into(),
            zone: Some("z3".into()),
        };
        let (c, _) = choose(
            &svc,
            "http",
            &[a.clone(), b.clone()],
            Traffic::Internal,
            &z3,
        );
        assert_eq!(to(&c).len(), 2, "none for this zone: all");
        b.for_nodes = vec!["n9".into()];
        let (c, _) = choose(&svc, "http", &[a, b], Traffic::Internal, &z3);
        assert_eq!(to(&c), ["10.244.2.5:8080"], "hinted for this node");
    }
}
