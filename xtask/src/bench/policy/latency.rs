//! Programming latency: on each of the three nodes a client and a server pod; a policy that
//! isolates the servers (no rule) is always in force. Changes, alternating:
//! - **policy**: NetworkPolicy `allow` (clients labelled `access: yes` may reach the servers)
//!   written, then deleted;
//! - **label**: with `allow` in force, every client's `access` label set to `no`, then back.
//!
//! Before each change a probe starts in every client pod: TCP connection attempts to its
//! server, one after another, each given [`ATTEMPT`]; an attempt answered (accepted or reset:
//! the packets passed) means open, one that times out means closed. A change's latency, per
//! node, is from just before its write to the API server to the start of the first attempt
//! that saw the new verdict; the change's is the slowest node's. Precision: one attempt (an
//! opening is seen up to [`ATTEMPT`] late).
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use calix_testbed::{KubeApi, Netns, Node, Pod};
use serde_json::json;

use crate::bench::harness::{check_interrupted, Bench};

/// One connection attempt's patience.
pub(super) const ATTEMPT: Duration = Duration::from_millis(10);
/// How long a change may take before the run fails.
const PATIENCE: Duration = Duration::from_secs(15);
/// Any port: nothing listens, a reset is an answer too.
const PROBE_PORT: u16 = 7100;

/// Every change's latency (ms), by kind.
#[derive(Default)]
pub(super) struct Latency {
    pub(super) policy_ms: Vec<f64>,
    pub(super) label_ms: Vec<f64>,
}

pub(super) fn run(b: &Bench, api: &KubeApi, nodes: &[Node], changes: usize) -> Result<Latency> {
    let namespace = b.name("lat");
    api.namespace(&namespace, json!({}), json!({}))?;
    let mut pairs: Vec<(Pod, Pod)> = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let client = api.running_pod(
            node,
            &namespace,
            &format!("client-{i}"),
            json!({"lat": "client", "access": "yes"}),
        )?;
        let server = api.running_pod(
            node,
            &namespace,
            &format!("server-{i}"),
            json!({"lat": "server"}),
        )?;
        pairs.push((client, server));
    }
    let probes: Vec<(Netns, SocketAddr)> = pairs
        .iter()
        .map(|(c, s)| {
            let ip: std::net::IpAddr = s.ip().parse().context("the server's address")?;
            Ok((Netns::borrowed(&c.ns.name), SocketAddr::new(ip, PROBE_PORT)))
        })
        .collect::<Result<_>>()?;
    let policy = |name: &str, ingress: serde_json::Value| {
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"podSelector": {"matchLabels": {"lat": "server"}},
                     "policyTypes": ["Ingress"], "ingress": ingress}
        })
    };
    let allow = policy(
        "allow",
        json!([{"from": [{"podSelector": {"matchLabels": {"access": "yes"}}}]}]),
    );
    api.apply(policy("isolate", json!([])))?;
    api.apply(allow.clone())?;
    // Settled: open everywhere.
    change(&probes, true, || Ok(vec![Instant::now(); probes.len()]))
        .context("the probes never got through with `allow` in force")?;
    println!(
        "[latency] {} changes of each kind, 3 nodes, probes every {} ms",
        changes,
        ATTEMPT.as_millis()
    );
    let mut out = Latency::default();
    let label = |access: &str| -> Result<Vec<Instant>> {
        (0..pairs.len())
            .map(|i| {
                let t = Instant::now();
                let meta = json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": format!("client-{i}"), "namespace": namespace}});
                api.merge_patch(meta, json!({"metadata": {"labels": {"access": access}}}))?;
                Ok(t)
            })
            .collect()
    };
    // Rounds of four changes: the policy deleted (closes) and written again (opens), then,
    // with it in force, the clients' label taken (closes) and given back (opens).
    let rounds = changes.div_ceil(2);
    for k in 0..rounds {
        check_interrupted()?;
        let why = |what: &str| format!("round {}: {what}{}", k + 1, diagnose(nodes, &namespace));
        let policy_write = |open: bool| -> Result<Vec<Instant>> {
            let t = Instant::now();
            match open {
                true => api.apply(allow.clone()).map(drop)?,
                false => {
                    api.delete_in("networking.k8s.io/v1", "NetworkPolicy", &namespace, "allow")?
                }
            }
            Ok(vec![t; probes.len()])
        };
        let pc =
            change(&probes, false, || policy_write(false)).with_context(|| why("allow deleted"))?;
        let po = change(&probes, true, || policy_write(true))
            .with_context(|| why("allow written again"))?;
        let lc = change(&probes, false, || label("no")).with_context(|| why("label taken"))?;
        let lo = change(&probes, true, || label("yes")).with_context(|| why("label given back"))?;
        out.policy_ms.extend([pc, po]);
        out.label_ms.extend([lc, lo]);
        if (k + 1) % 5 == 0 || k + 1 == rounds {
            println!(
                "[latency] {}/{changes}: policy {pc:.1} / {po:.1} ms, label {lc:.1} / {lo:.1} ms (closing / opening)",
                2 * (k + 1)
            );
        }
    }
    Ok(out)
}

/// Each node's policy of its server and the end of its agent's log, to say why a change was
/// not seen.
fn diagnose(nodes: &[Node], namespace: &str) -> String {
    let mut s = String::new();
    for (i, n) in nodes.iter().enumerate() {
        let policy = n
            .agent()
            .calixctl_json(&["policy", &format!("{namespace}/server-{i}")])
            .map(|v| v.to_string())
            .unwrap_or_else(|e| e.to_string());
        let log = n.agent_log();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        s.push_str(&format!(
            "\n--- node {i}: calixctl policy {namespace}/server-{i}: {policy}\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    s
}

/// Starts a probe in every client for verdict `open`, makes the change with `write` (which
/// returns when it wrote for each probe), waits for every probe, and returns the slowest
/// node's latency (ms).
fn change(
    probes: &[(Netns, SocketAddr)],
    open: bool,
    write: impl FnOnce() -> Result<Vec<Instant>>,
) -> Result<f64> {
    let handles = probes
        .iter()
        .map(|(ns, to)| {
            let to = *to;
            Ok(ns.spawn(None, move || probe(to, open))?)
        })
        .collect::<Result<Vec<_>>>()?;
    let written = write();
    let seen: Vec<Option<Instant>> = handles
        .into_iter()
        .map(|h| h.join().unwrap_or(None))
        .collect();
    let written = written?;
    let mut worst = 0.0_f64;
    for (i, (s, w)) in seen.iter().zip(&written).enumerate() {
        let s = s.with_context(|| {
            format!(
                "node {i}: not {} after {} s",
                if open { "open" } else { "closed" },
                PATIENCE.as_secs()
            )
        })?;
        worst = worst.max(s.saturating_duration_since(*w).as_secs_f64() * 1e3);
    }
    Ok(worst)
}

/// Connection attempts to `to` until one sees verdict `open`: the start of that attempt
/// (`None` after [`PATIENCE`]).
fn probe(to: SocketAddr, open: bool) -> Option<Instant> {
    let end = Instant::now() + PATIENCE;
    loop {
        let t = Instant::now();
        if t > end {
            return None;
        }
        let answered = match TcpStream::connect_timeout(&to, ATTEMPT) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
        };
        if answered == open {
            return Some(t);
        }
        if answered {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
