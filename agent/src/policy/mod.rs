//! NetworkPolicy in the agent: the cluster as policy sees it (calix-core's calculation), fed
//! one change at a time by the Kubernetes adapter (`kubernetes::policy::watch`), and this
//! node's endpoints' policies computed again when a change touches them; what `calixctl
//! policy` shows; and the tables the dataplane programs ([`PolicyService::tables`], sent to
//! it by [`program`]).
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use calix_core::policy::cluster::{Change, Cluster};
use calix_core::policy::compiler::Compiler;
use calix_core::policy::endpoint::Direction;
use calix_core::policy::endpoint::EndpointPolicy;
use calix_core::policy::model::PodKey;
use calix_core::policy::report::{EndpointReport, PolicyReport};
use calix_core::policy::tables::{RuleId, RuleRef, Tables};
use calix_dataplane::PolicyCounts;

pub mod monitor;
#[cfg(test)]
mod tests;
pub mod trace;

/// What one change did, for logs and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// This node's endpoints whose policy was computed again.
    pub endpoints: usize,
    /// Of those, how many changed.
    pub changed: usize,
    /// Sets whose members changed.
    pub sets: usize,
    pub took: Duration,
}

#[derive(Default)]
struct Inner {
    cluster: Cluster,
    /// This node's pods.
    local: BTreeSet<PodKey>,
    /// Their policies as last computed (a host-network pod has none).
    computed: BTreeMap<PodKey, EndpointPolicy>,
    ready: bool,
    changes: u64,
    /// Identity and rule numbers, stable from one compilation to the next.
    compiler: Compiler,
    /// Sets whose members moved since the last compilation (the next starts from the last).
    changed_sets: BTreeSet<calix_core::policy::sets::SetKey>,
    /// The rules' numbers in the last tables compiled (the dataplane counts hits by them).
    rules: BTreeMap<RuleId, RuleRef>,
    /// The last programming's outcome, as `calixctl policy` shows it.
    programmed: Option<String>,
    /// Whether the last programming failed, and how many have since the start.
    failing: bool,
    failures: u64,
    /// What the last successful programming wrote.
    prefixes: usize,
    entries: usize,
    /// Time spent, since the start: applying changes, compiling tables (how many times), and
    /// writing them to the dataplane.
    applying: Duration,
    compiling: Duration,
    compilations: u64,
    programming: Duration,
}

/// The policy calculation of one agent.
pub struct PolicyService {
    node: String,
    inner: Mutex<Inner>,
}

impl PolicyService {
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_string(),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one change. `on_this_node`: for a pod, whether it runs here (its policy is then
    /// computed and kept); ignored for other changes.
    pub fn apply(&self, change: Change, on_this_node: bool) -> Applied {
        let start = Instant::now();
        let mut inner = self.lock();
        match &change {
            Change::Pod(p) if on_this_node => {
                inner.local.insert(p.key.clone());
            }
            Change::Pod(p) => {
                let key = p.key.clone();
                // Moved away (or never here): not this node's any more.
                if inner.local.remove(&key) {
                    inner.computed.remove(&key);
                }
            }
            Change::PodGone(key) => {
                let key = key.clone();
                inner.local.remove(&key);
                inner.computed.remove(&key);
            }
            _ => {}
        }
        let touched = inner.cluster.apply(change);
        inner.changes += 1;
        inner.changed_sets.extend(touched.sets.keys().cloned());
        let mut out = Applied {
            sets: touched.sets.len(),
            ..Applied::default()
        };
        for key in &touched.endpoints {
            if !inner.local.contains(key) {
                continue;
            }
            out.endpoints += 1;
            let changed = match inner.cluster.endpoint(key) {
                Some(ep) => inner.computed.insert(key.clone(), ep.clone()).as_ref() != Some(&ep),
                None => inner.computed.remove(key).is_some(),
            };
            out.changed += usize::from(changed);
        }
        out.took = start.elapsed();
        inner.applying += out.took;
        out
    }

    /// Records a programming that wrote everything (`prefixes` and `entries`) in `took`.
    pub fn programmed(&self, prefixes: usize, entries: usize, took: Duration) {
        let mut inner = self.lock();
        inner.programming += took;
        inner.programmed = Some(format!("{prefixes} prefixes, {entries} entries"));
        inner.failing = false;
        (inner.prefixes, inner.entries) = (prefixes, entries);
    }

    /// Records a programming that failed (in part: the endpoints it names deny what could not
    /// be written), and why.
    pub fn not_programmed(&self, why: &str) {
        let mut inner = self.lock();
        inner.programmed = Some(format!("not fully programmed: {why}"));
        inner.failing = true;
        inner.failures += 1;
    }

    /// The Prometheus text of policy: no label per pod or policy (bounded cardinality).
    pub fn metrics(&self) -> String {
        let inner = self.lock();
        let isolated = |ingress: bool| {
            inner
                .computed
                .values()
                .filter(|e| {
                    if ingress {
                        e.ingress.is_some()
                    } else {
                        e.egress.is_some()
                    }
                })
                .count()
        };
        let problems: usize = inner.computed.values().map(|e| e.problems.len()).sum();
        let (namespaces, pods, policies, sets) = inner.cluster.counts();
        format!(
            "# HELP calix_policy_ready 1 once the first listings of namespaces, pods and NetworkPolicies are in.\n\
             # TYPE calix_policy_ready gauge\ncalix_policy_ready {}\n\
             # HELP calix_policy_objects What the policy calculation holds, cluster-wide.\n\
             # TYPE calix_policy_objects gauge\n\
             calix_policy_objects{{kind=\"namespace\"}} {namespaces}\n\
             calix_policy_objects{{kind=\"pod\"}} {pods}\n\
             calix_policy_objects{{kind=\"networkpolicy\"}} {policies}\n\
             calix_policy_objects{{kind=\"set\"}} {sets}\n\
             # HELP calix_policy_isolated_endpoints This node's pods a NetworkPolicy isolates, by direction.\n\
             # TYPE calix_policy_isolated_endpoints gauge\n\
             calix_policy_isolated_endpoints{{direction=\"ingress\"}} {}\n\
             calix_policy_isolated_endpoints{{direction=\"egress\"}} {}\n\
             # HELP calix_policy_unenforceable_rules Rules selecting this node's pods that cannot be enforced as written: they allow nothing (calixctl policy names them).\n\
             # TYPE calix_policy_unenforceable_rules gauge\ncalix_policy_unenforceable_rules {problems}\n\
             # HELP calix_policy_changes_total Changes of namespaces, pods and NetworkPolicies applied.\n\
             # TYPE calix_policy_changes_total counter\ncalix_policy_changes_total {}\n\
             # HELP calix_policy_dataplane_entries What the dataplane holds for policy after the last full programming.\n\
             # TYPE calix_policy_dataplane_entries gauge\n\
             calix_policy_dataplane_entries{{kind=\"prefix\"}} {}\n\
             calix_policy_dataplane_entries{{kind=\"entry\"}} {}\n\
             # HELP calix_policy_not_programmed 1 while the last programming failed (the endpoints it could not finish deny what is missing; the agent retries).\n\
             # TYPE calix_policy_not_programmed gauge\ncalix_policy_not_programmed {}\n\
             # HELP calix_policy_program_failures_total Programmings of the policy that failed.\n\
             # TYPE calix_policy_program_failures_total counter\ncalix_policy_program_failures_total {}\n\
             # HELP calix_policy_seconds_total Time the policy calculation took, by step: applying changes, compiling this node's tables, writing them to the dataplane.\n\
             # TYPE calix_policy_seconds_total counter\n\
             calix_policy_seconds_total{{step=\"apply\"}} {:.9}\n\
             calix_policy_seconds_total{{step=\"compile\"}} {:.9}\n\
             calix_policy_seconds_total{{step=\"program\"}} {:.9}\n\
             # HELP calix_policy_compilations_total Compilations of this node's tables (a burst of changes is one).\n\
             # TYPE calix_policy_compilations_total counter\ncalix_policy_compilations_total {}\n",
            u8::from(inner.ready),
            isolated(true),
            isolated(false),
            inner.changes,
            inner.prefixes,
            inner.entries,
            u8::from(inner.failing),
            inner.failures,
            inner.applying.as_secs_f64(),
            inner.compiling.as_secs_f64(),
            inner.programming.as_secs_f64(),
            inner.compilations,
        )
    }

    /// The first listing of namespaces, pods and policies is in.
    pub fn set_ready(&self) {
        self.lock().ready = true;
    }

    /// The tables this node's pods enforce, compiled from their policies now; `None` until the
    /// first listings are in (until then the dataplane keeps what it enforced before: an
    /// agent restart opens and closes nothing).
    pub fn tables(&self) -> Option<Tables> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        if !inner.ready {
            return None;
        }
        let start = Instant::now();
        let cluster = &inner.cluster;
        let changed = std::mem::take(&mut inner.changed_sets);
        let tables = inner
            .compiler
            .compile_changed(&inner.computed, &changed, |s| cluster.members(s));
        inner.compiling += start.elapsed();
        inner.compilations += 1;
        inner.rules.clone_from(&tables.rules);
        Some(tables)
    }

    /// Pod `pod`'s addresses and whether it is on the host's network (None: not known).
    pub fn pod_addresses(&self, pod: &PodKey) -> Option<(Vec<std::net::IpAddr>, bool)> {
        let inner = self.lock();
        let p = inner.cluster.pod(pod)?;
        Some((p.ips.clone(), p.host_network))
    }

    /// Rule number `id` of the tables last compiled, as `policy ns/name ingress rule 0`.
    pub fn rule_name(&self, id: RuleId) -> Option<String> {
        self.lock().rules.get(&id).map(rule_text)
    }

    /// The policies that select `pod` now.
    pub fn policies_of(&self, pod: &PodKey) -> Vec<String> {
        let inner = self.lock();
        inner
            .cluster
            .endpoint(pod)
            .map(|e| e.policies.iter().map(ToString::to_string).collect())
            .unwrap_or_default()
    }

    /// What pod `pod`'s policy (as computed now from the cluster's objects) makes of a packet
    /// of `proto` with `peer` in direction `d` (`port`: the pod's on ingress, the peer's on
    /// egress): `None` when the pod is unknown or on the host's network; else `Ok(None)` when
    /// it is not isolated that way, `Ok(Some(rule))` when a rule allows it, `Err(())` when
    /// none does.
    #[allow(clippy::result_unit_err)]
    pub fn computed_verdict(
        &self,
        pod: &PodKey,
        d: Direction,
        peer: std::net::IpAddr,
        proto: u8,
        port: u16,
    ) -> Option<Result<Option<String>, ()>> {
        let inner = self.lock();
        let ep = inner.cluster.endpoint(pod)?;
        let cluster = &inner.cluster;
        let endpoints = BTreeMap::from([(pod.clone(), ep)]);
        let t = Compiler::new().compile(&endpoints, |s| cluster.members(s));
        Some(match t.verdict(pod, d, peer, proto, port) {
            calix_core::policy::tables::Verdict::Open => Ok(None),
            calix_core::policy::tables::Verdict::Allowed(r) => {
                Ok(Some(t.rules.get(&r).map(rule_text).unwrap_or_default()))
            }
            calix_core::policy::tables::Verdict::Denied => Err(()),
        })
    }

    /// The pod (`namespace/name`) that has address `ip`, when the agent knows one.
    pub fn pod_with_address(&self, ip: std::net::IpAddr) -> Option<String> {
        self.lock()
            .cluster
            .pod_with_address(ip)
            .map(ToString::to_string)
    }

    /// This node's endpoint policy of `pod` as last computed (None: not here, host network, or
    /// not known).
    pub fn endpoint(&self, pod: &PodKey) -> Option<EndpointPolicy> {
        self.lock().computed.get(pod).cloned()
    }

    /// The report `calixctl policy` shows, for `pod` when one is asked for, with the
    /// dataplane's `counts` of its endpoint when there are some.
    pub fn report_counted(
        &self,
        pod: Option<&PodKey>,
        counts: Option<&PolicyCounts>,
    ) -> PolicyReport {
        let mut r = self.report(pod);
        let Some(c) = counts else {
            return r;
        };
        let hits: BTreeMap<(String, Direction, usize), u64> = {
            let inner = self.lock();
            let mut hits = BTreeMap::new();
            for (id, n) in &c.hits {
                if let Some(rule) = inner.rules.get(id) {
                    *hits
                        .entry((rule.policy.to_string(), rule.direction, rule.rule))
                        .or_insert(0) += n;
                }
            }
            hits
        };
        r.endpoint = r
            .endpoint
            .map(|e| e.with_counts(&hits, c.denied_ingress, c.denied_egress));
        r
    }

    /// The report `calixctl policy` shows, for `pod` when one is asked for.
    pub fn report(&self, pod: Option<&PodKey>) -> PolicyReport {
        let inner = self.lock();
        let (namespaces, pods, policies, sets) = inner.cluster.counts();
        PolicyReport {
            node: self.node.clone(),
            enabled: true,
            ready: inner.ready,
            namespaces,
            pods,
            policies,
            sets,
            local_endpoints: inner.computed.len(),
            changes: inner.changes,
            dataplane: inner.programmed.clone(),
            endpoint: pod
                .and_then(|k| EndpointReport::of(&inner.cluster, k, inner.local.contains(k))),
        }
    }
}

/// A rule as `calixctl trace` names it.
fn rule_text(r: &RuleRef) -> String {
    format!("policy {} {} rule {}", r.policy, r.direction, r.rule)
}

/// A Warning Event `NetworkPolicyNotProgrammed` on each pod whose policy the dataplane could
/// not fully write (`e`): it denies what is missing until there is room.
pub fn notice_not_programmed(
    notices: &crate::notice::Notifier,
    e: &calix_dataplane::DataplaneError,
) {
    let calix_dataplane::DataplaneError::PolicyIncomplete { pods, source, .. } = e else {
        return;
    };
    for pod in pods {
        notices.warning(
            "NetworkPolicyNotProgrammed",
            crate::notice::Subject::Pod {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
            },
            format!(
                "NetworkPolicy is not fully programmed for this pod: it denies what could not be \
                 written until there is room ({})",
                calix_log::error_chain(source.as_ref())
            ),
        );
    }
}

/// Sends the service's tables to the dataplane whenever `changed` says they may have changed
/// (a burst of changes is one compilation), until the agent stops. A failed write is tried
/// again a second later with the tables as they are then.
pub async fn program<F, Fut, E>(
    service: std::sync::Arc<PolicyService>,
    mut changed: tokio::sync::watch::Receiver<u64>,
    set: F,
) where
    F: Fn(Tables) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::error::Error,
{
    let mut failing = false;
    loop {
        let Some(tables) = service.tables() else {
            if changed.changed().await.is_err() {
                return;
            }
            continue;
        };
        let start = Instant::now();
        let (prefixes, entries) = (tables.prefixes.len(), tables.entry_count());
        match set(tables).await {
            Ok(()) => {
                if failing {
                    tracing::info!("NetworkPolicy programmed again");
                }
                failing = false;
                let took = start.elapsed();
                service.programmed(prefixes, entries, took);
                tracing::debug!(prefixes, entries, ?took, "NetworkPolicy programmed");
            }
            Err(e) => {
                let e = calix_log::error_chain(&e);
                if !failing {
                    tracing::error!(error = %e, "NetworkPolicy cannot be programmed; trying again");
                }
                service.not_programmed(&e);
                failing = true;
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        }
        if changed.changed().await.is_err() {
            return;
        }
    }
}
