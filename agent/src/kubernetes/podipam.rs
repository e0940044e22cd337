//! A pod's IPAM annotations at its allocation. The plugin passes the pod's namespace and name
//! (the allocation's `namespace` and `pod` attributes, from `K8S_POD_NAMESPACE` and
//! `K8S_POD_NAME`); the agent, which may read the API, reads the pod and its namespace straight
//! from the API server (not the watch: a pod just created may not have reached it) and
//! resolves their labels and annotations ([`super::annotations`]) against the IPPools. A pod
//! the API server does not have (a static pod before its mirror) has no annotations of its
//! own; a namespace it does not have matches no `namespaceSelector`.
use std::sync::Arc;

use calix_core::ipam::annotations::{self, NamedPool, Namespace, PodIpam};
use calix_core::ipam::Pool;

use super::cluster::Cluster;
use crate::error::AgentError;
use calix_datastore::kubernetes::views::{self, NamespaceView, PodView};
use calix_datastore::Datastore;

/// Reads pods' IPAM annotations.
pub struct PodIpamSource {
    store: Arc<dyn Datastore>,
    node: String,
    cluster: Cluster,
}

impl PodIpamSource {
    pub fn new(store: Arc<dyn Datastore>, node: &str, cluster: Cluster) -> Self {
        Self {
            store,
            node: node.to_string(),
            cluster,
        }
    }

    /// The pools pod `namespace/name` may use and its fixed addresses, from its namespace's
    /// labels (the IPPools' `namespaceSelector`) and annotations and its own, for an
    /// allocation of the families `(v4, v6)`; `node_pools` are the node's pools as its
    /// allocator has them (a disabled one is not usable).
    pub async fn for_pod(
        &self,
        namespace: &str,
        name: &str,
        node_pools: &[Pool],
        families: (bool, bool),
    ) -> Result<PodIpam, AgentError> {
        let pod_key = format!("{}{namespace}/{name}", views::pods_of(&self.node));
        let pod = match self.store.get(&pod_key).await? {
            Some(kv) => kv.decode::<PodView>()?.annotations,
            None => Default::default(),
        };
        let ns = match self
            .store
            .get(&format!("{}{namespace}", views::NAMESPACES))
            .await?
        {
            Some(kv) => Some(kv.decode::<NamespaceView>()?),
            None => None,
        };
        let no_annotations = Default::default();
        let ns = Namespace {
            name: namespace,
            labels: ns.as_ref().map(|n| &n.labels),
            annotations: ns.as_ref().map_or(&no_annotations, |n| &n.annotations),
        };
        let pools: Vec<NamedPool> = self
            .cluster
            .named_pools()
            .into_iter()
            .map(|(name, p)| {
                let cidr = p.cidr.trunc();
                NamedPool {
                    usable: node_pools.iter().any(|n| n.cidr == cidr && !n.disabled),
                    name,
                    cidr,
                    namespace_selector: p.namespace_selector,
                }
            })
            .collect();
        Ok(annotations::resolve(&ns, name, &pod, &pools, families)?)
    }
}
