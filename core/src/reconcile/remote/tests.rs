//! The plan of routes to other nodes, pure: which route goes direct and which through VXLAN,
//! what is a problem, the route guard. (The agent's reconciler tests write the plan into an
//! in-memory kernel.)
use std::collections::BTreeMap;

use ipnet::IpNet;

use super::fixtures::{cluster_routes, ip, net, route, underlay, UPLINK};
use super::*;

/// Node 1 of a cluster: uplink eth0 on 172.31.1.0/24 and fd31:1::/64.
fn uplinks() -> Vec<Option<Uplink>> {
    vec![Some(Uplink {
        index: UPLINK,
        mtu: 1500,
        addresses: vec![net("172.31.1.1/24"), net("fd31:1::1/64")],
    })]
}

#[test]
fn the_plan_follows_the_subnets_and_the_pools_vxlan() {
    let uplinks = uplinks();
    let mut desired: BTreeMap<IpNet, RemoteRoute> = cluster_routes()
        .into_iter()
        .map(|r| (r.prefix, r))
        .collect();
    for r in [
        route("10.244.3.0/26", "n2", "172.31.1.2", VxlanMode::Always),
        route("10.244.4.0/26", "n3", "172.31.2.3", VxlanMode::Never),
        route("10.244.5.0/26", "n4", "fd31:2::4", VxlanMode::CrossSubnet),
        route("10.244.6.0/26", "n1", "172.31.1.1", VxlanMode::CrossSubnet),
    ] {
        desired.insert(r.prefix, r);
    }
    let p = plan(&desired, &underlay(), &uplinks);
    assert_eq!(
        p.routes[&net("10.244.1.0/26")],
        (ip("172.31.1.2"), Via::Uplink(UPLINK))
    );
    assert_eq!(
        p.routes[&net("10.244.2.0/26")],
        (ip("172.31.2.3"), Via::Vxlan(Family::V4))
    );
    assert_eq!(
        p.routes[&net("fd00:244::40/122")],
        (ip("fd31:2::3"), Via::Vxlan(Family::V6))
    );
    // Always: through VXLAN even on the same subnet.
    assert_eq!(
        p.routes[&net("10.244.3.0/26")],
        (ip("172.31.1.2"), Via::Vxlan(Family::V4))
    );
    // Never across subnets, a next hop of the other family, this node itself: problems.
    let problems: Vec<String> = p.problems.keys().map(ToString::to_string).collect();
    assert_eq!(
        problems,
        ["10.244.4.0/26", "10.244.5.0/26", "10.244.6.0/26"]
    );
    assert!(p.problems[&net("10.244.4.0/26")].contains("never"));
    assert!(p.problems[&net("10.244.5.0/26")].contains("family"));
    assert!(p.problems[&net("10.244.6.0/26")].contains("own address"));
    // The devices: local address from the uplink, on the uplink (the agent takes the
    // encapsulation off its MTU), the peers.
    let (v4, peers4) = &p.devices[&Family::V4];
    assert_eq!(
        (v4.local, v4.uplink_mtu, v4.vni, v4.port, v4.uplink),
        (ip("172.31.1.1"), 1500, 4096, 4789, UPLINK)
    );
    assert_eq!(
        peers4.iter().copied().collect::<Vec<_>>(),
        [ip("172.31.1.2"), ip("172.31.2.3")]
    );
    let (v6, _) = &p.devices[&Family::V6];
    assert_eq!((v6.local, v6.uplink_mtu), (ip("fd31:1::1"), 1500));

    // Configured node addresses win; without an address of the family, VXLAN is a problem.
    let mut u = underlay();
    u.node_addresses = vec![ip("172.31.1.100")];
    let p = plan(&desired, &u, &uplinks);
    assert_eq!(p.devices[&Family::V4].0.local, ip("172.31.1.100"));
    assert!(p.problems[&net("fd00:244::40/122")].contains("no address"));
    // No uplink: nothing direct, nothing through VXLAN.
    let p = plan(&desired, &Underlay::default(), &[]);
    assert!(p.routes.is_empty());
    assert!(p.devices.is_empty());
}

/// The route guard at the kernel's door: whatever it is handed, a route covering one of this
/// node's uplink addresses (here a default route and the uplink's own /24, both "via" node 2)
/// is never planned, and is reported. Before, both were planned as routes via 172.31.1.2.
#[test]
fn a_route_covering_an_uplink_address_is_never_planned() {
    let uplinks = uplinks();
    let mut desired: BTreeMap<IpNet, RemoteRoute> = BTreeMap::new();
    for r in [
        route("0.0.0.0/0", "n2", "172.31.1.2", VxlanMode::CrossSubnet),
        route("172.31.1.0/24", "n2", "172.31.1.2", VxlanMode::CrossSubnet),
        route("10.244.1.0/26", "n2", "172.31.1.2", VxlanMode::CrossSubnet),
    ] {
        desired.insert(r.prefix, r);
    }
    let p = plan(&desired, &underlay(), &uplinks);
    assert_eq!(
        p.routes.keys().map(ToString::to_string).collect::<Vec<_>>(),
        ["10.244.1.0/26"]
    );
    for bad in ["0.0.0.0/0", "172.31.1.0/24"] {
        let why = p.problems.get(&net(bad)).expect("reported");
        assert!(
            why.contains("covers_uplink_address") && why.contains("172.31.1.1"),
            "{why}"
        );
    }
}

#[test]
fn the_guard_keeps_routes_to_blocks_of_the_pools() {
    let pools = vec![Pool {
        cidr: net("10.244.0.0/16"),
        block_size: 26,
        disabled: true,
        previous_block_sizes: vec![24],
        restricted: false,
    }];
    assert_eq!(guard(&net("10.244.1.0/26"), &pools), Ok(()));
    assert_eq!(guard(&net("10.244.1.0/24"), &pools), Ok(()));
    assert_eq!(guard(&net("10.244.1.9/32"), &pools), Ok(()));
    assert_eq!(guard(&net("10.244.0.0/20"), &pools), Err(Guarded::TooShort));
    assert_eq!(guard(&net("10.244.0.0/16"), &pools), Err(Guarded::TooShort));
    assert_eq!(guard(&net("0.0.0.0/0"), &pools), Err(Guarded::OutsidePools));
    assert_eq!(
        guard(&net("10.245.0.0/26"), &pools),
        Err(Guarded::OutsidePools)
    );
    assert_eq!(
        guard(&net("fd00::/122"), &pools),
        Err(Guarded::OutsidePools)
    );
}
