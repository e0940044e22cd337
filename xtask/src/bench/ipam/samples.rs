//! What the IPAM bench measures: per repetition, per variant over every repetition, and the
//! floors.
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use calix_testbed::traffic::cpu::load_average;

use super::{FSYNC_LINE, IN_FLIGHT};
use crate::bench::harness::true_floor;
use crate::bench::report::{fmt_ms, fmt_spread_with, percentile, Calls};

/// Unique container IDs of one variant and repetition.
pub(super) struct Ids {
    pub(super) n: usize,
    pub(super) rep: usize,
    pub(super) tag: &'static str,
}

impl Ids {
    pub(super) fn id(&self, phase: &str, i: usize) -> String {
        format!("cxb{}{}{phase}{i:06}", self.rep, self.tag)
    }
}

/// One variant's repetition.
pub(super) struct Measured {
    /// Wall times (s) of the phases.
    pub(super) seq_wall: f64,
    pub(super) conc_wall: f64,
    pub(super) rel_wall: f64,
    /// Per-call latencies (ms), sequential.
    pub(super) alloc_lat: Vec<f64>,
    pub(super) rel_lat: Vec<f64>,
    /// calix: Status round trips (ms), the gRPC floor.
    pub(super) rpc_lat: Vec<f64>,
    /// The embedded journal's size after the sequential allocations.
    pub(super) journal: Option<u64>,
}

/// One variant over every repetition.
#[derive(Default)]
pub(super) struct Samples {
    /// Per repetition: allocations/s sequential and with 16 in flight, releases/s.
    pub(super) seq: Vec<f64>,
    pub(super) conc: Vec<f64>,
    pub(super) rel: Vec<f64>,
    /// Sequential calls (ms).
    pub(super) alloc: Calls,
    pub(super) release: Calls,
    /// calix: Status round trips (ms).
    pub(super) rpc: Calls,
    /// Sequential allocation latencies (ms) of the first and the last tenth of each repetition.
    pub(super) first_tenth: Vec<f64>,
    pub(super) last_tenth: Vec<f64>,
    /// Journal bytes per sequential allocation (embedded).
    pub(super) journal_per_alloc: Vec<f64>,
    pub(super) load: Vec<f64>,
}

impl Samples {
    /// Records a repetition; returns its progress line.
    pub(super) fn push(&mut self, n: usize, m: Measured) -> String {
        let nf = n as f64;
        let (seq, conc, rel) = (nf / m.seq_wall, nf / m.conc_wall, nf / m.rel_wall);
        self.seq.push(seq);
        self.conc.push(conc);
        self.rel.push(rel);
        let k = (m.alloc_lat.len() / 10).max(1).min(m.alloc_lat.len());
        self.first_tenth.extend(&m.alloc_lat[..k]);
        self.last_tenth
            .extend(&m.alloc_lat[m.alloc_lat.len() - k..]);
        if let Some(j) = m.journal {
            self.journal_per_alloc.push(j as f64 / nf);
        }
        let a99 = percentile(&m.alloc_lat, 99.0);
        let (a50, r50) = (self.alloc.push(m.alloc_lat), self.release.push(m.rel_lat));
        self.rpc.push(m.rpc_lat);
        format!(
            "sequential {}/s (p50 {} ms, p99 {} ms), {IN_FLIGHT} in flight {}/s, release {}/s (p50 {} ms)",
            fmt_rate(seq),
            fmt_ms(a50),
            fmt_ms(a99),
            fmt_rate(conc),
            fmt_rate(rel),
            fmt_ms(r50),
        )
    }
}

/// The floors over every repetition (ms per call).
#[derive(Default)]
pub(super) struct Floors {
    pub(super) truth: Calls,
    pub(super) fsync: Calls,
    pub(super) load: Vec<f64>,
}

impl Floors {
    pub(super) fn run(&mut self, dir: &Path, n: usize) -> Result<String> {
        use std::os::unix::fs::OpenOptionsExt;
        let load = load_average();
        self.load.push(load);
        let t50 = self.truth.push(true_floor(n, None)?);
        let path = dir.join("fsync-floor");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let mut line = vec![b'x'; FSYNC_LINE - 1];
        line.push(b'\n');
        let mut fsync = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            f.write_all(&line)?;
            f.sync_data()?;
            fsync.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        drop(f);
        std::fs::remove_file(&path)?;
        let f50 = self.fsync.push(fsync);
        Ok(format!(
            "(load {load:.2}): /bin/true p50 {} ms, append {FSYNC_LINE} B + fdatasync p50 {} ms",
            fmt_ms(t50),
            fmt_ms(f50)
        ))
    }
}

/// Allocations per second: no decimals from 100 up.
pub(super) fn fmt_rate(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

pub(super) fn rate_spread(v: &[f64]) -> String {
    fmt_spread_with(v, "/s", fmt_rate)
}
