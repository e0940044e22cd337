//! Kubernetes Services in the agent (issue 24): the cluster's Services and EndpointSlices as
//! the calculation (`calix_core::services::state`) keeps them, fed one change at a time by the
//! Kubernetes adapter (`kubernetes::services::watch`); what `calixctl services` shows; and,
//! with `[services] translate`, the frontends the eBPF dataplane translates at the sockets
//! ([`program`]; what they translate: [`translation`]).
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use std::net::IpAddr;

use calix_core::services::admit::{Admission, Refusal};
use calix_core::services::choose::Here;
use calix_core::services::model::ServiceKey;
use calix_core::services::slices::SliceProblem;
use calix_core::services::state::{Change, Limits, State};
use calix_core::services::Programmed;
use calix_dataplane::ebpf::services::Translation;
use calix_dataplane::DataplaneStats;
use serde::{Deserialize, Serialize};

mod counters;
mod expanded;
mod translation;

pub use counters::{FrontCounts, SERVICE_SERIES};

/// What `calixctl services` shows: the calculation's totals, then each Service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServicesReport {
    pub node: String,
    /// The first listings of Services and EndpointSlices are in.
    pub ready: bool,
    /// Whether the dataplane translates what is shown (`[services] translate`; else
    /// kube-proxy does), and the last programming's error.
    pub programmed: bool,
    pub program_error: Option<String>,
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
    /// What the socket programs counted for each of `frontends` (same order); empty when
    /// nothing is counted (calculation only, or nothing yet).
    #[serde(default)]
    pub counters: Vec<FrontCounts>,
}

/// Something about a Service an operator must see (an Event on the Service).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceNotice {
    pub service: ServiceKey,
    /// `ServiceAddressRefused`, `ServiceNotProgrammed` or `EndpointSliceSkipped`.
    pub reason: &'static str,
    pub message: String,
}

struct Inner {
    state: State,
    /// What was last said of each Service (a complaint is said once, again only after it
    /// went away).
    said: BTreeMap<ServiceKey, BTreeSet<(&'static str, String)>>,
    ready: bool,
    changes: u64,
    programmed: bool,
    program_error: Option<String>,
    /// What could not be read of each object, by its store key.
    unreadable: BTreeMap<String, (Option<ServiceKey>, Vec<String>)>,
    applying: Duration,
    /// The cluster's Nodes and their addresses (a `Local` NodePort reached at another node's
    /// address gets that node's endpoints).
    nodes: BTreeMap<String, Vec<IpAddr>>,
    /// The Services the metrics name one by one ([`SERVICE_SERIES`] at most).
    series: BTreeSet<ServiceKey>,
    /// Each Service's frontends as last handed to the dataplane, and what changed since.
    expanded: expanded::Expanded,
}

impl Inner {
    /// What `k` has wrong now.
    fn complaints(&self, k: &ServiceKey) -> BTreeSet<(&'static str, String)> {
        let mut out = BTreeSet::new();
        if let Some((f, b)) = self.state.refused_for_room().get(k) {
            out.insert((
                "ServiceNotProgrammed",
                format!(
                    "not programmed: it needs {f} frontend(s) and {b} backend entries, more than \
                     the room left ([services] frontends, backends); it never evicts another Service"
                ),
            ));
        }
        if let Some(p) = self.state.plan(k) {
            for r in &p.refused {
                out.insert((
                    "ServiceAddressRefused",
                    format!(
                        "{:?} address {} is not programmed: {}",
                        r.kind, r.address, r.why
                    ),
                ));
            }
            for sp in &p.problems {
                out.insert((
                    "EndpointSliceSkipped",
                    format!(
                        "EndpointSlice {}: {} (skipped; the rest is programmed)",
                        sp.slice, sp.what
                    ),
                ));
            }
        }
        out
    }

    /// The complaints of the Services in `touched` not said before; remembers them.
    fn news(&mut self, touched: BTreeSet<ServiceKey>) -> Vec<ServiceNotice> {
        let mut out = Vec::new();
        for k in touched {
            let now = self.complaints(&k);
            let before = self.said.remove(&k).unwrap_or_default();
            for (reason, message) in now.difference(&before) {
                out.push(ServiceNotice {
                    service: k.clone(),
                    reason,
                    message: message.clone(),
                });
            }
            if !now.is_empty() {
                self.said.insert(k, now);
            }
        }
        out
    }
}

/// The Services calculation of one node.
pub struct ServicesService {
    node: String,
    inner: Mutex<Inner>,
    /// Where the socket programs' counters are read.
    counters: OnceLock<Box<dyn DataplaneStats>>,
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
                said: BTreeMap::new(),
                ready: false,
                changes: 0,
                programmed: false,
                program_error: None,
                unreadable: BTreeMap::new(),
                applying: Duration::ZERO,
                nodes: BTreeMap::new(),
                series: BTreeSet::new(),
                expanded: expanded::Expanded::default(),
            }),
            counters: OnceLock::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one change; returns what the Services it touched have newly wrong.
    pub fn apply(&self, change: Change) -> Vec<ServiceNotice> {
        let start = Instant::now();
        let mut inner = self.lock();
        let replaced = inner.state.apply(change);
        let touched = replaced.keys().cloned().collect();
        inner.expanded.replaced(replaced);
        inner.changes += 1;
        let notices = inner.news(touched);
        inner.applying += start.elapsed();
        notices
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

    /// The cluster's Nodes and their addresses, by name.
    pub fn set_nodes(&self, nodes: BTreeMap<String, Vec<IpAddr>>) {
        let mut inner = self.lock();
        if inner.nodes != nodes {
            inner.nodes = nodes;
            inner.expanded.everything();
        }
    }

    /// New admission rules (pools, node addresses, the allowed CIDRs); what is newly wrong.
    pub fn set_rules(&self, rules: Admission) -> Vec<ServiceNotice> {
        let mut inner = self.lock();
        let touched = inner.state.set_rules(rules);
        inner.expanded.everything();
        inner.news(touched)
    }

    /// The calculation's metrics (no label per Service: bounded whatever the cluster holds),
    /// then the socket programs' counters per Service (bounded: [`SERVICE_SERIES`]).
    pub fn metrics(&self) -> String {
        let mut out = self.calculation_metrics();
        out.push_str(&self.counter_metrics());
        out
    }

    fn calculation_metrics(&self) -> String {
        let inner = self.lock();
        let st = &inner.state;
        let (services, slices) = st.counts();
        let (used_f, used_b) = st.used();
        let limits = st.limits();
        let refused: usize = st.plans().values().map(|p| p.refused.len()).sum();
        let problems: usize = st.plans().values().map(|p| p.problems.len()).sum();
        format!(
            "# HELP calix_services_ready 1 once the first listings of Services and EndpointSlices are in.\n\
             # TYPE calix_services_ready gauge\ncalix_services_ready {}\n\
             # HELP calix_services_objects What the Services calculation holds, cluster-wide.\n\
             # TYPE calix_services_objects gauge\n\
             calix_services_objects{{kind=\"service\"}} {services}\n\
             calix_services_objects{{kind=\"endpointslice\"}} {slices}\n\
             # HELP calix_services_room Frontends and backend entries: in use, and the room ([services] frontends, backends).\n\
             # TYPE calix_services_room gauge\n\
             calix_services_room{{kind=\"frontend\",of=\"used\"}} {used_f}\n\
             calix_services_room{{kind=\"frontend\",of=\"limit\"}} {}\n\
             calix_services_room{{kind=\"backend\",of=\"used\"}} {used_b}\n\
             calix_services_room{{kind=\"backend\",of=\"limit\"}} {}\n\
             # HELP calix_services_refused What is not programmed now: addresses not a Service's to have (CVE-2020-8554), Services refused whole for room.\n\
             # TYPE calix_services_refused gauge\n\
             calix_services_refused{{reason=\"address\"}} {refused}\n\
             calix_services_refused{{reason=\"room\"}} {}\n\
             # HELP calix_services_slice_problems Parts of EndpointSlices skipped (unmatched ports, wrong-family addresses, duplicates).\n\
             # TYPE calix_services_slice_problems gauge\ncalix_services_slice_problems {problems}\n\
             # HELP calix_services_changes_total Changes of Services and EndpointSlices applied.\n\
             # TYPE calix_services_changes_total counter\ncalix_services_changes_total {}\n",
            u8::from(inner.ready),
            limits.frontends,
            limits.backends,
            st.refused_for_room().len(),
            inner.changes,
        )
    }

    /// The ports of the Services with a health check node port (LoadBalancer, `Local`).
    pub fn health_ports(&self) -> BTreeSet<u16> {
        self.lock()
            .state
            .health_checks()
            .into_iter()
            .map(|c| c.port)
            .collect()
    }

    /// What health check node port `port` answers now (status, JSON body, this node's ready
    /// endpoints), kube-proxy's contract (`calix_core::services::health`); `None`: no Service
    /// has it. Healthy: the first listings are in and the last programming worked.
    pub fn health_answer(&self, port: u16) -> Option<(u16, String, usize)> {
        let inner = self.lock();
        let check = inner
            .state
            .health_checks()
            .into_iter()
            .find(|c| c.port == port)?;
        let healthy = inner.ready && inner.program_error.is_none();
        let (status, body) = calix_core::services::health::answer(&check, healthy);
        Some((status, body, check.local_endpoints))
    }

    /// The first listings are in.
    pub fn set_ready(&self) {
        self.lock().ready = true;
    }

    /// Services and slices known.
    pub fn counts(&self) -> (usize, usize) {
        self.lock().state.counts()
    }

    /// Whether the first listings are in.
    pub fn ready(&self) -> bool {
        self.lock().ready
    }

    /// The outcome of the last programming of the dataplane (after a failure the next
    /// translation is whole: what the maps hold is not known).
    pub fn programmed(&self, r: Result<(), String>) {
        let mut inner = self.lock();
        if r.is_err() {
            inner.expanded.everything();
        }
        inner.programmed = r.is_ok();
        inner.program_error = r.err();
    }

    /// Time spent applying changes since the start.
    pub fn applying(&self) -> Duration {
        self.lock().applying
    }

    /// The report, for every Service or the one named `only` (`namespace/name`).
    pub fn report(&self, only: Option<&str>) -> ServicesReport {
        let mut counts = self.counted();
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
            counters: Vec::new(),
        };
        for (k, p) in st.plans() {
            let r = rows.entry(k.to_string()).or_insert_with(|| row(k));
            r.frontends.clone_from(&p.frontends);
            r.refused.clone_from(&p.refused);
            r.problems.clone_from(&p.problems);
            r.counters = counts.remove(k).unwrap_or_default();
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
            programmed: inner.programmed,
            program_error: inner.program_error.clone(),
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

/// Sends the frontends to the dataplane whenever `changed` says they may have changed (a
/// burst of changes is one write), once the first listings are in (until then the pins keep
/// what an agent before wrote: a restart stops no Service traffic): every frontend the first
/// time, then those that changed ([`ServicesService::next_translation`]). A failed write is
/// tried again a second later with every frontend as it is then.
pub async fn program<F, Fut, E>(
    service: std::sync::Arc<ServicesService>,
    node_addresses: Vec<IpAddr>,
    mut changed: tokio::sync::watch::Receiver<u64>,
    set: F,
) where
    F: Fn(Translation) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::error::Error,
{
    loop {
        if service.ready() {
            match set(service.next_translation(&node_addresses)).await {
                Ok(()) => service.programmed(Ok(())),
                Err(e) => {
                    let e = calix_log::error_chain(&e);
                    tracing::error!(error = %e, "Services cannot be programmed; trying again");
                    service.programmed(Err(e));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            }
        }
        if changed.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
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

    pub(super) fn service(name: &str, ip: &str, external: &[&str]) -> Service {
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
            health_check_node_port: None,
        }
    }

    pub(super) fn slice(name: &str, service: &str, backends: &[&str]) -> EndpointSlice {
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
        let said = svc.apply(Change::Service(service(
            "web",
            "10.96.0.10",
            &["192.0.2.9"],
        )));
        assert_eq!(said.len(), 1, "{said:?}");
        assert_eq!(said[0].reason, "ServiceAddressRefused");
        assert!(said[0].message.contains("192.0.2.9"), "{said:?}");
        svc.apply(Change::Slice(slice("web-1", "web", &["10.244.1.5"])));
        // big: two backends more than the room left.
        svc.apply(Change::Service(service("big", "10.96.0.11", &[])));
        let said = svc.apply(Change::Slice(slice(
            "big-1",
            "big",
            &["10.244.1.6", "10.244.1.7"],
        )));
        assert_eq!(said.len(), 1, "{said:?}");
        assert_eq!(said[0].reason, "ServiceNotProgrammed");
        svc.set_unreadable(
            "k8s/endpointslices/shop/web-1",
            Some(key("web")),
            vec!["endpoint address \"x\"".into()],
        );
        svc.set_ready();
        // Said once: web's refused address and big's want of room; a change that leaves them
        // as they are says nothing again.
        let again = svc.apply(Change::Service(service(
            "web",
            "10.96.0.10",
            &["192.0.2.9"],
        )));
        assert!(again.is_empty(), "{again:?}");
        let metrics = svc.metrics();
        for line in [
            "calix_services_ready 1",
            "calix_services_objects{kind=\"service\"} 2",
            "calix_services_refused{reason=\"address\"} 1",
            "calix_services_refused{reason=\"room\"} 1",
            "calix_services_room{kind=\"backend\",of=\"limit\"} 2",
        ] {
            assert!(metrics.contains(line), "{line}:\n{metrics}");
        }
        let r = svc.report(None);
        assert!(r.ready && !r.programmed);
        assert_eq!((r.services, r.slices, r.changes), (2, 2, 5));
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
