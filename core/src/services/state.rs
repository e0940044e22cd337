//! Every Service and EndpointSlice of the cluster, kept one change at a time, with what each
//! change touches (the Services to plan again) and the room the dataplane has: a Service takes
//! one entry per frontend and one per backend of each frontend; one that does not fit in what
//! is left is refused whole and said, never programmed in part, and never evicts one admitted
//! before it. Room freed (a Service removed or shrunk, the limits raised) admits the refused
//! ones again, in the order of their keys.
use std::collections::{BTreeMap, BTreeSet};

use super::admit::Admission;
use super::choose::{Choice, Here};
use super::health::{local_endpoints, HealthCheck};
use super::model::{EndpointSlice, Service, ServiceKey};
use super::slices::backends;
use super::{plan, ServicePlan};

/// A change of the cluster's Services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Service(Service),
    ServiceGone(ServiceKey),
    /// A slice, by its `namespace/name`.
    Slice(EndpointSlice),
    SliceGone(String),
}

/// What a change did: the Services whose plan may have changed (admitted, changed, refused or
/// gone), each with its plan before the change (`None`: it had none). Whoever keeps
/// something derived from the plans updates it from the old plan and the new, not from a pass
/// over all of them.
pub type Replaced = BTreeMap<ServiceKey, Option<ServicePlan>>;

/// The dataplane's room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    pub frontends: usize,
    /// Backend entries: the sum over frontends of the backends each may send to.
    pub backends: usize,
}

/// What a Service's plan takes of the room.
fn size(p: &ServicePlan) -> (usize, usize) {
    let backends = p
        .frontends
        .iter()
        .map(|f| {
            let n = |c: &Choice| match c {
                Choice::To(v) => v.len(),
                _ => 0,
            };
            let local_at: usize = f.local_at.iter().flatten().map(|(_, v)| v.len()).sum();
            n(&f.internal) + f.external.as_ref().map_or(0, n) + local_at
        })
        .sum();
    // A Local NodePort's nodes with endpoints: an entry each (per node address, in fact; one
    // is counted).
    let extra: usize = p
        .frontends
        .iter()
        .map(|f| f.local_at.as_ref().map_or(0, BTreeMap::len))
        .sum();
    // A frontend for clients outside (NodePort, external, LoadBalancer) has an entry of its
    // own for them too (per node address, in fact; one is counted).
    let outside = p.frontends.iter().filter(|f| f.external.is_some()).count();
    (p.frontends.len() + extra + outside, backends)
}

/// The cluster's Services on this node.
#[derive(Debug)]
pub struct State {
    services: BTreeMap<ServiceKey, Service>,
    slices: BTreeMap<String, EndpointSlice>,
    /// Each Service's slices by name: a change plans one Service from its own slices, not
    /// from a scan of every slice of the cluster.
    by_service: BTreeMap<ServiceKey, BTreeSet<String>>,
    rules: Admission,
    here: Here,
    limits: Limits,
    /// The admitted Services' plans.
    plans: BTreeMap<ServiceKey, ServicePlan>,
    /// Services refused for room, with what they would take.
    refused: BTreeMap<ServiceKey, (usize, usize)>,
    used: (usize, usize),
}

impl State {
    pub fn new(rules: Admission, here: Here, limits: Limits) -> Self {
        Self {
            services: BTreeMap::new(),
            slices: BTreeMap::new(),
            by_service: BTreeMap::new(),
            rules,
            here,
            limits,
            plans: BTreeMap::new(),
            refused: BTreeMap::new(),
            used: (0, 0),
        }
    }

    /// Applies `change`; returns the plans it replaced.
    pub fn apply(&mut self, change: Change) -> Replaced {
        let key = match change {
            Change::Service(s) => {
                let k = s.key.clone();
                self.services.insert(k.clone(), s);
                k
            }
            Change::ServiceGone(k) => {
                self.services.remove(&k);
                k
            }
            Change::Slice(s) => {
                let mut touched = BTreeSet::new();
                if let Some(old) = self.slices.insert(s.name.clone(), s.clone()) {
                    self.unindex(&old);
                    touched.insert(old.service);
                }
                self.by_service
                    .entry(s.service.clone())
                    .or_default()
                    .insert(s.name.clone());
                touched.insert(s.service);
                return self.replan_keeping(touched);
            }
            Change::SliceGone(name) => match self.slices.remove(&name) {
                Some(old) => {
                    self.unindex(&old);
                    old.service
                }
                None => return Replaced::new(),
            },
        };
        self.replan_keeping(BTreeSet::from([key]))
    }

    /// [`Self::replan`], keeping the plans it replaced.
    fn replan_keeping(&mut self, touched: BTreeSet<ServiceKey>) -> Replaced {
        let mut replaced = Replaced::new();
        self.replan(touched, |k, before| {
            replaced.insert(k, before);
        });
        replaced
    }

    /// [`Self::replan`], keeping only which Services it touched: each old plan is dropped as
    /// it is replaced (a rules change replans every Service).
    fn replan_keys(&mut self, touched: BTreeSet<ServiceKey>) -> BTreeSet<ServiceKey> {
        let mut keys = BTreeSet::new();
        self.replan(touched, |k, _| {
            keys.insert(k);
        });
        keys
    }

    fn unindex(&mut self, old: &EndpointSlice) {
        if let Some(names) = self.by_service.get_mut(&old.service) {
            names.remove(&old.name);
            if names.is_empty() {
                self.by_service.remove(&old.service);
            }
        }
    }

    /// New admission rules (pools, node addresses, allowed CIDRs): every Service again; returns
    /// the Services whose plan may have changed (not their old plans: whoever keeps something
    /// derived from the plans starts over from all of them).
    pub fn set_rules(&mut self, rules: Admission) -> BTreeSet<ServiceKey> {
        self.rules = rules;
        let all: BTreeSet<ServiceKey> = self.services.keys().cloned().collect();
        self.replan_keys(all)
    }

    /// New limits: the refused may fit now (admitted ones stay, even over smaller limits);
    /// returns the Services admitted.
    pub fn set_limits(&mut self, limits: Limits) -> BTreeSet<ServiceKey> {
        self.limits = limits;
        self.replan_keys(BTreeSet::new())
    }

    /// Service `k`'s slices.
    fn slices_of(&self, k: &ServiceKey) -> Vec<EndpointSlice> {
        self.by_service
            .get(k)
            .into_iter()
            .flatten()
            .filter_map(|name| self.slices.get(name).cloned())
            .collect()
    }

    /// Service `k`'s plan from what is known now; `None` when it is gone.
    fn compute(&self, k: &ServiceKey) -> Option<ServicePlan> {
        let svc = self.services.get(k)?;
        Some(plan(svc, &self.slices_of(k), &self.rules, &self.here))
    }

    /// Every Service with a health check node port, and this node's ready endpoints of it
    /// (whether or not it fits the dataplane's room: the count is the slices').
    pub fn health_checks(&self) -> Vec<HealthCheck> {
        self.services
            .values()
            .filter_map(|svc| {
                let port = svc.health_check_node_port?;
                let (backends, _) = backends(svc, &self.slices_of(&svc.key));
                Some(HealthCheck {
                    service: svc.key.clone(),
                    port,
                    local_endpoints: local_endpoints(&backends, &self.here),
                })
            })
            .collect()
    }

    fn fits(&self, need: (usize, usize)) -> bool {
        self.used.0 + need.0 <= self.limits.frontends
            && self.used.1 + need.1 <= self.limits.backends
    }

    /// Plans the `touched` Services again, then admits the refused that fit now; hands each
    /// Service whose plan may have changed to `replaced`, with its plan before (once each).
    fn replan(
        &mut self,
        touched: BTreeSet<ServiceKey>,
        mut replaced: impl FnMut(ServiceKey, Option<ServicePlan>),
    ) {
        for k in &touched {
            // What it had is freed first: it is planned again from nothing.
            let before = self.plans.remove(k);
            let old = before.as_ref().map(size).unwrap_or((0, 0));
            self.used = (self.used.0 - old.0, self.used.1 - old.1);
            match self.compute(k) {
                None => {
                    self.refused.remove(k);
                }
                Some(p) => {
                    let need = size(&p);
                    if self.fits(need) {
                        self.used = (self.used.0 + need.0, self.used.1 + need.1);
                        self.refused.remove(k);
                        self.plans.insert(k.clone(), p);
                    } else {
                        // Refused whole: it never keeps half a plan.
                        self.refused.insert(k.clone(), need);
                    }
                }
            }
            replaced(k.clone(), before);
        }
        // Room freed may admit the refused, in key order (they had no plan).
        let waiting: Vec<(ServiceKey, (usize, usize))> = self
            .refused
            .iter()
            .filter(|(k, _)| !touched.contains(*k))
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        for (k, need) in waiting {
            if self.fits(need) {
                if let Some(p) = self.compute(&k) {
                    let need = size(&p);
                    if self.fits(need) {
                        self.used = (self.used.0 + need.0, self.used.1 + need.1);
                        self.refused.remove(&k);
                        self.plans.insert(k.clone(), p);
                        replaced(k, None);
                    }
                }
            }
        }
    }

    /// The admission rules in force (the nodes' addresses among them).
    pub fn rules(&self) -> &Admission {
        &self.rules
    }

    /// An admitted Service's plan.
    pub fn plan(&self, k: &ServiceKey) -> Option<&ServicePlan> {
        self.plans.get(k)
    }

    /// Every admitted Service's plan.
    pub fn plans(&self) -> &BTreeMap<ServiceKey, ServicePlan> {
        &self.plans
    }

    /// The Services refused for room, with the frontends and backend entries each needs.
    pub fn refused_for_room(&self) -> &BTreeMap<ServiceKey, (usize, usize)> {
        &self.refused
    }

    /// Frontends and backend entries in use.
    pub fn used(&self) -> (usize, usize) {
        self.used
    }

    /// The room.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Services and slices known (admitted or not).
    pub fn counts(&self) -> (usize, usize) {
        (self.services.len(), self.slices.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::fixtures::{endpoint, here, service, slice};
    use crate::services::model::AddressType;

    fn keys(r: Replaced) -> BTreeSet<ServiceKey> {
        r.into_keys().collect()
    }

    fn web(name: &str, backends: &[&str]) -> (Service, EndpointSlice) {
        let svc = service(name, &[("http", 80)]);
        let s = slice(
            &format!("default/{name}-1"),
            &svc,
            AddressType::V4,
            &[("http", Some(8080))],
            backends.iter().map(|a| endpoint(&[a], true)).collect(),
        );
        (svc, s)
    }

    #[test]
    fn a_change_touches_its_service_and_a_moved_slice_both() {
        let mut st = State::new(
            Admission::default(),
            here(),
            Limits {
                frontends: 10,
                backends: 10,
            },
        );
        let (a, sa) = web("a", &["10.244.1.1"]);
        let (b, _) = web("b", &[]);
        let ka = a.key.clone();
        assert_eq!(
            keys(st.apply(Change::Service(a))),
            BTreeSet::from([ka.clone()])
        );
        st.apply(Change::Service(b.clone()));
        assert_eq!(
            keys(st.apply(Change::Slice(sa.clone()))),
            BTreeSet::from([ka.clone()])
        );
        assert!(
            matches!(&st.plan(&ka).expect("planned").frontends[0].internal, Choice::To(v) if v.len() == 1)
        );
        // The slice now names b: both are planned again.
        let mut moved = sa.clone();
        moved.service = b.key.clone();
        let before = st.plan(&ka).cloned();
        let replaced = st.apply(Change::Slice(moved));
        assert_eq!(replaced.get(&ka), Some(&before), "a's plan as it was");
        assert_eq!(keys(replaced), BTreeSet::from([ka.clone(), b.key.clone()]));
        assert_eq!(
            st.plan(&ka).expect("planned").frontends[0].internal,
            Choice::Reject
        );
        assert_eq!(
            keys(st.apply(Change::SliceGone("nothing".into()))),
            BTreeSet::new()
        );
        st.apply(Change::ServiceGone(ka.clone()));
        assert!(st.plan(&ka).is_none());
        assert_eq!(st.used(), (1, 1), "b: one frontend, one backend");
    }

    #[test]
    fn a_service_that_does_not_fit_is_refused_whole_and_evicts_nothing() {
        let mut st = State::new(
            Admission::default(),
            here(),
            Limits {
                frontends: 10,
                backends: 3,
            },
        );
        let (a, sa) = web("a", &["10.244.1.1", "10.244.1.2"]);
        let (b, sb) = web("b", &["10.244.2.1", "10.244.2.2"]);
        for c in [
            Change::Service(a.clone()),
            Change::Slice(sa),
            Change::Service(b.clone()),
            Change::Slice(sb),
        ] {
            st.apply(c);
        }
        assert!(st.plan(&a.key).is_some(), "first come, kept");
        assert!(st.plan(&b.key).is_none(), "refused whole");
        assert_eq!(st.refused_for_room().get(&b.key), Some(&(1, 2)));
        assert_eq!(st.used(), (1, 2));
        // Room freed: a goes, b comes in.
        let replaced = st.apply(Change::ServiceGone(a.key.clone()));
        assert!(replaced[&a.key].is_some() && replaced[&b.key].is_none());
        assert_eq!(
            keys(replaced),
            BTreeSet::from([a.key.clone(), b.key.clone()])
        );
        assert!(st.plan(&b.key).is_some());
        assert!(st.refused_for_room().is_empty());
        // A grown Service that no longer fits leaves whole; raised limits take it back.
        let (_, big) = web(
            "b",
            &["10.244.2.1", "10.244.2.2", "10.244.2.3", "10.244.2.4"],
        );
        st.apply(Change::Slice(big));
        assert!(st.plan(&b.key).is_none());
        assert_eq!(st.used(), (0, 0));
        let touched = st.set_limits(Limits {
            frontends: 10,
            backends: 4,
        });
        assert_eq!(touched, BTreeSet::from([b.key.clone()]));
        assert!(st.plan(&b.key).is_some());
    }

    /// A NodePort takes its cluster IP's entry, the NodePort's, and one for clients outside
    /// (with its backends: the external choice's).
    #[test]
    fn a_nodeport_counts_its_entry_for_clients_outside() {
        let mut st = State::new(
            Admission::default(),
            here(),
            Limits {
                frontends: 10,
                backends: 10,
            },
        );
        let (mut a, sa) = web("a", &["10.244.1.1"]);
        a.ports[0].node_port = Some(30080);
        st.apply(Change::Service(a));
        st.apply(Change::Slice(sa));
        assert_eq!(
            st.used(),
            (3, 3),
            "frontends: cluster IP, NodePort, NodePort for clients outside; a backend each"
        );
    }
}
