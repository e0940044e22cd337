//! `cargo xtask bench policy`: what NetworkPolicy costs in calix's eBPF dataplane, on calix
//! nodes in Kubernetes mode (a real kube-apiserver, release agents with their ClusterRole,
//! pods wired by the real CNI plugin with their Pod objects), in one run (DESIGN.md §10):
//!
//! - **per packet** ([`perf`]): two pods on one node with no policy, and with 10, 100 and
//!   1,000 rules in each direction on both (isolated both ways; one rule lets the pair in, the
//!   rest name other peers and ports): the programs' run time per packet (BPF statistics) and
//!   same-node conn/s, TCP_RR and throughput, interleaved, as ratios to no policy;
//! - **programming latency** ([`latency`]): three nodes, a probe pair on each; a NetworkPolicy
//!   written or deleted, and a client's label changed, until every probe sees the new verdict
//!   (p50, p99 over `--changes`);
//! - **scale** ([`scale`]): one agent facing 10,000 pods and 1,000 policies cluster-wide, 100
//!   of the pods its own: the time from its start until everything is programmed, the RSS the
//!   objects add, and what one label change costs it.
//!
//! - **eBPF against kernel mode** ([`versus`]): the 1,000-rule pair on an eBPF node and on a
//!   kernel-mode node (nftables), interleaved: conn/s and TCP_RR;
//! - **per packet kind** ([`packets`]): a same-node connection's packets one by one through
//!   `from_pod` (BPF_PROG_TEST_RUN), with no policy and with policy at three flow-table sizes:
//!   where its time goes.
//!
//! Everything is named `cxb-<pid>-…` and removed on drop. Writes docs/bench/policy.md and .svg
//! (with `--quick`, target/bench/).
mod latency;
mod packets;
mod perf;
mod report;
mod scale;
mod versus;

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use calix_testbed::{Dataplane, KubeApi, Netns, Node};

use super::harness::Bench;

/// The nodes' pools, Node addresses (in their objects only) and tags.
const NODES: [(&str, &str, &str); 3] = [
    ("10.231.0.0/24", "192.0.2.231", "n0"),
    ("10.231.1.0/24", "192.0.2.232", "n1"),
    ("10.231.2.0/24", "192.0.2.233", "n2"),
];

/// What a run does: its repetitions and seconds (per packet), policy and label changes
/// (latency), and whether it is a development run.
pub struct Args {
    pub reps: usize,
    pub secs: u64,
    pub changes: usize,
    pub scale_pods: usize,
    pub quick: bool,
}

pub fn run(args: Args) -> Result<()> {
    let b = Bench::setup("the policy benchmark", &["iperf3", "nstat", "sysctl"], &[])?;
    // Before any node: it needs only the programs, and a CPU of its own.
    let packets = packets::run(args.reps.min(5), if args.quick { 2_000 } else { 20_000 })?;
    let name = b.name("api");
    println!("[setup] kube-apiserver v1.36.2 on etcd, in {name}");
    let api = KubeApi::launch(Some(Netns::create(name.clone())?), name, true)?;
    let nodes = NODES
        .iter()
        .map(|&(cidr, ip, tag)| node(&b, &api, tag, cidr, ip))
        .collect::<Result<Vec<_>>>()?;
    let tools = b.tools();

    let per_packet = perf::run(&b, &api, &tools, &nodes[0], args.reps, args.secs)?;
    let kernel = node_of(
        &b,
        &api,
        Dataplane::Kernel,
        ("10.231.3.0/24", "192.0.2.234", "k0"),
    )?;
    let versus = versus::run(&b, &api, &tools, [&nodes[0], &kernel], args.reps, args.secs)?;
    kernel.agent().stop();
    drop(kernel);
    let latency = latency::run(&b, &api, &nodes, args.changes)?;
    // The three agents would share the CPUs with the one measured at scale.
    for n in &nodes {
        n.agent().stop();
    }
    let scale = scale::run(&b, &api, args.scale_pods)?;
    drop(nodes);
    drop(api);
    b.done();
    let report = report::Report {
        reps: args.reps,
        secs: args.secs,
        quick: args.quick,
        per_packet,
        versus,
        latency,
        scale,
        packets,
        bench: b,
    };
    Bench::publish("policy", &report.markdown(), args.quick, |p| {
        report.chart(p)
    })
}

/// Node `tag` (eBPF, release agent) of `api` with a pool `cidr` of its own, started.
fn node(b: &Bench, api: &KubeApi, tag: &str, cidr: &str, ip: &str) -> Result<Node> {
    node_of(b, api, Dataplane::Ebpf, (cidr, ip, tag))
}

/// As [`node`], in `dataplane`.
fn node_of(
    b: &Bench,
    api: &KubeApi,
    dataplane: Dataplane,
    (cidr, ip, tag): (&str, &str, &str),
) -> Result<Node> {
    let name = b.name(tag);
    let n = Node::new(name.clone(), b.spec(dataplane))?;
    let n = api.kubernetes_node(n, None, "")?;
    let n = api
        .started_with_pool(n, &name, cidr, ip)
        .with_context(|| format!("starting node {name}"))?;
    let mode = match dataplane {
        Dataplane::Ebpf => "eBPF",
        _ => "kernel mode (nftables)",
    };
    println!("[setup] node {name}: calix {mode}, Kubernetes mode, pool {cidr}");
    Ok(n)
}

/// The agent's `/metrics`, by series (name and labels as written).
pub(super) fn metrics(node: &Node) -> Option<BTreeMap<String, f64>> {
    let (code, body) = node.http_get("/metrics")?;
    (code == 200).then(|| parse_metrics(&body))
}

/// Prometheus text as series → value (comments and unreadable lines left out).
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_read_by_series() {
        let m = parse_metrics(
            "# HELP x y\ncalix_policy_ready 1\ncalix_policy_seconds_total{step=\"apply\"} 0.25\nbad\n",
        );
        assert_eq!(m.get("calix_policy_ready"), Some(&1.0));
        assert_eq!(
            m.get("calix_policy_seconds_total{step=\"apply\"}"),
            Some(&0.25)
        );
        assert_eq!(m.len(), 2);
    }
}
