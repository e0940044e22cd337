//! The dataplane bench's report: the markdown and the chart.
use std::path::Path;

use anyhow::Result;
use calix_testbed::traffic::IPERF_NICE;

use super::cost::{Attach, Cost};
use super::{
    variants, Variant, BASELINE_ABOVE_FLOOR, BRIDGE_SUBNET, FLOOD_SECS, PROG_COST_SECS, SLOTS,
};
use crate::bench::chart::{traffic_chart, traffic_title};
use crate::bench::harness::{Bench, Compared, Machine};
use crate::bench::report::{
    busy_note_of, fmt_0, fmt_1, fmt_2, fmt_spread_with, heading, median, ratio, targets,
    traffic_table, Traffic as Samples, RATIOS_NOTE,
};

pub(super) struct Report {
    pub(super) reps: usize,
    pub(super) secs: u64,
    pub(super) quick: bool,
    pub(super) cpu: usize,
    /// Whether the client namespaces reuse TIME_WAIT ports after 1 ms.
    pub(super) tw_delay: bool,
    pub(super) plugins_version: String,
    pub(super) iperf_version: String,
    pub(super) res: [Samples; SLOTS],
    /// The programs' run time (eBPF variants).
    pub(super) cost: [Cost; SLOTS],
    /// The attachment's cost (the calix eBPF variants).
    pub(super) attach: [Attach; SLOTS],
    /// The baseline's revision, when the run had one (`--baseline`).
    pub(super) baseline: Option<String>,
    pub(super) bench: Bench,
}

impl Report {
    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    fn variants(&self) -> Vec<Variant> {
        variants(self.baseline.is_some())
    }

    /// `v`'s `from_pod` ns per packet above the minimal tc program's, per repetition (the two
    /// measured in the same repetition).
    fn above_floor_of(&self, v: Variant) -> Vec<f64> {
        let (c, f) = (
            &self.cost[v as usize].from_pod_ns,
            &self.cost[Variant::Floor as usize].from_pod_ns,
        );
        c.iter().zip(f).map(|(c, f)| c - f).collect()
    }

    /// calix `from_pod`'s ns per packet above the minimal tc program's, per repetition.
    fn above_floor(&self) -> Vec<f64> {
        self.above_floor_of(Variant::Ebpf)
    }

    fn machine(&self) -> &Machine {
        &self.bench.machine
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let (e, k, r) = (
            self.get(Variant::Ebpf),
            self.get(Variant::Kernel),
            self.get(Variant::Veth),
        );
        let (ec, kc, rc) = (median(&e.crr), median(&k.crr), median(&r.crr));
        let (el, kl) = (median(&e.rr_p50), median(&k.rr_p50));
        let (eg, rg) = (median(&e.gbps), median(&r.gbps));
        let f0 = fmt_0;
        let fc = median(&self.get(Variant::Floor).crr);
        let above = median(&self.above_floor());
        let (base, base_rev) = BASELINE_ABOVE_FLOOR;
        vec![
            (
                format!(
                    "from_pod's cost above the minimal tc program ≤ 0.5× before this work ({} ns \
                     on {base_rev}): {} vs {} ns",
                    fmt_1(base),
                    fmt_1(above),
                    fmt_1(0.5 * base)
                ),
                (!base.is_nan()).then_some(above <= 0.5 * base),
            ),
            (
                format!(
                    "conn/s ≥ 0.99× the minimal tc program: {} vs {} ({})",
                    f0(ec),
                    f0(0.99 * fc),
                    ratio(ec, fc)
                ),
                Some(ec >= 0.99 * fc),
            ),
            (
                format!(
                    "conn/s ≥ 0.95× raw veth: {} vs {} ({})",
                    f0(ec),
                    f0(0.95 * rc),
                    ratio(ec, rc)
                ),
                Some(ec >= 0.95 * rc),
            ),
            (
                format!(
                    "conn/s ≥ 1.15× calix kernel: {} vs {} ({})",
                    f0(ec),
                    f0(1.15 * kc),
                    ratio(ec, kc)
                ),
                Some(ec >= 1.15 * kc),
            ),
            (
                format!(
                    "TCP_RR ≥ 1.10× calix kernel (p50 round trip ≤ kernel's / 1.10): {} µs vs \
                     {} µs (kernel / eBPF: {})",
                    fmt_1(el),
                    fmt_1(kl / 1.10),
                    ratio(kl, el)
                ),
                Some(el <= kl / 1.10),
            ),
            (
                format!(
                    "throughput ≥ 0.9× raw veth: {} vs {} Gbit/s ({})",
                    fmt_1(eg),
                    fmt_1(0.9 * rg),
                    ratio(eg, rg)
                ),
                Some(eg >= 0.9 * rg),
            ),
        ]
    }

    pub(super) fn markdown(&self) -> String {
        let m = self.machine();
        let mut s = heading(
            "Same-node pod-to-pod dataplane: calix eBPF and kernel mode vs bridge and a raw veth",
            self.quick,
        );
        s.push_str(&format!(
            "{}: release build, `calix-agent --dataplane ebpf` / `kernel` with the embedded \
             datastore, pods wired by the `calix` CNI plugin; `bridge` + `host-local` from \
             Debian's containernetworking-plugins {} (`isGateway`, {BRIDGE_SUBNET}); {}.\n\n",
            self.bench.measured(&format!(
                "dataplane --reps {} --secs {}",
                self.reps, self.secs
            )),
            self.plugins_version,
            self.iperf_version,
        ));
        s.push_str(&format!(
            "Two pods on one node, client → server, every variant set up before the first \
             measurement: **calix eBPF** (the from-pod tc program `bpf_redirect_peer`s into the \
             destination pod; the programs attach with tcx links), **calix eBPF, cls_bpf** (the \
             same with `tc_attach = \"tc\"`: cls_bpf filters on a clsact qdisc), **calix kernel** (routes + proxy_arp: the node namespace's IP \
             stack forwards), **bridge** (Debian's reference plugin: the node's bridge switches \
             between the pods), **raw veth** (one veth pair straight between the two \
             namespaces: the ceiling), **minimal tc program** (calix eBPF with `from_pod` built with \
             the programs' `bench-floor` feature: a destination lookup and `bpf_redirect_peer`, \
             nothing else, attached with tcx as calix's — what a tc redirect costs at least, the \
             issue's hand-made 40-line program). Per variant and repetition, each {} s long, client and \
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
        if let Some(label) = &self.baseline {
            s.push_str(&format!(
                "**calix eBPF, baseline**: calix eBPF as it was at {label} (its agent and static \
                 plugin, release, built under target/baseline/), wired and measured as calix \
                 eBPF is, in the same repetitions; the row \"calix eBPF / calix eBPF, \
                 baseline\" is this build over it.\n\n"
            ));
        }
        let row = |v: Variant| (v.label(), self.get(v));
        let baseline_ratio = self
            .baseline
            .as_ref()
            .map(|_| (row(Variant::Ebpf), row(Variant::Baseline)));
        s.push_str(&traffic_table(
            self.variants().into_iter().map(row),
            baseline_ratio.into_iter().chain(
                [
                    (Variant::Ebpf, Variant::Veth),
                    (Variant::Ebpf, Variant::Kernel),
                    (Variant::Ebpf, Variant::Bridge),
                    (Variant::Ebpf, Variant::Floor),
                    (Variant::Ebpf, Variant::EbpfClsBpf),
                    (Variant::Floor, Variant::Veth),
                    (Variant::Floor, Variant::Kernel),
                    (Variant::Kernel, Variant::Veth),
                    (Variant::Bridge, Variant::Veth),
                ]
                .map(|(a, b)| (row(a), row(b))),
            ),
        ));
        s.push_str(&self.cost_markdown());
        s.push_str(RATIOS_NOTE);
        s.push_str(&format!(
            "\nWhy the iperf3 receiver runs at nice {IPERF_NICE}: with client and server on one \
             CPU the sender also runs the receive softirq, and an equal-priority receiver fell \
             behind in about half of the runs while this bench was written (even on the raw \
             veth): its window closed thousands of times a second and the run settled near 16 \
             instead of ~55 Gbit/s. Zero-window advertisements of the receiver per run, median \
             [min–max]: {}.\n",
            self.variants()
                .into_iter()
                .map(|v| format!(
                    "{} {}",
                    v.label(),
                    fmt_spread_with(&self.get(v).zero_windows, "", fmt_0)
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
        let baseline = self.baseline.as_ref().map(|_| Variant::Baseline);
        for v in [
            Variant::Ebpf,
            Variant::EbpfClsBpf,
            Variant::Floor,
            Variant::Kernel,
            Variant::Bridge,
        ]
        .into_iter()
        .chain(baseline)
        {
            let x = self.get(v);
            s.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                v.label(),
                fmt_spread_with(&x.fwd_per_conn, "", fmt_2),
                fmt_spread_with(&x.fwd_per_rt, "", fmt_2),
                fmt_spread_with(&x.fwd_iperf, "", fmt_0),
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
        s.push_str(&targets(
            "Targets (issue, calix eBPF, medians):",
            &self.targets(),
            "",
        ));
        s.push_str(&busy_note_of(self.cpu, m.cpus, &self.res));
        s.push_str("\n![dataplane chart](dataplane.svg)\n");
        s
    }
}

impl Report {
    fn cost_markdown(&self) -> String {
        let f1 = |v: &[f64]| fmt_spread_with(v, "", fmt_1);
        let f0 = |v: &[f64]| fmt_spread_with(v, "", fmt_0);
        let mut s = format!(
            "\nWhat the programs cost per packet: the kernel's BPF run-time statistics \
             (`kernel.bpf_stats_enabled`, run_time_ns / run_cnt of each program, read from its \
             pin) over an untimed {PROG_COST_SECS} s TCP_CRR run of the variant right after its \
             measurements in every repetition; median [min–max] over repetitions. The statistics \
             add a clock read to every run, the same for both programs; **above the floor** is \
             calix's `from_pod` minus the minimal tc program's `from_pod` in the same \
             repetition. `to_pod` runs only for packets the host stack delivers: none on the fast \
             path.\n\n\
             | variant | `from_pod` ns per packet | above the floor | packets per run | `to_pod` runs |\n\
             |---|---|---|---|---|\n"
        );
        let baseline = self.baseline.as_ref().map(|_| Variant::Baseline);
        for v in [Variant::Ebpf, Variant::EbpfClsBpf, Variant::Floor]
            .into_iter()
            .chain(baseline)
        {
            let c = &self.cost[v as usize];
            let above = match v {
                Variant::Ebpf | Variant::Baseline => f1(&self.above_floor_of(v)),
                _ => "—".into(),
            };
            s.push_str(&format!(
                "| {} | {} | {above} | {} | {} |\n",
                v.label(),
                f1(&c.from_pod_ns),
                f0(&c.from_pod_runs),
                f0(&c.to_pod_runs),
            ));
        }
        if baseline.is_some() {
            let (this, base) = (
                median(&self.cost[Variant::Ebpf as usize].from_pod_ns),
                median(&self.cost[Variant::Baseline as usize].from_pod_ns),
            );
            s.push_str(&format!(
                "\nThis build's `from_pod` over the baseline's: {} ({} against {} ns per \
                 packet, medians).\n",
                ratio(this, base),
                fmt_1(this),
                fmt_1(base)
            ));
        }
        let (t, c) = (
            &self.attach[Variant::Ebpf as usize],
            &self.attach[Variant::EbpfClsBpf as usize],
        );
        let saved: Vec<f64> = c
            .ns_per_packet
            .iter()
            .zip(&t.ns_per_packet)
            .map(|(c, t)| c - t)
            .collect();
        s.push_str(&format!(
            "\nWhat the attachment costs: every repetition, a {FLOOD_SECS} s flood from the \
             client pod of 60-byte UDP frames from a spoofed source, which `from_pod` drops \
             (counted: `spoofed_source_v4`); the sender thread's CPU time plus the bench CPU's \
             ksoftirqd (a veth delivers on the sending CPU) per dropped frame: the pod's veth, \
             its peer's receive, the hook, the program, the drop counter. Same program, same \
             frames: the difference is the attachment.\n\n\
             | attachment | ns per packet | Mpps dropped |\n|---|---|---|\n\
             | tcx (calix eBPF) | {} | {} |\n\
             | cls_bpf on clsact (calix eBPF, cls_bpf) | {} | {} |\n\
             | **cls_bpf − tcx**, per repetition | {} | |\n",
            f1(&t.ns_per_packet),
            fmt_spread_with(&t.mpps, "", fmt_2),
            f1(&c.ns_per_packet),
            fmt_spread_with(&c.mpps, "", fmt_2),
            f1(&saved),
        ));
        s
    }
}

pub(super) fn chart(path: &Path, r: &Report) -> Result<()> {
    let title = traffic_title("Same-node pod-to-pod", r.reps, r.secs, &r.machine().date);
    let variants: Vec<_> = r
        .variants()
        .into_iter()
        .map(|v| (v.label(), v.color(), Some(r.get(v))))
        .collect();
    traffic_chart(path, (1200, 460), &title, &variants)
}
