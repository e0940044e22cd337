//! A pool as it is written: a `[[pools]]` entry of the agent's config, or an IPPool object's
//! spec (the same type: the CRD's schema is generated from it). The allocator's own view of
//! a pool on this node is [`super::Pool`].
use std::collections::BTreeMap;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::selector::LabelSelector;

/// How traffic to a pool's addresses on another node travels (a pool's `vxlan`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    Default,
    schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum VxlanMode {
    /// Routed to the node's address; the nodes must share a subnet (or the network must
    /// route pod addresses).
    Never,
    /// Routed directly to a node on one of this node's subnets, through VXLAN otherwise.
    #[default]
    CrossSubnet,
    /// Always through VXLAN.
    Always,
}

/// One pool: its CIDR, its blocks' size, and who may use it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PoolSpec {
    #[schemars(with = "String")]
    pub cidr: IpNet,
    /// Prefix length of the per-node blocks; default 26 (IPv4) / 122 (IPv6).
    #[serde(default)]
    pub block_size: Option<u8>,
    /// Masquerade traffic from this pool to destinations outside every pool.
    #[serde(default)]
    pub nat_outgoing: bool,
    /// A disabled pool hands out no new addresses.
    #[serde(default)]
    pub disabled: bool,
    /// `never`, `crossSubnet` (default) or `always`: how pod traffic to this pool's
    /// addresses on other nodes travels.
    #[serde(default)]
    pub vxlan: VxlanMode,
    /// Only nodes carrying every one of these labels (`node_labels`) allocate from the pool;
    /// empty: every node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Only pods whose Namespace's labels match this selector (matchLabels /
    /// matchExpressions, as a NetworkPolicy's) get addresses from the pool, however they ask
    /// (by default, by a pool annotation, or by a fixed address); absent: every namespace.
    /// Needs the `kubernetes` datastore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Block sizes the pool had before `blockSize` (each in blockSize's range): blocks of
    /// these sizes, made before the change, still count. A block of any other size is
    /// ignored by every node (docs/decisions.md, "Blocks are well-formed or ignored").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous_block_sizes: Vec<u8>,
}

impl PoolSpec {
    pub fn new(cidr: IpNet) -> Self {
        Self {
            cidr,
            block_size: None,
            nat_outgoing: false,
            disabled: false,
            vxlan: VxlanMode::default(),
            node_selector: Default::default(),
            namespace_selector: None,
            previous_block_sizes: Vec::new(),
        }
    }

    /// Whether a node with `labels` uses this pool.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.node_selector
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }

    pub fn block_size(&self) -> u8 {
        self.block_size.unwrap_or(match self.cidr {
            IpNet::V4(_) => 26,
            IpNet::V6(_) => 122,
        })
    }
}
