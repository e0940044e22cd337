//! The policy bench's report: the markdown and the chart.
use std::path::Path;

use anyhow::Result;

use super::latency::{Latency, ATTEMPT};
use super::perf::{
    ns_per_conn, us_per_conn, Results, Variant, PROFILE_SECS, PROG_COST_SECS, VARIANTS,
};
use super::scale::Scale;
use super::versus::{Engine, Versus, ENGINES, RULES};
use crate::bench::chart::{self, Layout, Panel};
use crate::bench::harness::{Bench, Compared};
use crate::bench::report::{
    busy_note_of, fmt_0, fmt_1, fmt_2, fmt_spread_with, heading, median, percentile, ratio,
    targets, traffic_table, Traffic as Samples, RATIOS_NOTE,
};

pub(super) struct Report {
    pub(super) reps: usize,
    pub(super) secs: u64,
    pub(super) quick: bool,
    pub(super) per_packet: Results,
    pub(super) versus: Versus,
    pub(super) latency: Latency,
    pub(super) scale: Scale,
    /// The packet-by-packet section ([`super::packets`]), as written.
    pub(super) packets: String,
    pub(super) bench: Bench,
}

impl Report {
    fn traffic(&self, v: Variant) -> &Samples {
        &self.per_packet.traffic[v as usize]
    }

    /// `v`'s `from_pod` ns per packet above no policy's, per repetition (the two measured in
    /// the same repetition), over TCP_CRR or (`rr`) TCP_RR.
    fn above_none(&self, v: Variant, rr: bool) -> Vec<f64> {
        let of = |v: Variant| {
            let c = &self.per_packet.by_variant[v as usize];
            if rr {
                &c.from_pod_rr_ns
            } else {
                &c.from_pod_ns
            }
        };
        of(v)
            .iter()
            .zip(of(Variant::None))
            .map(|(c, n)| c - n)
            .collect()
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let above = median(&self.above_none(Variant::R100, false));
        let above_rr = median(&self.above_none(Variant::R100, true));
        let (c100, c0, again) = (
            median(&self.traffic(Variant::R100).crr),
            median(&self.traffic(Variant::None).crr),
            median(&self.traffic(Variant::NoneAgain).crr),
        );
        let p99 = |v: &[f64]| percentile(v, 99.0);
        let worst = p99(&self.latency.policy_ms).max(p99(&self.latency.label_ms));
        let s = &self.scale;
        let added = s.rss_after_mib - s.rss_before_mib;
        let change = median(&s.local_change_ms).max(median(&s.remote_change_ms));
        vec![
            (
                format!(
                    "from_pod with 100 rules ≤ 15 ns per packet above no policy: {} ns over \
                     TCP_CRR (new connections), {} ns over TCP_RR (established)",
                    fmt_1(above),
                    fmt_1(above_rr)
                ),
                Some(above <= 15.0),
            ),
            (
                format!(
                    "same-node conn/s with 100 rules ≥ 0.97× no policy: {} vs {} ({:.3}×; \
                     0.97× is {}; the control, a second pair with no policy: {:.3}×)",
                    fmt_0(c100),
                    fmt_0(c0),
                    c100 / c0,
                    fmt_0(0.97 * c0),
                    again / c0
                ),
                Some(c100 >= 0.97 * c0),
            ),
            (
                format!(
                    "programming latency p99 ≤ 250 ms (a policy written or deleted, a label \
                     changed; all 3 nodes): {} ms",
                    fmt_1(worst)
                ),
                Some(worst <= 250.0),
            ),
            (
                format!(
                    "{} pods and {} policies all programmed ≤ 2 s (from the agent's start): {} s",
                    s.pods,
                    s.policies,
                    fmt_2(s.programmed_s)
                ),
                Some(s.programmed_s <= 2.0),
            ),
            (
                format!("≤ 32 MiB added: {} MiB", fmt_1(added)),
                Some(added <= 32.0),
            ),
            (
                format!(
                    "one label change ≤ 10 ms of the agent's time (median, the worse kind): {} ms",
                    fmt_1(change)
                ),
                Some(change <= 10.0),
            ),
            self.versus_target(Engine::Nft),
            self.versus_target(Engine::NftLast),
        ]
    }

    /// eBPF ≥ 1.3× kernel mode's conn/s, against kernel mode with the allowing entry where
    /// `nft` puts it.
    fn versus_target(&self, nft: Engine) -> (String, Option<bool>) {
        let (e, n) = (
            median(&self.versus.traffic[Engine::Ebpf as usize].crr),
            median(&self.versus.traffic[nft as usize].crr),
        );
        let place = if nft == Engine::NftLast {
            "last"
        } else {
            "first"
        };
        (
            format!(
                "eBPF ≥ 1.3× kernel-mode nftables conn/s at 1,000 rules, the allowing entry \
                 {place} in nftables' chain: {} vs {} ({})",
                fmt_0(e),
                fmt_0(n),
                ratio(e, n)
            ),
            Some(e >= 1.3 * n),
        )
    }

    pub(super) fn markdown(&self) -> String {
        let mut s = heading(
            "NetworkPolicy: cost per packet, programming latency, scale",
            self.quick,
        );
        s.push_str(&format!(
            "{}: release build; calix nodes in Kubernetes mode (`calix-agent --dataplane ebpf`, \
             each authenticated as the agents' ServiceAccount with the chart's ClusterRole) on a \
             real kube-apiserver v1.36.2 and etcd; pods wired by the `calix` CNI plugin through \
             the agent, their Pod objects and addresses in the API server as a kubelet writes \
             them.\n\n",
            self.bench.measured(&format!(
                "policy --reps {} --secs {} --changes {} --scale-pods {}",
                self.reps,
                self.secs,
                self.latency.policy_ms.len(),
                self.scale.pods
            )),
        ));
        s.push_str(&self.per_packet_section());
        s.push_str(&self.packets);
        s.push_str(&self.versus_section());
        s.push_str(&self.latency_section());
        s.push_str(&self.scale_section());
        s.push_str(&targets("## Targets (issue 22)", &self.targets(), ""));
        s
    }

    fn versus_section(&self) -> String {
        let t = |e: Engine| (e.label(), &self.versus.traffic[e as usize]);
        let mut s = format!(
            "## eBPF against kernel mode (nftables)\n\nThe same pair and policy ({RULES} rules \
             each way), on an eBPF node and on a kernel-mode node \
             (`calix-agent --dataplane kernel`: the `inet calix_policy` table, \
             [decisions](../decisions.md#networkpolicy-in-kernel-mode-nftables-issue-22)) of the \
             same API server, measured as above, the three interleaved. Kernel mode judges a \
             connection's first packet by walking the endpoint's entries in order (one rule \
             each), so it runs twice: the pair's own entry first in its chain (the other peers' \
             /32s in 172.16.0.0/16, numbered after the pods' addresses) and last (in \
             10.0.0.0/16, numbered before them: 999 entries walked first).\n\n"
        );
        s.push_str(&traffic_table(
            ENGINES.iter().map(|&e| t(e)),
            [
                (t(Engine::Ebpf), t(Engine::Nft)),
                (t(Engine::Ebpf), t(Engine::NftLast)),
            ],
        ));
        s.push_str(RATIOS_NOTE);
        s.push_str(
            "\nkernel mode marks a connection once its first packet passed; its later packets \
             pass on the mark. eBPF looks a new flow up in two tries whatever the number of \
             rules and wherever the allowing one is.\n\n",
        );
        s
    }

    fn per_packet_section(&self) -> String {
        let mut s = format!(
            "## Per packet\n\nA client and a server pod on one node; with policy, one \
             NetworkPolicy selects both and isolates them both ways with *n* rules in each \
             direction: one lets the pair in (`podSelector`), the other *n*−1 each name another \
             peer (an `ipBlock` /32) on other ports (TCP or UDP, a fifth of them port ranges). \
             What the dataplane held: {}. Per variant and repetition, each {} s long, client and \
             server pinned to CPU {}: TCP_CRR, TCP_RR and iperf3 as in \
             [dataplane](dataplane.md), then the programs' own run time per packet (the \
             kernel's BPF statistics, over an untimed {PROG_COST_SECS} s TCP_CRR run, new \
             connections, and a TCP_RR run as long, one established connection). **no \
             policy, second pair** is the control: no policy either, on a pair of pods of its \
             own; its ratio to no policy is what two pairs differ by with nothing else changed \
             (their addresses, namespaces and port tables), the yardstick for the other \
             ratios. {} repetitions, variants interleaved; median [min–max] over \
             repetitions.\n\n",
            self.per_packet.programmed, self.secs, self.per_packet.cpu, self.reps
        );
        let none = (Variant::None.label(), self.traffic(Variant::None));
        s.push_str(&traffic_table(
            VARIANTS.iter().map(|&v| (v.label(), self.traffic(v))),
            VARIANTS[1..]
                .iter()
                .map(|&v| ((v.label(), self.traffic(v)), none)),
        ));
        s.push_str(RATIOS_NOTE);
        s.push_str(&busy_note_of(
            self.per_packet.cpu,
            self.bench.machine.cpus,
            &self.per_packet.traffic,
        ));
        s.push_str(
            "\n| variant | from_pod ns/packet, TCP_CRR | above no policy | from_pod ns/packet, \
             TCP_RR | above no policy | to_pod runs |\n|---|---|---|---|---|---|\n",
        );
        for v in VARIANTS {
            let r = &self.per_packet.by_variant[v as usize];
            let above = |rr: bool| match v {
                Variant::None => "–".to_string(),
                _ => fmt_spread_with(&self.above_none(v, rr), " ns", fmt_1),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                v.label(),
                fmt_spread_with(&r.from_pod_ns, " ns", fmt_1),
                above(false),
                fmt_spread_with(&r.from_pod_rr_ns, " ns", fmt_1),
                above(true),
                fmt_spread_with(&r.to_pod_runs, "", fmt_0),
            ));
        }
        s.push_str(
            "\nOn one node `from_pod` delivers into the destination pod (`bpf_redirect_peer`) \
             and judges both directions there (the client's egress, the server's ingress): \
             `to_pod` does not run. A new flow pays the peer's identity (a longest-prefix \
             match) and one rule lookup per direction; its later packets one flow lookup: the \
             number of rules changes the size of the tables, not the lookups.\n\n",
        );
        s.push_str(&self.profile_section());
        s
    }

    /// Where a connection's time goes with 100 rules against no policy: the symbols whose
    /// time per connection grew most.
    fn profile_section(&self) -> String {
        let p = &self.per_packet.profiles;
        let (none, with, again) = (Variant::None, Variant::R100, Variant::NoneAgain);
        if [none, with, again]
            .iter()
            .any(|&v| !p.iter().any(|x| x.variant == v))
        {
            return String::new();
        }
        let conns = |v: Variant| {
            p.iter()
                .filter(|x| x.variant == v)
                .map(|x| format!("{:.0}", x.conns))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut s = format!(
            "### Where a new connection's time goes\n\nThe bench CPU's time by symbol over \
             untimed {PROFILE_SECS} s TCP_CRR runs, no policy, 100 rules, the control (no \
             policy, second pair) twice, 100 rules, no policy (in that order: each run's \
             TIME_WAIT sockets slow the next one's connects), with \
             `perf record -e cpu-clock` on CPU {} and the BPF statistics off (samples of the \
             bench's processes and the CPU's softirq thread), as time per connection, the mean \
             of a variant's two runs: the client and server keep that CPU busy, so a symbol's \
             share of the samples is its share of the run. A connection took {} µs with no \
             policy ({} connections) and {} µs with 100 rules ({}): {} ns more; {} µs in the \
             control ({}: {} than no policy, with nothing changed but the pair). The \
             symbols whose time grew most with 100 rules, and the control's:\n\n| symbol | no \
             policy, ns/connection | 100 rules | more | control |\n|---|---|---|---|---|\n",
            self.per_packet.cpu,
            fmt_2(us_per_conn(p, none)),
            conns(none),
            fmt_2(us_per_conn(p, with)),
            conns(with),
            fmt_0((us_per_conn(p, with) - us_per_conn(p, none)) * 1e3),
            fmt_2(us_per_conn(p, again)),
            conns(again),
            more_or_less((us_per_conn(p, again) - us_per_conn(p, none)) * 1e3),
        );
        let mut syms: Vec<(f64, &str)> = p
            .iter()
            .flat_map(|x| &x.symbols)
            .map(|(_, sym)| sym.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|sym| (ns_per_conn(p, with, sym) - ns_per_conn(p, none, sym), sym))
            .collect();
        syms.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (more, sym) in syms.iter().take(15) {
            s.push_str(&format!(
                "| `{sym}` | {} | {} | {} | {} |\n",
                fmt_0(ns_per_conn(p, none, sym)),
                fmt_0(ns_per_conn(p, with, sym)),
                fmt_0(*more),
                fmt_0(ns_per_conn(p, again, sym)),
            ));
        }
        s.push('\n');
        s
    }

    fn latency_section(&self) -> String {
        let l = &self.latency;
        let row = |what: &str, v: &[f64]| {
            format!(
                "| {what} | {} | {} ms | {} ms | {} ms |\n",
                v.len(),
                fmt_1(median(v)),
                fmt_1(percentile(v, 99.0)),
                fmt_1(v.iter().copied().fold(f64::NAN, f64::max)),
            )
        };
        format!(
            "## Programming latency\n\nThree nodes, a client and a server pod on each; a \
             policy isolating the servers always in force. Changes, alternating: the \
             NetworkPolicy `allow` (clients labelled `access: yes` may reach the servers) \
             deleted then written again, and with it in force every client's label set to \
             `access: no` then back. Before each change a probe starts in every client: TCP \
             connection attempts to its server, each given {} ms (answered, accepted or reset: \
             open; timed out: closed). A change's latency is the slowest node's, from just \
             before its write to the API server to the start of the first attempt that saw the \
             new verdict (an opening is seen up to one attempt late).\n\n\
             | change | n | p50 | p99 | max |\n|---|---|---|---|---|\n{}{}\n",
            ATTEMPT.as_millis(),
            row("NetworkPolicy written or deleted", &l.policy_ms),
            row("pod label changed", &l.label_ms),
        )
    }

    fn scale_section(&self) -> String {
        let s = &self.scale;
        let [apply, compile, program] = s.steps_s;
        let changes = |v: &[f64]| {
            format!(
                "{} ms [{}–{}]",
                fmt_1(median(v)),
                fmt_1(v.iter().copied().fold(f64::NAN, f64::min)),
                fmt_1(v.iter().copied().fold(f64::NAN, f64::max))
            )
        };
        format!(
            "## Scale\n\nOne agent (the other nodes' stopped) facing {} pods and {} \
             NetworkPolicies cluster-wide, 100 of the pods its own (wired by the CNI plugin), \
             the others in 100 namespaces of other nodes; pods labelled `app` (20 values) and \
             `tier` (5), namespaces `team` (10); each policy selects an `app` in its namespace, \
             lets in another `app` on one TCP port, a `tier` of the namespaces of a `team`, and \
             an ipBlock /16 with a /24 `except`, and lets out to a `tier` on UDP 53.\n\n\
             | | |\n|---|---|\n\
             | agent RSS, its 100 pods and no policy (freshly started) | {} MiB |\n\
             | agent RSS, everything (freshly started) | {} MiB (+{} MiB) |\n\
             | from the agent's start: every object listed | {} s |\n\
             | from the agent's start: everything programmed | {} s |\n\
             | the agent's time over that start: apply / compile / program | {} / {} / {} s |\n\
             | what the dataplane holds | {} |\n\
             | one label change, a local pod's (agent time, {} changes) | {} |\n\
             | one label change, another node's pod's | {} |\n\n\
             The agent's time is its `calix_policy_seconds_total` (every step: the change into \
             the calculation, the compilation of this node's tables, the writes to the maps). \
             Each compilation starts from the last: only the sets whose members moved, and \
             their addresses, are looked at again.\n\n",
            s.pods,
            s.policies,
            fmt_1(s.rss_before_mib),
            fmt_1(s.rss_after_mib),
            fmt_1(s.rss_after_mib - s.rss_before_mib),
            fmt_2(s.ready_s),
            fmt_2(s.programmed_s),
            fmt_2(apply),
            fmt_2(compile),
            fmt_2(program),
            s.dataplane,
            s.local_change_ms.len(),
            changes(&s.local_change_ms),
            changes(&s.remote_change_ms),
        )
    }

    pub(super) fn chart(&self, path: &Path) -> Result<()> {
        let groups: Vec<&str> = VARIANTS.iter().map(|v| v.label()).collect();
        let one = |f: &dyn Fn(Variant) -> f64| -> Vec<chart::Series> {
            vec![(
                "median",
                chart::BLUE,
                VARIANTS.iter().map(|&v| Some(f(v))).collect(),
            )]
        };
        let l = &self.latency;
        let title = format!(
            "NetworkPolicy in calix eBPF, {} reps × {} s ({})",
            self.reps, self.secs, self.bench.machine.date
        );
        chart::chart(
            path,
            (1200, 420),
            &title,
            Layout::Grid(1, 3),
            &[
                Panel::new(
                    "from_pod ns per packet, lower is better",
                    "ns",
                    &groups,
                    vec![
                        (
                            "TCP_CRR",
                            chart::BLUE,
                            VARIANTS
                                .iter()
                                .map(|&v| {
                                    Some(median(
                                        &self.per_packet.by_variant[v as usize].from_pod_ns,
                                    ))
                                })
                                .collect(),
                        ),
                        (
                            "TCP_RR",
                            chart::LIGHT_BLUE,
                            VARIANTS
                                .iter()
                                .map(|&v| {
                                    Some(median(
                                        &self.per_packet.by_variant[v as usize].from_pod_rr_ns,
                                    ))
                                })
                                .collect(),
                        ),
                    ],
                    |_, _, v| fmt_1(v),
                ),
                Panel::new(
                    "same-node conn/s (TCP_CRR), higher is better",
                    "conn/s",
                    &groups,
                    one(&|v| median(&self.traffic(v).crr)),
                    |_, _, v| fmt_0(v),
                ),
                Panel::new(
                    "programming latency, 3 nodes (ms)",
                    "ms",
                    &["policy", "label"],
                    vec![
                        (
                            "p50",
                            chart::LIGHT_BLUE,
                            vec![Some(median(&l.policy_ms)), Some(median(&l.label_ms))],
                        ),
                        (
                            "p99",
                            chart::BLUE,
                            vec![
                                Some(percentile(&l.policy_ms, 99.0)),
                                Some(percentile(&l.label_ms, 99.0)),
                            ],
                        ),
                    ],
                    |_, _, v| fmt_1(v),
                )
                .reference("target p99", 250.0),
            ],
        )
    }
}

/// A difference in ns as words: "120 ns more", "120 ns less".
fn more_or_less(ns: f64) -> String {
    if ns < 0.0 {
        format!("{} ns less", fmt_0(-ns))
    } else {
        format!("{} ns more", fmt_0(ns))
    }
}
