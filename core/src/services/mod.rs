//! Kubernetes Services, calculated (issue 24): what each Service answers on and where each of
//! its frontends sends a new connection, from plain values the Kubernetes adapter fills. Pure:
//! the dataplane programs what [`plan`] answers.
//!
//! - [`model`]: Services and EndpointSlices as calix takes them;
//! - [`slices`]: a Service's slices read into backends, bad parts skipped and said;
//! - [`admit`]: its frontends, and the addresses it may not capture (CVE-2020-8554);
//! - [`choose`]: which backends a frontend sends to, for traffic from inside or outside;
//! - [`maglev`]: the consistent lookup table for traffic that may reach any node;
//! - [`health`]: what a health check node port answers (LoadBalancer, `Local` policy);
//! - [`state`]: every Service and slice, kept one change at a time, within the dataplane's room.
pub mod admit;
pub mod choose;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod health;
pub mod maglev;
pub mod model;
pub mod slices;
pub mod state;

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use admit::{Admission, Frontend, Kind, Refusal};
use choose::{choose, local_at_each_node, Choice, Here, Traffic};
use model::{EndpointSlice, Service};
use slices::SliceProblem;

/// One frontend and where it sends new connections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Programmed {
    pub frontend: Frontend,
    /// For clients in the cluster (pods, nodes).
    pub internal: Choice,
    /// For clients outside (NodePort, external and LoadBalancer addresses); `None` for a
    /// ClusterIP.
    pub external: Option<Choice>,
    /// Only terminating endpoints are left: they serve until they are gone.
    pub terminating_fallback: bool,
    /// `sessionAffinity: ClientIP`: seconds a client keeps its backend.
    pub affinity_secs: Option<u32>,
    /// A NodePort of a Service with `externalTrafficPolicy: Local`: each node's own usable
    /// endpoints, by node name (a node with none is absent): what a client reaching another
    /// node's address gets there. `None` for every other frontend.
    #[serde(default)]
    pub local_at: Option<BTreeMap<String, Vec<(IpAddr, u16)>>>,
}

/// Everything one Service needs programmed on this node, and what could not be.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePlan {
    pub frontends: Vec<Programmed>,
    /// Addresses it names that are not its to have.
    pub refused: Vec<Refusal>,
    /// Parts of its slices skipped.
    pub problems: Vec<SliceProblem>,
}

/// `service`'s plan on the node `here`, from its `slices` (others' are ignored) under `rules`.
pub fn plan(
    service: &Service,
    slices: &[EndpointSlice],
    rules: &Admission,
    here: &Here,
) -> ServicePlan {
    let (fronts, refused) = admit::frontends(service, rules);
    let (backends, problems) = slices::backends(service, slices);
    let frontends = fronts
        .into_iter()
        .map(|f| {
            let (internal, fb_in) =
                choose(service, &f.port_name, &backends, Traffic::Internal, here);
            let external = (f.kind != Kind::ClusterIp)
                .then(|| choose(service, &f.port_name, &backends, Traffic::External, here));
            let terminating_fallback = fb_in || external.as_ref().is_some_and(|(_, fb)| *fb);
            let local_at = (f.kind == Kind::NodePort
                && service.external_policy == model::TrafficPolicy::Local)
                .then(|| local_at_each_node(&f.port_name, &backends));
            Programmed {
                frontend: f,
                internal,
                external: external.map(|(c, _)| c),
                terminating_fallback,
                affinity_secs: service.affinity_secs,
                local_at,
            }
        })
        .collect();
    ServicePlan {
        frontends,
        refused,
        problems,
    }
}

/// The frontend a connection to `address`:`port` over `protocol` meets, and its Service: one
/// of that address first, else a NodePort when `address` is a node's (`node_address`).
pub fn frontend_for(
    plans: &BTreeMap<model::ServiceKey, ServicePlan>,
    address: IpAddr,
    protocol: model::Protocol,
    port: u16,
    node_address: bool,
) -> Option<(&model::ServiceKey, &Programmed)> {
    let all = || {
        plans
            .iter()
            .flat_map(|(k, p)| p.frontends.iter().map(move |f| (k, f)))
            .filter(|(_, f)| f.frontend.protocol == protocol && f.frontend.port == port)
    };
    all()
        .find(|(_, f)| f.frontend.address == Some(address))
        .or_else(|| {
            all().find(|(_, f)| {
                node_address && f.frontend.kind == Kind::NodePort && f.frontend.address.is_none()
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fixtures::{endpoint, service, slice};
    use model::{AddressType, TrafficPolicy};

    #[test]
    fn a_nodeport_service_with_a_local_external_policy() {
        let mut svc = service("web", &[("http", 80)]);
        svc.ports[0].node_port = Some(30080);
        svc.external_policy = TrafficPolicy::Local;
        svc.affinity_secs = Some(10_800);
        let mut far = endpoint(&["10.244.2.5"], true);
        far.node = Some("n2".into());
        let s = slice(
            "web-1",
            &svc,
            AddressType::V4,
            &[("http", Some(8080))],
            vec![endpoint(&["10.244.1.5"], true), far],
        );
        let here = Here {
            node: "n1".into(),
            zone: None,
        };
        let p = plan(&svc, &[s], &Admission::default(), &here);
        assert!(p.refused.is_empty() && p.problems.is_empty(), "{p:?}");
        assert_eq!(p.frontends.len(), 2);
        let cluster_ip = &p.frontends[0];
        assert_eq!(cluster_ip.external, None);
        assert!(
            matches!(&cluster_ip.internal, Choice::To(v) if v.len() == 2),
            "{cluster_ip:?}"
        );
        let node_port = &p.frontends[1];
        assert_eq!(node_port.frontend.kind, Kind::NodePort);
        assert_eq!(
            node_port.external,
            Some(Choice::To(vec![("10.244.1.5".parse().expect("ip"), 8080)])),
            "outside clients: this node's endpoint only"
        );
        assert_eq!(node_port.affinity_secs, Some(10_800));
        let local_at = node_port
            .local_at
            .as_ref()
            .expect("a Local NodePort's nodes");
        assert_eq!(
            local_at.get("n2"),
            Some(&vec![("10.244.2.5".parse().expect("ip"), 8080)]),
            "a client reaching n2 gets n2's endpoint"
        );
        assert_eq!(cluster_ip.local_at, None);
        let plans = BTreeMap::from([(svc.key.clone(), p.clone())]);
        let tcp = model::Protocol::Tcp;
        let found = |a: &str, port, node| {
            frontend_for(&plans, a.parse().expect("ip"), tcp, port, node)
                .map(|(_, f)| f.frontend.kind)
        };
        assert_eq!(found("10.96.0.10", 80, false), Some(Kind::ClusterIp));
        assert_eq!(found("192.0.2.1", 30080, true), Some(Kind::NodePort));
        assert_eq!(
            found("192.0.2.1", 30080, false),
            None,
            "not a node's address"
        );
        assert_eq!(found("10.96.0.10", 81, false), None);
    }
}
