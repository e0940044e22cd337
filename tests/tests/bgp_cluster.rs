//! A cluster with no overlay and no mesh (issue 23): three nodes on two subnets, route
//! distribution off, each agent's BGP speaker peering with the router of its subnet (in the
//! underlay namespace, which routes between the subnets and toward an "outside" namespace),
//! over IPv4 and over IPv6, each session with a TCP MD5 password. The router is BIRD 2 or FRR
//! (zebra and bgpd), configured alike; shown with each, in both dataplanes:
//! - every node's blocks reach the router and every other node (through the router; the next
//!   hop is the node itself on the same subnet, the router on the other): pods reach each
//!   other across nodes, and the outside reaches every pod by its own address (ping, TCP),
//!   with no VXLAN device anywhere; in eBPF mode no node's IP stack forwards;
//! - `calixctl bgp peers` / `routes` and the metrics say so;
//! - an agent killed with `kill -9` and started again: the router keeps its routes (graceful
//!   restart) and a flow from outside to its pod loses nothing;
//! - the router crashes and comes back: sessions come back, routes are learned again;
//! - a block released on a node disappears from the router;
//! - an agent that stops for good: its routes go after the restart time.
//!
//! Run as root; needs `bird` and FRR (cargo xtask setup).
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use calix_testbed::traffic::echo::{echo_roundtrip, EchoServer, ECHO_PORT};
use calix_testbed::{veth, Cluster, Dataplane as Mode, Netns, Node, Pod};
use common::bird::Bird;
use common::frr::Frr;
use ipnet::IpNet;
use serde_json::Value;

mod common;

const SUBNETS: [u8; 3] = [1, 1, 2];
const ROUTER_AS: u32 = 65000;
const PASSWORD: &str = "calix-bgp-cluster";
/// Short, so that "for good" shows within the test.
const RESTART_SECS: u64 = 8;

fn node_as(i: usize) -> u32 {
    64601 + i as u32
}

/// Blocks of 16 IPv4 and 16 IPv6 addresses.
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 28\n\
                     [[pools]]\ncidr = \"fd00:244::/64\"\nblockSize = 124\n";

fn agent_config(i: usize, c: &Cluster) -> String {
    let s = c.subnets[i];
    let password = c.nodes[i].dir.join("bgp-password");
    std::fs::write(&password, format!("{PASSWORD}\n")).expect("password file");
    let peer = |name: &str, address: String| {
        format!(
            "[[bgp.peers]]\nname = \"{name}\"\naddress = \"{address}\"\nas_number = {ROUTER_AS}\n\
             password_file = {:?}\nhold_time_secs = 9\n",
            password.display().to_string()
        )
    };
    format!(
        "resync_interval_secs = 1\nlog_level = \"info,calix_agent::bgp=debug\"\n{}{POOLS}\
         [ipam]\nleakCheckIntervalSecs = 1\nemptyBlockGraceSecs = 0\n\
         [bgp]\nenabled = true\nas_number = {}\nrestart_time_secs = {RESTART_SECS}\n{}{}",
        c.base_config(i),
        node_as(i),
        peer("tor4", format!("172.31.{s}.254")),
        peer("tor6", format!("fd31:{s}::fe")),
    )
}

/// The router of the scenario, in the underlay namespace: a session per node and family, the
/// learned routes into the underlay's kernel (so it forwards to the pods) and on to every
/// other node.
trait Router {
    const NAME: &'static str;
    fn start(c: &Cluster) -> Self;
    /// Its entry for `prefix`, for messages; empty when it has none.
    fn route(&self, prefix: &str) -> String;
    /// Whether it has a path for `prefix` that `asn` originated (stale or not).
    fn has_route_from(&self, prefix: &str, asn: u32) -> bool;
    /// Its sessions, for messages.
    fn sessions(&self) -> String;
    /// Its routes, for messages.
    fn routes(&self) -> String;
    /// kill -9, as a crash.
    fn kill(&mut self);
    /// A crash and a start again.
    fn restart(&mut self);
}

impl Router for Bird {
    const NAME: &'static str = "BIRD";
    fn start(c: &Cluster) -> Self {
        Bird::start(c.underlay(), &bird_conf(c))
    }
    fn route(&self, prefix: &str) -> String {
        Bird::route(self, prefix)
    }
    fn has_route_from(&self, prefix: &str, asn: u32) -> bool {
        Bird::has_route_from(self, prefix, asn)
    }
    fn sessions(&self) -> String {
        self.birdc("show protocols")
    }
    fn routes(&self) -> String {
        self.birdc("show route")
    }
    fn kill(&mut self) {
        Bird::kill(self)
    }
    fn restart(&mut self) {
        Bird::restart(self)
    }
}

impl Router for Frr {
    const NAME: &'static str = "FRR";
    fn start(c: &Cluster) -> Self {
        Frr::start(c.underlay(), &frr_conf(c))
    }
    fn route(&self, prefix: &str) -> String {
        Frr::route(self, prefix)
    }
    fn has_route_from(&self, prefix: &str, asn: u32) -> bool {
        Frr::has_route_from(self, prefix, asn)
    }
    fn sessions(&self) -> String {
        self.vtysh("show bgp summary")
    }
    fn routes(&self) -> String {
        self.vtysh("show bgp ipv4 unicast") + &self.vtysh("show bgp ipv6 unicast")
    }
    fn kill(&mut self) {
        Frr::kill(self)
    }
    fn restart(&mut self) {
        Frr::restart(self)
    }
}

fn bird_conf(c: &Cluster) -> String {
    let mut conf = format!(
        "router id 172.31.1.254;\nprotocol device {{}}\n\
         protocol kernel k4 {{ ipv4 {{ import none; export where source = RTS_BGP; }}; }}\n\
         protocol kernel k6 {{ ipv6 {{ import none; export where source = RTS_BGP; }}; }}\n\
         template bgp node {{ local as {ROUTER_AS}; password \"{PASSWORD}\"; hold time 9; \
         graceful restart on; connect retry time 1; error wait time 1, 2; }}\n"
    );
    for i in 0..c.nodes.len() {
        let (a4, a6) = (c.address(i), c.address6(i));
        let asn = node_as(i);
        conf.push_str(&format!(
            "protocol bgp n{i}v4 from node {{ neighbor {a4} as {asn}; \
             ipv4 {{ import all; export where source = RTS_BGP; }}; }}\n\
             protocol bgp n{i}v6 from node {{ neighbor {a6} as {asn}; \
             ipv6 {{ import all; export where source = RTS_BGP; }}; }}\n"
        ));
    }
    conf
}

/// The same in FRR: bgpd, whose best paths zebra installs in the underlay's kernel. eBGP
/// without policies (`no bgp ebgp-requires-policy`: everything in, everything out); each
/// session carries its own family only; graceful restart both ways (FRR's own restart time,
/// 120 s, is longer than the agents'; the stale paths of a node that comes back wait for its
/// End-of-RIB up to 360 s). Next hops: a node's route goes on to the other node of its subnet
/// with the node's own address (FRR keeps a third-party next hop on a shared network) and to
/// the node of the other subnet with the router's. (Unlike BIRD, FRR also sends each node its
/// own routes back, the peers of an update group sharing their UPDATEs; the agent refuses
/// them, its AS being in their path: `received` counts them, `accepted` does not.)
fn frr_conf(c: &Cluster) -> String {
    let mut neighbors = String::new();
    let (mut v4, mut v6) = (String::new(), String::new());
    for i in 0..c.nodes.len() {
        let asn = node_as(i);
        for (a, family) in [(c.address(i), &mut v4), (c.address6(i), &mut v6)] {
            neighbors.push_str(&format!(
                " neighbor {a} remote-as {asn}\n \
                 neighbor {a} password {PASSWORD}\n \
                 neighbor {a} timers connect 1\n"
            ));
            family.push_str(&format!("  neighbor {a} activate\n"));
        }
    }
    format!(
        "hostname router\n\
         router bgp {ROUTER_AS}\n \
         bgp router-id 172.31.1.254\n \
         bgp log-neighbor-changes\n \
         no bgp ebgp-requires-policy\n \
         no bgp default ipv4-unicast\n \
         bgp graceful-restart\n \
         bgp graceful-restart restart-time 120\n \
         bgp graceful-restart stalepath-time 360\n \
         timers bgp 3 9\n\
         {neighbors} \
         address-family ipv4 unicast\n{v4} \
         exit-address-family\n \
         address-family ipv6 unicast\n{v6} \
         exit-address-family\n"
    )
}

/// The outside: a namespace behind the router (172.31.9.0/24, fd31:9::/64).
fn outside(c: &Cluster) -> Netns {
    let out = Netns::new("bgpo");
    veth(&out, "eth0", c.underlay(), "out0").expect("veth to the router");
    c.underlay()
        .ip_batch("addr add 172.31.9.1/24 dev out0\naddr add fd31:9::1/64 dev out0 nodad\nlink set out0 up")
        .expect("router side");
    out.ip_batch(
        "addr add 172.31.9.2/24 dev eth0\naddr add fd31:9::2/64 dev eth0 nodad\nlink set eth0 up\n\
         route add default via 172.31.9.1\nroute add ::/0 via fd31:9::1",
    )
    .expect("outside addresses");
    out
}

fn text(o: std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn within(secs: u64, what: &str, mut done: impl FnMut() -> bool, show: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "not within {secs} s: {what}\n{}",
            show()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The block of `ip` in the pools above.
fn block_of(ip: &str) -> IpNet {
    let ip: std::net::IpAddr = ip.parse().expect("ip");
    let len = if ip.is_ipv4() { 28 } else { 124 };
    IpNet::new(ip, len).expect("prefix").trunc()
}

fn bgp_json(node: &Node, what: &str) -> Value {
    let out = node.calixctl(&["bgp", what, "-o", "json"]);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "calixctl bgp {what}: {e}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn established(node: &Node) -> usize {
    bgp_json(node, "peers")
        .as_array()
        .map(|a| a.iter().filter(|p| p["state"] == "Established").count())
        .unwrap_or(0)
}

/// calix's routes (protocol 202) on `node`.
fn calix_routes(node: &Node) -> String {
    text(node.ns.exec_ok(&["ip", "route", "show", "proto", "202"]))
        + &text(
            node.ns
                .exec_ok(&["ip", "-6", "route", "show", "proto", "202"]),
        )
}

fn reaches(from: &Netns, to: &Pod, what: &str) {
    for ip in to.ips() {
        assert!(
            from.ping(&ip, 2),
            "{what}: no ping reply from {ip}\nagent log:\n{}",
            to.node.agent_log()
        );
        let addr = SocketAddr::new(ip.parse().expect("ip"), ECHO_PORT);
        echo_roundtrip(from, addr, 64 * 1024, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{what}: TCP to {addr}: {e}"));
    }
}

fn forwarded(node: &Node) -> u64 {
    let out = node.ns.exec_ok(&["nstat", "-az", "-j", "IpForwDatagrams"]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("nstat json");
    v["kernel"]["IpForwDatagrams"].as_u64().unwrap_or(0)
}

fn metric(node: &Node, line: &str) -> Option<String> {
    let (_, body) = node.http_get("/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(line).map(|v| v.trim().to_string()))
}

/// A flow of pings from `from` to `ip` (every 50 ms, `count` of them), running.
fn flow(from: &Netns, ip: &str, count: u32) -> std::process::Child {
    from.cmd(&[
        "ping",
        "-i",
        "0.05",
        "-c",
        &count.to_string(),
        "-W",
        "1",
        "-q",
        ip,
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("ping flow")
}

fn no_overlay_cluster<R: Router>(mode: Mode) {
    let cluster = Cluster::create(mode, &SUBNETS, agent_config);
    let mut router = R::start(&cluster);
    let out = outside(&cluster);
    cluster.start();
    let dual = serde_json::json!({"ipam": {"type": "calix-ipam", "assign_ipv6": "true"}});
    let mut pods: Vec<Pod> = cluster
        .nodes
        .iter()
        .map(|n| Pod::add_with(n, "a", dual.clone()))
        .collect();
    let _servers: Vec<EchoServer> = pods
        .iter()
        .map(|p| EchoServer::start(&p.ns).expect("echo server"))
        .collect();
    let blocks: Vec<Vec<IpNet>> = pods
        .iter()
        .map(|p| p.ips().iter().map(|ip| block_of(ip)).collect())
        .collect();

    // Every block at the router, from its node; every other node's block on each node.
    for (i, bs) in blocks.iter().enumerate() {
        for b in bs {
            within(
                15,
                &format!("the router learns {b} from node {i}"),
                || router.has_route_from(&b.to_string(), node_as(i)),
                || {
                    format!(
                        "{}\nagent log:\n{}",
                        router.sessions(),
                        cluster.nodes[i].agent_log()
                    )
                },
            );
        }
    }
    // Next hops: a node of the same subnet directly (the router passes its address on, a
    // third-party next hop), one of the other subnet through the router.
    for (i, n) in cluster.nodes.iter().enumerate() {
        for (j, bs) in blocks.iter().enumerate().filter(|(j, _)| *j != i) {
            for b in bs {
                let s = cluster.subnets[i];
                let via = match (cluster.subnets[j] == s, b) {
                    (true, IpNet::V4(_)) => cluster.address(j),
                    (true, IpNet::V6(_)) => cluster.address6(j),
                    (false, IpNet::V4(_)) => format!("172.31.{s}.254"),
                    (false, IpNet::V6(_)) => format!("fd31:{s}::fe"),
                };
                let route = format!("{b} via {via} ");
                within(
                    10,
                    &format!("node {i} installs node {j}'s {b} via {via}"),
                    || calix_routes(n).lines().any(|l| l.starts_with(&route)),
                    || format!("{}\n{}", calix_routes(n), n.agent_log()),
                );
            }
        }
        assert!(
            !n.ns.links().iter().any(|l| l.contains("vxlan")),
            "node {i} has a VXLAN device: {:?}",
            n.ns.links()
        );
    }
    // The operator's view.
    let peers = bgp_json(&cluster.nodes[0], "peers");
    assert_eq!(established(&cluster.nodes[0]), 2, "{peers}");
    let tor4 = &peers[0];
    assert_eq!(tor4["name"], "tor4");
    assert_eq!(
        tor4["sent"], 1,
        "node 0's IPv4 block to the IPv4 peer: {tor4}"
    );
    assert_eq!(tor4["accepted"], 2, "the other nodes' IPv4 blocks: {tor4}");
    let routes = bgp_json(&cluster.nodes[0], "routes");
    assert_eq!(routes["complete"], true, "{routes}");
    let table = text(cluster.nodes[0].calixctl(&["bgp", "peers"]));
    assert!(
        table.contains("Established") && table.contains("tor6"),
        "{table}"
    );
    assert_eq!(
        metric(
            &cluster.nodes[0],
            "calix_bgp_session_established{peer=\"tor6\"}"
        )
        .as_deref(),
        Some("1")
    );

    // Pods across nodes and subnets, and the outside, by their own addresses.
    let before: Vec<u64> = cluster.nodes.iter().map(forwarded).collect();
    for from in &pods {
        for to in pods.iter().filter(|t| t.ns.name != from.ns.name) {
            reaches(
                &from.ns,
                to,
                &format!("{} → {}", from.node.ns.name, to.node.ns.name),
            );
        }
    }
    let between: Vec<u64> = cluster.nodes.iter().map(forwarded).collect();
    for to in &pods {
        reaches(&out, to, &format!("outside → {}", to.node.ns.name));
    }
    let after: Vec<u64> = cluster.nodes.iter().map(forwarded).collect();
    let name = R::NAME;
    eprintln!("{name}, {mode:?}: IpForwDatagrams before {before:?}, after the pods' traffic {between:?}, after the outside's {after:?}");
    if mode == Mode::Ebpf {
        // Pod to pod across the routers stays on the fast path. (A pod's replies to an
        // address outside the pools take the host stack, as SNATed traffic does.)
        assert_eq!(
            before, between,
            "eBPF mode went through a node's IP forwarding"
        );
    }

    // kill -9 and a restart of node 1's agent under a flow from outside: the router keeps
    // its routes (stale) meanwhile, nothing is lost.
    let target = pods[1].ip();
    let ping = flow(&out, &target, 100);
    std::thread::sleep(Duration::from_millis(500));
    cluster.nodes[1].kill_agent();
    std::thread::sleep(Duration::from_secs(1));
    let b1 = blocks[1][0].to_string();
    assert!(
        router.has_route_from(&b1, node_as(1)),
        "the router dropped node 1's route:\n{}",
        router.route(&b1)
    );
    cluster.nodes[1].start_agent();
    let done = ping.wait_with_output().expect("ping flow");
    let summary = text(done);
    assert!(
        summary.contains(" 0% packet loss"),
        "the flow lost packets:\n{summary}"
    );
    within(
        15,
        "node 1's sessions back",
        || established(&cluster.nodes[1]) == 2,
        || cluster.nodes[1].agent_log(),
    );
    reaches(&out, &pods[1], "outside → node 1 after its agent's restart");

    // The router crashes and comes back: sessions back, routes learned again both ways.
    router.restart();
    for (i, n) in cluster.nodes.iter().enumerate() {
        within(
            30,
            &format!("node {i}'s sessions back after the router's restart"),
            || established(n) == 2,
            || format!("{}\n{}", router.sessions(), n.agent_log()),
        );
    }
    for to in &pods {
        within(
            10,
            "the outside reaches every pod again",
            || out.ping(&to.ip(), 1),
            || router.routes(),
        );
        reaches(&out, to, "outside, after the router's restart");
    }
    reaches(
        &pods[0].ns,
        &pods[2],
        "node 0 → node 2 after the router's restart",
    );

    // A block released: node 2's only pod goes, its block with it, and the router forgets it.
    pods[2].del();
    for b in &blocks[2] {
        within(
            15,
            &format!("the router forgets {b}"),
            || router.route(&b.to_string()).is_empty(),
            || {
                format!(
                    "{}\n{}",
                    router.route(&b.to_string()),
                    cluster.nodes[2].agent_log()
                )
            },
        );
        within(
            10,
            &format!("node 0 forgets {b}"),
            || !calix_routes(&cluster.nodes[0]).contains(&b.to_string()),
            || calix_routes(&cluster.nodes[0]),
        );
    }

    // Node 1's agent stops and stays away: the router keeps its routes for the restart time,
    // then they go.
    cluster.nodes[1].stop_agent();
    let stopped = Instant::now();
    assert!(
        router.has_route_from(&b1, node_as(1)),
        "dropped at once:\n{}",
        router.route(&b1)
    );
    within(
        RESTART_SECS + 10,
        "node 1's routes withdrawn after the restart time",
        || router.route(&b1).is_empty(),
        || router.route(&b1),
    );
    let gone = stopped.elapsed();
    eprintln!("{name}, {mode:?}: node 1's route left the router {gone:?} after its agent stopped");
    assert!(
        gone >= Duration::from_secs(RESTART_SECS - 2),
        "withdrawn after {gone:?}, before the restart time ({RESTART_SECS} s)"
    );
    drop(pods);
    router.kill();
}

#[test]
fn no_overlay_cluster_over_bgp_bird_ebpf() {
    no_overlay_cluster::<Bird>(Mode::Ebpf);
}

#[test]
fn no_overlay_cluster_over_bgp_bird_kernel() {
    no_overlay_cluster::<Bird>(Mode::Kernel);
}

#[test]
fn no_overlay_cluster_over_bgp_frr_ebpf() {
    no_overlay_cluster::<Frr>(Mode::Ebpf);
}

#[test]
fn no_overlay_cluster_over_bgp_frr_kernel() {
    no_overlay_cluster::<Frr>(Mode::Kernel);
}
