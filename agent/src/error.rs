//! The error of the agent's services (IPAM, the endpoint registry, the node that composes
//! them), mapped to gRPC codes in `grpc/`.
use calix_core::ipam::IpamError;

use calix_dataplane::DataplaneError;
use calix_datastore::DatastoreError;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Ipam(#[from] IpamError),
    #[error(transparent)]
    Datastore(#[from] DatastoreError),
    #[error("programming endpoint {host_ifname} failed")]
    Dataplane {
        host_ifname: String,
        #[source]
        source: DataplaneError,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("pool change refused: {0}")]
    PoolChange(String),
    /// An address another node allocated: only that node's agent releases it (or an operator,
    /// with the datastore's own credentials).
    #[error(
        "{addr} was allocated by node {node}: only that node's agent releases it (an operator: \
         calixctl --kubeconfig ipam release, or that node's calixctl)"
    )]
    ForeignAllocation {
        addr: std::net::IpAddr,
        node: String,
    },
    /// A pod's IPAM annotation that cannot be honoured, or no pool serves its namespace.
    #[error(transparent)]
    PodIpam(#[from] calix_core::ipam::annotations::PodIpamError),
}

/// A stored value that does not decode: the datastore's `BadValue`.
impl From<calix_core::store::BadValue> for AgentError {
    fn from(e: calix_core::store::BadValue) -> Self {
        AgentError::Datastore(e.into())
    }
}
