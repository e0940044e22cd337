//! Health check node ports: a LoadBalancer Service with `externalTrafficPolicy: Local` gets a
//! `healthCheckNodePort`, where the proxy of every node answers an HTTP GET with whether this
//! node has endpoints of it, so that the load balancer sends only to nodes that do
//! (kube-proxy's contract, which cloud load balancers and the upstream suite rely on):
//! - 200 with at least one local ready endpoint, else 503 (terminating ones do not count: a
//!   node whose last pods are going away must be taken out of the balancer's set);
//! - the body: `{"service":{"namespace":…,"name":…},"localEndpoints":N,"serviceProxyHealthy":…}`;
//! - also 503 while the proxy is not healthy (its first listing of the cluster not in yet).
use std::collections::BTreeSet;
use std::net::IpAddr;

use serde::Serialize;

use super::choose::Here;
use super::model::ServiceKey;
use super::slices::Backend;

/// One Service's health check node port and what this node has of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HealthCheck {
    pub service: ServiceKey,
    pub port: u16,
    /// This node's ready endpoints: distinct addresses, of the family with more of them (a
    /// dual-stack endpoint counts once).
    pub local_endpoints: usize,
}

/// How many ready endpoints among `backends` are on this node.
pub fn local_endpoints(backends: &[Backend], here: &Here) -> usize {
    let local: BTreeSet<IpAddr> = backends
        .iter()
        .filter(|b| b.ready && b.node.as_deref() == Some(here.node.as_str()))
        .map(|b| b.address)
        .collect();
    let v4 = local.iter().filter(|a| a.is_ipv4()).count();
    v4.max(local.len() - v4)
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Body<'a> {
    service: &'a ServiceKey,
    local_endpoints: usize,
    service_proxy_healthy: bool,
}

/// The HTTP status and JSON body the port answers with; `proxy_healthy`: the proxy has the
/// cluster's state (else 503 whatever the count).
pub fn answer(check: &HealthCheck, proxy_healthy: bool) -> (u16, String) {
    let body = Body {
        service: &check.service,
        local_endpoints: check.local_endpoints,
        service_proxy_healthy: proxy_healthy,
    };
    let status = if proxy_healthy && check.local_endpoints > 0 {
        200
    } else {
        503
    };
    // A struct of a string pair and two scalars always serializes.
    let json = serde_json::to_string(&body).unwrap_or_default();
    (status, json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::fixtures::{endpoint, here, service, slice};
    use crate::services::model::AddressType;
    use crate::services::slices::backends;

    #[test]
    fn only_this_nodes_ready_endpoints_count() {
        let svc = service("lb", &[("http", 80), ("https", 443)]);
        let mut far = endpoint(&["10.244.2.5"], true);
        far.node = Some("n2".into());
        let mut going = endpoint(&["10.244.1.7"], false);
        going.serving = true;
        going.terminating = true;
        let s = slice(
            "lb-1",
            &svc,
            AddressType::V4,
            &[("http", Some(8080)), ("https", Some(8443))],
            vec![endpoint(&["10.244.1.5"], true), far, going],
        );
        let (b, _) = backends(&svc, &[s]);
        assert_eq!(
            local_endpoints(&b, &here()),
            1,
            "one local ready endpoint, whatever its ports; not the far one nor the terminating one"
        );
    }

    #[test]
    fn a_dual_stack_endpoint_counts_once() {
        let svc = service("lb", &[("http", 80)]);
        let v4 = slice(
            "lb-4",
            &svc,
            AddressType::V4,
            &[("http", Some(8080))],
            vec![
                endpoint(&["10.244.1.5"], true),
                endpoint(&["10.244.1.6"], true),
            ],
        );
        let v6 = slice(
            "lb-6",
            &svc,
            AddressType::V6,
            &[("http", Some(8080))],
            vec![endpoint(&["fd00::5"], true), endpoint(&["fd00::6"], true)],
        );
        let (b, _) = backends(&svc, &[v4, v6]);
        assert_eq!(local_endpoints(&b, &here()), 2);
    }

    #[test]
    fn the_answer_is_kube_proxys() {
        let mut check = HealthCheck {
            service: service("lb", &[]).key,
            port: 32000,
            local_endpoints: 2,
        };
        let (status, body) = answer(&check, true);
        assert_eq!(status, 200);
        assert_eq!(
            body,
            r#"{"service":{"namespace":"default","name":"lb"},"localEndpoints":2,"serviceProxyHealthy":true}"#
        );
        assert_eq!(answer(&check, false).0, 503, "an unhealthy proxy says so");
        check.local_endpoints = 0;
        let (status, body) = answer(&check, true);
        assert_eq!(status, 503);
        assert!(body.contains(r#""localEndpoints":0"#), "{body}");
    }
}
