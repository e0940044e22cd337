//! The Pods bound to this node (`k8s/pods/<node>/`, a watch with `spec.nodeName=<node>`): who
//! each endpoint belongs to (namespace, name, UID, labels, phase; `calixctl endpoints` shows
//! them), and the cleanup of endpoints whose pod no longer exists.
//!
//! An endpoint made for a Kubernetes pod (it has the pod's namespace and name) whose pod is not
//! among this node's Pods — or is there with another UID than the endpoint recorded: a new pod
//! of the same name — is a candidate. After [`PodsConfig::grace`] (a static pod's mirror may lag
//! its sandbox) it is read once more straight from the API server; still gone, its endpoint is
//! forgotten, its addresses released and its host veth deleted (when its owner alias is still
//! that endpoint's), as a CNI DEL would have done. So a pod deleted while this node's agent was
//! down is cleaned up when the agent returns; endpoints of other runtimes (no pod namespace)
//! are never touched.
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use calix_core::model::EndpointRecord;
use calix_core::store::KeyValue;
use calix_core::store::WatchEvent;

use crate::notice::Subject;
use crate::pod_network::Node;
use calix_datastore::follow::Follower;
use calix_datastore::kubernetes::views::{self, PodView};
use calix_datastore::{Datastore, DatastoreError};

/// How the cleanup runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodsConfig {
    /// How long an endpoint's pod must be gone before the endpoint is cleaned up.
    pub grace: Duration,
    /// How often endpoints are checked (also after every Pod deletion).
    pub every: Duration,
}

/// This node's Pods, by (namespace, name), kept current.
#[derive(Clone, Default)]
pub struct Pods(Arc<RwLock<BTreeMap<(String, String), PodView>>>);

impl Pods {
    /// The pod `namespace/name` on this node, as last seen.
    pub fn get(&self, namespace: &str, name: &str) -> Option<PodView> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    pub fn len(&self) -> usize {
        self.0.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn set(&self, known: &BTreeMap<String, KeyValue>) {
        let pods = known
            .values()
            .filter_map(|kv| kv.decode::<PodView>().ok())
            .map(|p| ((p.namespace.clone(), p.name.clone()), p))
            .collect();
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = pods;
    }
}

/// Whether `ep`'s pod is `pod` (present, and the same pod when both know its UID).
fn belongs(ep: &EndpointRecord, pod: Option<&PodView>) -> bool {
    pod.is_some_and(|p| ep.pod_uid.is_empty() || p.uid.is_empty() || p.uid == ep.pod_uid)
}

/// Whether `ep` was made for a Kubernetes pod.
fn for_a_pod(ep: &EndpointRecord) -> bool {
    !ep.pod_namespace.is_empty() && !ep.pod_name.is_empty()
}

/// Lists this node's Pods; [`spawn`] follows them and cleans up.
pub async fn load(
    store: Arc<dyn Datastore>,
    node: &str,
) -> Result<(Pods, Follower), DatastoreError> {
    let follower = Follower::start(store, &views::pods_of(node)).await?;
    let pods = Pods::default();
    pods.set(follower.known());
    Ok((pods, follower))
}

/// Follows the Pods and cleans up after gone ones, for as long as the agent runs.
pub fn spawn(
    pods: Pods,
    mut follower: Follower,
    node: Arc<Node>,
    store: Arc<dyn Datastore>,
    cfg: PodsConfig,
) {
    let (deleted_tx, mut deleted_rx) = tokio::sync::mpsc::channel::<()>(1);
    let watched = pods.clone();
    tokio::spawn(async move {
        loop {
            let event = follower.next().await;
            watched.set(follower.known());
            if matches!(event, WatchEvent::Delete { .. }) {
                let _ = deleted_tx.try_send(());
            }
        }
    });
    tokio::spawn(async move {
        let mut cleaner = Cleaner {
            pods,
            node,
            store,
            cfg,
            missing: HashMap::new(),
        };
        let mut tick = tokio::time::interval(cfg.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                Some(()) = deleted_rx.recv() => {}
            }
            cleaner.pass(Instant::now()).await;
        }
    });
}

struct Cleaner {
    pods: Pods,
    node: Arc<Node>,
    store: Arc<dyn Datastore>,
    cfg: PodsConfig,
    /// Endpoint id → when its pod was first seen gone.
    missing: HashMap<String, Instant>,
}

impl Cleaner {
    async fn pass(&mut self, now: Instant) {
        let endpoints: Vec<EndpointRecord> = self
            .node
            .endpoints
            .records()
            .await
            .into_iter()
            .filter(for_a_pod)
            .collect();
        let gone: Vec<EndpointRecord> = endpoints
            .into_iter()
            .filter(|ep| !belongs(ep, self.pods.get(&ep.pod_namespace, &ep.pod_name).as_ref()))
            .collect();
        let ids: std::collections::HashSet<String> = gone.iter().map(EndpointRecord::id).collect();
        self.missing.retain(|id, _| ids.contains(id));
        for ep in gone {
            let first = *self.missing.entry(ep.id()).or_insert(now);
            if now.duration_since(first) < self.cfg.grace {
                continue;
            }
            // The watch may lag: ask the API server itself.
            let key = format!(
                "{}{}/{}",
                views::pods_of(self.node.name()),
                ep.pod_namespace,
                ep.pod_name
            );
            let live = match self.store.get(&key).await {
                Ok(kv) => kv.and_then(|kv| kv.decode::<PodView>().ok()),
                Err(e) => {
                    tracing::warn!(pod = %key, error = %e, "cannot read the pod; its endpoint stays for now");
                    continue;
                }
            };
            if belongs(&ep, live.as_ref()) {
                self.missing.remove(&ep.id());
                continue;
            }
            self.missing.remove(&ep.id());
            self.clean(&ep, live.as_ref(), now.duration_since(first))
                .await;
        }
    }

    async fn clean(&self, ep: &EndpointRecord, now: Option<&PodView>, waited: Duration) {
        let why = match now {
            Some(p) => format!(
                "pod {}/{} is now another pod (UID {})",
                p.namespace, p.name, p.uid
            ),
            None => format!("pod {}/{} no longer exists", ep.pod_namespace, ep.pod_name),
        };
        let release = (!ep.handle.is_empty()).then_some(ep.handle.as_str());
        let released = match self
            .node
            .unregister(&ep.container_id, &ep.ifname, release)
            .await
        {
            Ok((_, released)) => released,
            Err(e) => {
                tracing::warn!(endpoint = %ep.id(), error = %e, "{why}: endpoint not cleaned up; trying again");
                return;
            }
        };
        let link = match self.node.endpoints.delete_host_link(ep).await {
            Ok(true) => "deleted",
            Ok(false) => "already gone",
            Err(e) => {
                tracing::warn!(host_ifname = %ep.host_ifname, error = %e, "cannot delete the host veth");
                "not deleted"
            }
        };
        let addresses: Vec<String> = released.iter().map(ToString::to_string).collect();
        tracing::info!(endpoint = %ep.id(), host_ifname = %ep.host_ifname, released = ?addresses,
            link, gone_for_s = waited.as_secs(), "{why}: its endpoint is cleaned up");
        self.node.notices.normal(
            "EndpointCleanedUp",
            Subject::Node,
            format!(
                "{why}: endpoint {} ({}) removed, addresses [{}] released",
                ep.id(),
                ep.host_ifname,
                addresses.join(", ")
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ns: &str, uid: &str) -> EndpointRecord {
        EndpointRecord {
            container_id: "c".into(),
            ifname: "eth0".into(),
            host_ifname: "calia".into(),
            netns: String::new(),
            pod_namespace: ns.into(),
            pod_name: if ns.is_empty() {
                String::new()
            } else {
                "p".into()
            },
            pod_uid: uid.into(),
            addresses: Vec::new(),
            handle: "h".into(),
            mac: String::new(),
            host_ifindex: 0,
        }
    }

    fn pod(uid: &str) -> PodView {
        PodView {
            namespace: "d".into(),
            name: "p".into(),
            uid: uid.into(),
            ..Default::default()
        }
    }

    #[test]
    fn an_endpoint_belongs_to_its_pod_by_name_and_uid() {
        assert!(belongs(&ep("d", "u1"), Some(&pod("u1"))));
        assert!(
            !belongs(&ep("d", "u1"), Some(&pod("u2"))),
            "a new pod of the same name"
        );
        assert!(
            belongs(&ep("d", ""), Some(&pod("u2"))),
            "no UID recorded: by name"
        );
        assert!(!belongs(&ep("d", "u1"), None));
        assert!(for_a_pod(&ep("d", "")));
        assert!(!for_a_pod(&ep("", "")), "another runtime's endpoint");
    }
}
