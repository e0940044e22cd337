//! `cargo xtask bench dataplane`: same-node pod-to-pod performance of calix's eBPF dataplane
//! and its kernel mode against Debian's reference `bridge` plugin and a raw veth pair (the
//! physical ceiling), in one run on one machine (DESIGN.md §10).
//!
//! Four topologies, all built before any measurement and kept for the whole run:
//! - **calix eBPF** and **calix kernel**: a node namespace running a release `calix-agent`
//!   (`--dataplane ebpf` / `kernel`; started by `setns` from a `pre_exec`, not `ip netns exec`,
//!   so its bpffs pins land on the host's bpffs, under `/sys/fs/bpf/cxb-dp/<node>`) and two pod
//!   namespaces wired by the real `calix` CNI plugin, exec'd into the node namespace with the
//!   CNI environment and the config on stdin;
//! - **bridge**: a node namespace and two pods wired by `/usr/lib/cni/bridge` + `host-local`
//!   (`isGateway`, a /24): pod-to-pod traffic is switched by the bridge;
//! - **raw veth**: one veth pair straight between two namespaces.
//!
//! In every topology the server pod runs `xtask netperf server` (release build) and `iperf3
//! -s`; the client pod runs, per repetition and variant: `xtask netperf crr` (TCP_CRR:
//! connections per second), `xtask netperf rr` (TCP_RR: 1-byte ping-pong round trip p50/p99)
//! and `iperf3 -C cubic` (throughput), each `--secs` long. Servers and clients are pinned to
//! the same CPU (`sched_setaffinity` in the child, like `taskset -c 1`). Variants are
//! interleaved (repetitions outer, variants inner, the order rotated every repetition); the
//! load average is recorded before each variant; `nstat -asz IpForwDatagrams` is read in the
//! node namespace around every measurement (the eBPF dataplane should forward nothing through
//! the node's IP stack, kernel mode every packet).
//!
//! Everything is named `cxb-<pid>-…` and removed on drop, on error and Ctrl-C too: servers and
//! agents stopped, namespaces deleted (their links with them), this run's pins removed and
//! `/sys/fs/bpf/cxb-dp` with them. Writes docs/bench/dataplane.md and docs/bench/dataplane.svg
//! (with `--quick`, target/bench/ instead: development numbers are not published).
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::harness::{
    fmt_1, fmt_2, listening, log_to, median, num, program_run_time, remove_stale, run_json, Guard,
};
use super::{
    catch_interrupts, check_interrupted, cni_plugins_version, fmt_spread_with, git_rev, in_netns,
    in_netns_on, loadavg, loads, out_dir, panel, ratio, wait_ready, Call, Machine, Plugin, CNI_DIR,
};
use crate::util::{self, output, run as run_cmd};

const PREFIX: &str = "cxb";
/// bpffs root of the bench agents' pins (each node pins below `<root>/<node>`).
const PIN_ROOT: &str = "/sys/fs/bpf/cxb-dp";
const NODE_IP: &str = "10.99.0.1";
const CALIX_POOL: &str = "10.244.0.0/16";
const BRIDGE_SUBNET: &str = "10.245.0.0/24";
const BRIDGE_NAME: &str = "cxbbr0";
const VETH_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 246, 0, 1);
const VETH_SERVER: Ipv4Addr = Ipv4Addr::new(10, 246, 0, 2);
const NETPERF_PORT: u16 = 7001;
const IPERF_PORT: u16 = 5201;
const IPERF3: &str = "iperf3";
/// Niceness of the receiving iperf3 (see `start_servers`).
const IPERF_NICE: &str = "-5";
/// Linux ≥ 6.13: how long a TIME_WAIT port waits before `tcp_tw_reuse` may reuse it.
const TW_REUSE_DELAY: &str = "/proc/sys/net/ipv4/tcp_tw_reuse_delay";
/// The receiver's counter of zero-window advertisements (a receiver that fell behind).
const ZERO_WINDOW: &str = "TcpExtTCPToZeroWindowAdv";
/// Busy share (%) of the CPUs the bench does not use above which a run counts as shared.
const OTHERS_BUSY_LIMIT: f64 = 25.0;
/// Warm-up before the first repetition (untimed): TCP_CRR then TCP_RR for this long.
const WARMUP_SECS: f64 = 0.5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Ebpf,
    Kernel,
    Bridge,
    Veth,
    Floor,
}

const VARIANTS: [Variant; 5] = [
    Variant::Ebpf,
    Variant::Kernel,
    Variant::Bridge,
    Variant::Veth,
    Variant::Floor,
];

/// The eBPF crate's feature whose `from_pod` is the least a same-node redirect needs.
const FLOOR_FEATURE: &str = "bench-floor";

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Self::Ebpf => "calix eBPF",
            Self::Kernel => "calix kernel",
            Self::Bridge => "bridge",
            Self::Veth => "raw veth",
            Self::Floor => "minimal tc program",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Kernel => "kern",
            Self::Bridge => "brdg",
            Self::Veth => "veth",
            Self::Floor => "flor",
        }
    }

    fn color(self) -> plotters::style::RGBColor {
        use plotters::style::RGBColor;
        match self {
            Self::Ebpf => RGBColor(0x1f, 0x77, 0xb4),
            Self::Kernel => RGBColor(0x2c, 0xa0, 0x2c),
            Self::Bridge => RGBColor(0xff, 0x7f, 0x0e),
            Self::Veth => RGBColor(0x7f, 0x7f, 0x7f),
            Self::Floor => RGBColor(0x94, 0x67, 0xbd),
        }
    }
}

/// One variant's wiring: where client and server run, and the server's address.
struct Topology {
    /// The node namespace (none for the raw veth pair).
    node: Option<String>,
    client: String,
    server: String,
    client_ip: Ipv4Addr,
    server_ip: Ipv4Addr,
}

/// The bench's own binaries and settings, shared by every measurement.
struct Tools {
    bins: PathBuf,
    cpu: usize,
}

impl Tools {
    /// `xtask netperf <mode>` against the server of `t` for `secs`, in the client pod.
    fn netperf(&self, t: &Topology, mode: &str, secs: f64) -> Result<Value> {
        let to = SocketAddr::from((t.server_ip, NETPERF_PORT)).to_string();
        run_json(
            &format!("netperf {mode} {} → {to}", t.client),
            in_netns_on(&self.bins.join("xtask"), &t.client, Some(self.cpu))?.args([
                "netperf",
                mode,
                "--to",
                &to,
                "--secs",
                &secs.to_string(),
            ]),
        )
    }

    /// iperf3 (cubic) from the client pod to the server pod for `secs`: Gbit/s received.
    fn iperf(&self, t: &Topology, secs: u64) -> Result<f64> {
        let v = run_json(
            &format!("iperf3 {} → {}", t.client, t.server_ip),
            in_netns_on(Path::new(IPERF3), &t.client, Some(self.cpu))?.args([
                "-c",
                &t.server_ip.to_string(),
                "-p",
                &IPERF_PORT.to_string(),
                "-t",
                &secs.to_string(),
                "-C",
                "cubic",
                "--connect-timeout",
                "3000",
                "-J",
            ]),
        )?;
        let cc = v["end"]["sender_tcp_congestion"].as_str().unwrap_or("?");
        if cc != "cubic" {
            bail!("iperf3 ran with congestion control {cc}, not cubic");
        }
        Ok(num(&v, &["end", "sum_received", "bits_per_second"])? / 1e9)
    }
}

/// Counter `name` of namespace `ns` (`nstat -asz <name>` run inside it).
fn nstat(ns: &str, name: &str) -> Result<f64> {
    let out = output(in_netns(Path::new("nstat"), ns)?.args(["-asz", name]))?;
    out.lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(name))
                .then(|| it.next().and_then(|v| v.parse().ok()))
                .flatten()
        })
        .with_context(|| format!("no {name} in nstat's output: {out}"))
}

/// The node namespace's IpForwDatagrams; 0 without a node.
fn forwarded(node: Option<&str>) -> Result<f64> {
    node.map_or(Ok(0.0), |n| nstat(n, "IpForwDatagrams"))
}

// --- topologies ----------------------------------------------------------------------------

/// The IPv4 address (without prefix length) of a CNI ADD result.
fn added_ip(v: &Value) -> Result<Ipv4Addr> {
    let a = v["ips"][0]["address"].as_str().unwrap_or_default();
    a.split('/')
        .next()
        .and_then(|ip| ip.parse().ok())
        .with_context(|| format!("no IPv4 address in the ADD result {v}"))
}

/// ADDs pods `client` and `server` with `p`; their addresses.
fn add_pods(p: &Plugin, tag: &str, client: &str, server: &str) -> Result<(Ipv4Addr, Ipv4Addr)> {
    let mut ips = [Ipv4Addr::UNSPECIFIED; 2];
    for (i, pod) in [client, server].into_iter().enumerate() {
        let id = format!("{PREFIX}{}{tag}{i}0123456789abcdef", std::process::id());
        let v = p.call(&Call {
            command: "ADD",
            args: format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={tag}-{i};\
                 K8S_POD_INFRA_CONTAINER_ID={id}"
            ),
            container_id: id,
            netns: format!("/run/netns/{pod}"),
        })?;
        ips[i] = added_ip(&v)?;
    }
    Ok((ips[0], ips[1]))
}

/// A node namespace with a calix-agent (`dataplane`) and two pods wired by the calix plugin.
fn calix_topology(
    g: &mut Guard,
    bins: &Path,
    v: Variant,
    dataplane: &str,
    object: Option<&Path>,
) -> Result<Topology> {
    let node = g.netns(v.tag())?;
    run_cmd(Command::new("ip").args([
        "-n",
        &node,
        "addr",
        "add",
        &format!("{NODE_IP}/32"),
        "dev",
        "lo",
    ]))?;
    let client = g.netns(&format!("{}-a", v.tag()))?;
    let server = g.netns(&format!("{}-b", v.tag()))?;
    let dir = g.dir.join(v.tag());
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("agent.sock");
    let log_path = dir.join("agent.log");
    let (out, err) = log_to(&log_path)?;
    g.pin_dirs.push(Path::new(PIN_ROOT).join(&node));
    let child = in_netns_on(&bins.join("calix-agent"), &node, None)?
        .args([
            "--node-name",
            &node,
            "--dataplane",
            dataplane,
            "--pool",
            CALIX_POOL,
            "--log-level",
            "info",
            "--bpf-pin-root",
            PIN_ROOT,
        ])
        .arg("--socket")
        .arg(&socket)
        .arg("--datastore-path")
        .arg(dir.join("store.json"))
        .args(
            object
                .map(|o| ["--bpf-object".as_ref(), o.as_os_str()])
                .into_iter()
                .flatten(),
        )
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("cannot start calix-agent")?;
    g.agents.push(child);
    let ctl = bins.join("calixctl");
    if let Some(agent) = g.agents.last_mut() {
        wait_ready(
            &format!("calix-agent --dataplane {dataplane}"),
            agent,
            &log_path,
            Duration::from_secs(20),
            || {
                Command::new(&ctl)
                    .arg("--socket")
                    .arg(&socket)
                    .arg("endpoints")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            },
        )?;
    }
    let plugin = Plugin {
        label: v.label(),
        binary: bins.join("calix"),
        node: Some(node.clone()),
        conf: json!({
            "cniVersion": "1.0.0",
            "name": "k8s",
            "type": "calix",
            "agent_socket": socket.display().to_string(),
            "ipam": { "type": "calix-ipam" },
        })
        .to_string(),
    };
    let (client_ip, server_ip) = add_pods(&plugin, v.tag(), &client, &server)?;
    Ok(Topology {
        node: Some(node),
        client,
        server,
        client_ip,
        server_ip,
    })
}

/// A node namespace and two pods wired by Debian's bridge plugin with host-local.
fn bridge_topology(g: &mut Guard) -> Result<Topology> {
    let v = Variant::Bridge;
    let node = g.netns(v.tag())?;
    let client = g.netns(&format!("{}-a", v.tag()))?;
    let server = g.netns(&format!("{}-b", v.tag()))?;
    let plugin = Plugin {
        label: v.label(),
        binary: Path::new(CNI_DIR).join("bridge"),
        node: Some(node.clone()),
        conf: json!({
            "cniVersion": "1.0.0",
            "name": "cxb-bridge",
            "type": "bridge",
            "bridge": BRIDGE_NAME,
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "subnet": BRIDGE_SUBNET,
                "dataDir": g.dir.join("host-local").display().to_string(),
            },
        })
        .to_string(),
    };
    let (client_ip, server_ip) = add_pods(&plugin, v.tag(), &client, &server)?;
    Ok(Topology {
        node: Some(node),
        client,
        server,
        client_ip,
        server_ip,
    })
}

/// Two namespaces joined by one veth pair (both ends `eth0`, a /24).
fn veth_topology(g: &mut Guard) -> Result<Topology> {
    let v = Variant::Veth;
    let client = g.netns(&format!("{}-a", v.tag()))?;
    let server = g.netns(&format!("{}-b", v.tag()))?;
    run_cmd(Command::new("ip").args([
        "-n", &client, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns",
        &server,
    ]))?;
    for (ns, ip) in [(&client, VETH_CLIENT), (&server, VETH_SERVER)] {
        run_cmd(Command::new("ip").args([
            "-n",
            ns,
            "addr",
            "add",
            &format!("{ip}/24"),
            "dev",
            "eth0",
        ]))?;
        run_cmd(Command::new("ip").args(["-n", ns, "link", "set", "eth0", "up"]))?;
    }
    Ok(Topology {
        node: None,
        client,
        server,
        client_ip: VETH_CLIENT,
        server_ip: VETH_SERVER,
    })
}

/// The servers of `t` (netperf and iperf3, pinned to the bench CPU), up and listening.
fn start_servers(g: &mut Guard, tools: &Tools, v: Variant, t: &Topology) -> Result<()> {
    // TCP_CRR opens tens of thousands of connections a second and the client closes first, so
    // its ports sit in TIME_WAIT: every port of the client's namespace, and TIME_WAIT ports
    // reused for new connections (safe with timestamps) after 1 ms instead of 1 s. Without the
    // delay, connect() (which takes even ports first) runs out at ~32k connections/s on any
    // dataplane.
    let mut sysctls = vec![
        "net.ipv4.ip_local_port_range=1024 65535",
        "net.ipv4.tcp_tw_reuse=1",
    ];
    if Path::new(TW_REUSE_DELAY).exists() {
        sysctls.push("net.ipv4.tcp_tw_reuse_delay=1");
    }
    for kv in sysctls {
        run_cmd(
            in_netns(Path::new("sysctl"), &t.client)?
                .args(["-qw", kv])
                .stdout(Stdio::null()),
        )?;
    }
    let listen = SocketAddr::from((t.server_ip, NETPERF_PORT)).to_string();
    let netperf = {
        let mut c = in_netns_on(&tools.bins.join("xtask"), &t.server, Some(tools.cpu))?;
        c.args(["netperf", "server", "--listen", &listen]);
        c
    };
    // The receiving iperf3 runs at nice -5: with both ends on one CPU the sender also runs the
    // receive softirq, and an equal-priority receiver falls behind in about half the runs on
    // this kernel — the window closes thousands of times a second and the run settles near a
    // third of its throughput, on any dataplane (even the raw veth).
    let iperf = {
        let mut c = in_netns_on(Path::new("nice"), &t.server, Some(tools.cpu))?;
        c.args([
            "-n",
            IPERF_NICE,
            IPERF3,
            "-s",
            "-B",
            &t.server_ip.to_string(),
            "-p",
            &IPERF_PORT.to_string(),
        ]);
        c
    };
    for (name, mut cmd, port) in [
        ("netperf", netperf, NETPERF_PORT),
        ("iperf3", iperf, IPERF_PORT),
    ] {
        let log_path = g.dir.join(format!("{}-{name}.log", v.tag()));
        let (out, err) = log_to(&log_path)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start the {name} server"))?;
        let pid = child.id();
        g.servers.push(child);
        if let Some(c) = g.servers.last_mut() {
            wait_ready(
                &format!("{} {name} server", v.label()),
                c,
                &log_path,
                Duration::from_secs(10),
                || listening(pid, port),
            )?;
        }
    }
    Ok(())
}

// --- measurements --------------------------------------------------------------------------

/// One variant over every repetition.
#[derive(Default)]
struct Samples {
    /// Per repetition.
    crr: Vec<f64>,
    rr_p50: Vec<f64>,
    rr_p99: Vec<f64>,
    rr_rate: Vec<f64>,
    gbps: Vec<f64>,
    /// IpForwDatagrams in the node namespace: per connection (TCP_CRR), per round trip
    /// (TCP_RR), and over the iperf3 run.
    fwd_per_conn: Vec<f64>,
    fwd_per_rt: Vec<f64>,
    fwd_iperf: Vec<f64>,
    /// Zero-window advertisements of the iperf3 receiver.
    zero_windows: Vec<f64>,
    load: Vec<f64>,
    /// Over the measurements: how busy the CPUs the bench does not use were (%), and the
    /// bench CPU's steal time (%).
    others_busy: Vec<f64>,
    steal: Vec<f64>,
}

/// Per CPU from /proc/stat: [busy, steal, total] jiffies.
fn cpu_jiffies() -> Vec<[u64; 3]> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .map(|l| {
            // user nice system idle iowait irq softirq steal (guest time is within user).
            let v: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .take(8)
                .filter_map(|x| x.parse().ok())
                .collect();
            let at = |i: usize| v.get(i).copied().unwrap_or(0);
            let total: u64 = v.iter().sum();
            let (idle, steal) = (at(3) + at(4), at(7));
            [total.saturating_sub(idle + steal), steal, total]
        })
        .collect()
}

/// Between two [`cpu_jiffies`]: the busy share (%) of every CPU but `cpu` (what else ran on
/// the machine: the measured processes are pinned to `cpu`) and `cpu`'s steal share (%).
fn cpu_shares(before: &[[u64; 3]], after: &[[u64; 3]], cpu: usize) -> (f64, f64) {
    let d = |i: usize, k: usize| after[i][k].saturating_sub(before[i][k]) as f64;
    let n = before.len().min(after.len());
    let (mut busy, mut total) = (0.0, 0.0);
    for i in (0..n).filter(|&i| i != cpu) {
        busy += d(i, 0);
        total += d(i, 2);
    }
    let steal = if cpu < n && d(cpu, 2) > 0.0 {
        100.0 * d(cpu, 1) / d(cpu, 2)
    } else {
        f64::NAN
    };
    let others = if total > 0.0 {
        100.0 * busy / total
    } else {
        f64::NAN
    };
    (others, steal)
}

/// One repetition of one variant; its progress line.
fn measure(tools: &Tools, t: &Topology, secs: u64, s: &mut Samples) -> Result<String> {
    let load = loadavg();
    let cpu0 = cpu_jiffies();
    let node = t.node.as_deref();
    let f0 = forwarded(node)?;
    let crr = tools.netperf(t, "crr", secs as f64)?;
    let f1 = forwarded(node)?;
    let rr = tools.netperf(t, "rr", secs as f64)?;
    let f2 = forwarded(node)?;
    let z0 = nstat(&t.server, ZERO_WINDOW)?;
    let gbps = tools.iperf(t, secs)?;
    let zero_windows = nstat(&t.server, ZERO_WINDOW)? - z0;
    let f3 = forwarded(node)?;
    let (others, steal) = cpu_shares(&cpu0, &cpu_jiffies(), tools.cpu);
    let (conns, rate) = (num(&crr, &["count"])?, num(&crr, &["rate"])?);
    let rts = num(&rr, &["count"])?;
    let (p50, p99) = (num(&rr, &["p50_us"])?, num(&rr, &["p99_us"])?);
    s.load.push(load);
    s.others_busy.push(others);
    s.steal.push(steal);
    s.crr.push(rate);
    s.rr_p50.push(p50);
    s.rr_p99.push(p99);
    s.rr_rate.push(num(&rr, &["rate"])?);
    s.gbps.push(gbps);
    s.zero_windows.push(zero_windows);
    let fwd = node.is_some();
    if fwd {
        s.fwd_per_conn.push((f1 - f0) / conns.max(1.0));
        s.fwd_per_rt.push((f2 - f1) / rts.max(1.0));
        s.fwd_iperf.push(f3 - f2);
    }
    Ok(format!(
        "(load {load:.2}, other CPUs {others:.0}% busy, steal {steal:.0}%): {} conn/s, RR p50 {p50:.1} µs p99 {p99:.1} µs, {gbps:.1} Gbit/s \
         ({zero_windows:.0} zero windows){}",
        fmt_rate(rate),
        if fwd {
            format!(
                ", IpForwDatagrams +{:.0} (CRR) +{:.0} (RR) +{:.0} (iperf3)",
                f1 - f0,
                f2 - f1,
                f3 - f2
            )
        } else {
            String::new()
        }
    ))
}

fn fmt_rate(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.0}")
    }
}

pub fn run(reps: usize, secs: u64, quick: bool) -> Result<()> {
    util::require_root("the dataplane benchmark")?;
    if reps < 1 || secs < 1 {
        bail!("--reps and --secs must be at least 1");
    }
    for bin in ["bridge", "host-local"] {
        let p = Path::new(CNI_DIR).join(bin);
        if !p.exists() {
            bail!(
                "{} is missing: install containernetworking-plugins (cargo xtask setup)",
                p.display()
            );
        }
    }
    for tool in [IPERF3, "nstat", "sysctl"] {
        if output(Command::new("sh").args(["-c", &format!("command -v {tool}")])).is_err() {
            bail!("{tool} is missing: cargo xtask setup installs it");
        }
    }
    let t_start = Instant::now();
    // The revision the binaries are built from (read before the build, not after the run).
    let rev = git_rev(&util::workspace_root());
    println!("[setup] building release binaries (cargo build --release --workspace --bins)");
    let bins = util::build_bins_release()?;
    println!("[setup] building the eBPF floor (the `{FLOOR_FEATURE}` feature of the programs)");
    let floor =
        calix_ebpf_build::build_ebpf_feature(&calix_ebpf_build::ebpf_target_dir(), FLOOR_FEATURE)
            .map_err(|e| anyhow::anyhow!("building the {FLOOR_FEATURE} eBPF object: {e}"))?;
    remove_stale(PREFIX, PIN_ROOT)?;
    catch_interrupts();

    let machine = Machine::read();
    let tools = Tools {
        bins,
        cpu: if machine.cpus > 1 { 1 } else { 0 },
    };
    let prefix = format!("{PREFIX}-{}", std::process::id());
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    let mut g = Guard::new(prefix, PIN_ROOT, dir);

    let mut topo = Vec::with_capacity(VARIANTS.len());
    for v in VARIANTS {
        check_interrupted()?;
        let t = match v {
            Variant::Ebpf => calix_topology(&mut g, &tools.bins, v, "ebpf", None),
            Variant::Kernel => calix_topology(&mut g, &tools.bins, v, "kernel", None),
            Variant::Floor => calix_topology(&mut g, &tools.bins, v, "ebpf", Some(&floor)),
            Variant::Bridge => bridge_topology(&mut g),
            Variant::Veth => veth_topology(&mut g),
        }
        .with_context(|| format!("setting up {}", v.label()))?;
        start_servers(&mut g, &tools, v, &t)
            .with_context(|| format!("starting the servers of {}", v.label()))?;
        // Untimed warm-up, which also proves the path works before anything is timed.
        let w = tools
            .netperf(&t, "crr", WARMUP_SECS)
            .and_then(|_| tools.netperf(&t, "rr", WARMUP_SECS))
            .with_context(|| {
                format!(
                    "{}: {} cannot reach {} (warm-up)",
                    v.label(),
                    t.client_ip,
                    t.server_ip
                )
            })?;
        println!(
            "[setup] {}: {} → {} ({} → {}), warm-up RR p50 {:.1} µs",
            v.label(),
            t.client,
            t.server,
            t.client_ip,
            t.server_ip,
            num(&w, &["p50_us"])?
        );
        topo.push(t);
    }

    // What from_pod costs per packet, from the kernel's BPF run-time statistics over an untimed
    // TCP_CRR run (the statistics add two clock reads per run, so never during a measurement).
    let prog_cost = program_cost(&tools, &topo[Variant::Ebpf as usize])
        .context("measuring from_pod's run time")?;
    println!(
        "[setup] calix eBPF: from_pod {:.0} ns per packet over {} packets (kernel BPF stats)",
        prog_cost.ns_per_run, prog_cost.runs
    );

    let mut res: [Samples; 5] = Default::default();
    for rep in 0..reps {
        let mut order = VARIANTS;
        order.rotate_left(rep % VARIANTS.len());
        for v in order {
            check_interrupted()?;
            let i = v as usize;
            // Ctrl-C kills the running client too: report the interrupt, not its failure.
            let line = measure(&tools, &topo[i], secs, &mut res[i])
                .or_else(|e| check_interrupted().and(Err(e)))
                .with_context(|| format!("{} (repetition {})", v.label(), rep + 1))?;
            println!("[rep {}/{reps}] {} {line}", rep + 1, v.label());
        }
    }
    drop(g);
    println!(
        "[done] measured in {:.0}s; servers and agents stopped, namespaces and pins removed",
        t_start.elapsed().as_secs_f64()
    );

    let report = Report {
        reps,
        secs,
        quick,
        cpu: tools.cpu,
        tw_delay: Path::new(TW_REUSE_DELAY).exists(),
        machine,
        rev,
        plugins_version: cni_plugins_version(),
        iperf_version: output(Command::new(IPERF3).arg("--version"))
            .ok()
            .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
            .unwrap_or_else(|| "iperf3".into()),
        res,
        prog_cost,
    };
    let md = report.markdown();
    println!("\n{md}");
    let out = if quick {
        let d = util::workspace_root().join("target").join("bench");
        std::fs::create_dir_all(&d)?;
        d
    } else {
        out_dir()?
    };
    std::fs::write(out.join("dataplane.md"), &md)?;
    chart(&out.join("dataplane.svg"), &report)?;
    println!(
        "wrote {} and {}",
        out.join("dataplane.md").display(),
        out.join("dataplane.svg").display()
    );
    Ok(())
}

// --- report --------------------------------------------------------------------------------

struct Report {
    reps: usize,
    secs: u64,
    quick: bool,
    cpu: usize,
    /// Whether the client namespaces reuse TIME_WAIT ports after 1 ms.
    tw_delay: bool,
    machine: Machine,
    rev: String,
    plugins_version: String,
    iperf_version: String,
    res: [Samples; 5],
    prog_cost: ProgCost,
}

/// A program's average run time per packet over a load.
struct ProgCost {
    ns_per_run: f64,
    runs: u64,
}

const PROG_COST_SECS: f64 = 2.0;

/// `from_pod`'s average run time per packet over an untimed TCP_CRR run of
/// [`PROG_COST_SECS`] (kernel BPF statistics).
fn program_cost(tools: &Tools, t: &Topology) -> Result<ProgCost> {
    let (ns_per_run, runs) = program_run_time("from_pod", || {
        tools.netperf(t, "crr", PROG_COST_SECS).map(drop)
    })?;
    Ok(ProgCost { ns_per_run, runs })
}

impl Report {
    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    fn row(&self, v: Variant) -> String {
        let s = self.get(v);
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            v.label(),
            fmt_spread_with(&s.crr, "", fmt_rate),
            fmt_spread_with(&s.rr_p50, " µs", fmt_1),
            fmt_spread_with(&s.rr_p99, " µs", fmt_1),
            fmt_spread_with(&s.rr_rate, "", fmt_rate),
            fmt_spread_with(&s.gbps, " Gbit/s", fmt_1),
            loads(&s.load),
            fmt_spread_with(&s.others_busy, " %", fmt_rate),
        )
    }

    fn ratio_row(&self, a: Variant, b: Variant) -> String {
        let (x, y) = (self.get(a), self.get(b));
        format!(
            "| {} / {} | {} | {} | {} | {} | {} | | |\n",
            a.label(),
            b.label(),
            ratio(median(&x.crr), median(&y.crr)),
            ratio(median(&x.rr_p50), median(&y.rr_p50)),
            ratio(median(&x.rr_p99), median(&y.rr_p99)),
            ratio(median(&x.rr_rate), median(&y.rr_rate)),
            ratio(median(&x.gbps), median(&y.gbps)),
        )
    }

    /// What the machine did besides the bench. The load average before a variant includes the
    /// bench itself (the pinned client and server keep one CPU busy, so it sits near 1–2 and
    /// cannot fall below ~1.2 between variants); the other CPUs' busy share over each
    /// measurement shows what else ran.
    fn load_note(&self) -> String {
        let all = |f: fn(&Samples) -> &Vec<f64>| -> Vec<f64> {
            self.res.iter().flat_map(|r| f(r).iter().copied()).collect()
        };
        let (others, steal, load) = (all(|r| &r.others_busy), all(|r| &r.steal), all(|r| &r.load));
        let max_others = others.iter().copied().fold(f64::NAN, f64::max);
        let plural = if self.machine.cpus > 2 { "s" } else { "" };
        let mut s = format!(
            "\nLoad: the 1-minute load average before each variant includes the bench itself (the \
             pinned client and server keep CPU {} busy: it sits between 1 and 2 by itself), so \
             DESIGN.md §10's \"rerun above ~1.2\" is judged on what ran elsewhere: the other \
             CPU{plural} {} {} busy during the measurements (median [min–max] over every \
             measurement; the agents, this bench's own process and nstat included), and \
             the bench CPU's steal time was {} %. Load averages before the variants: {}.\n",
            self.cpu,
            if plural.is_empty() { "was" } else { "were" },
            fmt_spread_with(&others, " %", fmt_rate),
            fmt_spread_with(&steal, "", fmt_rate),
            loads(&load),
        );
        if max_others > OTHERS_BUSY_LIMIT {
            s.push_str(&format!(
                "\n**Something else used up to {max_others:.0} % of the other CPU{plural} during a \
                 measurement** (above {OTHERS_BUSY_LIMIT:.0} %: the machine was shared; rerun \
                 for publishable numbers).\n",
            ));
        }
        s
    }

    fn targets(&self) -> Vec<(String, bool)> {
        let (e, k, r) = (
            self.get(Variant::Ebpf),
            self.get(Variant::Kernel),
            self.get(Variant::Veth),
        );
        let (ec, kc, rc) = (median(&e.crr), median(&k.crr), median(&r.crr));
        let (el, kl) = (median(&e.rr_p50), median(&k.rr_p50));
        let (eg, rg) = (median(&e.gbps), median(&r.gbps));
        vec![
            (
                format!(
                    "conn/s ≥ 0.95× raw veth: {} vs {} ({})",
                    fmt_rate(ec),
                    fmt_rate(0.95 * rc),
                    ratio(ec, rc)
                ),
                ec >= 0.95 * rc,
            ),
            (
                format!(
                    "conn/s ≥ 1.15× calix kernel: {} vs {} ({})",
                    fmt_rate(ec),
                    fmt_rate(1.15 * kc),
                    ratio(ec, kc)
                ),
                ec >= 1.15 * kc,
            ),
            (
                format!(
                    "TCP_RR ≥ 1.10× calix kernel (p50 round trip ≤ kernel's / 1.10): {} µs vs \
                     {} µs (kernel / eBPF: {})",
                    fmt_1(el),
                    fmt_1(kl / 1.10),
                    ratio(kl, el)
                ),
                el <= kl / 1.10,
            ),
            (
                format!(
                    "throughput ≥ 0.9× raw veth: {} vs {} Gbit/s ({})",
                    fmt_1(eg),
                    fmt_1(0.9 * rg),
                    ratio(eg, rg)
                ),
                eg >= 0.9 * rg,
            ),
        ]
    }

    fn markdown(&self) -> String {
        let m = &self.machine;
        let mut s = String::new();
        s.push_str(
            "# Same-node pod-to-pod dataplane: calix eBPF and kernel mode vs bridge and a raw \
             veth\n\n",
        );
        if self.quick {
            s.push_str("**Development run (`--quick`): too short to publish.**\n\n");
        }
        s.push_str(&format!(
            "Measured {} by `cargo xtask bench dataplane --reps {} --secs {}` on {} × {} ({} CPUs), \
             kernel {}. calix {}: release build, `calix-agent --dataplane ebpf` / `kernel` with \
             the embedded datastore, pods wired by the `calix` CNI plugin; `bridge` + \
             `host-local` from Debian's containernetworking-plugins {} (`isGateway`, \
             {BRIDGE_SUBNET}); {}.\n\n",
            m.date,
            self.reps,
            self.secs,
            m.cpu,
            m.cpus,
            m.cpus,
            m.kernel,
            self.rev,
            self.plugins_version,
            self.iperf_version,
        ));
        s.push_str(&format!(
            "Two pods on one node, client → server, every variant set up before the first \
             measurement: **calix eBPF** (the from-pod tc program `bpf_redirect_peer`s into the \
             destination pod), **calix kernel** (routes + proxy_arp: the node namespace's IP \
             stack forwards), **bridge** (Debian's reference plugin: the node's bridge switches \
             between the pods), **raw veth** (one veth pair straight between the two \
             namespaces: the ceiling), **minimal tc program** (calix eBPF with `from_pod` built with \
             the programs' `bench-floor` feature: a destination lookup and `bpf_redirect_peer`, \
             nothing else — what a tc redirect costs at least, the issue's hand-made 40-line \
             program). Per variant and repetition, each {} s long, client and \
             server pinned to CPU {} (`sched_setaffinity`, as `taskset -c {}`): \
             **TCP_CRR** (`xtask netperf crr`: connect, 1-byte request, 1-byte reply, close, \
             sequentially; the client closes first, so its namespace uses ports 1024–65535 with \
             `tcp_tw_reuse=1`{}), **TCP_RR** (`xtask netperf rr`: 1-byte ping-pong on one \
             `TCP_NODELAY` connection, every round trip timed; p50/p99 of the repetition) and \
             **throughput** (`iperf3 -C cubic -t {}`, one stream, the receiver at nice \
             {IPERF_NICE}). {} repetitions, variants \
             interleaved (order rotated every repetition); median [min–max] over repetitions; \
             the 1-minute load average before each variant.\n\n",
            self.secs,
            self.cpu,
            self.cpu,
            if self.tw_delay {
                " and `tcp_tw_reuse_delay=1` ms"
            } else {
                " (no `tcp_tw_reuse_delay` on this kernel: TIME_WAIT ports wait 1 s, which caps \
                 TCP_CRR near 32k connections/s)"
            },
            self.secs,
            self.reps,
        ));
        s.push_str(
            "| variant | conn/s (TCP_CRR) | TCP_RR p50 | TCP_RR p99 | TCP_RR round trips/s | \
             throughput | load before | other CPU busy |\n",
        );
        s.push_str("|---|---|---|---|---|---|---|---|\n");
        for v in VARIANTS {
            s.push_str(&self.row(v));
        }
        for (a, b) in [
            (Variant::Ebpf, Variant::Veth),
            (Variant::Ebpf, Variant::Kernel),
            (Variant::Ebpf, Variant::Bridge),
            (Variant::Ebpf, Variant::Floor),
            (Variant::Floor, Variant::Veth),
            (Variant::Floor, Variant::Kernel),
            (Variant::Kernel, Variant::Veth),
            (Variant::Bridge, Variant::Veth),
        ] {
            s.push_str(&self.ratio_row(a, b));
        }
        s.push_str(&format!(
            "\n`from_pod` costs {:.0} ns per packet: the kernel's BPF run-time statistics \
             (`kernel.bpf_stats_enabled`) over {} packets of an untimed {PROG_COST_SECS} s \
             TCP_CRR run of the eBPF variant before the measurements.\n",
            self.prog_cost.ns_per_run, self.prog_cost.runs
        ));
        s.push_str(
            "\nRatios of medians: above 1× is better for conn/s, round trips/s and throughput, \
             below 1× is better for the round-trip latencies.\n",
        );
        s.push_str(&format!(
            "\nWhy the iperf3 receiver runs at nice {IPERF_NICE}: with client and server on one \
             CPU the sender also runs the receive softirq, and an equal-priority receiver fell \
             behind in about half of the runs while this bench was written (even on the raw \
             veth): its window closed thousands of times a second and the run settled near 16 \
             instead of ~55 Gbit/s. Zero-window advertisements of the receiver per run, median \
             [min–max]: {}.\n",
            VARIANTS
                .iter()
                .map(|&v| format!(
                    "{} {}",
                    v.label(),
                    fmt_spread_with(&self.get(v).zero_windows, "", fmt_rate)
                ))
                .collect::<Vec<_>>()
                .join("; ")
        ));
        s.push_str(
            "\nIpForwDatagrams of the node namespace (`nstat -asz IpForwDatagrams` run inside \
             it before and after each measurement), median [min–max] over repetitions:\n\n\
             | variant | per connection (TCP_CRR) | per round trip (TCP_RR) | during iperf3 |\n\
             |---|---|---|---|\n",
        );
        for v in [
            Variant::Ebpf,
            Variant::Floor,
            Variant::Kernel,
            Variant::Bridge,
        ] {
            let x = self.get(v);
            s.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                v.label(),
                fmt_spread_with(&x.fwd_per_conn, "", fmt_2),
                fmt_spread_with(&x.fwd_per_rt, "", fmt_2),
                fmt_spread_with(&x.fwd_iperf, "", fmt_rate),
            ));
        }
        let (e, k) = (self.get(Variant::Ebpf), self.get(Variant::Kernel));
        let bypass = !e.fwd_per_conn.is_empty()
            && e.fwd_per_conn.iter().all(|&x| x < 0.01)
            && median(&k.fwd_per_conn) >= 1.0;
        s.push_str(&format!(
            "\n{} the eBPF dataplane forwarded {} datagrams per connection through the node's IP \
             stack, kernel mode {} (a TCP_CRR connection is about 5 packets each way; the \
             bridge switches at layer 2, so it forwards none either).\n",
            if bypass {
                "Bypass shown:"
            } else {
                "**Bypass not shown**:"
            },
            fmt_2(median(&e.fwd_per_conn)),
            fmt_2(median(&k.fwd_per_conn)),
        ));
        s.push_str("\nTargets (issue, calix eBPF, medians):\n\n");
        for (text, met) in self.targets() {
            s.push_str(&format!(
                "- {} {text}\n",
                if met { "met:" } else { "**not met**:" }
            ));
        }
        s.push_str(&self.load_note());
        s.push_str("\n![dataplane chart](dataplane.svg)\n");
        s
    }
}

fn chart(path: &Path, r: &Report) -> Result<()> {
    let root = super::chart_root(
        path,
        (1200, 460),
        &format!(
            "Same-node pod-to-pod, medians of {} reps × {} s ({})",
            r.reps, r.secs, r.machine.date
        ),
    )?;
    let panels = root.split_evenly((1, 3));
    let series = |f: &dyn Fn(&Samples) -> Vec<Option<f64>>| -> Vec<super::Series> {
        VARIANTS
            .iter()
            .map(|&v| (v.label(), v.color(), f(r.get(v))))
            .collect()
    };
    panel(
        &panels[0],
        "connections/s (TCP_CRR), higher is better",
        "conn/s",
        &["TCP_CRR"],
        &series(&|s| vec![Some(median(&s.crr))]),
        &|_, _, v| fmt_rate(v),
        None,
    )?;
    panel(
        &panels[1],
        "TCP_RR round trip (µs), lower is better",
        "µs",
        &["p50", "p99"],
        &series(&|s| vec![Some(median(&s.rr_p50)), Some(median(&s.rr_p99))]),
        &|_, _, v| fmt_1(v),
        None,
    )?;
    panel(
        &panels[2],
        "throughput (iperf3 cubic), higher is better",
        "Gbit/s",
        &["1 stream"],
        &series(&|s| vec![Some(median(&s.gbps))]),
        &|_, _, v| fmt_1(v),
        None,
    )?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::stale_pid;
    use super::*;

    #[test]
    fn stale_names_need_a_dead_pid() {
        let me = std::process::id();
        assert_eq!(stale_pid(&format!("cxb-{me}-ebpf"), PREFIX), None);
        assert_eq!(stale_pid("cxb-ipam-123", PREFIX), None);
        assert_eq!(stale_pid("cxbother", PREFIX), None);
        // pid_max is at most 2^22: this pid cannot exist.
        assert_eq!(stale_pid("cxb-4294967295-kern-a", PREFIX), Some(4294967295));
    }
}
