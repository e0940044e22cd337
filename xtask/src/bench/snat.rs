//! `cargo xtask bench snat` (issue 6): pod → outside traffic through calix eBPF SNAT against
//! the kernel's MASQUERADE (iptables, nftables) and plain routing without NAT (the ceiling), and
//! the XDP deny list's cost per dropped packet against nftables drop rules, in one run on one
//! machine (DESIGN.md §10).
//!
//! **Outgoing traffic.** One topology per variant, all built before any measurement: a node
//! namespace running a release `calix-agent` (started by `setns` in a `pre_exec`, so its pins
//! land on the host's bpffs under `/sys/fs/bpf/cxb-snat/<node>`), one pod wired by the real
//! `calix` CNI plugin, and an uplink veth (`cxup0`, 198.18.0.1/24) to an "internet" namespace
//! (`eth0`, 198.18.0.2/24) that runs the servers. The node routes by default via the internet.
//! - **routing (no NAT)**: kernel mode; the internet has a route back to the pool via the node.
//! - **calix eBPF, no NAT**: the same with `dataplane = "ebpf"` and the uplink programs: the
//!   eBPF dataplane's own cost, without SNAT.
//! - **iptables MASQUERADE** / **nftables masquerade**: kernel mode, no route back; the node
//!   masquerades `-s <pool> ! -d <pool> -o cxup0` (Debian's iptables is iptables-nft).
//! - **calix eBPF SNAT**: `dataplane = "ebpf"`, `uplinks = ["cxup0"]`, the pool with
//!   `natOutgoing = true`, plus `--snat-config <FILE>` appended (e.g. a `[nat]` section); no
//!   route back.
//!
//! Before anything is timed, a probe connection from the pod shows which source address the
//! internet sees: the pod's for the routing variants, the node's (198.18.0.1) for the NAT
//! ones. A NAT variant whose probe fails or shows the pod's address is a bench bug — except
//! calix SNAT, which is reported as "not available: <reason>" while the rest still runs.
//! Measurements per variant and repetition as `bench dataplane` does them: TCP_CRR (`xtask
//! netperf crr`), TCP_RR (`xtask netperf rr`), `iperf3 -C cubic`, client and servers pinned to
//! one CPU.
//!
//! **Drops.** Per filter, a node namespace with the uplink and an internet namespace: **calix
//! XDP native** and **generic** (`[xdp] enabled = true`, `deny_cidrs = ["198.51.100.0/24"]`),
//! **nft netdev ingress** (a `netdev` table's ingress hook on the uplink: where XDP generic
//! runs, the closest kernel equivalent) and **nft ip prerouting** (priority raw). A sender
//! thread in the internet namespace, pinned to the bench CPU, writes 60-byte UDP frames from
//! 198.51.100.7 with `sendmmsg` on an `AF_PACKET` socket (`PACKET_QDISC_BYPASS`) for `--secs`.
//! On a veth every receive runs on the sender's CPU, in softirq (generic XDP and nft from the
//! backlog `netif_rx` fills, native XDP in the receiving veth's NAPI poll), so that CPU's
//! softirq time (/proc/stat) per dropped packet is the filter side's cost, and the sender
//! thread's CPU time (which includes the softirqs it ran) per packet is the total. Drops are
//! counted by the filters themselves (`calixctl bpf counters`, nft counters).
//!
//! Everything is named `cxb-<pid>-…` and removed on drop, on error and Ctrl-C too. Writes
//! docs/bench/snat.md and docs/bench/snat.svg (with `--quick`, target/bench/ instead).
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use super::harness::{
    fmt_1, fmt_2, listening, log_to, median, num, program_run_time, remove_stale, run_json, Guard,
};
use super::{
    catch_interrupts, check_interrupted, fmt_spread_with, git_rev, in_netns, in_netns_on, loadavg,
    loads, out_dir, panel, ratio, wait_ready, Call, Machine, Plugin,
};
use crate::util::{self, output, run as run_cmd};

const PREFIX: &str = "cxb";
/// bpffs root of the bench agents' pins (each node pins below `<root>/<node>`).
const PIN_ROOT: &str = "/sys/fs/bpf/cxb-snat";
const POOL: &str = "10.244.0.0/16";
const NODE_LO: &str = "10.99.0.1";
/// The node's uplink and its peer in the internet namespace (RFC 2544 benchmark addresses).
const UPLINK: &str = "cxup0";
const PEER_IF: &str = "eth0";
const NODE_UP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const INET: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const UP_PREFIX: u8 = 24;
/// The denied CIDR of the drop part (TEST-NET-2) and the flood's source in it.
const DENY_CIDR: &str = "198.51.100.0/24";
const FLOOD_SRC: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
/// UDP discard: not a failsafe port.
const FLOOD_PORT: u16 = 9;
/// Frames per `sendmmsg`.
const BATCH: usize = 64;
const NETPERF_PORT: u16 = 7001;
const PROBE_PORT: u16 = 7002;
const IPERF_PORT: u16 = 5201;
const IPERF3: &str = "iperf3";
/// Niceness of the receiving iperf3 (see dataplane.rs: an equal-priority receiver on the
/// sender's CPU falls behind).
const IPERF_NICE: &str = "-5";
const TW_REUSE_DELAY: &str = "/proc/sys/net/ipv4/tcp_tw_reuse_delay";
const WARMUP_SECS: f64 = 0.5;
/// Busy share (%) of the CPUs the bench does not use above which a run counts as shared.
const OTHERS_BUSY_LIMIT: f64 = 25.0;
const XDP_REASON: &str = "xdp_denied_source";

// --- variants ------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Routing,
    EbpfRouting,
    Iptables,
    Nftables,
    CalixSnat,
}

const VARIANTS: [Variant; 5] = [
    Variant::Routing,
    Variant::EbpfRouting,
    Variant::Iptables,
    Variant::Nftables,
    Variant::CalixSnat,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Self::Routing => "routing (no NAT)",
            Self::EbpfRouting => "calix eBPF, no NAT",
            Self::Iptables => "iptables MASQUERADE",
            Self::Nftables => "nftables masquerade",
            Self::CalixSnat => "calix eBPF SNAT",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::Routing => "rt",
            Self::EbpfRouting => "ert",
            Self::Iptables => "ipt",
            Self::Nftables => "nft",
            Self::CalixSnat => "snat",
        }
    }

    /// Whether the node translates the pod's address (no route back to the pool).
    fn nat(self) -> bool {
        matches!(self, Self::Iptables | Self::Nftables | Self::CalixSnat)
    }

    fn ebpf(self) -> bool {
        matches!(self, Self::EbpfRouting | Self::CalixSnat)
    }

    fn color(self) -> plotters::style::RGBColor {
        use plotters::style::RGBColor;
        match self {
            Self::Routing => RGBColor(0x7f, 0x7f, 0x7f),
            Self::EbpfRouting => RGBColor(0x9e, 0xc9, 0xe2),
            Self::Iptables => RGBColor(0xff, 0x7f, 0x0e),
            Self::Nftables => RGBColor(0xd6, 0x27, 0x28),
            Self::CalixSnat => RGBColor(0x1f, 0x77, 0xb4),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Filter {
    XdpNative,
    XdpGeneric,
    NftIngress,
    NftPrerouting,
    /// No filter: frames of an EtherType nobody handles, dropped at the end of the receive
    /// core (`rx_dropped`). Sender + veth + backlog: what every filter costs on top of.
    Floor,
}

const FILTERS: [Filter; 5] = [
    Filter::XdpNative,
    Filter::XdpGeneric,
    Filter::NftIngress,
    Filter::NftPrerouting,
    Filter::Floor,
];

/// The floor's EtherType (IEEE 802 local experimental): no protocol handler takes it.
const FLOOR_ETHERTYPE: u16 = 0x88b5;

impl Filter {
    fn label(self) -> &'static str {
        match self {
            Self::XdpNative => "calix XDP native",
            Self::XdpGeneric => "calix XDP generic",
            Self::NftIngress => "nft netdev ingress",
            Self::NftPrerouting => "nft ip prerouting",
            Self::Floor => "no filter (floor)",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::XdpNative => "xn",
            Self::XdpGeneric => "xg",
            Self::NftIngress => "fi",
            Self::NftPrerouting => "fp",
            Self::Floor => "fl",
        }
    }

    fn xdp_mode(self) -> Option<&'static str> {
        match self {
            Self::XdpNative => Some("native"),
            Self::XdpGeneric => Some("generic"),
            _ => None,
        }
    }

    /// The nft table holding the drop rule (`family name`).
    fn nft_table(self) -> Option<&'static str> {
        match self {
            Self::NftIngress => Some("netdev cxbdrop"),
            Self::NftPrerouting => Some("ip cxbdrop"),
            _ => None,
        }
    }

    fn color(self) -> plotters::style::RGBColor {
        use plotters::style::RGBColor;
        match self {
            Self::XdpNative => RGBColor(0x1f, 0x77, 0xb4),
            Self::XdpGeneric => RGBColor(0x9e, 0xc9, 0xe2),
            Self::NftIngress => RGBColor(0xff, 0x7f, 0x0e),
            Self::NftPrerouting => RGBColor(0xd6, 0x27, 0x28),
            Self::Floor => RGBColor(0x7f, 0x7f, 0x7f),
        }
    }
}

// --- cleanup -------------------------------------------------------------------------------

// --- small helpers -------------------------------------------------------------------------

/// `ip -n <ns> <args>` (`args` split at whitespace).
fn ip(ns: &str, args: &str) -> Result<()> {
    run_cmd(
        Command::new("ip")
            .args(["-n", ns])
            .args(args.split_whitespace()),
    )
}

/// `sysctl -qw <kv>` inside namespace `ns`.
fn sysctl(ns: &str, kv: &str) -> Result<()> {
    run_cmd(
        in_netns(Path::new("sysctl"), ns)?
            .args(["-qw", kv])
            .stdout(Stdio::null()),
    )
}

fn fmt_0(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.0}")
    }
}

/// Runs `f` on a new thread that joined network namespace `ns` (`setns` affects only the
/// calling thread) and, with `cpu`, runs on that CPU only. Sockets keep the namespace they were
/// created in, whichever thread uses them later.
fn spawn_in_netns<T: Send + 'static>(
    ns: &str,
    cpu: Option<usize>,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<std::thread::JoinHandle<Result<T>>> {
    let file = File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("cannot open netns {ns}"))?;
    let ns = ns.to_string();
    Ok(std::thread::spawn(move || {
        // SAFETY: setns(2) on a valid namespace fd; CLONE_NEWNET moves this thread only.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("cannot enter netns {ns}"));
        }
        if let Some(c) = cpu {
            // SAFETY: cpu_set_t is plain data (all zeroes: the empty set); CPU_SET sets one bit;
            // sched_setaffinity(0, …) pins this thread.
            let ok = unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(c, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) == 0
            };
            if !ok {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("cannot pin to CPU {c}"));
            }
        }
        f()
    }))
}

fn join<T>(h: std::thread::JoinHandle<Result<T>>) -> Result<T> {
    h.join().map_err(|_| anyhow!("a bench thread panicked"))?
}

/// The MAC address of `ifname` in namespace `ns`.
fn mac_of(ns: &str, ifname: &str) -> Result<[u8; 6]> {
    let v = run_json(
        &format!("ip link show {ifname} in {ns}"),
        Command::new("ip").args(["-n", ns, "-j", "link", "show", "dev", ifname]),
    )?;
    let s = v[0]["address"].as_str().unwrap_or_default();
    let bytes: Vec<u8> = s
        .split(':')
        .filter_map(|b| u8::from_str_radix(b, 16).ok())
        .collect();
    bytes
        .try_into()
        .map_err(|_| anyhow!("{ifname} in {ns} has no MAC address ({s:?})"))
}

/// The attach mode `ip link` reports for the XDP program on `ifname` (1 driver, 2 generic).
fn xdp_attach_mode(ns: &str, ifname: &str) -> Result<Option<u64>> {
    let v = run_json(
        &format!("ip -d link show {ifname} in {ns}"),
        Command::new("ip").args(["-n", ns, "-j", "-d", "link", "show", "dev", ifname]),
    )?;
    Ok(v[0]["xdp"]["mode"].as_u64())
}

// --- CPU accounting ------------------------------------------------------------------------

/// Per CPU from /proc/stat: user nice system idle iowait irq softirq steal (USER_HZ ticks).
fn cpu_stat() -> Vec<[u64; 8]> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .map(|l| {
            let mut v = [0u64; 8];
            for (i, x) in l.split_whitespace().skip(1).take(8).enumerate() {
                v[i] = x.parse().unwrap_or(0);
            }
            v
        })
        .collect()
}

/// Nanoseconds per /proc/stat tick.
fn ns_per_tick() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    1e9 / if hz > 0 { hz as f64 } else { 100.0 }
}

/// Between two [`cpu_stat`]s: the busy share (%) of every CPU but `cpu` (what else ran) and
/// `cpu`'s steal share (%).
fn cpu_shares(before: &[[u64; 8]], after: &[[u64; 8]], cpu: usize) -> (f64, f64) {
    let n = before.len().min(after.len());
    let d = |i: usize, k: usize| after[i][k].saturating_sub(before[i][k]) as f64;
    let total = |i: usize| (0..8).map(|k| d(i, k)).sum::<f64>();
    let (mut busy, mut all) = (0.0, 0.0);
    for i in (0..n).filter(|&i| i != cpu) {
        let t = total(i);
        busy += t - d(i, 3) - d(i, 4) - d(i, 7);
        all += t;
    }
    let others = if all > 0.0 {
        100.0 * busy / all
    } else {
        f64::NAN
    };
    let steal = if cpu < n && total(cpu) > 0.0 {
        100.0 * d(cpu, 7) / total(cpu)
    } else {
        f64::NAN
    };
    (others, steal)
}

/// This thread's CPU time (ns): with tick-based accounting it includes the softirqs the thread
/// ran on its way out of a system call.
fn thread_cpu_ns() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e9 + ts.tv_nsec as f64
}

// --- the agents ----------------------------------------------------------------------------

/// How a node's calix-agent is configured (rendered to its TOML config file).
struct AgentSpec<'a> {
    dataplane: &'a str,
    uplinks: bool,
    nat_outgoing: bool,
    xdp_mode: Option<&'a str>,
    /// TOML appended at the end (after every table): `--snat-config`.
    extra: Option<&'a str>,
}

impl AgentSpec<'_> {
    fn render(&self, node: &str, dir: &Path) -> String {
        let mut s = format!(
            "node_name = {node:?}\nsocket = {:?}\ndataplane = {:?}\nlog_level = \"info\"\n\
             bpf_pin_root = {PIN_ROOT:?}\n",
            dir.join("agent.sock").display().to_string(),
            self.dataplane,
        );
        if self.uplinks {
            s.push_str(&format!("uplinks = [{UPLINK:?}]\n"));
        }
        s.push_str(&format!(
            "\n[datastore]\ntype = \"embedded\"\npath = {:?}\n\n[[pools]]\ncidr = {POOL:?}\n",
            dir.join("store.json").display().to_string()
        ));
        if self.nat_outgoing {
            s.push_str("natOutgoing = true\n");
        }
        if let Some(mode) = self.xdp_mode {
            s.push_str(&format!(
                "\n[xdp]\nenabled = true\nmode = {mode:?}\ndeny_cidrs = [{DENY_CIDR:?}]\n"
            ));
        }
        if let Some(extra) = self.extra {
            s.push('\n');
            s.push_str(extra.trim_end());
            s.push('\n');
        }
        s
    }
}

/// Starts calix-agent in `node` with `spec`, waits until it answers; its socket and config.
fn start_agent(
    g: &mut Guard,
    bins: &Path,
    node: &str,
    tag: &str,
    spec: &AgentSpec,
) -> Result<(PathBuf, String)> {
    let dir = g.dir.join(tag);
    std::fs::create_dir_all(&dir)?;
    let config = spec.render(node, &dir);
    let conf_path = dir.join("agent.toml");
    std::fs::write(&conf_path, &config)?;
    let log_path = dir.join("agent.log");
    let (out, err) = log_to(&log_path)?;
    g.pin_dirs.push(Path::new(PIN_ROOT).join(node));
    let child = in_netns_on(&bins.join("calix-agent"), node, None)?
        .arg("--config")
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("cannot start calix-agent")?;
    g.agents.push(child);
    let socket = dir.join("agent.sock");
    let ctl = bins.join("calixctl");
    if let Some(agent) = g.agents.last_mut() {
        wait_ready(
            &format!("calix-agent ({} dataplane)", spec.dataplane),
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
    Ok((socket, config))
}

/// A node namespace with its uplink to a new internet namespace: (node, internet).
fn uplinked(g: &mut Guard, tag: &str) -> Result<(String, String)> {
    let node = g.netns(tag)?;
    let inet = g.netns(&format!("{tag}-i"))?;
    ip(
        &node,
        &format!("link add {UPLINK} type veth peer name {PEER_IF} netns {inet}"),
    )?;
    ip(
        &node,
        &format!("addr add {NODE_UP}/{UP_PREFIX} dev {UPLINK}"),
    )?;
    ip(&node, &format!("link set {UPLINK} up"))?;
    ip(&inet, &format!("addr add {INET}/{UP_PREFIX} dev {PEER_IF}"))?;
    ip(&inet, &format!("link set {PEER_IF} up"))?;
    Ok((node, inet))
}

// --- outgoing traffic topologies -----------------------------------------------------------

/// One variant's wiring.
struct Topology {
    node: String,
    pod: String,
    inet: String,
    pod_ip: Ipv4Addr,
}

/// The agent config the calix SNAT variant ran with (for the report).
struct Setup {
    topo: Topology,
    config: Option<String>,
}

/// Builds variant `v`: node + agent + uplink + internet + pod + NAT rules + servers.
fn topology(g: &mut Guard, tools: &Tools, v: Variant, extra: Option<&str>) -> Result<Setup> {
    let (node, inet) = uplinked(g, v.tag())?;
    let pod = g.netns(&format!("{}-p", v.tag()))?;
    ip(&node, &format!("addr add {NODE_LO}/32 dev lo"))?;
    sysctl(&node, "net.ipv4.ip_forward=1")?;
    ip(&node, &format!("route add default via {INET}"))?;
    if !v.nat() {
        ip(&inet, &format!("route add {POOL} via {NODE_UP}"))?;
    }
    let spec = AgentSpec {
        dataplane: if v.ebpf() { "ebpf" } else { "kernel" },
        uplinks: v.ebpf(),
        nat_outgoing: v == Variant::CalixSnat,
        xdp_mode: None,
        extra: if v == Variant::CalixSnat { extra } else { None },
    };
    let (socket, config) = start_agent(g, &tools.bins, &node, v.tag(), &spec)?;
    let plugin = Plugin {
        label: v.label(),
        binary: tools.bins.join("calix"),
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
    let id = format!("{PREFIX}{}{}0123456789abcdef", std::process::id(), v.tag());
    let res = plugin.call(&Call {
        command: "ADD",
        args: format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={}-0;\
             K8S_POD_INFRA_CONTAINER_ID={id}",
            v.tag()
        ),
        container_id: id,
        netns: format!("/run/netns/{pod}"),
    })?;
    let pod_ip: Ipv4Addr = res["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("no IPv4 address in the ADD result {res}"))?;
    match v {
        Variant::Iptables => run_cmd(in_netns(Path::new("iptables"), &node)?.args([
            "-w",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-s",
            POOL,
            "!",
            "-d",
            POOL,
            "-o",
            UPLINK,
            "-j",
            "MASQUERADE",
        ]))?,
        Variant::Nftables => nft(
            g,
            &node,
            v.tag(),
            &format!(
                "table ip cxbnat {{\n  chain post {{\n    type nat hook postrouting priority \
                 srcnat; policy accept;\n    oifname {UPLINK:?} ip saddr {POOL} ip daddr != \
                 {POOL} masquerade\n  }}\n}}\n"
            ),
        )?,
        _ => {}
    }
    start_servers(g, tools, v, &pod, &inet)?;
    Ok(Setup {
        topo: Topology {
            node,
            pod,
            inet,
            pod_ip,
        },
        config: (v == Variant::CalixSnat).then_some(config),
    })
}

/// Loads ruleset `rules` into namespace `ns` (`nft -f`).
fn nft(g: &Guard, ns: &str, tag: &str, rules: &str) -> Result<()> {
    let path = g.dir.join(format!("{tag}.nft"));
    std::fs::write(&path, rules)?;
    run_cmd(in_netns(Path::new("nft"), ns)?.arg("-f").arg(&path))
}

/// The servers in the internet namespace (netperf and iperf3, pinned to the bench CPU), up and
/// listening; the pod's sysctls for TCP_CRR.
fn start_servers(g: &mut Guard, tools: &Tools, v: Variant, pod: &str, inet: &str) -> Result<()> {
    // As in dataplane.rs: every port, TIME_WAIT ports reused after 1 ms (the client closes
    // first), or connect() runs out of ports at ~32k connections/s.
    let mut sysctls = vec![
        "net.ipv4.ip_local_port_range=1024 65535",
        "net.ipv4.tcp_tw_reuse=1",
    ];
    if Path::new(TW_REUSE_DELAY).exists() {
        sysctls.push("net.ipv4.tcp_tw_reuse_delay=1");
    }
    for kv in sysctls {
        sysctl(pod, kv)?;
    }
    let listen = SocketAddr::from((INET, NETPERF_PORT)).to_string();
    let mut netperf = in_netns_on(&tools.bins.join("xtask"), inet, Some(tools.cpu))?;
    netperf.args(["netperf", "server", "--listen", &listen]);
    let mut iperf = in_netns_on(Path::new("nice"), inet, Some(tools.cpu))?;
    iperf.args([
        "-n",
        IPERF_NICE,
        IPERF3,
        "-s",
        "-B",
        &INET.to_string(),
        "-p",
        &IPERF_PORT.to_string(),
    ]);
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

/// One TCP connection from the pod to the internet: the source address the internet saw.
fn probe(t: &Topology) -> Result<Ipv4Addr> {
    let listener = join(spawn_in_netns(&t.inet, None, || {
        Ok(TcpListener::bind((INET, PROBE_PORT))?)
    })?)
    .context("probe listener")?;
    listener.set_nonblocking(true)?;
    let client = spawn_in_netns(&t.pod, None, || {
        TcpStream::connect_timeout(
            &SocketAddr::from((INET, PROBE_PORT)),
            Duration::from_secs(2),
        )
        .with_context(|| format!("connecting to {INET}:{PROBE_PORT}"))
    })?;
    let deadline = Instant::now() + Duration::from_secs(3);
    let seen = loop {
        match listener.accept() {
            Ok((_, peer)) => break Some(peer.ip()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).context("probe accept"),
        }
    };
    join(client)?;
    match seen {
        Some(std::net::IpAddr::V4(a)) => Ok(a),
        Some(a) => bail!("the internet saw an IPv6 source {a}"),
        None => bail!("the connection reached no listener"),
    }
}

// --- tools and measurements ----------------------------------------------------------------

struct Tools {
    bins: PathBuf,
    cpu: usize,
    /// ksoftirqd of `cpu`.
    ksoftirqd: Option<u32>,
}

impl Tools {
    /// `xtask netperf <mode>` from the pod to the internet's server for `secs`.
    fn netperf(&self, t: &Topology, mode: &str, secs: f64) -> Result<Value> {
        let to = SocketAddr::from((INET, NETPERF_PORT)).to_string();
        run_json(
            &format!("netperf {mode} {} → {to}", t.pod),
            in_netns_on(&self.bins.join("xtask"), &t.pod, Some(self.cpu))?.args([
                "netperf",
                mode,
                "--to",
                &to,
                "--secs",
                &secs.to_string(),
            ]),
        )
    }

    /// iperf3 (cubic) from the pod to the internet for `secs`: Gbit/s received.
    fn iperf(&self, t: &Topology, secs: u64) -> Result<f64> {
        let v = run_json(
            &format!("iperf3 {} → {INET}", t.pod),
            in_netns_on(Path::new(IPERF3), &t.pod, Some(self.cpu))?.args([
                "-c",
                &INET.to_string(),
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

/// One outgoing-traffic variant over every repetition.
#[derive(Default)]
struct Samples {
    crr: Vec<f64>,
    rr_p50: Vec<f64>,
    rr_p99: Vec<f64>,
    gbps: Vec<f64>,
    load: Vec<f64>,
    others_busy: Vec<f64>,
    steal: Vec<f64>,
}

fn measure(tools: &Tools, t: &Topology, secs: u64, s: &mut Samples) -> Result<String> {
    let load = loadavg();
    let cpu0 = cpu_stat();
    let crr = tools.netperf(t, "crr", secs as f64)?;
    let rr = tools.netperf(t, "rr", secs as f64)?;
    let gbps = tools.iperf(t, secs)?;
    let (others, steal) = cpu_shares(&cpu0, &cpu_stat(), tools.cpu);
    let rate = num(&crr, &["rate"])?;
    let (p50, p99) = (num(&rr, &["p50_us"])?, num(&rr, &["p99_us"])?);
    s.load.push(load);
    s.others_busy.push(others);
    s.steal.push(steal);
    s.crr.push(rate);
    s.rr_p50.push(p50);
    s.rr_p99.push(p99);
    s.gbps.push(gbps);
    Ok(format!(
        "(load {load:.2}, other CPUs {others:.0}% busy, steal {steal:.0}%): {rate:.0} conn/s, \
         RR p50 {p50:.1} µs p99 {p99:.1} µs, {gbps:.1} Gbit/s"
    ))
}

// --- drop filters --------------------------------------------------------------------------

/// One drop filter's wiring.
struct DropTopo {
    node: String,
    inet: String,
    /// The agent's socket (calix XDP).
    socket: Option<PathBuf>,
    frame: Vec<u8>,
}

/// Builds filter `f`: node + uplink + internet, then the calix agent with XDP or the nft rule.
fn drop_topology(g: &mut Guard, tools: &Tools, f: Filter) -> Result<DropTopo> {
    let (node, inet) = uplinked(g, f.tag())?;
    let mut socket = None;
    if let Some(mode) = f.xdp_mode() {
        let spec = AgentSpec {
            dataplane: "ebpf",
            uplinks: true,
            nat_outgoing: false,
            xdp_mode: Some(mode),
            extra: None,
        };
        socket = Some(start_agent(g, &tools.bins, &node, f.tag(), &spec)?.0);
        let want = if mode == "native" { 1 } else { 2 };
        let got = xdp_attach_mode(&node, UPLINK)?;
        if got != Some(want) {
            bail!("XDP on {UPLINK} attached in mode {got:?}, expected {want} ({mode})");
        }
    }
    // A set with interval flags: the same lookup structure for one CIDR as for many, like the
    // deny list's LPM trie.
    let set = format!(
        "  set deny {{\n    type ipv4_addr; flags interval;\n    elements = {{ {DENY_CIDR} }}\n  }}\n"
    );
    let rule = "ip saddr @deny counter drop";
    match f {
        Filter::NftIngress => nft(
            g,
            &node,
            f.tag(),
            &format!(
                "table netdev cxbdrop {{\n{set}  chain ingress {{\n    type filter hook ingress \
                 device {UPLINK:?} priority -500; policy accept;\n    {rule}\n  }}\n}}\n"
            ),
        )?,
        Filter::NftPrerouting => nft(
            g,
            &node,
            f.tag(),
            &format!(
                "table ip cxbdrop {{\n{set}  chain pre {{\n    type filter hook prerouting \
                 priority raw; policy accept;\n    {rule}\n  }}\n}}\n"
            ),
        )?,
        _ => {}
    }
    let mut frame = udp_frame(
        mac_of(&node, UPLINK)?,
        mac_of(&inet, PEER_IF)?,
        FLOOD_SRC,
        NODE_UP,
        FLOOD_PORT,
    );
    if f == Filter::Floor {
        frame[12..14].copy_from_slice(&FLOOR_ETHERTYPE.to_be_bytes());
    }
    Ok(DropTopo {
        node,
        inet,
        socket,
        frame,
    })
}

/// A minimal Ethernet + IPv4 + UDP frame (60 bytes: 18 bytes of payload), valid checksums.
fn udp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    port: u16,
) -> Vec<u8> {
    const PAYLOAD: usize = 18;
    let ip_len = (20 + 8 + PAYLOAD) as u16;
    let mut f = Vec::with_capacity(14 + ip_len as usize);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&ip_len.to_be_bytes());
    h[6] = 0x40; // DF
    h[8] = 64;
    h[9] = 17;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let csum = ipv4_checksum(&h);
    h[10..12].copy_from_slice(&csum.to_be_bytes());
    f.extend_from_slice(&h);
    f.extend_from_slice(&40000u16.to_be_bytes());
    f.extend_from_slice(&port.to_be_bytes());
    f.extend_from_slice(&((8 + PAYLOAD) as u16).to_be_bytes());
    // UDP checksum 0: none (allowed over IPv4).
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&[b'x'; PAYLOAD]);
    f
}

fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The kernel thread that runs CPU `cpu`'s softirqs when they pile up.
fn ksoftirqd_pid(cpu: usize) -> Option<u32> {
    let want = format!("ksoftirqd/{cpu}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == want).then_some(pid)
    })
}

/// A task's CPU time so far (ns, `/proc/<pid>/schedstat`); 0 when unknown.
fn task_cpu_ns(pid: Option<u32>) -> f64 {
    pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/schedstat")).ok())
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// What the flood thread reports.
struct Flooded {
    sent: u64,
    /// The thread's CPU time over the flood (ns), the receive softirqs it ran included.
    cpu_ns: f64,
    secs: f64,
}

/// Writes `frame` out of the internet's `eth0` for `secs` from a thread pinned to `cpu`:
/// `sendmmsg` batches on an `AF_PACKET` socket that bypasses the qdisc.
fn flood(inet: &str, cpu: usize, frame: Vec<u8>, secs: f64) -> Result<Flooded> {
    join(spawn_in_netns(inet, Some(cpu), move || {
        let name = std::ffi::CString::new(PEER_IF)?;
        // SAFETY: a NUL-terminated name; if_nametoindex looks it up in this thread's netns.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(std::io::Error::last_os_error()).context("if_nametoindex");
        }
        // SAFETY: socket(2); protocol 0: a send-only packet socket (it receives nothing).
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error()).context("AF_PACKET socket");
        }
        // SAFETY: a fresh fd this thread owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with an int option of the right size.
        if unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        } != 0
        {
            return Err(std::io::Error::last_os_error()).context("PACKET_QDISC_BYPASS");
        }
        // SAFETY: sockaddr_ll is plain data.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_protocol = (libc::ETH_P_IP as u16).to_be();
        to.sll_ifindex = ifindex as i32;
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&frame[..6]);
        let mut iov = libc::iovec {
            iov_base: frame.as_ptr() as *mut libc::c_void,
            iov_len: frame.len(),
        };
        // SAFETY: mmsghdr is plain data; every entry points at the same address and frame,
        // which outlive the sendmmsg calls below.
        let mut msgs: Vec<libc::mmsghdr> = (0..BATCH)
            .map(|_| {
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_name = (&mut to as *mut libc::sockaddr_ll).cast();
                m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                m.msg_hdr.msg_iov = &mut iov;
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs_f64(secs);
        let c0 = thread_cpu_ns();
        let mut sent = 0u64;
        while Instant::now() < end {
            // SAFETY: BATCH valid mmsghdrs (see above).
            let n = unsafe {
                libc::sendmmsg(fd.as_raw_fd(), msgs.as_mut_ptr(), BATCH as libc::c_uint, 0)
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if matches!(e.raw_os_error(), Some(libc::ENOBUFS) | Some(libc::EAGAIN)) {
                    continue;
                }
                return Err(e).context("sendmmsg");
            }
            sent += n as u64;
        }
        let cpu_ns = thread_cpu_ns() - c0;
        Ok(Flooded {
            sent,
            cpu_ns,
            secs: t0.elapsed().as_secs_f64(),
        })
    })?)
}

/// Packets the filter of `t` dropped so far (its own counter).
fn dropped(tools: &Tools, f: Filter, t: &DropTopo) -> Result<f64> {
    if let Some(socket) = &t.socket {
        let v = run_json(
            "calixctl bpf counters",
            Command::new(tools.bins.join("calixctl"))
                .arg("--socket")
                .arg(socket)
                .args(["bpf", "counters", "-o", "json"]),
        )?;
        return Ok(v["drops"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["interface"] == UPLINK && d["reason"] == XDP_REASON)
            .filter_map(|d| d["packets"].as_f64())
            .sum());
    }
    if f == Filter::Floor {
        let v = run_json(
            &format!("ip -s link show {UPLINK}"),
            Command::new("ip").args(["-n", &t.node, "-j", "-s", "link", "show", "dev", UPLINK]),
        )?;
        // An unhandled protocol counts as rx_dropped (rx_nohandler only for exact-match
        // deliveries); iproute2 leaves a key out while it is 0.
        let rx = &v[0]["stats64"]["rx"];
        return Ok(["dropped", "nohandler"]
            .iter()
            .filter_map(|k| rx[*k].as_f64())
            .sum());
    }
    let table = f.nft_table().context("a filter without a counter")?;
    let mut cmd = in_netns(Path::new("nft"), &t.node)?;
    cmd.args(["-j", "list", "table"]).args(table.split(' '));
    let v = run_json(&format!("nft list table {table}"), &mut cmd)?;
    Ok(nft_counter(&v))
}

/// The sum of every rule counter's packets in `nft -j` output.
fn nft_counter(v: &Value) -> f64 {
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o["rule"]["expr"].as_array())
        .flatten()
        .filter_map(|e| e["counter"]["packets"].as_f64())
        .sum()
}

/// One filter over every repetition.
#[derive(Default)]
struct DropSamples {
    sent_rate: Vec<f64>,
    drop_rate: Vec<f64>,
    /// Dropped by the filter / sent (%).
    share: Vec<f64>,
    /// The bench CPU's softirq time per dropped packet (ns).
    softirq_ns: Vec<f64>,
    /// The sender thread's and the bench CPU's ksoftirqd's CPU time (every receive softirq
    /// included) per dropped packet (ns).
    total_ns: Vec<f64>,
    /// The share (%) of that CPU time ksoftirqd ran.
    ksoftirqd: Vec<f64>,
    load: Vec<f64>,
    others_busy: Vec<f64>,
}

fn measure_drops(
    tools: &Tools,
    f: Filter,
    t: &DropTopo,
    secs: u64,
    s: &mut DropSamples,
) -> Result<String> {
    let load = loadavg();
    let d0 = dropped(tools, f, t)?;
    let cpu0 = cpu_stat();
    let k0 = task_cpu_ns(tools.ksoftirqd);
    let fl = flood(&t.inet, tools.cpu, t.frame.clone(), secs as f64)?;
    let k1 = task_cpu_ns(tools.ksoftirqd);
    let cpu1 = cpu_stat();
    let d1 = dropped(tools, f, t)?;
    let drops = d1 - d0;
    let softirq_ticks = cpu1
        .get(tools.cpu)
        .zip(cpu0.get(tools.cpu))
        .map_or(f64::NAN, |(a, b)| a[6].saturating_sub(b[6]) as f64);
    let (others, _) = cpu_shares(&cpu0, &cpu1, tools.cpu);
    if drops < 1.0 {
        bail!("{}: nothing dropped ({} frames sent)", f.label(), fl.sent);
    }
    let softirq_ns = softirq_ticks * ns_per_tick() / drops;
    let total_ns = (fl.cpu_ns + k1 - k0) / drops;
    let ksoftirqd = 100.0 * (k1 - k0) / (fl.cpu_ns + k1 - k0).max(1.0);
    let share = 100.0 * drops / (fl.sent.max(1) as f64);
    s.sent_rate.push(fl.sent as f64 / fl.secs);
    s.drop_rate.push(drops / fl.secs);
    s.share.push(share);
    s.softirq_ns.push(softirq_ns);
    s.total_ns.push(total_ns);
    s.ksoftirqd.push(ksoftirqd);
    s.load.push(load);
    s.others_busy.push(others);
    Ok(format!(
        "(load {load:.2}, other CPUs {others:.0}% busy): sent {:.2} Mpps, dropped {:.2} Mpps \
         ({share:.1}% of sent), softirq {softirq_ns:.0} ns/drop, sender+softirq {total_ns:.0} \
         ns/drop ({ksoftirqd:.0}% in ksoftirqd)",
        fl.sent as f64 / fl.secs / 1e6,
        drops / fl.secs / 1e6,
    ))
}

// --- run -----------------------------------------------------------------------------------

pub fn run(reps: usize, secs: u64, quick: bool, snat_config: Option<PathBuf>) -> Result<()> {
    util::require_root("the snat benchmark")?;
    if reps < 1 || secs < 1 {
        bail!("--reps and --secs must be at least 1");
    }
    for tool in [IPERF3, "nft", "iptables", "sysctl"] {
        if output(Command::new("sh").args(["-c", &format!("command -v {tool}")])).is_err() {
            bail!("{tool} is missing: cargo xtask setup installs it");
        }
    }
    let extra = match &snat_config {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("cannot read --snat-config {}", p.display()))?,
        ),
        None => None,
    };
    let t_start = Instant::now();
    let rev = git_rev(&util::workspace_root());
    println!("[setup] building release binaries (cargo build --release --workspace --bins)");
    let bins = util::build_bins_release()?;
    remove_stale(PREFIX, PIN_ROOT)?;
    catch_interrupts();

    let machine = Machine::read();
    let cpu = if machine.cpus > 1 { 1 } else { 0 };
    let tools = Tools {
        bins,
        cpu,
        ksoftirqd: ksoftirqd_pid(cpu),
    };
    let prefix = format!("{PREFIX}-{}", std::process::id());
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    let mut g = Guard::new(prefix, PIN_ROOT, dir);

    // Outgoing traffic: every variant built, probed and warmed up before anything is timed.
    let mut topo: Vec<Result<Topology, String>> = Vec::with_capacity(VARIANTS.len());
    let mut snat_agent_config = None;
    for v in VARIANTS {
        check_interrupted()?;
        let built = topology(&mut g, &tools, v, extra.as_deref())
            .with_context(|| format!("setting up {}", v.label()))
            .and_then(|s| {
                let want = if v.nat() { NODE_UP } else { s.topo.pod_ip };
                match probe(&s.topo) {
                    // Translated, and not by a kernel rule someone left in the node.
                    Ok(seen) if seen == want && v == Variant::CalixSnat => {
                        let rules = output(in_netns(Path::new("nft"), &s.topo.node)?.args(["list", "ruleset"]))?;
                        if rules.contains("masquerade") || rules.contains("snat") {
                            bail!("the node has a kernel NAT rule, so eBPF SNAT is not what translates:\n{rules}");
                        }
                        Ok(s)
                    }
                    Ok(seen) if seen == want => Ok(s),
                    Ok(seen) => Err(anyhow!(
                        "the internet saw the pod's connection from {seen}, not {want}{}",
                        if seen == s.topo.pod_ip {
                            " (not translated)"
                        } else {
                            ""
                        }
                    )),
                    Err(e) if v.nat() => Err(anyhow!(
                        "not translated: the pod's connection to the internet failed ({:#}; \
                         the internet has no route back to {POOL}, so only a translated \
                         connection is answered)",
                        e
                    )),
                    Err(e) => Err(e.context(format!(
                        "a connection from the pod ({}) to the internet ({INET}) failed",
                        s.topo.pod_ip
                    ))),
                }
            });
        let s = match built {
            Ok(s) => s,
            Err(e) if v == Variant::CalixSnat => {
                check_interrupted()?;
                snat_agent_config =
                    std::fs::read_to_string(g.dir.join(v.tag()).join("agent.toml")).ok();
                let reason = unavailable_reason(&e);
                println!("[setup] {}: not available: {reason}", v.label());
                topo.push(Err(reason));
                continue;
            }
            Err(e) => return Err(e),
        };
        if s.config.is_some() {
            snat_agent_config = s.config;
        }
        let t = s.topo;
        let w = tools
            .netperf(&t, "crr", WARMUP_SECS)
            .and_then(|_| tools.netperf(&t, "rr", WARMUP_SECS))
            .with_context(|| format!("{}: warm-up", v.label()))?;
        println!(
            "[setup] {}: {} → {} ({} seen as {}), warm-up RR p50 {:.1} µs",
            v.label(),
            t.pod,
            t.inet,
            t.pod_ip,
            if v.nat() { NODE_UP } else { t.pod_ip },
            num(&w, &["p50_us"])?
        );
        topo.push(Ok(t));
    }

    // Drops: every filter built and checked to drop before anything is timed.
    let mut dtopo = Vec::with_capacity(FILTERS.len());
    let mut xdp_prog_ns: [Option<f64>; 5] = Default::default();
    for f in FILTERS {
        check_interrupted()?;
        let t = drop_topology(&mut g, &tools, f)
            .with_context(|| format!("setting up {}", f.label()))?;
        let mut warm = DropSamples::default();
        let line = measure_drops(&tools, f, &t, 1, &mut warm)
            .with_context(|| format!("{}: warm-up", f.label()))?;
        println!("[setup] {}: warm-up {line}", f.label());
        if f.xdp_mode().is_some() {
            let ns = xdp_program_ns(&tools, &t)
                .with_context(|| format!("{}: the program's run time", f.label()))?;
            println!(
                "[setup] {}: xdp_host_dev {ns:.0} ns per packet (kernel BPF stats)",
                f.label()
            );
            xdp_prog_ns[f as usize] = Some(ns);
        }
        dtopo.push(t);
    }

    let mut res: [Samples; 5] = Default::default();
    let mut dres: [DropSamples; 5] = Default::default();
    for rep in 0..reps {
        let mut order = VARIANTS;
        order.rotate_left(rep % VARIANTS.len());
        for v in order {
            check_interrupted()?;
            let i = v as usize;
            let Ok(t) = &topo[i] else { continue };
            let line = measure(&tools, t, secs, &mut res[i])
                .or_else(|e| check_interrupted().and(Err(e)))
                .with_context(|| format!("{} (repetition {})", v.label(), rep + 1))?;
            println!("[rep {}/{reps}] {} {line}", rep + 1, v.label());
        }
        let mut order = FILTERS;
        order.rotate_left(rep % FILTERS.len());
        for f in order {
            check_interrupted()?;
            let i = f as usize;
            let line = measure_drops(&tools, f, &dtopo[i], secs, &mut dres[i])
                .or_else(|e| check_interrupted().and(Err(e)))
                .with_context(|| format!("{} (repetition {})", f.label(), rep + 1))?;
            println!("[rep {}/{reps}] {} {line}", rep + 1, f.label());
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
        machine,
        rev,
        iperf_version: output(Command::new(IPERF3).arg("--version"))
            .ok()
            .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
            .unwrap_or_else(|| "iperf3".into()),
        nft_version: output(Command::new("nft").arg("--version"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "nft".into()),
        iptables_version: output(Command::new("iptables").arg("--version"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "iptables".into()),
        unavailable: topo.iter().map(|t| t.as_ref().err().cloned()).collect(),
        snat_config: snat_config.map(|p| p.display().to_string()),
        snat_agent_config,
        res,
        dres,
        xdp_prog_ns,
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
    std::fs::write(out.join("snat.md"), &md)?;
    chart(&out.join("snat.svg"), &report)?;
    println!(
        "wrote {} and {}",
        out.join("snat.md").display(),
        out.join("snat.svg").display()
    );
    Ok(())
}

/// Why calix SNAT could not be measured, in one line: the agent's last log line when it did
/// not come up, else the error chain.
fn unavailable_reason(e: &anyhow::Error) -> String {
    let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
    let text = chain.join(": ");
    let one_line = match text.split_once(" did not come up:") {
        Some((head, log)) => {
            let last = log
                .lines()
                .rev()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("(empty log)");
            format!("{head} exited: {last}")
        }
        None => text.lines().map(str::trim).collect::<Vec<_>>().join(" "),
    };
    let mut s: String = one_line.chars().take(400).collect();
    if s.len() < one_line.len() {
        s.push('…');
    }
    s
}

// --- report --------------------------------------------------------------------------------

struct Report {
    reps: usize,
    secs: u64,
    quick: bool,
    cpu: usize,
    machine: Machine,
    rev: String,
    iperf_version: String,
    nft_version: String,
    iptables_version: String,
    /// Per variant: why it was not measured.
    unavailable: Vec<Option<String>>,
    snat_config: Option<String>,
    snat_agent_config: Option<String>,
    res: [Samples; 5],
    dres: [DropSamples; 5],
    /// Per filter: the XDP program's own run time per packet (kernel BPF stats).
    xdp_prog_ns: [Option<f64>; 5],
}

/// `xdp_host_dev`'s average run time per packet over an untimed one-second flood of `t`
/// (kernel BPF statistics; only the flooded filter's program runs meanwhile).
fn xdp_program_ns(tools: &Tools, t: &DropTopo) -> Result<f64> {
    let (ns, _) = program_run_time("xdp_host_dev", || {
        flood(&t.inet, tools.cpu, t.frame.clone(), 1.0).map(drop)
    })?;
    Ok(ns)
}

impl Report {
    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    fn dget(&self, f: Filter) -> &DropSamples {
        &self.dres[f as usize]
    }

    fn unavailable(&self, v: Variant) -> Option<&str> {
        self.unavailable.get(v as usize).and_then(|u| u.as_deref())
    }

    fn row(&self, v: Variant) -> String {
        if let Some(why) = self.unavailable(v) {
            return format!(
                "| {} | not available: {} | | | | | |\n",
                v.label(),
                why.replace('|', "\\|")
            );
        }
        let s = self.get(v);
        format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            v.label(),
            fmt_spread_with(&s.crr, "", fmt_0),
            fmt_spread_with(&s.rr_p50, " µs", fmt_1),
            fmt_spread_with(&s.rr_p99, " µs", fmt_1),
            fmt_spread_with(&s.gbps, " Gbit/s", fmt_1),
            loads(&s.load),
            fmt_spread_with(&s.others_busy, " %", fmt_0),
        )
    }

    fn ratio_row(&self, a: Variant, b: Variant) -> String {
        let (x, y) = (self.get(a), self.get(b));
        let na = self.unavailable(a).is_some() || self.unavailable(b).is_some();
        let r = |p: fn(&Samples) -> &Vec<f64>| {
            if na {
                "–".into()
            } else {
                ratio(median(p(x)), median(p(y)))
            }
        };
        format!(
            "| {} / {} | {} | {} | {} | {} | | |\n",
            a.label(),
            b.label(),
            r(|s| &s.crr),
            r(|s| &s.rr_p50),
            r(|s| &s.rr_p99),
            r(|s| &s.gbps),
        )
    }

    /// Per repetition: this filter's CPU per drop minus the floor's in the same repetition.
    fn above_floor(&self, f: Filter) -> Vec<f64> {
        let floor = &self.dget(Filter::Floor).total_ns;
        self.dget(f)
            .total_ns
            .iter()
            .zip(floor)
            .map(|(t, fl)| t - fl)
            .collect()
    }

    fn drop_row(&self, f: Filter) -> String {
        let s = self.dget(f);
        let nft = self.dget(Filter::NftIngress);
        let mpps = |v: &[f64]| v.iter().map(|r| r / 1e6).collect::<Vec<_>>();
        let per_cpu: Vec<f64> = s.total_ns.iter().map(|ns| 1e3 / ns).collect();
        let (above, vs_nft_above) = if f == Filter::Floor {
            ("–".to_string(), "–".to_string())
        } else {
            let a = self.above_floor(f);
            (
                fmt_spread_with(&a, " ns", fmt_0),
                ratio(median(&self.above_floor(Filter::NftIngress)), median(&a)),
            )
        };
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            f.label(),
            fmt_spread_with(&mpps(&s.sent_rate), "", fmt_2),
            fmt_spread_with(&mpps(&s.drop_rate), "", fmt_2),
            fmt_spread_with(&s.share, " %", fmt_1),
            fmt_spread_with(&s.total_ns, " ns", fmt_0),
            fmt_spread_with(&per_cpu, "", fmt_2),
            above,
            vs_nft_above,
            ratio(median(&nft.total_ns), median(&s.total_ns)),
            fmt_spread_with(&s.softirq_ns, " ns", fmt_0),
        )
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let mut t = Vec::new();
        let (c, m, r) = (
            self.get(Variant::CalixSnat),
            self.get(Variant::Iptables),
            self.get(Variant::Routing),
        );
        let na = self.unavailable(Variant::CalixSnat);
        let (cc, mc, rc) = (median(&c.crr), median(&m.crr), median(&r.crr));
        let (cl, ml) = (median(&c.rr_p50), median(&m.rr_p50));
        let (cg, mg) = (median(&c.gbps), median(&m.gbps));
        let judged = |ok: bool| if na.is_some() { None } else { Some(ok) };
        t.push((
            format!(
                "calix SNAT conn/s ≥ 1.15× iptables MASQUERADE: {} vs {} ({})",
                fmt_0(cc),
                fmt_0(1.15 * mc),
                ratio(cc, mc)
            ),
            judged(cc >= 1.15 * mc),
        ));
        t.push((
            format!(
                "calix SNAT conn/s ≈ 0.9× routing without NAT: {} vs {} ({})",
                fmt_0(cc),
                fmt_0(0.9 * rc),
                ratio(cc, rc)
            ),
            judged(cc >= 0.9 * rc),
        ));
        t.push((
            format!(
                "calix SNAT TCP_RR p50 ≤ 0.9× MASQUERADE's: {} µs vs {} µs ({})",
                fmt_1(cl),
                fmt_1(0.9 * ml),
                ratio(cl, ml)
            ),
            judged(cl <= 0.9 * ml),
        ));
        t.push((
            format!(
                "calix SNAT throughput ≥ MASQUERADE's: {} vs {} Gbit/s ({})",
                fmt_1(cg),
                fmt_1(mg),
                ratio(cg, mg)
            ),
            judged(cg >= mg),
        ));
        let nft = median(&self.above_floor(Filter::NftIngress));
        for f in [Filter::XdpNative, Filter::XdpGeneric] {
            let x = median(&self.above_floor(f));
            t.push((
                format!(
                    "{} drops ≥ 3× nft netdev ingress's rate per CPU (CPU per drop above the \
                     floor ≤ a third of nft's): {} vs {} ns ({})",
                    f.label(),
                    fmt_0(x),
                    fmt_0(nft),
                    ratio(nft, x)
                ),
                Some(x * 3.0 <= nft),
            ));
        }
        t
    }

    fn load_note(&self) -> String {
        let mut others: Vec<f64> = self
            .res
            .iter()
            .flat_map(|r| r.others_busy.iter().copied())
            .collect();
        others.extend(self.dres.iter().flat_map(|r| r.others_busy.iter().copied()));
        let mut load: Vec<f64> = self
            .res
            .iter()
            .flat_map(|r| r.load.iter().copied())
            .collect();
        load.extend(self.dres.iter().flat_map(|r| r.load.iter().copied()));
        let steal: Vec<f64> = self
            .res
            .iter()
            .flat_map(|r| r.steal.iter().copied())
            .collect();
        let max_others = others.iter().copied().fold(f64::NAN, f64::max);
        let mut s = format!(
            "\nLoad: the load average includes the bench itself (CPU {} is kept busy), so \
             DESIGN.md §10's \"rerun above ~1.2\" is judged on the other CPU(s): {} busy during \
             the measurements (median [min–max]; the agents and this bench's own process \
             included); steal on the bench CPU {} %. Load averages before the variants: {}.\n",
            self.cpu,
            fmt_spread_with(&others, " %", fmt_0),
            fmt_spread_with(&steal, "", fmt_0),
            loads(&load),
        );
        if max_others > OTHERS_BUSY_LIMIT {
            s.push_str(&format!(
                "\n**Something else used up to {max_others:.0} % of the other CPU(s) during a \
                 measurement** (above {OTHERS_BUSY_LIMIT:.0} %: the machine was shared; rerun \
                 for publishable numbers).\n"
            ));
        }
        s
    }

    fn markdown(&self) -> String {
        let m = &self.machine;
        let mut s = String::new();
        s.push_str(
            "# Pod → outside: calix eBPF SNAT vs MASQUERADE vs routing; XDP deny list vs nftables \
             drops\n\n",
        );
        if self.quick {
            s.push_str("**Development run (`--quick`): too short to publish.**\n\n");
        }
        s.push_str(&format!(
            "Measured {} by `cargo xtask bench snat --reps {} --secs {}{}` on {} × {} ({} CPUs, \
             Debian 12), kernel {}. calix {}: release build, `calix-agent` with the embedded \
             datastore, the pod wired by the `calix` CNI plugin; {}; {}; {}.\n\n",
            m.date,
            self.reps,
            self.secs,
            self.snat_config
                .as_ref()
                .map(|p| format!(" --snat-config {p}"))
                .unwrap_or_default(),
            m.cpu,
            m.cpus,
            m.cpus,
            m.kernel,
            self.rev,
            self.iptables_version,
            self.nft_version,
            self.iperf_version,
        ));
        s.push_str(&format!(
            "## Pod → outside\n\nPer variant: a node namespace (calix-agent), one pod, an uplink \
             veth `{UPLINK}` ({NODE_UP}/{UP_PREFIX}) to an \"internet\" namespace ({INET}) that \
             runs the servers; the node's default route points there. **routing (no NAT)**: \
             kernel mode, the internet routes {POOL} back via the node (the ceiling). **calix \
             eBPF, no NAT**: the same with the eBPF dataplane and its uplink programs. \
             **iptables MASQUERADE**: kernel mode, no route back, `iptables -t nat -A \
             POSTROUTING -s {POOL} ! -d {POOL} -o {UPLINK} -j MASQUERADE` in the node (conntrack \
             runs in that namespace only). **nftables masquerade**: the same as an `ip` nat \
             table, `oifname {UPLINK:?} ip saddr {POOL} ip daddr != {POOL} masquerade`. **calix \
             eBPF SNAT**: `dataplane = \"ebpf\"`, `uplinks = [\"{UPLINK}\"]`, the pool with \
             `natOutgoing = true`, no route back. Before timing, a probe connection shows the \
             source the internet sees (the pod's address for the routing rows, {NODE_UP} for \
             the NAT rows). Per variant and repetition, each {} s, client (pod) and servers \
             (internet) pinned to CPU {}: **TCP_CRR** (`xtask netperf crr`: connect, 1-byte \
             request, 1-byte reply, close; the pod uses ports 1024–65535 with `tcp_tw_reuse`), \
             **TCP_RR** (`xtask netperf rr`: 1-byte ping-pong, every round trip timed) and \
             **throughput** (`iperf3 -C cubic`, one stream, receiver at nice {IPERF_NICE}). {} \
             repetitions, variants interleaved (order rotated every repetition); median \
             [min–max] over repetitions.\n\n",
            self.secs, self.cpu, self.reps,
        ));
        s.push_str(
            "| variant | conn/s (TCP_CRR) | TCP_RR p50 | TCP_RR p99 | throughput | load before | \
             other CPU busy |\n|---|---|---|---|---|---|---|\n",
        );
        for v in VARIANTS {
            s.push_str(&self.row(v));
        }
        for (a, b) in [
            (Variant::CalixSnat, Variant::Iptables),
            (Variant::CalixSnat, Variant::Routing),
            (Variant::CalixSnat, Variant::EbpfRouting),
            (Variant::Iptables, Variant::Routing),
            (Variant::Nftables, Variant::Routing),
            (Variant::Nftables, Variant::Iptables),
            (Variant::EbpfRouting, Variant::Routing),
        ] {
            s.push_str(&self.ratio_row(a, b));
        }
        s.push_str(
            "\nRatios of medians: above 1× is better for conn/s and throughput, below 1× for the \
             latencies.\n",
        );
        if let Some(c) = &self.snat_agent_config {
            s.push_str(&format!(
                "\nThe calix eBPF SNAT node's agent config (paths of this run):\n\n```toml\n{}```\n",
                c
            ));
        }
        s.push_str(&format!(
            "\n## Dropping a denied source: XDP vs nftables\n\nPer filter, a node namespace with \
             the uplink and an internet namespace: **calix XDP native** / **generic** (the agent \
             with `[xdp] enabled = true, mode = \"native\"` / `\"generic\"`, `deny_cidrs = \
             [\"{DENY_CIDR}\"]`; the attach mode checked with `ip -d link`), **nft netdev \
             ingress** (a `netdev` table's ingress hook on `{UPLINK}`, priority -500: the same \
             place in the receive path as generic XDP, the fair kernel equivalent) and **nft ip \
             prerouting** (priority raw, after the IP layer's checks); both nft rules are `ip \
             saddr @deny counter drop` on an interval set holding {DENY_CIDR} (a lookup that \
             scales like the deny list's LPM trie). **no filter (floor)**: the same frames with \
             EtherType 0x{FLOOR_ETHERTYPE:04x}, which no protocol handler takes (dropped at the \
             end of the receive core, counted in the uplink's `rx_dropped`): the sender, the veth and the \
             backlog, what every filter costs on top of. A sender thread in the internet namespace, \
             pinned to CPU {}, writes 60-byte UDP frames from {FLOOD_SRC} to {NODE_UP}:{FLOOD_PORT} \
             with `sendmmsg` ({BATCH} per call) on an `AF_PACKET` socket with \
             `PACKET_QDISC_BYPASS`, {} s per filter and repetition, filters interleaved. On a \
             veth the receive side runs on the sender's CPU, in softirq: generic XDP and nft \
             from the backlog `netif_rx` filled, native XDP in the receiving veth's NAPI poll \
             (the skb converted to an XDP buffer). **CPU per drop** is the CPU time of the sender thread (`CLOCK_THREAD_CPUTIME_ID`, which \
             includes the softirqs it ran on its way out of `sendmmsg`) plus that of the CPU's \
             `ksoftirqd` (which takes over when softirqs pile up; its share: {}) per dropped \
             packet; Mpps per CPU = 1 / that time; **above the floor** is that minus the floor's \
             in the same repetition: the filter's own cost. The last column, the CPU's softirq \
             time per drop from /proc/stat, is only indicative: this kernel has no \
             `CONFIG_IRQ_TIME_ACCOUNTING`, so it is tick-sampled, and it came out bimodal \
             (~250 or ~600 ns for the same filter) while this bench was written. Drops are the filters' own counters (`calixctl bpf counters`: \
             `{XDP_REASON}` on `{UPLINK}`; the nft rule's counter).\n\n",
            self.cpu,
            self.secs,
            FILTERS
                .iter()
                .map(|&f| format!(
                    "{} {}",
                    f.label(),
                    fmt_spread_with(&self.dget(f).ksoftirqd, " %", fmt_0)
                ))
                .collect::<Vec<_>>()
                .join(", "),
        ));
        s.push_str(
            "| filter | sent Mpps | dropped Mpps | dropped / sent | CPU per drop | Mpps per CPU \
             | above the floor | vs nft ingress (above the floor) | vs nft ingress (whole) | \
             softirq per drop (indicative) |\n|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for f in FILTERS {
            s.push_str(&self.drop_row(f));
        }
        s.push_str(
            "\n\"vs nft ingress\": nft netdev ingress's CPU time per drop / this filter's (above \
             1×: cheaper than nft, i.e. more drops per CPU). A veth is not a NIC: its skb exists before any hook runs, so \
             XDP cannot show here what it saves on a real driver (the skb allocation); native \
             XDP on a veth even converts the skb into an XDP buffer first.\n",
        );
        let prog: Vec<String> = FILTERS
            .iter()
            .filter_map(|&f| {
                self.xdp_prog_ns[f as usize].map(|ns| format!("{} {ns:.0} ns", f.label()))
            })
            .collect();
        if !prog.is_empty() {
            s.push_str(&format!(
                "\nThe XDP program itself (`xdp_host_dev`: parse, deny-list LPM lookup, failsafe \
                 port lookup, drop counter; kernel BPF run-time statistics over an untimed 1 s \
                 flood, which include two clock reads per run): {} per packet. The rest of the \
                 XDP rows' cost above the floor is the kernel's XDP path on a veth, not the \
                 program.\n",
                prog.join(", ")
            ));
        }
        s.push_str("\nTargets (issue 6, medians):\n\n");
        for (text, met) in self.targets() {
            s.push_str(&format!(
                "- {} {text}\n",
                match met {
                    Some(true) => "met:",
                    Some(false) => "**not met**:",
                    None => "pending (calix SNAT not available):",
                }
            ));
        }
        s.push_str(&self.load_note());
        s.push_str("\n![snat chart](snat.svg)\n");
        s
    }
}

fn chart(path: &Path, r: &Report) -> Result<()> {
    let root = super::chart_root(
        path,
        (1200, 820),
        &format!(
            "Pod → outside and drop filters, medians of {} reps × {} s ({})",
            r.reps, r.secs, r.machine.date
        ),
    )?;
    let panels = root.split_evenly((2, 2));
    let series = |f: &dyn Fn(&Samples) -> Vec<Option<f64>>| -> Vec<super::Series> {
        VARIANTS
            .iter()
            .map(|&v| {
                let values = if r.unavailable(v).is_some() {
                    f(&Samples::default()).iter().map(|_| None).collect()
                } else {
                    f(r.get(v))
                };
                (v.label(), v.color(), values)
            })
            .collect()
    };
    panel(
        &panels[0],
        "connections/s (TCP_CRR), higher is better",
        "conn/s",
        &["pod → outside"],
        &series(&|s| vec![Some(median(&s.crr))]),
        &|_, _, v| fmt_0(v),
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
    let dseries: Vec<super::Series> = FILTERS
        .iter()
        .map(|&f| {
            let s = r.dget(f);
            (
                f.label(),
                f.color(),
                vec![
                    Some(median(&s.total_ns)),
                    (f != Filter::Floor).then(|| median(&r.above_floor(f))),
                ],
            )
        })
        .collect();
    panel(
        &panels[3],
        "CPU ns per dropped packet, lower is better",
        "ns",
        &["sender + receive", "above the floor"],
        &dseries,
        &|_, _, v| fmt_0(v),
        None,
    )?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flood_frame_is_a_valid_udp_packet() {
        let f = udp_frame([2; 6], [4; 6], FLOOD_SRC, NODE_UP, FLOOD_PORT);
        assert_eq!(f.len(), 60);
        assert_eq!(&f[12..14], &[0x08, 0x00]);
        // A header with its checksum sums to 0xffff: the checksum of it is 0.
        assert_eq!(ipv4_checksum(&f[14..34]), 0);
        assert_eq!(&f[26..30], &FLOOD_SRC.octets());
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), FLOOD_PORT);
    }

    #[test]
    fn nft_counters_are_summed_from_json() {
        let v: Value = serde_json::from_str(
            r#"{"nftables":[{"metainfo":{}},{"table":{"family":"netdev"}},
            {"rule":{"expr":[{"match":{}},{"counter":{"packets":5,"bytes":300}},{"drop":null}]}}]}"#,
        )
        .unwrap_or_default();
        assert_eq!(nft_counter(&v), 5.0);
    }

    #[test]
    fn agent_config_has_keys_before_tables() {
        let spec = AgentSpec {
            dataplane: "ebpf",
            uplinks: true,
            nat_outgoing: true,
            xdp_mode: None,
            extra: Some("[nat]\nfoo = 1"),
        };
        let c = spec.render("n1", Path::new("/tmp/x"));
        let first_table = c.find("\n[").unwrap_or(0);
        assert!(c.find("uplinks").is_some_and(|i| i < first_table));
        assert!(c.contains("natOutgoing = true"));
        assert!(c.trim_end().ends_with("foo = 1"));
    }
}
