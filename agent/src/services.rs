//! Kubernetes Services in the agent (issue 24): the cluster's Services and EndpointSlices as
//! the calculation (`calix_core::services::state`) keeps them, fed one change at a time by the
//! Kubernetes adapter (`kubernetes::services::watch`), and what `calixctl services` shows.
//! Calculated only: nothing is programmed into the dataplane yet (kube-proxy still
//! translates), and the report says so.
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use calix_core::services::admit::{Admission, Refusal};
use calix_core::services::choose::Here;
use calix_core::services::model::ServiceKey;
use calix_core::services::slices::SliceProblem;
use calix_core::services::state::{Change, Limits, State};
use calix_core::services::Programmed;
use serde::{Deserialize, Serialize};

/// What `calixctl services` shows: the calculation's totals, then each Service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServicesReport {
    pub node: String,
    /// The first listings of Services and EndpointSlices are in.
    pub ready: bool,
    /// Whether the dataplane translates what is shown (not yet: kube-proxy does).
    pub programmed: bool,
    pub services: usize,
    pub slices: usize,
    /// Frontends and backend entries in use, and the room.
    pub used_frontends: usize,
    pub used_backends: usize,
    pub limits: Limits,
    /// Changes applied since the start.
    pub changes: u64,
    pub list: Vec<ServiceRow>,
}

/// One Service: what it answers on and where each frontend sends, or why it is not
/// programmed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceRow {
    /// `namespace/name`.
    pub service: String,
    pub frontends: Vec<Programmed>,
    /// Addresses it names that are not its to have (CVE-2020-8554).
    pub refused: Vec<Refusal>,
    /// Parts of its EndpointSlices skipped.
    pub problems: Vec<SliceProblem>,
    /// What of its objects could not be read (left out, the rest kept).
    pub unreadable: Vec<String>,
    /// Refused whole: it does not fit in the room left (frontends, backend entries it needs).
    pub no_room: Option<(usize, usize)>,
}

struct Inner {
    state: State,
    ready: bool,
    changes: u64,
    /// What could not be read of each object, by its store key.
    unreadable: BTreeMap<String, (Option<ServiceKey>, Vec<String>)>,
    applying: Duration,
}

/// The Services calculation of one node.
pub struct ServicesService {
    node: String,
    inner: Mutex<Inner>,
}

impl ServicesService {
    pub fn new(node: &str, zone: Option<String>, rules: Admission, limits: Limits) -> Self {
        let here = Here {
            node: node.to_string(),
            zone,
        };
        Self {
            node: node.to_string(),
            inner: Mutex::new(Inner {
                state: State::new(rules, here, limits),
                ready: false,
                changes: 0,
                unreadable: BTreeMap::new(),
                applying: Duration::ZERO,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one change; returns how many Services' plans may have changed.
    pub fn apply(&self, change: Change) -> usize {
        let start = Instant::now();
        let mut inner = self.lock();
        let touched = inner.state.apply(change).len();
        inner.changes += 1;
        inner.applying += start.elapsed();
        touched
    }

    /// What could not be read of the object stored at `key` (of Service `service`); empty:
    /// all of it could.
    pub fn set_unreadable(&self, key: &str, service: Option<ServiceKey>, what: Vec<String>) {
        let mut inner = self.lock();
        if what.is_empty() {
            inner.unreadable.remove(key);
        } else {
            inner.unreadable.insert(key.to_string(), (service, what));
        }
    }

    /// New admission rules (pools, node addresses, the allowed CIDRs).
    pub fn set_rules(&self, rules: Admission) -> usize {
        self.lock().state.set_rules(rules).len()
    }

    /// The first listings are in.
    pub fn set_ready(&self) {
        self.lock().ready = true;
    }

    /// Time spent applying changes since the start.
    pub fn applying(&self) -> Duration {
        self.lock().applying
    }

    /// The report, for every Service or the one named `only` (`namespace/name`).
    pub fn report(&self, only: Option<&str>) -> ServicesReport {
        let inner = self.lock();
        let st = &inner.state;
        let (services, slices) = st.counts();
        let (used_frontends, used_backends) = st.used();
        let mut rows: BTreeMap<String, ServiceRow> = BTreeMap::new();
        let row = |k: &ServiceKey| ServiceRow {
            service: k.to_string(),
            frontends: Vec::new(),
            refused: Vec::new(),
            problems: Vec::new(),
            unreadable: Vec::new(),
            no_room: None,
        };
        for (k, p) in st.plans() {
            let r = rows.entry(k.to_string()).or_insert_with(|| row(k));
            r.frontends.clone_from(&p.frontends);
            r.refused.clone_from(&p.refused);
            r.problems.clone_from(&p.problems);
        }
        for (k, need) in st.refused_for_room() {
            rows.entry(k.to_string()).or_insert_with(|| row(k)).no_room = Some(*need);
        }
        for (key, (service, what)) in &inner.unreadable {
            let Some(k) = service else { continue };
            let r = rows.entry(k.to_string()).or_insert_with(|| row(k));
            r.unreadable
                .extend(what.iter().map(|w| format!("{key}: {w}")));
        }
        let list = rows
            .into_values()
            .filter(|r| only.is_none_or(|o| r.service == o))
            .collect();
        ServicesReport {
            node: self.node.clone(),
            ready: inner.ready,
            programmed: false,
            services,
            slices,
            used_frontends,
            used_backends,
            limits: st.limits(),
            changes: inner.changes,
            list,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_core::services::model::{
        AddressType, Distribution, Endpoint, EndpointSlice, Protocol, Service, ServicePort,
        SlicePort, TrafficPolicy,
    };

    fn key(name: &str) -> ServiceKey {
        ServiceKey {
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    fn service(name: &str, ip: &str, external: &[&str]) -> Service {
        Service {
            key: key(name),
            cluster_ips: vec![ip.parse().expect("ip")],
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: None,
            }],
            external_ips: external.iter().map(|a| a.parse().expect("ip")).collect(),
            load_balancer_ips: Vec::new(),
            affinity_secs: None,
            external_policy: TrafficPolicy::Cluster,
            internal_policy: TrafficPolicy::Cluster,
            distribution: Distribution::Any,
        }
    }

    fn slice(name: &str, service: &str, backends: &[&str]) -> EndpointSlice {
        EndpointSlice {
            name: format!("shop/{name}"),
            service: key(service),
            address_type: AddressType::V4,
            ports: vec![SlicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: Some(8080),
            }],
            endpoints: backends
                .iter()
                .map(|a| Endpoint {
                    addresses: vec![a.parse().expect("ip")],
                    ready: true,
                    serving: true,
                    terminating: false,
                    node: None,
                    zone: None,
                    for_zones: Vec::new(),
                    for_nodes: Vec::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn the_report_shows_plans_refusals_room_and_what_could_not_be_read() {
        let svc = ServicesService::new(
            "n1",
            None,
            Admission::default(),
            Limits {
                frontends: 2,
                backends: 2,
            },
        );
        // web: admitted, its external address refused (no CIDR allows any).
        svc.apply(Change::Service(service(
            "web",
            "10.96.0.10",
            &["192.0.2.9"],
        )));
        svc.apply(Change::Slice(slice("web-1", "web", &["10.244.1.5"])));
        // big: two backends more than the room left.
        svc.apply(Change::Service(service("big", "10.96.0.11", &[])));
        svc.apply(Change::Slice(slice(
            "big-1",
            "big",
            &["10.244.1.6", "10.244.1.7"],
        )));
        svc.set_unreadable(
            "k8s/endpointslices/shop/web-1",
            Some(key("web")),
            vec!["endpoint address \"x\"".into()],
        );
        svc.set_ready();
        let r = svc.report(None);
        assert!(r.ready && !r.programmed);
        assert_eq!((r.services, r.slices, r.changes), (2, 2, 4));
        assert_eq!((r.used_frontends, r.used_backends), (1, 1));
        let names: Vec<&str> = r.list.iter().map(|s| s.service.as_str()).collect();
        assert_eq!(names, ["shop/big", "shop/web"]);
        assert_eq!(r.list[0].no_room, Some((1, 2)));
        assert!(r.list[0].frontends.is_empty());
        let web = &r.list[1];
        assert_eq!(web.frontends.len(), 1);
        assert_eq!(web.refused.len(), 1, "{web:?}");
        assert_eq!(web.refused[0].address.to_string(), "192.0.2.9");
        assert_eq!(web.unreadable.len(), 1);
        assert_eq!(svc.report(Some("shop/web")).list.len(), 1);
        // Read again whole: the complaint goes.
        svc.set_unreadable(
            "k8s/endpointslices/shop/web-1",
            Some(key("web")),
            Vec::new(),
        );
        assert!(svc.report(None).list[1].unreadable.is_empty());
    }
}
