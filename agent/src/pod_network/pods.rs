//! The pods this node hosts, as the node's services ask about them: who a pod is (`calixctl
//! endpoints` shows it) and which pools and fixed addresses its IPAM annotations allow it.
//! With the `kubernetes` datastore the Kubernetes adapter answers (`crate::kubernetes::pods::
//! KubePods`); with another there is no directory, and every allocation has the default pools.
use std::collections::BTreeMap;

use calix_core::ipam::annotations::PodIpam;
use calix_core::ipam::Pool;

use crate::error::AgentError;

/// A pod as last seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodInfo {
    pub uid: String,
    pub labels: BTreeMap<String, String>,
    pub phase: String,
    /// Its deletion has begun (its containers may still run).
    pub deleting: bool,
}

/// Where the node's services look pods up.
#[tonic::async_trait]
pub trait PodDirectory: Send + Sync {
    /// Pod `namespace/name` on this node, as last seen; `None`: not (yet) seen.
    fn pod(&self, namespace: &str, name: &str) -> Option<PodInfo>;

    /// The pools pod `namespace/name` may use and its fixed addresses, for an allocation of
    /// the families `(v4, v6)`; `node_pools` are the node's pools as its allocator has them.
    async fn ipam(
        &self,
        namespace: &str,
        name: &str,
        node_pools: &[Pool],
        families: (bool, bool),
    ) -> Result<PodIpam, AgentError>;
}
