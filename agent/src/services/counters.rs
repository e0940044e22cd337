//! What the socket programs counted, per Service (`calix_common::SVC_COUNTERS_MAP`): each
//! counted frontend key back to its Service's frontend, for `calixctl services` and the
//! metrics. The metrics name at most [`SERVICE_SERIES`] Services (the first to count, kept
//! while they exist); the others are summed under `service="other"`, so a cluster of 10,000
//! Services costs the scraper the same as one of 100.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use calix_common::{SvcCounters, SvcKey};
use calix_core::services::admit::Kind;
use calix_core::services::model::{Protocol, ServiceKey};
use calix_core::services::ServicePlan;
use calix_dataplane::ebpf::services::{front, TCP, UDP};
use calix_dataplane::DataplaneStats;
use serde::{Deserialize, Serialize};

use super::ServicesService;

/// Services the metrics name one by one, at most.
pub const SERVICE_SERIES: usize = 100;

/// One frontend's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrontCounts {
    /// Connections sent to a backend (TCP and UDP `connect`, an unconnected UDP socket's
    /// first datagram; from outside the nodes, each new flow).
    pub connections: u64,
    /// Calls refused (no endpoint; a `Local` policy with none there), from inside or outside.
    pub refused: u64,
}

/// Each counted key's counters added to its Service's frontend (by index in the plan's
/// frontends); keys no frontend of `plans` stands for (a Service just removed) are left out.
/// A key's address is a frontend's own, else a node's (a NodePort: the wildcard and, with
/// `externalTrafficPolicy: Local`, node addresses), as `calix_core::services::frontend_for`
/// reads it; the frontends are indexed once, so a scrape stays linear in the Services.
pub fn attribute(
    plans: &BTreeMap<ServiceKey, ServicePlan>,
    counted: &[(SvcKey, SvcCounters)],
) -> BTreeMap<ServiceKey, Vec<FrontCounts>> {
    // (address, protocol, port) → (Service, frontend index); a NodePort's address is `None`.
    // The first in the plans' order wins, as in `frontend_for`.
    let mut index: BTreeMap<(Option<IpAddr>, Protocol, u16), (&ServiceKey, usize)> =
        BTreeMap::new();
    for (k, plan) in plans {
        for (i, p) in plan.frontends.iter().enumerate() {
            let f = &p.frontend;
            if f.address.is_some() || f.kind == Kind::NodePort {
                index
                    .entry((f.address, f.protocol, f.port))
                    .or_insert((k, i));
            }
        }
    }
    let mut out: BTreeMap<ServiceKey, Vec<FrontCounts>> = BTreeMap::new();
    for (k, c) in counted {
        let Some(f) = front(k) else { continue };
        let protocol = match f.proto {
            TCP => Protocol::Tcp,
            UDP => Protocol::Udp,
            _ => continue,
        };
        let Some(&(service, i)) = index
            .get(&(Some(f.address), protocol, f.port))
            .or_else(|| index.get(&(None, protocol, f.port)))
        else {
            continue;
        };
        let len = plans.get(service).map_or(0, |p| p.frontends.len());
        let counts = out
            .entry(service.clone())
            .or_insert_with(|| vec![FrontCounts::default(); len]);
        counts[i].connections = counts[i].connections.wrapping_add(c.connections);
        counts[i].refused = counts[i].refused.wrapping_add(c.refused);
    }
    out
}

/// A Service's frontends' counters summed.
fn total(v: &[FrontCounts]) -> FrontCounts {
    v.iter().fold(FrontCounts::default(), |a, c| FrontCounts {
        connections: a.connections.wrapping_add(c.connections),
        refused: a.refused.wrapping_add(c.refused),
    })
}

/// The per-Service metrics: Services of `named` (updated: gone ones dropped, new counting ones
/// added in name order while there is room) one by one, the rest as `other`.
pub fn render(
    counts: &BTreeMap<ServiceKey, Vec<FrontCounts>>,
    live: &BTreeSet<ServiceKey>,
    named: &mut BTreeSet<ServiceKey>,
) -> String {
    named.retain(|k| live.contains(k));
    for (k, v) in counts {
        let t = total(v);
        if named.len() < SERVICE_SERIES && (t.connections > 0 || t.refused > 0) {
            named.insert(k.clone());
        }
    }
    let mut other = FrontCounts::default();
    let mut lines = Vec::new();
    for (k, v) in counts {
        let t = total(v);
        if named.contains(k) {
            lines.push((crate::prometheus::label_value(&k.to_string()), t));
        } else {
            other.connections = other.connections.wrapping_add(t.connections);
            other.refused = other.refused.wrapping_add(t.refused);
        }
    }
    // A named Service that has not counted since a restart of the counters still has its
    // series (at zero): a series never vanishes while its Service exists.
    for k in named.iter().filter(|k| !counts.contains_key(*k)) {
        lines.push((
            crate::prometheus::label_value(&k.to_string()),
            FrontCounts::default(),
        ));
    }
    lines.sort_by(|a, b| a.0.cmp(&b.0));
    lines.push(("other".into(), other));
    let mut out = format!(
        "# HELP calix_service_connections_total Connections sent to a Service's backends at this node's sockets, by Service (at most {SERVICE_SERIES}; the rest under \"other\").\n\
         # TYPE calix_service_connections_total counter\n"
    );
    for (s, t) in &lines {
        let _ = writeln!(
            out,
            "calix_service_connections_total{{service=\"{s}\"}} {}",
            t.connections
        );
    }
    out.push_str(
        "# HELP calix_service_refused_total Connections to a Service refused at this node's sockets (no endpoint), by Service.\n\
         # TYPE calix_service_refused_total counter\n",
    );
    for (s, t) in &lines {
        let _ = writeln!(
            out,
            "calix_service_refused_total{{service=\"{s}\"}} {}",
            t.refused
        );
    }
    out
}

impl ServicesService {
    /// Where the socket programs' counters are read (the eBPF dataplane's pinned maps).
    pub fn set_counters(&self, stats: Box<dyn DataplaneStats>) {
        let _ = self.counters.set(stats);
    }

    /// The counters, per Service and frontend; empty without a dataplane that counts (or
    /// when reading fails: said in the log).
    pub(super) fn counted(&self) -> BTreeMap<ServiceKey, Vec<FrontCounts>> {
        let Some(stats) = self.counters.get() else {
            return BTreeMap::new();
        };
        // Read before the calculation's lock: a scrape never holds up a change.
        let counted = match stats.service_counters() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %calix_log::error_chain(&e), "cannot read the Services counters");
                return BTreeMap::new();
            }
        };
        attribute(self.lock().state.plans(), &counted)
    }

    /// The per-Service metrics (bounded: [`SERVICE_SERIES`] Services by name, then `other`).
    pub(super) fn counter_metrics(&self) -> String {
        let counts = self.counted();
        let mut inner = self.lock();
        let live: BTreeSet<ServiceKey> = inner.state.plans().keys().cloned().collect();
        let mut named = std::mem::take(&mut inner.series);
        let out = render(&counts, &live, &mut named);
        inner.series = named;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_core::services::admit::Admission;
    use calix_core::services::state::{Change, Limits};
    use calix_dataplane::ebpf::services::{key, Front};

    use super::super::tests::{service, slice};

    fn counted(address: &str, port: u16, connections: u64, refused: u64) -> (SvcKey, SvcCounters) {
        (
            key(&Front {
                address: address.parse().expect("ip"),
                port,
                proto: TCP,
                external: false,
            }),
            SvcCounters {
                connections,
                refused,
            },
        )
    }

    fn svc_key(name: &str) -> ServiceKey {
        ServiceKey {
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    #[test]
    fn counters_go_to_their_services_frontend_and_strays_are_left_out() {
        let svc = ServicesService::new(
            "n1",
            None,
            Admission::default(),
            Limits {
                frontends: 8,
                backends: 8,
            },
        );
        svc.apply(Change::Service(service("web", "10.96.0.10", &[])));
        svc.apply(Change::Slice(slice("web-1", "web", &["10.244.1.5"])));
        svc.apply(Change::Service(service("db", "10.96.0.11", &[])));
        let plans = svc.lock().state.plans().clone();
        let got = attribute(
            &plans,
            &[
                counted("10.96.0.10", 80, 5, 0),
                counted("10.96.0.11", 80, 0, 3),
                // A frontend no Service has (removed), and one of another port.
                counted("10.96.0.12", 80, 7, 7),
                counted("10.96.0.10", 81, 7, 7),
            ],
        );
        assert_eq!(
            got.get(&svc_key("web")),
            Some(&vec![FrontCounts {
                connections: 5,
                refused: 0
            }])
        );
        assert_eq!(
            got.get(&svc_key("db")),
            Some(&vec![FrontCounts {
                connections: 0,
                refused: 3
            }])
        );
        assert_eq!(got.len(), 2, "{got:?}");
        // A NodePort counts at its wildcard key and at a node's address alike.
        let mut np = service("np", "10.96.0.13", &[]);
        np.ports[0].node_port = Some(30080);
        svc.apply(Change::Service(np));
        let plans = svc.lock().state.plans().clone();
        let got = attribute(
            &plans,
            &[
                counted("0.0.0.0", 30080, 2, 0),
                counted("192.0.2.1", 30080, 1, 1),
                counted("10.96.0.13", 80, 4, 0),
            ],
        );
        let fronts = &plans[&svc_key("np")].frontends;
        let at = |kind: Kind| {
            let i = fronts
                .iter()
                .position(|p| p.frontend.kind == kind)
                .unwrap_or_else(|| panic!("a {kind:?} frontend: {fronts:?}"));
            got[&svc_key("np")][i]
        };
        assert_eq!(
            at(Kind::NodePort),
            FrontCounts {
                connections: 3,
                refused: 1
            }
        );
        assert_eq!(
            at(Kind::ClusterIp),
            FrontCounts {
                connections: 4,
                refused: 0
            }
        );
    }

    #[test]
    fn the_metrics_name_a_bounded_number_of_services_and_sum_the_rest() {
        let mut counts = BTreeMap::new();
        let mut live = BTreeSet::new();
        for i in 0..SERVICE_SERIES + 5 {
            let k = svc_key(&format!("s{i:03}"));
            counts.insert(
                k.clone(),
                vec![FrontCounts {
                    connections: 1,
                    refused: 2,
                }],
            );
            live.insert(k);
        }
        let mut named = BTreeSet::new();
        let text = render(&counts, &live, &mut named);
        assert_eq!(named.len(), SERVICE_SERIES);
        let series = |t: &str| {
            t.lines()
                .filter(|l| l.starts_with("calix_service_connections_total{"))
                .count()
        };
        assert_eq!(series(&text), SERVICE_SERIES + 1, "{text}");
        assert!(
            text.contains("calix_service_connections_total{service=\"other\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains("calix_service_refused_total{service=\"other\"} 10\n"),
            "{text}"
        );
        assert!(
            text.contains("calix_service_connections_total{service=\"shop/s000\"} 1\n"),
            "{text}"
        );
        // A named Service keeps its series; one that is gone gives its place to the next.
        live.remove(&svc_key("s000"));
        counts.remove(&svc_key("s000"));
        counts.remove(&svc_key("s001"));
        let text = render(&counts, &live, &mut named);
        assert!(!text.contains("shop/s000"), "{text}");
        assert!(
            text.contains("calix_service_connections_total{service=\"shop/s001\"} 0\n"),
            "{text}"
        );
        assert!(named.contains(&svc_key(&format!("s{SERVICE_SERIES:03}"))));
        assert_eq!(series(&text), SERVICE_SERIES + 1, "{text}");
    }
}
