//! `cargo xtask bench snat` (issue 6): pod → outside traffic through calix eBPF SNAT against
//! the kernel's MASQUERADE (iptables, nftables) and plain routing without NAT (the ceiling), and
//! the XDP deny list's cost per dropped packet against nftables drop rules, in one run on one
//! machine (DESIGN.md §10).
//!
//! **Outgoing traffic.** One topology per variant, all built before any measurement: a
//! test-bed node (a namespace running a release `calix-agent`, its pins under
//! `/sys/fs/bpf/<node>`), one pod wired by the real `calix` CNI plugin, and an uplink veth
//! (`cxup0`, 198.18.0.1/24) to an "internet" namespace (`eth0`, 198.18.0.2/24) that runs the
//! servers. The node routes by default via the internet.
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
//! calix SNAT, which is reported as "not available: <reason>" while the rest still runs. The
//! test bed's traffic tools measure each as `bench dataplane` does: TCP_CRR, TCP_RR, iperf3.
//!
//! **Drops.** Per filter, a node namespace with the uplink and an internet namespace: **calix
//! XDP native** and **generic** (`[xdp] enabled = true`, `deny_cidrs = ["198.51.100.0/24"]`),
//! **nft netdev ingress** (a `netdev` table's ingress hook on the uplink: where XDP generic
//! runs, the closest kernel equivalent), **nft ip prerouting** (priority raw) and the floor (no
//! filter). The test bed's flood writes 60-byte UDP frames from 198.51.100.7 for `--secs`
//! from a thread in the internet namespace pinned to the bench CPU. On a veth every receive
//! runs on the sender's CPU, in softirq (generic XDP and nft from the backlog `netif_rx`
//! fills, native XDP in the receiving veth's NAPI poll), so that CPU's softirq time
//! (/proc/stat) per dropped packet is the filter side's cost, and the sender thread's CPU time
//! (which includes the softirqs it ran) per packet is the total. Drops are counted by the
//! filters themselves (`calixctl bpf counters`, nft counters, the uplink's `rx_dropped`).
//!
//! Everything is named `cxb-<pid>-…` and removed on drop, on error and Ctrl-C too. Writes
//! docs/bench/snat.md and docs/bench/snat.svg (with `--quick`, target/bench/ instead).
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use calix_testbed::packets::{eth, udp_with, Ip4, ETH_P_IP, ETH_P_LOCAL_EXP, UDP};
use calix_testbed::traffic::cpu::{ksoftirqd_pid, load_average, task_cpu_ns, CpuStat};
use calix_testbed::traffic::flood::{flood, BATCH};
use calix_testbed::traffic::{Tools, Traffic, IPERF_NICE};
use calix_testbed::{json, uplink, AgentSpec, Dataplane, Guarded, Netns, Node, Plugin};
use plotters::style::RGBColor;
use serde_json::Value;

use super::chart::{self, traffic_panels, Layout, Panel, Series};
use super::harness::{check_interrupted, order, repetition, version, warm_up, Bench, Compared};
use super::report::{
    busy_note, fmt_0, fmt_1, fmt_2, fmt_spread_with, heading, median, ratio, targets,
    Traffic as Samples,
};

const POOL: &str = "10.244.0.0/16";
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
const PROBE_PORT: u16 = 7002;
const XDP_REASON: &str = "xdp_denied_source";
/// The floor's EtherType (IEEE 802 local experimental): no protocol handler takes it.
const FLOOR_ETHERTYPE: u16 = ETH_P_LOCAL_EXP;

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

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Routing => ("routing (no NAT)", "rt", chart::GREY),
            Self::EbpfRouting => ("calix eBPF, no NAT", "ert", chart::PALE_BLUE),
            Self::Iptables => ("iptables MASQUERADE", "ipt", chart::ORANGE),
            Self::Nftables => ("nftables masquerade", "nft", chart::RED),
            Self::CalixSnat => ("calix eBPF SNAT", "snat", chart::BLUE),
        }
    }
}

impl Variant {
    /// Whether the node translates the pod's address (no route back to the pool).
    fn nat(self) -> bool {
        matches!(self, Self::Iptables | Self::Nftables | Self::CalixSnat)
    }

    fn ebpf(self) -> bool {
        matches!(self, Self::EbpfRouting | Self::CalixSnat)
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

impl Compared for Filter {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::XdpNative => ("calix XDP native", "xn", chart::BLUE),
            Self::XdpGeneric => ("calix XDP generic", "xg", chart::PALE_BLUE),
            Self::NftIngress => ("nft netdev ingress", "fi", chart::ORANGE),
            Self::NftPrerouting => ("nft ip prerouting", "fp", chart::RED),
            Self::Floor => ("no filter (floor)", "fl", chart::GREY),
        }
    }
}

impl Filter {
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
}

// --- topologies ----------------------------------------------------------------------------

/// The agent's config file beyond what the test bed passes as flags (node name, socket,
/// datastore path, dataplane, log level, pin root): the uplink, the pool, the XDP deny list,
/// then `extra` (`--snat-config`) after every table.
fn agent_config(
    uplinks: bool,
    nat_outgoing: bool,
    xdp: Option<&str>,
    extra: Option<&str>,
) -> String {
    let mut s = String::new();
    if uplinks {
        s.push_str(&format!("uplinks = [{UPLINK:?}]\n\n"));
    }
    s.push_str(&format!("[[pools]]\ncidr = {POOL:?}\n"));
    if nat_outgoing {
        s.push_str("natOutgoing = true\n");
    }
    if let Some(mode) = xdp {
        s.push_str(&format!(
            "\n[xdp]\nenabled = true\nmode = {mode:?}\ndeny_cidrs = [{DENY_CIDR:?}]\n"
        ));
    }
    if let Some(extra) = extra {
        s.push_str(&format!("\n{}\n", extra.trim_end()));
    }
    s
}

/// A node and its uplink to a new internet namespace. The agent runs `config` once started
/// (the caller wires the rest first); without one it never starts (the nft and floor filters).
fn uplinked(
    b: &Bench,
    tag: &str,
    dataplane: Dataplane,
    config: Option<String>,
) -> Result<(Node, Netns)> {
    let inet = b.netns(&format!("{tag}-i"))?;
    let node = Node::new(
        b.name(tag),
        AgentSpec {
            config,
            ..b.spec(dataplane)
        },
    )?;
    uplink(&node.ns, &inet, UPLINK, &format!("{NODE_UP}/{UP_PREFIX}"))?;
    inet.ip(&format!("addr add {INET}/{UP_PREFIX} dev {PEER_IF}"))?;
    Ok((node, inet))
}

/// Loads ruleset `rules` into namespace `ns` (`nft -f`).
fn nft(b: &Bench, ns: &Netns, rules: &str) -> Result<()> {
    let path = b.dir.join(format!("{}.nft", ns.name));
    std::fs::write(&path, rules)?;
    calix_testbed::checked(ns.command("nft")?.arg("-f").arg(&path))?;
    Ok(())
}

/// One outgoing-traffic variant's wiring, removed when dropped (servers first).
struct Topology {
    _servers: Vec<Guarded>,
    traffic: Traffic,
    pod_ip: Ipv4Addr,
    node: Node,
    _namespaces: [Netns; 2],
}

/// Builds variant `v`: node + agent + uplink + internet + pod + NAT rules + servers.
fn topology(b: &Bench, tools: &Tools, v: Variant, extra: Option<&str>) -> Result<Topology> {
    let extra = extra.filter(|_| v == Variant::CalixSnat);
    let config = agent_config(v.ebpf(), v == Variant::CalixSnat, None, extra);
    let dataplane = if v.ebpf() {
        Dataplane::Ebpf
    } else {
        Dataplane::Kernel
    };
    let (node, inet) = uplinked(b, v.tag(), dataplane, Some(config))?;
    let pod = b.netns(&format!("{}-p", v.tag()))?;
    let ns = &node.ns;
    ns.sysctl("net.ipv4.ip_forward=1")?;
    ns.ip(&format!("route add default via {INET}"))?;
    if !v.nat() {
        inet.ip(&format!("route add {POOL} via {NODE_UP}"))?;
    }
    node.agent().start(&[])?;
    let conf = node.conf(serde_json::json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } }));
    let plugin = Plugin::new(v.label(), b.bins.join("calix"), Some(ns), &conf);
    let pod_ip = plugin.add_pod(&pod, &format!("{}-0", v.tag()))?;
    let masquerade = format!("ip saddr {POOL} ip daddr != {POOL} masquerade");
    match v {
        Variant::Iptables => {
            let rule =
                format!("-w -t nat -A POSTROUTING -s {POOL} ! -d {POOL} -o {UPLINK} -j MASQUERADE");
            calix_testbed::checked(ns.command("iptables")?.args(rule.split(' ')))?;
        }
        Variant::Nftables => nft(
            b,
            ns,
            &format!(
                "table ip cxbnat {{\n  chain post {{\n    type nat hook postrouting priority \
                 srcnat; policy accept;\n    oifname {UPLINK:?} {masquerade}\n  }}\n}}\n"
            ),
        )?,
        _ => {}
    }
    let traffic = Traffic::new(&pod, &inet, INET);
    Ok(Topology {
        _servers: tools.start(&traffic, &b.dir)?,
        traffic,
        pod_ip,
        node,
        _namespaces: [pod, inet],
    })
}

/// One TCP connection from the pod to the internet: the source the internet saw.
fn probe(t: &Traffic) -> Result<SocketAddrV4> {
    let listener = t
        .server
        .spawn(None, || TcpListener::bind((INET, PROBE_PORT)))?
        .join()
        .map_err(|_| anyhow!("the probe listener's thread panicked"))?
        .context("probe listener")?;
    listener.set_nonblocking(true)?;
    let client = t.client.spawn(None, || {
        let to = SocketAddr::from((INET, PROBE_PORT));
        TcpStream::connect_timeout(&to, Duration::from_secs(2))
    })?;
    let deadline = Instant::now() + Duration::from_secs(3);
    let seen = loop {
        match listener.accept() {
            Ok((_, peer)) => break Some(peer),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).context("probe accept"),
        }
    };
    client
        .join()
        .map_err(|_| anyhow!("the probe client's thread panicked"))?
        .with_context(|| format!("connecting to {INET}:{PROBE_PORT}"))?;
    match seen {
        Some(SocketAddr::V4(a)) => Ok(a),
        Some(a) => bail!("the internet saw an IPv6 source {a}"),
        None => bail!("the connection reached no listener"),
    }
}

/// Builds `v` and checks with a probe that the internet sees the source it should; the
/// calix SNAT variant must be translated by the programs.
fn checked_topology(b: &Bench, tools: &Tools, v: Variant, extra: Option<&str>) -> Result<Topology> {
    let t = topology(b, tools, v, extra).with_context(|| format!("setting up {}", v.label()))?;
    let want = if v.nat() { NODE_UP } else { t.pod_ip };
    match probe(&t.traffic).map(|a| (*a.ip(), a.port())) {
        // Translated by the programs, not by a kernel rule (the agent's own nftables masquerade
        // of what the programs leave to the stack included): their conntrack holds the probe's
        // flow, leaving with the port the internet saw.
        Ok((seen, port)) if seen == want && v == Variant::CalixSnat => {
            let flows =
                t.node
                    .agent()
                    .calixctl_json(&["bpf", "nat", "--ip", &t.pod_ip.to_string()])?;
            let num = |f: &Value, k: &str| f[k].as_u64().or_else(|| f[k].as_str()?.parse().ok());
            let by_programs = flows["flows"].as_array().into_iter().flatten().any(|f| {
                num(f, "dst_port") == Some(PROBE_PORT.into())
                    && num(f, "nat_port") == Some(port.into())
            });
            if !by_programs {
                bail!("the internet saw {seen}:{port}, a translation the programs did not make (their flows: {flows})");
            }
            Ok(t)
        }
        Ok((seen, _)) if seen == want => Ok(t),
        Ok((seen, _)) => Err(anyhow!(
            "the internet saw the pod's connection from {seen}, not {want}{}",
            if seen == t.pod_ip {
                " (not translated)"
            } else {
                ""
            }
        )),
        Err(e) if v.nat() => Err(anyhow!(
            "not translated: the pod's connection to the internet failed ({e:#}; the internet \
             has no route back to {POOL}, so only a translated connection is answered)"
        )),
        Err(e) => Err(e.context(format!(
            "a connection from the pod ({}) to the internet ({INET}) failed",
            t.pod_ip
        ))),
    }
}

/// Why calix SNAT could not be measured, in one line: the agent's last log line when it did
/// not come up, else the error chain.
fn unavailable_reason(e: &anyhow::Error) -> String {
    let not_ready = e.chain().find_map(|c| match c.downcast_ref() {
        Some(calix_testbed::Error::NotReady { what, log, .. }) => Some((what, log)),
        _ => None,
    });
    let one_line = match not_ready {
        Some((what, log)) => {
            let last = log.lines().rev().map(str::trim).find(|l| !l.is_empty());
            format!("{what} exited: {}", last.unwrap_or("(empty log)"))
        }
        None => format!("{e:#}")
            .lines()
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" "),
    };
    let mut s: String = one_line.chars().take(400).collect();
    if s.len() < one_line.len() {
        s.push('…');
    }
    s
}

// --- drop filters --------------------------------------------------------------------------

/// One drop filter's wiring.
struct DropTopo {
    node: Node,
    inet: Netns,
    frame: Vec<u8>,
}

/// Builds filter `f`: node + uplink + internet, the calix agent with XDP or the nft rule.
fn drop_topology(b: &Bench, f: Filter) -> Result<DropTopo> {
    let config = f
        .xdp_mode()
        .map(|mode| agent_config(true, false, Some(mode), None));
    let (node, inet) = uplinked(b, f.tag(), Dataplane::Ebpf, config)?;
    if f.xdp_mode().is_some() {
        node.agent().start(&[])?;
    }
    if let Some(mode) = f.xdp_mode() {
        let want = if mode == "native" { 1 } else { 2 };
        let v = json(Command::new("ip").args([
            "-n",
            &node.ns.name,
            "-j",
            "-d",
            "link",
            "show",
            "dev",
            UPLINK,
        ]))?;
        let got = v[0]["xdp"]["mode"].as_u64();
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
    let chain = match f {
        Filter::NftIngress => Some(format!(
            "ingress {{\n    type filter hook ingress device {UPLINK:?} priority -500; policy accept;"
        )),
        Filter::NftPrerouting => Some("pre {\n    type filter hook prerouting priority raw; policy accept;".into()),
        _ => None,
    };
    if let (Some(table), Some(chain)) = (f.nft_table(), chain) {
        let rules = format!("table {table} {{\n{set}  chain {chain}\n    {rule}\n  }}\n}}\n");
        nft(b, &node.ns, &rules)?;
    }
    let ethertype = if f == Filter::Floor {
        FLOOR_ETHERTYPE
    } else {
        ETH_P_IP
    };
    let frame = flood_frame(node.ns.mac(UPLINK)?, inet.mac(PEER_IF)?, ethertype);
    Ok(DropTopo { node, inet, frame })
}

/// The flood's frame: 60 bytes of Ethernet + IPv4 + UDP from FLOOD_SRC to the node's UDP
/// discard port, 18 bytes of payload, the UDP checksum 0 (none, allowed over IPv4).
fn flood_frame(dst: [u8; 6], src: [u8; 6], ethertype: u16) -> Vec<u8> {
    let udp = udp_with(40000, FLOOD_PORT, &[b'x'; 18]);
    let ip = Ip4::new(FLOOD_SRC.octets(), NODE_UP.octets(), UDP, udp).bytes();
    eth(dst, src, ethertype, &ip)
}

/// Packets the filter of `t` dropped so far (its own counter).
fn dropped(f: Filter, t: &DropTopo) -> Result<f64> {
    if f.xdp_mode().is_some() {
        return Ok(t.node.agent().dropped(UPLINK, XDP_REASON)? as f64);
    }
    let ns = &t.node.ns;
    if f == Filter::Floor {
        let v = json(
            Command::new("ip").args(["-n", &ns.name, "-j", "-s", "link", "show", "dev", UPLINK]),
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
    let mut cmd = ns.command("nft")?;
    Ok(nft_counter(&json(
        cmd.args(["-j", "list", "table"]).args(table.split(' ')),
    )?))
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

/// One flood of `secs` through filter `f`, recorded in `s`; its progress line.
fn measure_drops(
    (cpu, ksoftirqd): (usize, Option<u32>),
    f: Filter,
    t: &DropTopo,
    secs: u64,
    s: &mut DropSamples,
) -> Result<String> {
    let load = load_average();
    let d0 = dropped(f, t)?;
    let cpu0 = CpuStat::read();
    let k0 = task_cpu_ns(ksoftirqd);
    let fl = flood(&t.inet, PEER_IF, cpu, t.frame.clone(), secs as f64)?;
    let k1 = task_cpu_ns(ksoftirqd);
    let cpu1 = CpuStat::read();
    let drops = dropped(f, t)? - d0;
    let (others, _) = cpu1.shares_since(&cpu0, cpu);
    if drops < 1.0 {
        bail!("{}: nothing dropped ({} frames sent)", f.label(), fl.sent);
    }
    let softirq_ns = cpu1.softirq_ns_since(&cpu0, cpu) / drops;
    let total_ns = (fl.cpu_ns + k1 - k0) / drops;
    let in_ksoftirqd = 100.0 * (k1 - k0) / (fl.cpu_ns + k1 - k0).max(1.0);
    let share = 100.0 * drops / (fl.sent.max(1) as f64);
    s.sent_rate.push(fl.sent as f64 / fl.secs);
    s.drop_rate.push(drops / fl.secs);
    s.share.push(share);
    s.softirq_ns.push(softirq_ns);
    s.total_ns.push(total_ns);
    s.ksoftirqd.push(in_ksoftirqd);
    s.load.push(load);
    s.others_busy.push(others);
    Ok(format!(
        "(load {load:.2}, other CPUs {others:.0}% busy): sent {:.2} Mpps, dropped {:.2} Mpps \
         ({share:.1}% of sent), softirq {softirq_ns:.0} ns/drop, sender+softirq {total_ns:.0} \
         ns/drop ({in_ksoftirqd:.0}% in ksoftirqd)",
        fl.sent as f64 / fl.secs / 1e6,
        drops / fl.secs / 1e6,
    ))
}

// --- run -----------------------------------------------------------------------------------

pub fn run(reps: usize, secs: u64, quick: bool, snat_config: Option<PathBuf>) -> Result<()> {
    let extra = match &snat_config {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("cannot read --snat-config {}", p.display()))?,
        ),
        None => None,
    };
    let b = Bench::setup(
        "the snat benchmark",
        &["iperf3", "nft", "iptables", "sysctl"],
        &[],
    )?;
    let tools = b.tools();
    // The bench CPU and its ksoftirqd, which the drop measurements count.
    let flood_cpu = (b.cpu, ksoftirqd_pid(b.cpu));

    // Outgoing traffic: every variant built, probed and warmed up before anything is timed.
    let mut topo: Vec<Result<Topology, String>> = Vec::with_capacity(VARIANTS.len());
    let mut snat_args = None;
    for v in VARIANTS {
        check_interrupted()?;
        let t = match checked_topology(&b, &tools, v, extra.as_deref()) {
            Ok(t) => t,
            Err(e) if v == Variant::CalixSnat => {
                check_interrupted()?;
                let reason = unavailable_reason(&e);
                println!("[setup] {}: not available: {reason}", v.label());
                topo.push(Err(reason));
                continue;
            }
            Err(e) => return Err(e),
        };
        if v == Variant::CalixSnat {
            snat_args = Some(t.node.agent_args(&[]).join(" "));
        }
        let seen_as = if v.nat() { NODE_UP } else { t.pod_ip };
        let address = format!("{} seen as {seen_as}", t.pod_ip);
        warm_up(&tools, v.label(), &t.traffic, &address, Duration::ZERO)?;
        topo.push(Ok(t));
    }

    // Drops: every filter built and checked to drop before anything is timed.
    let mut dtopo = Vec::with_capacity(FILTERS.len());
    let mut xdp_prog_ns: [Option<f64>; 5] = Default::default();
    for f in FILTERS {
        check_interrupted()?;
        let t = drop_topology(&b, f).with_context(|| format!("setting up {}", f.label()))?;
        let line = measure_drops(flood_cpu, f, &t, 1, &mut DropSamples::default())
            .with_context(|| format!("{}: warm-up", f.label()))?;
        println!("[setup] {}: warm-up {line}", f.label());
        if f.xdp_mode().is_some() {
            // xdp_host_dev's average run time per packet over an untimed one-second flood
            // (kernel BPF statistics; only the flooded filter's program runs meanwhile).
            let (ns, _) = calix_testbed::bpf::program_run_time("xdp_host_dev", || {
                flood(&t.inet, PEER_IF, b.cpu, t.frame.clone(), 1.0).map(drop)
            })
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
        let measured: Vec<Variant> = order(&VARIANTS, rep, true)
            .into_iter()
            .filter(|&v| topo[v as usize].is_ok())
            .collect();
        repetition(
            rep,
            reps,
            &measured,
            |v| v.label().into(),
            |v| {
                let Ok(t) = &topo[v as usize] else {
                    unreachable!("filtered above")
                };
                Ok(res[v as usize].push(&tools.measure(&t.traffic, secs, None, false)?))
            },
        )?;
        repetition(
            rep,
            reps,
            &order(&FILTERS, rep, true),
            |f| f.label().into(),
            |f| {
                measure_drops(
                    flood_cpu,
                    f,
                    &dtopo[f as usize],
                    secs,
                    &mut dres[f as usize],
                )
            },
        )?;
    }
    let unavailable = topo.iter().map(|t| t.as_ref().err().cloned()).collect();
    drop((topo, dtopo));
    b.done();
    let report = Report {
        reps,
        secs,
        quick,
        iperf_version: version("iperf3"),
        nft_version: version("nft"),
        iptables_version: version("iptables"),
        unavailable,
        snat_config: snat_config.map(|p| p.display().to_string()),
        snat_args,
        snat_agent_config: agent_config(true, true, None, extra.as_deref()),
        res,
        dres,
        xdp_prog_ns,
        bench: b,
    };
    Bench::publish("snat", &report.markdown(), quick, |p| chart(p, &report))
}

// --- report --------------------------------------------------------------------------------

struct Report {
    reps: usize,
    secs: u64,
    quick: bool,
    iperf_version: String,
    nft_version: String,
    iptables_version: String,
    /// Per variant: why it was not measured.
    unavailable: Vec<Option<String>>,
    snat_config: Option<String>,
    /// The calix SNAT node's agent: its command line (when it ran) and config file.
    snat_args: Option<String>,
    snat_agent_config: String,
    res: [Samples; 5],
    dres: [DropSamples; 5],
    /// Per filter: the XDP program's own run time per packet (kernel BPF stats).
    xdp_prog_ns: [Option<f64>; 5],
    bench: Bench,
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
        match self.unavailable(v) {
            Some(why) => format!(
                "| {} | not available: {} | | | | | |\n",
                v.label(),
                why.replace('|', "\\|")
            ),
            None => self.get(v).row(v.label(), false),
        }
    }

    fn ratio_row(&self, a: Variant, b: Variant) -> String {
        let na = self.unavailable(a).is_some() || self.unavailable(b).is_some();
        let label = format!("{} / {}", a.label(), b.label());
        Samples::ratio_row(&label, self.get(a), (!na).then(|| self.get(b)), false)
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
        let (res, dres) = (self.res.iter(), self.dres.iter());
        let others: Vec<f64> = res
            .clone()
            .flat_map(|r| r.others_busy.clone())
            .chain(dres.clone().flat_map(|r| r.others_busy.clone()))
            .collect();
        let load: Vec<f64> = res
            .clone()
            .flat_map(|r| r.load.clone())
            .chain(dres.flat_map(|r| r.load.clone()))
            .collect();
        let steal: Vec<f64> = res.flat_map(|r| r.steal.clone()).collect();
        busy_note(
            self.bench.cpu,
            self.bench.machine.cpus,
            &others,
            &steal,
            &load,
        )
    }

    fn markdown(&self) -> String {
        let (m, cpu) = (&self.bench.machine, self.bench.cpu);
        let mut s = heading(
            "Pod → outside: calix eBPF SNAT vs MASQUERADE vs routing; XDP deny list vs nftables \
             drops",
            self.quick,
        );
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
            self.bench.rev,
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
             the NAT rows; for calix eBPF SNAT, the programs' conntrack must hold that \
             translation). Per variant and repetition, each {} s, client (pod) and servers \
             (internet) pinned to CPU {}: **TCP_CRR** (`xtask netperf crr`: connect, 1-byte \
             request, 1-byte reply, close; the pod uses ports 1024–65535 with `tcp_tw_reuse`), \
             **TCP_RR** (`xtask netperf rr`: 1-byte ping-pong, every round trip timed) and \
             **throughput** (`iperf3 -C cubic`, one stream, receiver at nice {IPERF_NICE}). {} \
             repetitions, variants interleaved (order rotated every repetition); median \
             [min–max] over repetitions.\n\n",
            self.secs, cpu, self.reps,
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
        s.push_str(&format!(
            "\nThe calix eBPF SNAT node's agent{}, its config file:\n\n```toml\n{}```\n",
            self.snat_args
                .as_ref()
                .map(|a| format!(" (paths of this run): `{a}`"))
                .unwrap_or_default(),
            self.snat_agent_config
        ));
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
            cpu,
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
        s.push_str(&targets(
            "Targets (issue 6, medians):",
            &self.targets(),
            "calix SNAT not available",
        ));
        s.push_str(&self.load_note());
        s.push_str("\n![snat chart](snat.svg)\n");
        s
    }
}

fn chart(path: &Path, r: &Report) -> Result<()> {
    let variants = VARIANTS.map(|v| {
        let samples = r.unavailable(v).is_none().then(|| r.get(v));
        (v.label(), v.color(), samples)
    });
    let mut panels = traffic_panels("pod → outside", &variants);
    let drops: Vec<Series> = FILTERS
        .iter()
        .map(|&f| {
            let s = r.dget(f);
            let above = (f != Filter::Floor).then(|| median(&r.above_floor(f)));
            (f.label(), f.color(), vec![Some(median(&s.total_ns)), above])
        })
        .collect();
    panels.push(Panel::new(
        "CPU ns per dropped packet, lower is better",
        "ns",
        &["sender + receive", "above the floor"],
        drops,
        |_, _, v| fmt_0(v),
    ));
    chart::chart(
        path,
        (1200, 820),
        &format!(
            "Pod → outside and drop filters, medians of {} reps × {} s ({})",
            r.reps, r.secs, r.bench.machine.date
        ),
        Layout::Grid(2, 2),
        &panels,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_renders() {
        use crate::bench::harness::{around, render};
        let reps = 2;
        let drops = |ns: f64| DropSamples {
            sent_rate: around(2e6, reps),
            drop_rate: around(1e9 / ns, reps),
            share: around(99.0, reps),
            softirq_ns: around(ns / 2.0, reps),
            total_ns: around(ns, reps),
            ksoftirqd: around(30.0, reps),
            load: around(1.2, reps),
            others_busy: around(4.0, reps),
        };
        for calix_snat in [true, false] {
            let mut unavailable = vec![None; VARIANTS.len()];
            if !calix_snat {
                unavailable[Variant::CalixSnat as usize] = Some("no SNAT on this kernel".into());
            }
            let r = Report {
                reps,
                secs: 3,
                quick: false,
                iperf_version: "iperf 3.18".into(),
                nft_version: "nftables v1.1.1".into(),
                iptables_version: "iptables v1.8.11 (nf_tables)".into(),
                unavailable,
                snat_config: None,
                snat_args: calix_snat.then(|| "--dataplane ebpf".into()),
                snat_agent_config: agent_config(true, true, None, None),
                res: [1.0, 1.1, 0.8, 0.85, 0.95].map(|k| Samples::fake(k, reps)),
                dres: [40.0, 90.0, 120.0, 200.0, 30.0].map(drops),
                xdp_prog_ns: [Some(25.0), Some(30.0), None, None, None],
                bench: Bench::fake(),
            };
            let md = r.markdown();
            let name = if calix_snat {
                "snat"
            } else {
                "snat-unavailable"
            };
            let svg = render(name, &md, |p| chart(p, &r));
            assert!(md.starts_with("# "));
            assert!(svg.contains("CPU ns per dropped packet"));
        }
    }

    #[test]
    fn the_flood_frame_is_a_valid_udp_packet() {
        let f = flood_frame([2; 6], [4; 6], ETH_P_IP);
        assert_eq!(f.len(), 60);
        assert_eq!(&f[12..14], &[0x08, 0x00]);
        // A header with its checksum sums to 0xffff: the checksum of it is 0.
        assert_eq!(calix_testbed::packets::ipv4_checksum(&f[14..34]), 0);
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
        let c = agent_config(true, true, None, Some("[nat]\nfoo = 1"));
        let first_table = c.find("\n[").unwrap_or(0);
        assert!(c.find("uplinks").is_some_and(|i| i < first_table));
        assert!(c.contains("natOutgoing = true"));
        assert!(c.trim_end().ends_with("foo = 1"));
    }
}
