//! The BGP bench's report: the markdown and the chart.
use std::path::Path;

use anyhow::Result;

use super::idle::{Results as Idle, Usage, LEARNED, PEERS};
use super::prefixes::{Results as Prefixes, Samples, Sender, HOLD, POLL, PREFIXES, SENDERS};
use super::reach::{Samples as Reach, PROBE_INTERVAL, PROBE_LIMIT};
use super::{Args, PREFIXES_RATIO, REACH_P99_MS};
use crate::bench::chart::{self, Layout, Panel, Series};
use crate::bench::harness::{Bench, Compared};
use crate::bench::report::{
    fmt_0, fmt_1, fmt_ms, fmt_spread, fmt_spread_with, heading, load_note, loads, median,
    percentile, ratio, targets, thousands,
};

pub struct Report {
    pub args: Args,
    pub bird_version: String,
    pub prefixes: Prefixes,
    pub idle: Idle,
    pub reach: Reach,
    pub bench: Bench,
}

/// Three decimals; "–" for NaN.
fn fmt_3(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.3}")
    }
}

/// Per repetition: from the first UPDATE read until the receiver held them all (ms).
fn after_first(x: &Samples) -> Vec<f64> {
    x.all.iter().zip(&x.first_in).map(|(a, f)| a - f).collect()
}

/// `p50 / p99 / max` of the finite values of `v`, and how many were not seen.
fn quantiles(v: &[f64]) -> [String; 3] {
    let seen: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    let missing = v.len() - seen.len();
    let mut max = fmt_ms(percentile(&seen, 100.0));
    if missing > 0 {
        max.push_str(&format!(" ({missing} not seen)"));
    }
    [
        fmt_ms(percentile(&seen, 50.0)),
        fmt_ms(percentile(&seen, 99.0)),
        max,
    ]
}

impl Report {
    fn sender(&self, s: Sender) -> &Samples {
        &self.prefixes.by[s as usize]
    }

    /// calix's median over BIRD's, of `f`'s samples.
    fn ratio_of(&self, f: fn(&Samples) -> &Vec<f64>) -> f64 {
        median(f(self.sender(Sender::Calix))) / median(f(self.sender(Sender::Bird)))
    }

    /// calix's median time from the first UPDATE read until all are held, over BIRD's.
    fn wire_ratio(&self) -> String {
        ratio(
            median(&after_first(self.sender(Sender::Calix))),
            median(&after_first(self.sender(Sender::Bird))),
        )
    }

    fn reach_p99(&self) -> f64 {
        percentile(&self.reach.reply, 99.0)
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let n = thousands(PREFIXES as usize);
        let (all, gone) = (self.ratio_of(|s| &s.all), self.ratio_of(|s| &s.gone));
        let p99 = self.reach_p99();
        vec![
            (
                format!(
                    "{n} prefixes held by the receiver ≤ {PREFIXES_RATIO:.1}× BIRD's time: \
                     {all:.2}×"
                ),
                Some(all <= PREFIXES_RATIO),
            ),
            (
                format!("their withdrawal seen ≤ {PREFIXES_RATIO:.1}× BIRD's time: {gone:.2}×"),
                Some(gone <= PREFIXES_RATIO),
            ),
            (
                format!(
                    "a new block reachable from outside p99 ≤ {REACH_P99_MS:.0} ms after its \
                     ADD started: {} ms",
                    fmt_ms(p99)
                ),
                Some(p99 <= REACH_P99_MS),
            ),
        ]
    }

    pub fn markdown(&self) -> String {
        let a = &self.args;
        let mut s = heading("BGP: calix's speaker against BIRD 2", a.quick);
        s.push_str(&format!(
            "{}: release build, the agent's BGP speaker (calix-bgp's session and UPDATE builder, \
             the agent's peer task); {} (Debian's bird2) as the router and as the other \
             sender.\n",
            self.bench.measured(&format!(
                "bgp --prefix-reps {} --idle-reps {} --idle-secs {} --pods {}",
                a.prefix_reps, a.idle_reps, a.idle_secs, a.pods
            )),
            self.bird_version,
        ));
        s.push_str(&self.prefixes_section());
        s.push_str(&self.idle_section());
        s.push_str(&self.reach_section());
        let all_loads: Vec<f64> = SENDERS
            .iter()
            .flat_map(|&v| self.sender(v).load.iter().copied())
            .chain(self.idle.load.iter().copied())
            .chain(self.reach.load.iter().copied())
            .collect();
        if let Some(note) = load_note(&all_loads) {
            s.push_str(&note);
        }
        s.push_str(&targets("Targets (issue 23):", &self.targets(), ""));
        s.push_str("\n![BGP chart](bgp.svg)\n");
        s
    }

    fn prefixes_section(&self) -> String {
        let (p, n) = (&self.prefixes, thousands(PREFIXES as usize));
        let mut s = format!(
            "\n## {n} prefixes to a BIRD router\n\n\
             Two namespaces joined by a veth: the receiver (BIRD, one passive eBGP session per \
             sender, importing everything, exporting nothing) and the senders — calix \
             (`calix-bgpsend`: the agent's own peer task, `calix_agent::bgp::peer_task::run`, \
             with a `wanted` watch of {n} /26 prefixes and no IPAM) and BIRD (a static \
             protocol holding the same {n} routes, disabled). Both sessions are up \
             before anything is timed and stay up. Per repetition, each sender in turn (the \
             order rotating): the clock starts when the sender is told to announce — calix: \
             the whole set put in the peer task's `wanted` watch (a line on its stdin); BIRD: \
             `enable` of its static protocol (on its control socket) — and stops when the \
             receiver's protocol holds all {n} (`show protocols all`, asked every {} ms \
             on BIRD's control socket). **first / last UPDATE read**: the times BIRD stamps on \
             the routes (when its loop read the UPDATE that brought them; µs, its wall clock, \
             after the clock started). Then the withdrawal (calix: the empty set; BIRD: \
             `disable`), until the receiver holds none. Median [min–max] over {} repetitions; \
             the ratio row is calix's median over BIRD's.\n\n\
             | sender | cue answered | first UPDATE read | last UPDATE read | receiver holds \
             all {n} | of which after the first UPDATE | withdrawal seen (none held) | TCP \
             segments sent | load before |\n\
             |---|---|---|---|---|---|---|---|---|\n",
            POLL.as_millis(),
            self.args.prefix_reps,
        );
        for v in SENDERS {
            let x = self.sender(v);
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                v.label(),
                fmt_spread(&x.cue),
                fmt_spread(&x.first_in),
                fmt_spread(&x.last_in),
                fmt_spread(&x.all),
                fmt_spread(&after_first(x)),
                fmt_spread(&x.gone),
                fmt_spread_with(&x.segments, "", fmt_0),
                loads(&x.load),
            ));
        }
        let r = |f: fn(&Samples) -> &Vec<f64>| format!("{:.2}×", self.ratio_of(f));
        s.push_str(&format!(
            "| **calix / BIRD** | {} | {} | {} | **{}** | {} | **{}** | {} | |\n",
            r(|x| &x.cue),
            r(|x| &x.first_in),
            r(|x| &x.last_in),
            r(|x| &x.all),
            self.wire_ratio(),
            r(|x| &x.gone),
            r(|x| &x.segments),
        ));
        let e = &p.encode;
        let (c, b) = (self.sender(Sender::Calix), self.sender(Sender::Bird));
        let m = |v: &[f64]| fmt_ms(median(v));
        s.push_str(&format!(
            "\nThe polling floor: the receiver is asked every {} ms and one question takes {} ms \
             (median of 200; p99 {} ms), so a polled time is late by up to ~{} ms; nothing is \
             subtracted. The first and last UPDATE read are BIRD's own stamps, not polled.\n\n\
             Where the time goes (medians, ms after the cue). **calix**: building the UPDATEs \
             (`Advertised::update_to`, timed in `calix-bgpsend` before the session) takes {} ms \
             for the {n} routes ({} messages, {} bytes: ~{} prefixes a message, grouped by \
             next hop and packed to 4,096 bytes) and {} ms for their withdrawal. The peer task \
             builds every message before it writes the first, so the first UPDATE leaves only \
             after the whole set is built; it writes one message per `write` with TCP_NODELAY \
             set, which on the wire is {} \
             TCP segments (the messages are larger than a segment: one write per message makes \
             no small segments here). The cue is answered at {}; BIRD read the first UPDATE at \
             {} and the last at {}, and held all {n} at {}. **BIRD as the sender**: its \
             `enable` is answered only once the static protocol has put the {n} routes in \
             BIRD's own table ({}), and the first UPDATE is read right after ({}): {} \
             BIRD's time is that table load, which calix's `wanted` watch (a map handed over \
             whole) does not have. From the first UPDATE read until all are held — the wire \
             and the receiver's import alone — calix takes {} and BIRD {} ({}{}).\n",
            POLL.as_millis(),
            fmt_ms(median(&p.poll_ms)),
            fmt_ms(percentile(&p.poll_ms, 99.0)),
            fmt_ms(POLL.as_secs_f64() * 1e3 + median(&p.poll_ms)),
            fmt_ms(e.announce_ms),
            e.messages,
            e.bytes,
            (PREFIXES as usize).div_ceil(e.messages.max(1)),
            fmt_ms(e.withdraw_ms),
            fmt_0(median(&c.segments)),
            m(&c.cue),
            m(&c.first_in),
            m(&c.last_in),
            m(&c.all),
            m(&b.cue),
            m(&b.first_in),
            if median(&b.cue) > median(&b.all) / 2.0 {
                "most of"
            } else {
                "part of"
            },
            m(&after_first(c)),
            m(&after_first(b)),
            self.wire_ratio(),
            if (median(&after_first(c)) - median(&after_first(b))).abs() < POLL.as_secs_f64() * 1e3
            {
                ": the same within the poll's resolution"
            } else {
                ""
            },
        ));
        s.push_str(&format!(
            "\nSettings, the same for both senders: eBGP (AS 65002 and 65003 to the receiver's \
             65001), IPv4 unicast only, the routes' next hop the sender's own address, hold \
             time {HOLD} s proposed, no TCP MD5, no route filters but the receiver's \
             `import all`. Neither side delays UPDATEs (BIRD has no MRAI timer; calix's peer \
             task writes a change as soon as the watch holds it). The receiver's sessions are \
             passive; BIRD's sender connects after 1 s (`connect delay time 1`, `connect retry \
             time 1`) and calix's at once — which only decides how soon the sessions are up, \
             before any clock. calix's sender offers no graceful restart (BIRD's default: \
             offered; no End-of-RIB is waited for). Nothing is pinned to a CPU.\n",
        ));
        s
    }

    fn idle_section(&self) -> String {
        let (x, a) = (&self.idle, &self.args);
        let mut s = format!(
            "\n## The agent's CPU and memory with {PEERS} BGP peers\n\n\
             Per repetition a fresh two-node cluster (etcd, release agents, eBPF dataplane, a \
             pod on each node): one agent with `[bgp]` and {PEERS} peers — {PEERS} sessions with \
             BIRD in the underlay (a BGP protocol each, on a port of its own: BIRD takes one per \
             neighbor address and port; hold time 90 s, graceful restart \
             on: the agent's defaults), announcing {LEARNED} blocks of \
             other racks (each session the same ones), so the agent learns {} paths and \
             installs {LEARNED} routes — and the \
             same agent with BGP off, on the other node (which node speaks BGP alternates). \
             Once every session is up and has the node's block at the router, and the node's \
             kernel the {LEARNED} routes, and 3 s more, both agents idle for {} s side by \
             side. **CPU, idle**: the run time of all their threads over that window (ns, \
             /proc/<pid>/task/*/schedstat: an idle agent uses less than a clock tick in \
             seconds); **CPU to converge**: utime + stime from the agent's start until the \
             BGP node had converged (the other agent over the same time); RSS: `VmRSS` at the \
             window's end (with `RssAnon`). Median [min–max] over {} repetitions.\n\n\
             | agent | CPU, idle | CPU to converge | RSS | of which anonymous |\n\
             |---|---|---|---|---|\n",
            PEERS * LEARNED,
            a.idle_secs,
            a.idle_reps,
        );
        let row = |label: &str, u: &Usage| {
            format!(
                "| {label} | {} | {} | {} | {} |\n",
                fmt_spread_with(&u.cpu_ms_per_s, " ms/s", fmt_3),
                fmt_spread_with(&u.start_cpu_ms, " ms", fmt_0),
                fmt_spread_with(&u.rss_mib, " MiB", fmt_1),
                fmt_spread_with(&u.anon_mib, " MiB", fmt_1),
            )
        };
        s.push_str(&row(&format!("with BGP ({PEERS} peers)"), &x.bgp));
        s.push_str(&row("without BGP", &x.off));
        let diff = |f: fn(&Usage) -> &Vec<f64>| {
            let (a, b) = (median(f(&x.bgp)), median(f(&x.off)));
            format!("{} ({:+.1} MiB)", ratio(a, b), a - b)
        };
        let r = |f: fn(&Usage) -> &Vec<f64>| ratio(median(f(&x.bgp)), median(f(&x.off)));
        s.push_str(&format!(
            "| **with / without** | **{}** | {} | **{}** | {} |\n",
            r(|u| &u.cpu_ms_per_s),
            r(|u| &u.start_cpu_ms),
            diff(|u| &u.rss_mib),
            diff(|u| &u.anon_mib),
        ));
        s.push_str(&format!(
            "\nThe BGP node converged (its block at the router on every session, the {LEARNED} routes in its \
             kernel) {} after its agent started; the load average before the windows was \
             {}.\n",
            fmt_spread_with(&x.converge_s, " s", fmt_1),
            loads(&x.load),
        ));
        s
    }

    fn reach_section(&self) -> String {
        let (r, a) = (&self.reach, &self.args);
        let mut s = format!(
            "\n## A new block, reachable from outside\n\n\
             One node (release agent, eBPF dataplane, etcd) whose pool hands out blocks of one \
             address (`blockSize = 32`), so every ADD claims a block, which the agent's \
             speaker advertises to the router: BIRD in the underlay, installing what it \
             learns in the underlay's kernel (`protocol kernel`, no delay) and routing to an \
             \"outside\" namespace behind it. For each of {} pods: the real `calix` plugin's \
             ADD, exec'd as a runtime does, timed fork-to-exit; from the moment it returns, \
             the outside pings the new address every {} ms (a raw ICMP socket) until the first \
             reply, at most {} ms. Where the time went, in ms after the ADD started: when BIRD \
             read the UPDATE (its timestamp of the route), when the route reached the \
             router's kernel (a netlink listener in the underlay), the first reply. The \
             **floor**: in the same round, a pod long reachable, pinged from outside the same \
             way. Percentiles over every pod (nearest rank).\n\n\
             | step | p50 | p99 | max |\n|---|---|---|---|\n",
            a.pods,
            PROBE_INTERVAL.as_millis(),
            PROBE_LIMIT.as_millis(),
        );
        let rows: [(&str, &Vec<f64>); 6] = [
            ("the ADD returned (fork-to-exit)", &r.add),
            ("BIRD read the route's UPDATE", &r.at_bird),
            ("the route in the router's kernel", &r.in_kernel),
            ("**first reply from outside**", &r.reply),
            ("first reply, after the ADD returned", &r.reply_after_add),
            (
                "floor: a pod long reachable, after the ADD returned",
                &r.floor,
            ),
        ];
        for (label, v) in rows {
            let [p50, p99, max] = quantiles(v);
            s.push_str(&format!("| {label} | {p50} | {p99} | {max} |\n"));
        }
        let m = |v: &[f64]| {
            median(
                &v.iter()
                    .copied()
                    .filter(|x| x.is_finite())
                    .collect::<Vec<_>>(),
            )
        };
        let (add, bird, kernel) = (m(&r.add), m(&r.at_bird), m(&r.in_kernel));
        s.push_str(&format!(
            "\nWhere the time goes (medians, ms after the ADD started): the ADD returned at {}; \
             BIRD read the block's UPDATE at {} ({}), its kernel had the route {} later; the \
             first reply came {} after the ADD returned (the floor, a pod long reachable: {}; \
             the probe pings every {} ms).\n",
            fmt_ms(add),
            fmt_ms(bird),
            if bird < add {
                "the block is claimed early in the ADD and advertised as soon as the \
                 datastore's watch shows it, while the plugin is still wiring the pod"
            } else {
                "after the ADD returned"
            },
            fmt_ms(kernel - bird),
            fmt_ms(m(&r.reply_after_add)),
            fmt_ms(m(&r.floor)),
            PROBE_INTERVAL.as_millis(),
        ));
        s
    }

    pub fn chart(&self, path: &Path) -> Result<()> {
        let n = thousands(PREFIXES as usize);
        let finite = |v: f64| v.is_finite().then_some(v);
        let prefixes: Vec<Series> = SENDERS
            .iter()
            .map(|&v| {
                let x = self.sender(v);
                (
                    v.label(),
                    v.color(),
                    vec![
                        finite(median(&x.all)),
                        finite(median(&after_first(x))),
                        finite(median(&x.gone)),
                    ],
                )
            })
            .collect();
        let usage = |f: fn(&Usage) -> Vec<f64>| -> Vec<Series> {
            vec![
                ("with BGP (4 peers)", chart::BLUE, f(&self.idle.bgp)),
                ("without BGP", chart::GREY, f(&self.idle.off)),
            ]
            .into_iter()
            .map(|(l, c, v)| (l, c, v.into_iter().map(finite).collect()))
            .collect()
        };
        let r = &self.reach;
        let q = |v: &[f64]| {
            let seen: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
            vec![
                finite(percentile(&seen, 50.0)),
                finite(percentile(&seen, 99.0)),
            ]
        };
        let reach: Vec<Series> = vec![
            ("ADD returned", chart::LIGHT_BLUE, q(&r.add)),
            ("BIRD has the route", chart::ORANGE, q(&r.at_bird)),
            ("router's kernel", chart::GREEN, q(&r.in_kernel)),
            ("first reply from outside", chart::BLUE, q(&r.reply)),
        ];
        let panels = [
            Panel::new(
                format!("{n} prefixes to BIRD (ms), median"),
                "ms",
                &[
                    "all held",
                    "of which after the 1st UPDATE",
                    "withdrawal seen",
                ],
                prefixes,
                |_, _, v| fmt_ms(v),
            ),
            Panel::new(
                "agent CPU idle (µs per s), median",
                "µs/s",
                &["CPU"],
                usage(|u| vec![median(&u.cpu_ms_per_s) * 1e3]),
                |_, _, v| fmt_0(v),
            ),
            Panel::new(
                "agent memory (MiB), median",
                "MiB",
                &["RSS", "anonymous"],
                usage(|u| vec![median(&u.rss_mib), median(&u.anon_mib)]),
                |_, _, v| fmt_1(v),
            ),
            Panel::new(
                "new block: ms after the ADD started",
                "ms",
                &["p50", "p99"],
                reach,
                |_, _, v| fmt_ms(v),
            )
            .reference("target p99", REACH_P99_MS),
        ];
        chart::chart(
            path,
            (1600, 460),
            &format!(
                "BGP: {n} prefixes × {} reps, {PEERS} peers idle × {}, {} new blocks ({})",
                self.args.prefix_reps, self.args.idle_reps, self.args.pods, self.bench.machine.date
            ),
            Layout::Columns(&[460, 300, 360]),
            &panels,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::bgp::idle::Usage;
    use crate::bench::bgp::prefixes::Encode;
    use crate::bench::harness::{around, render};

    #[test]
    fn the_report_renders() {
        let reps = 3;
        let sender = |k: f64| Samples {
            cue: around(0.1 * k, reps),
            all: around(6.0 * k, reps),
            first_in: around(1.0 * k, reps),
            last_in: around(5.0 * k, reps),
            gone: around(4.0 * k, reps),
            segments: around(30.0 * k, reps),
            load: around(0.5, reps),
        };
        let usage = |k: f64| Usage {
            cpu_ms_per_s: around(0.3 * k, reps),
            start_cpu_ms: around(150.0 * k, reps),
            rss_mib: around(30.0 * k, reps),
            anon_mib: around(12.0 * k, reps),
        };
        let pods = 30;
        let mut reply = around(12.0, pods);
        reply[3] = f64::INFINITY;
        let r = Report {
            args: Args {
                prefix_reps: reps,
                idle_reps: reps,
                idle_secs: 30,
                pods,
                quick: true,
            },
            bird_version: "BIRD version 2.0.12".into(),
            prefixes: Prefixes {
                by: [sender(0.5), sender(1.0)],
                poll_ms: around(0.05, 200),
                encode: Encode {
                    announce_ms: 0.4,
                    withdraw_ms: 0.1,
                    messages: 13,
                    bytes: 50_559,
                },
            },
            idle: Idle {
                bgp: usage(1.2),
                off: usage(1.0),
                converge_s: around(4.0, reps),
                load: around(0.7, reps),
            },
            reach: Reach {
                add: around(20.0, pods),
                at_bird: around(8.0, pods),
                in_kernel: around(8.2, pods),
                reply,
                reply_after_add: around(0.4, pods),
                floor: around(0.2, pods),
                load: around(0.6, pods),
            },
            bench: Bench::fake(),
        };
        let md = r.markdown();
        let svg = render("bgp", &md, |p| r.chart(p));
        assert!(md.starts_with("# BGP"));
        assert!(
            md.contains(
                "| **calix / BIRD** | 0.50× | 0.50× | 0.50× | **0.50×** | 0.50× | **0.50×** |"
            ),
            "{md}"
        );
        assert!(md.contains("met: 10,000 prefixes held"), "{md}");
        assert!(md.contains("(1 not seen)"), "{md}");
        assert!(svg.contains("agent memory"));
    }
}
