//! A Service's frontends, and the addresses it may not have (CVE-2020-8554: with kube-proxy,
//! whoever may create a Service captures any address's traffic through `externalIPs` or a
//! LoadBalancer status). calix programs an external or LoadBalancer address only inside the
//! CIDRs the operator allows (none by default), and never a node's own address, an address
//! inside the pools, or a loopback, link-local, multicast or unspecified one, whatever the
//! CIDRs say; a cluster IP neither (the API server assigns those from the Service range, but
//! an API server with another range, or a stored object, must not capture either). Each
//! refusal is said, for an Event on the Service and a metric.
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::model::{Protocol, Service};

/// What a frontend address is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    ClusterIp,
    /// Every node address of the family, on the port's `nodePort`.
    NodePort,
    External,
    LoadBalancer,
}

/// One address and port a Service answers on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frontend {
    pub kind: Kind,
    /// `None` for a NodePort (the nodes' addresses).
    pub address: Option<IpAddr>,
    pub protocol: Protocol,
    pub port: u16,
    /// The Service port it is (its backends are that port's).
    pub port_name: String,
}

/// What the operator allows and what is never a Service's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    /// Where external and LoadBalancer addresses may be (`services.external_cidrs`).
    pub external_cidrs: Vec<IpNet>,
    /// Every node's own addresses.
    pub node_addresses: Vec<IpAddr>,
    /// The pools' CIDRs.
    pub pools: Vec<IpNet>,
}

/// An address a Service names that is not programmed, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub kind: Kind,
    pub address: IpAddr,
    pub why: String,
}

impl Admission {
    /// Why `a` may not be a frontend of `kind`; `None`: it may.
    pub fn refuses(&self, kind: Kind, a: &IpAddr) -> Option<String> {
        if a.is_loopback() || a.is_unspecified() || a.is_multicast() || link_local(a) {
            return Some("a loopback, unspecified, multicast or link-local address".into());
        }
        if self.node_addresses.contains(a) {
            return Some("a node's own address".into());
        }
        if let Some(p) = self.pools.iter().find(|p| p.contains(a)) {
            return Some(format!("inside the pool {p}"));
        }
        if matches!(kind, Kind::External | Kind::LoadBalancer)
            && !self.external_cidrs.iter().any(|c| c.contains(a))
        {
            return Some(if self.external_cidrs.is_empty() {
                "external and LoadBalancer addresses are allowed nowhere (services.external_cidrs is empty)".into()
            } else {
                "outside services.external_cidrs".into()
            });
        }
        None
    }
}

fn link_local(a: &IpAddr) -> bool {
    match a {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// `service`'s frontends, those of its addresses `rules` admit, and the refused ones. A
/// headless Service has none.
pub fn frontends(service: &Service, rules: &Admission) -> (Vec<Frontend>, Vec<Refusal>) {
    let mut out = Vec::new();
    let mut refused = Vec::new();
    if service.headless() {
        return (out, refused);
    }
    let addressed = service
        .cluster_ips
        .iter()
        .map(|a| (Kind::ClusterIp, a))
        .chain(service.external_ips.iter().map(|a| (Kind::External, a)))
        .chain(
            service
                .load_balancer_ips
                .iter()
                .map(|a| (Kind::LoadBalancer, a)),
        );
    for (kind, a) in addressed {
        if let Some(why) = rules.refuses(kind, a) {
            if !refused
                .iter()
                .any(|r: &Refusal| r.address == *a && r.kind == kind)
            {
                refused.push(Refusal {
                    kind,
                    address: *a,
                    why,
                });
            }
            continue;
        }
        for p in &service.ports {
            let f = Frontend {
                kind,
                address: Some(*a),
                protocol: p.protocol,
                port: p.port,
                port_name: p.name.clone(),
            };
            if !out.contains(&f) {
                out.push(f);
            }
        }
    }
    for p in &service.ports {
        if let Some(np) = p.node_port.filter(|n| *n != 0) {
            out.push(Frontend {
                kind: Kind::NodePort,
                address: None,
                protocol: p.protocol,
                port: np,
                port_name: p.name.clone(),
            });
        }
    }
    (out, refused)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::fixtures::service;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn rules(external: &[&str]) -> Admission {
        Admission {
            external_cidrs: external.iter().map(|c| c.parse().expect("cidr")).collect(),
            node_addresses: vec![ip("172.31.1.1"), ip("fd31:1::1")],
            pools: vec!["10.244.0.0/16".parse().expect("pool")],
        }
    }

    #[test]
    fn external_addresses_only_where_the_operator_allows() {
        let mut svc = service("web", &[("http", 80)]);
        svc.external_ips = vec![ip("198.51.100.7"), ip("203.0.113.9")];
        svc.load_balancer_ips = vec![ip("198.51.100.8")];
        let (f, refused) = frontends(&svc, &rules(&[]));
        assert_eq!(
            f.iter().map(|f| f.kind).collect::<Vec<_>>(),
            [Kind::ClusterIp],
            "nothing external by default"
        );
        assert_eq!(refused.len(), 3, "{refused:?}");
        assert!(refused[0].why.contains("allowed nowhere"), "{refused:?}");
        let (f, refused) = frontends(&svc, &rules(&["198.51.100.0/24"]));
        let kinds: Vec<(Kind, String)> = f
            .iter()
            .map(|f| (f.kind, f.address.map(|a| a.to_string()).unwrap_or_default()))
            .collect();
        assert_eq!(
            kinds,
            [
                (Kind::ClusterIp, "10.96.0.10".into()),
                (Kind::External, "198.51.100.7".into()),
                (Kind::LoadBalancer, "198.51.100.8".into()),
            ]
        );
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].address, ip("203.0.113.9"));
        assert!(refused[0].why.contains("outside"), "{refused:?}");
    }

    #[test]
    fn never_a_nodes_a_pods_or_a_special_address_whatever_the_cidrs() {
        let mut svc = service("web", &[("http", 80)]);
        svc.external_ips = vec![
            ip("172.31.1.1"),
            ip("10.244.3.4"),
            ip("127.0.0.1"),
            ip("169.254.169.254"),
            ip("fe80::1"),
            ip("224.0.0.1"),
        ];
        svc.cluster_ips.push(ip("10.244.0.9"));
        let (f, refused) = frontends(&svc, &rules(&["0.0.0.0/0", "::/0"]));
        assert_eq!(f.len(), 1, "only the real cluster IP: {f:?}");
        assert_eq!(refused.len(), 7, "{refused:?}");
        assert!(refused[0].why.contains("pool"), "{refused:?}");
        assert!(refused[1].why.contains("node's own"), "{refused:?}");
    }

    #[test]
    fn node_ports_and_headless() {
        let mut svc = service("web", &[("http", 80), ("dns", 53)]);
        svc.ports[0].node_port = Some(30080);
        let (f, _) = frontends(&svc, &rules(&[]));
        assert_eq!(f.len(), 3);
        assert_eq!(
            (f[2].kind, f[2].port, f[2].address),
            (Kind::NodePort, 30080, None)
        );
        svc.cluster_ips.clear();
        assert_eq!(frontends(&svc, &rules(&[])).0, [], "headless: left alone");
    }
}
