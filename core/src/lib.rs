//! calix's pure core: code with no I/O, no clock and no runtime, that the agent and the fuzz
//! targets share. For now the decoder of a peer's route stream ([`wire`]) and the plain
//! types it works on ([`Route`], [`update`]); the model, the allocator and the route engine
//! are to follow. No tokio, aya or kube here (and calix-proto without its `grpc` feature), so
//! that a sanitizer build of the fuzz targets stays small.
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
