//! Services and their endpoints as calix takes them: plain values the Kubernetes adapter fills
//! from `v1.Service` and `discovery.k8s.io/v1.EndpointSlice` (issue 24). Nothing here knows
//! the API's types; what the dataplane programs is calculated from these ([`super::plan`]).
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// The transport protocol a Service port carries: NetworkPolicy's, one contract.
pub use crate::policy::model::Protocol;

/// A Service's namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `externalTrafficPolicy` / `internalTrafficPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TrafficPolicy {
    #[default]
    Cluster,
    /// Only this node's endpoints; none here: dropped.
    Local,
}

/// `trafficDistribution`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Distribution {
    /// Every usable endpoint alike.
    #[default]
    Any,
    /// `PreferClose` / `PreferSameZone` / `PreferSameNode`: the endpoints the EndpointSlice
    /// hints give this node or its zone, when every usable endpoint carries hints.
    PreferClose,
}

/// One port of a Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePort {
    /// Its name ("" for a Service's only port): an EndpointSlice's ports match by it.
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
    /// NodePort and LoadBalancer Services: the port on every node's addresses.
    pub node_port: Option<u16>,
}

/// A Service, as far as forwarding goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Service {
    pub key: ServiceKey,
    /// `spec.clusterIPs` (one per family); empty for a headless Service (`None`), which calix
    /// leaves alone.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`.
    pub load_balancer_ips: Vec<IpAddr>,
    /// `sessionAffinity: ClientIP`: its timeout in seconds.
    pub affinity_secs: Option<u32>,
    pub external_policy: TrafficPolicy,
    pub internal_policy: TrafficPolicy,
    pub distribution: Distribution,
    /// `spec.healthCheckNodePort` (a LoadBalancer with `externalTrafficPolicy: Local`): the
    /// port on every node where the proxy says whether it has local endpoints
    /// ([`crate::services::health`]).
    #[serde(default)]
    pub health_check_node_port: Option<u16>,
}

impl Service {
    /// Headless: no cluster IP, nothing to translate.
    pub fn headless(&self) -> bool {
        self.cluster_ips.is_empty()
    }
}

/// An EndpointSlice's `addressType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AddressType {
    V4,
    V6,
    /// Not programmed (names, not addresses).
    Fqdn,
}

impl AddressType {
    pub fn holds(self, a: &IpAddr) -> bool {
        matches!(
            (self, a),
            (AddressType::V4, IpAddr::V4(_)) | (AddressType::V6, IpAddr::V6(_))
        )
    }
}

/// One endpoint of a slice, with its conditions (absent `ready` reads as ready, absent
/// `serving` as `ready`, absent `terminating` as not, as the API says).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub addresses: Vec<IpAddr>,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// `nodeName`: the node it runs on.
    pub node: Option<String>,
    pub zone: Option<String>,
    /// `hints.forZones`.
    pub for_zones: Vec<String>,
    /// `hints.forNodes`.
    pub for_nodes: Vec<String>,
}

/// One port of a slice: the backends' port for the Service port of the same name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    /// Absent: the slice says the port is not known (skipped).
    pub port: Option<u16>,
}

/// An EndpointSlice of a Service (`kubernetes.io/service-name`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointSlice {
    pub name: String,
    pub service: ServiceKey,
    pub address_type: AddressType,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
}
