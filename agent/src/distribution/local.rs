//! This node as route distribution sees it: the addresses it advertises its routes with (the
//! next hops) and the endpoint it records for its peers.
use std::net::{IpAddr, SocketAddr};

use calix_core::routes::advertise::NextHops;

use super::settings::ListenOn;

/// The next hops: `routes.node_addresses` (the first of each family); else the first global
/// address of each family on the first uplink; else the first of each family the node record
/// carries (every global address of the node).
pub fn next_hops(configured: &[IpAddr], uplink: &[IpAddr], record: &[String]) -> NextHops {
    let recorded: Vec<IpAddr> = record.iter().filter_map(|a| a.parse().ok()).collect();
    let pick = |v6: bool| {
        [configured, uplink, &recorded[..]]
            .into_iter()
            .find_map(|list| {
                list.iter()
                    .find(|a| a.is_ipv6() == v6 && is_global(a))
                    .copied()
            })
    };
    NextHops {
        v4: pick(false),
        v6: pick(true),
    }
}

/// Not loopback, link-local, unspecified or multicast.
pub fn is_global(a: &IpAddr) -> bool {
    let link_local = match a {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    };
    !(link_local || a.is_loopback() || a.is_unspecified() || a.is_multicast())
}

/// The addresses of interface `ifname` (none when it has none or does not exist).
pub fn interface_addresses(ifname: &str) -> Vec<IpAddr> {
    calix_dataplane::host_addrs::interface_addresses()
        .unwrap_or_default()
        .into_iter()
        .filter(|(n, _)| n == ifname)
        .map(|(_, a)| a)
        .collect()
}

/// The subnets of the node's own interfaces (not loopback, not pods' veths): a next hop in
/// one of them is on-link (`crossSubnet` goes direct).
pub fn subnets() -> Vec<ipnet::IpNet> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter(|a| a.interface_name != "lo" && !a.interface_name.starts_with("cali"))
        .filter_map(|a| {
            let (addr, mask) = (a.address?, a.netmask?);
            let (ip, len) = match (addr.as_sockaddr_in(), addr.as_sockaddr_in6()) {
                (Some(v4), _) => (
                    IpAddr::V4(v4.ip()),
                    mask.as_sockaddr_in()?.ip().to_bits().count_ones(),
                ),
                (None, Some(v6)) => (
                    IpAddr::V6(v6.ip()),
                    mask.as_sockaddr_in6()?.ip().to_bits().count_ones(),
                ),
                _ => return None,
            };
            is_global(&ip)
                .then(|| ipnet::IpNet::new(ip, u8::try_from(len).ok()?).ok())
                .flatten()
                .map(|n| n.trunc())
        })
        .collect()
}

/// Where peers reach this node's Routes service: the listen address when it is a specific
/// one, else this node's IPv4 next hop (IPv6 without one) with the listen port.
pub fn endpoint(listen: ListenOn, hops: &NextHops) -> Option<String> {
    if let ListenOn::Address(sa) = listen {
        if !sa.ip().is_unspecified() {
            return Some(sa.to_string());
        }
    }
    let ip = hops.v4.or(hops.v6)?;
    Some(SocketAddr::new(ip, listen.port()).to_string())
}

/// What the Routes service binds: this node's next hops (one per family) with the port, or
/// the one address `listen` names.
pub fn bind_addresses(listen: ListenOn, hops: &NextHops) -> Vec<SocketAddr> {
    match listen {
        ListenOn::NodeAddresses { port } => {
            hops.all().map(|ip| SocketAddr::new(ip, port)).collect()
        }
        ListenOn::Address(sa) => vec![sa],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ips(v: &[&str]) -> Vec<IpAddr> {
        v.iter().map(|a| a.parse().expect("ip")).collect()
    }

    #[test]
    fn configured_then_uplink_then_record() {
        let mut configured = Vec::new();
        let uplink = ips(&["fe80::1", "172.31.1.1", "fd31:1::1", "172.31.1.50"]);
        let record = vec!["10.0.0.1".to_string(), "2001:db8::1".to_string()];
        let h = next_hops(&configured, &uplink, &record);
        assert_eq!(h.v4, Some("172.31.1.1".parse().expect("ip")));
        assert_eq!(
            h.v6,
            Some("fd31:1::1".parse().expect("ip")),
            "not the link-local"
        );
        configured = ips(&["192.0.2.7"]);
        let h = next_hops(&configured, &uplink, &record);
        assert_eq!(h.v4, Some("192.0.2.7".parse().expect("ip")));
        assert_eq!(
            h.v6,
            Some("fd31:1::1".parse().expect("ip")),
            "the other family from the uplink"
        );
        let h = next_hops(&[], &[], &record);
        assert_eq!(h.v6, Some("2001:db8::1".parse().expect("ip")));
        assert_eq!(next_hops(&[], &[], &[]), NextHops::default());
    }

    fn on(listen: &str) -> ListenOn {
        ListenOn::parse(listen).expect("valid listen")
    }

    #[test]
    fn the_endpoint_peers_dial() {
        let h = NextHops {
            v4: Some("172.31.1.1".parse().expect("ip")),
            v6: Some("fd31:1::1".parse().expect("ip")),
        };
        assert_eq!(
            endpoint(on(":5474"), &h).as_deref(),
            Some("172.31.1.1:5474")
        );
        assert_eq!(
            endpoint(on("0.0.0.0:5474"), &h).as_deref(),
            Some("172.31.1.1:5474")
        );
        assert_eq!(
            endpoint(on("[::]:5474"), &h).as_deref(),
            Some("172.31.1.1:5474")
        );
        assert_eq!(
            endpoint(on("192.0.2.3:6000"), &h).as_deref(),
            Some("192.0.2.3:6000")
        );
        let v6 = NextHops { v4: None, ..h };
        assert_eq!(
            endpoint(on(":5474"), &v6).as_deref(),
            Some("[fd31:1::1]:5474")
        );
        assert_eq!(endpoint(on(":5474"), &NextHops::default()), None);
    }

    #[test]
    fn the_door_binds_the_next_hops_unless_told_otherwise() {
        let h = NextHops {
            v4: Some("172.31.1.1".parse().expect("ip")),
            v6: Some("fd31:1::1".parse().expect("ip")),
        };
        let addrs = |v: &[&str]| -> Vec<SocketAddr> {
            v.iter().map(|a| a.parse().expect("addr")).collect()
        };
        assert_eq!(
            bind_addresses(on(":5474"), &h),
            addrs(&["172.31.1.1:5474", "[fd31:1::1]:5474"]),
            "both families"
        );
        let v4 = NextHops { v6: None, ..h };
        assert_eq!(
            bind_addresses(on(":6000"), &v4),
            addrs(&["172.31.1.1:6000"])
        );
        assert_eq!(
            bind_addresses(on("0.0.0.0:5474"), &h),
            addrs(&["0.0.0.0:5474"]),
            "an explicit address is kept"
        );
        assert!(bind_addresses(on(":5474"), &NextHops::default()).is_empty());
    }
}
