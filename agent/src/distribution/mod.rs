//! Route distribution between agents (issue 13): every agent tells its peers which pod
//! addresses live on its node, and learns theirs. The engine (what to advertise, whom to
//! follow, what to accept) is pure and lives in `calix_core::routes`; this module is its
//! transport and its loop.
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
//! - `calix_core::routes`: the view, advertise, peers, sessions, validate, the engine, the
//!   report; `calix_core::wire`: the stream's decoder;
//! - [`feed`]: what this agent serves, with generation numbers (snapshot, then deltas);
//! - [`tls`], [`conn`], [`listener`], [`door`], [`server`], [`client`]: the gRPC service and
//!   its TCP door with mutual TLS (the door's bookkeeping in [`door`]), and the follower of
//!   one peer;
//! - [`local`]: this node's next hops and subnets;
//! - [`nodes`]: where the peers come from (node records, or Kubernetes' Nodes read as such);
//! - [`settings`]: what it starts with (from `[routes]`);
//! - [`verdict`]: `calixctl trace`'s question to the node a traced pod lives on (the server's
//!   side answers through [`server::Verdicts`]);
//! - [`task`]: the async loop that runs it in the agent; `watch`: the datastore parts it
//!   follows; [`handover`]: what it hands the reconciler and the dataplane ([`RouteSink`]).
pub mod client;
pub mod conn;
pub mod door;
pub mod feed;
pub mod handover;
pub mod listener;
pub mod local;
pub mod nodes;
pub mod server;
pub mod settings;
pub mod task;
pub mod tls;
pub mod verdict;
pub(crate) mod watch;

pub use handover::RouteSink;
pub use task::RoutesHandle;

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
