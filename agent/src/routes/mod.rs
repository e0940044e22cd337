//! Route distribution between agents (issue 13): every agent tells its peers which pod
//! addresses live on its node, and learns theirs.
//!
//! ```text
//!  datastore ──watch──► view ──► advertise ──► feed ──► server (TCP, mTLS) ──► peers
//!  (blocks, nodes)       │                       ▲
//!                        ├──► peers (who to follow) ──► client ×N ──┐
//!                        └──► validate ◄── sessions ◄───────────────┘
//!                                 │
//!                                 └──► desired routes ──► the reconciler (RemoteRoute)
//! ```
//!
//! - [`view`]: the datastore's blocks and node records, kept current by a watch;
//! - [`advertise`]: this node's routes (its blocks, and /32 /128 for borrowed addresses);
//! - [`feed`]: what this agent serves, with generation numbers (snapshot, then deltas);
//! - [`peers`]: whom to follow (full mesh, or route reflectors);
//! - [`session`]: what one peer said, and its graceful-restart timer;
//! - [`validate`]: who may say what (block affinity, the owner of a borrowed address, next hop);
//! - [`engine`]: all of the above together, pure (time injected), no sockets;
//! - [`wire`], [`tls`], [`conn`], [`listener`], [`door`], [`server`], [`client`]: the gRPC
//!   service and its TCP door with mutual TLS (the door's bookkeeping in [`door`]), and the
//!   follower of one peer;
//! - [`report`]: what `calixctl routes` / `nodes` and `/metrics` show;
//! - [`local`]: this node's next hops and subnets;
//! - [`nodes`]: where the peers come from (node records, or Kubernetes' Nodes read as such);
//! - [`settings`]: what it starts with (from `[routes]`);
//! - [`task`]: the async loop that runs it in the agent.
pub mod advertise;
pub mod client;
pub mod conn;
pub mod door;
pub mod engine;
pub mod feed;
pub mod listener;
pub mod local;
pub mod nodes;
pub mod peers;
pub mod report;
pub mod server;
pub mod session;
pub mod settings;
pub mod task;
pub mod tls;
pub mod validate;
pub mod view;
pub mod wire;

pub use calix_core::Route;
pub use task::{RouteSink, RoutesHandle};

/// Why route distribution could not start.
#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("cannot listen for peers on {addr} (routes.listen)")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "this node has no address to advertise routes with: set routes.node_addresses, or give the first uplink a global address"
    )]
    NoAddress,
}

#[cfg(test)]
mod tests;
