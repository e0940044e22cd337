//! calix-agent: the node daemon (IPAM, endpoint registry, eBPF dataplane) and the pieces
//! calixctl shares with it.
pub mod config;
/// The dataplane is its own crate (calix-dataplane, issue 21); re-exported under its old path so
/// `crate::dataplane::…` keeps naming it.
pub use calix_dataplane as dataplane;
pub mod datastore;
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
pub mod pki;
pub mod reconcile;
pub mod routes;
pub mod signer;
pub mod tasks;
pub mod uninstall;
