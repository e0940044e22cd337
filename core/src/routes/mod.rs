//! Route distribution's engine, pure (time passed in, no sockets): every agent tells its peers
//! which pod addresses live on its node, and learns theirs. The agent's `routes` module runs it:
//! the datastore's watch, the TCP door, the streams, the hand-over to the reconciler.
//!
//! ```text
//!  datastore ──watch──► view ──► advertise ──► (the agent's feed and server) ──► peers
//!  (blocks, nodes)       │
//!                        ├──► peers (who to follow) ──► (the agent's clients) ──┐
//!                        └──► validate ◄── sessions ◄───────────────────────────┘
//!                                 │
//!                                 └──► desired routes ──► the reconciler (RemoteRoute)
//! ```
//!
//! - [`view`]: the datastore's blocks and node records;
//! - [`advertise`]: this node's routes (its blocks, and /32 /128 for borrowed addresses);
//! - [`peers`]: whom to follow (full mesh, or route reflectors);
//! - [`session`]: what one peer said, and its graceful-restart timer;
//! - [`validate`]: who may say what (block affinity, the owner of a borrowed address, next hop);
//! - [`engine`]: all of the above together;
//! - [`report`]: what `calixctl routes` / `nodes` and `/metrics` show.
pub mod advertise;
pub mod engine;
pub mod peers;
pub mod report;
pub mod session;
pub mod validate;
pub mod view;
