//! calix on the `kubernetes` datastore (issue 14): real agents in node namespaces on a real
//! kube-apiserver v1.36.2 (with its etcd, in a namespace of its own; each node reaches it over
//! a veth), driven through the agents' gRPC API: concurrent allocations on three nodes, with an
//! agent killed and the API server restarted under them, and pools as IPPool objects. Each
//! agent runs as the agents' ServiceAccount with a token bound to a pod on its node, under the
//! chart's node authority: every write it makes must be its node's own.
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

mod common;

use calix_proto::v1 as pb;
use calix_testbed::{Dataplane, KubeApi, Node};
use common::{allocate, allocate_many, client, findings_of, ipam_json, release, rt};
use serde_json::{json, Value};

fn ippool(name: &str, cidr: &str, block_size: u8, disabled: bool) -> Value {
    json!({
        "apiVersion": "calix.dev/v1",
        "kind": "IPPool",
        "metadata": {"name": name},
        "spec": {"cidr": cidr, "blockSize": block_size, "disabled": disabled},
    })
}

/// Housekeeping every second (handle records repaired from the blocks after a failed write),
/// leaks released after the default 10 minutes: the tests register no endpoints.
const HOUSEKEEPING: &str = "[ipam]\nleakCheckIntervalSecs = 1\n";
/// Leak GC every second with a 2 s grace: for the end of a test only.
const FAST_GC: &str = "[ipam]\nleakCheckIntervalSecs = 1\nleakGraceSecs = 2\n";

/// A node on `api` (kubernetes datastore, `extra` config appended), its agent started, as the
/// agents' ServiceAccount with a token bound to a pod on its node, under the chart's node
/// authority.
fn kube_node(api: &KubeApi, extra: &str) -> Node {
    let probe = Node::create(Dataplane::Kernel, None);
    let token = api
        .agent_token(&probe.ns.name)
        .unwrap_or_else(|e| panic!("{e}"));
    let kubeconfig = api
        .wire_as(&probe.ns, &token)
        .unwrap_or_else(|e| panic!("{e}"));
    let node = probe.with_config(&format!(
        "[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\ntimeout_ms = 5000\nattempts = 40\n{extra}",
        kubeconfig.display()
    ));
    node.start_agent();
    node
}

/// Every write the agent made was its own node's: none refused by the node authority.
fn assert_admitted(node: &Node) {
    let log = node.agent_log();
    let refused = calix_testbed::authority::refusals(&log);
    assert!(refused.is_empty(), "{}", refused.join("\n"));
}

/// No address acknowledged to two handles.
fn assert_distinct(results: &[(String, Result<IpAddr, tonic::Status>)]) -> usize {
    let mut seen: HashMap<IpAddr, &str> = HashMap::new();
    for (h, r) in results {
        if let Ok(a) = r {
            if let Some(other) = seen.insert(*a, h) {
                panic!("{a} given to both {other} and {h}");
            }
        }
    }
    seen.len()
}

/// Waits until `calixctl ipam check` on `node` finds nothing at all.
fn wait_clean(node: &Node) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let check = ipam_json(node, "check");
        if check["findings"] == json!([]) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "ipam check not clean: {check}\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn three_agents_on_the_kubernetes_api_never_give_an_address_twice() {
    let api = KubeApi::in_namespace();
    api.apply(ippool("pool-a", "10.60.0.0/20", 26, false))
        .unwrap_or_else(|e| panic!("{e}"));
    let nodes: Vec<Node> = (0..3).map(|_| kube_node(&api, "")).collect();
    let rt = rt();
    let results: Vec<_> = rt.block_on(async {
        let mut runs = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            let c = client(n).await;
            runs.push(tokio::spawn(async move {
                allocate_many(&c, &format!("n{i}"), 300, 32).await
            }));
        }
        let mut out = Vec::new();
        for r in runs {
            out.push(r.await.expect("join"));
        }
        out
    });
    let all: Vec<_> = results.iter().flatten().cloned().collect();
    for (h, r) in &all {
        r.as_ref().unwrap_or_else(|e| panic!("{h}: {e}"));
    }
    assert_eq!(assert_distinct(&all), 900);
    let show = ipam_json(&nodes[0], "show");
    let used: u64 = show["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .map(|b| b["used"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(used, 900);
    for n in show["nodes"].as_array().expect("nodes") {
        assert_eq!(n["used"], 300, "{n}");
    }
    // Each node's blocks, listed by label from its BlockAffinity objects, are the blocks
    // whose IPAMBlock says so.
    let blocks = api
        .list("calix.dev/v1", "IPAMBlock", "")
        .unwrap_or_else(|e| panic!("{e}"));
    for n in &nodes {
        let name = &n.ns.name;
        let mut affine: Vec<&str> = blocks
            .iter()
            .filter(|b| b["spec"]["affinity"] == name.as_str())
            .filter_map(|b| b["spec"]["cidr"].as_str())
            .collect();
        affine.sort();
        let listed = api
            .list(
                "calix.dev/v1",
                "BlockAffinity",
                &format!("calix.dev/node={name}"),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        let mut by_label: Vec<&str> = listed
            .iter()
            .inspect(|a| assert_eq!(a["spec"]["node"], name.as_str(), "{a}"))
            .filter_map(|a| a["spec"]["cidr"].as_str())
            .collect();
        by_label.sort();
        assert!(affine.len() >= 5, "{name}: {affine:?}");
        assert_eq!(by_label, affine, "{name}'s BlockAffinity objects");
    }
    let check = ipam_json(&nodes[1], "check");
    for kind in [
        "duplicate",
        "orphan-handle",
        "orphan-allocation",
        "orphan-block",
        "missing-affinity",
        "orphan-affinity",
    ] {
        assert!(findings_of(&check, kind).is_empty(), "{kind}: {check}");
    }
    // Released again through each agent: nothing is left, nothing is found.
    rt.block_on(async {
        for (i, n) in nodes.iter().enumerate() {
            let c = client(n).await;
            for (h, _) in &results[i] {
                release(c.clone(), h.clone()).await;
            }
        }
    });
    wait_clean(&nodes[2]);
    nodes.iter().for_each(assert_admitted);
}

#[test]
fn an_agent_killed_and_the_api_server_restarted_mid_run_lose_nothing() {
    let api = KubeApi::in_namespace();
    api.apply(ippool("pool-a", "10.61.0.0/20", 26, false))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut nodes: Vec<Node> = (0..3).map(|_| kube_node(&api, HOUSEKEEPING)).collect();
    let rt = rt();
    let (results, killed_at, restarted_at) = rt.block_on(async {
        let mut runs = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            let c = client(n).await;
            runs.push(tokio::spawn(async move {
                allocate_many(&c, &format!("n{i}"), 300, 16).await
            }));
        }
        let allocated = |n: &Node| n.agent_log().matches("allocated").count();
        // kill -9 of agent 0 once it has done a good part; the API server restarted once
        // the others are well into theirs.
        let deadline = Instant::now() + Duration::from_secs(60);
        while allocated(&nodes[0]) < 80 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let killed_at = allocated(&nodes[0]);
        nodes[0].kill_agent();
        while allocated(&nodes[1]) < 150 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let restarted_at = allocated(&nodes[1]);
        api.restart_apiserver();
        nodes[0].start_agent();
        let mut out = Vec::new();
        for r in runs {
            out.push(r.await.expect("join"));
        }
        (out, killed_at, restarted_at)
    });
    let failed: Vec<&String> = results[0]
        .iter()
        .filter(|(_, r)| r.is_err())
        .map(|(h, _)| h)
        .collect();
    eprintln!(
        "agent 0 killed after {killed_at} allocations ({} of its 300 failed); API server restarted after {restarted_at} of node 1's",
        failed.len()
    );
    assert!(
        !failed.is_empty() && failed.len() < 300,
        "the kill came too early or too late"
    );
    assert!(restarted_at < 300, "the API server restart came too late");
    // Nodes 1 and 2 rode out the API server's restart: every allocation acknowledged.
    for (i, r) in results.iter().enumerate().skip(1) {
        for (h, a) in r {
            a.as_ref()
                .unwrap_or_else(|e| panic!("node {i}: {h}: {e}\n{}", nodes[i].agent_log()));
        }
    }
    let all: Vec<_> = results.iter().flatten().cloned().collect();
    let acked = assert_distinct(&all);
    // Node 0's failed ones again, on its new agent: distinct from everything acknowledged.
    let retried = rt.block_on(async {
        let c = client(&nodes[0]).await;
        let mut out = Vec::new();
        for h in &failed {
            out.push(((*h).clone(), allocate(c.clone(), (*h).clone()).await));
        }
        out
    });
    let mut everything = all.clone();
    everything.extend(retried.iter().cloned());
    assert_eq!(assert_distinct(&everything), acked + failed.len());
    // No duplicate ever; records a failed write left behind are rebuilt by housekeeping.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let check = ipam_json(&nodes[1], "check");
        assert!(findings_of(&check, "duplicate").is_empty(), "{check}");
        let orphans = ["orphan-handle", "orphan-allocation", "orphan-block"]
            .iter()
            .map(|k| findings_of(&check, k).len())
            .sum::<usize>();
        if orphans == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "orphans stay: {check}");
        std::thread::sleep(Duration::from_millis(500));
    }
    // Every acknowledged allocation is still held: released, the store is clean (leak GC takes
    // what node 0 committed but never acknowledged).
    let held: BTreeMap<String, IpAddr> = everything
        .iter()
        .filter_map(|(h, r)| r.as_ref().ok().map(|a| (h.clone(), *a)))
        .collect();
    rt.block_on(async {
        for (i, n) in nodes.iter().enumerate() {
            let mut c = client(n).await;
            for (h, a) in held
                .iter()
                .filter(|(h, _)| h.starts_with(&format!("net.n{i}-")))
            {
                let got = c
                    .lookup(pb::LookupRequest {
                        handle: h.clone(),
                        ifname: "eth0".into(),
                    })
                    .await
                    .expect("lookup")
                    .into_inner();
                assert_eq!(got.addresses[0].address, format!("{a}/32"), "{h}");
                release(c.clone(), h.clone()).await;
            }
        }
    });
    // Node 0's agent again, with a fast leak GC: it releases what the killed agent committed
    // but never acknowledged.
    let config = nodes[0]
        .agent()
        .spec
        .config
        .clone()
        .expect("config")
        .replace(HOUSEKEEPING, FAST_GC);
    nodes[0].agent_mut().spec.config = Some(config);
    nodes[0].stop_agent();
    nodes[0].start_agent();
    wait_clean(&nodes[1]);
    nodes.iter().for_each(assert_admitted);
}

/// The pools as node's agent uses them now: (cidr, disabled).
fn pools_of(node: &Node) -> Vec<(String, bool)> {
    ipam_json(node, "show")["pools"]
        .as_array()
        .expect("pools")
        .iter()
        .map(|p| {
            (
                p["cidr"].as_str().unwrap_or_default().to_string(),
                p["disabled"].as_bool().unwrap_or(false),
            )
        })
        .collect()
}

fn wait_pools(node: &Node, want: &[(&str, bool)]) {
    let want: Vec<(String, bool)> = want.iter().map(|(c, d)| (c.to_string(), *d)).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while pools_of(node) != want {
        assert!(
            Instant::now() < deadline,
            "pools {:?}, want {want:?}\n{}",
            pools_of(node),
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn ippool_changes_apply_without_a_restart_and_never_under_live_addresses() {
    let api = KubeApi::in_namespace();
    // The agent starts with no IPPool at all: nothing to allocate from, until one appears.
    let node = kube_node(&api, "[ipam]\nleakCheckIntervalSecs = 1\n");
    let rt = rt();
    let alloc = |h: &str| rt.block_on(async { allocate(client(&node).await, h.into()).await });
    let e = alloc("net.h-0").expect_err("no pools yet");
    assert!(e.message().contains("pool"), "{e:?}");
    api.apply(ippool("a", "10.64.0.0/24", 28, false))
        .unwrap_or_else(|e| panic!("{e}"));
    wait_pools(&node, &[("10.64.0.0/24", false)]);
    let a = alloc("net.h-1").expect("alloc");
    assert!(a.to_string().starts_with("10.64.0."), "{a}");
    // Disable a, add b: new addresses come from b; a's stays valid.
    api.apply(ippool("a", "10.64.0.0/24", 28, true))
        .unwrap_or_else(|e| panic!("{e}"));
    api.apply(ippool("b", "10.65.0.0/24", 28, false))
        .unwrap_or_else(|e| panic!("{e}"));
    wait_pools(&node, &[("10.64.0.0/24", true), ("10.65.0.0/24", false)]);
    let b = alloc("net.h-2").expect("alloc");
    assert!(b.to_string().starts_with("10.65.0."), "{b}");
    // Removing a (or shrinking it) while net.h-1 holds 10.64.0.x: refused, a stays.
    api.delete("calix.dev/v1", "IPPool", "a")
        .unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node.agent_log().contains("pool change rejected") {
        assert!(Instant::now() < deadline, "{}", node.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        node.agent_log().contains("10.64.0.0/24"),
        "{}",
        node.agent_log()
    );
    assert_eq!(
        pools_of(&node),
        [
            ("10.64.0.0/24".to_string(), true),
            ("10.65.0.0/24".to_string(), false)
        ]
    );
    // A pool that cannot be served (overlapping b): refused alone, named in the log; the rest
    // of the change (a's removal) is still refused while a holds an address.
    api.apply(ippool("c", "10.65.0.128/25", 28, false))
        .unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node.agent_log().contains("overlap") {
        assert!(Instant::now() < deadline, "{}", node.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    let refused = node.agent_log().matches("pool change rejected").count();
    api.delete("calix.dev/v1", "IPPool", "c")
        .unwrap_or_else(|e| panic!("{e}"));
    // The agent sees c go (and refuses a's removal once more) before a's address is released:
    // released first, that pass would apply the removal itself and nothing would be deferred.
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.agent_log().matches("pool change rejected").count() == refused {
        assert!(Instant::now() < deadline, "{}", node.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    // Once a's last address is released the deferred removal applies, with no restart: at
    // the next retry, or at the next pass a cluster change brings, whichever comes first.
    let reloads = |node: &Node| {
        node.agent_log()
            .matches("dataplane settings reloaded")
            .count()
    };
    let before = reloads(&node);
    rt.block_on(async { release(client(&node).await, "net.h-1".into()).await });
    wait_pools(&node, &[("10.65.0.0/24", false)]);
    // (Logged once the dataplane has them too, right after.)
    let deadline = Instant::now() + Duration::from_secs(15);
    while reloads(&node) == before {
        assert!(Instant::now() < deadline, "{}", node.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_admitted(&node);
}
