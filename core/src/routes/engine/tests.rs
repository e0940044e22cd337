//! The route engine as a whole, time passed in: learning, validating, advertising and
//! withdrawing routes, graceful restart, the guard, at scale (a hundred peers).
use std::net::IpAddr;

use super::*;
use crate::routes::view::tests::{block_kv, node_kv, put};
use crate::store::keys;
use crate::test_rng::Rng;
use crate::update::WireError;

const GRACE: Duration = Duration::from_secs(120);

fn settings(me: &str, topology: Topology, reflector: bool) -> Settings {
    let n = match me {
        "a" => 1,
        "b" => 2,
        "c" => 3,
        _ => 9,
    };
    Settings {
        me: me.into(),
        topology,
        reflector,
        grace: GRACE,
        settle: SETTLE,
        next_hops: NextHops {
            v4: Some(format!("172.31.1.{n}").parse().expect("ip")),
            v6: None,
        },
        pools: vec![
            ("10.244.0.0/16".parse().expect("net"), VxlanMode::Always),
            ("10.0.0.0/8".parse().expect("net"), VxlanMode::Never),
        ],
        blocks: crate::routes::view::tests::pools(),
    }
}

/// Nodes a, b, c (and r, a reflector), each with a block; b borrowed 10.244.0.5 from a.
fn node_kvs() -> Vec<KeyValue> {
    vec![
        node_kv("a", &["172.31.1.1"], false),
        node_kv("b", &["172.31.1.2"], false),
        node_kv("c", &["172.31.1.3"], false),
        node_kv("r", &["172.31.1.9"], true),
    ]
}

fn block_kvs() -> Vec<KeyValue> {
    vec![
        block_kv(
            "10.244.0.0/26",
            "a",
            &[("10.244.0.1", "a"), ("10.244.0.5", "b")],
        ),
        block_kv("10.244.0.64/26", "b", &[("10.244.0.65", "b")]),
        block_kv("10.244.0.128/26", "c", &[]),
    ]
}

fn engine(me: &str, topology: Topology, reflector: bool) -> Engine {
    let mut e = Engine::new(settings(me, topology, reflector));
    e.view_listed(Part::Nodes, node_kvs());
    e.view_listed(Part::Blocks, block_kvs());
    e
}

fn route(prefix: &str, node: &str) -> Route {
    let n = match node {
        "a" => 1,
        "b" => 2,
        "c" => 3,
        _ => 9,
    };
    Route {
        prefix: prefix.parse().expect("net"),
        node: node.into(),
        next_hop: format!("172.31.1.{n}").parse::<IpAddr>().expect("ip"),
    }
}

fn snapshot(routes: Vec<Route>) -> PeerEvent {
    PeerEvent::Snapshot {
        generation: 1,
        routes,
        unused: Unused::default(),
    }
}

fn prefixes(o: &Outputs) -> Vec<String> {
    o.desired.iter().map(|r| r.prefix.to_string()).collect()
}

#[test]
fn mesh_learns_every_peer_and_completes_when_all_answered() {
    let t0 = Instant::now();
    let mut e = engine("a", Topology::Mesh, false);
    let o = e.flush(t0);
    assert_eq!(o.peers.keys().collect::<Vec<_>>(), ["b", "c", "r"]);
    assert_eq!(
        o.own.keys().map(ToString::to_string).collect::<Vec<_>>(),
        ["10.244.0.0/26"],
        "a's block (its own allocation is inside it)"
    );
    assert!(o.desired.is_empty() && !o.complete);
    e.peer_event(
        "b",
        snapshot(vec![
            route("10.244.0.64/26", "b"),
            route("10.244.0.5/32", "b"),
        ]),
        t0,
    );
    let o = e.flush(t0);
    assert_eq!(prefixes(&o), ["10.244.0.5/32", "10.244.0.64/26"]);
    assert_eq!(o.desired[1].vxlan, VxlanMode::Always, "the pool's mode");
    assert_eq!(
        o.desired[1].next_hop,
        "172.31.1.2".parse::<IpAddr>().expect("ip")
    );
    assert!(!o.complete, "c and r have not answered");
    e.peer_event("c", snapshot(vec![route("10.244.0.128/26", "c")]), t0);
    e.peer_event("r", snapshot(vec![]), t0);
    let o = e.flush(t0);
    assert_eq!(o.desired.len(), 3);
    assert!(o.complete);
    assert!(e.refusals().is_empty());
    // A delta: c withdraws its block.
    e.peer_event(
        "c",
        PeerEvent::Delta {
            generation: 2,
            routes: vec![],
            withdrawn: vec!["10.244.0.128/26".parse().expect("net")],
            unused: Unused::default(),
        },
        t0,
    );
    assert_eq!(e.flush(t0).desired.len(), 2);
}

#[test]
fn refusals_are_not_used_and_counted_once_settled() {
    let t0 = Instant::now();
    let mut e = engine("a", Topology::Mesh, false);
    e.flush(t0);
    // c (not a reflector) announces b's block, and claims a's block as its own.
    e.peer_event(
        "c",
        snapshot(vec![
            route("10.244.0.64/26", "b"),
            route("10.244.0.0/26", "c"),
        ]),
        t0,
    );
    let o = e.flush(t0);
    assert!(o.desired.is_empty(), "{:?}", o.desired);
    assert!(
        matches!(
            e.verdict("c", &"10.244.0.64/26".parse().expect("net")),
            Some(Verdict::Pending {
                cause: Refusal::NotItsOwn,
                ..
            })
        ),
        "pending until it lasts"
    );
    assert!(e.refusals().is_empty());
    assert!(e.next_deadline(t0).is_some_and(|d| d <= t0 + SETTLE));
    e.tick(t0 + SETTLE);
    assert_eq!(e.refusals().get(&Refusal::NotItsOwn), Some(&1));
    assert_eq!(e.refusals().get(&Refusal::BlockNotAffine), Some(&1));
    // The same refusal again (another message, the view changing) is not counted again.
    e.peer_event(
        "c",
        snapshot(vec![
            route("10.244.0.64/26", "b"),
            route("10.244.0.0/26", "c"),
        ]),
        t0 + SETTLE,
    );
    e.view_event(&put(node_kv("b", &["172.31.1.2", "fd31::2"], false)));
    e.flush(t0 + SETTLE);
    e.tick(t0 + SETTLE * 3);
    assert_eq!(e.refusals().get(&Refusal::NotItsOwn), Some(&1));
    assert!(e.flush(t0 + SETTLE * 3).desired.is_empty());
    // Malformed routes: counted at once (the stream keeps a few examples of them); so are
    // withdrawals of prefixes the peer does not hold, which are ignored.
    e.peer_event(
        "c",
        PeerEvent::Delta {
            generation: 2,
            routes: vec![],
            withdrawn: vec![],
            unused: Unused {
                malformed: 5,
                examples: vec!["10.244.0.300/26 via ?".into(), "x".into()],
                unknown_withdrawals: 3,
            },
        },
        t0,
    );
    assert_eq!(e.refusals().get(&Refusal::Malformed), Some(&5));
    assert_eq!(e.unknown_withdrawals(), 3);
    let c = &e.sessions()["c"];
    assert_eq!((c.malformed, c.unknown_withdrawals), (5, 3));
    // A stream dropped for breaking a bound is counted by cause, for the peer and in all.
    e.peer_event(
        "c",
        PeerEvent::Down {
            reason: "peer broke the protocol: ...".into(),
            broke: Some(WireError::TooMany { limit: 10 }),
        },
        t0,
    );
    assert_eq!(e.dropped().get("too_many_routes"), Some(&1));
    assert_eq!(e.sessions()["c"].dropped.get("too_many_routes"), Some(&1));
}

#[test]
fn a_route_ahead_of_this_agents_view_is_accepted_when_the_view_catches_up() {
    let t0 = Instant::now();
    let mut e = engine("a", Topology::Mesh, false);
    e.flush(t0);
    // c claimed a new block; its route arrives before this agent's watch has the block.
    e.peer_event(
        "c",
        snapshot(vec![
            route("10.244.0.128/26", "c"),
            route("10.244.1.0/26", "c"),
        ]),
        t0,
    );
    assert_eq!(prefixes(&e.flush(t0)), ["10.244.0.128/26"]);
    let t1 = t0 + Duration::from_millis(5);
    assert!(e.view_event(&put(block_kv("10.244.1.0/26", "c", &[]))));
    assert_eq!(prefixes(&e.flush(t1)), ["10.244.0.128/26", "10.244.1.0/26"]);
    e.tick(t0 + SETTLE * 2);
    assert!(e.refusals().is_empty(), "never refused: {:?}", e.refusals());
}

#[test]
fn a_block_released_and_claimed_elsewhere_moves_its_route() {
    let t0 = Instant::now();
    let mut e = engine("a", Topology::Mesh, false);
    e.flush(t0);
    e.peer_event("b", snapshot(vec![route("10.244.0.64/26", "b")]), t0);
    e.peer_event("c", snapshot(vec![route("10.244.0.128/26", "c")]), t0);
    assert_eq!(e.flush(t0).desired.len(), 2);
    // b's block is released and c claims it; b's withdrawal has not arrived yet.
    e.view_event(&put(block_kv("10.244.0.64/26", "c", &[])));
    let o = e.flush(t0);
    assert_eq!(
        prefixes(&o),
        ["10.244.0.128/26"],
        "b's route is withdrawn at once"
    );
    e.peer_event(
        "c",
        PeerEvent::Delta {
            generation: 2,
            routes: vec![route("10.244.0.64/26", "c")],
            withdrawn: vec![],
            unused: Unused::default(),
        },
        t0,
    );
    let o = e.flush(t0);
    assert_eq!(o.desired.len(), 2);
    assert_eq!(o.desired[0].node, "c");
}

#[test]
fn graceful_restart_keeps_a_dropped_peers_routes_for_the_grace_period() {
    let t0 = Instant::now();
    let mut e = engine("a", Topology::Mesh, false);
    e.flush(t0);
    for (n, p) in [("b", "10.244.0.64/26"), ("c", "10.244.0.128/26")] {
        e.peer_event(n, snapshot(vec![route(p, n)]), t0);
    }
    e.peer_event("r", snapshot(vec![]), t0);
    assert_eq!(e.flush(t0).desired.len(), 2);
    let t1 = t0 + Duration::from_secs(1);
    e.peer_event(
        "b",
        PeerEvent::Down {
            reason: "stream ended".into(),
            broke: None,
        },
        t1,
    );
    let o = e.flush(t1);
    assert_eq!(o.desired.len(), 2, "kept meanwhile");
    assert!(o.complete);
    assert_eq!(e.next_deadline(t1), Some(t1 + GRACE));
    e.tick(t1 + GRACE - Duration::from_millis(1));
    assert_eq!(e.flush(t1 + GRACE).desired.len(), 2);
    e.tick(t1 + GRACE);
    assert_eq!(prefixes(&e.flush(t1 + GRACE)), ["10.244.0.128/26"]);
    // b comes back: its snapshot brings its routes back.
    e.peer_event(
        "b",
        snapshot(vec![route("10.244.0.64/26", "b")]),
        t1 + GRACE * 2,
    );
    assert_eq!(e.flush(t1 + GRACE * 2).desired.len(), 2);
}

#[test]
fn a_restarted_agent_is_incomplete_until_every_peer_answered_or_its_grace_ran_out() {
    let t0 = Instant::now();
    let mut e = Engine::new(settings("a", Topology::Mesh, false));
    assert!(!e.flush(t0).complete, "nothing listed yet");
    e.view_listed(Part::Nodes, node_kvs());
    e.view_listed(Part::Blocks, block_kvs());
    let o = e.flush(t0);
    assert!(!o.complete);
    e.peer_event("b", snapshot(vec![route("10.244.0.64/26", "b")]), t0);
    e.peer_event("r", snapshot(vec![]), t0);
    // c never answers (stopped for good).
    e.peer_event(
        "c",
        PeerEvent::Down {
            reason: "connection refused".into(),
            broke: None,
        },
        t0,
    );
    assert!(!e.flush(t0 + GRACE - Duration::from_millis(1)).complete);
    e.tick(t0 + GRACE);
    let o = e.flush(t0 + GRACE);
    assert!(o.complete);
    assert_eq!(o.desired.len(), 1);
    // A node that joins later does not make the set incomplete again.
    e.view_event(&put(node_kv("d", &["172.31.1.4"], false)));
    assert!(e.flush(t0 + GRACE).complete);
}

#[test]
fn a_peer_whose_node_record_is_deleted_is_dropped_with_its_routes() {
    let t0 = Instant::now();
    let mut e = engine("a", Topology::Mesh, false);
    e.flush(t0);
    e.peer_event("b", snapshot(vec![route("10.244.0.64/26", "b")]), t0);
    assert_eq!(e.flush(t0).desired.len(), 1);
    e.view_event(&WatchEvent::Delete {
        key: keys::node("b"),
        revision: 9,
    });
    let o = e.flush(t0);
    assert!(o.desired.is_empty());
    assert!(!o.peers.contains_key("b"));
    assert!(!e.sessions().contains_key("b"));
}

#[test]
fn a_reflector_relays_validated_routes_with_their_origin_and_next_hop() {
    let t0 = Instant::now();
    let mut r = engine("r", Topology::Reflectors, true);
    let o = r.flush(t0);
    assert_eq!(o.peers.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert!(o.peers.values().all(|t| !t.relayed));
    r.peer_event("a", snapshot(vec![route("10.244.0.0/26", "a")]), t0);
    r.peer_event(
        "b",
        snapshot(vec![
            route("10.244.0.64/26", "b"),
            route("10.244.0.5/32", "b"),
        ]),
        t0,
    );
    // c lies about a's block: not relayed.
    r.peer_event(
        "c",
        snapshot(vec![
            route("10.244.0.128/26", "c"),
            route("10.244.0.0/26", "c"),
        ]),
        t0,
    );
    let o = r.flush(t0);
    let relayed: Vec<(String, String, String)> = o
        .relay
        .values()
        .map(|x| (x.prefix.to_string(), x.node.clone(), x.next_hop.to_string()))
        .collect();
    assert_eq!(
        relayed,
        [
            ("10.244.0.0/26".into(), "a".into(), "172.31.1.1".into()),
            ("10.244.0.5/32".into(), "b".into(), "172.31.1.2".into()),
            ("10.244.0.64/26".into(), "b".into(), "172.31.1.2".into()),
            ("10.244.0.128/26".into(), "c".into(), "172.31.1.3".into()),
        ]
    );
    assert!(o.own.is_empty(), "r has no block of its own");

    // A client follows the reflector only and takes what it relays, its own routes aside.
    let mut a = engine("a", Topology::Reflectors, false);
    let o = a.flush(t0);
    assert_eq!(o.peers.keys().collect::<Vec<_>>(), ["r"]);
    assert!(o.peers["r"].relayed);
    a.peer_event("r", snapshot(r.flush(t0).relay.into_values().collect()), t0);
    let o = a.flush(t0);
    assert_eq!(
        prefixes(&o),
        ["10.244.0.5/32", "10.244.0.64/26", "10.244.0.128/26"]
    );
    assert!(o.complete);
    assert_eq!(
        a.verdict("r", &"10.244.0.0/26".parse().expect("net")),
        Some(Verdict::Own)
    );
    a.tick(t0 + SETTLE);
    assert!(a.refusals().is_empty());
}

#[test]
fn a_non_reflector_cannot_relay_and_a_direct_route_wins_over_a_relayed_one() {
    let t0 = Instant::now();
    let mut a = engine("a", Topology::Mesh, false);
    a.flush(t0);
    // b relays c's block (b is no reflector) and a's own block (a hijack attempt).
    a.peer_event(
        "b",
        snapshot(vec![
            route("10.244.0.128/26", "c"),
            route("10.244.0.0/26", "a"),
        ]),
        t0,
    );
    a.flush(t0);
    a.tick(t0 + SETTLE);
    assert_eq!(a.refusals().get(&Refusal::NotItsOwn), Some(&2));
    // r (a reflector, also followed in a mesh) relays c's block with an old next hop c
    // still has on record; c's own announcement is preferred.
    a.view_event(&put(node_kv("c", &["172.31.1.3", "172.31.1.33"], false)));
    let mut old = route("10.244.0.128/26", "c");
    old.next_hop = "172.31.1.33".parse().expect("ip");
    a.peer_event("r", snapshot(vec![old]), t0);
    let o = a.flush(t0);
    assert_eq!(o.desired[0].next_hop.to_string(), "172.31.1.33");
    a.peer_event("c", snapshot(vec![route("10.244.0.128/26", "c")]), t0);
    let o = a.flush(t0);
    assert_eq!(o.desired.len(), 1);
    assert_eq!(o.desired[0].next_hop.to_string(), "172.31.1.3");
}

/// 100 peers × 100 blocks: every route validated and merged; a block's change re-judges only
/// the routes inside it, a fresh listing all of them. What judging costs is counted in routes
/// judged, not timed: speed is measured by `cargo xtask bench routes`, not asserted here (the
/// times are printed for the curious).
#[test]
fn a_hundred_peers_with_a_hundred_blocks_each() {
    let t0 = Instant::now();
    let mut e = Engine::new(settings("a", Topology::Mesh, false));
    let mut nodes = vec![node_kv("a", &["172.31.1.1"], false)];
    let mut blocks = Vec::new();
    let mut snapshots = Vec::new();
    for n in 0..100u32 {
        let name = format!("n{n}");
        let hop = format!("172.30.{}.{}", n / 250, n % 250 + 1);
        nodes.push(node_kv(&name, &[&hop], false));
        let mut routes = Vec::new();
        for b in 0..100u32 {
            let i = n * 100 + b;
            let cidr = format!(
                "10.{}.{}.{}/26",
                100 + i / 1024,
                (i / 4) % 256,
                (i % 4) * 64
            );
            blocks.push(block_kv(&cidr, &name, &[]));
            routes.push(Route {
                prefix: cidr.parse().expect("net"),
                node: name.clone(),
                next_hop: hop.parse().expect("ip"),
            });
        }
        snapshots.push((name, routes));
    }
    e.view_listed(Part::Nodes, nodes.clone());
    e.view_listed(Part::Blocks, blocks.clone());
    e.flush(t0);
    let (start, before) = (Instant::now(), e.judged());
    for (name, routes) in snapshots {
        e.peer_event(&name, snapshot(routes), t0);
    }
    let o = e.flush(t0);
    let (learn, learn_cost) = (start.elapsed(), e.judged() - before);
    assert_eq!(o.desired.len(), 10_000);
    assert!(o.complete);
    let (start, before) = (Instant::now(), e.judged());
    e.view_event(&put(block_kv("10.200.0.0/26", "n1", &[])));
    assert_eq!(e.flush(t0).desired.len(), 10_000);
    let (block, block_cost) = (start.elapsed(), e.judged() - before);
    let (start, before) = (Instant::now(), e.judged());
    e.view_listed(Part::Blocks, blocks.clone());
    assert_eq!(e.flush(t0).desired.len(), 10_000);
    let (revalidate, revalidate_cost) = (start.elapsed(), e.judged() - before);
    eprintln!(
        "learn 10000 routes: {learn:?}; a block's change: {block:?}; a fresh listing (re-judges all): {revalidate:?}"
    );
    // Every route judged once to learn it, the one route inside the changed block again,
    // and every route again after a fresh listing.
    assert_eq!(learn_cost, 10_000);
    assert!(
        block_cost <= 1,
        "a block's change judged {block_cost} routes"
    );
    assert_eq!(revalidate_cost, 10_000);
}

/// A deadline that passed without a tick (the loop woke for something else just then) is
/// still due: otherwise the refusal never settles and the grace never ends.
#[test]
fn a_missed_deadline_stays_due_until_ticked() {
    let t0 = Instant::now();
    let mut e = engine("a", Topology::Mesh, false);
    e.flush(t0);
    e.peer_event("c", snapshot(vec![route("10.244.0.64/26", "b")]), t0);
    e.peer_event("b", snapshot(vec![route("10.244.0.64/26", "b")]), t0);
    e.flush(t0);
    e.peer_event(
        "b",
        PeerEvent::Down {
            reason: "gone".into(),
            broke: None,
        },
        t0,
    );
    e.flush(t0);
    let late = t0 + GRACE + Duration::from_secs(1);
    assert_eq!(
        e.next_deadline(late),
        Some(t0 + SETTLE),
        "the refusal is still due"
    );
    e.tick(late);
    assert_eq!(
        e.next_deadline(late),
        None,
        "nothing due after the tick (r and c settled or never)"
    );
    assert_eq!(e.refusals().get(&Refusal::NotItsOwn), Some(&1));
    assert!(e.flush(late).desired.is_empty(), "b's grace ran out");
}

/// `peers` peers n0.. with `blocks` blocks each (in the view and announced), listed and
/// learned by "a".
fn learned(peers: u32, blocks: u32) -> Engine {
    let t0 = Instant::now();
    let mut e = Engine::new(settings("a", Topology::Mesh, false));
    let mut nodes = vec![node_kv("a", &["172.31.1.1"], false)];
    let mut kvs = Vec::new();
    let mut snapshots = Vec::new();
    for n in 0..peers {
        let name = format!("n{n}");
        let hop = format!("172.30.{}.{}", n / 250, n % 250 + 1);
        nodes.push(node_kv(&name, &[&hop], false));
        let mut routes = Vec::new();
        for b in 0..blocks {
            let cidr = big_block(n * blocks + b);
            kvs.push(block_kv(&cidr, &name, &[]));
            routes.push(Route {
                prefix: cidr.parse().expect("net"),
                node: name.clone(),
                next_hop: hop.parse().expect("ip"),
            });
        }
        snapshots.push((name, routes));
    }
    e.view_listed(Part::Nodes, nodes.clone());
    e.view_listed(Part::Blocks, kvs.clone());
    e.flush(t0);
    for (name, routes) in snapshots {
        e.peer_event(&name, snapshot(routes), t0);
    }
    assert_eq!(e.flush(t0).desired.len(), (peers * blocks) as usize);
    e
}

/// Block `i` of [`learned`]: a /26 in 10.100.0.0/8.
fn big_block(i: u32) -> String {
    format!(
        "10.{}.{}.{}/26",
        100 + i / 1024,
        (i / 4) % 256,
        (i % 4) * 64
    )
}

/// Checking one delta costs what the delta changes, not the peer's whole table.
#[test]
fn a_delta_re_judges_only_the_prefixes_it_changed() {
    let t0 = Instant::now();
    let mut e = learned(2, 1000);
    let before = e.judged();
    let hop: std::net::IpAddr = "172.30.0.1".parse().expect("ip");
    // n0 announces one new route (refused: no such block) and withdraws one.
    e.peer_event(
        "n0",
        PeerEvent::Delta {
            generation: 2,
            routes: vec![Route {
                prefix: "10.99.0.0/26".parse().expect("net"),
                node: "n0".into(),
                next_hop: hop,
            }],
            withdrawn: vec![big_block(0).parse().expect("net")],
            unused: Unused::default(),
        },
        t0,
    );
    let start = Instant::now();
    assert_eq!(e.flush(t0).desired.len(), 1999);
    eprintln!(
        "a delta of 2 prefixes, 2000 routes held: flushed in {:?}",
        start.elapsed()
    );
    let cost = e.judged() - before;
    assert!(
        cost <= 2,
        "a delta of 2 prefixes of a peer holding 1000 re-judged {cost} routes"
    );
}

/// A block's change re-judges the routes inside its CIDR only; a node record's change, the
/// routes of that node (and everything its own peer says, since the record says whether it
/// may relay).
#[test]
fn a_view_change_re_judges_only_the_routes_it_can_affect() {
    let t0 = Instant::now();
    let mut e = learned(100, 100);
    let before = e.judged();
    // n1's block 100 (its first) released.
    e.view_event(&put(block_kv(&big_block(100), "", &[])));
    assert_eq!(e.flush(t0).desired.len(), 9999);
    let cost = e.judged() - before;
    assert!(
        cost <= 1,
        "a block's change re-judged {cost} routes of 10,000"
    );
    let before = e.judged();
    e.view_event(&put(node_kv("n2", &["172.30.0.3", "172.30.9.9"], false)));
    assert_eq!(e.flush(t0).desired.len(), 9999);
    let cost = e.judged() - before;
    assert!(
        cost <= 100,
        "n2's node record's change re-judged {cost} routes (n2 has 100)"
    );
}

/// Every verdict, as judged incrementally, is what judging from scratch gives, over random
/// sequences of datastore changes (blocks claimed, released, overlapping, with allocations;
/// node records changing addresses and role, deleted) and of what peers say (snapshots,
/// deltas, drops): the cause or acceptance of each route against `validate` itself, and
/// every verdict and output against a full re-judge of the same state.
#[test]
fn incremental_verdicts_equal_a_judge_from_scratch() {
    const NODES: [&str; 4] = ["a", "b", "c", "r"];
    const PEERS: [&str; 3] = ["b", "c", "r"];
    const HOPS: [&str; 4] = ["172.31.1.2", "172.31.1.3", "172.31.1.9", "172.31.1.7"];
    // Blocks of two lengths that overlap (a /25 and the /26s in it), and one apart.
    const CIDRS: [&str; 5] = [
        "10.244.0.0/26",
        "10.244.0.64/26",
        "10.244.0.0/25",
        "10.244.0.128/26",
        "10.244.1.0/26",
    ];
    const ADDRS: [&str; 6] = [
        "10.244.0.1",
        "10.244.0.5",
        "10.244.0.70",
        "10.244.0.130",
        "10.244.1.9",
        "10.244.2.1",
    ];
    for seed in 1..=24u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut t = Instant::now();
        let mut e = engine("a", Topology::Mesh, false);
        let mut blocks: BTreeMap<String, KeyValue> = block_kvs()
            .into_iter()
            .map(|kv| (kv.key.clone(), kv))
            .collect();
        let mut nodes: BTreeMap<String, KeyValue> = node_kvs()
            .into_iter()
            .map(|kv| (kv.key.clone(), kv))
            .collect();
        let mut generation: BTreeMap<&str, u64> = BTreeMap::new();
        e.flush(t);
        let prefixes: Vec<String> = CIDRS
            .iter()
            .map(|c| c.to_string())
            .chain(ADDRS.iter().map(|a| format!("{a}/32")))
            .chain(["10.244.0.0/27".to_string()])
            .collect();
        let random_route = |rng: &mut Rng| Route {
            prefix: rng.pick(&prefixes).parse().expect("net"),
            node: rng.pick(&NODES).to_string(),
            next_hop: rng.pick(&HOPS).parse().expect("ip"),
        };
        for step in 0..400 {
            match rng.below(10) {
                0 | 1 => {
                    let cidr = *rng.pick(&CIDRS);
                    let affinity = *rng.pick(&["a", "b", "c", "r", ""]);
                    let net: IpNet = cidr.parse().expect("net");
                    let mut allocs: Vec<(&str, &str)> = Vec::new();
                    for a in ADDRS {
                        if net.contains(&a.parse::<IpAddr>().expect("ip")) && rng.below(2) == 0 {
                            allocs.push((a, *rng.pick(&NODES)));
                        }
                    }
                    let kv = block_kv(cidr, affinity, &allocs);
                    e.view_event(&put(kv.clone()));
                    blocks.insert(kv.key.clone(), kv);
                }
                2 => {
                    let key = keys::block(&rng.pick(&CIDRS).parse().expect("net"));
                    blocks.remove(&key);
                    e.view_event(&WatchEvent::Delete { key, revision: 1 });
                }
                3 => {
                    let name = *rng.pick(&PEERS);
                    if rng.below(4) == 0 {
                        let key = keys::node(name);
                        nodes.remove(&key);
                        e.view_event(&WatchEvent::Delete { key, revision: 1 });
                    } else {
                        let hops: Vec<&str> =
                            HOPS.iter().copied().filter(|_| rng.below(2) == 0).collect();
                        let kv = node_kv(name, &hops, rng.below(3) == 0);
                        e.view_event(&put(kv.clone()));
                        nodes.insert(kv.key.clone(), kv);
                    }
                }
                4 => {
                    let peer = *rng.pick(&PEERS);
                    let routes = (0..rng.below(6)).map(|_| random_route(&mut rng)).collect();
                    let g = rng.next() % 1000;
                    generation.insert(peer, g);
                    e.peer_event(
                        peer,
                        PeerEvent::Snapshot {
                            generation: g,
                            routes,
                            unused: Unused::default(),
                        },
                        t,
                    );
                }
                5..=7 => {
                    let peer = *rng.pick(&PEERS);
                    let g = generation.entry(peer).or_default();
                    *g += 1;
                    let routes = (0..rng.below(3)).map(|_| random_route(&mut rng)).collect();
                    let withdrawn = (0..rng.below(3))
                        .map(|_| rng.pick(&prefixes).parse().expect("net"))
                        .collect();
                    e.peer_event(
                        peer,
                        PeerEvent::Delta {
                            generation: *g,
                            routes,
                            withdrawn,
                            unused: Unused::default(),
                        },
                        t,
                    );
                }
                8 => {
                    let peer = *rng.pick(&PEERS);
                    e.peer_event(
                        peer,
                        PeerEvent::Down {
                            reason: "gone".into(),
                            broke: None,
                        },
                        t,
                    );
                }
                _ => {
                    t += Duration::from_millis(rng.below(4000) as u64);
                    if rng.below(8) == 0 {
                        t += GRACE;
                    }
                    e.tick(t);
                }
            }
            let inc = e.flush(t);
            let judged_inc: BTreeMap<(String, IpNet), Verdict> = all_verdicts(&e);
            // Each verdict is validate's own answer.
            for (peer, s) in e.sessions() {
                let relays = e.view().node(peer).is_some_and(|n| n.record.reflector);
                for (p, r) in &s.routes {
                    let want = if r.node == "a" && relays {
                        Ok(Verdict::Own)
                    } else {
                        validate(e.view(), peer, r).map(|()| Verdict::Accepted)
                    };
                    let got = match e.verdict(peer, p) {
                        Some(Verdict::Pending { cause, .. }) | Some(Verdict::Refused(cause)) => {
                            Err(cause)
                        }
                        Some(v) => Ok(v),
                        None => panic!("seed {seed} step {step}: {peer}'s {p} has no verdict"),
                    };
                    assert_eq!(got, want, "seed {seed} step {step}: {peer}'s {r:?}");
                }
                assert_eq!(
                    judged_inc.keys().filter(|(n, _)| n == peer).count(),
                    s.routes.len(),
                    "seed {seed} step {step}: verdicts of {peer}'s prefixes gone"
                );
                let accepted = s
                    .routes
                    .keys()
                    .filter(|p| e.verdict(peer, p) == Some(Verdict::Accepted))
                    .count();
                assert_eq!(e.accepted(peer), accepted, "seed {seed} step {step}");
            }
            // And a full re-judge of the same state changes nothing.
            if step % 7 == 0 {
                e.view_listed(Part::Blocks, blocks.values().cloned().collect());
                e.view_listed(Part::Nodes, nodes.values().cloned().collect());
                let full = e.flush(t);
                assert_eq!(inc, full, "seed {seed} step {step}");
                assert_eq!(judged_inc, all_verdicts(&e), "seed {seed} step {step}");
            }
        }
    }
}

fn all_verdicts(e: &Engine) -> BTreeMap<(String, IpNet), Verdict> {
    e.verdicts
        .iter()
        .flat_map(|(peer, j)| j.verdicts.iter().map(|(p, v)| ((peer.clone(), *p), *v)))
        .collect()
}

/// Issue 20, item 1a: blocks forged affine to node c — a /32 over a's pod's address, and
/// 0.0.0.0/0 — are not advertised by c's own agent, and a refuses them when c announces them
/// (before: c advertised both, a accepted both, and longest-prefix match pulled a's pod's
/// traffic, or everything, to c).
#[test]
fn forged_blocks_are_neither_advertised_nor_accepted() {
    let t0 = Instant::now();
    let forged = [
        block_kv("10.244.0.1/32", "c", &[]),
        block_kv("0.0.0.0/0", "c", &[]),
    ];
    let mut c = engine("c", Topology::Mesh, false);
    for kv in &forged {
        c.view_event(&put(kv.clone()));
    }
    let own: Vec<String> = c.flush(t0).own.keys().map(ToString::to_string).collect();
    assert_eq!(own, ["10.244.0.128/26"], "c advertises only its real block");
    let mut a = engine("a", Topology::Mesh, false);
    for kv in &forged {
        a.view_event(&put(kv.clone()));
    }
    a.flush(t0);
    a.peer_event(
        "c",
        snapshot(vec![
            route("10.244.0.1/32", "c"),
            route("0.0.0.0/0", "c"),
            route("10.244.0.128/26", "c"),
        ]),
        t0,
    );
    a.flush(t0);
    a.tick(t0 + SETTLE);
    let o = a.flush(t0 + SETTLE);
    assert_eq!(
        prefixes(&o),
        ["10.244.0.128/26"],
        "a takes only c's real block"
    );
    for p in ["10.244.0.1/32", "0.0.0.0/0"] {
        assert_eq!(
            a.verdict("c", &p.parse().expect("net")),
            Some(Verdict::Refused(Refusal::BlockIgnored)),
            "{p}"
        );
    }
    assert_eq!(a.refusals().get(&Refusal::BlockIgnored), Some(&2));
    assert_eq!(a.view().ignored().len(), 2);
}

/// New pools sort the blocks again: a block of a size the pool did not make counts once the
/// pool says it had that size before, and stops counting when the pool goes.
#[test]
fn new_pools_sort_the_blocks_again() {
    let t0 = Instant::now();
    let mut c = engine("c", Topology::Mesh, false);
    c.view_event(&put(block_kv("10.244.1.0/28", "c", &[])));
    let own = |e: &mut Engine| -> Vec<String> {
        e.flush(t0).own.keys().map(ToString::to_string).collect()
    };
    assert_eq!(own(&mut c), ["10.244.0.128/26"]);
    let mut pools = crate::routes::view::tests::pools();
    pools[0].previous_block_sizes.push(28);
    c.set_block_pools(pools.clone());
    assert_eq!(own(&mut c), ["10.244.0.128/26", "10.244.1.0/28"]);
    pools.remove(0);
    c.set_block_pools(pools);
    assert!(own(&mut c).is_empty());
}

/// The route guard, whatever validation said: c's block 10.244.0.128/26 is valid, but it
/// covers node d's recorded address 10.244.0.130 (a node whose address sits in a pod pool), so
/// it never reaches the reconciler: counted once, kept out while it lasts. Before, it was
/// handed over, and traffic to node d would have gone to c.
#[test]
fn the_route_guard_keeps_out_a_valid_route_covering_a_nodes_address() {
    let t0 = Instant::now();
    let mut a = engine("a", Topology::Mesh, false);
    a.view_event(&put(node_kv("d", &["10.244.0.130"], false)));
    a.flush(t0);
    a.peer_event("c", snapshot(vec![route("10.244.0.128/26", "c")]), t0);
    a.peer_event("b", snapshot(vec![route("10.244.0.64/26", "b")]), t0);
    let o = a.flush(t0);
    assert_eq!(
        a.verdict("c", &"10.244.0.128/26".parse().expect("net")),
        Some(Verdict::Accepted),
        "validation accepts it"
    );
    assert_eq!(prefixes(&o), ["10.244.0.64/26"], "the guard keeps it out");
    let o = a.flush(t0 + Duration::from_secs(1));
    assert_eq!(prefixes(&o), ["10.244.0.64/26"]);
    assert_eq!(
        a.guard_counts()
            .get(&crate::reconcile::remote::Guarded::CoversNodeAddress),
        Some(&1),
        "counted once"
    );
    assert_eq!(a.guarded().len(), 1);
}

/// Both ways of reading the accepted routes (by lookup, walking in step) give exactly the
/// accepted ones, in order, whatever the share accepted.
#[test]
fn accepted_routes_are_the_accepted_ones_both_ways() {
    let routes: BTreeMap<IpNet, Route> = (0..200u32)
        .map(|i| {
            let p: IpNet = format!("10.244.{}.{}/32", i / 64, (i % 64) * 4)
                .parse()
                .expect("net");
            let r = Route {
                prefix: p,
                node: format!("n{i}"),
                next_hop: "172.31.1.2".parse().expect("ip"),
            };
            (p, r)
        })
        .collect();
    for every in [1usize, 2, 3, 7, 50, 199, 1000] {
        let mut accepted: BTreeSet<IpNet> = routes.keys().step_by(every).copied().collect();
        // A prefix the peer no longer says: skipped, whichever way.
        accepted.insert("10.245.0.0/26".parse().expect("net"));
        let want: Vec<IpNet> = routes
            .keys()
            .filter(|p| accepted.contains(p))
            .copied()
            .collect();
        let got: Vec<IpNet> = accepted_routes(&accepted, &routes)
            .map(|r| r.prefix)
            .collect();
        assert_eq!(got, want, "every {every}th accepted");
    }
}
