//! A Service's EndpointSlices, read together into its backends, each bad part skipped and
//! said: a slice of another address type than its addresses, a port that matches none of the
//! Service's (by name and protocol) or has no number, an endpoint listed twice (the first one
//! stays), FQDN slices (names, not addresses). One bad slice or endpoint never stops the rest.
use std::collections::BTreeSet;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::model::{AddressType, EndpointSlice, Protocol, Service};

/// One backend of one Service port: an address, the port to reach it on, and what the slices
/// say of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backend {
    /// The Service port's name it serves.
    pub port_name: String,
    pub protocol: Protocol,
    pub address: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node: Option<String>,
    pub zone: Option<String>,
    pub for_zones: Vec<String>,
    pub for_nodes: Vec<String>,
}

/// Something of a slice that was skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceProblem {
    pub slice: String,
    pub what: String,
}

/// The backends `slices` give `service` (those of other Services are ignored), in the slices'
/// order, and what was skipped.
pub fn backends(service: &Service, slices: &[EndpointSlice]) -> (Vec<Backend>, Vec<SliceProblem>) {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    let mut seen: BTreeSet<(String, Protocol, IpAddr, u16)> = BTreeSet::new();
    for slice in slices.iter().filter(|s| s.service == service.key) {
        let mut problem = |what: String| {
            problems.push(SliceProblem {
                slice: slice.name.clone(),
                what,
            })
        };
        if slice.address_type == AddressType::Fqdn {
            problem("an FQDN slice: names are not programmed".into());
            continue;
        }
        let mut ports = Vec::new();
        for p in &slice.ports {
            let Some(number) = p.port.filter(|n| *n != 0) else {
                problem(format!("port {:?} has no number", p.name));
                continue;
            };
            if !service
                .ports
                .iter()
                .any(|sp| sp.name == p.name && sp.protocol == p.protocol)
            {
                problem(format!(
                    "port {:?} ({:?}) matches no port of the Service",
                    p.name, p.protocol
                ));
                continue;
            }
            ports.push((p, number));
        }
        for e in &slice.endpoints {
            for a in &e.addresses {
                if !slice.address_type.holds(a) {
                    problem(format!(
                        "{a} in a slice of address type {:?}",
                        slice.address_type
                    ));
                    continue;
                }
                for (p, number) in &ports {
                    let key = (p.name.clone(), p.protocol, *a, *number);
                    if !seen.insert(key) {
                        problem(format!(
                            "{a} port {number} ({:?}) listed twice: the first stays",
                            p.name
                        ));
                        continue;
                    }
                    out.push(Backend {
                        port_name: p.name.clone(),
                        protocol: p.protocol,
                        address: *a,
                        port: *number,
                        ready: e.ready,
                        serving: e.serving,
                        terminating: e.terminating,
                        node: e.node.clone(),
                        zone: e.zone.clone(),
                        for_zones: e.for_zones.clone(),
                        for_nodes: e.for_nodes.clone(),
                    });
                }
            }
        }
    }
    (out, problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::fixtures::{endpoint, service, slice};

    #[test]
    fn every_port_of_every_endpoint_is_a_backend() {
        let svc = service("web", &[("http", 80), ("metrics", 9090)]);
        let s = slice(
            "web-1",
            &svc,
            AddressType::V4,
            &[("http", Some(8080)), ("metrics", Some(9100))],
            vec![
                endpoint(&["10.244.1.5"], true),
                endpoint(&["10.244.2.7"], false),
            ],
        );
        let (b, problems) = backends(&svc, &[s]);
        assert!(problems.is_empty(), "{problems:?}");
        let got: Vec<(String, String, u16, bool)> = b
            .iter()
            .map(|b| (b.port_name.clone(), b.address.to_string(), b.port, b.ready))
            .collect();
        assert_eq!(
            got,
            [
                ("http".into(), "10.244.1.5".into(), 8080, true),
                ("metrics".into(), "10.244.1.5".into(), 9100, true),
                ("http".into(), "10.244.2.7".into(), 8080, false),
                ("metrics".into(), "10.244.2.7".into(), 9100, false),
            ]
        );
    }

    #[test]
    fn bad_parts_are_skipped_and_said_and_the_rest_kept() {
        let svc = service("web", &[("http", 80)]);
        let good = slice(
            "web-1",
            &svc,
            AddressType::V4,
            &[("http", Some(8080)), ("nope", Some(1)), ("http-none", None)],
            vec![
                endpoint(&["10.244.1.5"], true),
                endpoint(&["fd00::5"], true),
                endpoint(&["10.244.1.5"], true),
            ],
        );
        let fqdn = slice(
            "web-2",
            &svc,
            AddressType::Fqdn,
            &[("http", Some(8080))],
            vec![],
        );
        let other = slice(
            "other-1",
            &service("other", &[("http", 80)]),
            AddressType::V4,
            &[("http", Some(8080))],
            vec![endpoint(&["10.244.9.9"], true)],
        );
        let (b, problems) = backends(&svc, &[good, fqdn, other]);
        assert_eq!(b.len(), 1, "{b:?}");
        assert_eq!(b[0].address.to_string(), "10.244.1.5");
        let said: Vec<&str> = problems.iter().map(|p| p.what.as_str()).collect();
        assert_eq!(said.len(), 5, "{said:?}");
        for (i, want) in [
            "matches no port",
            "has no number",
            "fd00::5 in a slice of address type V4",
            "listed twice",
            "FQDN",
        ]
        .iter()
        .enumerate()
        {
            assert!(said[i].contains(want), "{i}: {said:?}");
        }
    }
}
