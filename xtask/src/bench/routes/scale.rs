//! Scale: one real agent (release build, eBPF dataplane) taking 100 simulated peers × 100
//! blocks each, in a full mesh and through one reflector.
//!
//! Per repetition and topology, a fresh two-node cluster of the test bed (real etcd): node 0
//! runs the agent; node 1's namespace runs `calix-routesim` (the `calix-routesim` crate: each
//! simulated peer a `calix.v1.Routes` server of the agent's own code with a certificate of its
//! own, mutual TLS), which writes the 10,000 blocks to etcd and listens first, then — on cue —
//! the peers' node records. Two phases:
//! - **peers join**: the agent runs and has settled (and has read the blocks); the clock starts
//!   when the records are cued ("the peers appear") and stops when the 10,000th route to a
//!   node is in node 0's kernel (a netlink listener in its namespace, no polling);
//! - **agent restart**: the agent stopped (SIGTERM: its routes stay), its routes flushed by
//!   hand, started again on a datastore that has it all; the clock runs from its spawn to the
//!   10,000th route in the kernel.
//!
//! Measured on the agent's process: resident memory at its peak (`VmHWM`) and a second after
//! (`VmRSS`), CPU time (utime + stime, all threads) over the clock's run, and `ip route show
//! proto 202` counted at the end.
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::cpu::{load_average, ProcessUsage};
use calix_testbed::{Cluster, Dataplane, Netns};

use super::super::harness::{check_interrupted, order, Bench};
use super::super::routewatch::RouteWatch;
use crate::util::output;

pub const PEERS: u32 = 100;
pub const BLOCKS: u32 = 100;
const ROUTES: usize = (PEERS * BLOCKS) as usize;
/// Where the simulated blocks come from (the agent's pool too).
const POOL: &str = "10.240.0.0/12";
/// Peer k's address is 172.31.1.(100 + k): on node 0's subnet, so its routes are direct.
const FIRST_HOP: &str = "172.31.1.100";
const REFLECTOR: &str = "172.31.1.99:6999";
const FIRST_PORT: u16 = 6000;
/// How long the 10,000 routes may take before the run fails.
const LIMIT: Duration = Duration::from_secs(60);
const CA_NAME: &str = "calix-bench-ca";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Topology {
    Mesh,
    Reflector,
}

pub const TOPOLOGIES: [Topology; 2] = [Topology::Mesh, Topology::Reflector];

impl Topology {
    pub fn label(self) -> &'static str {
        match self {
            Self::Mesh => "full mesh (100 streams)",
            Self::Reflector => "one reflector (1 stream)",
        }
    }

    fn config(self) -> &'static str {
        match self {
            Self::Mesh => "mesh",
            Self::Reflector => "reflectors",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::Mesh => "sm",
            Self::Reflector => "sr",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Phase {
    Join,
    Restart,
}

pub const PHASES: [Phase; 2] = [Phase::Join, Phase::Restart];

impl Phase {
    pub fn label(self) -> &'static str {
        match self {
            Self::Join => "peers join",
            Self::Restart => "agent restart",
        }
    }
}

/// One phase's measurements over every repetition.
#[derive(Default)]
pub struct Samples {
    /// From the clock's start to the 10,000th route in the kernel (s).
    pub secs: Vec<f64>,
    /// The agent's CPU time over that (s).
    pub cpu: Vec<f64>,
    /// Its peak resident memory, and a second after the last route: all, anonymous, file
    /// pages (MiB).
    pub peak_mib: Vec<f64>,
    pub rss_mib: Vec<f64>,
    pub anon_mib: Vec<f64>,
    pub file_mib: Vec<f64>,
    /// Peers joining: its resident memory before, idle (a second after its start) and once it
    /// had read the 10,000 blocks (MiB).
    pub idle_mib: Vec<f64>,
    pub blocks_mib: Vec<f64>,
    /// `ip route show proto 202` lines at the end.
    pub kernel_routes: Vec<f64>,
}

/// One agent's measurements: per topology, per phase.
#[derive(Default)]
pub struct Runs {
    /// Which agent: this build, or a baseline's revision.
    pub label: String,
    pub res: [[Samples; 2]; 2],
}

/// An agent to measure: what the report calls it, where its binaries are.
pub struct Agent {
    pub label: String,
    pub bins: PathBuf,
}

/// Each agent's runs (this build first, then the baseline if any); and the simulator's etcd
/// writes (blocks, records; ms).
#[derive(Default)]
pub struct Results {
    pub runs: Vec<Runs>,
    pub blocks_ms: Vec<f64>,
    pub records_ms: Vec<f64>,
    /// The 1-minute load average before each phase.
    pub load: Vec<f64>,
}

/// The simulator process: its stdout lines as they come, its stdin to cue it. Killed on drop.
struct Simulator {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Simulator {
    /// `calix-routesim` in `ns` for `topology`, dialed at `host`, letting `agent` watch from
    /// `agent_address`.
    fn start(
        b: &Bench,
        ns: &Netns,
        etcd: &str,
        host: &str,
        t: Topology,
        (agent, agent_address): (&str, &str),
    ) -> Result<Self> {
        let ca_dir = b.dir.join("ca");
        let mut cmd = ns.daemon(b.bins.join("calix-routesim"), None)?;
        cmd.args(["--etcd", etcd, "--ca-name", CA_NAME, "--pool", POOL])
            .args(["--first-hop", FIRST_HOP, "--host", host, "--known", agent])
            .args(["--known-address", agent_address])
            .arg("--ca-dir")
            .arg(&ca_dir)
            .args([
                "--peers",
                &PEERS.to_string(),
                "--blocks",
                &BLOCKS.to_string(),
            ])
            .args(["--first-port", &FIRST_PORT.to_string()]);
        if t == Topology::Reflector {
            cmd.args(["--reflector", REFLECTOR]);
        }
        let log = b.dir.join(format!("{}-routesim.log", ns.name));
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting calix-routesim")?;
        let stdout = child.stdout.take().context("its stdout")?;
        let stdin = child.stdin.take();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            lines,
        })
    }

    /// Waits for a line starting with `word`; the number after it.
    fn expect(&mut self, word: &str, timeout: Duration) -> Result<f64> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => line
                .strip_prefix(word)
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| anyhow!("calix-routesim said {line:?}, expected {word} <ms>")),
            Err(RecvTimeoutError::Timeout) => bail!("calix-routesim: no {word} within {timeout:?}"),
            Err(RecvTimeoutError::Disconnected) => {
                let st = self.child.wait()?;
                bail!("calix-routesim exited ({st}) before {word}")
            }
        }
    }

    fn announce(&mut self) -> Result<()> {
        let stdin = self.stdin.as_mut().context("calix-routesim's stdin")?;
        stdin.write_all(b"announce\n")?;
        Ok(stdin.flush()?)
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        // EOF on stdin stops it; killed if it does not.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn usage(pid: Option<u32>) -> Result<ProcessUsage> {
    pid.and_then(ProcessUsage::read)
        .context("the agent is not running")
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// calix's routes in `ns`'s main table, as `ip route show proto 202` lists them.
fn kernel_routes(ns: &Netns) -> Result<usize> {
    let out = output(
        std::process::Command::new("ip")
            .args(["-n", &ns.name, "-4", "route", "show", "proto", "202"]),
    )?;
    Ok(out.lines().filter(|l| !l.trim().is_empty()).count())
}

/// Waits for the 10,000th route on `watch` from `t0`, then records the phase.
fn finish(
    c: &Cluster,
    watch: &RouteWatch,
    t0: Instant,
    cpu0: f64,
    s: &mut Samples,
) -> Result<String> {
    let done = watch.until_count(ROUTES, LIMIT)?.ok_or_else(|| {
        anyhow!(
            "{} of {ROUTES} routes in the kernel after {LIMIT:?}",
            watch.count()
        )
    })?;
    let agent = c.nodes[0].agent();
    let at_done = usage(agent.pid())?;
    std::thread::sleep(Duration::from_secs(1));
    let after = usage(agent.pid())?;
    let secs = done.saturating_duration_since(t0).as_secs_f64();
    let cpu = at_done.cpu_secs - cpu0;
    let routes = kernel_routes(&c.nodes[0].ns)?;
    s.secs.push(secs);
    s.cpu.push(cpu);
    s.peak_mib.push(mib(after.peak_rss_kib));
    s.rss_mib.push(mib(after.rss_kib));
    s.anon_mib.push(mib(after.rss_anon_kib));
    s.file_mib.push(mib(after.rss_file_kib));
    s.kernel_routes.push(routes as f64);
    if routes != ROUTES {
        bail!("{routes} routes of protocol 202 in the kernel, expected {ROUTES}");
    }
    Ok(format!(
        "{ROUTES} routes in the kernel after {:.0} ms, agent CPU {cpu:.2} s, peak RSS {:.1} MiB, \
         RSS {:.1} MiB ({:.1} anonymous, {:.1} file)",
        secs * 1e3,
        mib(after.peak_rss_kib),
        mib(after.rss_kib),
        mib(after.rss_anon_kib),
        mib(after.rss_file_kib),
    ))
}

/// One repetition of topology `t`: both phases on a fresh cluster.
fn one(
    b: &Bench,
    ca: &Ca,
    rep: usize,
    t: Topology,
    (a, bins): (usize, &Path),
    r: &mut Results,
) -> Result<()> {
    let tag = format!("{}{a}{rep}", t.tag());
    let mut spec = b.spec(Dataplane::Ebpf);
    spec.bins = bins.to_path_buf();
    let mut c = Cluster::launch_with(
        || b.name(&format!("{tag}-u")),
        |i| b.name(&format!("{tag}-n{i}")),
        spec,
        &[1, 1],
        |_, _| String::new(),
    )?;
    c.configure(|i, c| {
        let topology = format!("topology = \"{}\"", t.config());
        Ok(format!(
            "{}[[pools]]\ncidr = \"{POOL}\"\n{}",
            c.base_config(i),
            c.routes_config(i, ca, &topology)?
        ))
    })?;
    let agent = c.nodes[0].agent();
    agent.start(&[])?;
    std::thread::sleep(Duration::from_secs(1));
    let idle = usage(agent.pid())?;
    let watch = RouteWatch::start(&c.nodes[0].ns)?;
    let mut sim = Simulator::start(
        b,
        &c.nodes[1].ns,
        &c.etcd_url(1),
        &c.address(1),
        t,
        (c.name(0), &c.address(0)),
    )?;
    r.blocks_ms
        .push(sim.expect("ready", Duration::from_secs(300))?);
    // Until the agent has read the blocks (its datastore watch) and is idle again.
    std::thread::sleep(Duration::from_secs(2));
    let with_blocks = usage(agent.pid())?;
    let join = &mut r.runs[a].res[t as usize][Phase::Join as usize];
    join.idle_mib.push(mib(idle.rss_kib));
    join.blocks_mib.push(mib(with_blocks.rss_kib));
    let cpu0 = with_blocks.cpu_secs;
    r.load.push(load_average());
    let t0 = Instant::now();
    sim.announce()?;
    r.records_ms.push(sim.expect("announced", LIMIT)?);
    let line = finish(
        &c,
        &watch,
        t0,
        cpu0,
        &mut r.runs[a].res[t as usize][Phase::Join as usize],
    )?;
    println!(
        "[rep {}] {}, {}, {}: {line}",
        rep + 1,
        r.runs[a].label,
        t.label(),
        Phase::Join.label()
    );

    check_interrupted()?;
    agent.stop();
    c.nodes[0].ns.ip("route flush proto 202")?;
    // Until the watch has read the flush's deletions.
    let deadline = Instant::now() + Duration::from_secs(5);
    while watch.count() != 0 {
        if Instant::now() > deadline {
            bail!("{} routes left after the flush", watch.count());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    r.load.push(load_average());
    let t0 = Instant::now();
    agent.spawn(&[])?;
    let line = finish(
        &c,
        &watch,
        t0,
        0.0,
        &mut r.runs[a].res[t as usize][Phase::Restart as usize],
    )?;
    println!(
        "[rep {}] {}, {}, {}: {line}",
        rep + 1,
        r.runs[a].label,
        t.label(),
        Phase::Restart.label()
    );
    drop(sim);
    Ok(())
}

/// Runs the scale part: `reps` repetitions of both topologies, alternating, each with every
/// agent of `agents` (this build first), alternating too.
pub fn run(b: &Bench, ca: &Ca, reps: usize, agents: &[Agent]) -> Result<Results> {
    ca.save(&b.dir.join("ca"))?;
    let mut r = Results {
        runs: agents
            .iter()
            .map(|a| Runs {
                label: a.label.clone(),
                ..Runs::default()
            })
            .collect(),
        ..Results::default()
    };
    let indexes: Vec<usize> = (0..agents.len()).collect();
    for rep in 0..reps {
        for (k, t) in order(&TOPOLOGIES, rep, false).into_iter().enumerate() {
            for a in order(&indexes, rep + k, false) {
                check_interrupted()?;
                println!(
                    "[setup] scale, {}, {}: a 2-node cluster, {PEERS} simulated peers × \
                     {BLOCKS} blocks",
                    agents[a].label,
                    t.label()
                );
                one(b, ca, rep, t, (a, &agents[a].bins), &mut r).with_context(|| {
                    format!(
                        "{}, {} (repetition {})",
                        agents[a].label,
                        t.label(),
                        rep + 1
                    )
                })?;
            }
        }
    }
    Ok(r)
}

/// The CA's name, for the routes config's certificates.
pub fn ca() -> Result<Ca> {
    Ok(Ca::new(CA_NAME)?)
}
