//! Routes to other nodes against the in-memory kernel: desired → plan → writes, stale removal
//! only with a complete set, the VXLAN devices and their entries, no writes when nothing
//! drifted, failures retried.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calix_core::ipam::pool::VxlanMode;
use calix_core::reconcile::remote::fixtures::{cluster_routes, ip, net, route, underlay, UPLINK};
use calix_core::reconcile::remote::{Family, VxlanDevice};
use calix_kernel::host::FakeHost;
use calix_kernel::node_route::NodeRoute;
use calix_kernel::pod::HostRoute;
use calix_kernel::vxlan::{vtep_mac, FdbEntry, DEVICE_V4, DEVICE_V6};

use super::remote::device_spec;
use super::tests::{kinds, reconciler, wired, Seen};
use super::{Reconciler, ROUTES};
use calix_dataplane::Drift;

/// Node 1 of a cluster: uplink eth0 on 172.31.1.0/24 and fd31:1::/64.
fn node() -> FakeHost {
    let mut k = wired();
    k.add_uplink("eth0", UPLINK, 1500, &["172.31.1.1/24", "fd31:1::1/64"]);
    k
}

fn routed(k: FakeHost) -> (Reconciler<FakeHost>, Arc<Mutex<Seen>>) {
    let (r, seen) = reconciler(k);
    (r.with_underlay(underlay()), seen)
}

fn index(r: &Reconciler<FakeHost>, name: &str) -> u32 {
    r.kernel.vxlans[name].index
}

#[test]
fn routes_devices_and_entries_are_programmed_at_once_then_left_alone() {
    let (mut r, _) = routed(node());
    r.set_remote_routes(cluster_routes(), true);
    assert_eq!(r.routes_error(), None);
    let (v4, v6) = (index(&r, DEVICE_V4), index(&r, DEVICE_V6));
    let routes: Vec<NodeRoute> = r.kernel.node_routes.iter().copied().collect();
    assert_eq!(
        routes,
        [
            NodeRoute {
                dst: net("10.244.1.0/26"),
                gateway: ip("172.31.1.2"),
                oif: UPLINK,
                onlink: false
            },
            NodeRoute {
                dst: net("10.244.2.0/26"),
                gateway: ip("172.31.2.3"),
                oif: v4,
                onlink: true
            },
            NodeRoute {
                dst: net("fd00:244::40/122"),
                gateway: ip("fd31:2::3"),
                oif: v6,
                onlink: true
            },
        ]
    );
    let dev = &r.kernel.vxlans[DEVICE_V4];
    assert_eq!(dev.mtu, Some(1450));
    assert_eq!(dev.mac, Some(vtep_mac(ip("172.31.1.1"))));
    assert_eq!(
        r.kernel.fdb[&v4].iter().copied().collect::<Vec<_>>(),
        [FdbEntry::of_peer(ip("172.31.2.3"))]
    );
    assert_eq!(
        r.kernel.neighbours[&v4],
        BTreeMap::from([(ip("172.31.2.3"), vtep_mac(ip("172.31.2.3")))])
    );
    assert_eq!(
        r.kernel.neighbours[&v6],
        BTreeMap::from([(ip("fd31:2::3"), vtep_mac(ip("fd31:2::3")))])
    );
    // Programming is not repairing.
    assert!(r.repairs().is_empty(), "{:?}", r.repairs());
    // The pod's host route is untouched.
    assert_eq!(r.kernel.routes.len(), 1);
    // Idle: ten passes, reads only.
    let writes = r.kernel.writes.len();
    let now = Instant::now();
    for i in 0..10 {
        let pass = r.resync(now + Duration::from_secs(30 * i));
        assert!(pass.repairs.is_empty(), "{pass:?}");
    }
    assert_eq!(r.kernel.writes[writes..], [] as [String; 0]);
}

#[test]
fn nothing_is_removed_until_the_set_is_complete() {
    // What an earlier agent left: a route to a node that is gone, and its VXLAN device.
    let (mut r, _) = routed(node());
    r.set_remote_routes(
        vec![route(
            "10.244.9.0/26",
            "gone",
            "172.31.2.9",
            VxlanMode::CrossSubnet,
        )],
        true,
    );
    let gone = *r.kernel.node_routes.iter().next().expect("a route");
    // A restarted agent re-learning: the route to node 2 is added, nothing removed.
    let (mut r, _) = routed(r.kernel.clone());
    r.set_remote_routes(
        vec![route(
            "10.244.1.0/26",
            "n2",
            "172.31.1.2",
            VxlanMode::CrossSubnet,
        )],
        false,
    );
    assert!(r.kernel.node_routes.contains(&gone));
    assert!(r.kernel.vxlans.contains_key(DEVICE_V4));
    assert_eq!(r.kernel.node_routes.len(), 2);
    r.resync(Instant::now());
    assert!(
        r.kernel.node_routes.contains(&gone),
        "not by a resync either"
    );
    // Complete: the stale route goes, and the device no route needs with it.
    r.set_remote_routes(
        vec![route(
            "10.244.1.0/26",
            "n2",
            "172.31.1.2",
            VxlanMode::CrossSubnet,
        )],
        true,
    );
    assert!(!r.kernel.node_routes.contains(&gone));
    assert!(!r.kernel.vxlans.contains_key(DEVICE_V4));
    assert_eq!(r.kernel.node_routes.len(), 1);
    // The pod's host route (calix's protocol too) is never a stale route to a node.
    assert_eq!(
        r.kernel.routes.iter().copied().collect::<Vec<_>>(),
        HostRoute::of_pod(7, Some("10.244.0.5".parse().expect("v4")), None)
    );
}

#[test]
fn drift_is_repaired_and_counted_by_kind() {
    let (mut r, _) = routed(node());
    r.set_remote_routes(cluster_routes(), true);
    let v4 = index(&r, DEVICE_V4);
    // A route deleted by hand, an FDB entry and a neighbour flushed, the MTU changed.
    let direct = *r
        .kernel
        .node_routes
        .iter()
        .find(|n| n.oif == UPLINK)
        .expect("direct");
    r.kernel.node_routes.remove(&direct);
    r.kernel.fdb.get_mut(&v4).expect("fdb").clear();
    r.kernel.neighbours.get_mut(&v4).expect("neigh").clear();
    r.kernel.vxlans.get_mut(DEVICE_V4).expect("dev").mtu = Some(1500);
    let pass = r.resync(Instant::now());
    let mut got = kinds(&pass);
    got.sort();
    assert_eq!(
        got,
        ["node_route", "vxlan_device", "vxlan_fdb", "vxlan_neigh"]
    );
    assert!(pass.repairs.iter().all(|(k, _)| k == ROUTES));
    assert!(r.kernel.node_routes.contains(&direct));
    assert_eq!(r.kernel.vxlans[DEVICE_V4].mtu, Some(1450));
    assert_eq!(r.repairs()["node_route"], 1);
    // A device with the wrong VNI is made again, with its routes and entries.
    r.kernel
        .vxlans
        .get_mut(DEVICE_V4)
        .expect("dev")
        .vxlan
        .as_mut()
        .expect("vxlan")
        .vni = Some(1);
    let pass = r.resync(Instant::now());
    assert!(pass
        .repairs
        .iter()
        .any(|(_, r)| r.kind == "vxlan_device" && r.what.contains("VNI")));
    let v4 = index(&r, DEVICE_V4);
    assert!(r.kernel.node_routes.iter().any(|n| n.oif == v4));
    assert_eq!(r.kernel.fdb[&v4].len(), 1);
    // Repaired: nothing more to do.
    assert!(r.resync(Instant::now()).repairs.is_empty());
}

#[test]
fn a_changed_next_hop_or_path_is_replaced_in_one_step() {
    let (mut r, _) = routed(node());
    r.set_remote_routes(cluster_routes(), true);
    let writes = r.kernel.writes.len();
    // Node 3 moves onto this node's subnet: its IPv4 block goes direct, the IPv4 device goes.
    let mut moved = cluster_routes();
    moved[1].next_hop = ip("172.31.1.3");
    r.set_remote_routes(moved, true);
    let new = &r.kernel.writes[writes..];
    assert!(
        new.iter()
            .any(|w| w == "route replace 10.244.2.0/26 via 172.31.1.3 dev 2"),
        "{new:?}"
    );
    assert!(!new.iter().any(|w| w.starts_with("route del")), "{new:?}");
    assert!(new.iter().any(|w| w == "link del vxlan.calix"), "{new:?}");
    assert!(r.kernel.vxlans.contains_key(DEVICE_V6));
}

#[test]
fn failures_are_retried_with_backoff() {
    let mut k = node();
    k.fail.push("create_vxlan");
    let (mut r, _) = routed(k);
    r.set_remote_routes(cluster_routes(), true);
    assert!(r.routes_error().is_some_and(|e| e.contains("creating")));
    let t0 = Instant::now();
    let due = r.next_retry().expect("a retry is scheduled");
    assert!(r.retry_due(t0 - Duration::from_secs(1)).repairs.is_empty());
    // Due: applied, as programming (not repairs).
    let pass = r.retry_due(due);
    assert!(pass.repairs.is_empty(), "{pass:?}");
    assert_eq!(r.routes_error(), None);
    assert_eq!(r.next_retry(), None);
    assert_eq!(r.kernel.node_routes.len(), 3);
    // A route somebody else holds (not calix's) is left alone; the others go in.
    let mut k = node();
    k.routes.insert(HostRoute {
        dst: net("10.244.1.0/26"),
        oif: 7,
    });
    let (mut r, _) = routed(k);
    r.set_remote_routes(cluster_routes(), true);
    assert!(r
        .routes_error()
        .is_some_and(|e| e.contains("another route")));
    assert_eq!(r.kernel.node_routes.len(), 2);
    assert!(r.next_retry().is_some());
}

#[test]
fn vxlan_devices_get_the_host_device_programs() {
    let (mut r, seen) = routed(node());
    seen.lock().expect("lock").host_dev_drift.insert(
        DEVICE_V4.into(),
        vec![Drift::Filter {
            ingress: true,
            found: None,
        }],
    );
    r.set_remote_routes(cluster_routes(), true);
    assert_eq!(seen.lock().expect("lock").host_dev_attached, [DEVICE_V4]);
    // Later drift on the uplink or a device is a repair.
    seen.lock().expect("lock").host_dev_drift.insert(
        "eth0".into(),
        vec![Drift::Filter {
            ingress: false,
            found: Some(99),
        }],
    );
    let pass = r.resync(Instant::now());
    assert_eq!(kinds(&pass), ["tc_filter"]);
    assert!(pass.repairs[0].1.what.starts_with("eth0:"));
    assert_eq!(
        seen.lock().expect("lock").host_dev_attached,
        [DEVICE_V4, "eth0"]
    );
}

/// A planned device is the kernel's `vxlan.calix` / `vxlan-v6.calix`, its MTU the uplink's
/// less the encapsulation (50 bytes over IPv4, 70 over IPv6).
#[test]
fn a_planned_device_is_named_and_sized_for_the_kernel() {
    let d = VxlanDevice {
        vni: 4096,
        port: 4789,
        local: ip("172.31.1.1"),
        uplink: UPLINK,
        uplink_mtu: 1500,
    };
    let v4 = device_spec(Family::V4, &d);
    assert_eq!(
        (v4.name, v4.local, v4.mtu, v4.vni, v4.port, v4.underlay),
        (DEVICE_V4, ip("172.31.1.1"), 1450, 4096, 4789, UPLINK)
    );
    let v6 = device_spec(
        Family::V6,
        &VxlanDevice {
            local: ip("fd31:1::1"),
            ..d
        },
    );
    assert_eq!(
        (v6.name, v6.local, v6.mtu),
        (DEVICE_V6, ip("fd31:1::1"), 1430)
    );
}
