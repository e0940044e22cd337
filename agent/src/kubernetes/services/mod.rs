//! Services and EndpointSlices as the Services calculation takes them
//! (`calix_core::services::model`, issue 24), read with Kubernetes' meaning: ExternalName
//! Services are not calix's (DNS answers them); a LoadBalancer ingress with `ipMode: Proxy` is
//! the load balancer's to translate, not the nodes'; a NodePort is honoured for the NodePort
//! and LoadBalancer types only; a Service labelled `service.kubernetes.io/service-proxy-name`
//! (another proxy's) or `service.kubernetes.io/headless` is left alone, as kube-proxy does; an absent `ready` reads as ready, an absent `serving` as
//! `ready`, an absent `terminating` as not. What cannot be read (an address that does not
//! parse, a port out of range, an unknown protocol) is left out and said, the rest kept.
use std::net::IpAddr;

use calix_core::services::model::{
    AddressType, Distribution, Endpoint, EndpointSlice, Protocol, Service, ServiceKey, ServicePort,
    SlicePort, TrafficPolicy,
};
use k8s_openapi::api::core::v1::Service as KubeService;
use k8s_openapi::api::discovery::v1::EndpointSlice as KubeSlice;

pub mod watch;

/// The label naming a slice's Service.
pub use calix_datastore::kubernetes::views::SERVICE_NAME_LABEL;

fn addresses<'a>(
    texts: impl IntoIterator<Item = &'a String>,
    what: &str,
    problems: &mut Vec<String>,
) -> Vec<IpAddr> {
    texts
        .into_iter()
        .filter(|t| !t.is_empty() && t.as_str() != "None")
        .filter_map(|t| match t.parse() {
            Ok(a) => Some(a),
            Err(_) => {
                problems.push(format!("{what} {t:?} is not an address"));
                None
            }
        })
        .collect()
}

fn port(n: i32) -> Option<u16> {
    u16::try_from(n).ok().filter(|p| *p != 0)
}

fn policy(p: Option<&str>) -> TrafficPolicy {
    match p {
        Some("Local") => TrafficPolicy::Local,
        _ => TrafficPolicy::Cluster,
    }
}

/// Labels of a Service no default proxy serves (the datastore's Service view keeps them).
pub use calix_datastore::kubernetes::views::NOT_PROXIED;

/// A Service as the calculation takes it, and what of it could not be read; `None` for one
/// that is not calix's (ExternalName, a label of [`NOT_PROXIED`]) or has no namespace or name.
pub fn service(s: &KubeService) -> (Option<Service>, Vec<String>) {
    let mut problems = Vec::new();
    let (Some(namespace), Some(name)) = (s.metadata.namespace.clone(), s.metadata.name.clone())
    else {
        return (None, problems);
    };
    let labels = s.metadata.labels.as_ref();
    if NOT_PROXIED
        .iter()
        .any(|l| labels.is_some_and(|m| m.contains_key(*l)))
    {
        return (None, problems);
    }
    let spec = s.spec.clone().unwrap_or_default();
    let kind = spec.type_.as_deref().unwrap_or("ClusterIP");
    if kind == "ExternalName" {
        return (None, problems);
    }
    let node_ports = matches!(kind, "NodePort" | "LoadBalancer");
    let cluster_ips = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => addresses(ips, "clusterIP", &mut problems),
        _ => addresses(spec.cluster_ip.iter(), "clusterIP", &mut problems),
    };
    let mut ports = Vec::new();
    for p in spec.ports.unwrap_or_default() {
        let name = p.name.clone().unwrap_or_default();
        let (Some(protocol), Some(number)) = (Protocol::parse(p.protocol.as_deref()), port(p.port))
        else {
            problems.push(format!(
                "port {name:?}: {:?} {} cannot be served",
                p.protocol, p.port
            ));
            continue;
        };
        ports.push(ServicePort {
            name,
            protocol,
            port: number,
            node_port: p.node_port.and_then(port).filter(|_| node_ports),
        });
    }
    let lb: Vec<String> = s
        .status
        .as_ref()
        .and_then(|st| st.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
        .filter_map(|i| i.ip.clone())
        .collect();
    let affinity_secs = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .filter(|t| *t > 0)
            // The API's default: three hours.
            .unwrap_or(10_800)
    });
    let svc = Service {
        key: ServiceKey { namespace, name },
        cluster_ips,
        ports,
        external_ips: addresses(
            spec.external_ips.iter().flatten(),
            "externalIP",
            &mut problems,
        ),
        load_balancer_ips: addresses(lb.iter(), "LoadBalancer ingress", &mut problems),
        affinity_secs,
        external_policy: policy(spec.external_traffic_policy.as_deref()),
        internal_policy: policy(spec.internal_traffic_policy.as_deref()),
        distribution: match spec.traffic_distribution.as_deref() {
            Some("PreferClose" | "PreferSameZone" | "PreferSameNode") => Distribution::PreferClose,
            _ => Distribution::Any,
        },
        // The API gives one to a LoadBalancer with a Local policy only.
        health_check_node_port: spec.health_check_node_port.and_then(port),
    };
    (Some(svc), problems)
}

/// An EndpointSlice as the calculation takes it, and what of it could not be read; `None`
/// for one of no Service (no `kubernetes.io/service-name`), no namespace or name, or a label
/// of [`NOT_PROXIED`].
pub fn slice(s: &KubeSlice) -> (Option<EndpointSlice>, Vec<String>) {
    let mut problems = Vec::new();
    let labels = s.metadata.labels.as_ref();
    if NOT_PROXIED
        .iter()
        .any(|l| labels.is_some_and(|m| m.contains_key(*l)))
    {
        // kube-proxy ignores it as it ignores such a Service: as good as gone.
        return (None, problems);
    }
    let service = labels.and_then(|l| l.get(SERVICE_NAME_LABEL)).cloned();
    let (Some(namespace), Some(name), Some(service)) = (
        s.metadata.namespace.clone(),
        s.metadata.name.clone(),
        service,
    ) else {
        return (None, problems);
    };
    let address_type = match s.address_type.as_str() {
        "IPv4" => AddressType::V4,
        "IPv6" => AddressType::V6,
        _ => AddressType::Fqdn,
    };
    let mut ports = Vec::new();
    for p in s.ports.iter().flatten() {
        let name = p.name.clone().unwrap_or_default();
        let Some(protocol) = Protocol::parse(p.protocol.as_deref()) else {
            problems.push(format!("port {name:?}: protocol {:?}", p.protocol));
            continue;
        };
        ports.push(SlicePort {
            name,
            protocol,
            port: p.port.and_then(port),
        });
    }
    let endpoints = s
        .endpoints
        .iter()
        .flatten()
        .map(|e| {
            let c = e.conditions.clone().unwrap_or_default();
            let ready = c.ready.unwrap_or(true);
            let hints = e.hints.clone().unwrap_or_default();
            Endpoint {
                addresses: if address_type == AddressType::Fqdn {
                    Vec::new()
                } else {
                    addresses(&e.addresses, "endpoint", &mut problems)
                },
                ready,
                serving: c.serving.unwrap_or(ready),
                terminating: c.terminating.unwrap_or(false),
                node: e.node_name.clone(),
                zone: e.zone.clone(),
                for_zones: hints
                    .for_zones
                    .into_iter()
                    .flatten()
                    .map(|z| z.name)
                    .collect(),
                for_nodes: hints
                    .for_nodes
                    .into_iter()
                    .flatten()
                    .map(|n| n.name)
                    .collect(),
            }
        })
        .collect();
    let slice = EndpointSlice {
        name: format!("{namespace}/{name}"),
        service: ServiceKey {
            namespace,
            name: service,
        },
        address_type,
        ports,
        endpoints,
    };
    (Some(slice), problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kube_service(v: serde_json::Value) -> KubeService {
        serde_json::from_value(v).expect("a Service")
    }

    #[test]
    fn a_load_balancer_service_read_with_the_apis_meaning() {
        let s = kube_service(json!({
            "metadata": {"namespace": "shop", "name": "web"},
            "spec": {
                "type": "LoadBalancer",
                "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:96::10"],
                "ports": [
                    {"name": "http", "port": 80, "nodePort": 30080},
                    {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053},
                    {"name": "odd", "port": 70000}
                ],
                "externalIPs": ["198.51.100.7", "not-an-ip"],
                "externalTrafficPolicy": "Local",
                "internalTrafficPolicy": "Local",
                "sessionAffinity": "ClientIP",
                "trafficDistribution": "PreferClose"
            },
            "status": {"loadBalancer": {"ingress": [
                {"ip": "198.51.100.8"},
                {"ip": "198.51.100.9", "ipMode": "Proxy"},
                {"hostname": "lb.example"}
            ]}}
        }));
        let (svc, problems) = service(&s);
        let svc = svc.expect("a Service");
        assert_eq!(svc.key.to_string(), "shop/web");
        assert_eq!(svc.cluster_ips.len(), 2, "dual stack");
        assert_eq!(
            svc.ports
                .iter()
                .map(|p| (p.name.as_str(), p.protocol, p.port, p.node_port))
                .collect::<Vec<_>>(),
            [
                ("http", Protocol::Tcp, 80, Some(30080)),
                ("dns", Protocol::Udp, 53, Some(30053))
            ]
        );
        assert_eq!(
            svc.external_ips,
            ["198.51.100.7".parse::<IpAddr>().expect("ip")]
        );
        assert_eq!(
            svc.load_balancer_ips,
            ["198.51.100.8".parse::<IpAddr>().expect("ip")],
            "an ipMode Proxy ingress is the load balancer's"
        );
        assert_eq!(svc.affinity_secs, Some(10_800), "the API's default timeout");
        assert_eq!(
            (svc.external_policy, svc.internal_policy, svc.distribution),
            (
                TrafficPolicy::Local,
                TrafficPolicy::Local,
                Distribution::PreferClose
            )
        );
        assert_eq!(problems.len(), 2, "{problems:?}");
    }

    #[test]
    fn headless_external_name_and_cluster_ip_node_ports() {
        let headless = kube_service(json!({"metadata": {"namespace": "a", "name": "h"},
            "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}));
        assert!(service(&headless).0.expect("kept").headless());
        let external = kube_service(json!({"metadata": {"namespace": "a", "name": "e"},
            "spec": {"type": "ExternalName", "externalName": "db.example"}}));
        assert_eq!(service(&external).0, None);
        let cluster = kube_service(json!({"metadata": {"namespace": "a", "name": "c"},
            "spec": {"clusterIP": "10.96.0.11", "ports": [{"port": 80, "nodePort": 30001}]}}));
        let c = service(&cluster).0.expect("kept");
        assert_eq!(
            c.ports[0].node_port, None,
            "a ClusterIP Service has no NodePort"
        );
        assert_eq!(c.affinity_secs, None);
        for label in NOT_PROXIED {
            let other = kube_service(json!({"metadata": {"namespace": "a", "name": "o",
                    "labels": {label: "foo-bar"}},
                "spec": {"clusterIP": "10.96.0.12", "ports": [{"port": 80}]}}));
            assert_eq!(service(&other).0, None, "{label}: not calix's to serve");
        }
    }

    #[test]
    fn a_slice_with_its_conditions_and_hints() {
        let s: KubeSlice = serde_json::from_value(json!({
            "metadata": {"namespace": "shop", "name": "web-abc",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}, {"name": "x", "protocol": "QUIC", "port": 1}],
            "endpoints": [
                {"addresses": ["10.244.1.5"], "nodeName": "n1", "zone": "z1",
                 "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "n1"}]}},
                {"addresses": ["10.244.2.5"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                {"addresses": ["bogus"]}
            ]
        }))
        .expect("a slice");
        let (sl, problems) = slice(&s);
        let sl = sl.expect("kept");
        assert_eq!(sl.service.to_string(), "shop/web");
        assert_eq!(sl.ports.len(), 1);
        let e = &sl.endpoints;
        assert!(
            e[0].ready && e[0].serving && !e[0].terminating,
            "absent conditions"
        );
        assert_eq!(
            (e[0].for_zones.clone(), e[0].for_nodes.clone()),
            (vec!["z1".to_string()], vec!["n1".to_string()])
        );
        assert!(!e[1].ready && e[1].serving && e[1].terminating);
        assert!(e[2].addresses.is_empty());
        assert_eq!(problems.len(), 2, "{problems:?}");
        let orphan: KubeSlice = serde_json::from_value(json!({
            "metadata": {"namespace": "shop", "name": "x"}, "addressType": "IPv4"}))
        .expect("a slice");
        assert_eq!(slice(&orphan).0, None, "no Service named");
        for label in NOT_PROXIED {
            let other: KubeSlice = serde_json::from_value(json!({
                "metadata": {"namespace": "shop", "name": "web-abc",
                    "labels": {"kubernetes.io/service-name": "web", label: ""}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.244.1.5"]}]}))
            .expect("a slice");
            assert_eq!(slice(&other).0, None, "{label}: as good as gone");
        }
    }
}
