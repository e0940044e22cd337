//! Pod ADDs on the calix node while Services churn (issue 24: churn of thousands of Services a
//! minute must not delay pod ADDs): after the last stage, the kube-proxies stopped (they would
//! take the machine's CPU at each write), rounds of CNI ADDs timed with the
//! API quiet and with the fillers' EndpointSlices rewritten at [`PER_MINUTE`] (each write
//! changes a slice's endpoints, so every agent has a real change to follow and the calix one
//! a frontend to reprogram), the two interleaved. Each ADD is the plugin's whole call for a
//! Pod the API already has (the agent's IPAM on the kubernetes datastore, the veth, the
//! programs, the policy wait), its DEL untimed.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::{KubeApi, Node, Pod};
use serde_json::{json, Value};

use super::objects;

/// The churn's writes a minute.
pub const PER_MINUTE: u32 = 3_000;

/// What the rounds measured.
#[derive(Default)]
pub(in crate::bench) struct Churn {
    /// Each ADD with the API quiet, and while Services churn (ms).
    pub idle_ms: Vec<f64>,
    pub churn_ms: Vec<f64>,
    /// The churn's writes a minute, as made.
    pub per_minute: f64,
}

/// `rounds` rounds of `adds` ADDs each way on `node` (pods in `ns`), the churn over the
/// first `fillers` fillers' slices.
pub(super) fn measure(
    api: &KubeApi,
    ns: &str,
    node: &Node,
    fillers: usize,
    rounds: usize,
    adds: usize,
) -> Result<Churn> {
    let mut out = Churn::default();
    let (mut writes, mut churning) = (0usize, Duration::ZERO);
    let mut k = 0;
    for round in 0..rounds {
        for churn in [false, true] {
            super::super::harness::check_interrupted()?;
            let stop = Arc::new(AtomicBool::new(false));
            let started = Instant::now();
            let (times, written) = std::thread::scope(|s| -> Result<(Vec<f64>, usize)> {
                let writer = churn.then(|| {
                    let stop = stop.clone();
                    let ns = ns.to_string();
                    // Where the last round's writes stopped: each write changes its slice.
                    let base = writes;
                    s.spawn(move || {
                        let every = Duration::from_secs(60) / PER_MINUTE;
                        api.apply_paced(move |i| rewritten(&ns, fillers, base + i), every, stop)
                    })
                });
                let mut times = Vec::new();
                let mut failed = None;
                for _ in 0..adds {
                    match add(api, ns, node, k) {
                        Ok(ms) => times.push(ms),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                    k += 1;
                }
                stop.store(true, Ordering::Relaxed);
                let written = match writer {
                    Some(w) => match w.join() {
                        Ok(r) => r.context("the churn's writes")?,
                        Err(_) => bail!("the churn's writer panicked"),
                    },
                    None => 0,
                };
                match failed {
                    Some(e) => Err(e),
                    None => Ok((times, written)),
                }
            })?;
            let p50 = crate::bench::report::median(&times);
            if churn {
                writes += written;
                churning += started.elapsed();
                out.churn_ms.extend(times);
            } else {
                out.idle_ms.extend(times);
            }
            println!(
                "[churn] round {}/{rounds}, {}: {adds} ADDs, p50 {p50:.1} ms{}",
                round + 1,
                if churn { "Services churning" } else { "quiet" },
                if churn {
                    format!(", {written} slices rewritten")
                } else {
                    String::new()
                }
            );
        }
    }
    out.per_minute = writes as f64 * 60.0 / churning.as_secs_f64().max(1e-9);
    Ok(out)
}

/// Filler `i % fillers`'s slice with one endpoint or both, by turns: a change each time.
fn rewritten(ns: &str, fillers: usize, i: usize) -> Value {
    let f = i % fillers.max(1);
    let both = objects::filler_endpoints(f);
    let endpoints: &[_] = match (i / fillers.max(1)) % 2 {
        0 => &both[..1],
        _ => &both,
    };
    objects::slice(ns, &format!("f{f}"), endpoints, 80)
}

/// One Pod made in the API, then its CNI ADD timed (ms); its DEL and the Pod's deletion
/// after, untimed.
fn add(api: &KubeApi, ns: &str, node: &Node, k: usize) -> Result<f64> {
    let name = format!("churn-{k}");
    let made = api.apply(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeName": node.ns.name, "containers": [{"name": "c", "image": "pause"}]},
    }))?;
    let uid = made["metadata"]["uid"]
        .as_str()
        .context("no UID in the API server's answer")?
        .to_string();
    let started = Instant::now();
    let pod = Pod::try_add_k8s(node, ns, &name, &uid, Value::Null);
    let ms = started.elapsed().as_secs_f64() * 1e3;
    if !pod.result.success {
        bail!(
            "CNI ADD of {ns}/{name}: {}\n{}",
            pod.result.stdout.trim(),
            pod.result.stderr.trim()
        );
    }
    drop(pod);
    api.delete_now("v1", "Pod", ns, &name)?;
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_write_changes_a_slice() {
        let a = rewritten("ns", 3, 1);
        let b = rewritten("ns", 3, 4);
        assert_eq!(
            a["metadata"]["name"], b["metadata"]["name"],
            "f1 both times"
        );
        assert_ne!(a["endpoints"], b["endpoints"], "one endpoint, then two");
        assert_eq!(rewritten("ns", 3, 2)["metadata"]["name"], "f2-1");
    }
}
