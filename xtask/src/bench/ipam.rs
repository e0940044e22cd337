//! `cargo xtask bench ipam`: IPAM allocations per second, calix-agent with the embedded, the
//! etcd and the kubernetes datastore against Debian's reference `host-local` plugin, in one run
//! (DESIGN.md §10).
//!
//! calix is driven through its real gRPC API (`calix.v1.Ipam` on the agent's unix socket) from
//! this process: one HTTP/2 connection, each call timed client-side. host-local is a process per
//! allocation, as a runtime runs it: fork, exec with the CNI environment and the network config
//! on stdin, timed fork-to-exit.
//!
//! Per variant and repetition: the load average, a fresh state (a new test-bed agent, release
//! build, `--dataplane kernel`, with its own directory, config file, socket and datastore; a
//! fresh etcd key prefix; a fresh host-local `dataDir`), one untimed warm-up allocation and
//! release, then `allocs` sequential allocations, the same `allocs` released sequentially,
//! `allocs` fresh allocations with 16 in flight, and their release (16 in flight, untimed), after
//! which nothing may be left allocated. Variants are interleaved: repetitions outer, variants
//! inner, the order reversed every other repetition. Each repetition starts with two floors:
//! fork+exec `/bin/true` (what host-local pays per call before doing anything) and an append +
//! `fdatasync` in the bench's directory (what a durable allocation pays at least).
//!
//! etcd (`/usr/bin/etcd`, one member, its data under the bench's directory) runs for the whole
//! bench in a namespace of its own, `cxb-<pid>-ipam`, and the agents run there too, reaching it
//! on that namespace's 127.0.0.1 (and changing nothing of the host's). Everything is stopped and
//! removed on drop, on error too; the children also die with the bench (`PR_SET_PDEATHSIG`).
//! The kubernetes variant's API server (kube-apiserver v1.36.2 from `../shared/k8s`, its own
//! etcd, calix's CRDs, one `IPPool`) runs likewise in `cxb-<pid>-kube`, with its agents; its
//! objects stay across repetitions (each repetition's agent is a new node, whose blocks are
//! new, or released ones claimed again).
//!
//! Writes docs/bench/ipam.md and docs/bench/ipam.svg.
use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_proto::v1 as pb;
use calix_testbed::traffic::cpu::load_average;
use calix_testbed::{Agent, AgentSpec, Call, Dataplane, EtcdNs, KubeApi, Netns, Plugin, CNI_DIR};
use plotters::style::RGBColor;
use serde_json::json;
use tokio::runtime::Runtime;
use tonic::transport::Channel;

use super::chart::{self, Layout, Panel};
use super::harness::{cni_plugins_version, order, repetition, true_floor, Bench, Compared};
use super::report::{
    fmt_ms, fmt_spread_with, heading, load_note, loads, median, percentile, ratio, Calls,
};
use crate::util::output;

const CALIX_POOL: &str = "10.240.0.0/16";
const BLOCK_SIZE: u8 = 26;
const HOST_LOCAL_SUBNET: &str = "10.250.0.0/16";
const NETWORK: &str = "benchnet";
const ETCD: &str = "/usr/bin/etcd";
const IN_FLIGHT: usize = 16;
/// Both /16s hold 65k addresses; stay well below.
const MAX_ALLOCS: usize = 60_000;
const RPC_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes per append of the fdatasync floor.
const FSYNC_LINE: usize = 512;

type Client = pb::ipam_client::IpamClient<Channel>;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Embedded,
    Etcd,
    Kubernetes,
    HostLocal,
}

const VARIANTS: [Variant; 4] = [
    Variant::Embedded,
    Variant::Etcd,
    Variant::Kubernetes,
    Variant::HostLocal,
];
/// The calix variants (every one but host-local).
const CALIX: [Variant; 3] = [Variant::Embedded, Variant::Etcd, Variant::Kubernetes];

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Embedded => ("calix, embedded", "e", chart::BLUE),
            Self::Etcd => ("calix, etcd", "d", chart::GREEN),
            Self::Kubernetes => ("calix, kubernetes", "k", chart::PURPLE),
            Self::HostLocal => ("host-local", "h", chart::ORANGE),
        }
    }
}

// --- calix ---------------------------------------------------------------------------------

/// The agent's free IPv4 addresses (its Status).
async fn free_v4(c: &Client) -> Result<u64> {
    Ok(c.clone()
        .status(pb::StatusRequest {})
        .await?
        .into_inner()
        .free_v4)
}

/// A fresh calix-agent in `ns` with `datastore` as its `[datastore]` section, answering; a
/// gRPC client of it.
fn start_agent(
    b: &Bench,
    rt: &Runtime,
    ns: &Netns,
    tag: &str,
    datastore: &str,
) -> Result<(Agent, Client)> {
    // Housekeeping (leak GC, empty-block release) every hour: no pass during a measurement.
    // (With the kubernetes datastore the pool is an IPPool object.)
    let pools = if datastore.contains("kubernetes") {
        String::new()
    } else {
        format!("[[pools]]\ncidr = \"{CALIX_POOL}\"\nblockSize = {BLOCK_SIZE}\n")
    };
    let config =
        format!("[datastore]\n{datastore}\n\n[ipam]\nleakCheckIntervalSecs = 3600\n\n{pools}");
    let spec = AgentSpec {
        config: Some(config),
        log_level: "warn",
        ..b.spec(Dataplane::Kernel)
    };
    let agent = Agent::new(&b.name(tag), b.dir.join(tag), Some(ns), spec)?;
    agent.start(&[])?;
    let ch = rt.block_on(calix_proto::connect_unix(&agent.socket, RPC_TIMEOUT))?;
    Ok((agent, Client::new(ch)))
}

/// One IPv4 allocation for `handle`; its address.
async fn allocate(mut c: Client, handle: String) -> Result<String> {
    let r = c
        .allocate(pb::AllocateRequest {
            handle: handle.clone(),
            ifname: "eth0".into(),
            ipv4: true,
            ..Default::default()
        })
        .await
        .with_context(|| format!("Allocate {handle}"))?
        .into_inner();
    match r.addresses.as_slice() {
        [a] if a.pool == CALIX_POOL && !r.already_allocated => Ok(a.address.clone()),
        _ => bail!("Allocate {handle} returned {r:?}"),
    }
}

async fn release(mut c: Client, handle: String) -> Result<()> {
    let r = c
        .release(pb::ReleaseRequest {
            handle: handle.clone(),
            ifname: "eth0".into(),
        })
        .await
        .with_context(|| format!("Release {handle}"))?
        .into_inner();
    if r.released != 1 {
        bail!("Release {handle} released {} addresses", r.released);
    }
    Ok(())
}

/// `op(client, i)` for every i in 0..n, one after another: the wall time (s), every call's
/// latency (ms) and the results.
async fn sequential<T, F, Fut>(c: &Client, n: usize, op: &F) -> Result<(f64, Vec<f64>, Vec<T>)>
where
    F: Fn(Client, usize) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut lat = Vec::with_capacity(n);
    let mut out = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        out.push(op(c.clone(), i).await?);
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((t0.elapsed().as_secs_f64(), lat, out))
}

/// `op(ctx, i)` for every i in 0..n with IN_FLIGHT calls in flight (for calix, on the one
/// connection `ctx`): the wall time (s) and the results (unordered).
async fn in_flight<C, T, F, Fut>(c: &C, n: usize, op: F) -> Result<(f64, Vec<T>)>
where
    C: Clone + Send + 'static,
    F: Fn(C, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let t0 = Instant::now();
    for _ in 0..IN_FLIGHT.min(n) {
        let (op, next, c) = (op.clone(), next.clone(), c.clone());
        tasks.spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, anyhow::Error>(out);
                }
                match op(c.clone(), i).await {
                    Ok(v) => out.push(v),
                    Err(e) => {
                        // The other tasks stop after their current call.
                        next.store(n, Ordering::Relaxed);
                        return Err(e);
                    }
                }
            }
        });
    }
    let mut all = Vec::with_capacity(n);
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(v)) => all.extend(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(e.into());
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    match first_err {
        Some(e) => Err(e),
        None => Ok((wall, all)),
    }
}

/// Fails unless the `n` addresses are `n` distinct ones.
fn distinct(what: &str, addrs: &[String], n: usize) -> Result<()> {
    let set: std::collections::HashSet<&String> = addrs.iter().collect();
    if addrs.len() != n || set.len() != n {
        bail!(
            "{what}: {} distinct addresses for {n} allocations",
            set.len()
        );
    }
    Ok(())
}

/// One repetition of one calix variant.
fn run_calix(b: &Bench, rt: &Runtime, ns: &Netns, datastore: &str, ids: &Ids) -> Result<Measured> {
    let (agent, client) = start_agent(b, rt, ns, &format!("r{}{}", ids.rep, ids.tag), datastore)?;
    let handles = |phase: &str| -> Arc<Vec<String>> {
        Arc::new(
            (0..ids.n)
                .map(|i| calix_proto::handle::encode(NETWORK, &ids.id(phase, i)))
                .collect(),
        )
    };
    let alloc_op = |h: Arc<Vec<String>>| move |c: Client, i: usize| allocate(c, h[i].clone());
    let release_op = |h: Arc<Vec<String>>| move |c: Client, i: usize| release(c, h[i].clone());
    let (seq, conc, warm) = (handles("s"), handles("c"), handles("w"));
    let m = rt.block_on(async {
        // Warm-up (the connection, the agent's first allocation path): untimed.
        allocate(client.clone(), warm[0].clone()).await?;
        release(client.clone(), warm[0].clone()).await?;
        let free = free_v4(&client).await?;
        // The gRPC round trip with no datastore access: the floor of every call.
        let (_, rpc_lat, _) =
            sequential(
                &client,
                ids.n,
                &|c: Client, _| async move { free_v4(&c).await },
            )
            .await?;
        let (seq_wall, alloc_lat, addrs) =
            sequential(&client, ids.n, &alloc_op(seq.clone())).await?;
        distinct("sequential allocations", &addrs, ids.n)?;
        let journal = std::fs::metadata(agent.dir.join("store.json.journal"))
            .map(|m| m.len())
            .ok();
        let (rel_wall, rel_lat, _) = sequential(&client, ids.n, &release_op(seq)).await?;
        let (conc_wall, addrs) = in_flight(&client, ids.n, alloc_op(conc.clone())).await?;
        distinct("concurrent allocations", &addrs, ids.n)?;
        in_flight(&client, ids.n, release_op(conc)).await?;
        let after = free_v4(&client).await?;
        if after != free {
            bail!("{free} free addresses before the allocations, {after} after releasing them all");
        }
        Ok::<_, anyhow::Error>(Measured {
            seq_wall,
            conc_wall,
            rel_wall,
            alloc_lat,
            rel_lat,
            rpc_lat,
            journal,
        })
    });
    // The agent stops (SIGTERM) and its files go when it drops, at the end of this function:
    // it does not run during other variants.
    m.map_err(|e| match agent.exited() {
        Some(status) => e.context(format!(
            "calix-agent exited ({status}); its log:\n{}",
            agent.log()
        )),
        None => e,
    })
}

// --- host-local ----------------------------------------------------------------------------

/// Address files host-local holds in `data_dir` (it also keeps `lock` and `last_reserved_ip.*`).
fn host_local_held(data_dir: &Path) -> Result<usize> {
    let dir = data_dir.join(NETWORK);
    Ok(std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name != "lock" && !name.starts_with("last_reserved_ip")
        })
        .count())
}

/// `calls` with IN_FLIGHT processes running at a time: the wall time (s).
fn processes_in_flight(rt: &Runtime, p: &Arc<Plugin>, calls: Vec<Call<'static>>) -> Result<f64> {
    let (n, calls) = (calls.len(), Arc::new(calls));
    let call = move |p: Arc<Plugin>, i: usize| {
        let calls = calls.clone();
        async move { Ok(tokio::task::spawn_blocking(move || p.timed(&calls[i])).await??) }
    };
    Ok(rt.block_on(in_flight(p, n, call))?.0)
}

/// One repetition of host-local, a process per call, in a fresh `data_dir`.
fn run_host_local(rt: &Runtime, data_dir: &Path, ids: &Ids) -> Result<Measured> {
    let conf = json!({
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "type": "host-local",
        "ipam": {
            "type": "host-local",
            "ranges": [[{ "subnet": HOST_LOCAL_SUBNET }]],
            "dataDir": data_dir.display().to_string(),
        },
    });
    let p = Arc::new(Plugin::new(
        "host-local",
        Path::new(CNI_DIR).join("host-local"),
        None,
        &conf,
    ));
    // host-local never opens the namespace, but its ADD refuses to run without CNI_NETNS.
    let netns = format!("/proc/{}/ns/net", std::process::id());
    let calls = |command: &'static str, phase: &str, n: usize| -> Vec<Call<'static>> {
        (0..n)
            .map(|i| Call::new(command, ids.id(phase, i), netns.clone(), String::new()))
            .collect()
    };
    let timed_all = |calls: &[Call]| -> Result<(f64, Vec<f64>)> {
        let t0 = Instant::now();
        let lat = calls.iter().map(|c| p.timed(c)).collect::<Result<_, _>>()?;
        Ok((t0.elapsed().as_secs_f64(), lat))
    };
    timed_all(&calls("ADD", "w", 1))?;
    timed_all(&calls("DEL", "w", 1))?;
    let (seq_wall, alloc_lat) = timed_all(&calls("ADD", "s", ids.n))?;
    let held = host_local_held(data_dir)?;
    if held != ids.n {
        bail!("host-local holds {held} addresses after {} ADDs", ids.n);
    }
    let (rel_wall, rel_lat) = timed_all(&calls("DEL", "s", ids.n))?;
    let conc_wall = processes_in_flight(rt, &p, calls("ADD", "c", ids.n))?;
    let held = host_local_held(data_dir)?;
    if held != ids.n {
        bail!(
            "host-local holds {held} addresses after {} concurrent ADDs",
            ids.n
        );
    }
    processes_in_flight(rt, &p, calls("DEL", "c", ids.n))?;
    let held = host_local_held(data_dir)?;
    if held != 0 {
        bail!("host-local still holds {held} addresses after every DEL");
    }
    Ok(Measured {
        seq_wall,
        conc_wall,
        rel_wall,
        alloc_lat,
        rel_lat,
        rpc_lat: Vec::new(),
        journal: None,
    })
}

// --- the run -------------------------------------------------------------------------------

/// Unique container IDs of one variant and repetition.
struct Ids {
    n: usize,
    rep: usize,
    tag: &'static str,
}

impl Ids {
    fn id(&self, phase: &str, i: usize) -> String {
        format!("cxb{}{}{phase}{i:06}", self.rep, self.tag)
    }
}

/// One variant's repetition.
struct Measured {
    /// Wall times (s) of the phases.
    seq_wall: f64,
    conc_wall: f64,
    rel_wall: f64,
    /// Per-call latencies (ms), sequential.
    alloc_lat: Vec<f64>,
    rel_lat: Vec<f64>,
    /// calix: Status round trips (ms), the gRPC floor.
    rpc_lat: Vec<f64>,
    /// The embedded journal's size after the sequential allocations.
    journal: Option<u64>,
}

/// One variant over every repetition.
#[derive(Default)]
struct Samples {
    /// Per repetition: allocations/s sequential and with 16 in flight, releases/s.
    seq: Vec<f64>,
    conc: Vec<f64>,
    rel: Vec<f64>,
    /// Sequential calls (ms).
    alloc: Calls,
    release: Calls,
    /// calix: Status round trips (ms).
    rpc: Calls,
    /// Sequential allocation latencies (ms) of the first and the last tenth of each repetition.
    first_tenth: Vec<f64>,
    last_tenth: Vec<f64>,
    /// Journal bytes per sequential allocation (embedded).
    journal_per_alloc: Vec<f64>,
    load: Vec<f64>,
}

impl Samples {
    /// Records a repetition; returns its progress line.
    fn push(&mut self, n: usize, m: Measured) -> String {
        let nf = n as f64;
        let (seq, conc, rel) = (nf / m.seq_wall, nf / m.conc_wall, nf / m.rel_wall);
        self.seq.push(seq);
        self.conc.push(conc);
        self.rel.push(rel);
        let k = (m.alloc_lat.len() / 10).max(1).min(m.alloc_lat.len());
        self.first_tenth.extend(&m.alloc_lat[..k]);
        self.last_tenth
            .extend(&m.alloc_lat[m.alloc_lat.len() - k..]);
        if let Some(j) = m.journal {
            self.journal_per_alloc.push(j as f64 / nf);
        }
        let a99 = percentile(&m.alloc_lat, 99.0);
        let (a50, r50) = (self.alloc.push(m.alloc_lat), self.release.push(m.rel_lat));
        self.rpc.push(m.rpc_lat);
        format!(
            "sequential {}/s (p50 {} ms, p99 {} ms), {IN_FLIGHT} in flight {}/s, release {}/s (p50 {} ms)",
            fmt_rate(seq),
            fmt_ms(a50),
            fmt_ms(a99),
            fmt_rate(conc),
            fmt_rate(rel),
            fmt_ms(r50),
        )
    }
}

/// The floors over every repetition (ms per call).
#[derive(Default)]
struct Floors {
    truth: Calls,
    fsync: Calls,
    load: Vec<f64>,
}

impl Floors {
    fn run(&mut self, dir: &Path, n: usize) -> Result<String> {
        use std::os::unix::fs::OpenOptionsExt;
        let load = load_average();
        self.load.push(load);
        let t50 = self.truth.push(true_floor(n, None)?);
        let path = dir.join("fsync-floor");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let mut line = vec![b'x'; FSYNC_LINE - 1];
        line.push(b'\n');
        let mut fsync = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            f.write_all(&line)?;
            f.sync_data()?;
            fsync.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        drop(f);
        std::fs::remove_file(&path)?;
        let f50 = self.fsync.push(fsync);
        Ok(format!(
            "(load {load:.2}): /bin/true p50 {} ms, append {FSYNC_LINE} B + fdatasync p50 {} ms",
            fmt_ms(t50),
            fmt_ms(f50)
        ))
    }
}

/// Allocations per second: no decimals from 100 up.
fn fmt_rate(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

fn rate_spread(v: &[f64]) -> String {
    fmt_spread_with(v, "/s", fmt_rate)
}

pub fn run(allocs: usize, reps: usize) -> Result<()> {
    if !(2..=MAX_ALLOCS).contains(&allocs) || reps < 1 {
        bail!("--allocs must be 2..={MAX_ALLOCS} and --reps at least 1");
    }
    if !Path::new(ETCD).exists() {
        bail!("{ETCD} is missing: install etcd-server (cargo xtask setup)");
    }
    let b = Bench::setup("the IPAM benchmark", &[], &["host-local"])?;
    println!(
        "[setup] starting etcd in {} (data in {})",
        b.name("ipam"),
        b.dir.display()
    );
    let etcd = EtcdNs::launch(b.netns("ipam")?)?;
    println!("[setup] starting kube-apiserver in {}", b.name("kube"));
    let kube = KubeApi::launch(Some(b.netns("kube")?), b.name("kube"), true)?;
    kube.apply(json!({
        "apiVersion": "calix.dev/v1",
        "kind": "IPPool",
        "metadata": {"name": "bench"},
        "spec": {"cidr": CALIX_POOL, "blockSize": BLOCK_SIZE},
    }))?;
    let kube_store = format!(
        "type = \"kubernetes\"\nkubeconfig = \"{}\"\ntimeout_ms = 10000",
        kube.kubeconfig().display()
    );
    let kube_ns = kube.ns.as_ref().context("the API server's namespace")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a tokio runtime")?;

    let mut floors = Floors::default();
    let mut res: [Samples; 4] = Default::default();
    for rep in 0..reps {
        repetition(
            rep,
            reps,
            &[()],
            |()| "floors".into(),
            |()| floors.run(&b.dir, allocs),
        )?;
        repetition(
            rep,
            reps,
            &order(&VARIANTS, rep, false),
            |v| v.label().into(),
            |v| {
                let load = load_average();
                let ids = Ids {
                    n: allocs,
                    rep: rep + 1,
                    tag: v.tag(),
                };
                let m = match v {
                    Variant::Embedded => run_calix(&b, &rt, &etcd.ns, "type = \"embedded\"", &ids)?,
                    Variant::Etcd => {
                        let store = format!(
                        "type = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\nprefix = \"/cxb/r{}/\"",
                        rep + 1
                    );
                        run_calix(&b, &rt, &etcd.ns, &store, &ids)?
                    }
                    Variant::Kubernetes => run_calix(&b, &rt, kube_ns, &kube_store, &ids)?,
                    Variant::HostLocal => {
                        let dir = b.dir.join(format!("r{}-{}", rep + 1, v.tag()));
                        let m = run_host_local(&rt, &dir, &ids);
                        let _ = std::fs::remove_dir_all(&dir);
                        m?
                    }
                };
                let s = &mut res[v as usize];
                s.load.push(load);
                Ok(format!("(load {load:.2}): {}", s.push(allocs, m)))
            },
        )?;
    }
    drop((rt, etcd, kube));
    b.done();

    let etcd_version = output(Command::new(ETCD).arg("--version"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("etcd Version:")
                    .map(|v| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| "unknown".into());
    let report = Report {
        allocs,
        reps,
        plugins_version: cni_plugins_version(),
        etcd_version,
        res,
        floors,
        bench: b,
    };
    Bench::publish("ipam", &report.markdown(), false, |p| chart(p, &report))
}

// --- report --------------------------------------------------------------------------------

struct Report {
    allocs: usize,
    reps: usize,
    plugins_version: String,
    etcd_version: String,
    res: [Samples; 4],
    floors: Floors,
    bench: Bench,
}

impl Report {
    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    /// `<variant> <f(samples)>` for every variant, comma-separated.
    fn per_variant(&self, f: impl Fn(&Samples) -> String) -> String {
        VARIANTS
            .iter()
            .map(|&v| format!("{} {}", v.label(), f(self.get(v))))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn row(&self, v: Variant) -> String {
        let s = self.get(v);
        format!(
            "| {} | {} | {} | {} | {} | {} ms | {} | {} ms | {} |\n",
            v.label(),
            rate_spread(&s.seq),
            rate_spread(&s.conc),
            rate_spread(&s.rel),
            s.alloc.p50(),
            fmt_ms(s.alloc.p(99.0)),
            s.release.p50(),
            fmt_ms(s.release.p(99.0)),
            loads(&s.load),
        )
    }

    fn ratio_row(&self, v: Variant) -> String {
        let (c, h) = (self.get(v), self.get(Variant::HostLocal));
        let med = median;
        let pct = |s: &Samples, p: f64, rel: bool| match rel {
            true => s.release.p(p),
            false => s.alloc.p(p),
        };
        format!(
            "| {} / host-local | {} | {} | {} | {} | {} | {} | {} | |\n",
            v.label(),
            ratio(med(&c.seq), med(&h.seq)),
            ratio(med(&c.conc), med(&h.conc)),
            ratio(med(&c.rel), med(&h.rel)),
            ratio(pct(c, 50.0, false), pct(h, 50.0, false)),
            ratio(pct(c, 99.0, false), pct(h, 99.0, false)),
            ratio(pct(c, 50.0, true), pct(h, 50.0, true)),
            ratio(pct(c, 99.0, true), pct(h, 99.0, true)),
        )
    }

    fn markdown(&self) -> String {
        let f = &self.floors;
        let n = self.allocs;
        let mut s = heading(
            "IPAM allocations per second: calix (embedded, etcd, kubernetes) vs host-local",
            false,
        );
        s.push_str(&format!(
            "{} (release build, `calix-agent --dataplane kernel`, pool \
             {CALIX_POOL} in /{BLOCK_SIZE} blocks); the etcd backend against etcd {} (one member on \
             127.0.0.1, data on the same disk); the kubernetes backend against kube-apiserver \
             v1.36.2 (upstream, watch cache on) on its own etcd {}, both on 127.0.0.1 of a \
             namespace of their own (its IPAM objects kept across repetitions); `host-local` from Debian's \
             containernetworking-plugins {} (a {HOST_LOCAL_SUBNET} range). Every datastore is \
             in /tmp, on the root ext4 disk.\n\n",
            self.bench
                .measured(&format!("ipam --allocs {n} --reps {}", self.reps)),
            self.etcd_version,
            self.etcd_version,
            self.plugins_version,
        ));
        s.push_str(&format!(
            "**calix** is driven through its gRPC API (`calix.v1.Ipam/Allocate`, IPv4 only, a \
             unique handle per call; `Release`) on the agent's unix socket, from the bench \
             process over one HTTP/2 connection, each call timed client-side. **host-local is a \
             process per allocation**: fork, exec `/usr/lib/cni/host-local` with \
             `CNI_COMMAND=ADD` (a unique container ID) and the network config on stdin, wait for \
             its exit — the reference the issue asks for, so its numbers include process \
             creation and the Go runtime's start, which calix's numbers here do not (calix's own \
             CNI plugin is a process per ADD too: see [cni.md](cni.md)).\n\n\
             Per variant and repetition, from a fresh state (a new agent with its own directory \
             and datastore, a new etcd key prefix, a new host-local `dataDir`) after one untimed \
             warm-up allocation: {n} sequential allocations, the same {n} released sequentially, \
             {n} fresh allocations with {IN_FLIGHT} in flight ({IN_FLIGHT} tasks on the one \
             connection; {IN_FLIGHT} host-local processes at a time), released untimed; then \
             nothing may be left allocated. The sequential phase claims a block every 64 \
             allocations; the in-flight phase reuses those (empty, affine) blocks. The agent's \
             housekeeping runs hourly, so never during a measurement. {} repetitions with the \
             variants interleaved (order reversed every other repetition). Rates are \
             allocations (releases) per second of wall time, median [min–max] over repetitions; \
             latencies are per call, p50/p99 over all {} sequential calls with the [min–max] of \
             the per-repetition p50s; the 1-minute load average before each variant.\n\n",
            self.reps,
            n * self.reps,
        ));
        s.push_str(&format!(
            "| variant | sequential alloc/s | {IN_FLIGHT} in flight alloc/s | release/s | \
             alloc p50 | alloc p99 | release p50 | release p99 | load before |\n"
        ));
        s.push_str("|---|---|---|---|---|---|---|---|---|\n");
        for v in VARIANTS {
            s.push_str(&self.row(v));
        }
        for v in CALIX {
            s.push_str(&self.ratio_row(v));
        }
        s.push_str(
            "\nRatios are calix / host-local: above 1× is faster for rates, below 1× is faster \
             for latencies.\n",
        );
        s.push_str(&format!(
            "\n- {IN_FLIGHT} in flight against sequential (median rates): {}.\n",
            self.per_variant(|x| ratio(median(&x.conc), median(&x.seq)))
        ));
        s.push_str(&format!(
            "- 1 / the {IN_FLIGHT}-in-flight rate (what an allocation costs once the RPC work \
             overlaps; calix: about the time it holds the agent's lock): {}.\n",
            self.per_variant(|x| format!("{} ms", fmt_ms(1e3 / median(&x.conc))))
        ));
        s.push_str(&format!(
            "- Sequential allocation p50, first tenth → last tenth of each repetition (the \
             addresses held grow from 0 to {n}): {}.\n",
            self.per_variant(|x| format!(
                "{} → {} ms",
                fmt_ms(percentile(&x.first_tenth, 50.0)),
                fmt_ms(percentile(&x.last_tenth, 50.0))
            ))
        ));
        let journal = &self.get(Variant::Embedded).journal_per_alloc;
        if !journal.is_empty() {
            s.push_str(&format!(
                "- The embedded journal grew by {:.0} bytes per sequential allocation (one \
                 transaction: the block record and the handle record, fdatasync'd).\n",
                median(journal)
            ));
        }
        s.push_str("\nFloors, per call (the first two before the variants, load ");
        s.push_str(&loads(&f.load));
        s.push_str("; the gRPC ones in each calix run, before its allocations):\n\n");
        s.push_str("| floor | p50 | p99 |\n|---|---|---|\n");
        s.push_str(&f.truth.row(
            "fork+exec `/bin/true`, timed fork-to-exit (what every host-local call pays first)",
        ));
        s.push_str(&f.fsync.row(&format!(
            "append {FSYNC_LINE} B + `fdatasync` in /tmp (the least a durable allocation pays)"
        )));
        for v in CALIX {
            s.push_str(&self.get(v).rpc.row(&format!(
                "`calix.v1.Ipam/Status` round trip, {} agent (no datastore access: the gRPC \
                 floor of every call)",
                v.label().trim_start_matches("calix, ")
            )));
        }
        s.push_str(
            "\nWhat each allocation does. calix: one gRPC call; the agent takes its IPAM lock, \
             reads the handle key, picks an address in its in-memory block view, commits the \
             block alone with a compare-and-swap on its revision, then writes the handle record \
             (which follows the block); embedded: journal appends + one `fdatasync` (releases \
             append without fsync); etcd: a range and txn round trips to etcd, which fsyncs its \
             Raft WAL for every write (releases too); kubernetes: a GET of the handle object, a \
             PUT of the block object carrying its resourceVersion and the handle object's \
             create or replace, each an HTTPS request the API server turns into an etcd \
             transaction. Allocations are serialized on the agent's lock, so calls in flight \
             overlap only their RPC work. host-local: a process; `flock` on the `dataDir`, then \
             it reads every address file it holds (looking for the container ID's earlier \
             allocation: the cost grows with the addresses held), creates one file for the new \
             address and rewrites `last_reserved_ip`, no fsync.\n",
        );
        let all_loads: Vec<f64> = self
            .res
            .iter()
            .flat_map(|r| r.load.iter())
            .chain(&f.load)
            .copied()
            .collect();
        if let Some(note) = load_note(&all_loads) {
            s.push_str(&note);
        }
        s.push_str("\n![IPAM allocations per second](ipam.svg)\n");
        s
    }
}

fn chart(path: &Path, r: &Report) -> Result<()> {
    let rates = |s: &Samples| vec![Some(median(&s.seq)), Some(median(&s.conc))];
    let series = VARIANTS
        .iter()
        .map(|&v| (v.label(), v.color(), rates(r.get(v))))
        .collect();
    let host_local = rates(r.get(Variant::HostLocal));
    let label = move |si: usize, gi: usize, v: f64| {
        if VARIANTS[si] == Variant::HostLocal {
            fmt_rate(v)
        } else {
            let reference = host_local[gi].unwrap_or(f64::NAN);
            format!("{} ({})", fmt_rate(v), ratio(v, reference))
        }
    };
    let in_flight = format!("{IN_FLIGHT} in flight");
    chart::chart(
        path,
        (900, 460),
        &format!(
            "IPAM allocations/s, calix vs host-local ({} allocations × {} reps, {})",
            r.allocs, r.reps, r.bench.machine.date
        ),
        Layout::Grid(1, 1),
        &[Panel::new(
            "allocations per second (median); calix labels: ratio to host-local",
            "allocations/s",
            &["sequential", &in_flight],
            series,
            label,
        )],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::{around, render};

    #[test]
    fn the_report_renders() {
        let reps = 2;
        let samples = |rate: f64, journal: bool| Samples {
            seq: around(rate, reps),
            conc: around(1.5 * rate, reps),
            rel: around(2.0 * rate, reps),
            alloc: Calls::fake(1e3 / rate, reps),
            release: Calls::fake(500.0 / rate, reps),
            rpc: Calls::fake(0.1, reps),
            first_tenth: around(1e3 / rate, 10),
            last_tenth: around(1.2e3 / rate, 10),
            journal_per_alloc: if journal {
                around(300.0, reps)
            } else {
                Vec::new()
            },
            load: around(0.5, reps),
        };
        let r = Report {
            allocs: 1000,
            reps,
            plugins_version: "1.1.1".into(),
            etcd_version: "3.5.16".into(),
            res: [
                samples(2500.0, true),
                samples(400.0, false),
                samples(150.0, false),
                samples(300.0, false),
            ],
            floors: Floors {
                truth: Calls::fake(0.6, reps),
                fsync: Calls::fake(1.5, reps),
                load: around(0.3, reps),
            },
            bench: Bench::fake(),
        };
        let md = r.markdown();
        let svg = render("ipam", &md, |p| chart(p, &r));
        assert!(md.starts_with("# IPAM allocations per second"));
        assert!(svg.contains("calix, kubernetes") && svg.contains("host-local"));
    }
}
