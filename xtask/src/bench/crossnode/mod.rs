//! `cargo xtask bench crossnode`: pod to pod across nodes — calix's kernel mode, eBPF, and
//! VXLAN in both — against the underlay itself (the ceiling) and a plain kernel VXLAN device
//! with static routes (what flannel does), in one run on one machine (DESIGN.md §10).
//!
//! Three clusters of the test bed, all built before any measurement and kept for the whole
//! run, each with nodes 0 and 1 on subnet 1 and node 2 on subnet 2 (behind the underlay
//! namespace's router):
//! - **calix eBPF** and **calix kernel**: release agents with that dataplane, etcd, route
//!   distribution over mutual TLS; pods wired by the real `calix` plugin. Node 0 → node 1 is
//!   the direct route (same subnet), node 0 → node 2 goes through `vxlan.calix` (the pools'
//!   default `crossSubnet`);
//! - **plain**: no calix at all. Node 0 → node 1 between the node namespaces' own `eth0`
//!   addresses is the **underlay** (the ceiling: no pod, no veth, no forwarding); node 0 →
//!   node 2 is **plain VXLAN**: a `flannel.1`-style VXLAN device on each node (no learning,
//!   static forwarding entry and neighbour, routes `via <vtep> onlink`), pods as plain veth
//!   pairs routed by the node (MTU 1450, as calix's pods get), the kernel forwarding.
//!
//! The test bed's traffic tools measure client → server per repetition and variant: TCP_CRR,
//! TCP_RR and iperf3, client and servers pinned to one CPU, the client node's
//! `IpForwDatagrams` read around them; variants interleaved (order rotated every repetition).
//! Before the measurements, an untimed TCP_CRR run per variant shows the path: both nodes'
//! forwarded datagrams per connection, and for the eBPF variants the kernel's run time of every
//! calix program on both nodes (`kernel.bpf_stats_enabled`, per program id). Everything is
//! named `cxb-<pid>-…` and removed on drop, on error and Ctrl-C too. With `--baseline REV`, a
//! fourth cluster: calix eBPF of another revision (its agent and static plugin, built under
//! target/baseline/), and two more variants, direct and VXLAN, measured as this build's are.
//! Writes
//! docs/bench/crossnode.md and .svg (with `--quick`, target/bench/ instead).
mod path;
mod report;
#[cfg(test)]
mod tests;
mod topology;

use std::path::Path;

use anyhow::{Context, Result};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::TW_REUSE_DELAY;
use plotters::style::RGBColor;

use super::chart;
use super::harness::{check_interrupted, repetitions, version, Bench, Compared};
use super::report::Traffic as Samples;
use path::path;
use report::{chart, Report};
use topology::build;

/// Node 0 and 1 on subnet 1, node 2 on subnet 2.
const SUBNETS: [u8; 3] = [1, 1, 2];
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\n";
/// The untimed TCP_CRR run that shows each variant's path.
const PATH_SECS: f64 = 2.0;
/// The plain VXLAN: the device's name, VNI and port, and the MTU of its pods (calix's: the
/// uplink's 1500 less IPv4 VXLAN's 50).
const PLAIN_DEV: &str = "flannel.1";
const PLAIN_VNI: u32 = 1;
const VXLAN_PORT: u16 = 4789;
const PLAIN_MTU: u32 = 1450;
const CA_NAME: &str = "calix-bench-ca";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Underlay,
    Kernel,
    Ebpf,
    KernelVxlan,
    EbpfVxlan,
    PlainVxlan,
    /// calix eBPF of another revision (`--baseline`): direct, and through VXLAN.
    BaseEbpf,
    BaseEbpfVxlan,
}

/// Every variant's slot in the per-variant arrays ([`Variant`] as usize).
const SLOTS: usize = 8;

/// The variants of a run: [`VARIANTS`], and the baseline's when there is one.
fn variants(baseline: bool) -> Vec<Variant> {
    let mut v = VARIANTS.to_vec();
    if baseline {
        v.extend([Variant::BaseEbpf, Variant::BaseEbpfVxlan]);
    }
    v
}

const VARIANTS: [Variant; 6] = [
    Variant::Underlay,
    Variant::Kernel,
    Variant::Ebpf,
    Variant::KernelVxlan,
    Variant::EbpfVxlan,
    Variant::PlainVxlan,
];

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Underlay => ("underlay (node to node)", "und", chart::GREY),
            Self::Kernel => ("calix kernel", "kern", chart::GREEN),
            Self::Ebpf => ("calix eBPF", "ebpf", chart::BLUE),
            Self::KernelVxlan => ("calix kernel, VXLAN", "kvx", chart::LIGHT_GREEN),
            Self::EbpfVxlan => ("calix eBPF, VXLAN", "evx", chart::LIGHT_BLUE),
            Self::PlainVxlan => ("plain VXLAN (flannel-like)", "pvx", chart::ORANGE),
            Self::BaseEbpf => ("calix eBPF, baseline", "bas", chart::RED),
            Self::BaseEbpfVxlan => ("calix eBPF, VXLAN, baseline", "bvx", chart::PURPLE),
        }
    }
}

impl Variant {
    /// The server's node in its cluster (the client is always on node 0).
    fn server_node(self) -> usize {
        match self {
            Self::Underlay | Self::Kernel | Self::Ebpf | Self::BaseEbpf => 1,
            _ => 2,
        }
    }

    fn ebpf(self) -> bool {
        matches!(
            self,
            Self::Ebpf | Self::EbpfVxlan | Self::BaseEbpf | Self::BaseEbpfVxlan
        )
    }
}

pub fn run(reps: usize, secs: u64, quick: bool, baseline: Option<&str>) -> Result<()> {
    let b = Bench::setup(
        "the cross-node benchmark",
        &[
            "iperf3", "nstat", "sysctl", "bpftool", "bridge", "etcd", "perf",
        ],
        &[],
    )?;
    let base = baseline.map(super::baseline::calix).transpose()?;
    let ca = Ca::new(CA_NAME)?;
    let tools = b.tools();
    let all = variants(base.is_some());
    let (beds, topo) = build(&b, &ca, &tools, &all, base.as_ref())?;
    let mut paths = Vec::new();
    for (v, t) in all.iter().zip(&topo) {
        check_interrupted()?;
        let p = path(&b, &tools, t, *v).with_context(|| format!("{}: the path", v.label()))?;
        println!(
            "[setup] {}: path over {:.0} connections: IpForwDatagrams per connection {:.2} \
             (client node) {:.2} (server node){}",
            v.label(),
            p.conns,
            p.fwd[0],
            p.fwd[1],
            if p.progs.is_empty() {
                String::new()
            } else {
                format!(
                    ", BPF {:.0} ns per connection, {:.0} ns per TCP_RR round trip",
                    p.bpf_per_conn(),
                    p.rr_bpf_ns
                )
            }
        );
        paths.push(p);
    }
    let mut res: [Samples; SLOTS] = Default::default();
    repetitions(reps, &all, |v| {
        let t = &topo[v as usize];
        let m = tools.measure(&t.traffic, secs, Some(&t.nodes[0]), false)?;
        Ok(res[v as usize].push(&m))
    })?;
    drop(topo);
    drop(beds);
    b.done();
    let report = Report {
        reps,
        secs,
        quick,
        cpu: b.cpu,
        tw_delay: Path::new(TW_REUSE_DELAY).exists(),
        iperf_version: version("iperf3"),
        res,
        paths,
        baseline: base.map(|b| b.label),
        bench: b,
    };
    Bench::publish("crossnode", &report.markdown(), quick, |p| {
        chart(p, &report)
    })
}
