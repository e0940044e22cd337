//! The bench's Services and EndpointSlices, and where their addresses come from: every cluster
//! IP is given (none left to the API server's allocator, so none collides with another), the
//! fillers' endpoints are addresses no pod has (nothing answers them; nobody connects).
use std::net::Ipv4Addr;

use serde_json::{json, Value};

/// The API server's Service range is 10.96.0.0/16 (the test bed's); `kubernetes` holds
/// 10.96.0.1. Fillers from 10.96.1.1 up, 250 a /24.
const FILLERS_PER_OCTET: usize = 250;
/// The third octet of the probe Services (one per variant: .1, .2, .3).
const PROBE_OCTET: u8 = 100;
/// The third octet of the change-latency Services of stage `s`: 120 + s.
const LATENCY_OCTET: u8 = 120;
/// At most this many latency changes a stage (3 Services each, in one /24).
pub const MAX_CHANGES: usize = 80;

/// Filler `i`'s cluster IP.
pub fn filler_ip(i: usize) -> Ipv4Addr {
    let o = 1 + i / FILLERS_PER_OCTET;
    Ipv4Addr::new(10, 96, o as u8, (1 + i % FILLERS_PER_OCTET) as u8)
}

/// Filler `i`'s two endpoints: in 10.240.0.0/16, a pair per service.
pub fn filler_endpoints(i: usize) -> [Ipv4Addr; 2] {
    let at = |k: usize| Ipv4Addr::new(10, 240, (k / 256) as u8, (k % 256) as u8);
    [at(2 * i + 2), at(2 * i + 3)]
}

/// Variant `lane`'s probe Service's cluster IP (`lane` from 0).
pub fn probe_ip(lane: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, PROBE_OCTET, lane as u8 + 1)
}

/// The cluster IP of variant `lane`'s Service of change `change` in stage `stage`.
pub fn latency_ip(stage: usize, change: usize, lane: usize) -> Ipv4Addr {
    Ipv4Addr::new(
        10,
        96,
        LATENCY_OCTET + stage as u8,
        (change * 3 + lane + 1) as u8,
    )
}

/// The most fillers there can be.
pub fn max_fillers() -> usize {
    FILLERS_PER_OCTET * (PROBE_OCTET as usize - 1)
}

/// Service `name` in `namespace` at `ip`, TCP `port`, no selector (its EndpointSlice is
/// written by hand: no controller-manager runs here).
pub fn service(namespace: &str, name: &str, ip: Ipv4Addr, port: u16) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip.to_string(),
            "ports": [{"name": "p", "protocol": "TCP", "port": port, "targetPort": port}],
        },
    })
}

/// Service `name`'s EndpointSlice: `endpoints`, ready, on `port`.
pub fn slice(namespace: &str, name: &str, endpoints: &[Ipv4Addr], port: u16) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{name}-1"), "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "calix-bench",
            },
        },
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": [{"name": "p", "protocol": "TCP", "port": port}],
    })
}

/// Fillers `from..to` (Service and EndpointSlice each, no status), port 80.
pub fn fillers(namespace: &str, from: usize, to: usize) -> Vec<(Value, Value)> {
    (from..to)
        .flat_map(|i| {
            let name = format!("f{i}");
            [
                service(namespace, &name, filler_ip(i), 80),
                slice(namespace, &name, &filler_endpoints(i), 80),
            ]
        })
        .map(|o| (o, Value::Null))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn addresses_never_collide() {
        let mut ips = HashSet::new();
        for i in 0..max_fillers() {
            assert!(ips.insert(filler_ip(i)), "filler {i}");
        }
        for lane in 0..3 {
            assert!(ips.insert(probe_ip(lane)));
            for stage in 0..3 {
                for change in 0..MAX_CHANGES {
                    assert!(ips.insert(latency_ip(stage, change, lane)));
                }
            }
        }
        assert!(!ips.contains(&Ipv4Addr::new(10, 96, 0, 1)), "kubernetes'");
        assert!(max_fillers() >= 10_000);
        let eps: HashSet<_> = (0..10_000).flat_map(filler_endpoints).collect();
        assert_eq!(eps.len(), 20_000);
        assert!(eps.iter().all(|a| a.octets()[..2] == [10, 240]));
    }

    #[test]
    fn a_slice_names_its_service() {
        let s = slice("ns", "f7", &filler_endpoints(7), 80);
        assert_eq!(s["metadata"]["labels"]["kubernetes.io/service-name"], "f7");
        assert_eq!(s["endpoints"].as_array().map(Vec::len), Some(2));
        let f = fillers("ns", 3, 5);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0].0["spec"]["clusterIP"], filler_ip(3).to_string());
    }
}
