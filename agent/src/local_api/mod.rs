//! gRPC services over the agent core. Domain errors become `tonic::Status` only here.
pub mod bgp;
pub mod server;

pub use server::{EndpointsSvc, IpamSvc, PolicyInfoSvc, RouteInfoSvc, UnixSocket};
