//! `cargo xtask bench <scenario>`: benchmarks on this machine, the way DESIGN.md §10 says gives
//! stable numbers: release binaries, every variant built side by side and interleaved
//! (repetitions outer, variants inner), medians with [min–max] over repetitions, the load
//! average recorded before each variant. Results go to stdout and to docs/bench/<scenario>.md.
mod cni;

use std::time::Duration;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Scenario {
    /// CNI ADD/DEL latency (p50, p99) and 20/50 concurrent ADDs: calix (release, eBPF agent)
    /// against Debian's ptp + host-local, next to the floors (`/bin/true`, `ip link del`).
    Cni {
        /// Pods per variant and repetition (sequential ADDs, then sequential DELs).
        #[arg(long, default_value_t = 200)]
        pods: usize,
        /// Repetitions (each runs every variant once, in alternating order).
        #[arg(long, default_value_t = 4)]
        reps: usize,
    },
}

pub fn run(scenario: Scenario) -> Result<()> {
    match scenario {
        Scenario::Cni { pods, reps } => cni::run(pods, reps),
    }
}

/// Milliseconds of a duration.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `p`th percentile (nearest rank) of `v`; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// Median, minimum and maximum of `v` (NaN when empty).
pub fn spread(v: &[f64]) -> (f64, f64, f64) {
    let min = v.iter().copied().fold(f64::NAN, f64::min);
    let max = v.iter().copied().fold(f64::NAN, f64::max);
    (percentile(v, 50.0), min, max)
}

/// `12.3 ms [11.9–13.0]`: a median with the range over repetitions.
pub fn fmt_spread(v: &[f64]) -> String {
    let (m, lo, hi) = spread(v);
    if v.len() < 2 {
        return format!("{} ms", fmt_ms(m));
    }
    format!("{} ms [{}–{}]", fmt_ms(m), fmt_ms(lo), fmt_ms(hi))
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

/// The 1-minute load average.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|l| l.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// What the numbers were measured on: date, kernel, CPU model and count.
pub struct Machine {
    pub date: String,
    pub kernel: String,
    pub cpu: String,
    pub cpus: usize,
}

impl Machine {
    pub fn read() -> Self {
        let date = crate::util::output(
            std::process::Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]),
        )
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cpus = cpuinfo
            .lines()
            .filter(|l| l.split(':').next().is_some_and(|k| k.trim() == "processor"))
            .count();
        Self {
            date,
            kernel,
            cpu,
            cpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 100.0);
        assert_eq!(percentile(&v, 99.0), 198.0);
        assert_eq!(percentile(&v, 100.0), 200.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
        assert_eq!(spread(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(fmt_spread(&[3.0, 1.0, 2.0]), "2.00 ms [1.00–3.00]");
    }
}
