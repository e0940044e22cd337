//! calix's pure core: code with no I/O, no clock (time is passed in) and no runtime, that the
//! agent, its tests and the fuzz targets share. No tokio, aya, kube, tonic or netlink here
//! (and calix-proto without its `grpc` feature): it builds and tests in seconds, as any user.
//!
//! - [`model`]: the records the agent keeps besides IPAM's (nodes, endpoints);
//! - [`selector`]: Kubernetes label selectors (a pool's `namespaceSelector`);
//! - [`store`]: the datastore's plain types (a key's value and revision, a watch event) and
//!   its key layout;
//! - [`ipam`]: pools, blocks and the records IPAM stores, the allocator, the rule for blocks,
//!   a pod's IPAM annotations;
//! - [`routes`]: the route engine of route distribution (the view of blocks and nodes, what
//!   this node advertises, whom it follows, each peer's session, validation, the report);
//! - [`wire`], [`update`]: the decoder of a peer's route stream and what it yields;
//! - [`reconcile`]: the planners (routes to other nodes);
//! - [`policy`]: NetworkPolicy calculated (per endpoint rules over address sets);
//! - [`services`]: Kubernetes Services calculated (frontends, admission, backend choice,
//!   Maglev).
pub mod bgp;
pub mod ipam;
pub mod model;
pub mod policy;
pub mod reconcile;
pub mod routes;
pub mod selector;
pub mod services;
pub mod store;
#[cfg(test)]
mod test_rng;
pub mod update;
pub mod wire;

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// One route to pods: `prefix` lives on `node`, reached through `next_hop` (that node's
/// address of the prefix's family).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Route {
    pub prefix: IpNet,
    /// The node the addresses live on (the origin; a reflector relays it unchanged).
    pub node: String,
    pub next_hop: IpAddr,
}
