//! `cargo xtask bench routes`: how fast routes follow pods across a cluster, and what one
//! agent pays to take a big cluster's routes (issue 13), in one run:
//! - [`convergence`]: three real nodes, a pod's ADD on A until it answers B and C;
//! - [`scale`]: one real agent and 100 simulated peers × 100 blocks, mesh and reflector.
//!
//! Everything is named `cxb-<pid>-…` and removed on drop, on error and Ctrl-C too. Writes
//! docs/bench/routes.md and .svg (with `--quick`, target/bench/ instead).
mod convergence;
mod scale;

use std::path::Path;

use super::chart::{self, Layout, Panel, Series};
use super::harness::{Bench, Compared, Machine};
use super::report::{
    fmt_0, fmt_1, fmt_2, fmt_ms, fmt_spread_with, heading, load_note, loads, median, percentile,
    targets,
};
use anyhow::Result;
use convergence::{Samples as Conv, PROBE_INTERVAL, PROBE_LIMIT, VARIANTS};
use scale::{Phase, Results as Scale, BLOCKS, PEERS, PHASES, TOPOLOGIES};

/// Issue 13's targets.
const CONVERGENCE_P99_MS: f64 = 100.0;
const SCALE_SECS: f64 = 2.0;
const SCALE_RSS_MIB: f64 = 32.0;

/// Runs the bench; with `baseline` (a revision), the scale part measures that revision's agent
/// too, interleaved with this build's.
pub fn run(pods: usize, reps: usize, quick: bool, baseline: Option<&str>) -> Result<()> {
    anyhow::ensure!(
        (1..=1000).contains(&pods) && reps >= 1,
        "--pods must be 1–1000 and --reps at least 1"
    );
    let b = Bench::setup("the routes benchmark", &["ip", "etcd"], &[])?;
    let mut agents = vec![scale::Agent {
        label: format!("this build ({})", b.rev),
        bins: b.bins.clone(),
    }];
    if let Some(rev) = baseline {
        let base = super::baseline::build(rev, &["calix-agent"], None)?;
        agents.push(scale::Agent {
            label: format!("baseline {}", base.label),
            bins: base.bins,
        });
    }
    let ca = scale::ca()?;
    let conv = convergence::run(&b, &ca, pods)?;
    let scale = scale::run(&b, &ca, reps, &agents)?;
    b.done();
    let report = Report {
        pods,
        reps,
        quick,
        conv,
        scale,
        bench: b,
    };
    Bench::publish("routes", &report.markdown(), quick, |p| chart(p, &report))
}

struct Report {
    pods: usize,
    reps: usize,
    quick: bool,
    conv: [Conv; 2],
    scale: Scale,
    bench: Bench,
}

/// The observers of a new pod: node B on A's subnet, node C across the router.
const OBSERVERS: [&str; 2] = ["B (same subnet: direct route)", "C (other subnet: VXLAN)"];

fn p(v: &[f64], q: f64) -> String {
    let x = percentile(v, q);
    if x.is_infinite() {
        format!("> {} (none)", PROBE_LIMIT.as_millis())
    } else {
        fmt_ms(x)
    }
}

/// Routes seen, as `p50 / p99` of the finite values, and how many were never seen.
fn routes_cell(v: &[f64]) -> String {
    let seen: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    let missing = v.len() - seen.len();
    let mut s = format!(
        "{} / {}",
        fmt_ms(percentile(&seen, 50.0)),
        fmt_ms(percentile(&seen, 99.0))
    );
    if missing > 0 {
        s.push_str(&format!(" ({missing} not seen)"));
    }
    s
}

impl Report {
    fn machine(&self) -> &Machine {
        &self.bench.machine
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let mut t = Vec::new();
        for v in VARIANTS {
            let c = &self.conv[v as usize];
            for (o, who) in ["B", "C"].iter().enumerate() {
                let p99 = percentile(&c.seen[o].reply, 99.0);
                t.push((
                    format!(
                        "{}: reachable from {who} p99 ≤ {CONVERGENCE_P99_MS:.0} ms after the ADD \
                         returned: {} ms",
                        v.label(),
                        p(&c.seen[o].reply, 99.0)
                    ),
                    Some(p99 <= CONVERGENCE_P99_MS),
                ));
            }
        }
        for topo in TOPOLOGIES {
            for ph in PHASES {
                let s = &self.scale.runs[0].res[topo as usize][ph as usize];
                let (secs, peak) = (
                    s.secs.iter().copied().fold(f64::NAN, f64::max),
                    s.peak_mib.iter().copied().fold(f64::NAN, f64::max),
                );
                t.push((
                    format!(
                        "{}, {}: all {} routes in the kernel ≤ {SCALE_SECS:.0} s: {} s at worst",
                        topo.label(),
                        ph.label(),
                        PEERS * BLOCKS,
                        fmt_ms(secs)
                    ),
                    Some(secs <= SCALE_SECS),
                ));
                t.push((
                    format!(
                        "{}, {}: agent RSS ≤ {SCALE_RSS_MIB:.0} MiB at its peak: {} MiB at worst",
                        topo.label(),
                        ph.label(),
                        fmt_1(peak)
                    ),
                    Some(peak <= SCALE_RSS_MIB),
                ));
            }
        }
        t
    }

    fn markdown(&self) -> String {
        let mut s = heading("Routes between nodes: convergence and scale", self.quick);
        s.push_str(&format!(
            "{}: release build, `calix-agent --dataplane ebpf`, etcd \
             datastore, route distribution over mutual TLS (certificates made by the test bed), \
             pods wired by the `calix` CNI plugin.\n\n",
            self.bench
                .measured(&format!("routes --pods {} --reps {}", self.pods, self.reps)),
        ));
        s.push_str("## Convergence: a new pod on node A, reachable from B and C\n\n");
        s.push_str(&format!(
            "Three nodes per variant, both clusters built before anything is timed: A and B \
             on one subnet, C on another (the pools' default `crossSubnet`: C reaches A \
             through VXLAN). **new block**: pools in blocks of one address (`blockSize = 32`), \
             so every ADD claims a block that A advertises and B and C validate against etcd \
             and program. **borrowed**: the pool is one block, claimed by B beforehand; A owns \
             none, so each pod borrows an address of B's block and A advertises a /32. For each \
             of {} pods per variant (variants alternating): the plugin's ADD on A, exec'd as a \
             runtime does and timed fork-to-exit; from the moment it returns, a probe pod on B \
             and one on C ping the new address every {} ms (raw ICMP sockets, one thread) until \
             the first reply, at most {} ms; a netlink listener in B's and C's namespaces \
             stamps when the route to the new address appears in their kernels, in ms after \
             the ADD started and after it returned (negative: before — the address is \
             allocated, and its block claimed and advertised, early in the ADD, while the \
             plugin goes on wiring the pod). \
             The **floor**: in the same round, a pod on A that has long been reachable, \
             probed from C the same way — what probing itself takes. All times in ms after \
             the ADD returned, percentiles over every pod.\n\n",
            self.pods,
            PROBE_INTERVAL.as_millis(),
            PROBE_LIMIT.as_millis(),
        ));
        s.push_str(
            "| variant | seen from | ADD (fork-to-exit) p50 | route in the kernel after the ADD \
             started, p50 / p99 | route after the ADD returned, p50 / p99 | first reply p50 | \
             first reply p99 | first reply max |\n|---|---|---|---|---|---|---|---|\n",
        );
        for v in VARIANTS {
            let c = &self.conv[v as usize];
            for (o, who) in OBSERVERS.iter().enumerate() {
                let seen = &c.seen[o];
                s.push_str(&format!(
                    "| {} | {who} | {} | {} | {} | {} | {} | {} |\n",
                    v.label(),
                    fmt_ms(percentile(&c.add, 50.0)),
                    routes_cell(&seen.route_from_start),
                    routes_cell(&seen.route),
                    p(&seen.reply, 50.0),
                    p(&seen.reply, 99.0),
                    p(&seen.reply, 100.0),
                ));
            }
            s.push_str(&format!(
                "| {} | floor: C → a pod long reachable | | | | {} | {} | {} |\n",
                v.label(),
                p(&c.floor, 50.0),
                p(&c.floor, 99.0),
                p(&c.floor, 100.0),
            ));
        }
        s.push_str(&format!(
            "\n## Scale: one agent, {PEERS} simulated peers × {BLOCKS} blocks\n\n\
             Per repetition and topology a fresh two-node cluster (real etcd): node 0 runs the \
             agent (release build, eBPF dataplane); node 1's namespace runs `calix-routesim` — \
             each simulated peer a `calix.v1.Routes` server of the agent's own code with a \
             certificate of its own (mutual TLS) — which writes the {} blocks to etcd and \
             listens, then, on cue, the peers' node records. **peers join**: the agent has run \
             and read the blocks; the clock starts when the records are cued and stops at the \
             {}th route to a node in node 0's kernel (a netlink listener in its namespace, no \
             polling). **agent restart**: the agent stopped with SIGTERM, its routes flushed \
             by hand, started again on a datastore that has it all; the clock runs from its \
             spawn. Agent CPU: utime + stime of every thread over the clock's run (from its \
             start for a restart). Peak RSS: `VmHWM` of the agent's process, a second after the \
             last route; RSS after: `VmRSS` then, split into anonymous memory (heap, stacks) \
             and file pages (`RssAnon` + `RssFile`: the executable's pages as mapped, shared \
             and reclaimable); RSS before (peers joining): idle a second after the agent's \
             start, then once it had read the blocks. Median [min–max] over {} repetitions \
             (topologies alternating); the kernel routes are `ip route show proto 202` lines \
             at the end.\n\n",
            PEERS * BLOCKS,
            PEERS * BLOCKS,
            self.reps,
        ));
        s.push_str(
            "| topology | phase | all routes in the kernel | agent CPU | RSS before: idle, with \
             the blocks | peak RSS | RSS after | of which anonymous + file | kernel routes \
             |\n|---|---|---|---|---|---|---|---|---|\n",
        );
        for topo in TOPOLOGIES {
            for ph in PHASES {
                let x = &self.scale.runs[0].res[topo as usize][ph as usize];
                let before = if x.idle_mib.is_empty() {
                    "–".to_string()
                } else {
                    format!(
                        "{}, {}",
                        fmt_spread_with(&x.idle_mib, " MiB", fmt_1),
                        fmt_spread_with(&x.blocks_mib, " MiB", fmt_1)
                    )
                };
                let ms: Vec<f64> = x.secs.iter().map(|v| v * 1e3).collect();
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {before} | {} | {} | {} + {} MiB | {} |\n",
                    topo.label(),
                    ph.label(),
                    fmt_spread_with(&ms, " ms", fmt_ms),
                    fmt_spread_with(&x.cpu, " s", fmt_2),
                    fmt_spread_with(&x.peak_mib, " MiB", fmt_1),
                    fmt_spread_with(&x.rss_mib, " MiB", fmt_1),
                    fmt_1(median(&x.anon_mib)),
                    fmt_1(median(&x.file_mib)),
                    fmt_spread_with(&x.kernel_routes, "", fmt_0),
                ));
            }
        }
        s.push_str(&self.memory());
        s.push_str(&self.against_baseline());
        s.push_str(&format!(
            "\nThe simulator wrote the {} blocks to etcd in {} and the {} node records in {} \
             (32 writes in flight; the records' writing is inside the \"peers join\" clock).\n",
            PEERS * BLOCKS,
            fmt_spread_with(&self.scale.blocks_ms, " ms", fmt_ms),
            PEERS,
            fmt_spread_with(&self.scale.records_ms, " ms", fmt_ms),
        ));
        let conv_load: Vec<f64> = self
            .conv
            .iter()
            .flat_map(|c| c.load.iter().copied())
            .collect();
        s.push_str(&format!(
            "\nThe 1-minute load average was {} before the pods of the convergence part and {} \
             before the phases of the scale part (median [min–max]; the bench's own agents \
             included: 6 of them idle during convergence).\n",
            loads(&conv_load),
            loads(&self.scale.load),
        ));
        if let Some(note) = load_note(
            &conv_load
                .iter()
                .chain(&self.scale.load)
                .copied()
                .collect::<Vec<_>>(),
        ) {
            s.push_str(&note);
        }
        s.push_str(&targets("Targets (issue 13):", &self.targets(), ""));
        s.push_str("\n![routes chart](routes.svg)\n");
        s
    }
}

impl Report {
    /// This build's medians against the baseline's, measured in the same run (empty without
    /// a baseline).
    fn against_baseline(&self) -> String {
        let [this, base] = match self.scale.runs.as_slice() {
            [a, b] => [a, b],
            _ => return String::new(),
        };
        let mut s = format!(
            "\n### Against the baseline\n\nThe same phases, in the same run, with the agent of \
             {} (its repetitions interleaved with this build's, on fresh clusters alike). \
             Medians; the ratio is this build's over the baseline's, the difference this \
             build's minus the baseline's.\n\n\
             | topology | phase | all routes in the kernel: this, baseline, ratio | agent CPU: \
             this, baseline, ratio | peak RSS: this, baseline, difference | RSS idle: this, \
             baseline, difference | RSS with the blocks read: this, baseline, difference | \
             anonymous RSS after: this, baseline, difference |\n|---|---|---|---|---|---|---|---|\n",
            base.label
        );
        // Median of this build, of the baseline, and how they compare (`–`: not measured in
        // this phase).
        let cell = |x: &[f64], y: &[f64], fmt: fn(f64) -> String, ratio: bool| {
            if x.is_empty() || y.is_empty() {
                return "–".to_string();
            }
            let (a, b) = (median(x), median(y));
            let compared = if ratio {
                format!("{:.2}×", a / b)
            } else {
                format!("{:+.1} MiB", a - b)
            };
            format!("{}, {}, {compared}", fmt(a), fmt(b))
        };
        let ms = |v: &[f64]| v.iter().map(|s| s * 1e3).collect::<Vec<_>>();
        for topo in TOPOLOGIES {
            for ph in PHASES {
                let (x, y) = (
                    &this.res[topo as usize][ph as usize],
                    &base.res[topo as usize][ph as usize],
                );
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    topo.label(),
                    ph.label(),
                    cell(
                        &ms(&x.secs),
                        &ms(&y.secs),
                        |v| format!("{} ms", fmt_ms(v)),
                        true
                    ),
                    cell(&x.cpu, &y.cpu, |v| format!("{} s", fmt_2(v)), true),
                    cell(&x.peak_mib, &y.peak_mib, fmt_1, false),
                    cell(&x.idle_mib, &y.idle_mib, fmt_1, false),
                    cell(&x.blocks_mib, &y.blocks_mib, fmt_1, false),
                    cell(&x.anon_mib, &y.anon_mib, fmt_1, false),
                ));
            }
        }
        s
    }

    /// Where the agent's resident memory goes as the peers join (medians).
    fn memory(&self) -> String {
        let mut s = String::from(
            "\nWhere the memory goes as the peers join (medians; RSS counts the executable's \
             file pages, the same ~14 MiB from start to end):\n",
        );
        for topo in TOPOLOGIES {
            let x = &self.scale.runs[0].res[topo as usize][Phase::Join as usize];
            let (idle, blocks, peak, file) = (
                median(&x.idle_mib),
                median(&x.blocks_mib),
                median(&x.peak_mib),
                median(&x.file_mib),
            );
            s.push_str(&format!(
                "- {}: idle {} MiB ({} of it anonymous); +{} MiB once the agent has read the \
                 {} blocks (its datastore view); +{} MiB with the {} routes learned, validated \
                 and programmed.\n",
                topo.label(),
                fmt_1(idle),
                fmt_1(idle - file),
                fmt_1(blocks - idle),
                PEERS * BLOCKS,
                fmt_1(peak - blocks),
                PEERS * BLOCKS,
            ));
        }
        s
    }
}

/// The phases' colours.
fn phase_color(ph: Phase) -> plotters::style::RGBColor {
    match ph {
        Phase::Join => chart::BLUE,
        Phase::Restart => chart::ORANGE,
    }
}

fn chart(path: &Path, r: &Report) -> Result<()> {
    let finite = |v: f64| v.is_finite().then_some(v);
    let mut series: Vec<Series> = VARIANTS
        .iter()
        .map(|&v| {
            let c = &r.conv[v as usize];
            let q = |o: usize, q: f64| finite(percentile(&c.seen[o].reply, q));
            (
                v.label(),
                v.color(),
                vec![q(0, 50.0), q(0, 99.0), q(1, 50.0), q(1, 99.0)],
            )
        })
        .collect();
    let floor = &r.conv[0].floor;
    series.push((
        "floor (a reachable pod)",
        chart::GREY,
        vec![
            None,
            None,
            finite(percentile(floor, 50.0)),
            finite(percentile(floor, 99.0)),
        ],
    ));
    let groups: Vec<&str> = TOPOLOGIES
        .iter()
        .map(|t| match t {
            scale::Topology::Mesh => "mesh",
            scale::Topology::Reflector => "reflector",
        })
        .collect();
    let per_phase = |f: &dyn Fn(&scale::Samples) -> f64| -> Vec<Series> {
        PHASES
            .iter()
            .map(|&ph| {
                (
                    ph.label(),
                    phase_color(ph),
                    TOPOLOGIES
                        .iter()
                        .map(|&t| finite(f(&r.scale.runs[0].res[t as usize][ph as usize])))
                        .collect(),
                )
            })
            .collect()
    };
    let panels = [
        Panel::new(
            "new pod on A: first reply, ms after its ADD returned",
            "ms",
            &["from B p50", "from B p99", "from C p50", "from C p99"],
            series,
            |_, _, v| fmt_ms(v),
        )
        .reference("target p99", CONVERGENCE_P99_MS),
        Panel::new(
            format!("{} routes in the kernel (ms), median", PEERS * BLOCKS),
            "ms",
            &groups,
            per_phase(&|s| median(&s.secs) * 1e3),
            |_, _, v| format!("{v:.0}"),
        )
        .reference("target", SCALE_SECS * 1e3),
        Panel::new(
            "agent peak RSS (MiB), median",
            "MiB",
            &groups,
            per_phase(&|s| median(&s.peak_mib)),
            |_, _, v| fmt_1(v),
        )
        .reference("target", SCALE_RSS_MIB),
    ];
    chart::chart(
        path,
        (1300, 460),
        &format!(
            "Routes between nodes: {} pods per variant; {PEERS} peers × {BLOCKS} blocks, {} reps ({})",
            r.pods,
            r.reps,
            r.machine().date
        ),
        Layout::Columns(&[560, 420]),
        &panels,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::{around, render};

    #[test]
    fn the_report_renders() {
        let (pods, reps) = (20, 2);
        let seen = |ms: f64| convergence::Seen {
            route: around(ms / 2.0, pods),
            route_from_start: around(ms, pods),
            reply: around(ms, pods),
        };
        let conv = |ms: f64| Conv {
            add: around(3.0, pods),
            seen: [seen(ms), seen(2.0 * ms)],
            floor: around(0.3, pods),
            load: around(0.5, pods),
        };
        let phase = |s: f64| scale::Samples {
            secs: around(s, reps),
            cpu: around(s / 2.0, reps),
            peak_mib: around(20.0, reps),
            rss_mib: around(18.0, reps),
            anon_mib: around(10.0, reps),
            file_mib: around(8.0, reps),
            idle_mib: around(6.0, reps),
            blocks_mib: around(15.0, reps),
            kernel_routes: around(10_000.0, reps),
        };
        let r = Report {
            pods,
            reps,
            quick: true,
            conv: [conv(40.0), conv(60.0)],
            scale: Scale {
                runs: vec![
                    scale::Runs {
                        label: "this build (abc)".into(),
                        res: [[phase(0.8), phase(1.1)], [phase(0.6), phase(0.9)]],
                    },
                    scale::Runs {
                        label: "baseline main~3 (def)".into(),
                        res: [[phase(0.4), phase(1.0)], [phase(0.3), phase(0.8)]],
                    },
                ],
                blocks_ms: around(900.0, reps),
                records_ms: around(300.0, reps),
                load: around(0.7, reps),
            },
            bench: Bench::fake(),
        };
        let md = r.markdown();
        let svg = render("routes", &md, |p| chart(p, &r));
        assert!(md.starts_with("# Routes between nodes"));
        assert!(svg.contains("agent peak RSS"));
        // This build against the baseline: 0.8 s over 0.4 s is 2.00×.
        assert!(md.contains("### Against the baseline"), "{md}");
        assert!(md.contains("baseline main~3 (def)"));
        assert!(
            md.contains("| full mesh (100 streams) | peers join | 800 ms, 400 ms, 2.00× |"),
            "{md}"
        );
    }
}
