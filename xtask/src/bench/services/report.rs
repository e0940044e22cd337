//! The services bench's report: per stage, each variant's conn/s, TCP_RR, change latency, time
//! to program the stage, RSS and CPU; the ratios of calix to kube-proxy; the targets;
//! a chart of conn/s, change latency p99 and RSS by stage.
use std::path::Path;

use anyhow::Result;

use super::{Each, Results, Stage, Variant, VARIANTS};
use crate::bench::chart::{self, Layout, Panel};
use crate::bench::harness::{Bench, Compared};
use crate::bench::report::{
    fmt_0, fmt_1, fmt_ms, fmt_spread_with, heading, load_note, median, percentile, ratio, targets,
    thousands, RATIOS_NOTE,
};

pub(super) struct Report {
    pub reps: usize,
    pub secs: u64,
    pub changes: usize,
    pub quick: bool,
    pub results: Results,
    pub bench: Bench,
}

impl Report {
    fn first(&self) -> Option<&(usize, [Stage; 3])> {
        self.results.stages.first()
    }

    fn last(&self) -> Option<&(usize, [Stage; 3])> {
        self.results.stages.last()
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let (Some((n0, first)), Some((n, last))) = (self.first(), self.last()) else {
            return Vec::new();
        };
        let crr = |s: &Stage| median(&s.traffic.crr);
        let [c, i, f] = last.each(crr);
        let flat = c / crr(&first[Variant::Calix as usize]);
        let p99 = percentile(&last[0].latency_ms, 99.0);
        let worst_p99 = self
            .results
            .stages
            .iter()
            .map(|(_, s)| percentile(&s[0].latency_ms, 99.0))
            .fold(0.0, f64::max);
        let added = last[0].rss_mib - first[0].rss_mib;
        let (n0, n) = (thousands(*n0), thousands(*n));
        let churn = self.results.churn.as_ref().map(|c| {
            let r = median(&c.churn_ms) / median(&c.idle_ms);
            (
                format!(
                    "churn of thousands of Services a minute does not delay pod ADDs: ADD p50 \
                     while {:.0} EndpointSlices a minute are rewritten ≤ 1.2× quiet (our bound): \
                     {r:.2}×",
                    c.per_minute
                ),
                Some(r <= 1.2),
            )
        });
        let mut out = vec![
            (
                format!(
                    "at {n} Services, calix conn/s ≥ 1.5× kube-proxy iptables: {}",
                    ratio(c, i)
                ),
                Some(c >= 1.5 * i),
            ),
            (
                format!(
                    "at {n} Services, calix conn/s ≥ 1.1× kube-proxy nftables: {}",
                    ratio(c, f)
                ),
                Some(c >= 1.1 * f),
            ),
            (
                format!("calix flat in N: conn/s at {n} ≥ 0.95× at {n0}: {flat:.2}×"),
                Some(flat >= 0.95),
            ),
            (
                format!(
                    "a change takes effect in ≤ 100 ms p99 (calix): {} ms at {n}, {} ms at worst",
                    fmt_ms(p99),
                    fmt_ms(worst_p99)
                ),
                Some(worst_p99 <= 100.0),
            ),
            (
                format!("≤ 32 MiB RSS added at {n} Services (calix agent, against {n0}): {added:.1} MiB"),
                Some(added <= 32.0),
            ),
        ];
        out.extend(churn);
        out
    }

    pub(super) fn markdown(&self) -> String {
        let mut s = heading(
            "Services: calix eBPF against kube-proxy (iptables, nftables)",
            self.quick,
        );
        let stages: Vec<String> = self
            .results
            .stages
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        s.push_str(&format!(
            "{}: release build; three calix nodes (eBPF, Kubernetes mode) of one real \
             kube-apiserver v1.36.2, each with a client pod and two backend pods and a probe \
             Service naming them. On one, calix translates Services (`[services] translate`: \
             the socket programs, the client in their cgroup); on the others calix does not and \
             kube-proxy v1.36.2 runs in the node's namespace (`--proxy-mode=iptables`, \
             `nftables`). Every variant sees every Service: the stages' Services (2 endpoints \
             each, no pod behind the fillers'; the probes and `kubernetes` count) are written \
             in bulk, then measured once every variant has programmed them. Traffic: TCP_CRR \
             and TCP_RR from the client to its probe Service's cluster IP, {} s each, the three \
             variants interleaved over {} repetitions, client and servers on one CPU. Change: \
             {} a stage on each variant: a new Service's EndpointSlice (its two backends) \
             written at least 2.4 s after the Service, one variant at a time, 1.2 s apart, \
             timed from the slice's write until a client trying every millisecond gets \
             through (methods: `xtask/src/bench/services/`).\n\n",
            self.bench.measured(&format!(
                "services --reps {} --secs {} --changes {} --stages {}",
                self.reps,
                self.secs,
                self.changes,
                stages.join(",")
            )),
            self.secs,
            self.reps,
            self.changes,
        ));
        for (n, st) in &self.results.stages {
            s.push_str(&stage_section(*n, st));
        }
        if let (Some(c), Some((n, _))) = (&self.results.churn, self.last()) {
            s.push_str(&churn_section(*n, c));
        }
        s.push_str(RATIOS_NOTE);
        let loads: Vec<f64> = self
            .results
            .stages
            .iter()
            .flat_map(|(_, st)| st.iter().flat_map(|x| x.traffic.load.iter().copied()))
            .collect();
        if let Some(note) = load_note(&loads) {
            s.push_str(&note);
        }
        s.push_str(
            "\nRSS: `VmRSS` of what programs Services (the calix agent; kube-proxy) once the \
             stage is programmed; the calix agents of the kube-proxy nodes (Services off) are \
             the floor an agent costs without them. CPU: utime + stime over the bulk write, \
             and over the changes divided by their number (each change writes a Service and \
             its EndpointSlice for every variant: 6 objects every one of them follows). \
             kube-proxy in iptables mode rewrites its whole table at \
             each change (`iptables-restore`); in nftables mode it updates its maps; calix \
             writes the Service's map entries.\n",
        );
        s.push_str(&targets("## Targets (issue 24)", &self.targets(), ""));
        s
    }

    pub(super) fn chart(&self, path: &Path) -> Result<()> {
        let groups: Vec<String> = self
            .results
            .stages
            .iter()
            .map(|(n, _)| format!("{} Services", thousands(*n)))
            .collect();
        let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
        let series = |f: &dyn Fn(&Stage) -> f64| -> Vec<chart::Series> {
            VARIANTS
                .iter()
                .map(|&v| {
                    let values = self
                        .results
                        .stages
                        .iter()
                        .map(|(_, st)| Some(f(&st[v as usize])))
                        .collect();
                    (v.label(), v.color(), values)
                })
                .collect()
        };
        let title = format!(
            "Services: calix eBPF against kube-proxy, {} reps × {} s ({})",
            self.reps, self.secs, self.bench.machine.date
        );
        chart::chart(
            path,
            (1200, 420),
            &title,
            Layout::Grid(1, 3),
            &[
                Panel::new(
                    "pod → ClusterIP conn/s, higher is better",
                    "conn/s",
                    &groups,
                    series(&|s| median(&s.traffic.crr)),
                    |_, _, v| fmt_0(v),
                ),
                Panel::new(
                    "a change until it takes effect, p99 (ms)",
                    "ms",
                    &groups,
                    series(&|s| percentile(&s.latency_ms, 99.0)),
                    |_, _, v| fmt_ms(v),
                )
                .reference("target", 100.0),
                Panel::new(
                    "RSS of what programs Services (MiB)",
                    "MiB",
                    &groups,
                    series(&|s| s.rss_mib),
                    |_, _, v| fmt_1(v),
                ),
            ],
        )
    }
}

/// The calix node's pod ADDs, quiet and while Services churn.
fn churn_section(n: usize, c: &super::churn::Churn) -> String {
    let row = |what: &str, ms: &[f64]| {
        format!(
            "| {what} | {} | {} ms | {} ms |\n",
            ms.len(),
            fmt_ms(median(ms)),
            fmt_ms(percentile(ms, 99.0))
        )
    };
    format!(
        "## Pod ADDs while Services churn ({} Services)\n\nOn the calix node (Services \
         translated), after the last stage and with the kube-proxies stopped (each would spend \
         most of a CPU of this machine's two on the churn): CNI ADDs of Pods the API has, {} a round, by turns \
         with the API quiet and while the fillers' EndpointSlices are rewritten at {} a minute \
         (each write changes a slice's endpoints; made: {:.0} a minute). An ADD is the \
         plugin's whole call: IPAM on the kubernetes datastore, the veth and its programs, \
         the policy wait.\n\n| | ADDs | p50 | p99 |\n|---|---|---|---|\n{}{}\
         | churning / quiet | | {} | {} |\n\n",
        thousands(n),
        super::CHURN_ADDS,
        super::churn::PER_MINUTE,
        c.per_minute,
        row("quiet", &c.idle_ms),
        row("Services churning", &c.churn_ms),
        ratio(median(&c.churn_ms), median(&c.idle_ms)),
        ratio(percentile(&c.churn_ms, 99.0), percentile(&c.idle_ms, 99.0)),
    )
}

/// One stage's table: a row per variant, then calix against each kube-proxy.
fn stage_section(n: usize, st: &[Stage; 3]) -> String {
    let mut s = format!(
        "## {} Services\n\n| variant | conn/s (TCP_CRR) | TCP_RR p50 | TCP_RR p99 | change p50 | \
         change p99 | stage programmed in | RSS | CPU, stage | CPU per change | agent RSS |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        thousands(n)
    );
    for v in VARIANTS {
        let x = &st[v as usize];
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} ms | {} ms | {:.1} s | {:.1} MiB | {:.2} s | {} ms | {:.1} MiB |\n",
            v.label(),
            fmt_spread_with(&x.traffic.crr, "", fmt_0),
            fmt_spread_with(&x.traffic.rr_p50, " µs", fmt_1),
            fmt_spread_with(&x.traffic.rr_p99, " µs", fmt_1),
            fmt_ms(median(&x.latency_ms)),
            fmt_ms(percentile(&x.latency_ms, 99.0)),
            x.program_secs,
            x.rss_mib,
            x.cpu_bulk_secs,
            fmt_ms(x.cpu_per_change_ms),
            x.agent_rss_mib,
        ));
    }
    let c = &st[Variant::Calix as usize];
    for v in [Variant::Iptables, Variant::Nftables] {
        let o = &st[v as usize];
        let r = |f: fn(&Stage) -> f64| ratio(f(c), f(o));
        s.push_str(&format!(
            "| calix / {} | {} | {} | {} | {} | {} | | | | | |\n",
            v.label(),
            r(|x| median(&x.traffic.crr)),
            r(|x| median(&x.traffic.rr_p50)),
            r(|x| median(&x.traffic.rr_p99)),
            r(|x| median(&x.latency_ms)),
            r(|x| percentile(&x.latency_ms, 99.0)),
        ));
    }
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::{around, render};
    use crate::bench::report::Traffic as Samples;

    fn stage(crr: f64, ms: f64, rss: f64) -> Stage {
        Stage {
            traffic: Samples::fake(crr, 3),
            latency_ms: around(ms, 10),
            program_secs: 1.0,
            rss_mib: rss,
            cpu_bulk_secs: 0.5,
            cpu_per_change_ms: 3.0,
            agent_rss_mib: 30.0,
        }
    }

    #[test]
    fn report_renders_and_judges_targets() {
        let r = Report {
            reps: 3,
            secs: 2,
            changes: 10,
            quick: false,
            results: Results {
                stages: vec![
                    (
                        10,
                        [
                            stage(1.0, 5.0, 40.0),
                            stage(1.0, 20.0, 50.0),
                            stage(1.0, 10.0, 45.0),
                        ],
                    ),
                    (
                        10_000,
                        [
                            stage(1.0, 6.0, 60.0),
                            stage(0.5, 900.0, 80.0),
                            stage(0.95, 30.0, 70.0),
                        ],
                    ),
                ],
                churn: Some(super::super::churn::Churn {
                    idle_ms: around(100.0, 10),
                    churn_ms: around(150.0, 10),
                    per_minute: 2990.0,
                }),
            },
            bench: Bench::fake(),
        };
        let md = r.markdown();
        assert!(md.contains("## 10,000 Services"), "{md}");
        assert!(md.contains("calix / kube-proxy iptables"), "{md}");
        assert!(md.contains("## Pod ADDs while Services churn"), "{md}");
        let t = r.targets();
        assert_eq!(t.len(), 6);
        assert_eq!(t[5].1, Some(false), "1.5× quiet: {}", t[5].0);
        assert_eq!(t[0].1, Some(true), "{}", t[0].0);
        assert_eq!(t[1].1, Some(false), "{}", t[1].0);
        assert_eq!(t[2].1, Some(true), "{}", t[2].0);
        assert_eq!(t[4].1, Some(true), "{}", t[4].0);
        let svg = render("services", &md, |p| r.chart(p));
        assert!(svg.contains("kube-proxy nftables"));
        assert_eq!(
            (thousands(1000), thousands(10)),
            ("1,000".into(), "10".into())
        );
    }
}
