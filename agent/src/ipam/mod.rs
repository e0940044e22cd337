//! IP address management: pools carved into per-node blocks, allocation by handle.
pub mod allocator;

pub use allocator::{
    pool_of, Allocated, Allocation, Block, HandleRecord, Held, IpamError, IpamState, Policy, Pool,
    Retired,
};
