//! `cargo xtask bench dataplane`: same-node pod-to-pod performance of calix's eBPF dataplane
//! and its kernel mode against Debian's reference `bridge` plugin and a raw veth pair (the
//! physical ceiling), in one run on one machine (DESIGN.md §10).
//!
//! Six topologies, all built before any measurement and kept for the whole run:
//! - **calix eBPF** (tcx links), **calix eBPF, cls_bpf** (`tc_attach = "tc"`), **calix
//!   kernel** and the **minimal tc program** (eBPF with the programs' `bench-floor` build): a
//!   test-bed node (a namespace running a release `calix-agent`, its pins under
//!   `/sys/fs/bpf/<node>`) and two pod namespaces wired by the real `calix` CNI plugin, exec'd
//!   into the node namespace with the CNI environment and the config on stdin;
//! - **bridge**: a node namespace and two pods wired by `/usr/lib/cni/bridge` + `host-local`
//!   (`isGateway`, a /24): pod-to-pod traffic is switched by the bridge;
//! - **raw veth**: one veth pair straight between two namespaces.
//!
//! In each, the test bed's traffic tools measure client pod → server pod per repetition and
//! variant: TCP_CRR, TCP_RR and iperf3, client and servers pinned to one CPU, the node's
//! `IpForwDatagrams` and the receiver's zero windows read around them. Variants are interleaved
//! (order rotated every repetition). For the eBPF variants, the programs' own run time per
//! packet (the kernel's BPF statistics, over an untimed TCP_CRR run); for the two calix eBPF
//! variants, what the attachment costs: the CPU per packet of a flood from the client pod that
//! `from_pod` drops (a spoofed source), tcx against cls_bpf. With `--baseline REV`, a seventh
//! variant: **calix eBPF, baseline**, the agent and static plugin of another revision (built
//! under target/baseline/), wired and measured as calix eBPF is. Everything is named `cxb-<pid>-…` and removed on drop, on
//! error and Ctrl-C too. Writes docs/bench/dataplane.md and .svg (with `--quick`,
//! target/bench/ instead: development numbers are not published).
mod cost;
mod report;
#[cfg(test)]
mod tests;

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use calix_testbed::traffic::cpu::ksoftirqd_pid;
use calix_testbed::traffic::{Tools, Traffic, TW_REUSE_DELAY};
use calix_testbed::{veth, AgentSpec, Dataplane, Guarded, Netns, Node, Plugin, CNI_DIR, POOL};
use plotters::style::RGBColor;
use serde_json::json;

use super::baseline::Calix;
use super::chart;
use super::harness::{
    check_interrupted, cni_plugins_version, repetitions, version, warm_up, Bench, Compared,
};
use super::report::Traffic as Samples;
use cost::{Attach, Cost};
use report::{chart, Report};

const BRIDGE_SUBNET: &str = "10.245.0.0/24";
const VETH_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 246, 0, 1);
const VETH_SERVER: Ipv4Addr = Ipv4Addr::new(10, 246, 0, 2);
/// The eBPF crate's feature whose `from_pod` is the least a same-node redirect needs.
const FLOOR_FEATURE: &str = "bench-floor";
/// The untimed TCP_CRR run the programs' cost per packet is measured over, per repetition.
const PROG_COST_SECS: f64 = 2.0;
/// The flood through `from_pod`'s hook, per repetition and calix eBPF variant (seconds).
const FLOOD_SECS: f64 = 1.0;
/// The flood's source: not the client pod's address, so `from_pod` drops every frame.
const SPOOFED: [u8; 4] = [10, 244, 250, 250];
/// The programs whose run time is read (from their pins): the pod-side pair.
const COST_PROGS: [&str; 2] = ["from_pod", "to_pod"];
/// calix `from_pod`'s cost above the minimal tc program's before issue 13's work on it (ns per
/// packet, median over repetitions), measured by this bench on this machine: the target is
/// half of it. See docs/bench/dataplane-baseline.md.
const BASELINE_ABOVE_FLOOR: (f64, &str) = (65.2, "36784a3");

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Ebpf,
    Kernel,
    Bridge,
    Veth,
    Floor,
    EbpfClsBpf,
    /// calix eBPF of another revision (`--baseline`).
    Baseline,
}

/// Every variant's slot in the per-variant arrays ([`Variant`] as usize).
const SLOTS: usize = 7;

const VARIANTS: [Variant; 6] = [
    Variant::Ebpf,
    Variant::Kernel,
    Variant::Bridge,
    Variant::Veth,
    Variant::Floor,
    Variant::EbpfClsBpf,
];

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Ebpf => ("calix eBPF", "ebpf", chart::BLUE),
            Self::Kernel => ("calix kernel", "kern", chart::GREEN),
            Self::Bridge => ("bridge", "brdg", chart::ORANGE),
            Self::Veth => ("raw veth", "veth", chart::GREY),
            Self::Floor => ("minimal tc program", "flor", chart::PURPLE),
            Self::EbpfClsBpf => ("calix eBPF, cls_bpf", "ebtc", chart::CYAN),
            Self::Baseline => ("calix eBPF, baseline", "base", chart::RED),
        }
    }
}

/// The variants of a run: [`VARIANTS`], and the baseline's when there is one.
fn variants(baseline: bool) -> Vec<Variant> {
    let mut v = VARIANTS.to_vec();
    if baseline {
        v.push(Variant::Baseline);
    }
    v
}

/// One variant's wiring, removed when dropped (servers first).
struct Topology {
    _servers: Vec<Guarded>,
    traffic: Traffic,
    /// The node namespace whose forwarding is counted (none for the raw veth pair).
    node_ns: Option<Netns>,
    _node: Option<Node>,
    _namespaces: Vec<Netns>,
    /// The pins of [`COST_PROGS`] (eBPF variants).
    prog_pins: Option<Vec<std::path::PathBuf>>,
}

/// Builds `v`: its node (calix, bridge) and two pods, or the veth pair; servers up.
fn topology(
    b: &Bench,
    tools: &Tools,
    v: Variant,
    floor: &Path,
    base: Option<&Calix>,
) -> Result<Topology> {
    let tag = v.tag();
    let (client, server) = (b.netns(&format!("{tag}-a"))?, b.netns(&format!("{tag}-b"))?);
    let (mut node, mut namespaces, mut server_ip) = (None::<Node>, Vec::new(), VETH_SERVER);
    // The plugin that wires the pods, and the node namespace whose forwarding is counted.
    let (plugin, node_ns) = match v {
        Variant::Veth => {
            veth(&client, "eth0", &server, "eth0")?;
            for (ns, ip) in [(&client, VETH_CLIENT), (&server, VETH_SERVER)] {
                ns.ip(&format!("addr add {ip}/24 dev eth0"))?;
                ns.ip("link set eth0 up")?;
            }
            (None, None)
        }
        Variant::Bridge => {
            let n = b.netns(tag)?;
            let conf = json!({
                "cniVersion": "1.0.0", "name": "cxb-bridge", "type": "bridge",
                "bridge": "cxbbr0", "isGateway": true, "ipMasq": false,
                "ipam": { "type": "host-local", "subnet": BRIDGE_SUBNET,
                          "dataDir": b.dir.join("host-local").display().to_string() },
            });
            let bridge = Path::new(CNI_DIR).join("bridge");
            let p = Plugin::new(v.label(), bridge, Some(&n), &conf);
            let ns = Netns::borrowed(&n.name);
            namespaces.push(n);
            (Some(p), Some(ns))
        }
        _ => {
            let (dataplane, object) = match v {
                Variant::Kernel => (Dataplane::Kernel, None),
                Variant::Floor => (Dataplane::Ebpf, Some(floor.to_path_buf())),
                _ => (Dataplane::Ebpf, None),
            };
            let config = (v == Variant::EbpfClsBpf)
                .then(|| format!("tc_attach = \"tc\"\n[[pools]]\ncidr = \"{POOL}\"\n"));
            let mut spec = AgentSpec {
                object,
                config,
                ..b.spec(dataplane)
            };
            let mut plugin = b.bins.join("calix");
            if v == Variant::Baseline {
                let base = base.context("the baseline variant without a baseline")?;
                spec.bins = base.agent_bins.clone();
                plugin = base.plugin.clone();
            }
            let n = b.node(tag, spec)?;
            let conf = n.conf(json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } }));
            let p = Plugin::new(v.label(), plugin, Some(&n.ns), &conf);
            let ns = Netns::borrowed(&n.ns.name);
            node = Some(n);
            (Some(p), Some(ns))
        }
    };
    if let Some(p) = plugin {
        p.add_pod(&client, &format!("{tag}-0"))?;
        server_ip = p.add_pod(&server, &format!("{tag}-1"))?;
    }
    let traffic = Traffic::new(&client, &server, server_ip);
    let servers = tools.start(&traffic, &b.dir)?;
    namespaces.extend([client, server]);
    let prog_pins = match (v, &node) {
        (Variant::Ebpf | Variant::EbpfClsBpf | Variant::Floor | Variant::Baseline, Some(n)) => {
            Some(
                COST_PROGS
                    .iter()
                    .map(|p| {
                        n.prog_pin(p)
                            .with_context(|| format!("{}: no pin of {p}", v.label()))
                    })
                    .collect::<Result<Vec<_>>>()?,
            )
        }
        _ => None,
    };
    Ok(Topology {
        _servers: servers,
        traffic,
        node_ns,
        _node: node,
        _namespaces: namespaces,
        prog_pins,
    })
}

pub fn run(reps: usize, secs: u64, quick: bool, baseline: Option<&str>) -> Result<()> {
    let tools_needed = ["iperf3", "nstat", "sysctl"];
    let b = Bench::setup(
        "the dataplane benchmark",
        &tools_needed,
        &["bridge", "host-local"],
    )?;
    println!("[setup] building the eBPF floor (the `{FLOOR_FEATURE}` feature of the programs)");
    let floor =
        calix_ebpf_build::build_ebpf_feature(&calix_ebpf_build::ebpf_target_dir(), FLOOR_FEATURE)
            .map_err(|e| anyhow::anyhow!("building the {FLOOR_FEATURE} eBPF object: {e}"))?;
    let base = baseline.map(super::baseline::calix).transpose()?;
    let tools = b.tools();
    let all = variants(base.is_some());
    let mut topo = Vec::with_capacity(all.len());
    for &v in &all {
        check_interrupted()?;
        let t = topology(&b, &tools, v, &floor, base.as_ref())
            .with_context(|| format!("setting up {}", v.label()))?;
        let tr = &t.traffic;
        warm_up(
            &tools,
            v.label(),
            tr,
            &tr.server_ip.to_string(),
            Duration::ZERO,
        )?;
        topo.push(t);
    }

    let mut res: [Samples; SLOTS] = Default::default();
    let mut cost: [Cost; SLOTS] = Default::default();
    let mut attach: [Attach; SLOTS] = Default::default();
    let ksoftirqd = ksoftirqd_pid(tools.cpu);
    repetitions(reps, &all, |v| {
        let t = &topo[v as usize];
        let m = tools.measure(&t.traffic, secs, t.node_ns.as_ref(), true)?;
        let mut line = res[v as usize].push(&m);
        if let Some(pins) = &t.prog_pins {
            line.push_str(&cost[v as usize].measure(&tools, &t.traffic, pins)?);
        }
        if let (Variant::Ebpf | Variant::EbpfClsBpf, Some(n)) = (v, &t._node) {
            let a = &mut attach[v as usize];
            line.push_str(&a.measure(n, &t.traffic, (tools.cpu, ksoftirqd))?);
        }
        Ok(line)
    })?;
    drop(topo);
    b.done();
    let report = Report {
        reps,
        secs,
        quick,
        cpu: b.cpu,
        tw_delay: Path::new(TW_REUSE_DELAY).exists(),
        plugins_version: cni_plugins_version(),
        iperf_version: version("iperf3"),
        res,
        cost,
        attach,
        baseline: base.map(|b| b.label),
        bench: b,
    };
    Bench::publish("dataplane", &report.markdown(), quick, |p| {
        chart(p, &report)
    })
}
