//! Where the agent's durable state lives. One trait, so IPAM and the endpoint registry don't
//! care which backend holds them; `embedded` (a crash-safe local file) is the single-node one.
pub mod embedded;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ipam::IpamState;

pub use embedded::EmbeddedStore;

#[derive(Debug, thiserror::Error)]
pub enum DatastoreError {
    #[error("datastore file {path}: {op} failed")]
    Io {
        path: std::path::PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("datastore file {path} is corrupt; move it away to start empty")]
    Corrupt {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("datastore changed under us (revision {expected} expected, {found} found)")]
    Conflict { expected: u64, found: u64 },
}

/// An endpoint as the registry records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRecord {
    pub container_id: String,
    pub ifname: String,
    pub host_ifname: String,
    pub netns: String,
    pub pod_namespace: String,
    pub pod_name: String,
    pub addresses: Vec<String>,
    pub handle: String,
}

impl EndpointRecord {
    pub fn key(container_id: &str, ifname: &str) -> String {
        format!("{container_id}/{ifname}")
    }
}

/// Everything the agent persists, with the revision it was read at.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreState {
    pub revision: u64,
    pub ipam: IpamState,
    /// Endpoints keyed by "containerID/ifname".
    pub endpoints: BTreeMap<String, EndpointRecord>,
}

/// How durable a commit must be before it is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Survives power loss (fsync). Every new allocation: an address handed out must never be
    /// handed out twice.
    Power,
    /// Survives the agent crashing (the kernel has the write), not power loss. Enough for
    /// endpoint records (no pod network outlives a reboot) and for releases (losing one only
    /// leaves an address allocated, which leak GC reclaims): it saves two journal commits.
    Process,
}

/// A datastore: read the whole state, write it back with compare-and-swap on the revision.
pub trait Datastore: Send + Sync {
    fn load(&self) -> Result<StoreState, DatastoreError>;
    /// Writes `state` if the stored revision is still `state.revision`; returns the new revision.
    fn commit(&self, state: &StoreState, durability: Durability) -> Result<u64, DatastoreError>;
}
