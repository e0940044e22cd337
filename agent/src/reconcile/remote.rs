//! Routes to pods on other nodes: what route distribution (`crate::routes`) wants programmed,
//! and the reconciler keeps true in the kernel (desired state, like endpoints).
use std::net::IpAddr;

use ipnet::IpNet;

use crate::config::VxlanMode;

/// One route to another node's pods: a block affine to `node`, or one address it borrowed
/// from another node's block (/32, /128).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RemoteRoute {
    pub prefix: IpNet,
    /// The node the addresses live on.
    pub node: String,
    /// That node's address (validated against its node record): the route's gateway, or the
    /// VXLAN peer.
    pub next_hop: IpAddr,
    /// The pool's `vxlan` setting: whether the route goes through the VXLAN device (always, or
    /// when `next_hop` is not on one of this node's subnets) or straight to `next_hop`.
    pub vxlan: VxlanMode,
}
