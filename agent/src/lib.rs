//! calix-agent: the node daemon (IPAM, endpoint registry, eBPF dataplane) and the pieces
//! calixctl shares with it.
pub mod config;
/// The dataplane and the datastore are crates of their own (calix-dataplane and
/// calix-datastore, layer 2; issue 21); re-exported under their old paths so
/// `crate::dataplane::…` and `crate::datastore::…` keep naming them.
pub use calix_dataplane as dataplane;
pub use calix_datastore as datastore;
pub mod endpoints;
pub mod error;
pub mod instance;
pub mod ipam;
pub mod kubernetes;
pub mod local_api;
pub mod memory;
pub mod metrics;
pub mod notice;
pub mod paths;
pub mod pod_network;
/// X.509 for route distribution is its own crate (layer 1); re-exported so `crate::pki::…`
/// paths keep working.
pub use calix_pki as pki;
pub mod distribution;
pub mod reconcile;
pub mod signer;
pub mod tasks;
pub mod uninstall;
