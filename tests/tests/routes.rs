//! Route distribution between agents (issue 13): real agents in node namespaces on the test
//! bed's underlay, real etcd, mutual TLS with certificates made by the test bed. What the
//! kernel does with the routes is the reconciler's (tested with it); here: what each agent
//! learns, refuses and hands to its reconciler (`calixctl routes -o json`, "desired").
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use calix_core::Route;
use calix_routesim::{record, Plan, Server, Sim};
use calix_testbed::tls::Ca;
use calix_testbed::{Cluster, Dataplane, Pod};
use serde_json::Value;

mod common;
use common::certs::try_watch_with as try_watch;

const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\n";

/// `calixctl routes -o json` of node `i`.
fn routes(c: &Cluster, i: usize) -> Value {
    c.nodes[i]
        .agent()
        .calixctl_json(&["routes"])
        .unwrap_or_else(|e| panic!("calixctl routes on node {i}: {e}"))
}

/// `calixctl nodes -o json` of node `i`.
fn peers(c: &Cluster, i: usize) -> Value {
    c.nodes[i]
        .agent()
        .calixctl_json(&["nodes"])
        .unwrap_or_else(|e| panic!("calixctl nodes on node {i}: {e}"))
}

/// (prefix, node, next hop) of what node `i`'s agent handed to its reconciler.
fn desired(c: &Cluster, i: usize) -> BTreeSet<(String, String, String)> {
    triples(&routes(c, i)["desired"])
}

fn triples(v: &Value) -> BTreeSet<(String, String, String)> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (s("prefix"), s("node"), s("next_hop"))
        })
        .collect()
}

/// Polls `f` every 10 ms until it gives something, at most `timeout`; panics naming `what`.
fn wait_for<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    wait_showing(what, timeout, f, String::new)
}

/// [`wait_for`], and on failure shows `show()`.
fn wait_showing<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
    show: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "not within {timeout:?}: {what}\n{}",
            show()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The /26 block of an IPv4 address.
fn block26(ip: &str) -> String {
    let ip: std::net::Ipv4Addr = ip.parse().expect("ipv4");
    let o = ip.octets();
    format!("{}.{}.{}.{}/26", o[0], o[1], o[2], o[3] & 0xc0)
}

/// A cluster of nodes on `subnets` with route distribution on (mutual TLS from `ca`),
/// `extra(i)` lines in each `[routes]`, started and settled: node `i`'s agent streams from
/// `follows(i)` peers.
fn cluster(
    subnets: &[u8],
    ca: &Ca,
    extra: impl Fn(usize) -> String,
    follows: impl Fn(usize) -> usize,
) -> Cluster {
    cluster_with(subnets, ca, POOLS, extra, follows)
}

/// [`cluster`] with `pools` (and any `[ipam]` section) instead of [`POOLS`].
fn cluster_with(
    subnets: &[u8],
    ca: &Ca,
    pools: &str,
    extra: impl Fn(usize) -> String,
    follows: impl Fn(usize) -> usize,
) -> Cluster {
    let c = Cluster::create(Dataplane::under_test(), subnets, |i, c| {
        c.base_config(i)
            + pools
            + &c.routes_config(i, ca, &extra(i))
                .unwrap_or_else(|e| panic!("{e}"))
    });
    c.start();
    for i in 0..c.nodes.len() {
        wait_for(
            &format!("node {i} streams from its {} peer(s)", follows(i)),
            Duration::from_secs(20),
            || (up(&peers(&c, i)).len() == follows(i)).then_some(()),
        );
    }
    c
}

/// The peers a `calixctl nodes` report shows streaming.
fn up(nodes: &Value) -> Vec<String> {
    nodes["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|x| x["state"] == "up")
        .filter_map(|x| x["name"].as_str().map(String::from))
        .collect()
}

/// Waits until node `i` hands its reconciler `want`'s routes, at most `timeout`; returns how
/// long it took.
fn until_desired(
    c: &Cluster,
    i: usize,
    want: &(String, String, String),
    timeout: Duration,
) -> Duration {
    let start = Instant::now();
    wait_for(
        &format!("node {i} hands its reconciler {want:?}"),
        timeout,
        || desired(c, i).contains(want).then_some(()),
    );
    start.elapsed()
}

#[test]
fn every_node_learns_every_other_nodes_blocks_within_a_second_of_the_add() {
    let ca = Ca::new("calix-test-ca").expect("CA");
    let c = cluster(&[1, 1, 2], &ca, |_| "grace_secs = 10".into(), |_| 2);
    for i in 0..3 {
        let p = peers(&c, i);
        assert_eq!(p["tls"], true);
        assert_eq!(p["complete"], true);
    }
    let mut pods = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 0..3 {
        let pod = Pod::add(&c.nodes[i], "p");
        let added = Instant::now();
        let want = (block26(&pod.ip()), c.name(i).to_string(), c.address(i));
        for j in (0..3).filter(|j| *j != i) {
            until_desired(&c, j, &want, Duration::from_secs(1));
            slowest = slowest.max(added.elapsed());
        }
        pods.push(pod);
    }
    eprintln!("slowest: a pod's block on both other nodes {slowest:?} after its ADD returned");
    // What node 0 learned, as calixctl shows it: node 1 on its subnet (direct), node 2
    // across the router (the pool's default crossSubnet: VXLAN).
    let r = routes(&c, 0);
    let learned = r["learned"].as_array().expect("learned");
    for (j, via) in [(1, "direct"), (2, "vxlan")] {
        let l = learned
            .iter()
            .find(|l| l["node"] == c.name(j) && l["source"] == c.name(j))
            .unwrap_or_else(|| panic!("node {j}'s block learned by node 0: {r:#}"));
        assert_eq!(l["via"], via, "{l}");
        assert_eq!(l["state"], "accepted");
        assert_eq!(l["next_hop"], c.address(j).as_str());
    }
    assert_eq!(r["desired_complete"], true);
    let advertised = triples(&r["advertised"]);
    assert_eq!(
        advertised,
        BTreeSet::from([(block26(&pods[0].ip()), c.name(0).to_string(), c.address(0))])
    );
    assert!(
        r["refusals"].as_object().is_some_and(|m| m.is_empty()),
        "{r:#}"
    );
    // The tables print too, and /metrics counts.
    let out = c.nodes[0].calixctl(&["routes"]);
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("calixctl routes:\n{text}");
    assert!(
        out.status.success() && text.contains("NEXT HOP") && text.contains("accepted"),
        "{text}"
    );
    let out = c.nodes[0].calixctl(&["nodes"]);
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("calixctl nodes:\n{text}");
    assert!(
        out.status.success() && text.contains("GRACE LEFT") && text.contains("mutual TLS"),
        "{text}"
    );
    let (code, metrics) = c.nodes[0].http_get("/metrics").expect("/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("calix_route_peers{state=\"up\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("calix_routes_learned 2"), "{metrics}");
}

/// Node `i`'s view of peer `peer` in `calixctl nodes -o json`.
fn peer_state(c: &Cluster, i: usize, peer: &str) -> Value {
    peers(c, i)["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == peer)
        .cloned()
        .unwrap_or(Value::Null)
}

#[test]
fn peers_keep_a_restarted_agents_routes_and_withdraw_a_stopped_ones_after_the_grace_period() {
    const GRACE: u64 = 8;
    let ca = Ca::new("calix-test-ca").expect("CA");
    let c = cluster(&[1, 1, 2], &ca, |_| format!("grace_secs = {GRACE}"), |_| 2);
    let pods: Vec<Pod> = (0..3).map(|i| Pod::add(&c.nodes[i], "p")).collect();
    let block = |i: usize| (block26(&pods[i].ip()), c.name(i).to_string(), c.address(i));
    for i in 0..3 {
        for j in (0..3).filter(|j| *j != i) {
            until_desired(&c, i, &block(j), Duration::from_secs(2));
        }
    }
    let b = c.name(1).to_string();
    // Node 1's agent goes and comes back, by SIGTERM and by SIGKILL: node 0 and node 2 keep
    // its block all along.
    type Stop = fn(&calix_testbed::Node);
    let stops: [(&str, Stop); 2] = [
        ("SIGTERM", calix_testbed::Node::stop_agent),
        ("SIGKILL", calix_testbed::Node::kill_agent),
    ];
    for (n, (how, stop)) in stops.into_iter().enumerate() {
        stop(&c.nodes[1]);
        for i in [0, 2] {
            let s = wait_for(
                &format!("node {i} sees node 1's stream end after {how}"),
                Duration::from_secs(5),
                || Some(peer_state(&c, i, &b)).filter(|s| s["state"] == "grace"),
            );
            let left = s["grace_left_secs"].as_f64().expect("grace timer");
            assert!(left > 0.0 && left <= GRACE as f64, "{s}");
            assert!(
                desired(&c, i).contains(&block(1)),
                "node {i} keeps node 1's block"
            );
        }
        if how == "SIGTERM" {
            assert!(
                c.nodes[0]
                    .agent_log()
                    .contains("calix-agent is shutting down"),
                "SIGTERM closes the streams cleanly"
            );
        }
        c.nodes[1].start_agent();
        // Back: node 1 re-learns everything, and its peers stream from it again.
        wait_for(
            &format!("node 1 re-learns after {how}"),
            Duration::from_secs(10),
            || {
                assert!(
                    desired(&c, 0).contains(&block(1)),
                    "node 0 keeps node 1's block meanwhile"
                );
                let r = routes(&c, 1);
                let d = triples(&r["desired"]);
                (r["desired_complete"] == true && d.contains(&block(0)) && d.contains(&block(2)))
                    .then_some(())
            },
        );
        // It waited for both peers before letting stale routes go.
        assert!(
            c.nodes[1]
                .agent_log()
                .contains("stale routes may go from now on peers=2"),
            "{}",
            c.nodes[1].agent_log()
        );
        for i in [0, 2] {
            wait_for(
                &format!("node {i} streams from node 1 again after {how}"),
                Duration::from_secs(10),
                || {
                    let s = peer_state(&c, i, &b);
                    (s["state"] == "up" && s["snapshots"] == n as u64 + 2).then_some(())
                },
            );
            assert!(desired(&c, i).contains(&block(1)));
        }
    }
    // Stopped for good: withdrawn once the grace period is over, not before.
    c.nodes[1].stop_agent();
    let stopped = Instant::now();
    wait_for(
        "node 0 withdraws node 1's block",
        Duration::from_secs(GRACE + 5),
        || (!desired(&c, 0).contains(&block(1))).then_some(()),
    );
    let took = stopped.elapsed();
    assert!(
        took >= Duration::from_secs(GRACE - 1),
        "withdrawn after {took:?}, before the grace period"
    );
    eprintln!("node 1's block withdrawn {took:?} after its agent stopped (grace {GRACE} s)");
    wait_for("node 2 withdraws it too", Duration::from_secs(2), || {
        (!desired(&c, 2).contains(&block(1))).then_some(())
    });
    assert_eq!(peer_state(&c, 0, &b)["state"], "down");
    assert!(desired(&c, 0).contains(&block(2)), "the others stay");
}

#[test]
fn with_reflectors_nodes_follow_only_the_reflector_and_learn_every_node_through_it() {
    let ca = Ca::new("calix-test-ca").expect("CA");
    // Node 0 relays; plain text between nodes this time (warned at start).
    let c = cluster(
        &[1, 1, 2],
        &ca,
        |i| {
            format!(
                "topology = \"reflectors\"\nreflector = {}\nplaintext = true",
                i == 0
            )
        },
        |i| if i == 0 { 2 } else { 1 },
    );
    for i in 1..3 {
        let p = peers(&c, i);
        assert_eq!(up(&p), [c.name(0)], "node {i} follows the reflector only");
        assert_eq!(p["peers"][0]["reflector"], true);
        assert_eq!(p["tls"], false);
        assert!(c.nodes[i].agent_log().contains("PLAIN TEXT between nodes"));
    }
    let mut pods = Vec::new();
    for i in [1, 2, 0] {
        let pod = Pod::add(&c.nodes[i], "p");
        let added = Instant::now();
        let want = (block26(&pod.ip()), c.name(i).to_string(), c.address(i));
        for j in (0..3).filter(|j| *j != i) {
            until_desired(&c, j, &want, Duration::from_secs(1));
        }
        eprintln!(
            "node {i}'s block on both others {:?} after the ADD",
            added.elapsed()
        );
        pods.push(pod);
    }
    // Node 1 learned node 2's block from the reflector, origin and next hop kept.
    let r = routes(&c, 1);
    let l = r["learned"]
        .as_array()
        .expect("learned")
        .iter()
        .find(|l| l["node"] == c.name(2))
        .cloned()
        .expect("node 2's block");
    assert_eq!(l["source"], c.name(0));
    assert_eq!(l["next_hop"], c.address(2).as_str());
    assert_eq!(l["state"], "accepted");
    assert_eq!(
        routes(&c, 0)["relayed"],
        3,
        "the reflector relays all three blocks"
    );
    assert!(
        r["refusals"].as_object().is_some_and(|m| m.is_empty()),
        "{r:#}"
    );
}

/// [`calix_routesim::tls_material`], for tests.
fn tls_material(
    ca_pem: &str,
    cert: &calix_testbed::tls::NodeCert,
) -> calix_agent::distribution::tls::TlsMaterial {
    calix_routesim::tls_material(ca_pem, cert).expect("TLS material")
}

/// From node `from`'s namespace, through node `to`'s TCP door with a trusted certificate:
/// the gRPC code each of the unix socket's services answers with (`Ipam.Status`,
/// `Endpoints.List`, `RouteInfo.Show`).
fn other_services_over_tcp(
    c: &Cluster,
    from: usize,
    to: usize,
    as_node: &str,
    tls: std::sync::Arc<rustls::ClientConfig>,
) -> Vec<(&'static str, tonic::Code)> {
    use calix_agent::distribution::client::{connect, Dialer};
    use calix_proto::v1 as pb;
    let dialer = Dialer {
        me: as_node.to_string(),
        tls: Some(tls),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    };
    let peer = c.name(to).to_string();
    let endpoint = format!("{}:5474", c.address(to));
    c.nodes[from].ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let channel = connect(&peer, &endpoint, &dialer)
                .await
                .expect("the door lets a trusted certificate in");
            let code = |r: Result<(), tonic::Status>| r.err().map_or(tonic::Code::Ok, |s| s.code());
            vec![
                (
                    "Ipam.Status",
                    code(
                        pb::ipam_client::IpamClient::new(channel.clone())
                            .status(pb::StatusRequest {})
                            .await
                            .map(drop),
                    ),
                ),
                (
                    "Endpoints.List",
                    code(
                        pb::endpoints_client::EndpointsClient::new(channel.clone())
                            .list(pb::ListRequest {})
                            .await
                            .map(drop),
                    ),
                ),
                (
                    "RouteInfo.Show",
                    code(
                        pb::route_info_client::RouteInfoClient::new(channel)
                            .show(pb::RouteInfoRequest {})
                            .await
                            .map(drop),
                    ),
                ),
            ]
        })
    })
}

#[test]
fn a_rogue_peer_cannot_hijack_and_bad_certificates_are_refused() {
    let ca = Ca::new("calix-test-ca").expect("CA");
    // Node 2's agent never runs: its namespace hosts the rogue.
    let c = Cluster::create(Dataplane::under_test(), &[1, 1, 2], |i, c| {
        c.base_config(i)
            + POOLS
            + &c.routes_config(i, &ca, "grace_secs = 10")
                .expect("routes config")
    });
    c.nodes[0].start_agent();
    c.nodes[1].start_agent();
    for i in 0..2 {
        wait_for(
            "nodes 0 and 1 stream from each other",
            Duration::from_secs(20),
            || (up(&peers(&c, i)).len() == 1).then_some(()),
        );
    }
    let pod = Pod::add(&c.nodes[0], "p");
    let a_block = (block26(&pod.ip()), c.name(0).to_string(), c.address(0));
    until_desired(&c, 1, &a_block, Duration::from_secs(2));
    let pod1 = Pod::add(&c.nodes[1], "p");
    let b_block = (block26(&pod1.ip()), c.name(1).to_string(), c.address(1));
    until_desired(&c, 0, &b_block, Duration::from_secs(2));

    // The rogue, node 2, with its own valid certificate, announces node 1's block (relaying
    // without being a reflector), claims node 0's block for itself, claims node 0's pod's
    // address, and a prefix that is no block.
    let rogue = c.name(2).to_string();
    let route = |prefix: &str, node: &str, hop: &str| Route {
        prefix: prefix.parse().expect("prefix"),
        node: node.into(),
        next_hop: hop.parse().expect("hop"),
    };
    let rogue_hop = c.address(2);
    let announce = vec![
        route(&b_block.0, c.name(1), &c.address(1)),
        route(&a_block.0, &rogue, &rogue_hop),
        route(&format!("{}/32", pod.ip()), &rogue, &rogue_hop),
        route("10.244.200.0/26", &rogue, &rogue_hop),
    ];
    let _rogue = Sim::start(
        &c,
        2,
        &ca,
        Plan {
            records: vec![record(
                &rogue,
                &rogue_hop,
                Some(format!("{rogue_hop}:5474")),
                false,
            )],
            blocks: vec![],
            servers: vec![Server {
                name: rogue.clone(),
                port: 5474,
                routes: announce,
            }],
            known: vec![c.name(0).into(), c.name(1).into()],
            known_addresses: [0, 1]
                .map(|i| c.address(i).parse().expect("address"))
                .into(),
        },
    );
    for i in 0..2 {
        wait_for(
            &format!("node {i} follows the rogue"),
            Duration::from_secs(10),
            || up(&peers(&c, i)).contains(&rogue).then_some(()),
        );
    }
    let refused = |i: usize| -> BTreeSet<String> {
        routes(&c, i)["learned"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| l["source"] == rogue.as_str() && l["state"] == "refused")
            .filter_map(|l| l["cause"].as_str().map(String::from))
            .collect()
    };
    for i in 0..2 {
        let causes = wait_showing(
            &format!("node {i} refuses all four of the rogue's routes"),
            Duration::from_secs(6),
            || Some(refused(i)).filter(|r| r.len() == 4),
            || format!("{:#}", routes(&c, i)["learned"]),
        );
        // Node 1's own block relayed to it is refused as well: not the rogue's to say.
        let want: BTreeSet<String> = [
            "not_its_own",
            "block_not_affine",
            "address_of_other_node",
            "not_a_block",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(causes, want, "node {i}");
        // Nothing of it reached the reconciler.
        let d = desired(&c, i);
        assert!(
            d.iter()
                .all(|(_, node, hop)| *node != rogue && *hop != rogue_hop),
            "node {i} handed a rogue route to its reconciler: {d:?}"
        );
        let theirs = if i == 0 { &b_block } else { &a_block };
        assert!(
            d.contains(theirs),
            "the block still via its own node: {d:?}"
        );
        let log = c.nodes[i].agent_log();
        assert!(
            log.contains("refused a route") && log.contains("is not a route reflector"),
            "{log}"
        );
        let r = routes(&c, i);
        assert_eq!(r["refusals"]["block_not_affine"], 1, "{r:#}");
        let (_, metrics) = c.nodes[i].http_get("/metrics").expect("/metrics");
        assert!(
            metrics.contains("calix_route_refusals_total{cause=\"not_its_own\"} 1"),
            "{metrics}"
        );
    }

    // Strangers at node 0's door, from the rogue's namespace.
    let other_ca = Ca::new("another-ca").expect("CA");
    let node1_cert = ca.issue(c.name(1)).expect("cert");
    let attempts: Vec<(
        &str,
        &str,
        Option<std::sync::Arc<rustls::ClientConfig>>,
        &str,
    )> = vec![
        (
            "a certificate of another CA",
            c.name(1),
            Some(
                tls_material(&ca.pem(), &other_ca.issue(c.name(1)).expect("cert"))
                    .client_config()
                    .expect("client"),
            ),
            "",
        ),
        (
            "no certificate",
            c.name(1),
            Some(
                calix_agent::distribution::tls::anonymous_client_config(ca.pem().as_bytes())
                    .expect("client"),
            ),
            "",
        ),
        ("plain text", c.name(1), None, ""),
        (
            "node 1's certificate, as another node",
            &rogue,
            Some(
                tls_material(&ca.pem(), &node1_cert)
                    .client_config()
                    .expect("client"),
            ),
            "with the certificate of node",
        ),
        (
            "a valid certificate of no node",
            "cxt-ghost",
            Some(
                tls_material(&ca.pem(), &ca.issue("cxt-ghost").expect("cert"))
                    .client_config()
                    .expect("client"),
            ),
            "has no node record",
        ),
    ];
    for (what, as_node, tls, says) in attempts {
        let err = try_watch(&c, 2, 0, as_node, tls).expect_err(what);
        assert!(err.contains(says), "{what}: {err}");
        eprintln!("{what}: refused: {err}");
    }
    // The same door lets node 1's certificate in as node 1.
    try_watch(
        &c,
        2,
        0,
        c.name(1),
        Some(
            tls_material(&ca.pem(), &node1_cert)
                .client_config()
                .expect("client"),
        ),
    )
    .expect("node 1's certificate as node 1");
    // Only Routes is served on TCP: IPAM, endpoints and the route report stay on the unix
    // socket, even for a trusted node.
    let answers = other_services_over_tcp(
        &c,
        2,
        0,
        c.name(1),
        tls_material(&ca.pem(), &node1_cert)
            .client_config()
            .expect("client"),
    );
    for (service, code) in answers {
        assert_eq!(code, tonic::Code::Unimplemented, "{service} over TCP");
    }
    let door = &peers(&c, 0)["door"];
    assert!(door["refused_tls"].as_u64() >= Some(3), "{door}");
    assert!(door["refused_identity"].as_u64() >= Some(2), "{door}");
    let log = c.nodes[0].agent_log();
    for line in [
        "TLS handshake failed",
        "refused a peer's watch",
        "with the certificate of node",
    ] {
        assert!(log.contains(line), "node 0's log lacks {line:?}:\n{log}");
    }
    let handshake_reasons: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("TLS handshake failed"))
        .collect();
    eprintln!("{}", handshake_reasons.join("\n"));
}

#[test]
fn borrowed_addresses_are_advertised_as_host_routes_in_both_families() {
    let ca = Ca::new("calix-test-ca").expect("CA");
    // Tiny blocks, one per family per node: a node's fifth pod borrows from the other's.
    let pools = "[ipam]\nmaxBlocksPerNode = 2\n\
        [[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 30\n\
        [[pools]]\ncidr = \"fd00:244::/64\"\nblockSize = 126\n";
    let c = cluster_with(&[1, 2], &ca, pools, |_| String::new(), |_| 1);
    let dual = serde_json::json!({"ipam": {"type": "calix-ipam", "assign_ipv6": true}});
    let _first = Pod::add_with(&c.nodes[1], "q", dual.clone());
    let mut pods = Vec::new();
    for k in 0..5 {
        pods.push(Pod::add_with(&c.nodes[0], &format!("p{k}"), dual.clone()));
    }
    let added = Instant::now();
    // Node 0's blocks (as it advertises them) and the addresses outside them: borrowed.
    let r = routes(&c, 0);
    let own: Vec<ipnet::IpNet> = r["advertised"]
        .as_array()
        .expect("advertised")
        .iter()
        .filter_map(|a| a["prefix"].as_str()?.parse().ok())
        .filter(|p: &ipnet::IpNet| p.prefix_len() < p.max_prefix_len())
        .collect();
    assert_eq!(own.len(), 2, "one block per family: {r:#}");
    let borrowed: Vec<std::net::IpAddr> = pods
        .iter()
        .flat_map(|p| p.ips())
        .map(|a| a.parse().expect("ip"))
        .filter(|a| !own.iter().any(|b| b.contains(a)))
        .collect();
    assert!(
        borrowed.iter().any(|a| a.is_ipv4()) && borrowed.iter().any(|a| a.is_ipv6()),
        "pods borrowed in both families: {borrowed:?}"
    );
    for a in &borrowed {
        let (len, hop) = if a.is_ipv4() {
            (32, c.address(0))
        } else {
            (128, c.address6(0))
        };
        let want = (format!("{a}/{len}"), c.name(0).to_string(), hop);
        assert!(
            triples(&r["advertised"]).contains(&want),
            "node 0 advertises {want:?}"
        );
        until_desired(&c, 1, &want, Duration::from_secs(1));
    }
    eprintln!(
        "borrowed host routes on node 1 {:?} after the last ADD",
        added.elapsed()
    );
    // Node 1 reaches node 0 across the router: through VXLAN (the default crossSubnet).
    let r1 = routes(&c, 1);
    assert!(
        r1["desired"]
            .as_array()
            .expect("desired")
            .iter()
            .all(|d| d["via"] == "vxlan" && d["vxlan"] == "crossSubnet"),
        "{r1:#}"
    );
    // Releasing a borrowed address withdraws its route.
    let gone = pods.pop().expect("the last pod");
    let gone_ips: Vec<String> = gone.ips();
    drop(gone);
    wait_for(
        "node 1 withdraws the released addresses",
        Duration::from_secs(2),
        || {
            let d = desired(&c, 1);
            d.iter()
                .all(|(p, _, _)| !gone_ips.iter().any(|ip| p.starts_with(&format!("{ip}/"))))
                .then_some(())
        },
    );
}

/// `calix_routes_desired` of node `i`'s `/metrics`.
fn desired_count(c: &Cluster, i: usize) -> Option<u64> {
    let (_, body) = c.nodes[i].http_get("/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix("calix_routes_desired "))
        .and_then(|n| n.trim().parse().ok())
}

/// (resident memory in KiB, CPU seconds) of a process.
fn rss_and_cpu(pid: u32) -> (u64, f64) {
    let u = calix_testbed::traffic::cpu::ProcessUsage::read(pid).expect("the agent runs");
    (u.rss_kib, u.cpu_secs)
}

/// One agent and 100 simulated peers with 100 blocks each: in a full mesh it follows all of
/// them; with a (simulated) reflector it follows that one, which relays the 10,000 routes.
/// Every route is validated against the datastore and handed to the reconciler.
#[test]
fn one_agent_takes_a_hundred_peers_with_a_hundred_blocks_each() {
    const PEERS: u32 = 100;
    const BLOCKS: u32 = 100;
    let ca = Ca::new("calix-test-ca").expect("CA");
    for topology in ["mesh", "reflectors"] {
        let c = Cluster::create(Dataplane::under_test(), &[1, 1], |i, c| {
            c.base_config(i)
                + "[[pools]]\ncidr = \"10.240.0.0/12\"\n"
                + &c.routes_config(i, &ca, &format!("topology = \"{topology}\""))
                    .expect("routes config")
        });
        let mut plan = calix_routesim::scale(
            &calix_routesim::Scale {
                peers: PEERS,
                blocks_per_peer: BLOCKS,
                pool: "10.240.0.0/12".parse().expect("pool"),
                block_len: 26,
                first_hop: std::net::Ipv4Addr::new(172, 31, 1, 100),
                first_port: 6000,
                host: c.address(1).parse().expect("address"),
                reflector: (topology == "reflectors")
                    .then_some((std::net::Ipv4Addr::new(172, 31, 1, 99), 6999)),
            },
            vec![c.name(0).into()],
        )
        .expect("plan");
        plan.known_addresses = vec![c.address(0).parse().expect("address")];
        // Mesh: the agent starts on a datastore that has it all (a restart). Reflectors: the
        // agent runs first (its own RSS measured), then the peers appear.
        let start_agent = || {
            let spawned = Instant::now();
            c.nodes[0].start_agent();
            spawned.elapsed()
        };
        let mut before = None;
        if topology == "reflectors" {
            start_agent();
            std::thread::sleep(Duration::from_secs(1));
            before = Some(rss_and_cpu(c.nodes[0].agent_pid().expect("agent pid")));
        }
        let written = Instant::now();
        let _sim = Sim::start(&c, 1, &ca, plan);
        eprintln!(
            "{topology}: simulated peers up ({:?} to write 10,000 blocks)",
            written.elapsed()
        );
        let from = Instant::now();
        let startup = (topology == "mesh").then(start_agent);
        wait_showing(
            &format!("{topology}: all 10,000 routes handed to the reconciler"),
            Duration::from_secs(30),
            || (desired_count(&c, 0) == Some(u64::from(PEERS * BLOCKS))).then_some(()),
            || format!("{:?}", desired_count(&c, 0)),
        );
        let took = from.elapsed();
        let (rss, cpu) = rss_and_cpu(c.nodes[0].agent_pid().expect("agent pid"));
        eprintln!(
            "{topology}: 10,000 routes from {} peer(s) handed to the reconciler {took:?} after {}; agent RSS {rss} KiB{}, CPU {cpu:.2} s{} (debug build)",
            if topology == "mesh" { PEERS } else { 1 },
            match startup {
                Some(s) => format!("the agent started (it answered after {s:?})"),
                None => "the peers were up".into(),
            },
            before.map(|(r, _)| format!(" ({r} KiB before)")).unwrap_or_default(),
            before.map(|(_, c)| format!(" ({c:.2} s before)")).unwrap_or_default(),
        );
        let r = routes(&c, 0);
        assert!(
            r["refusals"].as_object().is_some_and(|m| m.is_empty()),
            "no refusal"
        );
        assert_eq!(
            up(&peers(&c, 0)).len(),
            if topology == "mesh" {
                PEERS as usize
            } else {
                1
            }
        );
    }
}

/// Writes `blocks` into the cluster's etcd as a stolen agent token could: straight to their
/// keys, no compare (from node 0's namespace, where etcd is reachable).
fn forge_blocks(c: &Cluster, blocks: Vec<calix_core::ipam::Block>) {
    use calix_core::store::keys;
    use calix_datastore::{Datastore, Durability, EtcdConfig, EtcdStore, Op};
    let etcd = c.etcd_url(0);
    c.nodes[0].ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let store = EtcdStore::connect(EtcdConfig {
                endpoints: vec![etcd],
                prefix: "/calix/".into(),
                timeout: Duration::from_secs(5),
                attempts: 3,
            })
            .await
            .expect("etcd");
            for b in &blocks {
                store
                    .txn(
                        &[],
                        &[Op::put_json(keys::block(&b.cidr), b)],
                        Durability::Power,
                    )
                    .await
                    .expect("forge")
                    .expect("written");
            }
        });
    });
}

/// A forged block: `cidr` affine to `node`, holding one allocation by it at offset 0.
fn forged(cidr: &str, node: &str) -> calix_core::ipam::Block {
    let mut b = calix_core::ipam::Block::new(cidr.parse().expect("cidr"), node);
    b.allocations.insert(
        0,
        calix_core::ipam::Allocation {
            handle: "forged".into(),
            ifname: "eth0".into(),
            node: node.into(),
            seq: 1,
            attributes: Default::default(),
        },
    );
    b
}

/// `calixctl ipam check -o json` of node `i`: (block, rule, node) of its ignored-block rows.
fn ignored_rows(c: &Cluster, i: usize) -> BTreeSet<(String, String, String)> {
    let out = c.nodes[i].calixctl(&["ipam", "check", "-o", "json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "ipam check on node {i}: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    v["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == "ignored-block")
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or_default().to_string();
            (s("block"), s("rule"), s("node"))
        })
        .collect()
}

/// Issue 20, item 1a: blocks forged affine to node 2 — a /32 over node 0's pod's address, and
/// 0.0.0.0/0 — written straight into etcd. Node 2's own agent does not advertise them (before,
/// it did, and every peer took them: longest-prefix match pulled node 0's pod's traffic, or
/// everything, to node 2), node 1 still claims a block (before, 0.0.0.0/0 overlapped every
/// block a claim could make), and every node reports them.
#[test]
fn blocks_forged_affine_to_a_node_are_not_advertised_and_stop_no_claim() {
    let ca = Ca::new("calix-test-ca").expect("CA");
    let c = cluster(&[1, 1, 1], &ca, |_| "grace_secs = 10".into(), |_| 2);
    let pod0 = Pod::add(&c.nodes[0], "p");
    let victim = format!("{}/32", pod0.ip());
    let rogue = c.name(2).to_string();
    forge_blocks(
        &c,
        vec![forged(&victim, &rogue), forged("0.0.0.0/0", &rogue)],
    );
    let forged_prefixes = [victim.clone(), "0.0.0.0/0".to_string()];
    // Node 1 claims its first block beside them, and node 0 learns it.
    let pod1 = Pod::add(&c.nodes[1], "p");
    let b1 = (block26(&pod1.ip()), c.name(1).to_string(), c.address(1));
    until_desired(&c, 0, &b1, Duration::from_secs(5));
    // Node 2 says it ignores both; it never advertised them, and nobody hands them over.
    wait_showing(
        "node 2's route view ignores the forged blocks",
        Duration::from_secs(10),
        || {
            let r = routes(&c, 2);
            (r["ignored_blocks"]["outside_pools"] == 1 && r["ignored_blocks"]["block_size"] == 1)
                .then_some(())
        },
        || format!("{:#}", routes(&c, 2)),
    );
    let advertised = triples(&routes(&c, 2)["advertised"]);
    for p in &forged_prefixes {
        assert!(
            advertised.iter().all(|(prefix, ..)| prefix != p),
            "node 2 advertises the forged {p}: {advertised:?}"
        );
        for i in 0..2 {
            assert!(
                desired(&c, i).iter().all(|(prefix, ..)| prefix != p),
                "node {i} hands the forged {p} to its reconciler"
            );
        }
    }
    let text = String::from_utf8_lossy(&c.nodes[2].calixctl(&["routes"]).stdout).to_string();
    assert!(text.contains("blocks ignored"), "{text}");
    // Reported by IPAM on every node: ipam check rows, the metric, the log.
    for i in 0..3 {
        let rows = ignored_rows(&c, i);
        for (block, rule) in [
            (victim.as_str(), "block_size"),
            ("0.0.0.0/0", "outside_pools"),
        ] {
            assert!(
                rows.contains(&(block.to_string(), rule.to_string(), rogue.clone())),
                "node {i}: {block} {rule} not in {rows:?}"
            );
        }
    }
    let (_, metrics) = c.nodes[1].http_get("/metrics").expect("/metrics");
    assert!(
        metrics.contains("calix_ipam_ignored_blocks{rule=\"outside_pools\"} 1")
            && metrics.contains("calix_ipam_ignored_blocks{rule=\"block_size\"} 1"),
        "{metrics}"
    );
    assert!(
        c.nodes[2].agent_log().contains("block ignored"),
        "{}",
        c.nodes[2].agent_log()
    );
}

/// Issue 20, item 1a, the receiving side: a rogue node (simulated, with its own valid
/// certificate) has blocks forged affine to itself — a /32 over node 0's pod's address and
/// 0.0.0.0/0 — and announces them. Every node refuses both (`block_ignored`) and keeps its
/// own routes; the rogue's real block is taken.
#[test]
fn a_rogue_announcing_its_forged_blocks_is_refused() {
    let ca = Ca::new("calix-test-ca").expect("CA");
    let c = Cluster::create(Dataplane::under_test(), &[1, 1, 2], |i, c| {
        c.base_config(i)
            + POOLS
            + &c.routes_config(i, &ca, "grace_secs = 10")
                .expect("routes config")
    });
    c.nodes[0].start_agent();
    c.nodes[1].start_agent();
    for i in 0..2 {
        wait_for(
            "nodes 0 and 1 stream from each other",
            Duration::from_secs(20),
            || (up(&peers(&c, i)).len() == 1).then_some(()),
        );
    }
    let pod = Pod::add(&c.nodes[0], "p");
    let a_block = (block26(&pod.ip()), c.name(0).to_string(), c.address(0));
    until_desired(&c, 1, &a_block, Duration::from_secs(2));
    let rogue = c.name(2).to_string();
    let rogue_hop = c.address(2);
    let victim = format!("{}/32", pod.ip());
    let route = |prefix: &str| Route {
        prefix: prefix.parse().expect("prefix"),
        node: rogue.clone(),
        next_hop: rogue_hop.parse().expect("hop"),
    };
    let _rogue = Sim::start(
        &c,
        2,
        &ca,
        Plan {
            records: vec![record(
                &rogue,
                &rogue_hop,
                Some(format!("{rogue_hop}:5474")),
                false,
            )],
            blocks: vec![
                forged(&victim, &rogue),
                forged("0.0.0.0/0", &rogue),
                calix_core::ipam::Block::new("10.244.201.0/26".parse().expect("cidr"), &rogue),
            ],
            servers: vec![Server {
                name: rogue.clone(),
                port: 5474,
                routes: vec![route(&victim), route("0.0.0.0/0"), route("10.244.201.0/26")],
            }],
            known: vec![c.name(0).into(), c.name(1).into()],
            known_addresses: [0, 1]
                .iter()
                .map(|i| c.address(*i).parse().expect("address"))
                .collect(),
        },
    );
    for i in 0..2 {
        let states = wait_showing(
            &format!("node {i} refuses the rogue's forged blocks"),
            Duration::from_secs(10),
            || {
                let learned: BTreeSet<(String, String, String)> = routes(&c, i)["learned"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|l| l["source"] == rogue.as_str())
                    .map(|l| {
                        let s = |k: &str| l[k].as_str().unwrap_or_default().to_string();
                        (s("prefix"), s("state"), s("cause"))
                    })
                    .collect();
                let settled =
                    learned.len() == 3 && learned.iter().all(|(_, state, _)| state != "pending");
                settled.then_some(learned)
            },
            || format!("{:#}", routes(&c, i)["learned"]),
        );
        let want: BTreeSet<(String, String, String)> = [
            (victim.clone(), "refused", "block_ignored"),
            ("0.0.0.0/0".into(), "refused", "block_ignored"),
            ("10.244.201.0/26".into(), "accepted", ""),
        ]
        .into_iter()
        .map(|(p, s, c)| (p, s.to_string(), c.to_string()))
        .collect();
        assert_eq!(states, want, "node {i}");
        let d = desired(&c, i);
        assert!(
            d.iter().all(|(p, ..)| *p != victim && p != "0.0.0.0/0"),
            "node {i} hands a forged route to its reconciler: {d:?}"
        );
        let (_, metrics) = c.nodes[i].http_get("/metrics").expect("/metrics");
        assert!(
            metrics.contains("calix_route_refusals_total{cause=\"block_ignored\"} 2"),
            "{metrics}"
        );
    }
    assert!(
        desired(&c, 1).contains(&a_block),
        "node 0's block still via node 0"
    );
}
