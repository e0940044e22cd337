//! IP address management: pools carved into per-node blocks, allocation by handle.
pub mod allocator;

pub use allocator::{Allocation, Block, IpamError, IpamState, Pool};
