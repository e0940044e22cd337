//! The agent's CPU and memory with 4 BGP peers, against the same agent with BGP off, in the
//! same cluster at the same time.
//!
//! Per repetition a fresh two-node cluster (real etcd, release agents, eBPF dataplane), both
//! nodes on subnet 1 with a pod each: one agent with `[bgp]` and 4 peers — 4 sessions with
//! BIRD in the underlay, each announcing the same [`LEARNED`] blocks of other racks (BIRD
//! takes one protocol per neighbor address and port: each session has a port of its own,
//! [`port`]) — and one agent without BGP; which node speaks BGP
//! alternates. Once every session is up, the router holds the node's block from each and the
//! node's kernel holds the [`LEARNED`] routes, both agents idle for `secs` seconds: CPU over
//! that window (every thread's run time, ns, from /proc/<pid>/task/*/schedstat: an idle
//! agent uses less than a clock tick in seconds), resident memory at its end; and the CPU
//! each had used from its start until the BGP node had converged (utime + stime, ticks).
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::traffic::cpu::{load_average, ProcessUsage};
use calix_testbed::{Cluster, Dataplane, Netns, Plugin};
use serde_json::json;

use super::super::harness::{check_interrupted, Bench};
use super::bird::Bird;

/// BGP sessions of the speaking agent.
pub const PEERS: usize = 4;
/// Blocks each router announces (the same ones: other racks' pods).
pub const LEARNED: usize = 500;
const ROUTER_AS: u32 = 65000;
const NODE_AS: u32 = 64601;
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 26\n";
/// Pause between convergence and the window (the agents' start-up work done).
const SETTLE: Duration = Duration::from_secs(3);

/// One agent over every repetition: CPU (ms per second of the window), RSS and its
/// anonymous part at the window's end (MiB), CPU from its start to convergence (ms).
#[derive(Default)]
pub struct Usage {
    pub cpu_ms_per_s: Vec<f64>,
    pub start_cpu_ms: Vec<f64>,
    pub rss_mib: Vec<f64>,
    pub anon_mib: Vec<f64>,
}

#[derive(Default)]
pub struct Results {
    /// With BGP (4 peers), without.
    pub bgp: Usage,
    pub off: Usage,
    /// Seconds from the agents' start until the BGP node had converged.
    pub converge_s: Vec<f64>,
    pub load: Vec<f64>,
}

/// The router's address on subnet 1.
const ROUTER: &str = "172.31.1.254";

/// Session `k`'s port at the router.
fn port(k: usize) -> usize {
    1790 + k
}

fn agent_config(c: &Cluster, i: usize, bgp: bool) -> String {
    let mut s = format!("{}{POOLS}", c.base_config(i));
    if bgp {
        s.push_str(&format!("[bgp]\nenabled = true\nas_number = {NODE_AS}\n"));
        for k in 0..PEERS {
            s.push_str(&format!(
                "[[bgp.peers]]\nname = \"tor{k}\"\naddress = \"{ROUTER}\"\nport = {}\n\
                 as_number = {ROUTER_AS}\n",
                port(k)
            ));
        }
    }
    s
}

/// The router: one BIRD, a passive session per port, each announcing the same [`LEARNED`]
/// blocks (10.244.128.0/26 on: never this cluster's own).
pub(super) fn bird_conf(node: &str) -> String {
    let mut c = String::from(
        "router id 172.31.1.254;\nprotocol device {}\nprotocol static racks { ipv4;\n",
    );
    for k in 0..LEARNED as u32 {
        let a = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 244, 128, 0)) + k * 64);
        c.push_str(&format!("  route {a}/26 blackhole;\n"));
    }
    c.push_str("}\n");
    for k in 0..PEERS {
        c.push_str(&format!(
            "protocol bgp tor{k} {{ local {ROUTER} port {p} as {ROUTER_AS}; neighbor {node} port \
             {p} as {NODE_AS}; passive on; ipv4 {{ import all; export where proto = \"racks\"; \
             }}; }}\n",
            p = port(k)
        ));
    }
    c
}

/// calix's routes in `ns`'s main table.
fn kernel_routes(ns: &Netns) -> Result<usize> {
    let out = crate::util::output(
        std::process::Command::new("ip").args(["-n", &ns.name, "route", "show", "proto", "202"]),
    )?;
    Ok(out.lines().filter(|l| !l.trim().is_empty()).count())
}

fn usage(pid: Option<u32>) -> Result<ProcessUsage> {
    pid.and_then(ProcessUsage::read)
        .context("an agent is not running")
}

/// The run time of every thread of `pid` so far (ns, the first field of each
/// /proc/<pid>/task/<tid>/schedstat).
fn threads_cpu_ns(pid: Option<u32>) -> Result<f64> {
    let pid = pid.context("an agent is not running")?;
    let mut total = 0.0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
        let stat = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
        total += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
    }
    Ok(total)
}

/// Repetition `r`: its cluster, convergence and idle window; the progress line.
fn repetition(b: &Bench, r: usize, secs: u64, res: &mut Results) -> Result<String> {
    let speaker = r % 2;
    let mut cluster = Cluster::launch_with(
        || b.name(&format!("i{r}-u")),
        |i| b.name(&format!("i{r}-n{i}")),
        b.spec(Dataplane::Ebpf),
        &[1, 1],
        |_, _| String::new(),
    )?;
    cluster.configure(|i, c| Ok(agent_config(c, i, i == speaker)))?;
    let mut bird = Bird::start(
        cluster.underlay(),
        &b.dir,
        &format!("idle{r}"),
        &bird_conf(&cluster.address(speaker)),
    )?;
    let t0 = Instant::now();
    cluster.try_start()?;
    let mut pods = Vec::new();
    for (i, n) in cluster.nodes.iter().enumerate() {
        let conf = n.conf(json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } }));
        let plugin = Plugin::new("calix", b.bins.join("calix"), Some(&n.ns), &conf);
        let ns = b.netns(&format!("i{r}-pod{i}"))?;
        plugin.add_pod(&ns, &format!("idle{i}"))?;
        pods.push(ns);
    }
    let protos: Vec<String> = (0..PEERS).map(|k| format!("tor{k}")).collect();
    let protos: Vec<&str> = protos.iter().map(String::as_str).collect();
    bird.ctl.until_up(&protos, 1, Duration::from_secs(60))?;
    let node = &cluster.nodes[speaker];
    let deadline = Instant::now() + Duration::from_secs(30);
    while kernel_routes(&node.ns)? < LEARNED {
        if Instant::now() > deadline {
            bail!(
                "node {speaker} installed {} of the {LEARNED} learned routes in 30 s",
                kernel_routes(&node.ns)?
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let converged = t0.elapsed().as_secs_f64();
    let pids = [
        cluster.nodes[speaker].agent_pid(),
        cluster.nodes[1 - speaker].agent_pid(),
    ];
    let at_convergence = [usage(pids[0])?, usage(pids[1])?];
    std::thread::sleep(SETTLE);
    let load = load_average();
    let before = [threads_cpu_ns(pids[0])?, threads_cpu_ns(pids[1])?];
    let start = Instant::now();
    for _ in 0..secs {
        check_interrupted()?;
        std::thread::sleep(Duration::from_secs(1));
    }
    let cpu_after = [threads_cpu_ns(pids[0])?, threads_cpu_ns(pids[1])?];
    let window = start.elapsed().as_secs_f64();
    let after = [usage(pids[0])?, usage(pids[1])?];
    bird.ctl.until_up(&protos, 1, Duration::from_secs(1))?;
    let mut line = format!("(load {load:.2}): converged in {converged:.1} s;");
    for (k, u) in [&mut res.bgp, &mut res.off].into_iter().enumerate() {
        let cpu = (cpu_after[k] - before[k]) / 1e6 / window;
        let start_cpu = at_convergence[k].cpu_secs * 1e3;
        let (rss, anon) = (
            after[k].rss_kib as f64 / 1024.0,
            after[k].rss_anon_kib as f64 / 1024.0,
        );
        u.cpu_ms_per_s.push(cpu);
        u.start_cpu_ms.push(start_cpu);
        u.rss_mib.push(rss);
        u.anon_mib.push(anon);
        line.push_str(&format!(
            " {}: {cpu:.3} ms/s idle, {start_cpu:.0} ms to converge, RSS {rss:.1} MiB \
             ({anon:.1} anonymous);",
            if k == 0 { "BGP" } else { "no BGP" }
        ));
    }
    res.converge_s.push(converged);
    res.load.push(load);
    drop(pods);
    Ok(line)
}

/// Runs the part: `reps` clusters, each idle for `secs` seconds.
pub fn run(b: &Bench, reps: usize, secs: u64) -> Result<Results> {
    let mut res = Results::default();
    for r in 0..reps {
        check_interrupted()?;
        println!(
            "[setup] agent with {PEERS} BGP peers and without, repetition {}/{reps}: a \
             two-node cluster, BIRD in the underlay, then {secs} s idle",
            r + 1
        );
        let line =
            repetition(b, r, secs, &mut res).with_context(|| format!("repetition {}", r + 1))?;
        println!("[rep {}/{reps}] {line}", r + 1);
    }
    Ok(res)
}
