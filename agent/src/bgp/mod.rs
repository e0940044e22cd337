//! BGP with the data centre's routers (issue 23): calix-bgp's pure speaker, run by the agent.
//!
//! - [`settings`]: what it starts with (from `[bgp]`, `crate::config::bgp`);
//! - [`md5`]: a connection's TCP MD5 password (RFC 2385);
//! - [`conn`]: whole messages read and written on one connection;
//! - [`peer_task`]: one configured peer for the agent's lifetime (connect, session, advertise,
//!   import, graceful restart);
//! - [`peers`]: the running peers, started, stopped and reconfigured while the agent runs;
//! - [`speaker`]: the loop: this node's routes from the datastore's blocks to every peer, the
//!   peers' routes to the reconciler, the report;
//! - [`status`]: the report (`calixctl bgp`) and the metrics.
pub mod conn;
pub mod listen;
pub mod md5;
pub mod peer_task;
pub mod peers;
pub mod settings;
pub mod speaker;
pub mod status;
