//! Route distribution between agents (issue 13): real agents in node namespaces on the test
//! bed's underlay, real etcd, mutual TLS with certificates made by the test bed. What the
//! kernel does with the routes is the reconciler's (tested with it); here: what each agent
//! learns, refuses and hands to its reconciler (`calixctl routes -o json`, "desired").
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use calix_testbed::tls::Ca;
use calix_testbed::{Cluster, Dataplane, Pod};
use serde_json::Value;

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
fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "not within {timeout:?}: {what}");
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
    let c = Cluster::create(Dataplane::under_test(), subnets, |i, c| {
        c.base_config(i)
            + POOLS
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
    assert!(
        out.status.success() && text.contains("NEXT HOP") && text.contains("accepted"),
        "{text}"
    );
    let out = c.nodes[0].calixctl(&["nodes"]);
    let text = String::from_utf8_lossy(&out.stdout);
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
