//! calixctl's commands: ask the agent (or the cluster), print through [`crate::render`].
pub(crate) mod bgp;
pub(crate) mod bpf;
pub(crate) mod endpoints;
pub(crate) mod ipam;
pub(crate) mod policy;
pub(crate) mod routes;
pub(crate) mod services;
