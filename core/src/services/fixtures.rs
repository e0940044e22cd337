//! Services, slices and backends for the tests.
use super::model::{
    AddressType, Distribution, Endpoint, EndpointSlice, Protocol, Service, ServiceKey, ServicePort,
    SlicePort, TrafficPolicy,
};
use super::slices::Backend;

/// Node n1, no zone: where the tests' calculations run.
pub fn here() -> super::choose::Here {
    super::choose::Here {
        node: "n1".into(),
        zone: None,
    }
}

/// A TCP Service `default/<name>` at 10.96.0.10 with `ports` (name, port).
pub fn service(name: &str, ports: &[(&str, u16)]) -> Service {
    Service {
        key: ServiceKey {
            namespace: "default".into(),
            name: name.into(),
        },
        cluster_ips: vec!["10.96.0.10".parse().expect("ip")],
        ports: ports
            .iter()
            .map(|(n, p)| ServicePort {
                name: (*n).into(),
                protocol: Protocol::Tcp,
                port: *p,
                node_port: None,
            })
            .collect(),
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        affinity_secs: None,
        external_policy: TrafficPolicy::Cluster,
        internal_policy: TrafficPolicy::Cluster,
        distribution: Distribution::Any,
        health_check_node_port: None,
    }
}

/// An endpoint on node n1 with `addresses`, ready (and serving) or not.
pub fn endpoint(addresses: &[&str], ready: bool) -> Endpoint {
    Endpoint {
        addresses: addresses.iter().map(|a| a.parse().expect("ip")).collect(),
        ready,
        serving: ready,
        terminating: false,
        node: Some("n1".into()),
        zone: None,
        for_zones: Vec::new(),
        for_nodes: Vec::new(),
    }
}

/// A slice of `svc` with TCP `ports` (name, number).
pub fn slice(
    name: &str,
    svc: &Service,
    address_type: AddressType,
    ports: &[(&str, Option<u16>)],
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    EndpointSlice {
        name: name.into(),
        service: svc.key.clone(),
        address_type,
        ports: ports
            .iter()
            .map(|(n, p)| SlicePort {
                name: (*n).into(),
                protocol: Protocol::Tcp,
                port: *p,
            })
            .collect(),
        endpoints,
    }
}

/// A ready backend of port "http" at `address`:8080 on `node`.
pub fn backend(address: &str, node: &str) -> Backend {
    Backend {
        port_name: "http".into(),
        protocol: Protocol::Tcp,
        address: address.parse().expect("ip"),
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        node: Some(node.into()),
        zone: None,
        for_zones: Vec::new(),
        for_nodes: Vec::new(),
    }
}
