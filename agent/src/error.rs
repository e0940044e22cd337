//! The error of the agent's services (IPAM, the endpoint registry, the node that composes
//! them), mapped to gRPC codes in `grpc/`.
use crate::dataplane::DataplaneError;
use crate::datastore::DatastoreError;
use crate::ipam::IpamError;

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
    /// A pod's IPAM annotation that cannot be honoured, or no pool serves its namespace.
    #[error(transparent)]
    PodIpam(#[from] crate::k8s::annotations::PodIpamError),
}
