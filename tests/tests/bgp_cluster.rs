//! A cluster with no overlay and no mesh (issue 23): three nodes in two racks (subnets), route
//! distribution off. Each rack has its own router, in a namespace of its own, with an AS of its
//! own: nodes 0 and 1 (subnet 1) peer with rack A's router, node 2 (subnet 2) with rack B's;
//! the two routers peer with each other over a transit link (eBGP), and an "outside"
//! namespace hangs off rack A's. The underlay namespace only switches (its bridges, etcd): it
//! forwards nothing, so every packet between the subnets crosses both routers. Each agent's
//! BGP speaker peers over IPv4 and over IPv6, each session with a TCP MD5 password. One rack's
//! router is BIRD 2 and the other's FRR (zebra and bgpd), both ways round, in both dataplanes:
//! - every node's blocks reach both routers and every other node: the next hop is the node
//!   itself on the same subnet, the rack's router on the other; pods reach each other across
//!   the racks, and the outside reaches every pod by its own address (ping, TCP), with no
//!   VXLAN device anywhere; in eBPF mode no node's IP stack forwards;
//! - each node's routes reach its rack's router with the communities configured on its
//!   peers (`communities`);
//! - `calixctl bgp peers` / `routes` and the metrics say so: node 0's `bgp routes -o json` lists
//!   its blocks advertised to the peer of their family, and the other nodes' blocks learned from
//!   its rack's router, with their next hops and AS paths;
//! - node 1's agent killed with `kill -9` and started again: both routers keep its routes
//!   (graceful restart at rack A's, nothing withdrawn beyond it) and a flow from outside to its
//!   pod loses nothing;
//! - rack A's router crashes and comes back: sessions come back, routes are learned again;
//! - a block released on node 2 disappears from both routers and from node 0;
//! - node 1's agent stops for good: its routes go after the restart time.
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
const PASSWORD: &str = "calix-bgp-cluster";
/// Short, so that "for good" shows within the test.
const RESTART_SECS: u64 = 8;

fn node_as(i: usize) -> u32 {
    64601 + i as u32
}

/// The community node `i` puts on the routes it advertises to its peers.
fn community(i: usize) -> String {
    format!("65100:{}", 100 + i)
}

/// Rack `s`'s router (subnet `s`): its AS, its address on the subnet (every node of the rack's
/// gateway and BGP peer) and on the transit link between the two routers.
struct Rack {
    subnet: u8,
}

impl Rack {
    fn asn(&self) -> u32 {
        65000 + u32::from(self.subnet)
    }
    fn id(&self) -> String {
        format!("172.31.{}.253", self.subnet)
    }
    fn lan4(&self) -> String {
        self.id()
    }
    fn lan6(&self) -> String {
        format!("fd31:{}::fd", self.subnet)
    }
    fn transit4(&self) -> String {
        format!("172.31.12.{}", self.subnet)
    }
    fn transit6(&self) -> String {
        format!("fd31:12::{}", self.subnet)
    }
    /// The other rack.
    fn other(&self) -> Rack {
        Rack {
            subnet: 3 - self.subnet,
        }
    }
    /// The nodes of its subnet.
    fn nodes(&self, c: &Cluster) -> Vec<usize> {
        (0..c.nodes.len())
            .filter(|i| c.subnets[*i] == self.subnet)
            .collect()
    }
}

/// Blocks of 16 IPv4 and 16 IPv6 addresses.
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 28\n\
                     [[pools]]\ncidr = \"fd00:244::/64\"\nblockSize = 124\n";

fn agent_config(i: usize, c: &Cluster) -> String {
    let s = c.subnets[i];
    let password = c.nodes[i].dir.join("bgp-password");
    std::fs::write(&password, format!("{PASSWORD}\n")).expect("password file");
    let rack = Rack { subnet: s };
    let peer = |name: &str, address: String| {
        format!(
            "[[bgp.peers]]\nname = \"{name}\"\naddress = \"{address}\"\nas_number = {}\n\
             password_file = {:?}\nhold_time_secs = 9\ncommunities = [\"{}\"]\n",
            rack.asn(),
            password.display().to_string(),
            community(i)
        )
    };
    format!(
        "resync_interval_secs = 1\nlog_level = \"info,calix_agent::bgp=debug\"\n{}{POOLS}\
         [ipam]\nleakCheckIntervalSecs = 1\nemptyBlockGraceSecs = 0\n\
         [bgp]\nenabled = true\nas_number = {}\nrestart_time_secs = {RESTART_SECS}\n{}{}",
        c.base_config(i),
        node_as(i),
        peer("tor4", rack.lan4()),
        peer("tor6", rack.lan6()),
    )
}

/// A rack's router, in its own namespace: a session per node of the rack and family, and one
/// per family with the other rack's router; the learned routes into its kernel (so it
/// forwards to the pods) and on to every peer.
trait Router {
    const NAME: &'static str;
    fn start(ns: &Netns, rack: &Rack, c: &Cluster) -> Self;
    /// Its entry for `prefix`, for messages; empty when it has none.
    fn route(&self, prefix: &str) -> String;
    /// Whether it has a path for `prefix` that `asn` originated (stale or not).
    fn has_route_from(&self, prefix: &str, asn: u32) -> bool;
    /// Whether its route for `prefix` carries `community` ("asn:value").
    fn has_community(&self, prefix: &str, community: &str) -> bool;
    /// Its sessions, for messages.
    fn sessions(&self) -> String;
    /// Both its sessions with the other rack's router are established.
    fn has_sessions_with_router(&self) -> bool;
    /// Its routes, for messages.
    fn routes(&self) -> String;
    /// kill -9, as a crash.
    fn kill(&mut self);
    /// A crash and a start again.
    fn restart(&mut self);
}

impl Router for Bird {
    const NAME: &'static str = "BIRD";
    fn start(ns: &Netns, rack: &Rack, c: &Cluster) -> Self {
        Bird::start(ns, &bird_conf(rack, c))
    }
    fn route(&self, prefix: &str) -> String {
        Bird::route(self, prefix)
    }
    fn has_route_from(&self, prefix: &str, asn: u32) -> bool {
        Bird::has_route_from(self, prefix, asn)
    }
    fn has_community(&self, prefix: &str, community: &str) -> bool {
        Bird::has_community(self, prefix, community)
    }
    fn sessions(&self) -> String {
        self.birdc("show protocols")
    }
    fn has_sessions_with_router(&self) -> bool {
        let p = self.birdc("show protocols");
        ["rack4", "rack6"].iter().all(|r| {
            p.lines()
                .any(|l| l.starts_with(r) && l.contains("Established"))
        })
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
    fn start(ns: &Netns, rack: &Rack, c: &Cluster) -> Self {
        Frr::start(ns, &frr_conf(rack, c))
    }
    fn route(&self, prefix: &str) -> String {
        Frr::route(self, prefix)
    }
    fn has_route_from(&self, prefix: &str, asn: u32) -> bool {
        Frr::has_route_from(self, prefix, asn)
    }
    fn has_community(&self, prefix: &str, community: &str) -> bool {
        Frr::has_community(self, prefix, community)
    }
    fn sessions(&self) -> String {
        self.vtysh("show bgp summary")
    }
    fn has_sessions_with_router(&self) -> bool {
        ["172.31.12", "fd31:12::"]
            .iter()
            .all(|p| self.established_with(p))
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

fn bird_conf(rack: &Rack, c: &Cluster) -> String {
    let (asn, other) = (rack.asn(), rack.other());
    let mut conf = format!(
        "router id {};\nprotocol device {{}}\n\
         protocol kernel k4 {{ ipv4 {{ import none; export where source = RTS_BGP; }}; }}\n\
         protocol kernel k6 {{ ipv6 {{ import none; export where source = RTS_BGP; }}; }}\n\
         template bgp common {{ local as {asn}; hold time 9; graceful restart on; \
         connect retry time 1; error wait time 1, 2; }}\n\
         template bgp node from common {{ password \"{PASSWORD}\"; }}\n\
         protocol bgp rack4 from common {{ neighbor {} as {}; \
         ipv4 {{ import all; export where source = RTS_BGP; }}; }}\n\
         protocol bgp rack6 from common {{ neighbor {} as {}; \
         ipv6 {{ import all; export where source = RTS_BGP; }}; }}\n",
        rack.id(),
        other.transit4(),
        other.asn(),
        other.transit6(),
        other.asn(),
    );
    for i in rack.nodes(c) {
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

/// The same in FRR: bgpd, whose best paths zebra installs in the router's kernel. eBGP
/// without policies (`no bgp ebgp-requires-policy`: everything in, everything out); each
/// session carries its own family only; graceful restart both ways (FRR's own restart time,
/// 120 s, is longer than the agents'; the stale paths of a node that comes back wait for its
/// End-of-RIB up to 360 s). Next hops: a node's route goes on to another node of its subnet
/// with the node's own address (FRR keeps a third-party next hop on a shared network), to the
/// other router with its own. (Unlike BIRD, FRR also sends each node its own routes back, the
/// peers of an update group sharing their UPDATEs; the agent refuses them, its AS being in
/// their path: `received` counts them, `accepted` does not.)
fn frr_conf(rack: &Rack, c: &Cluster) -> String {
    let other = rack.other();
    let mut neighbors = String::new();
    let (mut v4, mut v6) = (String::new(), String::new());
    for i in rack.nodes(c) {
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
    for (a, family) in [(other.transit4(), &mut v4), (other.transit6(), &mut v6)] {
        neighbors.push_str(&format!(
            " neighbor {a} remote-as {}\n neighbor {a} timers connect 1\n",
            other.asn()
        ));
        family.push_str(&format!("  neighbor {a} activate\n"));
    }
    format!(
        "hostname rack{}\n\
         router bgp {}\n \
         bgp router-id {}\n \
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
         exit-address-family\n",
        rack.subnet,
        rack.asn(),
        rack.id()
    )
}

/// The racks' routers' namespaces (subnet 1's, subnet 2's) and the outside's, wired: each
/// router a port of its subnet's bridge (`.253`, `::fd`), the two joined by a transit link
/// (172.31.12.0/24, fd31:12::/64), the outside (172.31.9.0/24, fd31:9::/64) behind rack A's.
/// The underlay stops forwarding and every node's default route goes to its rack's router.
struct Racks {
    a: Netns,
    b: Netns,
    outside: Netns,
}

fn racks(c: &Cluster) -> Racks {
    let under = c.underlay();
    under
        .sysctl("net.ipv4.ip_forward=0")
        .expect("the underlay stops forwarding");
    under
        .sysctl("net.ipv6.conf.all.forwarding=0")
        .expect("the underlay stops forwarding");
    let routers: Vec<Netns> = [1u8, 2]
        .into_iter()
        .map(|s| {
            let rack = Rack { subnet: s };
            let ns = Netns::new(&format!("bgpr{s}"));
            let port = format!("rk{s}");
            veth(&ns, "lan", under, &port).expect("veth to the subnet");
            under
                .ip(&format!("link set {port} master br{} up", (b'a' + s - 1) as char))
                .expect("router on the bridge");
            ns.ip_batch(&format!(
                "addr add {}/24 dev lan\naddr add {}/64 dev lan nodad\nlink set lan up\nlink set lo up",
                rack.lan4(),
                rack.lan6()
            ))
            .expect("router addresses");
            ns.sysctl("net.ipv4.ip_forward=1").expect("forwarding");
            ns.sysctl("net.ipv6.conf.all.forwarding=1")
                .expect("forwarding");
            ns
        })
        .collect();
    let [a, b]: [Netns; 2] = routers.try_into().unwrap_or_else(|_| panic!("two routers"));
    veth(&a, "transit", &b, "transit").expect("transit link");
    for (ns, rack) in [(&a, Rack { subnet: 1 }), (&b, Rack { subnet: 2 })] {
        ns.ip_batch(&format!(
            "addr add {}/24 dev transit\naddr add {}/64 dev transit nodad\nlink set transit up",
            rack.transit4(),
            rack.transit6()
        ))
        .expect("transit addresses");
    }
    let outside = Netns::new("bgpo");
    veth(&outside, "eth0", &a, "out").expect("veth to rack A's router");
    a.ip_batch(
        "addr add 172.31.9.1/24 dev out\naddr add fd31:9::1/64 dev out nodad\nlink set out up",
    )
    .expect("router side");
    outside
        .ip_batch(
            "addr add 172.31.9.2/24 dev eth0\naddr add fd31:9::2/64 dev eth0 nodad\nlink set eth0 up\n\
             route add default via 172.31.9.1\nroute add ::/0 via fd31:9::1",
        )
        .expect("outside addresses");
    // Rack B reaches the outside through rack A (not a BGP matter: the pods' are).
    b.ip_batch(&format!(
        "route add 172.31.9.0/24 via {}\nroute add fd31:9::/64 via {}",
        Rack { subnet: 1 }.transit4(),
        Rack { subnet: 1 }.transit6()
    ))
    .expect("rack B to the outside");
    for (i, n) in c.nodes.iter().enumerate() {
        let rack = Rack {
            subnet: c.subnets[i],
        };
        n.ns.ip_batch(&format!(
            "route replace default via {}\nroute replace ::/0 via {}",
            rack.lan4(),
            rack.lan6()
        ))
        .expect("the node's default route to its rack's router");
    }
    // Until every router answers on each of its links.
    for (ns, peer) in [
        (&a, "172.31.12.2"),
        (&a, "fd31:12::2"),
        (&a, "172.31.9.2"),
        (&a, "fd31:9::2"),
    ] {
        within(
            10,
            &format!("{peer} answers"),
            || ns.ping(peer, 1),
            String::new,
        );
    }
    for (i, n) in c.nodes.iter().enumerate() {
        let rack = Rack {
            subnet: c.subnets[i],
        };
        // A port added to a bridge can change the bridge's own MAC address: the nodes forget
        // what they learned of the underlay (etcd's address), so they ask again.
        n.ns.ip("neigh flush all")
            .expect("flush the node's neighbours");
        let s = c.subnets[i];
        for gw in [
            rack.lan4(),
            rack.lan6(),
            format!("172.31.{s}.254"),
            format!("fd31:{s}::fe"),
        ] {
            within(
                10,
                &format!("node {i} reaches {gw}"),
                || n.ns.ping(&gw, 1),
                String::new,
            );
        }
    }
    Racks { a, b, outside }
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

/// Whether both routers have a path for `prefix` that `asn` originated.
fn both_have(a: &impl Router, b: &impl Router, prefix: &str, asn: u32) -> bool {
    a.has_route_from(prefix, asn) && b.has_route_from(prefix, asn)
}

/// Both routers' entries for `prefix`, for messages.
fn routes_of(a: &impl Router, b: &impl Router, prefix: &str) -> String {
    format!("rack A:\n{}\nrack B:\n{}", a.route(prefix), b.route(prefix))
}

/// One line of `calixctl bgp routes -o json`: prefix, next hop, peer, AS path.
type Line = (String, String, String, Vec<u32>);

fn lines(routes: &Value, which: &str, keep: impl Fn(&Value) -> bool) -> Vec<Line> {
    let mut out: Vec<Line> = routes[which]
        .as_array()
        .unwrap_or_else(|| panic!("no {which:?} list in {routes}"))
        .iter()
        .filter(|l| keep(l))
        .map(|l| {
            let s = |k: &str| l[k].as_str().unwrap_or_default().to_string();
            let path = l["as_path"].as_array().into_iter().flatten();
            let path = path.filter_map(|a| a.as_u64().and_then(|a| u32::try_from(a).ok()));
            let path = path.collect();
            (s("prefix"), s("next_hop"), s("peer"), path)
        })
        .collect();
    out.sort();
    out
}

/// Node 0's `calixctl bgp routes -o json`: its blocks advertised to the peer of their family
/// (next hop: the node), and the other nodes' blocks learned from rack A's router with the
/// next hop it installs and the AS path they came by, installed and not stale. A route refused
/// by the import rule can only be one of node 0's own blocks (FRR sends them back).
fn check_routes_report(routes: &Value, c: &Cluster, blocks: &[Vec<IpNet>]) {
    let peer_of = |b: &IpNet| match b {
        IpNet::V4(_) => "tor4".to_string(),
        IpNet::V6(_) => "tor6".to_string(),
    };
    let mut advertised: Vec<Line> = blocks[0]
        .iter()
        .map(|b| {
            let hop = match b {
                IpNet::V4(_) => c.address(0),
                IpNet::V6(_) => c.address6(0),
            };
            (b.to_string(), hop, peer_of(b), Vec::new())
        })
        .collect();
    advertised.sort();
    assert_eq!(
        lines(routes, "advertised", |_| true),
        advertised,
        "node 0's blocks, each to the peer of its family: {routes}"
    );
    let (rack_a, rack_b) = (Rack { subnet: 1 }, Rack { subnet: 2 });
    let mut learned = Vec::new();
    for (j, bs) in blocks.iter().enumerate().skip(1) {
        let same = c.subnets[j] == rack_a.subnet;
        for b in bs {
            let hop = match (same, b) {
                (true, IpNet::V4(_)) => c.address(j),
                (true, IpNet::V6(_)) => c.address6(j),
                (false, IpNet::V4(_)) => rack_a.lan4(),
                (false, IpNet::V6(_)) => rack_a.lan6(),
            };
            let path = if same {
                vec![rack_a.asn(), node_as(j)]
            } else {
                vec![rack_a.asn(), rack_b.asn(), node_as(j)]
            };
            learned.push((b.to_string(), hop, peer_of(b), path));
        }
    }
    learned.sort();
    let taken = |l: &Value| l["accepted"] == true;
    assert_eq!(
        lines(routes, "learned", taken),
        learned,
        "the other nodes' blocks, from rack A's router: {routes}"
    );
    let installed = |l: &Value| taken(l) && l["installed"] == true && l["stale"] == false;
    assert_eq!(
        lines(routes, "learned", installed).len(),
        learned.len(),
        "every learned route installed, none stale: {routes}"
    );
    let own: Vec<String> = blocks[0].iter().map(ToString::to_string).collect();
    for (prefix, ..) in lines(routes, "learned", |l| l["accepted"] == false) {
        assert!(own.contains(&prefix), "{prefix} refused: {routes}");
    }
}

fn no_overlay_cluster<A: Router, B: Router>(mode: Mode) {
    let cluster = Cluster::create(mode, &SUBNETS, agent_config);
    let net = racks(&cluster);
    let (rack_a, rack_b) = (Rack { subnet: 1 }, Rack { subnet: 2 });
    let mut router_a = A::start(&net.a, &rack_a, &cluster);
    let router_b = B::start(&net.b, &rack_b, &cluster);
    let out = &net.outside;
    let name = format!("rack A {}, rack B {}", A::NAME, B::NAME);
    within(
        30,
        "the routers' sessions with each other",
        || router_a.has_sessions_with_router() && router_b.has_sessions_with_router(),
        || format!("{}\n{}", router_a.sessions(), router_b.sessions()),
    );
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

    // Every block at both routers, from its node; every other node's block on each node.
    for (i, bs) in blocks.iter().enumerate() {
        for b in bs {
            within(
                15,
                &format!("both routers learn {b} from node {i}"),
                || both_have(&router_a, &router_b, &b.to_string(), node_as(i)),
                || {
                    format!(
                        "{}\n{}\n{}\nagent log:\n{}",
                        router_a.sessions(),
                        router_b.sessions(),
                        routes_of(&router_a, &router_b, &b.to_string()),
                        cluster.nodes[i].agent_log()
                    )
                },
            );
        }
    }
    // Each node's blocks carry its community at its own rack's router (BIRD or FRR).
    for (i, bs) in blocks.iter().enumerate() {
        for b in bs.iter().map(ToString::to_string) {
            let c = community(i);
            let (has, shown) = if cluster.subnets[i] == rack_a.subnet {
                (router_a.has_community(&b, &c), router_a.route(&b))
            } else {
                (router_b.has_community(&b, &c), router_b.route(&b))
            };
            assert!(
                has,
                "node {i}'s {b} reached its rack's router without the community {c}:\n{shown}"
            );
        }
    }
    // Next hops: a node of the same subnet directly (the router passes its address on, a
    // third-party next hop), one of the other rack through the node's own rack's router.
    for (i, n) in cluster.nodes.iter().enumerate() {
        for (j, bs) in blocks.iter().enumerate().filter(|(j, _)| *j != i) {
            for b in bs {
                let rack = Rack {
                    subnet: cluster.subnets[i],
                };
                let via = match (cluster.subnets[j] == rack.subnet, b) {
                    (true, IpNet::V4(_)) => cluster.address(j),
                    (true, IpNet::V6(_)) => cluster.address6(j),
                    (false, IpNet::V4(_)) => rack.lan4(),
                    (false, IpNet::V6(_)) => rack.lan6(),
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
    check_routes_report(&routes, &cluster, &blocks);
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

    // Pods across nodes and racks, and the outside, by their own addresses.
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
        reaches(out, to, &format!("outside → {}", to.node.ns.name));
    }
    let after: Vec<u64> = cluster.nodes.iter().map(forwarded).collect();
    eprintln!("{name}, {mode:?}: IpForwDatagrams before {before:?}, after the pods' traffic {between:?}, after the outside's {after:?}");
    if mode == Mode::Ebpf {
        // Pod to pod across the routers stays on the fast path. (A pod's replies to an
        // address outside the pools take the host stack, as SNATed traffic does.)
        assert_eq!(
            before, between,
            "eBPF mode went through a node's IP forwarding"
        );
    }

    // kill -9 and a restart of node 1's agent under a flow from outside: rack A's router
    // keeps its routes (stale) meanwhile, rack B's never loses them, nothing is lost.
    let target = pods[1].ip();
    let ping = flow(out, &target, 100);
    std::thread::sleep(Duration::from_millis(500));
    cluster.nodes[1].kill_agent();
    std::thread::sleep(Duration::from_secs(1));
    let b1 = blocks[1][0].to_string();
    assert!(
        both_have(&router_a, &router_b, &b1, node_as(1)),
        "a router dropped node 1's route:\n{}",
        routes_of(&router_a, &router_b, &b1)
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
    reaches(out, &pods[1], "outside → node 1 after its agent's restart");

    // Rack A's router crashes and comes back: sessions back, routes learned again both ways.
    router_a.restart();
    for (i, n) in cluster.nodes.iter().enumerate() {
        within(
            30,
            &format!("node {i}'s sessions back after rack A's router's restart"),
            || established(n) == 2,
            || format!("{}\n{}", router_a.sessions(), n.agent_log()),
        );
    }
    within(
        30,
        "the routers' sessions with each other back",
        || router_a.has_sessions_with_router() && router_b.has_sessions_with_router(),
        || format!("{}\n{}", router_a.sessions(), router_b.sessions()),
    );
    for to in &pods {
        within(
            15,
            "the outside reaches every pod again",
            || out.ping(&to.ip(), 1),
            || format!("{}\n{}", router_a.routes(), router_b.routes()),
        );
        reaches(out, to, "outside, after rack A's router's restart");
    }
    reaches(
        &pods[0].ns,
        &pods[2],
        "node 0 → node 2 after rack A's router's restart",
    );

    // A block released: node 2's only pod goes, its block with it, and both routers and
    // node 0 forget it.
    pods[2].del();
    for b in &blocks[2] {
        within(
            15,
            &format!("the routers forget {b}"),
            || {
                router_a.route(&b.to_string()).is_empty()
                    && router_b.route(&b.to_string()).is_empty()
            },
            || {
                format!(
                    "{}\n{}",
                    routes_of(&router_a, &router_b, &b.to_string()),
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

    // Node 1's agent stops and stays away: rack A's router keeps its routes for the restart
    // time, then they go, from rack B's as well.
    cluster.nodes[1].stop_agent();
    let stopped = Instant::now();
    assert!(
        both_have(&router_a, &router_b, &b1, node_as(1)),
        "dropped at once:\n{}",
        routes_of(&router_a, &router_b, &b1)
    );
    within(
        RESTART_SECS + 10,
        "node 1's routes withdrawn after the restart time",
        || router_a.route(&b1).is_empty() && router_b.route(&b1).is_empty(),
        || routes_of(&router_a, &router_b, &b1),
    );
    let gone = stopped.elapsed();
    eprintln!("{name}, {mode:?}: node 1's route left the routers {gone:?} after its agent stopped");
    assert!(
        gone >= Duration::from_secs(RESTART_SECS - 2),
        "withdrawn after {gone:?}, before the restart time ({RESTART_SECS} s)"
    );
    drop(pods);
    router_a.kill();
}

#[test]
fn no_overlay_cluster_over_bgp_bird_frr_ebpf() {
    no_overlay_cluster::<Bird, Frr>(Mode::Ebpf);
}

#[test]
fn no_overlay_cluster_over_bgp_bird_frr_kernel() {
    no_overlay_cluster::<Bird, Frr>(Mode::Kernel);
}

#[test]
fn no_overlay_cluster_over_bgp_frr_bird_ebpf() {
    no_overlay_cluster::<Frr, Bird>(Mode::Ebpf);
}

#[test]
fn no_overlay_cluster_over_bgp_frr_bird_kernel() {
    no_overlay_cluster::<Frr, Bird>(Mode::Kernel);
}
