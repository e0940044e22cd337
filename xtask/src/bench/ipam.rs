//! `cargo xtask bench ipam`: IPAM allocations per second, calix-agent with the embedded and the
//! etcd datastore against Debian's reference `host-local` plugin, in one run (DESIGN.md §10).
//!
//! calix is driven through its real gRPC API (`calix.v1.Ipam` on the agent's unix socket) from
//! this process: one HTTP/2 connection, each call timed client-side. host-local is a process per
//! allocation, as a runtime runs it: fork, exec with the CNI environment and the network config
//! on stdin, timed fork-to-exit.
//!
//! Per variant and repetition: the load average, a fresh state (a new `calix-agent`, release
//! build, `--dataplane kernel`, with its own directory, config file, socket and datastore; a
//! fresh etcd key prefix; a fresh host-local `dataDir`), one untimed warm-up allocation and
//! release, then `allocs` sequential allocations, the same `allocs` released sequentially,
//! `allocs` fresh allocations with 16 in flight, and their release (16 in flight, untimed), after
//! which nothing may be left allocated. Variants are interleaved: repetitions outer, variants
//! inner, the order reversed every other repetition. Each repetition starts with two floors:
//! fork+exec `/bin/true` (what host-local pays per call before doing anything) and an append +
//! `fdatasync` in the bench's directory (what a durable allocation pays at least).
//!
//! etcd (`/usr/bin/etcd`, one member on 127.0.0.1, free ports, a data directory under the
//! bench's) runs for the whole bench. Everything lives in `/tmp/cxb-ipam-<pid>` and is stopped and
//! removed on drop, on error too; the children also die with the bench (`PR_SET_PDEATHSIG`).
//!
//! Writes docs/bench/ipam.md and docs/bench/ipam.svg.
use std::future::Future;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_proto::v1 as pb;
use serde_json::json;
use tonic::transport::Channel;

use super::{
    cni_plugins_version, fmt_ms, fmt_spread_with, git_rev, load_note, loadavg, loads, ms, out_dir,
    p50_with_reps, panel, percentile, ratio, spread, stop_child, timed_cmd, wait_ready, Call,
    Machine, Plugin, CNI_DIR,
};
use crate::util::{self, output};

const PREFIX: &str = "cxb-ipam";
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
    HostLocal,
}

const VARIANTS: [Variant; 3] = [Variant::Embedded, Variant::Etcd, Variant::HostLocal];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Self::Embedded => "calix, embedded",
            Self::Etcd => "calix, etcd",
            Self::HostLocal => "host-local",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::Embedded => "e",
            Self::Etcd => "d",
            Self::HostLocal => "h",
        }
    }
}

/// What the bench started; stopped and removed on drop (error or panic included).
struct Guard {
    dir: PathBuf,
    etcd: Option<Child>,
    agent: Option<Child>,
}

impl Guard {
    fn stop_agent(&mut self) {
        if let Some(a) = self.agent.take() {
            stop_child(a);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop_agent();
        if let Some(e) = self.etcd.take() {
            stop_child(e);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The child gets SIGKILL when the bench dies, however it dies.
fn die_with_parent(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Removes the directories of earlier runs that died without cleaning up.
fn remove_stale() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.strip_prefix('-'))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            println!("      removing stale {}", e.path().display());
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A log file for a child's stdout and stderr.
fn log_to(path: &Path) -> Result<(Stdio, Stdio)> {
    let f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    Ok((f.try_clone()?.into(), f.into()))
}

// --- etcd ----------------------------------------------------------------------------------

/// Two distinct free ports on 127.0.0.1 (both held while asking, so they differ).
fn free_ports() -> Result<(u16, u16)> {
    let a = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let b = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// Whether etcd's `/health` on 127.0.0.1:`port` says so.
fn etcd_healthy(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut body = String::new();
    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .and_then(|_| s.read_to_string(&mut body))
        .is_ok()
        && body.contains(r#""health":"true""#)
}

/// Starts a one-member etcd on 127.0.0.1; returns its client URL once it is healthy.
fn start_etcd(g: &mut Guard) -> Result<String> {
    let (client_port, peer_port) = free_ports()?;
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let log_path = g.dir.join("etcd.log");
    let (out, err) = log_to(&log_path)?;
    let child = die_with_parent(Command::new(ETCD).args([
        "--name",
        "cxb",
        "--listen-client-urls",
        &client,
        "--advertise-client-urls",
        &client,
        "--listen-peer-urls",
        &peer,
        "--initial-advertise-peer-urls",
        &peer,
        "--initial-cluster",
        &format!("cxb={peer}"),
        "--initial-cluster-state",
        "new",
        "--logger",
        "zap",
        "--log-level",
        "warn",
    ]))
    .arg("--data-dir")
    .arg(g.dir.join("etcd"))
    .stdin(Stdio::null())
    .stdout(out)
    .stderr(err)
    .spawn()
    .with_context(|| format!("cannot start {ETCD}"))?;
    let etcd = g.etcd.insert(child);
    wait_ready("etcd", etcd, &log_path, Duration::from_secs(30), || {
        etcd_healthy(client_port)
    })?;
    Ok(client)
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

/// Whether the agent answers Status on a fresh connection.
async fn agent_answers(socket: &Path) -> Result<u64> {
    let ch = calix_proto::connect_unix(socket, Duration::from_secs(1)).await?;
    free_v4(&Client::new(ch)).await
}

/// Starts a calix-agent in the fresh directory `dir` with `datastore` as its `[datastore]`
/// section; returns a client once the socket answers.
fn start_agent(
    g: &mut Guard,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    dir: &Path,
    datastore: &str,
) -> Result<Client> {
    std::fs::create_dir_all(dir)?;
    let config = dir.join("agent.toml");
    // Housekeeping (leak GC, empty-block release) every hour: no pass during a measurement.
    std::fs::write(
        &config,
        format!(
            "[datastore]\n{datastore}\n\n[ipam]\nleakCheckIntervalSecs = 3600\n\n\
             [[pools]]\ncidr = \"{CALIX_POOL}\"\nblockSize = {BLOCK_SIZE}\n"
        ),
    )?;
    let socket = dir.join("agent.sock");
    let log_path = dir.join("agent.log");
    let (out, err) = log_to(&log_path)?;
    let child = die_with_parent(
        Command::new(bin)
            .arg("--config")
            .arg(&config)
            .args(["--node-name", "bench-node", "--socket"])
            .arg(&socket)
            .arg("--datastore-path")
            .arg(dir.join("store.json"))
            .args(["--dataplane", "kernel", "--log-level", "warn"]),
    )
    .stdin(Stdio::null())
    .stdout(out)
    .stderr(err)
    .spawn()
    .context("cannot start calix-agent")?;
    let agent = g.agent.insert(child);
    wait_ready(
        "calix-agent",
        agent,
        &log_path,
        Duration::from_secs(20),
        || rt.block_on(agent_answers(&socket)).is_ok(),
    )?;
    let ch = rt.block_on(calix_proto::connect_unix(&socket, RPC_TIMEOUT))?;
    Ok(Client::new(ch))
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
        lat.push(ms(t.elapsed()));
    }
    Ok((t0.elapsed().as_secs_f64(), lat, out))
}

/// `op(client, i)` for every i in 0..n with IN_FLIGHT calls in flight on the one connection:
/// the wall time (s) and the results (unordered).
async fn in_flight<T, F, Fut>(c: &Client, n: usize, op: F) -> Result<(f64, Vec<T>)>
where
    F: Fn(Client, usize) -> Fut + Send + Sync + 'static,
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
fn run_calix(
    g: &mut Guard,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    dir: &Path,
    datastore: &str,
    ids: &Ids,
) -> Result<Measured> {
    let client = start_agent(g, rt, bin, dir, datastore)?;
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
        let journal = std::fs::metadata(dir.join("store.json.journal"))
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
    let m = m.map_err(
        |e| match g.agent.as_mut().and_then(|a| a.try_wait().ok().flatten()) {
            Some(status) => {
                let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
                e.context(format!("calix-agent exited ({status}); its log:\n{log}"))
            }
            None => e,
        },
    );
    // SIGTERM now rather than at the next start: the agent is not running during other variants.
    g.stop_agent();
    m
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
fn processes_in_flight(p: &Plugin, calls: &[Call]) -> Result<f64> {
    let next = AtomicUsize::new(0);
    let t0 = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..IN_FLIGHT.min(calls.len()))
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(call) = calls.get(i) else {
                        return Ok(());
                    };
                    if let Err(e) = p.timed(call) {
                        next.store(calls.len(), Ordering::Relaxed);
                        return Err(e);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a worker panicked")))
            })
            .collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(wall)
}

/// One repetition of host-local, a process per call, in a fresh `data_dir`.
fn run_host_local(data_dir: &Path, ids: &Ids) -> Result<Measured> {
    let p = Plugin {
        label: "host-local",
        binary: Path::new(CNI_DIR).join("host-local"),
        node: None,
        conf: json!({
            "cniVersion": "1.0.0",
            "name": NETWORK,
            "type": "host-local",
            "ipam": {
                "type": "host-local",
                "ranges": [[{ "subnet": HOST_LOCAL_SUBNET }]],
                "dataDir": data_dir.display().to_string(),
            },
        })
        .to_string(),
    };
    // host-local never opens the namespace, but its ADD refuses to run without CNI_NETNS.
    let netns = format!("/proc/{}/ns/net", std::process::id());
    let calls = |command: &'static str, phase: &str, n: usize| -> Vec<Call<'static>> {
        (0..n)
            .map(|i| Call {
                command,
                container_id: ids.id(phase, i),
                netns: netns.clone(),
                args: String::new(),
            })
            .collect()
    };
    let timed_all = |calls: &[Call]| -> Result<(f64, Vec<f64>)> {
        let t0 = Instant::now();
        let lat = calls.iter().map(|c| p.timed(c)).collect::<Result<_>>()?;
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
    let conc_wall = processes_in_flight(&p, &calls("ADD", "c", ids.n))?;
    let held = host_local_held(data_dir)?;
    if held != ids.n {
        bail!(
            "host-local holds {held} addresses after {} concurrent ADDs",
            ids.n
        );
    }
    processes_in_flight(&p, &calls("DEL", "c", ids.n))?;
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
    /// Every call (ms), pooled.
    alloc_lat: Vec<f64>,
    rel_lat: Vec<f64>,
    /// calix: Status round trips (ms), pooled.
    rpc_lat: Vec<f64>,
    /// Per repetition p50s (ms).
    alloc_p50: Vec<f64>,
    rel_p50: Vec<f64>,
    rpc_p50: Vec<f64>,
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
        let (a50, a99) = (
            percentile(&m.alloc_lat, 50.0),
            percentile(&m.alloc_lat, 99.0),
        );
        let r50 = percentile(&m.rel_lat, 50.0);
        self.seq.push(seq);
        self.conc.push(conc);
        self.rel.push(rel);
        self.alloc_p50.push(a50);
        self.rel_p50.push(r50);
        if !m.rpc_lat.is_empty() {
            self.rpc_p50.push(percentile(&m.rpc_lat, 50.0));
        }
        self.rpc_lat.extend(m.rpc_lat);
        let k = (m.alloc_lat.len() / 10).max(1).min(m.alloc_lat.len());
        self.first_tenth.extend(&m.alloc_lat[..k]);
        self.last_tenth
            .extend(&m.alloc_lat[m.alloc_lat.len() - k..]);
        self.alloc_lat.extend(m.alloc_lat);
        self.rel_lat.extend(m.rel_lat);
        if let Some(j) = m.journal {
            self.journal_per_alloc.push(j as f64 / nf);
        }
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

    fn median(v: &[f64]) -> f64 {
        spread(v).0
    }
}

/// The floors over every repetition (ms per call).
#[derive(Default)]
struct Floors {
    truth: Vec<f64>,
    fsync: Vec<f64>,
    truth_p50: Vec<f64>,
    fsync_p50: Vec<f64>,
    load: Vec<f64>,
}

impl Floors {
    fn run(&mut self, dir: &Path, n: usize) -> Result<String> {
        use std::os::unix::fs::OpenOptionsExt;
        self.load.push(loadavg());
        let mut truth = Vec::with_capacity(n);
        for _ in 0..n {
            truth.push(timed_cmd(&mut Command::new("/bin/true"))?);
        }
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
            fsync.push(ms(t0.elapsed()));
        }
        drop(f);
        std::fs::remove_file(&path)?;
        let (t50, f50) = (percentile(&truth, 50.0), percentile(&fsync, 50.0));
        self.truth_p50.push(t50);
        self.fsync_p50.push(f50);
        self.truth.extend(truth);
        self.fsync.extend(fsync);
        Ok(format!(
            "/bin/true p50 {} ms, append {FSYNC_LINE} B + fdatasync p50 {} ms",
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
    util::require_root("the IPAM benchmark")?;
    if !(2..=MAX_ALLOCS).contains(&allocs) || reps < 1 {
        bail!("--allocs must be 2..={MAX_ALLOCS} and --reps at least 1");
    }
    for bin in [Path::new(CNI_DIR).join("host-local"), PathBuf::from(ETCD)] {
        if !bin.exists() {
            bail!(
                "{} is missing: install containernetworking-plugins and etcd-server (cargo xtask setup)",
                bin.display()
            );
        }
    }
    let t_start = Instant::now();
    // The revision the binaries are built from (read before the build, not after the run).
    let rev = git_rev(&util::workspace_root());
    println!("[setup] building release binaries (cargo build --release --workspace --bins)");
    let bins = util::build_bins_release()?;
    let agent_bin = bins.join("calix-agent");
    remove_stale();

    let dir = std::env::temp_dir().join(format!("{PREFIX}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut g = Guard {
        dir: dir.clone(),
        etcd: None,
        agent: None,
    };
    println!(
        "[setup] starting etcd on 127.0.0.1 (data in {})",
        dir.display()
    );
    let etcd_url = start_etcd(&mut g)?;
    println!("[setup] etcd at {etcd_url}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a tokio runtime")?;

    let mut floors = Floors::default();
    let mut res: [Samples; 3] = Default::default();
    for rep in 1..=reps {
        let line = floors.run(&dir, allocs)?;
        println!(
            "[rep {rep}/{reps}] floors (load {:.2}): {line}",
            floors.load.last().copied().unwrap_or(f64::NAN)
        );
        let mut order = VARIANTS;
        if rep % 2 == 0 {
            order.reverse();
        }
        for v in order {
            let load = loadavg();
            let ids = Ids {
                n: allocs,
                rep,
                tag: v.tag(),
            };
            let vdir = dir.join(format!("r{rep}-{}", v.tag()));
            let m = match v {
                Variant::Embedded => {
                    run_calix(&mut g, &rt, &agent_bin, &vdir, "type = \"embedded\"", &ids)
                }
                Variant::Etcd => run_calix(
                    &mut g,
                    &rt,
                    &agent_bin,
                    &vdir,
                    &format!(
                        "type = \"etcd\"\nendpoints = [\"{etcd_url}\"]\nprefix = \"/cxb/r{rep}/\""
                    ),
                    &ids,
                ),
                Variant::HostLocal => run_host_local(&vdir, &ids),
            }
            .with_context(|| format!("{} (repetition {rep})", v.label()))?;
            let _ = std::fs::remove_dir_all(&vdir);
            let s = &mut res[v as usize];
            s.load.push(load);
            let line = s.push(allocs, m);
            println!("[rep {rep}/{reps}] {} (load {load:.2}): {line}", v.label());
        }
    }
    drop(rt);
    drop(g);
    println!(
        "[done] measured in {:.0}s; etcd stopped, everything removed",
        t_start.elapsed().as_secs_f64()
    );

    let report = Report {
        allocs,
        reps,
        machine: Machine::read(),
        rev,
        plugins_version: cni_plugins_version(),
        etcd_version: output(Command::new(ETCD).arg("--version"))
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| {
                    l.strip_prefix("etcd Version:")
                        .map(|v| v.trim().to_string())
                })
            })
            .unwrap_or_else(|| "unknown".into()),
        res,
        floors,
    };
    let md = report.markdown();
    println!("\n{md}");
    let out = out_dir()?;
    std::fs::write(out.join("ipam.md"), &md)?;
    chart(&out.join("ipam.svg"), &report)?;
    println!(
        "wrote {} and {}",
        out.join("ipam.md").display(),
        out.join("ipam.svg").display()
    );
    Ok(())
}

// --- report --------------------------------------------------------------------------------

struct Report {
    allocs: usize,
    reps: usize,
    machine: Machine,
    rev: String,
    plugins_version: String,
    etcd_version: String,
    res: [Samples; 3],
    floors: Floors,
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
            p50_with_reps(percentile(&s.alloc_lat, 50.0), &s.alloc_p50),
            fmt_ms(percentile(&s.alloc_lat, 99.0)),
            p50_with_reps(percentile(&s.rel_lat, 50.0), &s.rel_p50),
            fmt_ms(percentile(&s.rel_lat, 99.0)),
            loads(&s.load),
        )
    }

    fn ratio_row(&self, v: Variant) -> String {
        let (c, h) = (self.get(v), self.get(Variant::HostLocal));
        let med = Samples::median;
        let pct = |s: &Samples, p: f64, rel: bool| {
            percentile(if rel { &s.rel_lat } else { &s.alloc_lat }, p)
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
        let m = &self.machine;
        let f = &self.floors;
        let n = self.allocs;
        let mut s = String::new();
        s.push_str("# IPAM allocations per second: calix (embedded, etcd) vs host-local\n\n");
        s.push_str(&format!(
            "Measured {} by `cargo xtask bench ipam --allocs {n} --reps {}` on {} × {} ({} CPUs), \
             kernel {}. calix {} (release build, `calix-agent --dataplane kernel`, pool \
             {CALIX_POOL} in /{BLOCK_SIZE} blocks); the etcd backend against etcd {} (one member on \
             127.0.0.1, data on the same disk); `host-local` from Debian's \
             containernetworking-plugins {} (a {HOST_LOCAL_SUBNET} range). Every datastore is \
             in /tmp, on the root ext4 disk.\n\n",
            m.date,
            self.reps,
            m.cpu,
            m.cpus,
            m.cpus,
            m.kernel,
            self.rev,
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
        for v in [Variant::Embedded, Variant::Etcd] {
            s.push_str(&self.ratio_row(v));
        }
        s.push_str(
            "\nRatios are calix / host-local: above 1× is faster for rates, below 1× is faster \
             for latencies.\n",
        );
        s.push_str(&format!(
            "\n- {IN_FLIGHT} in flight against sequential (median rates): {}.\n",
            self.per_variant(|x| ratio(Samples::median(&x.conc), Samples::median(&x.seq)))
        ));
        s.push_str(&format!(
            "- 1 / the {IN_FLIGHT}-in-flight rate (what an allocation costs once the RPC work \
             overlaps; calix: about the time it holds the agent's lock): {}.\n",
            self.per_variant(|x| format!("{} ms", fmt_ms(1e3 / Samples::median(&x.conc))))
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
                spread(journal).0
            ));
        }
        s.push_str("\nFloors, per call (the first two before the variants, load ");
        s.push_str(&loads(&f.load));
        s.push_str("; the gRPC ones in each calix run, before its allocations):\n\n");
        s.push_str("| floor | p50 | p99 |\n|---|---|---|\n");
        for (label, all, reps) in [
            (
                "fork+exec `/bin/true`, timed fork-to-exit (what every host-local call pays \
                 first)"
                    .to_string(),
                &f.truth,
                &f.truth_p50,
            ),
            (
                format!(
                    "append {FSYNC_LINE} B + `fdatasync` in /tmp (the least a durable \
                     allocation pays)"
                ),
                &f.fsync,
                &f.fsync_p50,
            ),
        ]
        .into_iter()
        .chain([Variant::Embedded, Variant::Etcd].map(|v| {
            let x = self.get(v);
            (
                format!(
                    "`calix.v1.Ipam/Status` round trip, {} agent (no datastore access: the \
                     gRPC floor of every call)",
                    v.label().trim_start_matches("calix, ")
                ),
                &x.rpc_lat,
                &x.rpc_p50,
            )
        })) {
            s.push_str(&format!(
                "| {label} | {} | {} ms |\n",
                p50_with_reps(percentile(all, 50.0), reps),
                fmt_ms(percentile(all, 99.0))
            ));
        }
        s.push_str(
            "\nWhat each allocation does. calix: one gRPC call; the agent takes its IPAM lock, \
             reads the handle key, picks an address in its in-memory block view and commits \
             the block and the handle record in one compare-and-swap transaction; embedded: one \
             journal append + `fdatasync` (releases append without fsync); etcd: a \
             range and a txn round trip to etcd, which fsyncs its Raft WAL for every write \
             (releases too). Allocations are serialized on the agent's lock, so calls in flight \
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
    use plotters::prelude::*;
    let root = super::chart_root(
        path,
        (900, 460),
        &format!(
            "IPAM allocations/s, calix vs host-local ({} allocations × {} reps, {})",
            r.allocs, r.reps, r.machine.date
        ),
    )?;
    let colors = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0xff, 0x7f, 0x0e),
    ];
    let rates = |s: &Samples| {
        vec![
            Some(Samples::median(&s.seq)),
            Some(Samples::median(&s.conc)),
        ]
    };
    let series: Vec<_> = VARIANTS
        .iter()
        .zip(colors)
        .map(|(&v, c)| (v.label(), c, rates(r.get(v))))
        .collect();
    let host_local = rates(r.get(Variant::HostLocal));
    let label = |si: usize, gi: usize, v: f64| {
        if VARIANTS[si] == Variant::HostLocal {
            fmt_rate(v)
        } else {
            let reference = host_local[gi].unwrap_or(f64::NAN);
            format!("{} ({})", fmt_rate(v), ratio(v, reference))
        }
    };
    panel(
        &root,
        "allocations per second (median); calix labels: ratio to host-local",
        "allocations/s",
        &["sequential", &format!("{IN_FLIGHT} in flight")],
        &series,
        &label,
        None,
    )?;
    root.present()?;
    Ok(())
}
