//! The cluster as the policy calculation sees it (namespaces, pods, policies), kept up to date
//! one change at a time. Each change says what it touched: the endpoints whose rules must be
//! computed again, and the sets whose members changed, with the members added and removed. A
//! pod's label change touches that pod's own rules and the sets it moves in or out of, not
//! every endpoint.
use std::collections::{BTreeMap, BTreeSet};

use super::endpoint::{self, selects, EndpointPolicy};
use super::model::{Labels, Pod, PodKey, Policy, PolicyKey};
use super::sets::{Member, SetKey};

/// One change seen by the watches.
#[derive(Debug, Clone)]
pub enum Change {
    Namespace { name: String, labels: Labels },
    NamespaceGone(String),
    Pod(Pod),
    PodGone(PodKey),
    Policy(Policy),
    PolicyGone(PolicyKey),
}

/// What one set gained and lost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetDelta {
    pub added: BTreeSet<Member>,
    pub removed: BTreeSet<Member>,
}

/// What a change touched.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Touched {
    /// Endpoints to compute again ([`Cluster::endpoint`]); the caller keeps its own.
    pub endpoints: BTreeSet<PodKey>,
    /// Sets whose members changed. A set no rule names any more is here with every member
    /// removed, and is in [`Touched::gone`].
    pub sets: BTreeMap<SetKey, SetDelta>,
    /// Sets no rule names any more.
    pub gone: BTreeSet<SetKey>,
}

/// A set some rule names: how many rules, and its members (each with how many pods bring it:
/// an address can stay while the pod that had it goes and another takes it).
#[derive(Debug, Default)]
struct Used {
    rules: usize,
    members: BTreeMap<Member, usize>,
}

#[derive(Debug, Default)]
pub struct Cluster {
    namespaces: BTreeMap<String, Labels>,
    pods: BTreeMap<PodKey, Pod>,
    policies: BTreeMap<PolicyKey, Policy>,
    sets: BTreeMap<SetKey, Used>,
}

impl Cluster {
    pub fn new() -> Self {
        Self::default()
    }

    /// The endpoint policy of pod `key` now (None: unknown, or on the host's network).
    pub fn endpoint(&self, key: &PodKey) -> Option<EndpointPolicy> {
        let pod = self.pods.get(key)?;
        endpoint::compute(pod, self.policies_of(&key.namespace))
    }

    /// The members of `set` now (empty if no rule names it).
    pub fn members(&self, set: &SetKey) -> BTreeSet<Member> {
        self.sets
            .get(set)
            .map(|u| u.members.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Every set a rule names.
    pub fn sets(&self) -> impl Iterator<Item = &SetKey> {
        self.sets.keys()
    }

    pub fn pod(&self, key: &PodKey) -> Option<&Pod> {
        self.pods.get(key)
    }

    pub fn policy(&self, key: &PolicyKey) -> Option<&Policy> {
        self.policies.get(key)
    }

    /// The pod (not on the host's network) that has address `ip`, if one does.
    pub fn pod_with_address(&self, ip: std::net::IpAddr) -> Option<&PodKey> {
        self.pods
            .values()
            .find(|p| !p.host_network && p.ips.contains(&ip))
            .map(|p| &p.key)
    }

    pub fn counts(&self) -> (usize, usize, usize, usize) {
        (
            self.namespaces.len(),
            self.pods.len(),
            self.policies.len(),
            self.sets.len(),
        )
    }

    fn policies_of<'a>(&'a self, namespace: &'a str) -> impl Iterator<Item = &'a Policy> {
        self.policies
            .range(
                PolicyKey {
                    namespace: namespace.to_string(),
                    name: String::new(),
                }..,
            )
            .take_while(move |(k, _)| k.namespace == namespace)
            .map(|(_, p)| p)
    }

    fn pods_of<'a>(&'a self, namespace: &'a str) -> impl Iterator<Item = &'a Pod> {
        self.pods
            .range(
                PodKey {
                    namespace: namespace.to_string(),
                    name: String::new(),
                }..,
            )
            .take_while(move |(k, _)| k.namespace == namespace)
            .map(|(_, p)| p)
    }

    /// Applies one change and says what it touched.
    pub fn apply(&mut self, change: Change) -> Touched {
        let mut t = Touched::default();
        match change {
            Change::Namespace { name, labels } => {
                let old = self.namespaces.insert(name.clone(), labels);
                self.namespace_moved(&name, old, &mut t);
            }
            Change::NamespaceGone(name) => {
                if let Some(old) = self.namespaces.remove(&name) {
                    self.namespace_moved(&name, Some(old), &mut t);
                }
            }
            Change::Pod(pod) => {
                let key = pod.key.clone();
                let old = self.pods.insert(key.clone(), pod);
                self.pod_moved(old.as_ref(), &key, &mut t);
                t.endpoints.insert(key);
            }
            Change::PodGone(key) => {
                if let Some(old) = self.pods.remove(&key) {
                    self.pod_moved(Some(&old), &key, &mut t);
                    t.endpoints.insert(key);
                }
            }
            Change::Policy(policy) => {
                let key = policy.key.clone();
                let old = self.policies.insert(key.clone(), policy);
                self.policy_moved(old, &key, &mut t);
            }
            Change::PolicyGone(key) => {
                if let Some(old) = self.policies.remove(&key) {
                    self.policy_moved(Some(old), &key, &mut t);
                }
            }
        }
        t.sets
            .retain(|_, d| !(d.added.is_empty() && d.removed.is_empty()));
        t
    }

    /// A pod was `old` and is now what `self.pods` holds at `key` (or gone): every set moves by
    /// the difference of what the two bring.
    fn pod_moved(&mut self, old: Option<&Pod>, key: &PodKey, t: &mut Touched) {
        let ns = self.namespaces.get(&key.namespace);
        let new = self.pods.get(key);
        for (set, used) in &mut self.sets {
            let before = old.map(|p| set.members_of(p, ns)).unwrap_or_default();
            let after = new.map(|p| set.members_of(p, ns)).unwrap_or_default();
            if before == after {
                continue;
            }
            let delta = t.sets.entry(set.clone()).or_default();
            count(used, &before, &after, delta);
        }
    }

    /// A namespace's labels were `old` and are now what `self.namespaces` holds (or none): the
    /// sets that read namespaces move by its pods.
    fn namespace_moved(&mut self, name: &str, old: Option<Labels>, t: &mut Touched) {
        let new = self.namespaces.get(name).cloned();
        let pods: Vec<Pod> = self.pods_of(name).cloned().collect();
        for (set, used) in &mut self.sets {
            if !set.reads_namespaces() {
                continue;
            }
            for pod in &pods {
                let before = set.members_of(pod, old.as_ref());
                let after = set.members_of(pod, new.as_ref());
                if before != after {
                    let delta = t.sets.entry(set.clone()).or_default();
                    count(used, &before, &after, delta);
                }
            }
        }
    }

    /// A policy was `old` and is now what `self.policies` holds (or gone): the endpoints either
    /// selects, and the sets either names.
    fn policy_moved(&mut self, old: Option<Policy>, key: &PolicyKey, t: &mut Touched) {
        let new = self.policies.get(key).cloned();
        for pod in self.pods_of(&key.namespace) {
            if old.iter().chain(&new).any(|p| selects(p, pod)) {
                t.endpoints.insert(pod.key.clone());
            }
        }
        let named = |p: &Option<Policy>| -> Vec<SetKey> {
            p.iter().flat_map(endpoint::policy_sets).collect()
        };
        for set in named(&new) {
            self.use_set(set, t);
        }
        for set in named(&old) {
            self.drop_set(set, t);
        }
    }

    fn use_set(&mut self, set: SetKey, t: &mut Touched) {
        if let Some(u) = self.sets.get_mut(&set) {
            u.rules += 1;
            return;
        }
        let mut used = Used {
            rules: 1,
            members: BTreeMap::new(),
        };
        let mut added = BTreeSet::new();
        for m in set.fixed_members() {
            *used.members.entry(m).or_default() += 1;
            added.insert(m);
        }
        for pod in self.pods.values() {
            for m in set.members_of(pod, self.namespaces.get(&pod.key.namespace)) {
                *used.members.entry(m).or_default() += 1;
                added.insert(m);
            }
        }
        t.gone.remove(&set);
        let delta = t.sets.entry(set.clone()).or_default();
        delta.removed.retain(|m| !added.contains(m));
        delta.added.extend(added);
        self.sets.insert(set, used);
    }

    fn drop_set(&mut self, set: SetKey, t: &mut Touched) {
        let Some(u) = self.sets.get_mut(&set) else {
            return;
        };
        u.rules -= 1;
        if u.rules > 0 {
            return;
        }
        let Some(u) = self.sets.remove(&set) else {
            return;
        };
        let delta = t.sets.entry(set.clone()).or_default();
        delta.added.clear();
        delta.removed.extend(u.members.into_keys());
        t.gone.insert(set);
    }
}

/// Counts `before` out and `after` in; what crosses zero goes into `delta`.
fn count(used: &mut Used, before: &[Member], after: &[Member], delta: &mut SetDelta) {
    for m in before {
        if let Some(n) = used.members.get_mut(m) {
            *n -= 1;
            if *n == 0 {
                used.members.remove(m);
                if !delta.added.remove(m) {
                    delta.removed.insert(*m);
                }
            }
        }
    }
    for m in after {
        let n = used.members.entry(*m).or_default();
        *n += 1;
        if *n == 1 && !delta.removed.remove(m) {
            delta.added.insert(*m);
        }
    }
}
