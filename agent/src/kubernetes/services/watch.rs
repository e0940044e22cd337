//! Services and EndpointSlices, followed through the store's read-only keys
//! (`k8s/services/`, `k8s/endpointslices/`) and fed to the Services calculation one change at
//! a time. Each kind has its own follower task (a follower re-watches and re-lists on its
//! own); one task applies what they send. The calculation is ready once both first listings
//! are in. An object that is not calix's (an ExternalName Service, a slice of no Service) is
//! as good as gone; one that cannot be read at all is too, and said. The Nodes are followed
//! too: no Service may capture any node's address (their `InternalIP`s and `ExternalIP`s).
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use calix_core::services::admit::Admission;
use calix_core::services::model::ServiceKey;
use calix_core::services::state::Change;
use calix_core::store::{KeyValue, WatchEvent};
use calix_datastore::follow::Follower;
use calix_datastore::kubernetes::views::{self, NodeView};
use calix_datastore::{Datastore, DatastoreError};
use k8s_openapi::api::core::v1::Service as KubeService;
use k8s_openapi::api::discovery::v1::EndpointSlice as KubeSlice;

use super::super::fan_in;
use crate::services::{ServiceNotice, ServicesService};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Service,
    Slice,
    Node,
}

const PREFIXES: [(Kind, &str); 3] = [
    (Kind::Service, views::SERVICES),
    (Kind::Slice, views::ENDPOINT_SLICES),
    (Kind::Node, views::NODES),
];

/// What one event is about.
#[derive(Debug)]
pub enum Update {
    Change(Change),
    /// A Node's addresses now (empty: gone).
    Node(String, Vec<IpAddr>),
}

/// What one stored object or deletion means: the change, and what could not be read of it
/// (with the Service it belongs to).
#[derive(Debug)]
pub struct Seen {
    pub key: String,
    pub update: Update,
    pub service: Option<ServiceKey>,
    pub unreadable: Vec<String>,
}

/// `(namespace, name)` from the rest of a key.
fn namespaced(kind: Kind, key: &str) -> Option<(String, String)> {
    let prefix = match kind {
        Kind::Service => views::SERVICES,
        Kind::Slice => views::ENDPOINT_SLICES,
        Kind::Node => return None,
    };
    let (ns, name) = key.strip_prefix(prefix)?.split_once('/')?;
    Some((ns.to_string(), name.to_string()))
}

fn gone(kind: Kind, key: &str) -> Option<Update> {
    if kind == Kind::Node {
        return Some(Update::Node(
            key.strip_prefix(views::NODES)?.to_string(),
            Vec::new(),
        ));
    }
    let (namespace, name) = namespaced(kind, key)?;
    Some(Update::Change(match kind {
        Kind::Slice => Change::SliceGone(format!("{namespace}/{name}")),
        _ => Change::ServiceGone(ServiceKey { namespace, name }),
    }))
}

/// A Node's `InternalIP`s and `ExternalIP`s that parse.
fn node_addresses(n: &NodeView) -> Vec<IpAddr> {
    n.addresses
        .iter()
        .filter(|a| a.kind == "InternalIP" || a.kind == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

fn put(kind: Kind, kv: &KeyValue) -> Option<Seen> {
    let seen = |change, service, unreadable| Seen {
        key: kv.key.clone(),
        update: Update::Change(change),
        service,
        unreadable,
    };
    match kind {
        Kind::Node => {
            let n: NodeView = kv.decode().ok()?;
            let addresses = node_addresses(&n);
            Some(Seen {
                key: kv.key.clone(),
                update: Update::Node(n.name, addresses),
                service: None,
                unreadable: Vec::new(),
            })
        }
        Kind::Service => {
            let (svc, problems) = match kv.decode::<KubeService>() {
                Ok(s) => super::service(&s),
                Err(e) => (
                    None,
                    vec![format!("the Service cannot be read: {}", e.detail)],
                ),
            };
            Some(match svc {
                Some(s) => {
                    let k = s.key.clone();
                    seen(Change::Service(s), Some(k), problems)
                }
                None => {
                    let (namespace, name) = namespaced(kind, &kv.key)?;
                    let k = ServiceKey { namespace, name };
                    seen(Change::ServiceGone(k.clone()), Some(k), problems)
                }
            })
        }
        Kind::Slice => {
            let (slice, problems) = match kv.decode::<KubeSlice>() {
                Ok(s) => super::slice(&s),
                Err(e) => (
                    None,
                    vec![format!("the EndpointSlice cannot be read: {}", e.detail)],
                ),
            };
            Some(match slice {
                Some(s) => {
                    let k = s.service.clone();
                    seen(Change::Slice(s), Some(k), problems)
                }
                None => Seen {
                    key: kv.key.clone(),
                    update: gone(kind, &kv.key)?,
                    service: None,
                    unreadable: problems,
                },
            })
        }
    }
}

/// The change one watch event means.
pub fn change_of(event: &WatchEvent) -> Option<Seen> {
    let kind = PREFIXES
        .iter()
        .find(|(_, p)| event.key().starts_with(p))
        .map(|(k, _)| *k)?;
    match event {
        WatchEvent::Put(kv) => put(kind, kv),
        WatchEvent::Delete { key, .. } => Some(Seen {
            key: key.clone(),
            update: gone(kind, key)?,
            service: None,
            unreadable: Vec::new(),
        }),
    }
}

/// Lists Services, EndpointSlices and Nodes (each follower's first listing, all at once).
pub async fn load(store: Arc<dyn Datastore>) -> Result<Vec<Follower>, DatastoreError> {
    fan_in::start(store, PREFIXES.iter().map(|(_, p)| *p)).await
}

/// Feeds the calculation: the first listings, then every change, for as long as the agent
/// runs. What a change makes newly wrong with a Service goes to `notify`. `rules`: the
/// admission rules but the Nodes' addresses, which are added as the Nodes come and go.
/// `changed` counts the changes applied since the first listings were in (the dataplane's
/// programmer follows it).
pub fn spawn(
    followers: Vec<Follower>,
    service: Arc<ServicesService>,
    rules: Admission,
    notify: impl Fn(ServiceNotice) + Send + 'static,
    changed: tokio::sync::watch::Sender<u64>,
) {
    let kinds = followers.len();
    let mut rx = fan_in::fan_in(followers, change_of);
    tokio::spawn(async move {
        let mut listed = 0;
        let mut nodes: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        let admission = |nodes: &BTreeMap<String, Vec<IpAddr>>| {
            let mut all: BTreeSet<IpAddr> = rules.node_addresses.iter().copied().collect();
            all.extend(nodes.values().flatten().copied());
            Admission {
                node_addresses: all.into_iter().collect(),
                ..rules.clone()
            }
        };
        while let Some(msg) = rx.recv().await {
            let Some(seen) = msg else {
                listed += 1;
                if listed == kinds {
                    service.set_ready();
                    let (services, slices) = service.counts();
                    tracing::info!(services, slices, took = ?service.applying(),
                        "Services: first listings in");
                    changed.send_modify(|n| *n += 1);
                }
                continue;
            };
            if !seen.unreadable.is_empty() {
                tracing::warn!(key = %seen.key, problems = ?seen.unreadable,
                    "Services: parts of an object cannot be read; left out");
            }
            let said = match seen.update {
                Update::Change(change) => {
                    service.set_unreadable(&seen.key, seen.service, seen.unreadable);
                    service.apply(change)
                }
                Update::Node(name, addresses) => {
                    let before = if addresses.is_empty() {
                        nodes.remove(&name)
                    } else {
                        nodes.insert(name, addresses.clone())
                    };
                    if before.unwrap_or_default() == addresses {
                        continue;
                    }
                    service.set_nodes(nodes.clone());
                    service.set_rules(admission(&nodes))
                }
            };
            for n in said {
                notify(n);
            }
            if listed == kinds {
                changed.send_modify(|n| *n += 1);
            }
        }
    });
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
    fn stored_objects_and_deletions_become_changes() {
        let svc = kv(
            "k8s/services/shop/web",
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "web"},
                "spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                         "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
            }),
        );
        let seen = change_of(&WatchEvent::Put(svc)).expect("a change");
        assert!(
            matches!(seen.update, Update::Change(Change::Service(ref s)) if s.key.name == "web")
        );
        // An ExternalName Service is not calix's: as good as gone.
        let ext = kv(
            "k8s/services/shop/ext",
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "ext"},
                "spec": {"type": "ExternalName", "externalName": "example.com"}
            }),
        );
        let seen = change_of(&WatchEvent::Put(ext)).expect("a change");
        assert!(
            matches!(seen.update, Update::Change(Change::ServiceGone(ref k)) if k.name == "ext")
        );
        // A slice that cannot be read at all: gone, and said.
        let bad = kv(
            "k8s/endpointslices/shop/web-1",
            serde_json::json!({"metadata": {"namespace": "shop", "name": "web-1"},
                               "addressType": 4, "endpoints": "many"}),
        );
        let seen = change_of(&WatchEvent::Put(bad)).expect("a change");
        assert!(
            matches!(seen.update, Update::Change(Change::SliceGone(ref n)) if n == "shop/web-1")
        );
        assert_eq!(seen.unreadable.len(), 1, "{seen:?}");
        let del = change_of(&WatchEvent::Delete {
            key: "k8s/endpointslices/shop/web-1".into(),
            revision: 2,
        })
        .expect("a change");
        assert!(
            matches!(del.update, Update::Change(Change::SliceGone(ref n)) if n == "shop/web-1")
        );
        // A Node: its internal and external addresses, not its hostname.
        let node = kv(
            "k8s/nodes/n1",
            serde_json::json!({"name": "n1", "addresses": [
                {"type": "InternalIP", "address": "192.0.2.10"},
                {"type": "ExternalIP", "address": "198.51.100.10"},
                {"type": "Hostname", "address": "n1"}]}),
        );
        let seen = change_of(&WatchEvent::Put(node)).expect("a node");
        let Update::Node(name, addresses) = seen.update else {
            panic!("a node: {seen:?}")
        };
        assert_eq!(name, "n1");
        assert_eq!(addresses.len(), 2);
        let gone = change_of(&WatchEvent::Delete {
            key: "k8s/nodes/n1".into(),
            revision: 3,
        })
        .expect("a node gone");
        assert!(matches!(gone.update, Update::Node(ref n, ref a) if n == "n1" && a.is_empty()));
        assert!(change_of(&WatchEvent::Put(kv("k8s/ippools/x", serde_json::json!({})))).is_none());
    }
}
