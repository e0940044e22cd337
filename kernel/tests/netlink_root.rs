//! Root-only: the real netlink side effects of wiring a pod, in throwaway namespaces.
//!
//! Each test makes its own "node" and "pod" namespaces (`cxtn-<pid>-<n>-<role>`), runs the
//! library inside the node namespace on a dedicated thread (as the CNI plugin runs in the
//! host's), checks the result with netlink dumps, and deletes its namespaces on drop, also
//! when it fails. Without root they fail: they test nothing then.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use calix_kernel::netlink::{self, Family, NetlinkError, ROUTE_PROTO};
use calix_kernel::netns::{self, NetNs, NetnsError};
use calix_kernel::pod::{self, GATEWAY_V4, GATEWAY_V6, HOST_VETH_MAC};
use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo};
use netlink_packet_route::route::{RouteProtocol, RouteScope};
use rtnetlink::{LinkVeth, RouteMessageBuilder};

const SCOPE_LINK: u8 = 253;
const SCOPE_UNIVERSE: u8 = 0;
const TABLE_MAIN: u32 = 254;
const PROTO_STATIC: u8 = 4;
const IFA_F_TENTATIVE: u32 = 0x40;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the netlink_root tests need root (network namespaces, veths, routes): run them as root"
    );
}

/// Deletes the named namespace on drop.
struct NsGuard {
    name: String,
}

impl Drop for NsGuard {
    fn drop(&mut self) {
        match Command::new("ip")
            .args(["netns", "del", &self.name])
            .status()
        {
            Ok(status) if status.success() => {}
            other => eprintln!("cannot delete netns {}: {other:?}", self.name),
        }
    }
}

/// A throwaway namespace. Fields drop in order: the fd first, then the namespace itself.
struct TestNs {
    ns: NetNs,
    name: String,
    _guard: NsGuard,
}

impl TestNs {
    fn new(role: &str) -> TestNs {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "cxtn-{}-{}-{role}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip netns add");
        assert!(status.success(), "ip netns add {name} failed");
        let guard = NsGuard { name: name.clone() };
        let ns = NetNs::open(format!("/run/netns/{name}")).expect("open the new netns");
        TestNs {
            ns,
            name,
            _guard: guard,
        }
    }

    fn fd(&self) -> NetNs {
        self.ns.try_clone().expect("dup netns fd")
    }
}

/// Runs an async test body on a current-thread runtime, on a thread inside `ns`: there
/// `netlink_here()` and /proc/sys/net are the node's, as they are the host's for the plugin.
fn block_on_in<T, Fut>(ns: &NetNs, body: impl FnOnce() -> Fut + Send + 'static) -> T
where
    T: Send + 'static,
    Fut: Future<Output = T>,
{
    netns::run_in(ns, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("build runtime")
            .block_on(body())
    })
    .expect("test body in the node namespace")
}

fn sysctl(path: &str) -> String {
    netns::read_sysctl(path).expect("read sysctl")
}

async fn raw_link(
    handle: &rtnetlink::Handle,
    name: &str,
) -> netlink_packet_route::link::LinkMessage {
    handle
        .link()
        .get()
        .match_name(name)
        .execute()
        .try_next()
        .await
        .expect("get link")
        .expect("link exists")
}

#[test]
fn wires_a_dual_stack_pod_and_tears_it_down() {
    require_root();
    let node = TestNs::new("node");
    let pod = TestNs::new("pod");
    let pod_ns = pod.fd();
    const HOST_IF: &str = "calitest0000001";
    let v4: Ipv4Addr = "10.244.7.9".parse().expect("v4");
    let v6: Ipv6Addr = "fd00:10:244::7:9".parse().expect("v6");

    block_on_in(&node.ns, move || async move {
        let host = netns::netlink_here().await.expect("host netlink");
        let pair = pod::create_veth(&host, &pod_ns, HOST_IF, "eth0", Some(1400))
            .await
            .expect("create veth");
        let pod = netns::netlink_in(&pod_ns).await.expect("pod netlink");
        pod::configure_pod(
            &pod,
            pair.pod_ifindex,
            Some(v4),
            Some(v6),
            pod::PodRouting::Main,
            None,
        )
        .await
        .expect("configure pod");
        pod::configure_host(&host, HOST_IF, pair.host_ifindex, Some(v4), Some(v6), None)
            .await
            .expect("configure host");

        // Host side, from a raw dump: MAC, MTU, kind, peer.
        let raw = raw_link(&host, HOST_IF).await;
        assert_eq!(raw.header.index, pair.host_ifindex);
        assert!(raw
            .attributes
            .contains(&LinkAttribute::Address(HOST_VETH_MAC.to_vec())));
        assert!(raw.attributes.contains(&LinkAttribute::Mtu(1400)));
        assert!(raw
            .attributes
            .contains(&LinkAttribute::Link(pair.pod_ifindex)));
        assert!(raw.attributes.iter().any(|a| matches!(
            a,
            LinkAttribute::LinkInfo(infos) if infos.contains(&LinkInfo::Kind(InfoKind::Veth))
        )));
        let host_link = netlink::link_details(&host, HOST_IF)
            .await
            .expect("host link")
            .expect("host link exists");
        assert!(host_link.up);
        assert_eq!(host_link.kind.as_deref(), Some("veth"));
        assert_eq!(host_link.mac, Some(HOST_VETH_MAC));

        // Pod side lives in the pod namespace only.
        assert_eq!(
            netlink::link_index(&host, "eth0").await.expect("lookup"),
            None
        );
        let pod_link = netlink::link_details(&pod, "eth0")
            .await
            .expect("pod link")
            .expect("eth0 exists in the pod");
        assert_eq!(pod_link.index, pair.pod_ifindex);
        assert_eq!(pod_link.mac, Some(pair.pod_mac));
        assert_ne!(pair.pod_mac, HOST_VETH_MAC);
        assert_eq!(pod_link.mtu, Some(1400));
        assert!(pod_link.up);
        assert_eq!(pod_link.kind.as_deref(), Some("veth"));
        assert_eq!(pod_link.peer_index, Some(pair.host_ifindex));
        assert_eq!(
            netlink::link_index(&pod, HOST_IF).await.expect("lookup"),
            None
        );

        // Pod addresses.
        let addresses = netlink::addresses(&pod, pair.pod_ifindex)
            .await
            .expect("addresses");
        let a4 = addresses
            .iter()
            .find(|a| a.address == IpNet::new(IpAddr::V4(v4), 32).expect("net"))
            .unwrap_or_else(|| panic!("no {v4}/32 in {addresses:?}"));
        assert!(!a4.nodad());
        let a6 = addresses
            .iter()
            .find(|a| a.address == IpNet::new(IpAddr::V6(v6), 128).expect("net"))
            .unwrap_or_else(|| panic!("no {v6}/128 in {addresses:?}"));
        assert!(a6.nodad(), "{a6:?}");

        // Pod routes.
        let r4: Vec<_> = netlink::routes(&pod, Family::V4)
            .await
            .expect("pod v4 routes")
            .into_iter()
            .filter(|r| r.table == TABLE_MAIN)
            .collect();
        let gw_net: IpNet = "169.254.1.1/32".parse().expect("net");
        assert!(
            r4.iter().any(|r| r.dst == gw_net
                && r.gateway.is_none()
                && r.oif == Some(pair.pod_ifindex)
                && r.scope == SCOPE_LINK),
            "{r4:#?}"
        );
        let default4: IpNet = "0.0.0.0/0".parse().expect("net");
        assert!(
            r4.iter().any(|r| r.dst == default4
                && r.gateway == Some(IpAddr::V4(GATEWAY_V4))
                && r.oif == Some(pair.pod_ifindex)),
            "{r4:#?}"
        );
        let r6 = netlink::routes(&pod, Family::V6)
            .await
            .expect("pod v6 routes");
        let default6: IpNet = "::/0".parse().expect("net");
        assert!(
            r6.iter().any(|r| r.table == TABLE_MAIN
                && r.dst == default6
                && r.gateway == Some(IpAddr::V6(GATEWAY_V6))
                && r.oif == Some(pair.pod_ifindex)),
            "{r6:#?}"
        );

        // Pod neighbours: both gateways permanent at ee:ee:ee:ee:ee:ee.
        let n4 = netlink::neighbours(&pod, pair.pod_ifindex, Family::V4)
            .await
            .expect("v4 neighbours");
        assert!(
            n4.iter().any(|n| n.ip == IpAddr::V4(GATEWAY_V4)
                && n.mac == Some(HOST_VETH_MAC)
                && n.permanent),
            "{n4:#?}"
        );
        let n6 = netlink::neighbours(&pod, pair.pod_ifindex, Family::V6)
            .await
            .expect("v6 neighbours");
        assert!(
            n6.iter().any(|n| n.ip == IpAddr::V6(GATEWAY_V6)
                && n.mac == Some(HOST_VETH_MAC)
                && n.permanent),
            "{n6:#?}"
        );
        let accept_dad = netns::run_in_async(&pod_ns, || {
            netns::read_sysctl("/proc/sys/net/ipv6/conf/eth0/accept_dad")
        })
        .await
        .expect("enter pod ns")
        .expect("read accept_dad");
        assert_eq!(accept_dad, "0");
        // ... so the pod's link-local (made when the host side came up) does not wait for DAD.
        // The kernel marks a new address tentative and clears the mark from a workqueue even
        // without DAD, so allow that a moment (DAD itself would take a second or more).
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
        loop {
            let addresses = netlink::addresses(&pod, pair.pod_ifindex)
                .await
                .expect("addresses");
            let link_local = addresses
                .iter()
                .find(|a| matches!(a.address, IpNet::V6(n) if n.addr().is_unicast_link_local()))
                .unwrap_or_else(|| panic!("no link-local in {addresses:?}"));
            if link_local.flags & IFA_F_TENTATIVE == 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "still tentative after 500 ms: {link_local:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }

        // Host routes: ours, scope link for v4, through the veth.
        let net4 = IpNet::new(IpAddr::V4(v4), 32).expect("net");
        let net6 = IpNet::new(IpAddr::V6(v6), 128).expect("net");
        let h4 = netlink::routes_to(&host, net4)
            .await
            .expect("host v4 routes");
        assert_eq!(h4.len(), 1, "{h4:#?}");
        assert_eq!(h4[0].oif, Some(pair.host_ifindex));
        assert_eq!(h4[0].protocol, ROUTE_PROTO);
        assert_eq!(h4[0].scope, SCOPE_LINK);
        assert_eq!(h4[0].gateway, None);
        let h6 = netlink::routes_to(&host, net6)
            .await
            .expect("host v6 routes");
        assert_eq!(h6.len(), 1, "{h6:#?}");
        assert_eq!(h6[0].oif, Some(pair.host_ifindex));
        assert_eq!(h6[0].protocol, ROUTE_PROTO);
        assert_eq!(h6[0].scope, SCOPE_UNIVERSE);

        // Host sysctls (this thread is in the node namespace).
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv4/conf/{HOST_IF}/proxy_arp")),
            "1"
        );
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv4/neigh/{HOST_IF}/proxy_delay")),
            "0"
        );
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv4/conf/{HOST_IF}/forwarding")),
            "1"
        );
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv4/conf/{HOST_IF}/rp_filter")),
            "1",
            "strict reverse-path filtering on the host veth"
        );
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv6/conf/{HOST_IF}/proxy_ndp")),
            "1"
        );
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv6/conf/{HOST_IF}/accept_ra")),
            "0"
        );
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv6/conf/{HOST_IF}/forwarding")),
            "1"
        );

        // Name clashes are errors, never reuse; a failed create leaves nothing behind.
        match pod::create_veth(&host, &pod_ns, HOST_IF, "eth1", None).await {
            Err(NetlinkError::Exists { name }) => assert_eq!(name, HOST_IF),
            other => panic!("expected Exists, got {other:?}"),
        }
        assert_eq!(
            netlink::link_index(&pod, "eth1").await.expect("lookup"),
            None
        );
        match pod::create_veth(&host, &pod_ns, "calitest0000002", "eth0", None).await {
            Err(NetlinkError::Exists { name }) => assert_eq!(name, "eth0"),
            other => panic!("expected Exists, got {other:?}"),
        }
        assert_eq!(
            netlink::link_index(&host, "calitest0000002")
                .await
                .expect("lookup"),
            None
        );

        // Our routes can be deleted by prefix, once.
        assert!(netlink::delete_route(&host, net4)
            .await
            .expect("delete v4 route"));
        assert!(netlink::routes_to(&host, net4)
            .await
            .expect("routes")
            .is_empty());
        assert!(!netlink::delete_route(&host, net4)
            .await
            .expect("delete v4 route again"));
        assert!(netlink::delete_route(&host, net6)
            .await
            .expect("delete v6 route"));
        assert!(netlink::routes_to(&host, net6)
            .await
            .expect("routes")
            .is_empty());
        assert!(!netlink::delete_route(&host, net6)
            .await
            .expect("delete v6 route again"));

        // Re-add the routes, then deleting the host side takes the peer and the routes along.
        pod::configure_host(&host, HOST_IF, pair.host_ifindex, Some(v4), Some(v6), None)
            .await
            .expect("configure host again");
        assert_eq!(
            netlink::routes_to(&host, net4).await.expect("routes").len(),
            1
        );
        assert!(netlink::delete_link(&host, HOST_IF)
            .await
            .expect("delete link"));
        assert!(!netlink::delete_link(&host, HOST_IF)
            .await
            .expect("delete link again"));
        assert_eq!(
            netlink::link_index(&host, HOST_IF).await.expect("lookup"),
            None
        );
        assert_eq!(
            netlink::link_index(&pod, "eth0").await.expect("lookup"),
            None
        );
        assert!(netlink::routes_to(&host, net4)
            .await
            .expect("routes")
            .is_empty());
        assert!(netlink::routes_to(&host, net6)
            .await
            .expect("routes")
            .is_empty());
    });
}

#[test]
fn wires_a_v4_only_pod_with_the_default_mtu() {
    require_root();
    let node = TestNs::new("node");
    let pod = TestNs::new("pod");
    let pod_ns = pod.fd();
    const HOST_IF: &str = "calitest0000003";
    let v4: Ipv4Addr = "10.244.3.3".parse().expect("v4");

    block_on_in(&node.ns, move || async move {
        let host = netns::netlink_here().await.expect("host netlink");
        let pair = pod::create_veth(&host, &pod_ns, HOST_IF, "net1", None)
            .await
            .expect("create veth");
        let pod = netns::netlink_in(&pod_ns).await.expect("pod netlink");
        pod::configure_pod(
            &pod,
            pair.pod_ifindex,
            Some(v4),
            None,
            pod::PodRouting::Main,
            None,
        )
        .await
        .expect("configure pod");
        pod::configure_host(&host, HOST_IF, pair.host_ifindex, Some(v4), None, None)
            .await
            .expect("configure host");

        let pod_link = netlink::link_details(&pod, "net1")
            .await
            .expect("pod link")
            .expect("net1 exists");
        assert_eq!(pod_link.mtu, Some(1500));
        let addresses = netlink::addresses(&pod, pair.pod_ifindex)
            .await
            .expect("addresses");
        assert!(addresses
            .iter()
            .all(|a| !matches!(a.address, IpNet::V6(n) if !n.addr().is_unicast_link_local())));
        let r6 = netlink::routes(&pod, Family::V6)
            .await
            .expect("pod v6 routes");
        assert!(r6.iter().all(|r| r.gateway.is_none()), "{r6:#?}");
        // create_veth turns DAD off whatever the families.
        let accept_dad = netns::read_sysctl_in(&pod_ns, "/proc/sys/net/ipv6/conf/net1/accept_dad")
            .expect("read accept_dad");
        assert_eq!(accept_dad, "0");
        let h4 = netlink::routes_to(&host, IpNet::new(IpAddr::V4(v4), 32).expect("net"))
            .await
            .expect("host routes");
        assert_eq!(h4.len(), 1);
        assert_eq!(h4[0].protocol, ROUTE_PROTO);
        assert_eq!(
            sysctl(&format!("/proc/sys/net/ipv4/conf/{HOST_IF}/proxy_arp")),
            "1"
        );
    });
}

/// `wait_operational` hears the pod's end come into service: not while its peer is down (it
/// cannot be: no carrier), then as soon as both are up; and it names the state it found.
#[test]
fn waits_until_both_ends_of_the_veth_are_operational() {
    require_root();
    let node = TestNs::new("node");
    let pod = TestNs::new("pod");
    let pod_ns = pod.fd();
    const HOST_IF: &str = "calitest0000008";
    let v4: Ipv4Addr = "10.244.8.8".parse().expect("v4");
    block_on_in(&node.ns, move || async move {
        let host = netns::netlink_here().await.expect("host netlink");
        let (pair, mut pod) = pod::create_veth_with_handle(&host, &pod_ns, HOST_IF, "eth0", None)
            .await
            .expect("create veth");
        pod::configure_pod(
            &pod.handle,
            pair.pod_ifindex,
            Some(v4),
            None,
            pod::PodRouting::Main,
            None,
        )
        .await
        .expect("configure pod");
        // The pod's end is up, its peer down: no carrier, never operational.
        let short = std::time::Duration::from_millis(200);
        let ready =
            pod::wait_operational(&mut pod, pair.pod_ifindex, &host, pair.host_ifindex, short)
                .await
                .expect("read the links");
        assert!(!ready, "operational with its peer down");
        pod::configure_host(&host, HOST_IF, pair.host_ifindex, Some(v4), None, None)
            .await
            .expect("configure host");
        let ready = pod::wait_operational(
            &mut pod,
            pair.pod_ifindex,
            &host,
            pair.host_ifindex,
            pod::OPERATIONAL_WITHIN,
        )
        .await
        .expect("read the links");
        assert!(
            ready,
            "both ends up, yet not operational within {:?}",
            pod::OPERATIONAL_WITHIN
        );
        for (h, name) in [(&pod.handle, "eth0"), (&host, HOST_IF)] {
            let link = raw_link(h, name).await;
            assert!(
                link.attributes.iter().any(|a| matches!(
                    a,
                    LinkAttribute::OperState(netlink_packet_route::link::State::Up)
                )),
                "{name}: {:?}",
                link.attributes
            );
        }
    });
}

/// The MTU the agent asks for (a VXLAN tunnel's): set on both sides with the links going up.
#[test]
fn an_mtu_given_at_configure_time_is_set_on_both_sides() {
    require_root();
    let node = TestNs::new("node");
    let pod = TestNs::new("pod");
    let pod_ns = pod.fd();
    const HOST_IF: &str = "calitest0000005";
    let v4: Ipv4Addr = "10.244.5.5".parse().expect("v4");
    block_on_in(&node.ns, move || async move {
        let host = netns::netlink_here().await.expect("host netlink");
        let pair = pod::create_veth(&host, &pod_ns, HOST_IF, "eth0", None)
            .await
            .expect("create veth");
        let pod = netns::netlink_in(&pod_ns).await.expect("pod netlink");
        pod::configure_pod(
            &pod,
            pair.pod_ifindex,
            Some(v4),
            None,
            pod::PodRouting::Main,
            Some(1450),
        )
        .await
        .expect("configure pod");
        pod::configure_host(
            &host,
            HOST_IF,
            pair.host_ifindex,
            Some(v4),
            None,
            Some(1450),
        )
        .await
        .expect("configure host");
        for (h, name) in [(&pod, "eth0"), (&host, HOST_IF)] {
            let link = netlink::link_details(h, name)
                .await
                .expect("link")
                .expect("exists");
            assert_eq!((link.mtu, link.up), (Some(1450), true), "{name}");
        }
    });
}

#[test]
fn a_route_clash_is_an_error_and_the_foreign_route_stays() {
    require_root();
    let node = TestNs::new("node");
    let pod = TestNs::new("pod");
    let pod_ns = pod.fd();
    const HOST_IF: &str = "calitest0000004";
    let v4: Ipv4Addr = "10.244.4.4".parse().expect("v4");
    let v6: Ipv6Addr = "fd00:10:244::4:4".parse().expect("v6");

    block_on_in(&node.ns, move || async move {
        let host = netns::netlink_here().await.expect("host netlink");
        // Somebody else's routes to the pod's addresses, through another device.
        // (veth rather than dummy: the dummy module may be missing.)
        host.link()
            .add(LinkVeth::new("other0", "other1").up().build())
            .execute()
            .await
            .expect("add other veth");
        let other = netlink::link_index(&host, "other0")
            .await
            .expect("lookup")
            .expect("other0 exists");
        host.route()
            .add(
                RouteMessageBuilder::<Ipv4Addr>::new()
                    .destination_prefix(v4, 32)
                    .output_interface(other)
                    .scope(RouteScope::Link)
                    .protocol(RouteProtocol::Static)
                    .build(),
            )
            .execute()
            .await
            .expect("add foreign v4 route");
        host.route()
            .add(
                RouteMessageBuilder::<Ipv6Addr>::new()
                    .destination_prefix(v6, 128)
                    .output_interface(other)
                    .protocol(RouteProtocol::Static)
                    .build(),
            )
            .execute()
            .await
            .expect("add foreign v6 route");

        let pair = pod::create_veth(&host, &pod_ns, HOST_IF, "eth0", None)
            .await
            .expect("create veth");
        let net4 = IpNet::new(IpAddr::V4(v4), 32).expect("net");
        let net6 = IpNet::new(IpAddr::V6(v6), 128).expect("net");
        match pod::configure_host(&host, HOST_IF, pair.host_ifindex, Some(v4), None, None).await {
            Err(NetlinkError::RouteExists { dst }) => assert_eq!(dst, net4),
            other => panic!("expected RouteExists, got {other:?}"),
        }
        match pod::configure_host(&host, HOST_IF, pair.host_ifindex, None, Some(v6), None).await {
            Err(NetlinkError::RouteExists { dst }) => assert_eq!(dst, net6),
            other => panic!("expected RouteExists, got {other:?}"),
        }

        // delete_route only removes routes with our protocol.
        assert!(!netlink::delete_route(&host, net4).await.expect("delete v4"));
        assert!(!netlink::delete_route(&host, net6).await.expect("delete v6"));
        for net in [net4, net6] {
            let routes = netlink::routes_to(&host, net).await.expect("routes");
            assert_eq!(routes.len(), 1, "{routes:#?}");
            assert_eq!(routes[0].oif, Some(other));
            assert_eq!(routes[0].protocol, PROTO_STATIC);
        }
        assert!(netlink::delete_link(&host, HOST_IF)
            .await
            .expect("delete link"));
    });
}

#[test]
fn threads_enter_and_leave_namespaces() {
    require_root();
    let node = TestNs::new("node");
    let pod = TestNs::new("pod");
    let pod_ns = pod.fd();
    let node_ns = node.fd();

    // run_in runs inside the target; the caller's thread stays where it was.
    let before = NetNs::current().expect("current");
    let inside =
        netns::run_in(&pod.ns, || NetNs::current().expect("current inside")).expect("run_in");
    assert!(inside.is_same(&pod.ns).expect("compare"));
    assert!(!inside.is_same(&before).expect("compare"));
    assert!(NetNs::current()
        .expect("current")
        .is_same(&before)
        .expect("compare"));

    // Sysctls through run_in hit the pod's namespace only.
    // (A new namespace inherits ip_forward from the host's, so compare with "before".)
    let host_forwarding = sysctl("/proc/sys/net/ipv4/ip_forward");
    let read = |ns: &NetNs| {
        netns::read_sysctl_in(ns, "/proc/sys/net/ipv4/ip_forward").expect("read ip_forward")
    };
    let node_before = read(&node.ns);
    let flipped = if read(&pod.ns) == "1" { "0" } else { "1" };
    netns::write_sysctl_in(&pod.ns, "/proc/sys/net/ipv4/ip_forward", flipped).expect("write");
    assert_eq!(read(&pod.ns), flipped);
    assert_eq!(read(&node.ns), node_before);
    // Writing the value it already has is a no-op, not an error.
    netns::write_sysctl_in(&pod.ns, "/proc/sys/net/ipv4/ip_forward", flipped).expect("rewrite");
    assert_eq!(read(&pod.ns), flipped);
    assert_eq!(sysctl("/proc/sys/net/ipv4/ip_forward"), host_forwarding);

    // A netlink socket from netlink_in acts on its namespace, and the runtime thread never
    // moves.
    block_on_in(&node.ns, move || async move {
        let pod = netns::netlink_in(&pod_ns).await.expect("pod netlink");
        assert!(NetNs::current()
            .expect("current")
            .is_same(&node_ns)
            .expect("compare"));
        pod.link()
            .add(LinkVeth::new("probe0", "probe1").build())
            .execute()
            .await
            .expect("add a veth in the pod");
        let node = netns::netlink_here().await.expect("node netlink");
        assert!(netlink::link_index(&pod, "probe0")
            .await
            .expect("lookup")
            .is_some());
        assert!(netlink::link_index(&node, "probe0")
            .await
            .expect("lookup")
            .is_none());
        // A handle into the node namespace opened through netlink_in sees the same.
        let node_again = netns::netlink_in(&node_ns).await.expect("node netlink");
        assert!(netlink::link_index(&node_again, "probe0")
            .await
            .expect("lookup")
            .is_none());
        // Deleting twice: true, then false.
        assert!(netlink::delete_link(&pod, "probe0").await.expect("delete"));
        assert!(!netlink::delete_link(&pod, "probe0")
            .await
            .expect("delete again"));
    });

    // Opening a namespace that is gone says so (DEL succeeds on that).
    let path = format!("/run/netns/{}-gone", pod.name);
    match NetNs::open(&path) {
        Err(e @ NetnsError::NotFound { .. }) => assert!(e.is_not_found()),
        other => panic!("expected NotFound, got {other:?}"),
    }
}

/// The reconcilers' view of the kernel, for real: a link, calix's routes (and only calix's),
/// sysctls, tc filters, and exactly one write per change.
#[test]
fn the_host_kernel_reads_and_repairs_for_real() {
    use calix_kernel::host::{HostKernel, NetlinkHost};
    use calix_kernel::pod::HostRoute;
    require_root();
    let node = TestNs::new("node");
    let ns = node.fd();
    netns::run_in(&ns, || {
        let run = |args: &[&str]| {
            assert!(Command::new("ip")
                .args(args)
                .status()
                .expect("ip")
                .success());
        };
        run(&[
            "link", "add", "calixt0", "type", "veth", "peer", "name", "calixt0p",
        ]);
        let mut k = NetlinkHost::new().expect("netlink");
        let link = k.link("calixt0").expect("link").expect("exists");
        assert!(!link.up);
        assert_eq!(k.link("nope0").expect("link"), None);
        k.set_up(link.index).expect("up");
        assert!(k.link("calixt0").expect("link").expect("exists").up);
        // A route that is not calix's (static): never reported.
        run(&[
            "route",
            "add",
            "10.9.0.2/32",
            "dev",
            "calixt0",
            "proto",
            "static",
        ]);

        assert_eq!(k.routes().expect("routes"), vec![]);
        let r4 = HostRoute::of_pod(link.index, Some(Ipv4Addr::new(10, 9, 0, 1)), None);
        k.add_route(&r4[0]).expect("add v4");
        assert_eq!(k.routes().expect("routes"), r4);
        k.delete_route(&r4[0]).expect("delete");
        k.delete_route(&r4[0]).expect("delete again: gone is fine");
        assert_eq!(k.routes().expect("routes"), vec![]);

        let path = "ipv4/conf/calixt0/proxy_arp";
        assert_eq!(k.sysctl(path).expect("read").as_deref(), Some("0"));
        k.set_sysctl(path, "1").expect("write");
        assert_eq!(k.sysctl(path).expect("read").as_deref(), Some("1"));
        assert_eq!(k.sysctl("ipv4/conf/nope0/proxy_arp").expect("read"), None);

        assert_eq!(k.bpf_filters(link.index).expect("no clsact: none"), vec![]);
    })
    .expect("in the node namespace");
}

/// Routes to other nodes, the VXLAN devices, their forwarding and neighbour entries through
/// the reconcilers' trait, for real: what is written reads back equal, only calix's is seen.
#[test]
fn routes_to_other_nodes_and_vxlan_devices_for_real() {
    use calix_kernel::host::{HostKernel, NetlinkHost};
    use calix_kernel::node_route::NodeRoute;
    use calix_kernel::pod::HostRoute;
    use calix_kernel::vxlan::{vtep_mac, FdbEntry, VxlanSpec, DEVICE_V4, DEVICE_V6};
    require_root();
    let node = TestNs::new("node");
    let ns = node.fd();
    netns::run_in(&ns, || {
        let run = |args: &[&str]| {
            let out = Command::new("ip").args(args).output().expect("ip");
            assert!(out.status.success(), "ip {args:?}: {out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        run(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p",
        ]);
        run(&["addr", "add", "172.31.1.1/24", "dev", "eth0"]);
        run(&["addr", "add", "fd31:1::1/64", "dev", "eth0", "nodad"]);
        run(&["link", "set", "eth0", "up"]);
        run(&["link", "set", "eth0p", "up"]);
        run(&[
            "link", "add", "calixt0", "type", "veth", "peer", "name", "calixt0p",
        ]);
        let ip = |s: &str| -> IpAddr { s.parse().expect("ip") };
        let mut k = NetlinkHost::new().expect("netlink");

        let up = k.uplink("eth0").expect("uplink").expect("exists");
        assert_eq!(up.mtu, 1500);
        assert_eq!(
            up.addresses,
            vec![
                "172.31.1.1/24".parse::<IpNet>().expect("net"),
                "fd31:1::1/64".parse().expect("net")
            ],
            "global addresses only (no fe80::)"
        );
        assert_eq!(k.uplink("nope0").expect("uplink"), None);
        // The MTU without netlink (what the agent tells the plugin).
        assert_eq!(netlink::link_mtu("eth0").expect("mtu"), 1500);
        run(&["link", "set", "calixt0", "mtu", "1400"]);
        assert_eq!(netlink::link_mtu("calixt0").expect("mtu"), 1400);
        assert!(matches!(
            netlink::link_mtu("nope0"),
            Err(NetlinkError::LinkNotFound { .. })
        ));

        // The devices, as specified.
        let spec4 = VxlanSpec {
            name: DEVICE_V4,
            vni: 4096,
            port: 4789,
            local: ip("172.31.1.1"),
            underlay: up.index,
            mtu: up.mtu - 50,
        };
        let spec6 = VxlanSpec {
            name: DEVICE_V6,
            local: ip("fd31:1::1"),
            mtu: up.mtu - 70,
            ..spec4.clone()
        };
        assert_eq!(k.vxlan(DEVICE_V4).expect("read"), None);
        let v4 = k.create_vxlan(&spec4).expect("create v4");
        let v6 = k.create_vxlan(&spec6).expect("create v6");
        for (spec, index) in [(&spec4, v4), (&spec6, v6)] {
            let dev = k.vxlan(spec.name).expect("read").expect("exists");
            assert_eq!(dev.index, index);
            assert_eq!(dev.mismatch(spec), None, "{dev:?}");
            assert_eq!((dev.up, dev.mtu), (true, Some(spec.mtu)));
        }
        assert!(matches!(
            k.create_vxlan(&spec4),
            Err(NetlinkError::Exists { .. })
        ));
        // Another VNI reads back as a mismatch; a link of the name that is not VXLAN too.
        let other = VxlanSpec {
            vni: 7,
            ..spec4.clone()
        };
        let why = k
            .vxlan(DEVICE_V4)
            .expect("read")
            .expect("exists")
            .mismatch(&other)
            .expect("a mismatch");
        assert!(why.contains("VNI"), "{why}");
        let not_vxlan = k.vxlan("calixt0").expect("read").expect("exists");
        assert!(not_vxlan.vxlan.is_none());
        k.set_mtu(v4, 1400).expect("mtu");
        assert_eq!(
            k.vxlan(DEVICE_V4).expect("read").expect("exists").mtu,
            Some(1400)
        );

        // Forwarding entries: only this device's, exactly what was written.
        let peer = FdbEntry::of_peer(ip("172.31.2.3"));
        assert_eq!(k.fdb(v4).expect("fdb"), vec![]);
        k.add_fdb(v4, &peer).expect("add fdb");
        k.add_fdb(v4, &peer).expect("add again: replaced");
        k.add_fdb(v6, &FdbEntry::of_peer(ip("fd31:2::3")))
            .expect("add fdb v6");
        assert_eq!(k.fdb(v4).expect("fdb"), vec![peer]);
        let shown = run(&["-d", "link", "show", DEVICE_V4]);
        assert!(shown.contains("nolearning"), "{shown}");
        let fdb = String::from_utf8_lossy(
            &Command::new("bridge")
                .args(["fdb", "show", "dev", DEVICE_V4])
                .output()
                .expect("bridge")
                .stdout,
        )
        .into_owned();
        assert!(
            fdb.contains("0e:ca:ac:1f:02:03 dst 172.31.2.3 self permanent"),
            "{fdb}"
        );
        k.delete_fdb(v4, &peer).expect("delete fdb");
        k.delete_fdb(v4, &peer).expect("delete again: gone is fine");
        assert_eq!(k.fdb(v4).expect("fdb"), vec![]);

        // Permanent neighbours: set, replaced, deleted; others are not reported.
        k.set_neighbour(v4, ip("172.31.2.3"), [2, 0, 0, 0, 0, 1])
            .expect("neigh");
        k.set_neighbour(v4, ip("172.31.2.3"), vtep_mac(ip("172.31.2.3")))
            .expect("neigh replaced");
        k.set_neighbour(v6, ip("fd31:2::3"), vtep_mac(ip("fd31:2::3")))
            .expect("neigh v6");
        run(&[
            "neigh",
            "add",
            "172.31.1.9",
            "lladdr",
            "02:00:00:00:00:09",
            "dev",
            "eth0",
            "nud",
            "stale",
        ]);
        let n = k.permanent_neighbours(v4).expect("neighbours");
        assert_eq!(
            n.into_iter().collect::<Vec<_>>(),
            vec![(ip("172.31.2.3"), vtep_mac(ip("172.31.2.3")))]
        );
        assert!(k
            .permanent_neighbours(up.index)
            .expect("neighbours")
            .is_empty());
        assert_eq!(k.permanent_neighbours(v6).expect("neighbours").len(), 1);

        // Routes to other nodes: direct, and onlink through each device.
        let direct = NodeRoute {
            dst: "10.244.1.0/26".parse().expect("net"),
            gateway: ip("172.31.1.2"),
            oif: up.index,
            onlink: false,
        };
        let tunnel4 = NodeRoute {
            dst: "10.244.2.0/26".parse().expect("net"),
            gateway: ip("172.31.2.3"),
            oif: v4,
            onlink: true,
        };
        let tunnel6 = NodeRoute {
            dst: "fd00:244::40/122".parse().expect("net"),
            gateway: ip("fd31:2::3"),
            oif: v6,
            onlink: true,
        };
        // A pod's host route and a route of another protocol: not routes to nodes.
        let pod = k.link("calixt0").expect("link").expect("exists").index;
        k.set_up(pod).expect("up");
        let host = HostRoute::of_pod(pod, Some(Ipv4Addr::new(10, 244, 0, 5)), None);
        k.add_route(&host[0]).expect("host route");
        run(&[
            "route",
            "add",
            "10.99.0.0/24",
            "via",
            "172.31.1.254",
            "proto",
            "static",
        ]);
        for r in [&direct, &tunnel4, &tunnel6] {
            k.add_node_route(r, false).expect("add route");
        }
        let mut got = k.node_routes().expect("node routes");
        got.sort();
        assert_eq!(got, vec![direct, tunnel4, tunnel6]);
        assert_eq!(k.routes().expect("host routes"), host, "no gateway routes");
        let shown = run(&["route", "show", "10.244.2.0/26"]);
        assert!(
            shown.contains("via 172.31.2.3 dev vxlan.calix proto 202 onlink"),
            "{shown}"
        );
        // Exclusive add; replace swaps the route in one step.
        assert!(matches!(
            k.add_node_route(&direct, false),
            Err(NetlinkError::RouteExists { .. })
        ));
        let moved = NodeRoute {
            gateway: ip("172.31.1.3"),
            ..direct
        };
        k.add_node_route(&moved, true).expect("replace");
        let moved6 = NodeRoute {
            gateway: ip("fd31:2::4"),
            ..tunnel6
        };
        k.add_node_route(&moved6, true).expect("replace v6");
        let mut got = k.node_routes().expect("node routes");
        got.sort();
        assert_eq!(got, vec![moved, tunnel4, moved6]);
        k.delete_node_route(&moved).expect("delete");
        k.delete_node_route(&moved)
            .expect("delete again: gone is fine");
        // A device taken away takes its routes and entries with it.
        assert!(k.delete_link(DEVICE_V6).expect("delete"));
        assert!(!k.delete_link(DEVICE_V6).expect("delete again"));
        assert_eq!(k.node_routes().expect("node routes"), vec![tunnel4]);
        assert_eq!(k.vxlan(DEVICE_V6).expect("read"), None);
    })
    .expect("in the node namespace");
}

/// A connected UDP socket is listed with its ends and cookie, and ended: its next receive
/// fails with ECONNABORTED; an unconnected one is not listed; a socket of another namespace
/// is not seen.
#[test]
fn connected_udp_sockets_are_listed_and_ended() {
    use calix_kernel::sock_diag;
    use std::os::fd::AsRawFd;
    require_root();
    let t = TestNs::new("udp");
    let other = TestNs::new("udp-other");
    let (seen, ended, after) = netns::run_in(&t.fd(), move || {
        let up = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("ip link");
        assert!(up.success());
        let server = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let to = server.local_addr().expect("addr");
        let client = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        client.connect(to).expect("connect");
        let local = client.local_addr().expect("addr");
        let _loose = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let mut cookie = 0u64;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: SO_COOKIE into a u64 we own, with its size.
        let rc = unsafe {
            libc::getsockopt(
                client.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_COOKIE,
                (&mut cookie as *mut u64).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "SO_COOKIE");
        let listed = sock_diag::connected_udp().expect("list");
        let seen: Vec<_> = listed
            .iter()
            .map(|s| (s.local, s.peer_plain(), s.cookie))
            .collect();
        let mine = listed
            .iter()
            .find(|s| s.peer_plain() == to)
            .copied()
            .expect("the connected socket listed");
        sock_diag::destroy(&mine).expect("destroy");
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        let ended = client.recv(&mut [0u8; 8]).map_err(|e| e.raw_os_error());
        let after = sock_diag::destroy(&mine).map_err(|e| e.to_string());
        ((seen, local, to, cookie), ended, after)
    })
    .expect("in the test namespace");
    let (seen, local, to, cookie) = seen;
    assert_eq!(seen, [(local, to, cookie)], "only the connected socket");
    assert_eq!(ended, Err(Some(libc::ECONNABORTED)), "ended");
    assert!(after.is_err(), "gone already: {after:?}");
    let there = netns::run_in(&other.fd(), sock_diag::connected_udp)
        .expect("in the other namespace")
        .expect("list");
    assert!(
        there
            .iter()
            .all(|s| s.peer_plain() != to || s.local != local),
        "another namespace's sockets are not seen: {there:?}"
    );
}
