//! gRPC services over the agent core. Domain errors become `tonic::Status` only here.
pub mod bgp;
pub mod server;
pub mod services;

/// The reports calixctl reads besides the node's own: the BGP speaker's, the Services
/// calculation's (`None`: off).
#[derive(Default)]
pub struct Reports {
    pub bgp: Option<std::sync::Arc<crate::bgp::speaker::BgpHandle>>,
    pub services: Option<std::sync::Arc<crate::services::ServicesService>>,
}

pub use server::{EndpointsSvc, IpamSvc, PolicyInfoSvc, RouteInfoSvc, UnixSocket};
