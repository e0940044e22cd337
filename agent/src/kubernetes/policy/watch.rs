//! Namespaces, every Pod of the cluster and NetworkPolicies, followed through the store's
//! read-only keys (`k8s/namespaces/`, `k8s/clusterpods/`, `k8s/networkpolicies/`) and fed to
//! the policy service one change at a time. Each kind has its own follower task (a follower
//! re-watches and re-lists on its own); one task applies what they send, in order per kind.
//! The service is ready once the three first listings are in.
use std::sync::Arc;
use std::time::Duration;

use calix_core::policy::cluster::Change;
use calix_core::policy::model::{PodKey, Policy, PolicyKey, Rule};
use calix_core::selector::LabelSelector;
use calix_core::store::{KeyValue, WatchEvent};
use calix_datastore::follow::Follower;
use calix_datastore::kubernetes::views::{self, NamespaceView};
use calix_datastore::{Datastore, DatastoreError};
use k8s_openapi::api::core::v1::Pod as KubePod;
use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::super::fan_in;
use crate::policy::PolicyService;

/// A change with, for a pod, whether it runs on this node.
#[derive(Debug)]
pub struct Seen {
    pub change: Change,
    pub on_this_node: bool,
}

/// Which of the three prefixes a key is under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Namespace,
    Pod,
    Policy,
}

const PREFIXES: [(Kind, &str); 3] = [
    (Kind::Namespace, views::NAMESPACES),
    (Kind::Pod, views::CLUSTER_PODS),
    (Kind::Policy, views::NETWORK_POLICIES),
];

/// `(namespace, name)` from a `<namespace>/<name>` rest of a key.
fn namespaced(rest: &str) -> Option<(String, String)> {
    let (ns, name) = rest.split_once('/')?;
    Some((ns.to_string(), name.to_string()))
}

/// The change one stored object means (None: a key that names nothing this reads).
fn put(kind: Kind, kv: &KeyValue, node: &str) -> Option<Seen> {
    let plain = |change| Seen {
        change,
        on_this_node: false,
    };
    match kind {
        Kind::Namespace => {
            let ns: NamespaceView = kv.decode().ok()?;
            Some(plain(Change::Namespace {
                name: ns.name,
                labels: ns.labels,
            }))
        }
        Kind::Pod => {
            let rest = kv.key.strip_prefix(views::CLUSTER_PODS)?;
            let (namespace, name) = namespaced(rest)?;
            // A pod that cannot be read leaves every set: allowed nowhere, never more.
            let Ok(p) = kv.decode::<KubePod>() else {
                tracing::warn!(key = %kv.key, "a Pod that cannot be read: it is in no policy's set");
                return Some(plain(Change::PodGone(PodKey { namespace, name })));
            };
            let on_this_node = p
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_some_and(|n| n == node);
            let pod = super::pod(&p)?;
            Some(Seen {
                change: Change::Pod(pod),
                on_this_node,
            })
        }
        Kind::Policy => {
            let rest = kv.key.strip_prefix(views::NETWORK_POLICIES)?;
            let (namespace, name) = namespaced(rest)?;
            let policy = match kv.decode::<NetworkPolicy>() {
                Ok(np) => super::policy(&np)?,
                Err(e) => closed(PolicyKey { namespace, name }, &e.detail),
            };
            Some(plain(Change::Policy(policy)))
        }
    }
}

/// A policy that cannot be read at all: it isolates every pod of its namespace in both
/// directions and allows nothing.
fn closed(key: PolicyKey, why: &str) -> Policy {
    let why = format!("the NetworkPolicy cannot be read: {why}");
    let rule = Rule {
        unreadable: Some(why.clone()),
        ..Rule::default()
    };
    Policy {
        key,
        pod_selector: LabelSelector::default(),
        ingress: Some(vec![rule.clone()]),
        egress: Some(vec![rule]),
        unreadable_selector: Some(why),
    }
}

/// The change a deleted key means.
fn gone(kind: Kind, key: &str) -> Option<Change> {
    match kind {
        Kind::Namespace => Some(Change::NamespaceGone(
            key.strip_prefix(views::NAMESPACES)?.to_string(),
        )),
        Kind::Pod => {
            let (namespace, name) = namespaced(key.strip_prefix(views::CLUSTER_PODS)?)?;
            Some(Change::PodGone(PodKey { namespace, name }))
        }
        Kind::Policy => {
            let (namespace, name) = namespaced(key.strip_prefix(views::NETWORK_POLICIES)?)?;
            Some(Change::PolicyGone(PolicyKey { namespace, name }))
        }
    }
}

/// The change one watch event means.
pub fn change_of(event: &WatchEvent, node: &str) -> Option<Seen> {
    let kind = PREFIXES
        .iter()
        .find(|(_, p)| event.key().starts_with(p))
        .map(|(k, _)| *k)?;
    match event {
        WatchEvent::Put(kv) => put(kind, kv, node),
        WatchEvent::Delete { key, .. } => gone(kind, key).map(|change| Seen {
            change,
            on_this_node: false,
        }),
    }
}

/// Lists namespaces, pods and policies (each follower's first listing, the three at once).
pub async fn load(store: Arc<dyn Datastore>) -> Result<Vec<Follower>, DatastoreError> {
    fan_in::start(store, PREFIXES.iter().map(|(_, p)| *p)).await
}

/// Feeds the service: the first listings, then every change, for as long as the agent runs.
/// `changed` counts the changes applied since the first listings were in (the dataplane's
/// programmer follows it).
pub fn spawn(
    followers: Vec<Follower>,
    service: Arc<PolicyService>,
    node: String,
    changed: tokio::sync::watch::Sender<u64>,
) {
    let kinds = followers.len();
    let mut rx = fan_in::fan_in(followers, move |e| change_of(e, &node));
    tokio::spawn(async move {
        let mut listed = 0;
        while let Some(msg) = rx.recv().await {
            let Some(seen) = msg else {
                listed += 1;
                if listed == kinds {
                    service.set_ready();
                    tracing::info!(report = ?service.report(None), "NetworkPolicy: first listings in");
                    changed.send_modify(|n| *n += 1);
                }
                continue;
            };
            let what = change_name(&seen.change);
            let gone = matches!(seen.change, Change::PodGone(_));
            let applied = service.apply(seen.change, seen.on_this_node);
            // What the dataplane holds may have changed: a set's members, an endpoint's rules,
            // a pod of this node come or gone.
            if listed == kinds && (applied.sets > 0 || applied.endpoints > 0 || gone) {
                changed.send_modify(|n| *n += 1);
            }
            if applied.took > Duration::from_millis(100) {
                tracing::warn!(change = %what, took = ?applied.took, endpoints = applied.endpoints,
                    "NetworkPolicy: a change took long to compute");
            } else {
                tracing::debug!(change = %what, took = ?applied.took, endpoints = applied.endpoints,
                    changed = applied.changed, sets = applied.sets, "NetworkPolicy: change applied");
            }
        }
    });
}

/// What a change is about, for logs (not its content: labels can be many).
fn change_name(c: &Change) -> String {
    match c {
        Change::Namespace { name, .. } => format!("namespace {name}"),
        Change::NamespaceGone(name) => format!("namespace {name} gone"),
        Change::Pod(p) => format!("pod {}", p.key),
        Change::PodGone(k) => format!("pod {k} gone"),
        Change::Policy(p) => format!("policy {}", p.key),
        Change::PolicyGone(k) => format!("policy {k} gone"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: serde_json::Value) -> KeyValue {
        KeyValue {
            key: key.to_string(),
            value: serde_json::to_vec(&value).expect("json"),
            revision: 1,
            created: 1,
        }
    }

    #[test]
    fn stored_objects_become_changes_and_a_pod_knows_its_node() {
        let pod = kv(
            "k8s/clusterpods/shop/web-0",
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "web-0", "labels": {"app": "web"}},
                "spec": {"nodeName": "n1", "containers": [{"name": "web", "ports": [
                    {"name": "http", "containerPort": 80}]}]},
                "status": {"podIPs": [{"ip": "10.0.0.7"}]}
            }),
        );
        let seen = change_of(&WatchEvent::Put(pod.clone()), "n1").expect("a change");
        assert!(seen.on_this_node);
        let Change::Pod(p) = seen.change else {
            panic!("a pod: {:?}", seen.change)
        };
        assert_eq!(p.ips, ["10.0.0.7".parse::<std::net::IpAddr>().expect("ip")]);
        assert_eq!(p.ports.len(), 1);
        assert!(
            !change_of(&WatchEvent::Put(pod), "n2")
                .expect("a change")
                .on_this_node
        );

        let gone = change_of(
            &WatchEvent::Delete {
                key: "k8s/networkpolicies/shop/deny".into(),
                revision: 2,
            },
            "n1",
        )
        .expect("a change");
        assert!(
            matches!(gone.change, Change::PolicyGone(k) if k.name == "deny" && k.namespace == "shop")
        );
        let ns = kv(
            "k8s/namespaces/shop",
            serde_json::json!({"name": "shop", "labels": {"team": "a"}}),
        );
        assert!(matches!(
            change_of(&WatchEvent::Put(ns), "n1").expect("a change").change,
            Change::Namespace { name, labels } if name == "shop" && labels["team"] == "a"
        ));
        assert!(change_of(
            &WatchEvent::Put(kv("k8s/nodes/x", serde_json::json!({}))),
            "n1"
        )
        .is_none());
    }

    #[test]
    fn a_policy_that_cannot_be_read_isolates_its_namespace_and_allows_nothing() {
        // podSelector must be an object.
        let bad = kv(
            "k8s/networkpolicies/shop/broken",
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "broken"},
                "spec": {"podSelector": "everything"}
            }),
        );
        let seen = change_of(&WatchEvent::Put(bad), "n1").expect("a change");
        let Change::Policy(p) = seen.change else {
            panic!("a policy: {:?}", seen.change)
        };
        assert!(p.selector_problem().is_some());
        assert!(p.ingress.is_some() && p.egress.is_some());
        let web = calix_core::policy::model::Pod {
            key: PodKey {
                namespace: "shop".into(),
                name: "web".into(),
            },
            labels: Default::default(),
            ips: vec!["10.0.0.7".parse().expect("ip")],
            ports: Vec::new(),
            host_network: false,
        };
        let ep = calix_core::policy::endpoint::compute(&web, [&p]).expect("subject");
        assert_eq!((ep.ingress, ep.egress), (Some(vec![]), Some(vec![])));
        assert!(!ep.problems.is_empty());
    }
}
