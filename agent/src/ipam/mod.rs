//! IP address management: pools carved into per-node blocks, allocation by handle. The pure
//! allocator decides; the service commits its decisions to the datastore.
pub mod admin;
pub mod allocator;
pub mod annotations;
pub mod pool;
pub mod service;
pub mod wellformed;

pub use allocator::{
    pool_of, AffinityRecord, Allocated, Allocation, Block, HandleRecord, Held, IpamError,
    IpamState, Policy, Pool, PoolChoice, Retired,
};
pub use service::IpamService;
