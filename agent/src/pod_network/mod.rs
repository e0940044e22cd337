//! The node: the IPAM service and the endpoint registry side by side, and the few operations
//! that need both (a CNI DEL releases what its endpoint held; CNI GC and leak GC compare
//! allocations with endpoints). Each keeps its own state and lock; where both are taken, the
//! registry's comes first.
mod conntrack;
pub mod mtu;
pub mod pods;

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use calix_common::NatConfig;
use calix_core::ipam::annotations::PodIpam;
use calix_core::ipam::{Policy, Pool};
use calix_core::model::EndpointRecord;
use calix_proto::handle;

use crate::endpoints::EndpointRegistry;
use crate::error::AgentError;
use crate::ipam::service::Swept;
use crate::ipam::IpamService;
use pods::{PodDirectory, PodInfo};

pub struct Node {
    pub ipam: IpamService,
    pub endpoints: EndpointRegistry,
    /// SNAT's conntrack table (pin directory, settings), once the eBPF dataplane is up.
    conntrack: std::sync::OnceLock<(PathBuf, NatConfig)>,
    /// What decides the MTU of pods whose network config sets none.
    pod_mtu: std::sync::RwLock<mtu::PodMtu>,
    /// What an operator must see (Kubernetes Events with the kubernetes datastore).
    pub notices: Arc<crate::notice::Notifier>,
    /// Where pods are looked up (the kubernetes datastore: this node's Pods, once watched, and
    /// their IPAM annotations).
    pub pods: std::sync::OnceLock<Arc<dyn PodDirectory>>,
}

impl Node {
    pub fn new(ipam: IpamService, endpoints: EndpointRegistry) -> Self {
        Self {
            ipam,
            endpoints,
            conntrack: std::sync::OnceLock::new(),
            pod_mtu: Default::default(),
            notices: Default::default(),
            pods: std::sync::OnceLock::new(),
        }
    }

    /// Sets what decides pods' MTU (at start, on SIGHUP).
    pub fn set_pod_mtu(&self, m: mtu::PodMtu) {
        *self.pod_mtu.write().unwrap_or_else(|p| p.into_inner()) = m;
    }

    /// The MTU a pod with `addresses` should have when its network config sets none; `None`:
    /// no opinion (see [`mtu`]).
    pub fn pod_mtu(&self, addresses: &[IpAddr]) -> Option<u32> {
        let m = self
            .pod_mtu
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        m.of(addresses)
    }

    pub fn name(&self) -> &str {
        self.ipam.node()
    }

    /// Pod `namespace/name` as the pod directory last saw it; `None` without a directory.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<PodInfo> {
        self.pods.get()?.pod(namespace, name)
    }

    /// What an allocation for the pod its `attributes` name (`namespace`, `pod`) may use: the
    /// pod's pools (its namespace's, narrowed by its annotations) and fixed addresses, for the
    /// families `(v4, v6)`. `None` when the allocation names no pod or there is no pod
    /// directory: the default pools.
    pub async fn pod_ipam(
        &self,
        attributes: &BTreeMap<String, String>,
        families: (bool, bool),
    ) -> Result<Option<PodIpam>, AgentError> {
        let (Some(directory), Some(ns), Some(pod)) = (
            self.pods.get(),
            attributes.get("namespace").filter(|v| !v.is_empty()),
            attributes.get("pod").filter(|v| !v.is_empty()),
        ) else {
            return Ok(None);
        };
        let pools = self.ipam.pools();
        Ok(Some(directory.ipam(ns, pod, &pools, families).await?))
    }

    /// An allocation failed: when no pool can give an address, an operator must see it (a
    /// Warning `IPAMExhausted` on the pod named by the request's attributes, else the node).
    pub fn notice_allocation_failure(
        &self,
        e: &AgentError,
        attributes: &std::collections::BTreeMap<String, String>,
    ) {
        use calix_core::ipam::IpamError;
        if !matches!(
            e,
            AgentError::Ipam(IpamError::Exhausted { .. } | IpamError::NoPool { .. })
        ) {
            return;
        }
        let subject = match (attributes.get("namespace"), attributes.get("pod")) {
            (Some(ns), Some(pod)) if !ns.is_empty() && !pod.is_empty() => {
                crate::notice::Subject::Pod {
                    namespace: ns.clone(),
                    name: pod.clone(),
                }
            }
            _ => crate::notice::Subject::Node,
        };
        self.notices.warning(
            "IPAMExhausted",
            subject,
            format!("node {}: no address for the pod: {e}", self.name()),
        );
    }

    /// CNI DEL: forgets the endpoint and, with `release_handle`, releases what that handle
    /// holds for `ifname`. Two writes, the endpoint record first: an agent that dies between
    /// them leaves an allocation without an endpoint, which leak GC reclaims (the other order
    /// could leave an endpoint record naming an address free for the next pod). Idempotent;
    /// returns whether the endpoint existed and what was released.
    pub async fn unregister(
        &self,
        container_id: &str,
        ifname: &str,
        release_handle: Option<&str>,
    ) -> Result<(bool, Vec<IpAddr>), AgentError> {
        let existed = self
            .endpoints
            .unregister(container_id, ifname)
            .await?
            .is_some();
        let released = match release_handle {
            Some(h) => self.ipam.release(h, ifname).await?,
            None => Vec::new(),
        };
        Ok((existed, released))
    }

    /// CNI GC: releases every allocation of this node for `network` whose (containerID,
    /// ifname) is not in `valid`, and forgets the endpoints of those attachments. Exactly this
    /// network: `k8s` never matches `k8s.x`'s. Returns the released addresses and the
    /// forgotten endpoints.
    pub async fn gc(
        &self,
        network: &str,
        valid: &HashSet<(String, String)>,
    ) -> Result<(Vec<IpAddr>, Vec<EndpointRecord>), AgentError> {
        if !handle::is_cni_name(network) {
            return Err(AgentError::Invalid(format!(
                "{network:?} is not a CNI network name"
            )));
        }
        let stale = |attachment: Option<(&str, &str)>, ifname: &str| {
            attachment.is_some_and(|(net, cid)| {
                net == network && !valid.contains(&(cid.to_string(), ifname.to_string()))
            })
        };
        let forgotten = self.endpoints.gc(&stale).await?;
        let released = self.ipam.gc(&stale).await?;
        Ok((released, forgotten))
    }

    /// One housekeeping pass: leak GC against the registry's endpoints, empty blocks, handle
    /// records.
    pub async fn housekeep(&self, now: Instant) -> Result<Swept, AgentError> {
        let swept = self.ipam.housekeep(now, &self.endpoints).await;
        self.notice_ignored_blocks().await;
        swept
    }

    /// The IPAM blocks found ignored since the last call (they break the rule for blocks:
    /// `calix_core::ipam::wellformed`), and blocks retained under a refused pool change, each a
    /// Warning on this node (an Event in Kubernetes).
    pub async fn notice_ignored_blocks(&self) {
        if let Some(msg) = self.ipam.take_retention_notice() {
            self.notices
                .warning("IPPoolRefused", crate::notice::Subject::Node, msg);
        }
        for i in self.ipam.take_ignored().await {
            self.notices.warning(
                "IPAMBlockIgnored",
                crate::notice::Subject::Node,
                format!(
                    "IPAM block {} (affine to {:?}, {} allocation(s)) is ignored: it breaks \
                     the rule for blocks ({}: {}); calixctl ipam check lists it",
                    i.key,
                    i.affinity,
                    i.allocations.len(),
                    i.rule,
                    i.detail
                ),
            );
        }
    }

    /// New pools (SIGHUP): refused, naming the pool, when one would drop live addresses; the
    /// dataplane learns them after IPAM.
    pub async fn set_pools(&self, pools: Vec<Pool>, policy: Policy) -> Result<(), AgentError> {
        let cidrs = pools.iter().map(|p| p.cidr).collect();
        self.ipam.set_pools(pools, policy).await?;
        if let Err(e) = self.endpoints.set_pools(cidrs).await {
            tracing::warn!(error = %e, "cannot give the dataplane the new pools");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
