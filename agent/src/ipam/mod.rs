//! IP address management: pools carved into per-node blocks, allocation by handle. The pure
//! allocator (`calix_core::ipam`) decides; the service commits its decisions to the datastore.
pub mod admin;
pub mod service;

pub use service::IpamService;
