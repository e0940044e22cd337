//! A hostile or broken BGP peer cannot hurt the node (issue 23): a real agent peers with
//! test peers that speak raw BGP from the underlay namespace, each on its own address:
//! - `raw-a` (limit 5, refuse): a route it announces is installed; the same route again with a
//!   malformed ORIGIN is withdrawn (RFC 7606 treat-as-withdraw) and the session stays up; ten
//!   more routes: five are taken, the rest refused, the session stays up;
//!   then 20,000 UPDATEs withdrawing and announcing five routes, then two withdrawn: memory
//!   stays bounded and the end state is right;
//! - `raw-b` (limit 5, reset): six routes end the session with Cease "maximum number of
//!   prefixes reached", and its routes go;
//! - `raw-c`: its OPEN names an AS other than the one configured: refused with OPEN Message
//!   Error "Bad Peer AS", never established.
//!
//! - `raw-d`: nothing listens at its address, so the agent cannot reach it; it connects to the
//!   node's BGP port itself, and its session is established on that connection;
//! - `raw-a` connects to the node again while its session is Established: the new connection
//!   is closed with Cease "connection collision resolution" (RFC 4271 §6.8) and the session
//!   stays;
//! - `raw-e` has a TCP MD5 password: its connections to the node without it or with another
//!   never open; with it, its session is established;
//! - `raw-f` stops reading (it asks for the routes again and again and reads no answer): the
//!   agent's writes wait at most the hold time, then the session ends; memory stays bounded;
//! - an address that is no configured peer's connects to the node: closed at once.
//!
//! Each is counted (calixctl bgp peers, /metrics) and logged; what the node announces (its
//! Service ClusterIP range, `service_cluster_ips`) reaches the peers; a peer's trouble does not touch
//! another's session. Run as root.
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use calix_bgp::update::AsSegment;
use calix_bgp::{Family, Message, PathAttributes, UpdateBuilder};
use calix_testbed::{Cluster, Dataplane as Mode, Node};
use common::raw_bgp::Raw;
use ipnet::IpNet;
use serde_json::Value;

mod common;

const PEER_AS: u32 = 65000;
const NODE_AS: u32 = 64601;
/// The peers' addresses on the node's subnet, in the underlay namespace.
const PEERS: [(&str, &str, &str); 6] = [
    ("raw-a", "172.31.1.251", "refuse"),
    ("raw-b", "172.31.1.252", "reset"),
    ("raw-c", "172.31.1.253", "refuse"),
    ("raw-d", "172.31.1.249", "refuse"),
    ("raw-e", "172.31.1.247", "refuse"),
    ("raw-f", "172.31.1.246", "refuse"),
];
/// raw-e's TCP MD5 password.
const PASSWORD: &[u8] = b"calix-bad-peers";
/// No configured peer's.
const STRANGER: &str = "172.31.1.248";

fn config(i: usize, c: &Cluster) -> String {
    let password = c.nodes[i].dir.join("bgp-password");
    std::fs::write(&password, PASSWORD).expect("password file");
    let mut peers = String::new();
    for (name, addr, action) in PEERS {
        peers.push_str(&format!(
            "[[bgp.peers]]\nname = \"{name}\"\naddress = \"{addr}\"\nas_number = {PEER_AS}\n\
             max_prefixes = 5\nmax_prefixes_action = \"{action}\"\n"
        ));
        if name == "raw-f" {
            peers.push_str("hold_time_secs = 3\n");
        }
        if name == "raw-e" {
            peers.push_str(&format!(
                "password_file = {:?}\n",
                password.display().to_string()
            ));
        }
    }
    format!(
        "{}[[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 28\n\
         [bgp]\nenabled = true\nas_number = {NODE_AS}\nnode_addresses = [\"{}\"]\n\
         service_cluster_ips = [\"10.96.0.0/16\"]\n{peers}",
        c.base_config(i),
        c.address(i)
    )
}

fn builder() -> UpdateBuilder {
    UpdateBuilder {
        four_octet_as: true,
        attributes: PathAttributes {
            as_path: vec![AsSegment {
                set: false,
                asns: vec![PEER_AS],
            }],
            ..PathAttributes::default()
        },
    }
}

fn nets(first: u8, n: u8) -> Vec<IpNet> {
    (first..first + n)
        .map(|i| format!("10.244.{i}.0/28").parse().expect("net"))
        .collect()
}

fn announce(raw: &mut Raw, prefixes: &[IpNet], hop: &str) {
    for m in builder().announce(
        Family::IPV4_UNICAST,
        hop.parse().expect("ip"),
        None,
        prefixes,
    ) {
        raw.send(&m);
    }
}

fn peer<'a>(report: &'a Value, name: &str) -> &'a Value {
    report
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("no peer {name} in {report}"))
}

fn peers(node: &Node) -> Value {
    let out = node.calixctl(&["bgp", "peers", "-o", "json"]);
    serde_json::from_slice(&out.stdout).expect("calixctl bgp peers -o json")
}

fn kernel_routes(node: &Node) -> String {
    String::from_utf8_lossy(
        &node
            .ns
            .exec_ok(&["ip", "route", "show", "proto", "202"])
            .stdout,
    )
    .into_owned()
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

fn metric(node: &Node, line: &str) -> Option<String> {
    let (_, body) = node.http_get("/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(line).map(|v| v.trim().to_string()))
}

#[test]
fn hostile_peers_are_handled_by_the_rfcs_rules() {
    let cluster = Cluster::create(Mode::Ebpf, &[1], config);
    let under = cluster.underlay();
    for addr in PEERS.iter().map(|p| p.1).chain([STRANGER]) {
        under
            .ip(&format!("addr add {addr}/24 dev bra"))
            .expect("peer address");
    }
    // raw-d's address has nothing listening.
    let listeners: Vec<TcpListener> = PEERS[..3]
        .iter()
        .map(|(_, addr, _)| {
            let sa: SocketAddr = format!("{addr}:179").parse().expect("addr");
            under.run(move || TcpListener::bind(sa).expect("listen on 179"))
        })
        .collect();
    cluster.start();
    let node = &cluster.nodes[0];
    let (mut a, mut b, mut c) = (
        Raw::accept(&listeners[0]),
        Raw::accept(&listeners[1]),
        Raw::accept(&listeners[2]),
    );
    a.open(PEER_AS);
    b.open(PEER_AS);
    // What the node announces: its Service range (it has no pods, so no block), then its
    // End-of-RIB.
    let mut announced = Vec::new();
    loop {
        match a.message().expect("the agent's UPDATEs") {
            Message::Update(u) if u.end_of_rib.is_some() => break,
            Message::Update(u) => announced.extend(u.announced),
            _ => {}
        }
    }
    assert_eq!(
        announced,
        [(
            "10.96.0.0/16".parse::<IpNet>().expect("net"),
            "172.31.1.1".parse::<std::net::IpAddr>().expect("ip")
        )],
        "the Service range via the node"
    );

    // raw-c: the wrong AS.
    c.open(65099);
    let n = c
        .next_notification()
        .expect("a NOTIFICATION for the wrong AS");
    assert_eq!(
        (n.code, n.subcode),
        (2, 2),
        "OPEN Message Error, Bad Peer AS: {n:?}"
    );

    within(
        10,
        "raw-a and raw-b established",
        || {
            let p = peers(node);
            peer(&p, "raw-a")["state"] == "Established"
                && peer(&p, "raw-b")["state"] == "Established"
        },
        || node.agent_log(),
    );

    // raw-a: a good route, then the same with a malformed ORIGIN.
    let good = nets(200, 1);
    announce(&mut a, &good, "172.31.1.251");
    within(
        5,
        "raw-a's route installed",
        || kernel_routes(node).contains("10.244.200.0/28 via 172.31.1.251"),
        || kernel_routes(node),
    );
    let mut bad = builder().announce(
        Family::IPV4_UNICAST,
        "172.31.1.251".parse().expect("ip"),
        None,
        &good,
    );
    let m = &mut bad[0];
    let at = m
        .windows(4)
        .position(|w| w == [0x40, 0x01, 0x01, 0x00])
        .expect("the ORIGIN attribute");
    m[at + 3] = 7;
    a.send(m);
    within(
        5,
        "the malformed route withdrawn",
        || !kernel_routes(node).contains("10.244.200.0/28"),
        || format!("{}\n{}", kernel_routes(node), node.agent_log()),
    );
    let p = peers(node);
    assert_eq!(
        peer(&p, "raw-a")["state"],
        "Established",
        "the session stays up: {p}"
    );
    assert_eq!(peer(&p, "raw-a")["malformed_updates"], 1, "{p}");

    // raw-a: ten routes over a limit of five: five taken, the session up.
    announce(&mut a, &nets(210, 10), "172.31.1.251");
    within(
        5,
        "five of ten taken",
        || {
            let p = peers(node);
            peer(&p, "raw-a")["refused_over_limit"] == 5
        },
        || peers(node).to_string(),
    );
    let p = peers(node);
    assert_eq!(peer(&p, "raw-a")["received"], 5, "{p}");
    assert_eq!(peer(&p, "raw-a")["state"], "Established", "{p}");
    within(
        5,
        "five routes installed",
        || kernel_routes(node).matches("via 172.31.1.251").count() == 5,
        || kernel_routes(node),
    );

    // raw-a floods: 20,000 UPDATEs withdrawing and announcing its five routes again. The
    // agent's memory stays where it was, and the end state is right.
    let rss = || {
        let pid = node.agent_pid().expect("agent pid");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
    };
    let before = rss();
    let five = nets(210, 5);
    let withdraw = builder().withdraw(Family::IPV4_UNICAST, &five);
    let again = builder().announce(
        Family::IPV4_UNICAST,
        "172.31.1.251".parse().expect("ip"),
        None,
        &five,
    );
    let flood_started = Instant::now();
    for _ in 0..10_000 {
        a.send(&withdraw[0]);
        a.send(&again[0]);
    }
    // Last, two of them withdrawn: an end state that shows every UPDATE was read.
    a.send(&builder().withdraw(Family::IPV4_UNICAST, &five[..2])[0]);
    within(
        30,
        "the flood's end state: three routes",
        || {
            let p = peers(node);
            peer(&p, "raw-a")["received"] == 3
                && kernel_routes(node).matches("via 172.31.1.251").count() == 3
        },
        || kernel_routes(node),
    );
    let after = rss();
    eprintln!(
        "20,000 UPDATEs taken in {:?}; agent RSS {before} kB before, {after} kB after",
        flood_started.elapsed()
    );
    assert!(
        after < before + 20 * 1024,
        "the flood grew the agent by {} kB",
        after - before
    );
    assert_eq!(peer(&peers(node), "raw-a")["state"], "Established");

    // raw-b: six routes over a limit of five with "reset": Cease 1, the routes go.
    announce(&mut b, &nets(230, 6), "172.31.1.252");
    let n = b.next_notification().expect("a NOTIFICATION for the limit");
    assert_eq!(
        (n.code, n.subcode),
        (6, 1),
        "Cease, maximum number of prefixes: {n:?}"
    );
    within(
        5,
        "raw-b's reset counted",
        || peer(&peers(node), "raw-b")["limit_resets"] == 1,
        || peers(node).to_string(),
    );
    assert!(
        !kernel_routes(node).contains("via 172.31.1.252"),
        "{}",
        kernel_routes(node)
    );

    // raw-d: the agent cannot reach it; it connects to the node's port itself.
    let node_ip = cluster.address(0);
    let mut d = Raw::dial(under, PEERS[3].1, &node_ip);
    d.send_open(PEER_AS, Ipv4Addr::new(172, 31, 1, 249));
    let theirs = d.message().expect("the agent's OPEN on raw-d's connection");
    assert!(matches!(theirs, Message::Open(_)), "{theirs:?}");
    d.send(&Message::Keepalive.encode(true));
    within(
        10,
        "raw-d established on the connection it opened",
        || peer(&peers(node), "raw-d")["state"] == "Established",
        || format!("{}\n{}", peers(node), node.agent_log()),
    );
    let mut from_d = Vec::new();
    loop {
        match d.message().expect("the agent's UPDATEs to raw-d") {
            Message::Update(u) if u.end_of_rib.is_some() => break,
            Message::Update(u) => from_d.extend(u.announced.into_iter().map(|(n, _)| n)),
            _ => {}
        }
    }
    assert_eq!(
        from_d,
        ["10.96.0.0/16".parse::<IpNet>().expect("net")],
        "raw-d hears the node's routes"
    );

    // raw-a again, while its session is Established (a higher BGP identifier does not
    // matter then): the new connection is closed with Cease 7, the session stays.
    let mut a2 = Raw::dial(under, PEERS[0].1, &node_ip);
    a2.send_open(PEER_AS, Ipv4Addr::new(172, 31, 1, 255));
    let n = a2
        .next_notification()
        .expect("a NOTIFICATION on the colliding connection");
    assert_eq!(
        (n.code, n.subcode),
        (6, 7),
        "Cease, connection collision resolution: {n:?}"
    );
    a.send(&Message::Keepalive.encode(true));

    // raw-e has a password: its connections without it, or with another, never open (the
    // kernel drops their segments); with it, the session is established.
    for (key, what) in [
        (None, "no password"),
        (Some(&b"not-the-password"[..]), "a wrong password"),
    ] {
        let r = Raw::try_dial(under, PEERS[4].1, &node_ip, key);
        assert!(r.is_err(), "raw-e's connection with {what} opened");
    }
    let mut e = Raw::try_dial(under, PEERS[4].1, &node_ip, Some(PASSWORD))
        .expect("raw-e's connection with its password opens");
    e.send_open(PEER_AS, Ipv4Addr::new(172, 31, 1, 247));
    let theirs = e.message().expect("the agent's OPEN on raw-e's connection");
    assert!(matches!(theirs, Message::Open(_)), "{theirs:?}");
    e.send(&Message::Keepalive.encode(true));
    within(
        10,
        "raw-e established with its password",
        || peer(&peers(node), "raw-e")["state"] == "Established",
        || format!("{}\n{}", peers(node), node.agent_log()),
    );
    a.send(&Message::Keepalive.encode(true));

    // raw-f stops reading: it asks for the node's routes again and again (ROUTE-REFRESH)
    // and reads none of the answers. The agent's writes wait at most the hold time (3 s),
    // then the session ends; its memory stays bounded and the other sessions stay.
    let mut f = Raw::dial(under, PEERS[5].1, &node_ip);
    f.send_open(PEER_AS, Ipv4Addr::new(172, 31, 1, 246));
    let theirs = f.message().expect("the agent's OPEN on raw-f's connection");
    assert!(matches!(theirs, Message::Open(_)), "{theirs:?}");
    f.send(&Message::Keepalive.encode(true));
    within(
        10,
        "raw-f established",
        || peer(&peers(node), "raw-f")["state"] == "Established",
        || format!("{}\n{}", peers(node), node.agent_log()),
    );
    let before = rss();
    let refresh = Message::RouteRefresh {
        family: Family::IPV4_UNICAST,
        subtype: 0,
    }
    .encode(true)
    .repeat(1000);
    f.s.set_write_timeout(Some(Duration::from_secs(1)))
        .expect("write timeout");
    let flood = Instant::now();
    let mut asked = 0u64;
    while flood.elapsed() < Duration::from_secs(20) && f.s.write_all(&refresh).is_ok() {
        asked += 1000;
    }
    within(
        15,
        "raw-f's session ended: it read nothing",
        || {
            peer(&peers(node), "raw-f")["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("read nothing"))
        },
        || format!("{}\n{}", peers(node), node.agent_log()),
    );
    let after = rss();
    eprintln!(
        "raw-f asked {asked} times without reading; its session ended {:?} after the flood began; agent RSS {before} kB before, {after} kB after",
        flood.elapsed()
    );
    assert!(
        after < before + 20 * 1024,
        "a peer that stops reading grew the agent by {} kB",
        after - before
    );
    a.send(&Message::Keepalive.encode(true));

    // A stranger: closed at once, without a word.
    let mut x = Raw::dial(under, STRANGER, &node_ip);
    assert!(x.read().is_none(), "a stranger's connection is closed");
    within(
        5,
        "the stranger counted",
        || metric(node, "calix_bgp_refused_connections_total").as_deref() == Some("1"),
        || node.agent_log(),
    );

    // raw-a was never touched by the others' trouble.
    let p = peers(node);
    assert_eq!(peer(&p, "raw-a")["state"], "Established", "{p}");
    assert_eq!(peer(&p, "raw-a")["down_total"], 0, "{p}");
    assert!(
        peer(&p, "raw-c")["open_refused"].as_u64().unwrap_or(0) >= 1,
        "{p}"
    );
    assert_ne!(peer(&p, "raw-c")["state"], "Established", "{p}");
    let table = String::from_utf8_lossy(&node.calixctl(&["bgp", "peers"]).stdout).into_owned();
    assert!(
        table.contains("1 malformed UPDATE(s), 5 route(s) over the limit"),
        "{table}"
    );
    assert!(
        table.contains(&format!("listening on {node_ip}:179"))
            && table.contains("1 connection(s) from no configured peer closed"),
        "{table}"
    );
    for (line, want) in [
        ("calix_bgp_malformed_updates_total{peer=\"raw-a\"}", "1"),
        ("calix_bgp_refused_over_limit_total{peer=\"raw-a\"}", "5"),
        ("calix_bgp_limit_resets_total{peer=\"raw-b\"}", "1"),
    ] {
        assert_eq!(metric(node, line).as_deref(), Some(want), "{line}");
    }
    let log = node.agent_log();
    for said in [
        "malformed attribute",
        "over its prefix limit: routes refused",
        "over its prefix limit: the session is reset",
        "Bad Peer AS",
        "connection collision: the peer's new connection is closed",
        "no configured peer: closed",
    ] {
        assert!(
            log.to_lowercase().contains(&said.to_lowercase()),
            "the log does not say {said:?}:\n{log}"
        );
    }
}
