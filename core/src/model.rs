//! Records the agent keeps in the datastore besides IPAM.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// An endpoint as the registry records it (key `endpoints/<node>/<containerID>/<ifname>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct EndpointRecord {
    pub container_id: String,
    pub ifname: String,
    pub host_ifname: String,
    pub netns: String,
    pub pod_namespace: String,
    pub pod_name: String,
    /// The pod's UID (`K8S_POD_UID`): a new pod of the same name is another pod. Empty from
    /// runtimes that do not pass it, and from older plugins.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_uid: String,
    pub addresses: Vec<String>,
    pub handle: String,
    /// The pod interface's MAC ("aa:bb:cc:dd:ee:ff"); empty from older plugins.
    #[serde(default)]
    pub mac: String,
    /// The ifindex of the host-side veth this endpoint was created with: a link of the same
    /// name with another ifindex is somebody else's (a recreated pod's). 0 from older plugins.
    #[serde(default)]
    pub host_ifindex: u32,
}

impl EndpointRecord {
    /// The in-memory registry key, "containerID/ifname": an endpoint's identity (container
    /// IDs and interface names never contain '/').
    pub fn key(container_id: &str, ifname: &str) -> String {
        format!("{container_id}/{ifname}")
    }

    /// This endpoint's identity, [`EndpointRecord::key`].
    pub fn id(&self) -> String {
        Self::key(&self.container_id, &self.ifname)
    }
}

/// A node as it announces itself (key `nodes/<name>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct NodeRecord {
    pub name: String,
    #[serde(default)]
    pub addresses: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// calix-agent version that last wrote this record.
    #[serde(default)]
    pub agent_version: String,
    /// Where this node serves `calix.v1.Routes` (`address:port`, `[v6]:port`); empty when
    /// route distribution is off (or the record predates it): peers do not follow it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub routes_endpoint: String,
    /// This node's agent relays every node's routes (`routes.reflector`, with
    /// `topology = "reflectors"`). Also what entitles it to announce other nodes' routes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reflector: bool,
}

/// CNI GC's question about an attachment: given its (network, container ID), decoded from its
/// IPAM handle (`None` when no CNI plugin made it), and its ifname, is it gone from the
/// runtime's list of valid attachments?
pub type IsStale<'a> = dyn Fn(Option<(&str, &str)>, &str) -> bool + Sync + 'a;
