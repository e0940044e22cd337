//! calix-agent: the node daemon (IPAM, endpoint registry, eBPF dataplane) and the pieces
//! calixctl shares with it.
pub mod bgp;
pub mod config;
pub mod distribution;
pub mod endpoints;
pub mod error;
pub mod health_ports;
pub mod instance;
pub mod ipam;
pub mod kubernetes;
pub mod local_api;
pub mod memory;
pub mod metrics;
pub mod notice;
pub mod paths;
pub mod pod_network;
pub mod policy;
mod prometheus;
pub mod reconcile;
pub mod remote_routes;
pub mod services;
pub mod signer;
pub mod tasks;
pub mod uninstall;
