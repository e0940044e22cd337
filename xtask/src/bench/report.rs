//! What the benches' reports share: number formats, medians with their range, ratios, load
//! notes, target lists, the traffic benches' samples and rows (their charts: `chart`).
use calix_testbed::traffic::Measured;

pub use calix_testbed::stats::{median, percentile, spread};

/// `12.3 ms [11.9–13.0]`: a median with the range over repetitions.
pub fn fmt_spread(v: &[f64]) -> String {
    fmt_spread_with(v, " ms", fmt_ms)
}

/// A median with the range over repetitions, each value formatted by `f`, the median followed
/// by `unit` (with its leading space, if any).
pub fn fmt_spread_with(v: &[f64], unit: &str, f: fn(f64) -> String) -> String {
    let (m, lo, hi) = spread(v);
    if v.len() < 2 {
        return format!("{}{unit}", f(m));
    }
    format!("{}{unit} [{}–{}]", f(m), f(lo), f(hi))
}

/// A pooled p50 with the [min–max] of the per-repetition p50s.
pub fn p50_with_reps(pooled: f64, reps: &[f64]) -> String {
    let (_, lo, hi) = spread(reps);
    if reps.len() < 2 {
        format!("{} ms", fmt_ms(pooled))
    } else {
        format!("{} ms [{}–{}]", fmt_ms(pooled), fmt_ms(lo), fmt_ms(hi))
    }
}

/// Per-call latencies (ms) pooled over every repetition, and each repetition's p50.
#[derive(Default)]
pub struct Calls {
    pub all: Vec<f64>,
    pub p50s: Vec<f64>,
}

impl Calls {
    /// Adds a repetition's calls (none: nothing); returns their p50.
    pub fn push(&mut self, rep: Vec<f64>) -> f64 {
        let p50 = percentile(&rep, 50.0);
        if !rep.is_empty() {
            self.p50s.push(p50);
            self.all.extend(rep);
        }
        p50
    }

    /// The `q`th percentile of every call.
    pub fn p(&self, q: f64) -> f64 {
        percentile(&self.all, q)
    }

    /// The pooled p50 with the [min–max] of the repetitions' p50s.
    pub fn p50(&self) -> String {
        p50_with_reps(self.p(50.0), &self.p50s)
    }

    /// `| label | p50 [min–max] | p99 ms |`: a floor's row.
    pub fn row(&self, label: &str) -> String {
        format!(
            "| {label} | {} | {} ms |\n",
            self.p50(),
            fmt_ms(self.p(99.0))
        )
    }
}

/// `a / b` as `1.23×`; `–` when undefined.
pub fn ratio(a: f64, b: f64) -> String {
    if a.is_nan() || b.is_nan() || b == 0.0 {
        "–".into()
    } else {
        format!("{:.2}×", a / b)
    }
}

/// Load averages as median [min–max].
pub fn loads(v: &[f64]) -> String {
    let (m, lo, hi) = spread(v);
    format!("{m:.2} [{lo:.2}–{hi:.2}]")
}

/// The markdown note when a load average before a variant was above ~1.2 (DESIGN.md §10).
pub fn load_note(all: &[f64]) -> Option<String> {
    let max_load = all.iter().copied().fold(f64::NAN, f64::max);
    (max_load > 1.2).then(|| {
        format!(
            "\nThe load average reached {max_load:.2} before a variant (above ~1.2: the \
             machine was shared; DESIGN.md §10 says to rerun).\n"
        )
    })
}

/// Milliseconds with 2 significant decimals below 10, one below 100, none above.
pub fn fmt_ms(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// `10,000`: a count with thousands separated.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// No decimals; "–" for NaN (no measurement).
pub fn fmt_0(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.0}")
    }
}

/// One decimal; "–" for NaN.
pub fn fmt_1(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.1}")
    }
}

/// Two decimals; "–" for NaN.
pub fn fmt_2(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.2}")
    }
}

/// A report's first lines: its title, and whether it is a development run.
pub fn heading(title: &str, quick: bool) -> String {
    let mut s = format!("# {title}\n\n");
    if quick {
        s.push_str("**Development run (`--quick`): too short to publish.**\n\n");
    }
    s
}

/// `title` and its targets as a markdown list: met, **not met**, or pending (`None`, with why).
pub fn targets(title: &str, list: &[(String, Option<bool>)], pending: &str) -> String {
    let mut s = format!("\n{title}\n\n");
    for (text, met) in list {
        let mark = match met {
            Some(true) => "met:".to_string(),
            Some(false) => "**not met**:".to_string(),
            None => format!("pending ({pending}):"),
        };
        s.push_str(&format!("- {mark} {text}\n"));
    }
    s
}

// --- the traffic benches (dataplane, crossnode, snat) ---------------------------------------

/// Busy share (%) of the CPUs the bench does not use above which a run counts as shared.
const OTHERS_BUSY_LIMIT: f64 = 25.0;

/// One traffic variant over every repetition.
#[derive(Default)]
pub struct Traffic {
    /// Per repetition.
    pub crr: Vec<f64>,
    pub rr_p50: Vec<f64>,
    pub rr_p99: Vec<f64>,
    pub rr_rate: Vec<f64>,
    pub gbps: Vec<f64>,
    /// Zero-window advertisements of the iperf3 receiver.
    pub zero_windows: Vec<f64>,
    /// IpForwDatagrams in the node namespace: per connection (TCP_CRR), per round trip
    /// (TCP_RR), and over the iperf3 run.
    pub fwd_per_conn: Vec<f64>,
    pub fwd_per_rt: Vec<f64>,
    pub fwd_iperf: Vec<f64>,
    pub load: Vec<f64>,
    /// Over the measurements: how busy the CPUs the bench does not use were (%), and the bench
    /// CPU's steal time (%).
    pub others_busy: Vec<f64>,
    pub steal: Vec<f64>,
}

impl Traffic {
    /// Records a repetition; returns its progress line.
    pub fn push(&mut self, m: &Measured) -> String {
        let (rate, p50, p99, gbps) = (m.crr.rate, m.rr.p50_us, m.rr.p99_us, m.gbps);
        self.load.push(m.load);
        self.others_busy.push(m.others_busy);
        self.steal.push(m.steal);
        self.crr.push(rate);
        self.rr_p50.push(p50);
        self.rr_p99.push(p99);
        self.rr_rate.push(m.rr.rate);
        self.gbps.push(gbps);
        let mut line = format!(
            "(load {:.2}, other CPUs {:.0}% busy, steal {:.0}%): {rate:.0} conn/s, RR p50 \
             {p50:.1} µs p99 {p99:.1} µs, {gbps:.1} Gbit/s",
            m.load, m.others_busy, m.steal
        );
        if !m.zero_windows.is_nan() {
            self.zero_windows.push(m.zero_windows);
            line.push_str(&format!(" ({:.0} zero windows)", m.zero_windows));
        }
        if let Some([crr, rr, iperf]) = m.forwarded {
            self.fwd_per_conn.push(crr / m.crr.count.max(1.0));
            self.fwd_per_rt.push(rr / m.rr.count.max(1.0));
            self.fwd_iperf.push(iperf);
            line.push_str(&format!(
                ", IpForwDatagrams +{crr:.0} (CRR) +{rr:.0} (RR) +{iperf:.0} (iperf3)"
            ));
        }
        line
    }

    /// `| label | conn/s | p50 | p99 | [round trips/s |] throughput | load | busy |`.
    pub fn row(&self, label: &str, rr_rate: bool) -> String {
        let mut cells = vec![
            label.to_string(),
            fmt_spread_with(&self.crr, "", fmt_0),
            fmt_spread_with(&self.rr_p50, " µs", fmt_1),
            fmt_spread_with(&self.rr_p99, " µs", fmt_1),
        ];
        if rr_rate {
            cells.push(fmt_spread_with(&self.rr_rate, "", fmt_0));
        }
        cells.extend([
            fmt_spread_with(&self.gbps, " Gbit/s", fmt_1),
            loads(&self.load),
            fmt_spread_with(&self.others_busy, " %", fmt_0),
        ]);
        format!("| {} |\n", cells.join(" | "))
    }

    /// The ratios of the medians of `a` and `b` in [`Traffic::row`]'s columns (`–` without
    /// `b`).
    pub fn ratio_row(label: &str, a: &Self, b: Option<&Self>, rr_rate: bool) -> String {
        let r = |f: fn(&Self) -> &Vec<f64>| {
            b.map_or("–".into(), |b| ratio(median(f(a)), median(f(b))))
        };
        let mut cells = vec![
            label.to_string(),
            r(|s| &s.crr),
            r(|s| &s.rr_p50),
            r(|s| &s.rr_p99),
        ];
        if rr_rate {
            cells.push(r(|s| &s.rr_rate));
        }
        cells.push(r(|s| &s.gbps));
        format!("| {} | | |\n", cells.join(" | "))
    }
}

/// The traffic benches' table with round trips/s: a row per variant (label, samples), then a
/// ratio row per pair (`a / b`).
pub fn traffic_table<'a>(
    rows: impl IntoIterator<Item = (&'a str, &'a Traffic)>,
    ratios: impl IntoIterator<Item = ((&'a str, &'a Traffic), (&'a str, &'a Traffic))>,
) -> String {
    let mut s = String::from(
        "| variant | conn/s (TCP_CRR) | TCP_RR p50 | TCP_RR p99 | TCP_RR round trips/s | \
         throughput | load before | other CPU busy |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (label, t) in rows {
        s.push_str(&t.row(label, true));
    }
    for ((a, at), (b, bt)) in ratios {
        s.push_str(&Traffic::ratio_row(
            &format!("{a} / {b}"),
            at,
            Some(bt),
            true,
        ));
    }
    s
}

/// What [`traffic_table`]'s ratios mean.
pub const RATIOS_NOTE: &str = "\nRatios of medians: above 1× is better for conn/s, round trips/s \
                               and throughput, below 1× is better for the round-trip latencies.\n";

/// [`busy_note`] over every measurement of `res`.
pub fn busy_note_of(cpu: usize, cpus: usize, res: &[Traffic]) -> String {
    let all = |f: fn(&Traffic) -> &Vec<f64>| -> Vec<f64> {
        res.iter().flat_map(|r| f(r).iter().copied()).collect()
    };
    busy_note(
        cpu,
        cpus,
        &all(|r| &r.others_busy),
        &all(|r| &r.steal),
        &all(|r| &r.load),
    )
}

/// The load note of a traffic bench. The load average before a variant includes the bench
/// itself (the pinned client and server keep one CPU busy, so it sits near 1–2 and cannot fall
/// below ~1.2 between variants); the other CPUs' busy share over each measurement shows what
/// else ran.
pub fn busy_note(cpu: usize, cpus: usize, others: &[f64], steal: &[f64], load: &[f64]) -> String {
    let max_others = others.iter().copied().fold(f64::NAN, f64::max);
    let plural = if cpus > 2 { "s" } else { "" };
    let mut s = format!(
        "\nLoad: the 1-minute load average before each variant includes the bench itself (the \
         pinned client and server keep CPU {cpu} busy: it sits between 1 and 2 by itself), so \
         DESIGN.md §10's \"rerun above ~1.2\" is judged on what ran elsewhere: the other \
         CPU{plural} {} {} busy during the measurements (median [min–max] over every \
         measurement; the agents and this bench's own processes included), and the bench CPU's \
         steal time was {} %. Load averages before the variants: {}.\n",
        if plural.is_empty() { "was" } else { "were" },
        fmt_spread_with(others, " %", fmt_0),
        fmt_spread_with(steal, "", fmt_0),
        loads(load),
    );
    if max_others > OTHERS_BUSY_LIMIT {
        s.push_str(&format!(
            "\n**Something else used up to {max_others:.0} % of the other CPU{plural} during a \
             measurement** (above {OTHERS_BUSY_LIMIT:.0} %: the machine was shared; rerun for \
             publishable numbers).\n",
        ));
    }
    s
}

#[cfg(test)]
impl Calls {
    /// Made-up calls around `x` ms over `reps` repetitions (for reports rendered in tests).
    pub fn fake(x: f64, reps: usize) -> Self {
        Self {
            all: super::harness::around(x, 20 * reps),
            p50s: super::harness::around(x * 1.1, reps),
        }
    }
}

#[cfg(test)]
impl Traffic {
    /// Made-up samples of `reps` repetitions, scaled by `k` (for reports rendered in tests).
    pub fn fake(k: f64, reps: usize) -> Self {
        let a = |x: f64| super::harness::around(x, reps);
        Self {
            crr: a(30_000.0 * k),
            rr_p50: a(20.0 / k),
            rr_p99: a(35.0 / k),
            rr_rate: a(45_000.0 * k),
            gbps: a(40.0 * k),
            zero_windows: a(3.0),
            fwd_per_conn: a(5.0 * (k - 1.0).abs()),
            fwd_per_rt: a(2.0 * (k - 1.0).abs()),
            fwd_iperf: a(1e5 * (k - 1.0).abs()),
            load: a(1.1),
            others_busy: a(6.0),
            steal: a(0.5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_show_the_median_and_range() {
        assert_eq!(fmt_spread(&[3.0, 1.0, 2.0]), "2.00 ms [1.00–3.00]");
        assert_eq!(fmt_spread(&[3.0]), "3.00 ms");
        assert_eq!(ratio(1.0, 0.0), "–");
    }
}
