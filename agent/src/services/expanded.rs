//! Which Service has each frontend, kept between programmings, and the plans changes replaced
//! since: a change re-expands ([`super::translation::expand`]) only the Services it touched,
//! old plan and new, and the dataplane gets only the frontends that changed. At 10,000
//! Services a change so costs what its own Services cost, not a pass over all of them (the
//! whole translation and the programmer's diff of every frontend, ~100 ms of CPU a change
//! before). Nothing of a Service is kept but its key per frontend: the old plans wait here
//! only until the next programming, and the expansion of a plan is not kept at all (keeping it
//! cost ~0.3 KiB a Service).
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use calix_core::services::model::ServiceKey;
use calix_core::services::state::Replaced;
use calix_core::services::ServicePlan;
use calix_dataplane::ebpf::services::{Front, Frontends, Target, Translation};

use super::translation::{expand, Where};

/// A Service's frontends, sorted, each once.
type Fronts = Vec<(Front, Target)>;

/// The Services naming one frontend, in key order: the last has it (as in the whole
/// translation, where a later Service's entry replaces an earlier one's). Almost always one,
/// kept without a list of its own.
#[derive(Debug)]
enum Owners {
    One(ServiceKey),
    /// Two or more, sorted.
    Many(Vec<ServiceKey>),
}

impl Owners {
    fn add(&mut self, k: &ServiceKey) {
        match self {
            Owners::One(x) if x == k => {}
            Owners::One(x) => {
                let mut v = vec![x.clone(), k.clone()];
                v.sort();
                *self = Owners::Many(v);
            }
            Owners::Many(v) => {
                if let Err(at) = v.binary_search(k) {
                    v.insert(at, k.clone());
                }
            }
        }
    }

    /// Takes `k` out; whether none is left.
    fn remove(&mut self, k: &ServiceKey) -> bool {
        match self {
            Owners::One(x) => x == k,
            Owners::Many(v) => {
                v.retain(|x| x != k);
                if let [only] = v.as_slice() {
                    *self = Owners::One(only.clone());
                }
                false
            }
        }
    }

    /// The one that has the frontend.
    fn last(&self) -> Option<&ServiceKey> {
        match self {
            Owners::One(x) => Some(x),
            Owners::Many(v) => v.last(),
        }
    }
}

/// Who has each frontend as last expanded, and what changed since the dataplane last took
/// them.
pub(super) struct Expanded {
    owners: BTreeMap<Front, Owners>,
    /// Services changes touched since the last translation, each with its plan then (the
    /// first a change replaced; `None`: it had none).
    stale: Replaced,
    /// Every Service again, and a whole translation: at the start, after the nodes' addresses
    /// or the admission rules changed, after a programming failed.
    whole: bool,
    /// This node's own addresses at the last expansion.
    own: Vec<IpAddr>,
}

impl Default for Expanded {
    fn default() -> Self {
        Self {
            owners: BTreeMap::new(),
            stale: Replaced::new(),
            whole: true,
            own: Vec::new(),
        }
    }
}

impl Expanded {
    /// A change replaced these plans.
    pub fn replaced(&mut self, replaced: Replaced) {
        if self.whole {
            // Every Service is expanded anew next: the old plans are of no use.
            return;
        }
        for (k, before) in replaced {
            // The first replaced since the last translation is the one it expanded.
            self.stale.entry(k).or_insert(before);
        }
    }

    /// Every Service's frontends may have changed (the nodes, the rules), or the dataplane's
    /// maps are not known to hold what was handed out (a failed programming): whole next.
    pub fn everything(&mut self) {
        self.whole = true;
        self.stale.clear();
    }

    /// What to program now: whole, or the frontends changed since the last call. `w` is
    /// where the last call expanded (a change of the nodes or the rules makes it whole).
    pub fn next(
        &mut self,
        plans: &BTreeMap<ServiceKey, ServicePlan>,
        w: &Where,
        nodes: BTreeSet<IpAddr>,
        own: &[IpAddr],
    ) -> Translation {
        if self.whole || self.own != own {
            return self.rebuild(plans, w, nodes, own);
        }
        let mut pending = BTreeSet::new();
        // This pass's expansions of the Services it looks at.
        let mut now: BTreeMap<ServiceKey, Fronts> = BTreeMap::new();
        for (k, before) in std::mem::take(&mut self.stale) {
            let new = plans.get(&k).map(|p| fronts(p, w)).unwrap_or_default();
            let old = before.map(|p| fronts(&p, w)).unwrap_or_default();
            for (f, _) in old.iter().filter(|(f, _)| find(&new, f).is_none()) {
                if self.owners.get_mut(f).is_some_and(|o| o.remove(&k)) {
                    self.owners.remove(f);
                }
                pending.insert(*f);
            }
            for (f, t) in &new {
                if find(&old, f) != Some(t) {
                    match self.owners.get_mut(f) {
                        Some(o) => o.add(&k),
                        None => {
                            self.owners.insert(*f, Owners::One(k.clone()));
                        }
                    }
                    pending.insert(*f);
                }
            }
            now.insert(k, new);
        }
        let mut frontends = Frontends::new();
        let mut gone = BTreeSet::new();
        for f in pending {
            let target = self.owners.get(&f).and_then(Owners::last).and_then(|k| {
                // An owner no change touched (a frontend another Service gave up): its
                // plan is as it was.
                let e = now
                    .entry(k.clone())
                    .or_insert_with(|| plans.get(k).map(|p| fronts(p, w)).unwrap_or_default());
                find(e, &f).cloned()
            });
            match target {
                Some(t) => {
                    frontends.insert(f, t);
                }
                None => {
                    gone.insert(f);
                }
            }
        }
        Translation {
            frontends,
            gone,
            whole: false,
            nodes,
        }
    }

    /// Every Service expanded again; the whole translation.
    fn rebuild(
        &mut self,
        plans: &BTreeMap<ServiceKey, ServicePlan>,
        w: &Where,
        nodes: BTreeSet<IpAddr>,
        own: &[IpAddr],
    ) -> Translation {
        self.owners.clear();
        self.stale.clear();
        self.whole = false;
        self.own = own.to_vec();
        let mut frontends = Frontends::new();
        for (k, plan) in plans {
            for (f, t) in expand(plan, w) {
                match self.owners.get_mut(&f) {
                    Some(o) => o.add(k),
                    None => {
                        self.owners.insert(f, Owners::One(k.clone()));
                    }
                }
                // Plans in key order: the later Service's entry wins.
                frontends.insert(f, t);
            }
        }
        Translation {
            frontends,
            gone: BTreeSet::new(),
            whole: true,
            nodes,
        }
    }
}

/// `plan`'s frontends as [`Fronts`].
fn fronts(plan: &ServicePlan, w: &Where) -> Fronts {
    expand(plan, w).into_iter().collect()
}

/// Where `fronts` sends `f`.
fn find<'a>(fronts: &'a Fronts, f: &Front) -> Option<&'a Target> {
    fronts
        .binary_search_by(|(x, _)| x.cmp(f))
        .ok()
        .map(|i| &fronts[i].1)
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::net::IpAddr;

    use calix_core::services::admit::Admission;
    use calix_core::services::model::TrafficPolicy;
    use calix_core::services::state::{Change, Limits};
    use calix_dataplane::ebpf::services::{Frontends, Target, Translation};

    use crate::services::tests::{service, slice};
    use crate::services::ServicesService;

    fn ip(a: &str) -> IpAddr {
        a.parse().expect("ip")
    }

    /// Node n1 of n1–n3, external addresses allowed in 203.0.113.0/24, room for all.
    fn on_n1() -> ServicesService {
        let rules = Admission {
            external_cidrs: vec!["203.0.113.0/24".parse().expect("cidr")],
            ..Admission::default()
        };
        let limits = Limits {
            frontends: 4096,
            backends: 4096,
        };
        let svc = ServicesService::new("n1", None, rules, limits);
        svc.set_nodes(three_nodes(""));
        svc
    }

    /// n1–n3 at 192.0.2.1–3, and `extra` as n3's second address when not empty.
    fn three_nodes(extra: &str) -> BTreeMap<String, Vec<IpAddr>> {
        let mut n3 = vec![ip("192.0.2.3")];
        if !extra.is_empty() {
            n3.push(ip(extra));
        }
        BTreeMap::from([
            ("n1".to_string(), vec![ip("192.0.2.1")]),
            ("n2".to_string(), vec![ip("192.0.2.2")]),
            ("n3".to_string(), n3),
        ])
    }

    /// What the dataplane holds after `t`, from `held` before.
    fn programmed(held: &mut Frontends, t: Translation) {
        if t.whole {
            *held = t.frontends;
            return;
        }
        for f in &t.gone {
            held.remove(f);
        }
        held.extend(t.frontends);
    }

    /// Whatever the changes (Services, slices, NodePorts, `Local` policies, external
    /// addresses, Services gone, the nodes' addresses), the frontends programmed through the
    /// changes alone are the whole translation's.
    #[test]
    fn programming_only_what_changed_ends_where_the_whole_translation_is() {
        let svc = on_n1();
        svc.set_ready();
        let own = [ip("192.0.2.1")];
        let mut held = Frontends::new();
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let mut deltas = 0;
        for step in 0..400 {
            // One to three changes between programmings: a Service changed twice in
            // between is expanded from its plan before the first.
            for _ in 0..=next(3) {
                let i = next(12);
                let name = format!("s{i}");
                match next(6) {
                    0..=1 => {
                        let mut s = service(&name, &format!("10.96.0.{}", 10 + i), &[]);
                        if next(2) == 0 {
                            s.ports[0].node_port = Some(30000 + i as u16);
                        }
                        if next(3) == 0 {
                            s.external_policy = TrafficPolicy::Local;
                        }
                        if next(3) == 0 {
                            // Two Services may name one external address: the later key's.
                            s.external_ips = vec![ip(&format!("203.0.113.{}", next(3)))];
                        }
                        svc.apply(Change::Service(s));
                    }
                    2..=3 => {
                        let n = next(4) as usize;
                        let addrs: Vec<String> = (0..n)
                            .map(|j| format!("10.244.{}.{}", next(3) + 1, 10 + j))
                            .collect();
                        let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
                        let mut sl = slice(&format!("{name}-a"), &name, &refs);
                        for e in &mut sl.endpoints {
                            e.node = Some(format!("n{}", next(3) + 1));
                        }
                        svc.apply(Change::Slice(sl));
                    }
                    4 => {
                        svc.apply(Change::ServiceGone(service(&name, "10.96.0.1", &[]).key));
                    }
                    _ => {
                        let extra = ["", "192.0.2.30"][next(2) as usize];
                        svc.set_nodes(three_nodes(extra));
                    }
                }
            }
            let t = svc.next_translation(&own);
            deltas += usize::from(!t.whole);
            programmed(&mut held, t);
            let whole = svc.translation(&own).frontends;
            assert_eq!(held, whole, "after step {step}");
        }
        assert!(deltas > 200, "mostly changes only: {deltas} of 400");
    }

    /// A slice change of one Service among many hands out its frontends alone; a failed
    /// programming makes the next one whole.
    #[test]
    fn a_change_hands_out_its_services_frontends_alone() {
        let svc = on_n1();
        let own = [ip("192.0.2.1")];
        for i in 0..50 {
            let name = format!("s{i}");
            svc.apply(Change::Service(service(
                &name,
                &format!("10.96.1.{i}"),
                &[],
            )));
            svc.apply(Change::Slice(slice(
                &format!("{name}-a"),
                &name,
                &["10.244.1.5"],
            )));
        }
        let first = svc.next_translation(&own);
        assert!(first.whole);
        assert_eq!(first.frontends.len(), 50);
        let quiet = svc.next_translation(&own);
        assert!(!quiet.whole && quiet.frontends.is_empty() && quiet.gone.is_empty());
        svc.apply(Change::Slice(slice("s7-a", "s7", &["10.244.1.6"])));
        let t = svc.next_translation(&own);
        assert!(!t.whole);
        let fronts: Vec<String> = t.frontends.keys().map(|f| f.address.to_string()).collect();
        assert_eq!(fronts, ["10.96.1.7"]);
        assert_eq!(
            t.frontends.values().next(),
            Some(&Target::to(vec![(ip("10.244.1.6"), 8080)]))
        );
        svc.apply(Change::ServiceGone(service("s8", "10.96.1.8", &[]).key));
        let t = svc.next_translation(&own);
        let gone: BTreeSet<String> = t.gone.iter().map(|f| f.address.to_string()).collect();
        assert_eq!(
            (t.frontends.len(), gone),
            (0, BTreeSet::from(["10.96.1.8".into()]))
        );
        svc.programmed(Err("the map is full".into()));
        let again = svc.next_translation(&own);
        assert!(
            again.whole,
            "what the maps hold is not known after a failure"
        );
        assert_eq!(again.frontends.len(), 49);
        // Nodes listed again as they were: nothing to do; a new address: whole.
        svc.set_nodes(three_nodes(""));
        assert!(!svc.next_translation(&own).whole);
        svc.set_nodes(three_nodes("192.0.2.30"));
        assert!(svc.next_translation(&own).whole);
    }
}
