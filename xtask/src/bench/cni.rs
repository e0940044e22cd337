//! `cargo xtask bench cni`: CNI ADD and DEL latency, calix against Debian's reference `ptp` +
//! `host-local`, with the floors next to them, in one run (DESIGN.md §10).
//!
//! Every plugin call is exec'd the way a runtime in the node's namespace does it (fork, `setns`
//! into the node namespace, exec `<plugin>` with a
//! clean CNI environment and the network config on stdin) and timed fork-to-exit. Each variant
//! has its own node namespace (calix: with a release `calix-agent`, eBPF dataplane); the pod
//! namespaces are created once, before any timing, and shared: every phase leaves them empty.
//!
//! One repetition runs, in order: the floors (`/bin/true`, `/bin/true` exec'd into the node
//! namespace, `ip link del <veth>` exec'd into the node namespace over pre-created pod-like veths: peer in a pod
//! namespace, both ends up, an address and a /32 route), then calix and ptp in an
//! order that alternates between repetitions. Per variant: the load average, `pods` sequential
//! ADDs, `pods` sequential DELs, then 20 and 50 concurrent ADDs (wall time; cleaned up by
//! concurrent DELs, untimed).
//!
//! Writes docs/bench/cni.md and docs/bench/cni.svg. Everything it creates is named `cxb-<pid>-…`
//! and removed on drop, on error too.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

use super::{
    cni_plugins_version, fmt_ms, fmt_spread, git_rev, in_netns, load_note, loadavg, loads, out_dir,
    p50_with_reps, panel, percentile, ratio, spread, stop_child, timed_cmd, wait_ready, Call,
    Machine, Plugin, CNI_DIR,
};
use crate::util::{self, output, run as run_cmd};

const PREFIX: &str = "cxb";
const NODE_IP: &str = "10.99.0.1";
const CALIX_POOL: &str = "10.244.0.0/16";
const PTP_SUBNET: &str = "10.245.0.0/16";
const CONCURRENCY: [usize; 2] = [20, 50];

/// Everything the bench created; removed on drop (error or panic included).
struct Guard {
    prefix: String,
    dir: PathBuf,
    namespaces: Vec<String>,
    agent: Option<Child>,
}

impl Guard {
    /// Creates namespaces `<prefix>-<name>` in one `ip -batch`.
    fn netns(&mut self, names: &[String]) -> Result<Vec<String>> {
        let full: Vec<String> = names
            .iter()
            .map(|n| format!("{}-{n}", self.prefix))
            .collect();
        let script: String = full.iter().map(|n| format!("netns add {n}\n")).collect();
        // Recorded first: a half-done batch is still cleaned up.
        self.namespaces.extend(full.iter().cloned());
        ip_batch(None, &script)?;
        Ok(full)
    }

    fn stop_agent(&mut self) {
        // `ip netns exec` execs the agent: the child pid is the agent's. SIGTERM first so it
        // detaches its programs and removes its socket.
        if let Some(a) = self.agent.take() {
            stop_child(a);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop_agent();
        if !self.namespaces.is_empty() {
            let script: String = self
                .namespaces
                .iter()
                .rev()
                .map(|n| format!("netns del {n}\n"))
                .collect();
            if ip_batch(None, &script).is_err() {
                for n in &self.namespaces {
                    let _ = Command::new("ip")
                        .args(["netns", "del", n])
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(BENCH_PIN_ROOT);
    }
}

/// The target the plugin is built for: musl, a static executable (`cargo xtask setup` adds it).
const STATIC_TARGET: &str = crate::setup::MUSL_TARGET;

/// Builds the plugin the way it ships: a static musl executable. A CNI plugin is a process per
/// call, so its start-up is per-call cost: the dynamic glibc build spent ~0.8 ms of CPU per ADD
/// in the loader (three libraries, relocations, libgcc_s's CPUID probes, each a VM exit on a
/// virtual machine), and a static glibc build still ~0.2 ms more than musl in glibc's start-up
/// CPUID probing of the cache sizes (docs/decisions.md, "CNI concurrency"). `--target` keeps
/// the build in its own directory.
pub fn build_static_plugin() -> Result<PathBuf> {
    let root = util::workspace_root();
    run_cmd(Command::new(env!("CARGO")).current_dir(&root).args([
        "build",
        "--release",
        "-p",
        "calix-cni",
        "--bin",
        "calix",
        "--target",
        STATIC_TARGET,
    ]))?;
    Ok(root
        .join("target")
        .join(STATIC_TARGET)
        .join("release")
        .join("calix"))
}

/// bpffs directory of the bench agent's pins (removed at the end).
const BENCH_PIN_ROOT: &str = "/sys/fs/bpf/cxb-bench";

/// Runs `ip [-n ns] -force -batch -` with `script` on stdin.
fn ip_batch(ns: Option<&str>, script: &str) -> Result<()> {
    let mut c = Command::new("ip");
    if let Some(ns) = ns {
        c.args(["-n", ns]);
    }
    let mut child = c
        .args(["-force", "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run ip -batch")?;
    if let Some(mut si) = child.stdin.take() {
        si.write_all(script.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "ip -batch failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Removes namespaces left by an earlier bench run that died without cleaning up.
fn remove_stale() -> Result<()> {
    for line in output(Command::new("ip").args(["netns", "list"]))?.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.strip_prefix('-'))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            println!("      removing stale namespace {name}");
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
    Ok(())
}

impl Plugin {
    /// The `veth` links left in the node namespace (there must be none between phases).
    fn leftover_veths(&self) -> Result<usize> {
        let node = self.node.as_deref().context("no node namespace")?;
        let out =
            output(Command::new("ip").args(["-n", node, "-o", "link", "show", "type", "veth"]))?;
        Ok(out.lines().filter(|l| !l.trim().is_empty()).count())
    }
}

fn pod_call(command: &str, rep: usize, tag: &str, i: usize, pod_ns: &str) -> Call<'static> {
    let command: &'static str = match command {
        "ADD" => "ADD",
        _ => "DEL",
    };
    let container_id = format!("{PREFIX}{rep}{tag}{i:04}0123456789abcdef");
    Call {
        command,
        args: format!(
            "K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID=00000000-0000-0000-0000-{i:012};\
             IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-{tag}-{i}"
        ),
        container_id,
        netns: format!("/run/netns/{pod_ns}"),
    }
}

/// What one variant measured over every repetition.
#[derive(Default)]
struct Samples {
    add: Vec<f64>,
    del: Vec<f64>,
    add_p50: Vec<f64>,
    del_p50: Vec<f64>,
    conc: [Vec<f64>; 2],
    load: Vec<f64>,
}

/// The floors over every repetition.
#[derive(Default)]
struct Floors {
    truth: Vec<f64>,
    nsexec: Vec<f64>,
    link_del: Vec<f64>,
    truth_p50: Vec<f64>,
    nsexec_p50: Vec<f64>,
    link_del_p50: Vec<f64>,
    load: Vec<f64>,
}

fn run_floors(f: &mut Floors, floor_node: &str, pods: &[String], n: usize) -> Result<()> {
    f.load.push(loadavg());
    let mut truth = Vec::with_capacity(n);
    for _ in 0..n {
        truth.push(timed_cmd(&mut Command::new("/bin/true"))?);
    }
    let mut nsexec = Vec::with_capacity(n);
    for _ in 0..n {
        nsexec.push(timed_cmd(&mut in_netns(
            Path::new("/bin/true"),
            floor_node,
        )?)?);
    }
    // Veths like a pod's, set up untimed: the peer in the pod's namespace, both ends up, an
    // address on the pod end and a /32 scope-link route on the host end.
    let addr = |i: usize| format!("10.246.{}.{}", (i + 1) / 256, (i + 1) % 256);
    let script: String = pods[..n]
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "link add cxbf{i} type veth peer name eth0 netns {p}\nlink set cxbf{i} up\n\
                 route add {}/32 dev cxbf{i} scope link\n",
                addr(i)
            )
        })
        .collect();
    ip_batch(Some(floor_node), &script)?;
    for (i, p) in pods[..n].iter().enumerate() {
        ip_batch(
            Some(p),
            &format!("addr add {}/32 dev eth0\nlink set eth0 up\n", addr(i)),
        )?;
    }
    let mut del = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("cxbf{i}");
        del.push(timed_cmd(
            in_netns(Path::new("/usr/sbin/ip"), floor_node)?.args(["link", "del", &name]),
        )?);
    }
    f.truth_p50.push(percentile(&truth, 50.0));
    f.nsexec_p50.push(percentile(&nsexec, 50.0));
    f.link_del_p50.push(percentile(&del, 50.0));
    f.truth.extend(truth);
    f.nsexec.extend(nsexec);
    f.link_del.extend(del);
    Ok(())
}

fn run_variant(
    p: &Plugin,
    tag: &str,
    s: &mut Samples,
    rep: usize,
    pods: &[String],
    n: usize,
) -> Result<String> {
    let load = loadavg();
    s.load.push(load);
    let mut add = Vec::with_capacity(n);
    for (i, ns) in pods[..n].iter().enumerate() {
        add.push(p.timed(&pod_call("ADD", rep, tag, i, ns))?);
    }
    let mut del = Vec::with_capacity(n);
    for (i, ns) in pods[..n].iter().enumerate() {
        del.push(p.timed(&pod_call("DEL", rep, tag, i, ns))?);
    }
    let left = p.leftover_veths()?;
    if left != 0 {
        bail!("{}: {left} veth(s) left in the node after DEL", p.label);
    }
    let mut walls = [0.0; 2];
    for (k, &c) in CONCURRENCY.iter().enumerate() {
        let ctag = format!("{tag}c{c}x");
        let adds: Vec<Call> = (0..c)
            .map(|i| pod_call("ADD", rep, &ctag, i, &pods[i]))
            .collect();
        let wall = p.concurrent(&adds);
        let dels: Vec<Call> = (0..c)
            .map(|i| pod_call("DEL", rep, &ctag, i, &pods[i]))
            .collect();
        // Clean up even when an ADD failed (DEL is idempotent).
        let cleaned = p.concurrent(&dels);
        walls[k] = wall?;
        cleaned?;
        s.conc[k].push(walls[k]);
    }
    let left = p.leftover_veths()?;
    if left != 0 {
        bail!(
            "{}: {left} veth(s) left in the node after the concurrent DELs",
            p.label
        );
    }
    let (a50, a99, d50, d99) = (
        percentile(&add, 50.0),
        percentile(&add, 99.0),
        percentile(&del, 50.0),
        percentile(&del, 99.0),
    );
    s.add_p50.push(a50);
    s.del_p50.push(d50);
    s.add.extend(add);
    s.del.extend(del);
    Ok(format!(
        "{} (load {load:.2}): ADD p50 {} p99 {} ms, DEL p50 {} p99 {} ms, 20×ADD {} ms, 50×ADD {} ms",
        p.label,
        fmt_ms(a50),
        fmt_ms(a99),
        fmt_ms(d50),
        fmt_ms(d99),
        fmt_ms(walls[0]),
        fmt_ms(walls[1]),
    ))
}

fn start_agent(g: &mut Guard, agent: &Path, ctl: &Path, node: &str) -> Result<PathBuf> {
    let socket = g.dir.join("agent.sock");
    let log_path = g.dir.join("agent.log");
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new("ip")
        .args(["netns", "exec", node])
        .arg(agent)
        .args([
            "--node-name",
            "cxb-node",
            "--pool",
            CALIX_POOL,
            "--dataplane",
            "ebpf",
            "--log-level",
            "info",
        ])
        .arg("--socket")
        .arg(&socket)
        .arg("--datastore-path")
        .arg(g.dir.join("store.json"))
        .arg("--bpf-pin-root")
        .arg(BENCH_PIN_ROOT)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("cannot start calix-agent")?;
    let agent = g.agent.insert(child);
    wait_ready(
        "calix-agent",
        agent,
        &log_path,
        Duration::from_secs(20),
        || {
            Command::new("ip")
                .args(["netns", "exec", node])
                .arg(ctl)
                .arg("--socket")
                .arg(&socket)
                .arg("endpoints")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        },
    )?;
    Ok(socket)
}

pub fn run(pods: usize, reps: usize) -> Result<()> {
    util::require_root("the CNI benchmark")?;
    if pods < 2 || reps < 1 {
        bail!("--pods must be at least 2 and --reps at least 1");
    }
    let t_start = Instant::now();
    println!("[setup] prerequisites (cargo xtask setup)");
    crate::setup::run()?;
    for bin in ["ptp", "host-local"] {
        let p = Path::new(CNI_DIR).join(bin);
        if !p.exists() {
            bail!(
                "{} is missing: install containernetworking-plugins (cargo xtask setup)",
                p.display()
            );
        }
    }
    // The revision the binaries are built from (read before the build, not after the run).
    let rev = git_rev(&util::workspace_root());
    println!("[setup] building release binaries (cargo build --release --workspace --bins)");
    let bins = util::build_bins_release()?;
    println!("[setup] building the static plugin (--target {STATIC_TARGET})");
    let plugin = build_static_plugin()?;
    remove_stale()?;

    let prefix = format!("{PREFIX}-{}", std::process::id());
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    let mut g = Guard {
        prefix,
        dir: dir.clone(),
        namespaces: Vec::new(),
        agent: None,
    };

    let n_ns = pods.max(CONCURRENCY[1]);
    println!(
        "[setup] {} node namespaces (calix, ptp, floor) and {n_ns} pod namespaces",
        3
    );
    let nodes = g.netns(&["calix".into(), "ptp".into(), "floor".into()])?;
    let (calix_node, ptp_node, floor_node) = (nodes[0].clone(), nodes[1].clone(), nodes[2].clone());
    for n in &nodes {
        ip_batch(
            Some(n),
            &format!("link set lo up\naddr add {NODE_IP}/32 dev lo\n"),
        )?;
    }
    let pod_names: Vec<String> = (0..n_ns).map(|i| format!("p{i}")).collect();
    let pod_ns = g.netns(&pod_names)?;
    // lo up in every pod namespace, as a runtime's loopback plugin would.
    for p in &pod_ns {
        run_cmd(Command::new("ip").args(["-n", p, "link", "set", "lo", "up"]))?;
    }

    println!("[setup] starting calix-agent (release, eBPF dataplane) in {calix_node}");
    let socket = start_agent(
        &mut g,
        &bins.join("calix-agent"),
        &bins.join("calixctl"),
        &calix_node,
    )?;
    let calix = Plugin {
        label: "calix",
        binary: plugin,
        node: Some(calix_node.clone()),
        conf: json!({
            "cniVersion": "1.0.0",
            "name": "cxb-calix",
            "type": "calix",
            "mtu": 1500,
            "ipam": { "type": "calix-ipam" },
            "agent_socket": socket.display().to_string(),
        })
        .to_string(),
    };
    let ptp = Plugin {
        label: "ptp + host-local",
        binary: Path::new(CNI_DIR).join("ptp"),
        node: Some(ptp_node.clone()),
        conf: json!({
            "cniVersion": "1.0.0",
            "name": "cxb-ptp",
            "type": "ptp",
            "ipMasq": false,
            "mtu": 1500,
            "ipam": {
                "type": "host-local",
                "subnet": PTP_SUBNET,
                "routes": [{ "dst": "0.0.0.0/0" }],
                "dataDir": dir.join("host-local").display().to_string(),
            },
        })
        .to_string(),
    };

    // One untimed warm-up call of each (page cache, the agent's first connection).
    for (p, tag) in [(&calix, "w"), (&ptp, "w")] {
        p.timed(&pod_call("ADD", 0, tag, 0, &pod_ns[0]))?;
        p.timed(&pod_call("DEL", 0, tag, 0, &pod_ns[0]))?;
    }

    let mut floors = Floors::default();
    let mut res = [Samples::default(), Samples::default()];
    let variants = [&calix, &ptp];
    for rep in 0..reps {
        run_floors(&mut floors, &floor_node, &pod_ns, pods)?;
        println!(
            "[rep {}/{reps}] floors (load {:.2}): /bin/true p50 {} ms, /bin/true in node netns p50 {} ms, ip link del p50 {} ms",
            rep + 1,
            floors.load.last().copied().unwrap_or(f64::NAN),
            fmt_ms(floors.truth_p50[rep]),
            fmt_ms(floors.nsexec_p50[rep]),
            fmt_ms(floors.link_del_p50[rep]),
        );
        let order: [usize; 2] = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for v in order {
            let tag = if v == 0 { "c" } else { "p" };
            let line = run_variant(variants[v], tag, &mut res[v], rep + 1, &pod_ns, pods)?;
            println!("[rep {}/{reps}] {line}", rep + 1);
        }
    }
    drop(g);
    println!(
        "[done] measured in {:.0}s; everything removed",
        t_start.elapsed().as_secs_f64()
    );

    let machine = Machine::read();
    let report = Report {
        pods,
        reps,
        machine,
        rev,
        plugins_version: cni_plugins_version(),
        calix: res[0].summary(),
        ptp: res[1].summary(),
        floors,
        loads: [res[0].load.clone(), res[1].load.clone()],
    };
    let md = report.markdown();
    println!("\n{md}");
    let out_dir = out_dir()?;
    std::fs::write(out_dir.join("cni.md"), &md)?;
    chart(&out_dir.join("cni.svg"), &report)?;
    println!(
        "wrote {} and {}",
        out_dir.join("cni.md").display(),
        out_dir.join("cni.svg").display()
    );
    Ok(())
}

/// One variant's numbers: pooled percentiles, and the per-repetition spread.
struct Summary {
    add_p50: f64,
    add_p99: f64,
    del_p50: f64,
    del_p99: f64,
    add_p50_reps: Vec<f64>,
    del_p50_reps: Vec<f64>,
    conc: [Vec<f64>; 2],
}

impl Samples {
    fn summary(&self) -> Summary {
        Summary {
            add_p50: percentile(&self.add, 50.0),
            add_p99: percentile(&self.add, 99.0),
            del_p50: percentile(&self.del, 50.0),
            del_p99: percentile(&self.del, 99.0),
            add_p50_reps: self.add_p50.clone(),
            del_p50_reps: self.del_p50.clone(),
            conc: self.conc.clone(),
        }
    }
}

impl Summary {
    fn conc_median(&self, k: usize) -> f64 {
        spread(&self.conc[k]).0
    }
}

struct Report {
    pods: usize,
    reps: usize,
    machine: Machine,
    rev: String,
    plugins_version: String,
    calix: Summary,
    ptp: Summary,
    floors: Floors,
    loads: [Vec<f64>; 2],
}

impl Report {
    fn row(&self, label: &str, s: &Summary, load: &[f64]) -> String {
        format!(
            "| {label} | {} | {} ms | {} | {} ms | {} | {} | {} |\n",
            p50_with_reps(s.add_p50, &s.add_p50_reps),
            fmt_ms(s.add_p99),
            p50_with_reps(s.del_p50, &s.del_p50_reps),
            fmt_ms(s.del_p99),
            fmt_spread(&s.conc[0]),
            fmt_spread(&s.conc[1]),
            loads(load),
        )
    }

    fn link_del_p50(&self) -> f64 {
        percentile(&self.floors.link_del, 50.0)
    }

    fn targets(&self) -> Vec<(String, bool)> {
        let (c, p) = (&self.calix, &self.ptp);
        let floor = self.link_del_p50();
        vec![
            (
                format!(
                    "ADD p50 ≤ 0.5× ptp's: {} ms vs {} ms",
                    fmt_ms(c.add_p50),
                    fmt_ms(0.5 * p.add_p50)
                ),
                c.add_p50 <= 0.5 * p.add_p50,
            ),
            (
                format!(
                    "ADD p99 ≤ ptp's p50: {} ms vs {} ms",
                    fmt_ms(c.add_p99),
                    fmt_ms(p.add_p50)
                ),
                c.add_p99 <= p.add_p50,
            ),
            (
                format!(
                    "20 concurrent ADDs ≤ 0.5× ptp's wall: {} ms vs {} ms",
                    fmt_ms(c.conc_median(0)),
                    fmt_ms(0.5 * p.conc_median(0))
                ),
                c.conc_median(0) <= 0.5 * p.conc_median(0),
            ),
            (
                format!(
                    "DEL p50 ≤ 1.1× the `ip link del` floor: {} ms vs {} ms",
                    fmt_ms(c.del_p50),
                    fmt_ms(1.1 * floor)
                ),
                c.del_p50 <= 1.1 * floor,
            ),
        ]
    }

    fn markdown(&self) -> String {
        let m = &self.machine;
        let (c, p) = (&self.calix, &self.ptp);
        let f = &self.floors;
        let floor = self.link_del_p50();
        let mut s = String::new();
        s.push_str("# CNI ADD/DEL latency: calix vs ptp + host-local\n\n");
        s.push_str(&format!(
            "Measured {} by `cargo xtask bench cni --pods {} --reps {}` on {} × {} ({} CPUs), \
             kernel {}. calix {} (release build, the plugin static (musl) as it ships, `calix-agent` with the \
             eBPF dataplane and the embedded datastore); `ptp` + `host-local` from Debian's containernetworking-plugins \
             {} (`ipMasq: false`, a /16).\n\n",
            m.date,
            self.pods,
            self.reps,
            m.cpu,
            m.cpus,
            m.cpus,
            m.kernel,
            self.rev,
            self.plugins_version
        ));
        s.push_str(&format!(
            "Fork-to-exit of `<plugin>` exec'd into the node's network namespace (fork, setns, exec: as a runtime in that namespace does) with the CNI environment and the \
             config on stdin; {} pods per variant and repetition (sequential ADDs, then sequential \
             DELs, each pod in its own network namespace, created before timing), {} repetitions \
             with the variants interleaved. p50/p99 over all {} calls; [min–max] of the \
             per-repetition p50s; concurrent walls as median [min–max] over repetitions; the \
             1-minute load average before each variant.\n\n",
            self.pods,
            self.reps,
            self.pods * self.reps
        ));
        s.push_str("| variant | ADD p50 | ADD p99 | DEL p50 | DEL p99 | 20×ADD wall | 50×ADD wall | load before |\n");
        s.push_str("|---|---|---|---|---|---|---|---|\n");
        s.push_str(&self.row("calix", c, &self.loads[0]));
        s.push_str(&self.row("ptp + host-local", p, &self.loads[1]));
        s.push_str(&format!(
            "| calix / ptp | {} | {} | {} | {} | {} | {} | |\n",
            ratio(c.add_p50, p.add_p50),
            ratio(c.add_p99, p.add_p99),
            ratio(c.del_p50, p.del_p50),
            ratio(c.del_p99, p.del_p99),
            ratio(c.conc_median(0), p.conc_median(0)),
            ratio(c.conc_median(1), p.conc_median(1)),
        ));
        let floor99 = percentile(&f.link_del, 99.0);
        for (label, v) in [("calix", c), ("ptp + host-local", p)] {
            s.push_str(&format!(
                "| {label} DEL / `ip link del` floor | | | {} | {} | | | |\n",
                ratio(v.del_p50, floor),
                ratio(v.del_p99, floor99),
            ));
        }
        s.push_str("\nFloors, timed the same way (fork-to-exit), load before: ");
        s.push_str(&loads(&f.load));
        s.push_str(":\n\n| floor | p50 | p99 |\n|---|---|---|\n");
        for (label, all, reps) in [
            ("fork+exec `/bin/true`", &f.truth, &f.truth_p50),
            (
                "fork+setns+exec `/bin/true` (the exec path of every call)",
                &f.nsexec,
                &f.nsexec_p50,
            ),
            (
                "`ip link del <veth>` in the node namespace (a pod-like veth: peer in a pod \
                 namespace, both ends up, addressed, routed)",
                &f.link_del,
                &f.link_del_p50,
            ),
        ] {
            s.push_str(&format!(
                "| {label} | {} | {} ms |\n",
                p50_with_reps(percentile(all, 50.0), reps),
                fmt_ms(percentile(all, 99.0))
            ));
        }
        s.push_str("\nTargets (issue 3):\n\n");
        for (text, met) in self.targets() {
            s.push_str(&format!(
                "- {} {text}\n",
                if met { "met:" } else { "**not met**:" }
            ));
        }
        let all_loads: Vec<f64> = self
            .loads
            .iter()
            .flatten()
            .chain(&f.load)
            .copied()
            .collect();
        if let Some(note) = load_note(&all_loads) {
            s.push_str(&note);
        }
        s.push_str("\n![CNI latency chart](cni.svg)\n");
        s
    }
}

// --- chart ---------------------------------------------------------------------------------

fn chart(path: &Path, r: &Report) -> Result<()> {
    use plotters::prelude::*;
    let root = super::chart_root(
        path,
        (1000, 460),
        &format!(
            "CNI fork-to-exit latency, calix vs ptp + host-local ({} pods × {} reps, {})",
            r.pods, r.reps, r.machine.date
        ),
    )?;
    let (left, right) = root.split_horizontally(640);
    let (c, p) = (&r.calix, &r.ptp);
    let floor50 = percentile(&r.floors.link_del, 50.0);
    let floor99 = percentile(&r.floors.link_del, 99.0);
    let calix_color = RGBColor(0x1f, 0x77, 0xb4);
    let ptp_color = RGBColor(0xff, 0x7f, 0x0e);
    let floor_color = RGBColor(0x7f, 0x7f, 0x7f);
    panel(
        &left,
        "per call (ms)",
        "ms",
        &["ADD p50", "ADD p99", "DEL p50", "DEL p99"],
        &[
            (
                "calix",
                calix_color,
                vec![
                    Some(c.add_p50),
                    Some(c.add_p99),
                    Some(c.del_p50),
                    Some(c.del_p99),
                ],
            ),
            (
                "ptp + host-local",
                ptp_color,
                vec![
                    Some(p.add_p50),
                    Some(p.add_p99),
                    Some(p.del_p50),
                    Some(p.del_p99),
                ],
            ),
            (
                "ip link del floor",
                floor_color,
                vec![None, None, Some(floor50), Some(floor99)],
            ),
        ],
        &|_, _, v| fmt_ms(v),
        Some((
            "/bin/true in node netns p50",
            percentile(&r.floors.nsexec, 50.0),
        )),
    )?;
    panel(
        &right,
        "concurrent ADDs, wall (ms)",
        "ms",
        &["20×ADD", "50×ADD"],
        &[
            (
                "calix",
                calix_color,
                vec![Some(c.conc_median(0)), Some(c.conc_median(1))],
            ),
            (
                "ptp + host-local",
                ptp_color,
                vec![Some(p.conc_median(0)), Some(p.conc_median(1))],
            ),
        ],
        &|_, _, v| fmt_ms(v),
        None,
    )?;
    root.present()?;
    Ok(())
}
