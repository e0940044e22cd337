//! Pods on different nodes (issue 13), end to end with real agents only: three nodes on the
//! test bed's underlay — two on subnet 1, one on subnet 2 — each with two dual-stack pods
//! wired by its agent, route distribution between the agents (mutual TLS, real etcd), and each
//! agent's reconciler programming what it learns. Shown in both dataplane modes: every pod
//! reaches every other by ping and TCP, through the direct route on the shared subnet and
//! through VXLAN to and from the other subnet; in eBPF mode same-subnet traffic between nodes
//! never touches either node's IP forwarding; a new pod is reachable from another node within
//! 1 s of its ADD; a route or the VXLAN device deleted by hand is back within seconds; an idle
//! node writes nothing; restarting an agent (SIGTERM, kill -9) keeps cross-node flows running;
//! `--uninstall` removes the VXLAN devices. Run as root.
use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;
use std::time::{Duration, Instant};

use calix_agent::reconcile::driver::{Driver, Snapshot, Timing};
use calix_agent::reconcile::Backoff;
use calix_core::reconcile::remote::{RemoteRoute, Underlay};
use calix_dataplane::{Attached, Dataplane, DataplaneError, EndpointSpec};
use calix_kernel::host::NetlinkHost;
use calix_kernel::vxlan::{DEVICE_V4, DEVICE_V6};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::echo::{echo_roundtrip, EchoServer, ECHO_PORT};
use calix_testbed::traffic::probe::{first_replies, Pinger};
use calix_testbed::{Cluster, Dataplane as Mode, Node, Pod};
use ipnet::IpNet;
use serde_json::Value;

/// A dual-stack pool pair with the default `vxlan = "crossSubnet"`, in blocks of one address:
/// every new pod needs a new block, whose route every other node must learn.
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 32\n\
                     [[pools]]\ncidr = \"fd00:244::/64\"\nblockSize = 128\n";
/// Nodes 0 and 1 share subnet 1; node 2 is alone on subnet 2.
const SUBNETS: [u8; 3] = [1, 1, 2];
/// The routes only: what a node's route reconciler needs from a dataplane is nothing (the
/// node's agent programs the pods and attaches the host-device programs).
struct RoutesOnly;

impl Dataplane for RoutesOnly {
    fn attach(&mut self, ep: &EndpointSpec) -> Result<Attached, DataplaneError> {
        Err(DataplaneError::NoInterface {
            ifname: ep.host_ifname.clone(),
        })
    }
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(f)
}

fn snapshot(d: &Driver) -> Snapshot {
    block_on(d.snapshot()).expect("snapshot")
}

/// How `ip route` prints `net` (a host route without its prefix length).
fn as_shown(net: IpNet) -> String {
    if net.prefix_len() == net.max_prefix_len() {
        net.addr().to_string()
    } else {
        net.to_string()
    }
}

/// The block holding `ip` (the pools' /32 and /128).
fn block_of(ip: IpAddr) -> IpNet {
    let len = if ip.is_ipv4() { 32 } else { 128 };
    IpNet::new(ip, len).expect("prefix").trunc()
}

/// `nstat -az IpForwDatagrams` inside `node`.
fn forwarded(node: &Node) -> u64 {
    let out = node.ns.exec_ok(&["nstat", "-az", "-j", "IpForwDatagrams"]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("nstat json");
    v["kernel"]["IpForwDatagrams"].as_u64().unwrap_or(0)
}

fn text(out: std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits up to `secs` for `done`, polling.
fn within(secs: u64, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "not within {secs} s: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn reaches(from: &Pod, to: &Pod, what: &str) {
    for ip in to.ips() {
        assert!(
            from.ns.ping(&ip, 1),
            "{what}: no ping reply from {ip}\nagent log of the sender's node:\n{}",
            from.node.agent_log()
        );
        let addr = SocketAddr::new(ip.parse().expect("ip"), ECHO_PORT);
        echo_roundtrip(&from.ns, addr, 64 * 1024, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{what}: TCP to {addr}: {e}"));
    }
}

/// The value of metric line `name` (with its labels) from node `node`'s /metrics; 0 when absent.
fn metric(node: &Node, name: &str) -> u64 {
    let (_, body) = node.http_get("/metrics").unwrap_or_default();
    let prefix = format!("{name} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn repairs(node: &Node, kind: &str) -> u64 {
    metric(node, &format!("calix_repairs_total{{kind=\"{kind}\"}}"))
}

/// The agents' log level: route distribution's and the reconciler's steps at debug, so that
/// a route late to arrive shows where it waited (the agents' logs are printed on failure).
const LOG_LEVEL: &str = "info,calix_agent::distribution=debug,calix_agent::reconcile=debug";

/// A started cluster: route distribution with mutual TLS from `ca`, a 10 s grace period, the
/// reconcilers resyncing every second, the agents logging at [`LOG_LEVEL`].
fn cluster(mode: Mode, ca: &Ca) -> Cluster {
    let mut c = Cluster::create(mode, &SUBNETS, |i, c| {
        format!(
            "resync_interval_secs = 1\n{}{POOLS}{}",
            c.base_config(i),
            c.routes_config(i, ca, "grace_secs = 10")
                .unwrap_or_else(|e| panic!("{e}"))
        )
    });
    for n in &mut c.nodes {
        n.agent_mut().spec.log_level = LOG_LEVEL;
    }
    c.start();
    c
}

/// calix's routes (protocol 202) in node `i`'s main table, as `ip route` shows them.
fn calix_routes(c: &Cluster, i: usize) -> String {
    let v4 = text(
        c.nodes[i]
            .ns
            .exec_ok(&["ip", "route", "show", "proto", "202"]),
    );
    let v6 = text(
        c.nodes[i]
            .ns
            .exec_ok(&["ip", "-6", "route", "show", "proto", "202"]),
    );
    v4 + &v6
}

/// Pings `ip` from `from` every 5 ms until a reply; how long it took, or `None` after `limit`.
fn first_reply(from: &Pod, ip: &str, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    let mut pinger = Pinger::open(&from.ns).expect("pinger");
    let to = ip.parse().expect("IPv4 address");
    let got =
        first_replies(&mut [(&mut pinger, to)], Duration::from_millis(5), limit).expect("probe");
    got[0].map(|at| at - t)
}

fn pods_reach_each_other_across_nodes(mode: Mode) {
    let ca = Ca::new("calix-test-ca").expect("CA");
    let cluster = cluster(mode, &ca);
    let dual = serde_json::json!({"ipam": {"type": "calix-ipam", "assign_ipv6": "true"}});
    let pods: Vec<Vec<Pod>> = cluster
        .nodes
        .iter()
        .map(|n| {
            ["a", "b"]
                .iter()
                .map(|p| Pod::add_with(n, p, dual.clone()))
                .collect()
        })
        .collect();
    // Without an `mtu` in the conflist, the agent's: the uplink's (1500) less IPv6's VXLAN
    // encapsulation (70), on both sides of every pod's veth.
    for p in pods.iter().flatten() {
        let shown = text(p.ns.exec_ok(&["ip", "-o", "link", "show", "eth0"]));
        assert!(shown.contains(" mtu 1430 "), "{shown}");
        let host = text(
            p.node
                .ns
                .exec_ok(&["ip", "-o", "link", "show", &p.host_ifname()]),
        );
        assert!(host.contains(" mtu 1430 "), "{host}");
    }
    let _servers: Vec<EchoServer> = pods
        .iter()
        .flatten()
        .map(|p| EchoServer::start(&p.ns).expect("echo server"))
        .collect();
    // Route distribution programs every other node's blocks: direct on the shared subnet,
    // through VXLAN across subnets.
    for (i, subnet) in SUBNETS.iter().enumerate() {
        for j in (0..3).filter(|j| *j != i) {
            let via = if *subnet == SUBNETS[j] {
                format!("via {} dev eth0", cluster.address(j))
            } else {
                format!("via {} dev {DEVICE_V4} onlink", cluster.address(j))
            };
            let want4 = format!(
                "{} {via}",
                as_shown(block_of(pods[j][0].ip().parse().expect("ip")))
            );
            let v6: IpAddr = pods[j][0].ips()[1].parse().expect("ipv6");
            let want6 = format!("{} via {}", as_shown(block_of(v6)), cluster.address6(j));
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let shown = calix_routes(&cluster, i);
                if shown.contains(&want4) && shown.contains(&want6) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {i} has no route {want4:?} and {want6:?}:\n{shown}\nagent log:\n{}",
                    cluster.nodes[i].agent_log()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    assert!(cluster.nodes[2].ns.links().contains(&DEVICE_V6.to_string()));
    if mode == Mode::Ebpf {
        // The agents put their host-device programs on the devices at their next pass.
        for n in &cluster.nodes {
            within(5, "from_host_dev on vxlan.calix", || {
                n.filter_prog(DEVICE_V4, "ingress").is_some()
            });
        }
    }
    let all: Vec<&Pod> = pods.iter().flatten().collect();
    for from in &all {
        for to in all.iter().filter(|t| t.ns.name != from.ns.name) {
            reaches(from, to, &format!("{} → {}", from.ns.name, to.ns.name));
        }
    }

    // Same subnet, node 0 → node 1: in eBPF mode neither node's IP stack forwards it.
    let before = [forwarded(&cluster.nodes[0]), forwarded(&cluster.nodes[1])];
    for to in &pods[1] {
        for ip in to.ips() {
            assert!(pods[0][0].ns.ping(&ip, 10));
            let addr = SocketAddr::new(ip.parse().expect("ip"), ECHO_PORT);
            echo_roundtrip(&pods[0][0].ns, addr, 256 * 1024, Duration::from_secs(5)).expect("TCP");
        }
    }
    let after = [forwarded(&cluster.nodes[0]), forwarded(&cluster.nodes[1])];
    let delta = [after[0] - before[0], after[1] - before[1]];
    eprintln!("{mode:?}: IpForwDatagrams on nodes 0 and 1: +{delta:?}");
    match mode {
        Mode::Ebpf => assert_eq!(delta, [0, 0], "eBPF mode went through IP forwarding"),
        Mode::Kernel => assert!(delta[0] >= 40 && delta[1] >= 40, "{delta:?}"),
    }

    // A new pod on node 0 needs a new block: reachable from node 2 within 1 s of its ADD (the
    // block claimed, advertised, validated, programmed).
    let t = Instant::now();
    let t_wall = std::time::SystemTime::now();
    let c = Pod::add_with(&cluster.nodes[0], "c", dual.clone());
    let added = t.elapsed();
    let new_block = block_of(c.ip().parse().expect("ip"));
    assert!(
        pods[0]
            .iter()
            .all(|p| block_of(p.ip().parse().expect("ip")) != new_block),
        "pod c ({}) is in a block of its own: {:?}",
        c.ip(),
        pods[0].iter().map(|p| p.ips()).collect::<Vec<_>>()
    );
    let reply = first_reply(&pods[2][0], &c.ip(), Duration::from_secs(1));
    eprintln!("new pod on node 0: ADD took {added:?}, first reply from node 2 after {reply:?}");
    if reply.is_none() {
        // Where the path stood: the route on node 2, the neighbours on the way, and whether
        // it came later.
        let shown = |ns: &calix_testbed::Netns, argv: &[&str]| text(ns.exec_ok(argv));
        let state = format!(
            "node 2's calix routes:\n{}\nnode 2: {}node 0, neighbours on {}:\n{}pod c, neighbours:\n{}",
            calix_routes(&cluster, 2),
            shown(&cluster.nodes[2].ns, &["ip", "route", "get", &c.ip()]),
            c.host_ifname(),
            shown(
                &cluster.nodes[0].ns,
                &["ip", "-s", "neigh", "show", "dev", &c.host_ifname()]
            ),
            shown(&c.ns, &["ip", "-s", "neigh", "show"]),
        );
        let later = first_reply(&pods[2][0], &c.ip(), Duration::from_secs(5));
        panic!(
            "not reachable from node 2 within 1 s of its ADD (pod c {:?}, ADD started {}, took \
             {added:?}; a second probe's first reply after {later:?})\n{state}\n\
             agent log of node 0:\n{}\nagent log of node 2:\n{}",
            c.ips(),
            utc(t_wall),
            cluster.nodes[0].agent_log(),
            cluster.nodes[2].agent_log()
        );
    }

    // Node 1's agent restarted (SIGTERM, then kill -9) under a flow from node 2: no loss, and
    // its peers keep its routes meanwhile.
    let target = pods[1][0].ip();
    let flow = pods[2][0]
        .ns
        .cmd(&["ping", "-i", "0.05", "-c", "120", "-W", "1", "-q", &target])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ping flow");
    let b1 = format!("{} via", as_shown(block_of(target.parse().expect("ip"))));
    std::thread::sleep(Duration::from_millis(500));
    cluster.nodes[1].stop_agent();
    assert!(
        calix_routes(&cluster, 2).contains(&b1),
        "node 2 kept node 1's route"
    );
    cluster.nodes[1].start_agent();
    cluster.nodes[1].kill_agent();
    assert!(
        calix_routes(&cluster, 0).contains(&b1),
        "node 0 kept node 1's route"
    );
    cluster.nodes[1].start_agent();
    let flow = flow.wait_with_output().expect("ping flow");
    let summary = text_of(&flow.stdout);
    assert!(
        flow.status.success() && summary.contains(" 0% packet loss"),
        "the flow across the restarts lost packets:\n{summary}"
    );

    // Sabotage on node 2: its route to node 0's block, then the VXLAN device itself.
    let n2 = &cluster.nodes[2];
    let b0 = block_of(pods[0][0].ip().parse().expect("ip")).to_string();
    n2.ns.exec_ok(&["ip", "route", "del", &b0]);
    within(5, "the route re-created", || {
        text(n2.ns.exec_ok(&["ip", "route", "show", &b0])).contains(DEVICE_V4)
    });
    assert!(repairs(n2, "node_route") >= 1);
    n2.ns.exec_ok(&["ip", "link", "del", DEVICE_V4]);
    within(5, "the VXLAN device re-created with its routes", || {
        text(n2.ns.exec_ok(&["ip", "route", "show", &b0])).contains(DEVICE_V4)
    });
    if mode == Mode::Ebpf {
        within(5, "the programs back on the new device", || {
            n2.filter_prog(DEVICE_V4, "ingress").is_some()
        });
    }
    assert!(repairs(n2, "vxlan_device") >= 1);
    reaches(&pods[2][1], &pods[0][1], "after the repairs");

    // Idle: ten passes of the reconciler, no writes (neighbour entries: calix's devices').
    std::thread::sleep(Duration::from_secs(2));
    let watch = |argv: &[&str]| {
        n2.ns
            .cmd(argv)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("monitor")
    };
    let before = metric(n2, "calix_resyncs_total");
    let monitors = [
        watch(&[
            "timeout", "10", "ip", "-o", "monitor", "route", "link", "address",
        ]),
        watch(&[
            "timeout", "10", "ip", "-o", "monitor", "neigh", "dev", DEVICE_V4,
        ]),
        watch(&["timeout", "10", "bridge", "monitor", "fdb"]),
        watch(&["timeout", "10", "tc", "monitor"]),
    ];
    let seen: String = monitors
        .into_iter()
        .map(|m| text(m.wait_with_output().expect("monitor")))
        .collect();
    assert!(seen.trim().is_empty(), "writes while idle:\n{seen}");
    assert!(metric(n2, "calix_resyncs_total") - before >= 8);

    // Node 1's agent stopped for good: after the grace period (10 s) its peers withdraw its
    // routes from their kernels.
    cluster.nodes[1].stop_agent();
    let stopped = Instant::now();
    within(20, "node 1's block withdrawn on node 0", || {
        !calix_routes(&cluster, 0).contains(&b1)
    });
    let gone = stopped.elapsed();
    eprintln!("node 1's routes withdrawn {gone:?} after its agent stopped");
    assert!(
        gone >= Duration::from_secs(9),
        "withdrawn before the grace period: {gone:?}"
    );

    // `calix-agent --uninstall` removes the VXLAN devices.
    n2.stop_agent();
    let argv = n2.agent_args(&["--uninstall"]);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let out = calix_testbed::run(&mut n2.ns.cmd_setns(&argv));
    assert!(
        out.status.success(),
        "--uninstall: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let links = n2.ns.links();
    assert!(
        !links.iter().any(|l| l == DEVICE_V4 || l == DEVICE_V6),
        "{links:?}"
    );
}

/// `at` as the agents' log lines stamp their time (UTC, RFC 3339, microseconds).
fn utc(at: std::time::SystemTime) -> String {
    let d = at
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970");
    let (days, secs) = (d.as_secs() / 86_400, d.as_secs() % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60,
        d.subsec_micros()
    )
}

fn text_of(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn pods_reach_each_other_across_nodes_in_ebpf_mode() {
    pods_reach_each_other_across_nodes(Mode::Ebpf);
}

#[test]
fn pods_reach_each_other_across_nodes_in_kernel_mode() {
    pods_reach_each_other_across_nodes(Mode::Kernel);
}

/// One node told about 100 peers × 100 blocks each, half of the peers on another subnet
/// (through VXLAN): all 10,000 routes programmed in one change well within 2 s; a pass with
/// nothing to do is reads only, and quick.
#[test]
fn ten_thousand_routes_to_a_hundred_peers_are_programmed_at_once() {
    let ns = calix_testbed::Netns::new("r");
    for cmd in [
        "link add eth0 type veth peer name eth0p",
        "addr add 172.30.0.1/16 dev eth0",
        "link set eth0 up",
        "link set eth0p up",
    ] {
        ns.ip(cmd).expect("ip");
    }
    let driver = ns.run(|| {
        Driver::spawn(
            NetlinkHost::new,
            Box::new(RoutesOnly),
            Underlay {
                uplinks: vec!["eth0".into()],
                ..Underlay::default()
            },
            Timing {
                resync: Duration::from_secs(3600),
                backoff: Backoff::default(),
            },
        )
        .expect("route driver")
    });
    let mut routes = Vec::new();
    for peer in 0..100u32 {
        let subnet = if peer % 2 == 0 { 30 } else { 29 };
        let next_hop: IpAddr = format!("172.{subnet}.1.{}", peer + 2).parse().expect("ip");
        for b in 0..100u32 {
            let block = u32::from(std::net::Ipv4Addr::new(10, 64, 0, 0)) + (peer * 100 + b) * 64;
            let prefix = IpNet::new(IpAddr::V4(block.into()), 26).expect("block");
            routes.push(RemoteRoute {
                prefix,
                node: format!("peer{peer}"),
                next_hop,
                vxlan: Default::default(),
            });
        }
    }
    let t = Instant::now();
    block_on(driver.set_remote_routes(routes, true)).expect("set routes");
    let programmed = t.elapsed();
    let snap = snapshot(&driver);
    assert_eq!(snap.routes_error, None);
    let shown = text(ns.exec_ok(&["ip", "-4", "route", "show", "proto", "202"]));
    assert_eq!(shown.lines().count(), 10_000);
    assert_eq!(
        shown.lines().filter(|l| l.contains(DEVICE_V4)).count(),
        5_000
    );
    let t = Instant::now();
    block_on(driver.resync()).expect("resync");
    let checked = t.elapsed();
    // (A fresh namespace's forwarding sysctls are the only repairs.)
    let repairs = snapshot(&driver).repairs;
    assert!(
        repairs
            .keys()
            .all(|k| !k.starts_with("node_route") && !k.starts_with("vxlan")),
        "{repairs:?}"
    );
    eprintln!("10,000 routes: programmed in {programmed:?}, a pass with nothing to do {checked:?}");
    assert!(programmed < Duration::from_secs(2), "{programmed:?}");
    block_on(driver.release());
}
