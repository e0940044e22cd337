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
mod drops;
mod report;
#[cfg(test)]
mod tests;
mod topology;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use calix_testbed::packets::ETH_P_LOCAL_EXP;
use calix_testbed::traffic::cpu::ksoftirqd_pid;
use calix_testbed::traffic::flood::flood;
use plotters::style::RGBColor;

use super::chart;
use super::harness::{check_interrupted, order, repetition, version, warm_up, Bench, Compared};
use super::report::Traffic as Samples;
use drops::{drop_topology, measure_drops, DropSamples};
use report::{chart, Report};
use topology::{agent_config, checked_topology, unavailable_reason, Topology};

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
