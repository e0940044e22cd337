//! `cargo xtask bench services`: Services in calix eBPF (socket translation) against
//! kube-proxy in iptables and in nftables mode, on one API server in one run (DESIGN.md §10):
//!
//! - three nodes, eBPF, Kubernetes mode (release agents with their ClusterRole), each with a
//!   client pod and two backend pods and a probe Service whose EndpointSlice names those two
//!   backends: on one node calix translates Services (its socket programs on a cgroup of the
//!   bench's own, where the clients run), on the others it does not and kube-proxy
//!   (v1.36.2, `--proxy-mode=iptables`, `nftables`) runs in the node's namespace;
//! - stages of 10, 1,000 and 10,000 Services cluster-wide (2 endpoints each: fillers whose
//!   endpoints are addresses nobody has; the probe Services and `kubernetes` count too),
//!   written in bulk, then, once every variant has programmed them ([`programmed`]):
//!   pod → ClusterIP conn/s (TCP_CRR) and TCP_RR, the variants interleaved; the time from a
//!   change (a new Service and its EndpointSlice) until a client's connection gets through
//!   ([`latency`]); the RSS and CPU time of what programs Services (the calix agent,
//!   kube-proxy);
//! - after the last stage, pod ADDs on the calix node with the API quiet and while Services
//!   churn, interleaved ([`churn`]).
//!
//! A node answers a cluster IP nothing translated with an ICMP unreachable at once (a route
//! of the node's own, ICMP not rate-limited), so a client trying to connect learns in a
//! millisecond that a change has not taken effect yet.
//!
//! Everything is named `cxb-<pid>-…` and removed on drop. Writes docs/bench/services.md and
//! .svg (with `--quick`, target/bench/).
mod churn;
mod latency;
mod objects;
mod programmed;
mod report;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use calix_testbed::k8s::{KubeProxy, ProxyMode};
use calix_testbed::traffic::cpu::{self, CpuStat, ProcessUsage};
use calix_testbed::traffic::netperf::Mode;
use calix_testbed::traffic::{Measured, Tools, Traffic, NETPERF_PORT};
use calix_testbed::{Dataplane, Guarded, KubeApi, Netns, Node, Pod};
use plotters::style::RGBColor;
use serde_json::json;

use super::chart;
use super::harness::{repetitions, warm_up, Bench, Compared};
use super::report::Traffic as Samples;

/// What a run does.
pub struct Args {
    pub reps: usize,
    pub secs: u64,
    /// Changes timed per stage (each on every variant).
    pub changes: usize,
    /// Services cluster-wide, per stage, ascending.
    pub stages: Vec<usize>,
    pub quick: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Variant {
    Calix,
    Iptables,
    Nftables,
}

pub(super) const VARIANTS: [Variant; 3] = [Variant::Calix, Variant::Iptables, Variant::Nftables];

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Calix => ("calix eBPF", "calix", chart::PURPLE),
            Self::Iptables => ("kube-proxy iptables", "ipt", chart::ORANGE),
            Self::Nftables => ("kube-proxy nftables", "nft", chart::GREEN),
        }
    }
}

impl Variant {
    fn proxy(self) -> Option<ProxyMode> {
        match self {
            Self::Calix => None,
            Self::Iptables => Some(ProxyMode::Iptables),
            Self::Nftables => Some(ProxyMode::Nftables),
        }
    }
}

/// Pod ADDs timed each way in a round of the churn.
const CHURN_ADDS: usize = 10;

/// One variant in one stage.
#[derive(Default)]
pub(super) struct Stage {
    pub traffic: Samples,
    /// Change → a connection gets through (ms), one per change.
    pub latency_ms: Vec<f64>,
    /// From the bulk write until it had programmed every Service (s).
    pub program_secs: f64,
    /// What programs Services here (calix: the agent; kube-proxy) once it had: RSS (MiB),
    /// CPU time over the bulk (s), CPU time per change (ms).
    pub rss_mib: f64,
    pub cpu_bulk_secs: f64,
    pub cpu_per_change_ms: f64,
    /// The node's calix agent (with or without Services) then (MiB).
    pub agent_rss_mib: f64,
}

/// Every stage: its Services and each variant's results (by [`Variant`] as usize); then the
/// calix node's pod ADDs, quiet and while Services churn.
pub(super) struct Results {
    pub stages: Vec<(usize, [Stage; 3])>,
    pub churn: Option<churn::Churn>,
}

pub fn run(args: Args) -> Result<()> {
    anyhow::ensure!(
        args.stages
            .iter()
            .all(|&n| (5..=objects::max_fillers()).contains(&n))
            && args.stages.windows(2).all(|w| w[0] < w[1]),
        "stages must ascend, each from 5 to {} Services",
        objects::max_fillers()
    );
    anyhow::ensure!(
        (1..=objects::MAX_CHANGES).contains(&args.changes),
        "--changes must be from 1 to {}",
        objects::MAX_CHANGES
    );
    let b = Bench::setup("the services benchmark", &["iptables-save", "nft"], &[])?;
    let cg = BenchCgroup::new(&b.name("svc"))?;
    let name = b.name("api");
    println!("[setup] kube-apiserver v1.36.2 on etcd, in {name}");
    let api = KubeApi::launch(Some(Netns::create(name.clone())?), name, true)?;
    let ns = b.name("svc");
    api.namespace(&ns, json!({}), json!({}))?;
    let nodes = VARIANTS
        .iter()
        .enumerate()
        .map(|(i, &v)| node(&b, &api, v, i, &cg.0))
        .collect::<Result<Vec<_>>>()?;
    let tools = b.tools();
    let mut lanes = Vec::new();
    for (i, (&v, node)) in VARIANTS.iter().zip(&nodes).enumerate() {
        lanes.push(Lane::start(&b, &api, &tools, &ns, v, i, node, &cg.0)?);
    }
    for l in &lanes {
        let label = format!("{} (probe Service {})", l.v.label(), l.traffic.server_ip);
        warm_up(
            &tools,
            &label,
            &l.traffic,
            "ClusterIP",
            Duration::from_secs(60),
        )?;
    }
    let mut results = Results {
        stages: Vec::new(),
        churn: None,
    };
    let mut fillers = 0;
    for (si, &n) in args.stages.iter().enumerate() {
        let mut stage: [Stage; 3] = Default::default();
        // The probe Services and `kubernetes` count.
        let want = n - 4;
        println!(
            "[stage {n}] writing {} Services and their EndpointSlices",
            want - fillers
        );
        let before = usage(&lanes);
        let t0 = Instant::now();
        api.apply_many(objects::fillers(&ns, fillers, want), 32)?;
        fillers = want;
        let took = programmed::wait(&lanes, n - 1, t0)?;
        let after = usage(&lanes);
        for (i, s) in stage.iter_mut().enumerate() {
            s.program_secs = took[i];
            s.rss_mib = after[i].0.rss_kib as f64 / 1024.0;
            s.cpu_bulk_secs = after[i].0.cpu_secs - before[i].0.cpu_secs;
            s.agent_rss_mib = after[i].1.rss_kib as f64 / 1024.0;
        }
        println!(
            "[stage {n}] programmed in {}; RSS {}",
            fmt_each(&took, |s| format!("{s:.1} s")),
            fmt_each(&stage.each(|s| s.rss_mib), |m| format!("{m:.1} MiB"))
        );
        repetitions(args.reps, &VARIANTS, |v| {
            let m = measure(&tools, &lanes[v as usize].traffic, args.secs)?;
            let line = format!(
                "[{n} Services] (load {:.2}): {:.0} conn/s, RR p50 {:.1} µs",
                m.load, m.crr.rate, m.rr.p50_us
            );
            stage[v as usize].traffic.push(&m);
            Ok(line)
        })?;
        let before = usage(&lanes);
        for k in 0..args.changes {
            super::harness::check_interrupted()?;
            let ms = latency::change(&api, &ns, &lanes, &tools.netperf, &cg.0, si, k)?;
            for (s, v) in stage.iter_mut().zip(ms) {
                s.latency_ms.push(v);
            }
            println!(
                "[stage {n}] change {}/{}: {}",
                k + 1,
                args.changes,
                fmt_each(&ms, |v| format!("{v:.1} ms"))
            );
        }
        let after = usage(&lanes);
        for (i, s) in stage.iter_mut().enumerate() {
            s.cpu_per_change_ms =
                (after[i].0.cpu_secs - before[i].0.cpu_secs) * 1e3 / args.changes as f64;
        }
        latency::remove(&api, &ns, si, args.changes)?;
        results.stages.push((n, stage));
    }
    // The kube-proxies go first: at 10,000 Services each of them spends most of a CPU on the
    // churn (iptables-restore of the whole table at every write), which would slow the calix
    // node's ADDs through the machine, not through calix.
    for l in &mut lanes {
        if let Some(p) = l.proxy.take() {
            drop(p);
            println!("[churn] kube-proxy on {} stopped", l.node.ns.name);
        }
    }
    println!(
        "[churn] pod ADDs on the calix node, quiet and while {} EndpointSlices a minute are rewritten, {} rounds",
        churn::PER_MINUTE,
        args.reps
    );
    results.churn = Some(churn::measure(
        &api,
        &ns,
        lanes[Variant::Calix as usize].node,
        fillers,
        args.reps,
        CHURN_ADDS,
    )?);
    drop(lanes);
    drop(nodes);
    drop(api);
    drop(cg);
    b.done();
    let report = report::Report {
        reps: args.reps,
        secs: args.secs,
        changes: args.changes,
        quick: args.quick,
        results,
        bench: b,
    };
    super::harness::Bench::publish("services", &report.markdown(), args.quick, |p| {
        report.chart(p)
    })
}

trait Each {
    fn each(&self, f: impl Fn(&Stage) -> f64) -> [f64; 3];
}

impl Each for [Stage; 3] {
    fn each(&self, f: impl Fn(&Stage) -> f64) -> [f64; 3] {
        [f(&self[0]), f(&self[1]), f(&self[2])]
    }
}

/// `calix x, iptables y, nftables z`.
fn fmt_each(v: &[f64; 3], f: impl Fn(f64) -> String) -> String {
    VARIANTS
        .iter()
        .zip(v)
        .map(|(var, &x)| format!("{} {}", var.tag(), f(x)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Each lane's (what programs Services, its calix agent) usage now.
fn usage(lanes: &[Lane]) -> Vec<(ProcessUsage, ProcessUsage)> {
    let read = |pid: Option<u32>| pid.and_then(ProcessUsage::read).unwrap_or_default();
    lanes
        .iter()
        .map(|l| (read(l.programmer_pid()), read(l.node.agent_pid())))
        .collect()
}

/// TCP_CRR then TCP_RR from the client to its probe Service, `secs` each.
fn measure(tools: &Tools, t: &Traffic, secs: u64) -> Result<Measured> {
    let load = cpu::load_average();
    let cpu0 = CpuStat::read();
    let crr = tools.netperf(t, Mode::Crr, secs as f64)?;
    let rr = tools.netperf(t, Mode::Rr, secs as f64)?;
    let (others_busy, steal) = CpuStat::read().shares_since(&cpu0, tools.cpu);
    Ok(Measured {
        load,
        others_busy,
        steal,
        crr,
        rr,
        gbps: f64::NAN,
        zero_windows: f64::NAN,
        forwarded: None,
    })
}

/// Node `i` of variant `v`: eBPF, Kubernetes mode, a pool of its own; calix translating
/// Services for `cgroup`'s processes, or kube-proxy beside it (started by [`Lane::start`]).
fn node(b: &Bench, api: &KubeApi, v: Variant, i: usize, cgroup: &Path) -> Result<Node> {
    let name = b.name(v.tag());
    let n = Node::new(name.clone(), b.spec(Dataplane::Ebpf))?;
    let extra = match v {
        Variant::Calix => format!(
            "[services]\nenabled = true\ntranslate = true\ncgroup = \"{}\"\n",
            cgroup.display()
        ),
        _ => String::new(),
    };
    let n = api.kubernetes_node(n, None, &extra)?;
    let cidr = format!("10.232.{i}.0/24");
    let n = api
        .started_with_pool(n, &name, &cidr, &format!("192.0.2.{}", 240 + i))
        .with_context(|| format!("starting node {name}"))?;
    // Cluster IPs nothing translated: refused at once (see the module doc).
    n.ns.ip("route add unreachable 10.96.0.0/16")?;
    n.ns.sysctl("net.ipv4.icmp_ratelimit=0")?;
    println!("[setup] node {name}: calix eBPF, Kubernetes mode, pool {cidr}");
    Ok(n)
}

/// One variant's node at work: kube-proxy (unless calix), a client and two backend pods with
/// the traffic tools' servers, the probe Service.
pub(super) struct Lane<'a> {
    pub v: Variant,
    pub node: &'a Node,
    proxy: Option<KubeProxy>,
    pub traffic: Traffic,
    pub backends: [Ipv4Addr; 2],
    _servers: Vec<Guarded>,
    _pods: Vec<Pod<'a>>,
}

impl<'a> Lane<'a> {
    #[allow(clippy::too_many_arguments)]
    fn start(
        b: &Bench,
        api: &KubeApi,
        tools: &Tools,
        ns: &str,
        v: Variant,
        i: usize,
        node: &'a Node,
        cgroup: &Path,
    ) -> Result<Self> {
        let proxy = match v.proxy() {
            Some(mode) => {
                let kubeconfig = api.admin_kubeconfig_at(&node.ns)?;
                let log = b.dir.join(format!("{}-kube-proxy.log", v.tag()));
                let p = KubeProxy::start(
                    node.ns.path().as_ref(),
                    &node.ns.name,
                    &kubeconfig,
                    mode,
                    log,
                )
                .with_context(|| format!("kube-proxy on {}", node.ns.name))?;
                println!("[setup] kube-proxy ({}) on {}", mode.as_str(), node.ns.name);
                Some(p)
            }
            None => None,
        };
        let pod = |role: &str| {
            let name = format!("{}-{role}", v.tag());
            api.running_pod(node, ns, &name, json!({"bench": name}))
                .with_context(|| format!("pod {name}"))
        };
        let client = pod("client")?;
        let pods = [pod("b0")?, pod("b1")?];
        let mut servers = Vec::new();
        let mut backends = [Ipv4Addr::UNSPECIFIED; 2];
        for (a, p) in backends.iter_mut().zip(&pods) {
            *a = p.ip().parse().context("a backend's address")?;
            servers.extend(tools.start(&Traffic::new(&client.ns, &p.ns, *a), &b.dir)?);
        }
        let ip = objects::probe_ip(i);
        let name = format!("probe-{}", v.tag());
        api.apply(objects::service(ns, &name, ip, NETPERF_PORT))?;
        api.apply(objects::slice(ns, &name, &backends, NETPERF_PORT))?;
        let mut traffic = Traffic::new(&client.ns, &pods[0].ns, ip);
        if v == Variant::Calix {
            traffic = traffic.in_cgroup(cgroup);
        }
        let mut all = vec![client];
        all.extend(pods);
        Ok(Self {
            v,
            node,
            proxy,
            traffic,
            backends,
            _servers: servers,
            _pods: all,
        })
    }

    /// The process that programs Services on this node.
    fn programmer_pid(&self) -> Option<u32> {
        match &self.proxy {
            Some(p) => p.pid(),
            None => self.node.agent_pid(),
        }
    }
}

/// A cgroup of the bench's own on the v2 hierarchy (the clients of the calix variant run in
/// it), removed on drop.
struct BenchCgroup(PathBuf);

impl BenchCgroup {
    fn new(name: &str) -> Result<Self> {
        let hybrid = Path::new("/sys/fs/cgroup/unified");
        let root = match hybrid.join("cgroup.procs").exists() {
            true => hybrid,
            false => Path::new("/sys/fs/cgroup"),
        };
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        // Its processes have exited; their removal from it may lag a little.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() || !self.0.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
