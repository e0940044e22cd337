//! The node's pod directory ([`PodDirectory`]) in Kubernetes: who a pod is, from this node's
//! Pods as watched ([`Pods`]); what its IPAM annotations allow, read at its allocation
//! ([`PodIpamSource`]).
use calix_core::ipam::annotations::PodIpam;
use calix_core::ipam::Pool;

use crate::error::AgentError;
use crate::pod_network::pods::{PodDirectory, PodInfo};

use super::podipam::PodIpamSource;
use super::pods::Pods;

/// This node's Pods and their IPAM annotations.
pub struct KubePods {
    pub pods: Pods,
    pub ipam: PodIpamSource,
}

#[tonic::async_trait]
impl PodDirectory for KubePods {
    fn pod(&self, namespace: &str, name: &str) -> Option<PodInfo> {
        self.pods.get(namespace, name).map(|p| PodInfo {
            uid: p.uid,
            labels: p.labels,
            phase: p.phase,
            deleting: p.deleting,
        })
    }

    async fn ipam(
        &self,
        namespace: &str,
        name: &str,
        node_pools: &[Pool],
        families: (bool, bool),
    ) -> Result<PodIpam, AgentError> {
        self.ipam
            .for_pod(namespace, name, node_pools, families)
            .await
    }
}
