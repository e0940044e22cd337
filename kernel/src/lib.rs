//! calix's contracts with the node's kernel, written once and shared by every binary (the
//! agent, the CNI plugin, the tests and xtask):
//!
//! - [`netlink`]: links, addresses, routes, neighbours, rules; calix's route protocol;
//! - [`netns`]: network namespaces (a thread per namespace, sockets opened inside) and sysctls;
//! - [`pod`]: what a pod's wiring is (the host veth's MAC, the gateways, the routes and link
//!   settings of both sides), done by the plugin in ADD and kept true by the agent;
//! - [`node_route`]: routes to other nodes' pods (through an uplink or a VXLAN device);
//! - [`vxlan`]: calix's VXLAN devices, their forwarding and neighbour entries, and the VTEP
//!   MAC every node derives from a peer's address;
//! - [`host`]: the narrow trait the agent's reconcilers use, over netlink or in memory;
//! - [`mac`]: MAC addresses as text;
//! - [`bpffs`]: mounting the BPF filesystem;
//! - [`nft`]: nftables tables over nfnetlink (no `nft` binary): write one atomically, read it
//!   back to compare.
//!
//! This crate builds with cargo alone (no eBPF toolchain), so xtask can use it before
//! `cargo xtask setup` has run.
pub mod bpffs;
pub mod host;
pub mod mac;
pub mod netlink;
pub mod netns;
pub mod nft;
pub mod node_route;
pub mod pod;
pub mod sock_diag;
pub mod vxlan;
