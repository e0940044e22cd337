//! calix's contracts with the node's kernel, written once and shared by every binary (the
//! agent, the CNI plugin, the tests and xtask). This crate builds with cargo alone (no eBPF
//! toolchain), so xtask can use it before `cargo xtask setup` has run.
pub mod bpffs;
