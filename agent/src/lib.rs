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
pub mod grpc;
pub mod instance;
pub mod ipam;
pub mod k8s;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod notice;
pub mod paths;
/// X.509 for route distribution is its own crate (layer 1); re-exported so `crate::pki::…`
/// paths keep working.
pub use calix_pki as pki;
pub mod reconcile;
pub mod routes;
pub mod signer;
pub mod tasks;
pub mod uninstall;
