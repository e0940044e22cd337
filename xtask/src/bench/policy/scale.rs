//! Scale: one agent (a node of its own, the others stopped) facing `pods` pods and a tenth as
//! many NetworkPolicies cluster-wide, 100 of the pods its own (wired by the CNI plugin).
//!
//! - The cluster: 10 namespaces of local pods and 100 of other nodes' (labelled `team`), pods
//!   labelled `app` (20 values) and `tier` (5); each policy selects an `app` in its namespace,
//!   lets in another `app` on one port, a `tier` of the namespaces of a `team`, and an ipBlock
//!   with an `except`, and lets out to a `tier` on UDP 53.
//! - **RSS added**: the agent's resident memory with the local pods only, then with everything
//!   (each of an agent freshly started on what it holds).
//! - **Start**: the agent killed and started again, timed from its start until it has every
//!   object and has programmed its pods' tables (its `/metrics`, polled every 50 ms).
//! - **One change**: a label of a local pod, and of another node's pod, changed: what the
//!   agent spent on it (its `calix_policy_seconds_total`, every step).
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use calix_testbed::{Dataplane, KubeApi, Node, Pod};
use serde_json::{json, Value};

use super::metrics;
use crate::bench::harness::{check_interrupted, Bench};

/// This node's pods, over [`LOCAL_NAMESPACES`] namespaces.
const LOCAL: usize = 100;
const LOCAL_NAMESPACES: usize = 10;
const REMOTE_NAMESPACES: usize = 100;
/// Label changes of each kind (a local pod's, another node's pod's).
const CHANGES: usize = 10;
const POOL: &str = "10.231.4.0/24";

pub(super) struct Scale {
    pub(super) pods: usize,
    pub(super) policies: usize,
    pub(super) rss_before_mib: f64,
    pub(super) rss_after_mib: f64,
    /// From the agent's start: every listing in (ready), and everything programmed (s).
    pub(super) ready_s: f64,
    pub(super) programmed_s: f64,
    /// What the agent spent in each step over that start (s): apply, compile, program.
    pub(super) steps_s: [f64; 3],
    /// What the dataplane holds for the 100 pods.
    pub(super) dataplane: String,
    /// What one label change cost the agent (ms), by kind: a local pod's, another node's pod's.
    pub(super) local_change_ms: Vec<f64>,
    pub(super) remote_change_ms: Vec<f64>,
}

const SECONDS: [&str; 3] = [
    "calix_policy_seconds_total{step=\"apply\"}",
    "calix_policy_seconds_total{step=\"compile\"}",
    "calix_policy_seconds_total{step=\"program\"}",
];

pub(super) fn run(b: &Bench, api: &KubeApi, pods: usize) -> Result<Scale> {
    let policies = pods / 10;
    let name = b.name("sc");
    let node = Node::new(name.clone(), b.spec(Dataplane::Ebpf))?;
    let node = api.kubernetes_node(node, None, "")?;
    let node = api.started_with_pool(node, &name, POOL, "192.0.2.234")?;
    let team = |k: usize| format!("t{}", k % 10);
    let mut local: Vec<Pod> = Vec::with_capacity(LOCAL);
    for k in 0..LOCAL_NAMESPACES {
        let ns = b.name(&format!("s{k}"));
        api.namespace(&ns, json!({"team": team(k)}), json!({}))?;
    }
    println!("[scale] {LOCAL} pods of this node (CNI ADD through the agent)");
    for j in 0..LOCAL {
        check_interrupted()?;
        let ns = b.name(&format!("s{}", j % LOCAL_NAMESPACES));
        let labels = json!({"app": format!("a{}", j % 20), "tier": format!("t{}", j % 5)});
        local.push(api.running_pod(&node, &ns, &format!("p{j}"), labels)?);
    }
    settle(&node, LOCAL, 0)?;
    // Both RSS figures are of an agent freshly started on what it holds: one that has
    // served the CNI ADDs keeps their peak in its allocator's free memory (13 MiB in a run),
    // which hid what everything else adds.
    node.agent().kill();
    node.agent().spawn(&[])?;
    let settled = settle(&node, LOCAL, 0)?;
    let rss_before_mib = rss_mib(&node)?;
    println!(
        "[scale] {rss_before_mib:.1} MiB with {} pods, no policy",
        settled["calix_policy_objects{kind=\"pod\"}"]
    );

    let remote = pods.saturating_sub(LOCAL);
    println!(
        "[scale] {remote} pods of other nodes and {policies} NetworkPolicies into the API server"
    );
    let started = Instant::now();
    let mut objects: Vec<(Value, Value)> = Vec::new();
    for k in 0..REMOTE_NAMESPACES {
        let ns = b.name(&format!("x{k}"));
        objects.push((
            json!({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": ns, "labels": {"team": team(k)}}}),
            Value::Null,
        ));
        objects.push((
            json!({"apiVersion": "v1", "kind": "ServiceAccount",
                   "metadata": {"name": "default", "namespace": ns}}),
            Value::Null,
        ));
    }
    api.apply_many(objects, 16)?;
    let mut objects: Vec<(Value, Value)> = Vec::new();
    for j in 0..remote {
        let ns = b.name(&format!("x{}", j % REMOTE_NAMESPACES));
        let ip = format!("10.240.{}.{}", j / 250, 1 + j % 250);
        objects.push((
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("q{j}"), "namespace": ns,
                    "labels": {"app": format!("a{}", j % 20), "tier": format!("t{}", j % 5)}},
                "spec": {"nodeName": b.name(&format!("far{}", j % 50)),
                         "containers": [{"name": "c", "image": "pause"}]}}),
            json!({"podIP": ip, "podIPs": [{"ip": ip}]}),
        ));
    }
    let namespaces: Vec<String> = (0..LOCAL_NAMESPACES)
        .map(|k| b.name(&format!("s{k}")))
        .chain((0..REMOTE_NAMESPACES).map(|k| b.name(&format!("x{k}"))))
        .collect();
    for i in 0..policies {
        objects.push((
            scale_policy(i, &namespaces[i % namespaces.len()]),
            Value::Null,
        ));
    }
    api.apply_many(objects, 16)?;
    println!(
        "[scale] written in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    settle(&node, pods, policies)?;

    // The start, timed.
    node.agent().kill();
    let t0 = Instant::now();
    node.agent().spawn(&[])?;
    let mut ready_s = None;
    let (programmed_s, after) = loop {
        check_interrupted()?;
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "the agent did not program everything within 120 s of its start:\n{}",
            node.agent_log()
        );
        let Some(m) = metrics(&node) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
        let all_in = get("calix_policy_ready") == 1.0
            && get("calix_policy_objects{kind=\"pod\"}") >= pods as f64
            && get("calix_policy_objects{kind=\"networkpolicy\"}") >= policies as f64;
        if all_in && ready_s.is_none() {
            ready_s = Some(t0.elapsed().as_secs_f64());
        }
        if all_in
            && get(SECONDS[2]) > 0.0
            && get("calix_policy_not_programmed") == 0.0
            && get("calix_policy_dataplane_entries{kind=\"entry\"}") > 0.0
        {
            break (t0.elapsed().as_secs_f64(), m);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let ready_s = ready_s.unwrap_or(programmed_s);
    let steps_s = SECONDS.map(|k| after.get(k).copied().unwrap_or(0.0));
    let dataplane = node.agent().calixctl_json(&["policy"])?["dataplane"]
        .as_str()
        .unwrap_or("?")
        .to_string();
    println!("[scale] start to everything programmed: {programmed_s:.2} s ({dataplane})");
    let m = settle(&node, pods, policies)?;
    let rss_after_mib = rss_mib(&node)?;
    println!(
        "[scale] {rss_after_mib:.1} MiB with {} pods and {} policies",
        m["calix_policy_objects{kind=\"pod\"}"], m["calix_policy_objects{kind=\"networkpolicy\"}"]
    );

    let mut local_change_ms = Vec::new();
    let mut remote_change_ms = Vec::new();
    for c in 0..CHANGES {
        for is_local in [true, false] {
            let (ns, name, j) = match is_local {
                true => (
                    b.name(&format!("s{}", c % LOCAL_NAMESPACES)),
                    format!("p{c}"),
                    c,
                ),
                false => {
                    let j = 7 * c + 3;
                    (
                        b.name(&format!("x{}", j % REMOTE_NAMESPACES)),
                        format!("q{j}"),
                        j,
                    )
                }
            };
            let meta = json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": ns}});
            // A local pod's `app`: its own policy changes. Another node's pod's `tier`: into
            // or out of the set of its namespace's team and the tier that team's policies name
            // (every one of those sets exists), so the change always moves a set's members.
            let labels = match is_local {
                true => json!({"app": format!("a{}", (j + 1 + c) % 20)}),
                false => {
                    let team = j % REMOTE_NAMESPACES % 10;
                    let tier = if j % 5 == team % 5 {
                        (team + 1) % 5
                    } else {
                        team % 5
                    };
                    json!({"tier": format!("t{tier}")})
                }
            };
            let ms = one_change(&node, || {
                Ok(api.merge_patch(meta.clone(), json!({"metadata": {"labels": labels}}))?)
            })
            .with_context(|| format!("{name}'s labels changed to {labels}"))?;
            match is_local {
                true => local_change_ms.push(ms),
                false => remote_change_ms.push(ms),
            }
        }
    }
    drop(local);
    Ok(Scale {
        pods,
        policies,
        rss_before_mib,
        rss_after_mib,
        ready_s,
        programmed_s,
        steps_s,
        dataplane,
        local_change_ms,
        remote_change_ms,
    })
}

/// Policy `i` of the scale cluster, in `namespace`.
fn scale_policy(i: usize, namespace: &str) -> Value {
    let net = 100 + i % 50;
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": format!("np{i}"), "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": {"app": format!("a{}", i % 20)}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"app": format!("a{}", (i + 7) % 20)}}}],
                 "ports": [{"protocol": "TCP", "port": 80 + i % 50}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"team": format!("t{}", i % 10)}},
                           "podSelector": {"matchLabels": {"tier": format!("t{}", i % 5)}}}]},
                {"from": [{"ipBlock": {"cidr": format!("10.{net}.0.0/16"),
                                       "except": [format!("10.{net}.{}.0/24", i % 256)]}}]},
            ],
            "egress": [
                {"to": [{"podSelector": {"matchLabels": {"tier": format!("t{}", (i + 1) % 5)}}}],
                 "ports": [{"protocol": "UDP", "port": 53}]},
            ],
        }
    })
}

/// Waits until the agent holds `pods` pods and `policies` policies, everything programmed and
/// no compilation for a second; returns its metrics then.
fn settle(node: &Node, pods: usize, policies: usize) -> Result<BTreeMap<String, f64>> {
    let deadline = Instant::now() + Duration::from_secs(180);
    let (mut last, mut same) = (-1.0, 0);
    loop {
        check_interrupted()?;
        if let Some(m) = metrics(node) {
            let get = |k: &str| m.get(k).copied().unwrap_or(-1.0);
            let compilations = get("calix_policy_compilations_total");
            same = if compilations == last { same + 1 } else { 0 };
            last = compilations;
            if get("calix_policy_objects{kind=\"pod\"}") >= pods as f64
                && get("calix_policy_objects{kind=\"networkpolicy\"}") >= policies as f64
                && get("calix_policy_not_programmed") == 0.0
                && same >= 4
            {
                return Ok(m);
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the agent did not settle on {pods} pods and {policies} policies within 180 s"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// What the agent spent (ms, every step) on the change `write` makes: from its metrics before,
/// and once it has compiled again (and programmed: the same task, right after) and settled.
fn one_change(node: &Node, write: impl FnOnce() -> Result<()>) -> Result<f64> {
    let before = metrics(node).context("the agent's metrics")?;
    let spent = |m: &BTreeMap<String, f64>| SECONDS.iter().filter_map(|k| m.get(*k)).sum::<f64>();
    let compiled = |m: &BTreeMap<String, f64>| m.get("calix_policy_compilations_total").copied();
    write()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let m = metrics(node).context("the agent's metrics")?;
        if compiled(&m) > compiled(&before) {
            // Let a second compilation of the same burst land too.
            std::thread::sleep(Duration::from_millis(300));
            let m = metrics(node).context("the agent's metrics")?;
            return Ok((spent(&m) - spent(&before)) * 1e3);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the change was not programmed in 30 s"
        );
    }
}

/// The agent's resident memory (MiB).
fn rss_mib(node: &Node) -> Result<f64> {
    let pid = node.agent().pid().context("the agent is not running")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("VmRSS of the agent")?;
    Ok(kb / 1024.0)
}
