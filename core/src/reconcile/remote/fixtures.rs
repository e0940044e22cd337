//! The remote-route fixtures that the plan's tests (here) and the agent's reconciler tests
//! share: node 1 of a cluster (uplink eth0 on 172.31.1.0/24 and fd31:1::/64), nodes 2 and 3
//! on the same subnet and the other, their blocks. Built with `cfg(test)` or the `fixtures`
//! feature (the agent's dev-dependency), never into a release.
use std::net::IpAddr;

use ipnet::IpNet;

use super::{RemoteRoute, Underlay};
use crate::ipam::pool::VxlanMode;

/// The uplink's interface index.
pub const UPLINK: u32 = 2;

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

pub fn net(s: &str) -> IpNet {
    s.parse().expect("net")
}

pub fn route(prefix: &str, node: &str, next_hop: &str, vxlan: VxlanMode) -> RemoteRoute {
    RemoteRoute {
        prefix: net(prefix),
        node: node.into(),
        next_hop: ip(next_hop),
        vxlan,
    }
}

/// Node 1's underlay: its uplink eth0.
pub fn underlay() -> Underlay {
    Underlay {
        uplinks: vec!["eth0".into()],
        ..Underlay::default()
    }
}

/// Node 2 on the same subnet, node 3 on the other; IPv4 and IPv6 blocks.
pub fn cluster_routes() -> Vec<RemoteRoute> {
    vec![
        route("10.244.1.0/26", "n2", "172.31.1.2", VxlanMode::CrossSubnet),
        route("10.244.2.0/26", "n3", "172.31.2.3", VxlanMode::CrossSubnet),
        route(
            "fd00:244::40/122",
            "n3",
            "fd31:2::3",
            VxlanMode::CrossSubnet,
        ),
    ]
}
