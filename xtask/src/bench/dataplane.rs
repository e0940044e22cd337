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
//! `from_pod` drops (a spoofed source), tcx against cls_bpf. Everything is named `cxb-<pid>-…` and removed on drop, on
//! error and Ctrl-C too. Writes docs/bench/dataplane.md and .svg (with `--quick`,
//! target/bench/ instead: development numbers are not published).
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use calix_kernel::pod::HOST_VETH_MAC;
use calix_testbed::packets::{eth, udp_with, Ip4, ETH_P_IP, UDP};
use calix_testbed::traffic::cpu::{ksoftirqd_pid, task_cpu_ns};
use calix_testbed::traffic::flood::flood;
use calix_testbed::traffic::netperf::Mode;
use calix_testbed::traffic::{Tools, Traffic, IPERF_NICE, TW_REUSE_DELAY};
use calix_testbed::{veth, AgentSpec, Dataplane, Guarded, Netns, Node, Plugin, CNI_DIR, POOL};
use plotters::style::RGBColor;
use serde_json::json;

use super::chart::{self, traffic_chart, traffic_title};
use super::harness::{
    check_interrupted, cni_plugins_version, repetitions, version, warm_up, Bench, Compared, Machine,
};
use super::report::{
    busy_note_of, fmt_0, fmt_1, fmt_2, fmt_spread_with, heading, median, ratio, targets,
    traffic_table, Traffic as Samples, RATIOS_NOTE,
};

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
}

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
        }
    }
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
fn topology(b: &Bench, tools: &Tools, v: Variant, floor: &Path) -> Result<Topology> {
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
            let spec = AgentSpec {
                object,
                config,
                ..b.spec(dataplane)
            };
            let n = b.node(tag, spec)?;
            let conf = n.conf(json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } }));
            let p = Plugin::new(v.label(), b.bins.join("calix"), Some(&n.ns), &conf);
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
        (Variant::Ebpf | Variant::EbpfClsBpf | Variant::Floor, Some(n)) => Some(
            COST_PROGS
                .iter()
                .map(|p| {
                    n.prog_pin(p)
                        .with_context(|| format!("{}: no pin of {p}", v.label()))
                })
                .collect::<Result<Vec<_>>>()?,
        ),
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

pub fn run(reps: usize, secs: u64, quick: bool) -> Result<()> {
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
    let tools = b.tools();
    let mut topo = Vec::with_capacity(VARIANTS.len());
    for v in VARIANTS {
        check_interrupted()?;
        let t =
            topology(&b, &tools, v, &floor).with_context(|| format!("setting up {}", v.label()))?;
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

    let mut res: [Samples; 6] = Default::default();
    let mut cost: [Cost; 6] = Default::default();
    let mut attach: [Attach; 6] = Default::default();
    let ksoftirqd = ksoftirqd_pid(tools.cpu);
    repetitions(reps, &VARIANTS, |v| {
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
        bench: b,
    };
    Bench::publish("dataplane", &report.markdown(), quick, |p| {
        chart(p, &report)
    })
}

/// What the pod-side programs cost per packet in one variant, per repetition: the kernel's BPF
/// run-time statistics (`kernel.bpf_stats_enabled`) over an untimed TCP_CRR run right after the
/// variant's measurements (the statistics add two clock reads per run, so never during one).
#[derive(Default)]
struct Cost {
    /// `from_pod`'s ns per run.
    from_pod_ns: Vec<f64>,
    from_pod_runs: Vec<f64>,
    /// `to_pod`'s runs meanwhile: 0 when every packet took the fast path.
    to_pod_runs: Vec<f64>,
}

impl Cost {
    fn measure(
        &mut self,
        tools: &Tools,
        tr: &Traffic,
        pins: &[std::path::PathBuf],
    ) -> Result<String> {
        let rt = calix_testbed::bpf::pinned_run_time(pins, || {
            tools.netperf(tr, Mode::Crr, PROG_COST_SECS).map(drop)
        })
        .context("measuring the programs' run time")?;
        let (from, to) = (rt[0], rt[1]);
        let ns = from
            .ns_per_run
            .context("from_pod did not run during the cost measurement")?;
        self.from_pod_ns.push(ns);
        self.from_pod_runs.push(from.runs as f64);
        self.to_pod_runs.push(to.runs as f64);
        Ok(format!(
            ", from_pod {ns:.1} ns/packet over {} packets",
            from.runs
        ))
    }
}

/// What the attachment costs in one calix eBPF variant, per repetition: a flood of frames from
/// the client pod that `from_pod` drops (a spoofed source) — the pod's veth, its peer's
/// receive, the hook, the program up to its anti-spoofing check, the drop counter — timed as
/// the sender thread's CPU plus the bench CPU's ksoftirqd (a veth delivers on the sending
/// CPU), per dropped frame. The same program in both variants: the difference is tcx against
/// cls_bpf.
#[derive(Default)]
struct Attach {
    ns_per_packet: Vec<f64>,
    mpps: Vec<f64>,
}

impl Attach {
    fn measure(
        &mut self,
        node: &Node,
        tr: &Traffic,
        (cpu, ksoftirqd): (usize, Option<u32>),
    ) -> Result<String> {
        let mac = tr.client.mac("eth0")?;
        let payload = udp_with(9, 9, &[0; 18]);
        let ip = Ip4::new(SPOOFED, tr.server_ip.octets(), UDP, payload);
        let frame = eth(HOST_VETH_MAC, mac, ETH_P_IP, &ip.bytes());
        let dropped = || -> u64 {
            node.cali_links()
                .iter()
                .map(|l| node.dropped(l, "spoofed_source_v4"))
                .sum()
        };
        let d0 = dropped();
        let k0 = task_cpu_ns(ksoftirqd);
        let fl = flood(&tr.client, "eth0", cpu, frame, FLOOD_SECS)?;
        let k1 = task_cpu_ns(ksoftirqd);
        let drops = dropped().saturating_sub(d0) as f64;
        anyhow::ensure!(
            drops >= 0.9 * fl.sent as f64,
            "from_pod dropped {drops} of {} flooded frames",
            fl.sent
        );
        let ns = (fl.cpu_ns + k1 - k0) / drops;
        self.ns_per_packet.push(ns);
        self.mpps.push(drops / fl.secs / 1e6);
        Ok(format!(", flood {ns:.0} ns/packet"))
    }
}

// --- report --------------------------------------------------------------------------------

struct Report {
    reps: usize,
    secs: u64,
    quick: bool,
    cpu: usize,
    /// Whether the client namespaces reuse TIME_WAIT ports after 1 ms.
    tw_delay: bool,
    plugins_version: String,
    iperf_version: String,
    res: [Samples; 6],
    /// The programs' run time (eBPF variants).
    cost: [Cost; 6],
    /// The attachment's cost (the calix eBPF variants).
    attach: [Attach; 6],
    bench: Bench,
}

impl Report {
    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    /// calix `from_pod`'s ns per packet above the minimal tc program's, per repetition (the
    /// two measured in the same repetition).
    fn above_floor(&self) -> Vec<f64> {
        let (c, f) = (
            &self.cost[Variant::Ebpf as usize].from_pod_ns,
            &self.cost[Variant::Floor as usize].from_pod_ns,
        );
        c.iter().zip(f).map(|(c, f)| c - f).collect()
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

    fn markdown(&self) -> String {
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
        let row = |v: Variant| (v.label(), self.get(v));
        s.push_str(&traffic_table(
            VARIANTS.map(row),
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
            VARIANTS
                .iter()
                .map(|&v| format!(
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
        for v in [
            Variant::Ebpf,
            Variant::EbpfClsBpf,
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
        for v in [Variant::Ebpf, Variant::EbpfClsBpf, Variant::Floor] {
            let c = &self.cost[v as usize];
            let above = match v {
                Variant::Ebpf => f1(&self.above_floor()),
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

fn chart(path: &Path, r: &Report) -> Result<()> {
    let title = traffic_title("Same-node pod-to-pod", r.reps, r.secs, &r.machine().date);
    let variants = VARIANTS.map(|v| (v.label(), v.color(), Some(r.get(v))));
    traffic_chart(path, (1200, 460), &title, &variants)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::{around, render};

    #[test]
    fn the_report_renders() {
        let reps = 3;
        let res = [1.2, 1.0, 0.9, 1.3, 1.25, 1.15].map(|k| Samples::fake(k, reps));
        let mut cost: [Cost; 6] = Default::default();
        for (v, ns) in [
            (Variant::Ebpf, 90.0),
            (Variant::EbpfClsBpf, 95.0),
            (Variant::Floor, 40.0),
        ] {
            cost[v as usize] = Cost {
                from_pod_ns: around(ns, reps),
                from_pod_runs: around(1e6, reps),
                to_pod_runs: around(0.0, reps),
            };
        }
        let mut attach: [Attach; 6] = Default::default();
        for (v, ns) in [(Variant::Ebpf, 300.0), (Variant::EbpfClsBpf, 340.0)] {
            attach[v as usize] = Attach {
                ns_per_packet: around(ns, reps),
                mpps: around(1e3 / ns, reps),
            };
        }
        let r = Report {
            reps,
            secs: 3,
            quick: false,
            cpu: 1,
            tw_delay: true,
            plugins_version: "1.1.1".into(),
            iperf_version: "iperf 3.18".into(),
            res,
            cost,
            attach,
            bench: Bench::fake(),
        };
        let md = r.markdown();
        let svg = render("dataplane", &md, |p| chart(p, &r));
        assert!(md.starts_with("# Same-node pod-to-pod dataplane"));
        assert!(md.contains("| calix eBPF, cls_bpf |"));
        assert!(svg.contains("calix eBPF") && svg.contains("TCP_RR round trip"));
    }
}
