//! The cross-node bench's report: the markdown (with where the time goes) and the chart.
use std::path::Path;

use anyhow::Result;
use calix_testbed::traffic::IPERF_NICE;

use super::path::PathRun;
use super::{variants, Variant, PATH_SECS, PLAIN_DEV, PLAIN_MTU, PLAIN_VNI, SLOTS, VXLAN_PORT};
use crate::bench::chart::{traffic_chart, traffic_title};
use crate::bench::harness::{Bench, Compared, Machine};
use crate::bench::report::{
    busy_note_of, fmt_0, fmt_1, fmt_2, heading, median, ratio, targets, traffic_table,
    Traffic as Samples, RATIOS_NOTE,
};

pub(super) struct Report {
    pub(super) reps: usize,
    pub(super) secs: u64,
    pub(super) quick: bool,
    pub(super) cpu: usize,
    pub(super) tw_delay: bool,
    pub(super) iperf_version: String,
    pub(super) res: [Samples; SLOTS],
    /// Each variant's path, in [`variants`]' order.
    pub(super) paths: Vec<PathRun>,
    /// The baseline's revision, when the run had one (`--baseline`).
    pub(super) baseline: Option<String>,
    pub(super) bench: Bench,
}

impl Report {
    fn variants(&self) -> Vec<Variant> {
        variants(self.baseline.is_some())
    }

    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    fn machine(&self) -> &Machine {
        &self.bench.machine
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let m = |v: Variant, f: fn(&Samples) -> &Vec<f64>| median(f(self.get(v)));
        let (ec, kc) = (m(Variant::Ebpf, |s| &s.crr), m(Variant::Kernel, |s| &s.crr));
        let (el, kl) = (
            m(Variant::Ebpf, |s| &s.rr_p50),
            m(Variant::Kernel, |s| &s.rr_p50),
        );
        let (eg, kg) = (
            m(Variant::Ebpf, |s| &s.gbps),
            m(Variant::Kernel, |s| &s.gbps),
        );
        let (vc, pc) = (
            m(Variant::EbpfVxlan, |s| &s.crr),
            m(Variant::PlainVxlan, |s| &s.crr),
        );
        vec![
            (
                format!(
                    "calix eBPF ≥ 1.10× calix kernel conn/s: {} vs {} ({})",
                    fmt_0(ec),
                    fmt_0(kc),
                    ratio(ec, kc)
                ),
                Some(ec >= 1.10 * kc),
            ),
            (
                format!(
                    "calix eBPF TCP_RR p50 ≤ 0.9× calix kernel's: {} µs vs {} µs ({})",
                    fmt_1(el),
                    fmt_1(kl),
                    ratio(el, kl)
                ),
                Some(el <= 0.9 * kl),
            ),
            (
                format!(
                    "calix VXLAN (eBPF) ≥ 1.0× plain VXLAN conn/s: {} vs {} ({})",
                    fmt_0(vc),
                    fmt_0(pc),
                    ratio(vc, pc)
                ),
                Some(vc >= pc),
            ),
            (
                format!(
                    "calix eBPF throughput ≥ 0.95× calix kernel's: {} vs {} Gbit/s ({})",
                    fmt_1(eg),
                    fmt_1(kg),
                    ratio(eg, kg)
                ),
                Some(eg >= 0.95 * kg),
            ),
        ]
    }

    pub(super) fn markdown(&self) -> String {
        let m = self.machine();
        let mut s = heading(
            "Cross-node pod to pod: calix kernel, eBPF and VXLAN vs the underlay and plain VXLAN",
            self.quick,
        );
        s.push_str(&format!(
            "{}: release build, `calix-agent --dataplane ebpf` / `kernel`, etcd, route \
             distribution over mutual TLS, pods wired by the `calix` CNI plugin; {}.\n\n",
            self.bench.measured(&format!(
                "crossnode --reps {} --secs {}",
                self.reps, self.secs
            )),
            self.iperf_version,
        ));
        s.push_str(&format!(
            "Three clusters of the test bed, built before the first measurement: nodes 0 and 1 \
             on one subnet, node 2 on another behind the underlay namespace's router; every \
             node's uplink a veth into the underlay's bridge of its subnet. The client is on \
             node 0. **underlay**: node 0's namespace → node 1's `eth0` address, no calix (the \
             ceiling). **calix kernel** / **calix eBPF**: pod on node 0 → pod on node 1 (the \
             direct route `<block> via <node 1>`). **calix kernel, VXLAN** / **calix eBPF, \
             VXLAN**: pod on node 0 → pod on node 2 through `vxlan.calix` (`crossSubnet`). \
             **plain VXLAN**: no calix; node 0 → node 2 through a `{PLAIN_DEV}` VXLAN device per \
             node as flannel makes it (VNI {PLAIN_VNI}, port {VXLAN_PORT}, `nolearning`, the \
             peer's VTEP as a permanent neighbour and forwarding entry, `<pod subnet> via \
             <VTEP> onlink`), pods on plain veth pairs routed by the node, MTU {PLAIN_MTU} like \
             calix's pods. Per variant and repetition, each {} s long, client and server pinned \
             to CPU {} (so the whole path, both nodes' softirqs included, runs on that CPU): \
             **TCP_CRR** (`xtask netperf crr`; client ports 1024–65535 with `tcp_tw_reuse=1`{}), \
             **TCP_RR** (`xtask netperf rr`, p50/p99 of every round trip) and **throughput** \
             (`iperf3 -C cubic -t {}`, one stream, receiver at nice {IPERF_NICE}). {} \
             repetitions, variants interleaved (order rotated every repetition); median \
             [min–max] over repetitions.\n\n",
            self.secs,
            self.cpu,
            if self.tw_delay {
                " and `tcp_tw_reuse_delay=1` ms"
            } else {
                ""
            },
            self.secs,
            self.reps,
        ));
        if let Some(label) = &self.baseline {
            s.push_str(&format!(
                "**calix eBPF, baseline** and **calix eBPF, VXLAN, baseline**: a fourth cluster \
                 of calix eBPF as it was at {label} (its agents and static plugin, release, built \
                 under target/baseline/), measured as this build's in the same repetitions; the \
                 rows \"… / … baseline\" are this build over it.\n\n"
            ));
        }
        let row = |v: Variant| (v.label(), self.get(v));
        let baseline_ratios = self.baseline.iter().flat_map(|_| {
            [
                (row(Variant::Ebpf), row(Variant::BaseEbpf)),
                (row(Variant::EbpfVxlan), row(Variant::BaseEbpfVxlan)),
            ]
        });
        s.push_str(&traffic_table(
            self.variants().into_iter().map(row),
            baseline_ratios.chain(
                [
                    (Variant::Ebpf, Variant::Kernel),
                    (Variant::EbpfVxlan, Variant::PlainVxlan),
                    (Variant::KernelVxlan, Variant::PlainVxlan),
                    (Variant::EbpfVxlan, Variant::KernelVxlan),
                    (Variant::Ebpf, Variant::Underlay),
                    (Variant::Kernel, Variant::Underlay),
                    (Variant::EbpfVxlan, Variant::Underlay),
                    (Variant::PlainVxlan, Variant::Underlay),
                ]
                .map(|(a, b)| (row(a), row(b))),
            ),
        ));
        s.push_str(RATIOS_NOTE);
        s.push_str(&targets(
            "Targets (issue 13, medians):",
            &self.targets(),
            "",
        ));
        s.push_str(&self.where_time_goes());
        s.push_str(&busy_note_of(self.cpu, m.cpus, &self.res));
        s.push_str("\n![crossnode chart](crossnode.svg)\n");
        s
    }

    fn path(&self, v: Variant) -> &PathRun {
        &self.paths[v as usize]
    }

    /// The paths: forwarding per connection, the BPF programs' run time, the CPU's profile,
    /// and what the missed targets would take.
    fn where_time_goes(&self) -> String {
        let mut s = format!(
            "\n## Where the time goes\n\nAn untimed {PATH_SECS} s TCP_CRR run per variant before \
             the measurements (then, for the eBPF variants, an untimed TCP_RR run). \
             IpForwDatagrams per connection (`nstat`, both nodes; a TCP_CRR connection is \
             about 5 packets each way, so ~10 per node means the node's IP stack forwarded \
             every packet):\n\n\
             | variant | connections | client node | server node |\n|---|---|---|---|\n"
        );
        for v in self.variants() {
            let p = self.path(v);
            s.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                v.label(),
                fmt_0(p.conns),
                fmt_2(p.fwd[0]),
                fmt_2(p.fwd[1])
            ));
        }
        s.push_str(
            "\nThe eBPF variants' programs during the TCP_CRR run (kernel BPF statistics, \
             `kernel.bpf_stats_enabled`, per program id: each node's agent loads its own \
             programs, and one program attached to several devices counts once, over all of \
             them; every program that ran; run times include the statistics' own two clock \
             reads per run):\n\n\
             | variant | node | program | attached to | runs per connection | ns per run | ns \
             per connection |\n|---|---|---|---|---|---|---|\n",
        );
        for v in self.variants().into_iter().filter(|v| v.ebpf()) {
            let p = self.path(v);
            let conns = p.conns.max(1.0);
            for x in &p.progs {
                let at: Vec<String> = x
                    .at
                    .iter()
                    .map(|a| match a.strip_prefix("cali") {
                        Some(rest) => format!("cali…/{}", rest.rsplit('/').next().unwrap_or("")),
                        None => a.clone(),
                    })
                    .collect();
                let mut at = at;
                at.dedup();
                s.push_str(&format!(
                    "| {} | {} | `{}` | {} | {} | {} | {} |\n",
                    v.label(),
                    if x.node == 0 { "client's" } else { "server's" },
                    x.name,
                    at.join(", "),
                    fmt_1(x.runs as f64 / conns),
                    fmt_0(x.ns as f64 / x.runs as f64),
                    fmt_0(x.ns as f64 / conns),
                ));
            }
            let conn_us = 1e6 / median(&self.get(v).crr);
            s.push_str(&format!(
                "| {} | both | **all** | | | | **{} ns of a connection's {} µs ({:.0} %); {} ns \
                 per TCP_RR round trip** |\n",
                v.label(),
                fmt_0(p.bpf_per_conn()),
                fmt_1(conn_us),
                100.0 * p.bpf_per_conn() / 1e3 / conn_us,
                fmt_0(p.rr_bpf_ns),
            ));
        }
        s.push_str(&self.what_would_reach());
        s.push_str(&format!(
            "\n<details><summary>The bench CPU's time by symbol during a third untimed TCP_CRR \
             run (`perf record -e cpu-clock` on CPU {}, the BPF statistics off; samples of the \
             bench's processes and the CPU's softirq thread; the 20 largest symbols)</summary>\n\n",
            self.cpu
        ));
        for v in self.variants() {
            s.push_str(&format!("**{}**:", v.label()));
            let top: Vec<String> = self
                .path(v)
                .profile
                .iter()
                .take(20)
                .map(|(share, sym)| format!(" {share:.1} % `{sym}`"))
                .collect();
            s.push_str(&top.join(","));
            s.push_str("\n\n");
        }
        s.push_str("</details>\n");
        s
    }

    /// For each missed target, what the BPF programs' time would have to come down to, all
    /// else equal.
    fn what_would_reach(&self) -> String {
        let conn_us = |v: Variant| 1e6 / median(&self.get(v).crr);
        let rr_us = |v: Variant| median(&self.get(v).rr_p50);
        let mut lines = Vec::new();
        let mut need = |what: &str, now_us: f64, goal_us: f64, bpf_ns: f64, per: &str| {
            let cut = (now_us - goal_us) * 1e3;
            if cut > 0.0 {
                lines.push(format!(
                    "- {what}: {} µs {per} now, {} µs needed: {} ns less, i.e. the programs at \
                     {} ns instead of {} ns {per} ({:.0} % less), everything else equal.",
                    fmt_2(now_us),
                    fmt_2(goal_us),
                    fmt_0(cut),
                    fmt_0(bpf_ns - cut),
                    fmt_0(bpf_ns),
                    100.0 * cut / bpf_ns
                ));
            }
        };
        let e = self.path(Variant::Ebpf);
        need(
            "eBPF ≥ 1.10× kernel conn/s",
            conn_us(Variant::Ebpf),
            conn_us(Variant::Kernel) / 1.10,
            e.bpf_per_conn(),
            "per connection",
        );
        need(
            "eBPF TCP_RR p50 ≤ 0.9× kernel's",
            rr_us(Variant::Ebpf),
            0.9 * rr_us(Variant::Kernel),
            e.rr_bpf_ns,
            "per round trip",
        );
        need(
            "calix VXLAN ≥ 1.0× plain VXLAN conn/s",
            conn_us(Variant::EbpfVxlan),
            conn_us(Variant::PlainVxlan),
            self.path(Variant::EbpfVxlan).bpf_per_conn(),
            "per connection",
        );
        if lines.is_empty() {
            return String::new();
        }
        format!(
            "\nWhat the missed targets would take, from the medians above (a connection's time \
             is 1 / conn/s on the one CPU that runs the whole path):\n\n{}\n",
            lines.join("\n")
        )
    }
}

pub(super) fn chart(path: &Path, r: &Report) -> Result<()> {
    let title = traffic_title("Cross-node pod to pod", r.reps, r.secs, &r.machine().date);
    let variants: Vec<_> = r
        .variants()
        .into_iter()
        .map(|v| (v.label(), v.color(), Some(r.get(v))))
        .collect();
    traffic_chart(path, (1300, 480), &title, &variants)
}
