//! BGP's resources in Kubernetes (issue 23), against a real kube-apiserver: an agent
//! authenticated with only the chart's ClusterRole reads the BGPConfigurations (`default`,
//! and `node.<node>` over it) and the BGPPeers that select its node (every node, this node by
//! name, its labels), and peers with exactly those; a peer whose password is not mounted is
//! refused (logged, an Event on the Node) and the others are used; a password from the mounted
//! Secret's key reaches the peer. The peers are on the node's loopback: the connections are
//! refused, the configuration is what is checked (the sessions themselves: bgp_cluster), but
//! for one, a raw BGP peer in the node's namespace: its session is established, then its
//! connection drops, and the Node gets a `BGPSessionDown` Event.
use std::net::TcpListener;
use std::time::Duration;

use calix_testbed::{unique, wait_for, KubeApi, Node};
use common::raw_bgp::Raw;
use serde_json::{json, Value};

mod common;

/// The node's next hop, and the raw peer's address (both on the node's loopback).
const NODE_IP: &str = "192.0.2.77";
const LIVE_PEER: &str = "192.0.2.78";

/// The Warning Events of `reason` on Node `name`.
fn events(api: &KubeApi, reason: &str, name: &str) -> Vec<Value> {
    api.list("v1", "Event", "")
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["reason"] == reason && e["involvedObject"]["name"] == name)
        .collect()
}

fn peers(node: &Node) -> Value {
    let out = node.calixctl(&["bgp", "peers", "-o", "json"]);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "calixctl bgp peers: {e}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn bgp_object(kind: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "calix.dev/v1", "kind": kind, "metadata": {"name": name}, "spec": spec})
}

#[test]
fn an_agent_peers_with_the_bgp_peers_that_select_its_node() {
    let api = KubeApi::shared();
    let u = unique("b");
    let passwords = std::env::temp_dir().join(unique("bgp-passwords"));
    /// The passwords' directory, removed when the test ends, passed or not.
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _gone = Gone(passwords.clone());
    let secret = passwords.join("calix-bgp-passwords");
    std::fs::create_dir_all(&secret).expect("secret dir");
    std::fs::write(secret.join("tor"), "s3cret").expect("password");
    let extra = format!(
        "[bgp]\nenabled = true\nnode_addresses = [\"192.0.2.77\"]\npassword_dir = {:?}\n",
        passwords.display().to_string()
    );
    let node = api
        .kubernetes_node(
            Node::create(calix_testbed::Dataplane::Kernel, None),
            None,
            &extra,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let name = node.ns.name.clone();
    for a in [NODE_IP, LIVE_PEER] {
        node.ns
            .ip(&format!("addr add {a}/32 dev lo"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let live = node
        .ns
        .run(|| TcpListener::bind(format!("{LIVE_PEER}:179")).expect("bind"));
    api.node_object(
        &name,
        json!({"calix.dev/test": u, "rack": "a"}),
        &[("InternalIP", "192.0.2.77")],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    api.apply(json!({"apiVersion": "calix.dev/v1", "kind": "IPPool",
        "metadata": {"name": format!("{u}-pool")}, "spec": {"cidr": "10.88.0.0/24",
        "nodeSelector": {"calix.dev/test": u}}}))
        .unwrap_or_else(|e| panic!("{e}"));
    for o in [
        bgp_object(
            "BGPConfiguration",
            "default",
            json!({"asNumber": 64512, "restartTimeSecs": 60}),
        ),
        bgp_object(
            "BGPConfiguration",
            &format!("node.{name}"),
            json!({"asNumber": 64777, "routerID": "10.77.0.1"}),
        ),
        // Every node (the loopback: refused at once, nothing leaves the node).
        bgp_object(
            "BGPPeer",
            &format!("{u}-all"),
            json!({"peerIP": "127.0.0.2", "asNumber": 65000,
                   "password": {"secretKeyRef": {"name": "calix-bgp-passwords", "key": "tor"}}}),
        ),
        bgp_object(
            "BGPPeer",
            &format!("{u}-mine"),
            json!({"peerIP": "127.0.0.3", "asNumber": 65001, "node": name, "holdTimeSecs": 30}),
        ),
        bgp_object(
            "BGPPeer",
            &format!("{u}-rack"),
            json!({"peerIP": "::1", "asNumber": 65002, "nodeSelector": {"rack": "a"},
                   "maxPrefixesAction": "reset", "communities": ["65002:7"]}),
        ),
        // The raw peer.
        bgp_object(
            "BGPPeer",
            &format!("{u}-live"),
            json!({"peerIP": LIVE_PEER, "asNumber": 65008, "node": name}),
        ),
        // Not this node's.
        bgp_object(
            "BGPPeer",
            &format!("{u}-other-node"),
            json!({"peerIP": "127.0.0.4", "asNumber": 65003, "node": "elsewhere"}),
        ),
        bgp_object(
            "BGPPeer",
            &format!("{u}-other-rack"),
            json!({"peerIP": "127.0.0.5", "asNumber": 65004, "nodeSelector": {"rack": "b"}}),
        ),
        // Its password's Secret is not the one mounted.
        bgp_object(
            "BGPPeer",
            &format!("{u}-unmounted"),
            json!({"peerIP": "127.0.0.6", "asNumber": 65005,
                   "password": {"secretKeyRef": {"name": "elsewhere", "key": "tor"}}}),
        ),
    ] {
        api.apply(o).unwrap_or_else(|e| panic!("{e}"));
    }
    node.start_agent();
    let report = wait_for(
        "the agent's BGP peers",
        Duration::from_secs(20),
        || {
            let p = peers(&node);
            (p.as_array().map(Vec::len) == Some(4)).then_some(p)
        },
        || format!("{}\n{}", peers(&node), node.agent_log()),
    );
    let mut got: Vec<(String, String, u64)> = report
        .as_array()
        .expect("peers")
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or_default().to_string(),
                p["address"].as_str().unwrap_or_default().to_string(),
                p["asn"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            (format!("{u}-all"), "127.0.0.2".to_string(), 65000),
            (format!("{u}-live"), LIVE_PEER.to_string(), 65008),
            (format!("{u}-mine"), "127.0.0.3".to_string(), 65001),
            (format!("{u}-rack"), "::1".to_string(), 65002),
        ],
        "exactly the peers that select this node"
    );
    let full: Value =
        serde_json::from_slice(&node.calixctl(&["bgp", "routes", "-o", "json"]).stdout)
            .expect("routes json");
    assert!(full["complete"].is_boolean(), "{full}");
    let table = String::from_utf8_lossy(&node.calixctl(&["bgp", "peers"]).stdout).into_owned();
    assert!(
        table.contains("AS 64777, router ID 10.77.0.1"),
        "the node's own BGPConfiguration over the default:\n{table}"
    );
    let log = node.agent_log();
    assert!(
        log.contains("BGPPeer refused") && log.contains(&format!("{u}-unmounted")),
        "{log}"
    );
    let refused = wait_for(
        "the BGPPeerRefused Event",
        Duration::from_secs(10),
        || {
            let e = events(&api, "BGPPeerRefused", &name);
            (!e.is_empty()).then_some(e)
        },
        String::new,
    );
    assert!(
        refused[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("elsewhere/tor")),
        "{refused:?}"
    );

    // The raw peer's session: established, then its connection drops.
    let mut raw = Raw::accept(&live);
    raw.open(65008);
    let live_name = format!("{u}-live");
    wait_for(
        "the raw peer's session",
        Duration::from_secs(10),
        || {
            peers(&node)
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["name"] == live_name.as_str() && p["state"] == "Established")
                .then_some(())
        },
        || format!("{}\n{}", peers(&node), node.agent_log()),
    );
    drop(raw);
    drop(live);
    let down = wait_for(
        "the BGPSessionDown Event",
        Duration::from_secs(10),
        || {
            let e = events(&api, "BGPSessionDown", &name);
            (!e.is_empty()).then_some(e)
        },
        || node.agent_log(),
    );
    assert!(
        down[0]["type"] == "Warning"
            && down[0]["message"]
                .as_str()
                .is_some_and(|m| m.contains(&live_name) && m.contains("went down")),
        "{down:?}"
    );

    // Changed while the agent runs: a peer removed, one added, the node's AS number.
    api.delete("calix.dev/v1", "BGPPeer", &format!("{u}-mine"))
        .unwrap_or_else(|e| panic!("{e}"));
    api.apply(bgp_object(
        "BGPPeer",
        &format!("{u}-new"),
        json!({"peerIP": "127.0.0.7", "asNumber": 65007, "node": name}),
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    api.apply(bgp_object(
        "BGPConfiguration",
        &format!("node.{name}"),
        json!({"asNumber": 64778, "routerID": "10.77.0.1"}),
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the new peers and AS number, without a restart",
        Duration::from_secs(20),
        || {
            let mut names: Vec<String> = peers(&node)
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["name"].as_str().map(String::from))
                .collect();
            names.sort();
            let table =
                String::from_utf8_lossy(&node.calixctl(&["bgp", "peers"]).stdout).into_owned();
            (names
                == [
                    format!("{u}-all"),
                    format!("{u}-live"),
                    format!("{u}-new"),
                    format!("{u}-rack"),
                ]
                && table.contains("AS 64778"))
            .then_some(())
        },
        || format!("{}\n{}", peers(&node), node.agent_log()),
    );
    assert_eq!(
        node.agent_log().matches("starting calix-agent").count(),
        1,
        "one start"
    );
    node.stop_agent();
    for kind_name in [
        ("BGPConfiguration", "default".to_string()),
        ("BGPConfiguration", format!("node.{name}")),
    ] {
        let _ = api.delete("calix.dev/v1", kind_name.0, &kind_name.1);
    }
    for p in [
        "all",
        "live",
        "new",
        "rack",
        "other-node",
        "other-rack",
        "unmounted",
    ] {
        let _ = api.delete("calix.dev/v1", "BGPPeer", &format!("{u}-{p}"));
    }
}
