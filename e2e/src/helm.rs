//! What `helm install`, `helm test` and `helm uninstall` send to the API server, done with the
//! chart rendered by Helm's own library (there is no helm binary here): the objects in Helm's
//! install order (CRDs from crds/ first), the `test` hooks by weight, and the deletion in
//! Helm's uninstall order with background propagation. CRDs stay on uninstall, as with Helm.
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::chart_tools::{hook, Rendered};
use calix_testbed::KubeApi;
use serde_json::Value;

/// Helm's install order (pkg/release/util/kind_sorter.go); kinds not listed go last.
const INSTALL_ORDER: &[&str] = &[
    "PriorityClass",
    "Namespace",
    "NetworkPolicy",
    "ResourceQuota",
    "LimitRange",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "DaemonSet",
    "Pod",
    "ReplicationController",
    "ReplicaSet",
    "Deployment",
    "HorizontalPodAutoscaler",
    "StatefulSet",
    "Job",
    "CronJob",
    "IngressClass",
    "Ingress",
    "APIService",
];

/// Helm's uninstall order; kinds not listed go last.
const UNINSTALL_ORDER: &[&str] = &[
    "APIService",
    "Ingress",
    "IngressClass",
    "Service",
    "CronJob",
    "Job",
    "StatefulSet",
    "HorizontalPodAutoscaler",
    "Deployment",
    "ReplicaSet",
    "ReplicationController",
    "Pod",
    "DaemonSet",
    "RoleBinding",
    "Role",
    "ClusterRoleBinding",
    "ClusterRole",
    "PersistentVolumeClaim",
    "PersistentVolume",
    "StorageClass",
    "ConfigMap",
    "Secret",
    "ServiceAccount",
    "PodDisruptionBudget",
    "LimitRange",
    "ResourceQuota",
    "NetworkPolicy",
    "Namespace",
    "PriorityClass",
];

fn kind(o: &Value) -> &str {
    o["kind"].as_str().unwrap_or_default()
}

fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

/// `objects` sorted by `order`, kinds it does not list last and among themselves by kind name,
/// as Helm's `lessByKind` does (stable: the chart's order within a kind). So the node
/// authority's ValidatingAdmissionPolicies go before their bindings.
fn sorted<'a>(objects: impl Iterator<Item = &'a Value>, order: &[&str]) -> Vec<&'a Value> {
    let rank = |o: &'a Value| match order.iter().position(|k| *k == kind(o)) {
        Some(i) => (i, ""),
        None => (order.len(), kind(o)),
    };
    let mut v: Vec<&Value> = objects.collect();
    v.sort_by_key(|o| rank(o));
    v
}

/// The release's own objects: no hooks, no CRDs (Helm keeps those apart).
fn release_objects(r: &Rendered) -> impl Iterator<Item = &Value> {
    r.objects
        .iter()
        .filter(|o| hook(o).is_none() && kind(o) != "CustomResourceDefinition")
}

/// `helm install`: the CRDs, then every object of the release in Helm's order (server-side
/// apply, so a reinstall after an uninstall works the same).
pub fn install(api: &KubeApi, r: &Rendered) -> Result<usize> {
    let crds = r
        .objects
        .iter()
        .filter(|o| kind(o) == "CustomResourceDefinition");
    let mut n = 0;
    for o in crds.chain(sorted(release_objects(r), INSTALL_ORDER)) {
        api.apply(o.clone())
            .with_context(|| format!("install {} {}", kind(o), name(o)))?;
        n += 1;
    }
    Ok(n)
}

/// `helm uninstall`: every object of the release deleted in Helm's uninstall order (the
/// API's default propagation for each, background: a DaemonSet goes at once, its pods after).
pub fn uninstall(api: &KubeApi, r: &Rendered) -> Result<usize> {
    let mut n = 0;
    for o in sorted(release_objects(r), UNINSTALL_ORDER) {
        let api_version = o["apiVersion"].as_str().unwrap_or_default();
        match o["metadata"]["namespace"].as_str() {
            Some(ns) => api.delete_in(api_version, kind(o), ns, name(o)),
            None => api.delete(api_version, kind(o), name(o)),
        }
        .with_context(|| format!("uninstall {} {}", kind(o), name(o)))?;
        n += 1;
    }
    Ok(n)
}

/// `helm test`: the `test` hooks created by weight, then until every hook Pod has succeeded
/// (any failure: its log in the error), then the hooks deleted (their delete policy,
/// `hook-succeeded`). Returns how long the test Pods took.
pub fn test(
    api: &KubeApi,
    r: &Rendered,
    timeout: Duration,
    logs: impl Fn(&str, &str) -> String,
) -> Result<Duration> {
    let mut hooks: Vec<&Value> = r
        .objects
        .iter()
        .filter(|o| hook(o) == Some("test"))
        .collect();
    let weight = |o: &Value| {
        o["metadata"]["annotations"]["helm.sh/hook-weight"]
            .as_str()
            .and_then(|w| w.parse::<i64>().ok())
            .unwrap_or(0)
    };
    hooks.sort_by_key(|o| weight(o));
    if !hooks.iter().any(|o| kind(o) == "Pod") {
        bail!("the chart has no `helm test` Pod");
    }
    let started = Instant::now();
    for o in &hooks {
        api.apply((*o).clone())
            .with_context(|| format!("helm test: create {} {}", kind(o), name(o)))?;
    }
    let pods: Vec<(&str, &str)> = hooks
        .iter()
        .filter(|o| kind(o) == "Pod")
        .map(|o| {
            (
                o["metadata"]["namespace"].as_str().unwrap_or("default"),
                name(o),
            )
        })
        .collect();
    let deadline = started + timeout;
    let mut pending = pods.clone();
    while !pending.is_empty() {
        let mut still = Vec::new();
        for (ns, pod) in pending {
            let phase = api
                .get("v1", "Pod", Some(ns), pod)?
                .map(|p| p["status"]["phase"].as_str().unwrap_or("").to_string())
                .unwrap_or_default();
            match phase.as_str() {
                "Succeeded" => {}
                "Failed" => bail!("helm test: pod {pod} failed:\n{}", logs(ns, pod)),
                _ => still.push((ns, pod)),
            }
        }
        if !still.is_empty() && Instant::now() > deadline {
            bail!(
                "helm test: {still:?} not done within {timeout:?}:\n{}",
                still
                    .iter()
                    .map(|(ns, p)| logs(ns, p))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        pending = still;
        std::thread::sleep(Duration::from_millis(500));
    }
    let took = started.elapsed();
    for o in sorted(hooks.into_iter(), UNINSTALL_ORDER) {
        let api_version = o["apiVersion"].as_str().unwrap_or_default();
        match o["metadata"]["namespace"].as_str() {
            Some(ns) => api.delete_in(api_version, kind(o), ns, name(o)),
            None => api.delete(api_version, kind(o), name(o)),
        }
        .with_context(|| format!("helm test: delete {} {}", kind(o), name(o)))?;
    }
    Ok(took)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_go_in_helms_order_for_install_and_the_reverse_kinds_for_uninstall() {
        let objs = [
            json!({"kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": "w"}}),
            json!({"kind": "IPPool", "metadata": {"name": "p"}}),
            json!({"kind": "ValidatingAdmissionPolicy", "metadata": {"name": "v"}}),
            json!({"kind": "DaemonSet", "metadata": {"name": "d"}}),
            json!({"kind": "ClusterRoleBinding", "metadata": {"name": "b"}}),
            json!({"kind": "ConfigMap", "metadata": {"name": "c"}}),
            json!({"kind": "ServiceAccount", "metadata": {"name": "s"}}),
            json!({"kind": "ClusterRole", "metadata": {"name": "r"}}),
        ];
        let names = |v: Vec<&Value>| v.iter().map(|o| name(o).to_string()).collect::<String>();
        // Kinds Helm does not know last, by kind name: a policy before its binding.
        assert_eq!(names(sorted(objs.iter(), INSTALL_ORDER)), "scrbdpvw");
        // The DaemonSet before its RBAC: its agents can still read it when they stop.
        assert_eq!(names(sorted(objs.iter(), UNINSTALL_ORDER)), "dbrcspvw");
    }
}
