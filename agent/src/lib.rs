//! calix-agent: the node daemon (IPAM, endpoint registry, eBPF dataplane) and the pieces
//! calixctl shares with it.
pub mod config;
pub mod dataplane;
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
