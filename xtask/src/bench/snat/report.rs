//! The snat bench's report: the markdown and the chart.
use std::path::Path;

use anyhow::Result;
use calix_testbed::traffic::flood::BATCH;
use calix_testbed::traffic::IPERF_NICE;

use super::drops::DropSamples;
use super::{
    Filter, Variant, DENY_CIDR, FILTERS, FLOOD_PORT, FLOOD_SRC, FLOOR_ETHERTYPE, INET, NODE_UP,
    POOL, UPLINK, UP_PREFIX, VARIANTS, XDP_REASON,
};
use crate::bench::chart::{self, traffic_panels, Layout, Panel, Series};
use crate::bench::harness::{Bench, Compared};
use crate::bench::report::{
    busy_note, fmt_0, fmt_1, fmt_2, fmt_spread_with, heading, median, ratio, targets,
    Traffic as Samples,
};

pub(super) struct Report {
    pub(super) reps: usize,
    pub(super) secs: u64,
    pub(super) quick: bool,
    pub(super) iperf_version: String,
    pub(super) nft_version: String,
    pub(super) iptables_version: String,
    /// Per variant: why it was not measured.
    pub(super) unavailable: Vec<Option<String>>,
    pub(super) snat_config: Option<String>,
    /// The calix SNAT node's agent: its command line (when it ran) and config file.
    pub(super) snat_args: Option<String>,
    pub(super) snat_agent_config: String,
    pub(super) res: [Samples; 5],
    pub(super) dres: [DropSamples; 5],
    /// Per filter: the XDP program's own run time per packet (kernel BPF stats).
    pub(super) xdp_prog_ns: [Option<f64>; 5],
    pub(super) bench: Bench,
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

    pub(super) fn markdown(&self) -> String {
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

pub(super) fn chart(path: &Path, r: &Report) -> Result<()> {
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
