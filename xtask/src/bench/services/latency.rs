//! An EndpointSlice change until it takes effect. Each change: a Service per lane at a new
//! cluster IP, with no endpoints yet (every variant refuses its connections); 2.4 s later
//! (kube-proxy's `minSyncPeriod` is 1 s: the three Services' syncs are over), lane by lane
//! (the order rotated every change), 1.2 s apart: a client in the lane's client pod (in the
//! bench's cgroup for calix) tries to connect to the lane's Service every millisecond
//! (`xtask netperf wait`: refused at once until then), and its EndpointSlice (the lane's two
//! backends) is written. What is timed: from just before the slice's write until the
//! client's first connection that gets through (wall clock, one machine). One lane at a time,
//! so that no kube-proxy's sync for another lane's slice holds its own back.
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use calix_testbed::traffic::NETPERF_PORT;
use calix_testbed::{Guarded, KubeApi};

use super::{objects, Lane, Variant};
use crate::bench::harness::Compared;

/// How long a client waits for a change.
const WAIT_SECS: f64 = 60.0;
/// Between one lane's change and the next (more than kube-proxy's `minSyncPeriod`).
const SPACING: Duration = Duration::from_millis(1200);

/// The name of lane `lane`'s Service of change `k` in stage `stage`.
fn name(stage: usize, k: usize, lane: usize) -> String {
    format!("lat-{stage}-{k}-{lane}")
}

/// Change `k` of stage `stage`: each lane's time (ms) from its EndpointSlice's write until its
/// client got through.
pub(super) fn change(
    api: &KubeApi,
    ns: &str,
    lanes: &[Lane],
    netperf: &Path,
    cgroup: &Path,
    stage: usize,
    k: usize,
) -> Result<[f64; 3]> {
    let ip = |i: usize| objects::latency_ip(stage, k, i);
    std::thread::sleep(SPACING);
    api.apply_timed(
        (0..lanes.len())
            .map(|i| objects::service(ns, &name(stage, k, i), ip(i), NETPERF_PORT))
            .collect(),
    )?;
    std::thread::sleep(2 * SPACING);
    let mut ms = [0.0; 3];
    for (n, i) in super::super::harness::order(&[0, 1, 2], k, true)
        .into_iter()
        .enumerate()
    {
        if n > 0 {
            std::thread::sleep(SPACING);
        }
        let l = &lanes[i];
        let mut client = Client::start(l, &format!("{}:{NETPERF_PORT}", ip(i)), netperf, cgroup)?;
        let slice = objects::slice(ns, &name(stage, k, i), &l.backends, NETPERF_PORT);
        let written = api.apply_timed(vec![slice])?[0];
        let at = client.through().with_context(|| l.v.label())?;
        let from = written.duration_since(UNIX_EPOCH)?.as_nanos();
        ms[i] = at.saturating_sub(from) as f64 / 1e6;
    }
    Ok(ms)
}

/// `xtask netperf wait` in a lane's client pod, trying already.
struct Client {
    child: Guarded,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Client {
    fn start(l: &Lane, to: &str, netperf: &Path, cgroup: &Path) -> Result<Self> {
        let mut cmd = l.traffic.client.daemon(netperf, None)?;
        cmd.args(["netperf", "wait", "--to", to, "--secs"])
            .arg(WAIT_SECS.to_string());
        if l.v == Variant::Calix {
            cmd.arg("--cgroup").arg(cgroup);
        }
        let mut child = Guarded(
            cmd.stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("start a client")?,
        );
        let out = BufReader::new(child.0.stdout.take().context("its stdout")?);
        let mut c = Self {
            child,
            lines: out.lines(),
        };
        match c.lines.next() {
            Some(Ok(l)) if l == "probing" => Ok(c),
            other => bail!("a client did not start: {other:?}; {}", c.stderr()),
        }
    }

    /// When its first connection got through (ns since the epoch).
    fn through(&mut self) -> Result<u128> {
        let at = match self.lines.next() {
            Some(Ok(l)) => l.trim().parse().context("a client's time")?,
            other => bail!(
                "no connection after the change: {other:?}; {}",
                self.stderr()
            ),
        };
        let _ = self.child.0.wait();
        Ok(at)
    }

    /// What it said on stderr (killed first).
    fn stderr(&mut self) -> String {
        let _ = self.child.0.kill();
        let mut s = String::new();
        if let Some(mut e) = self.child.0.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut s);
        }
        s
    }
}

/// Deletes stage `stage`'s `changes` changes' Services and EndpointSlices.
pub(super) fn remove(api: &KubeApi, ns: &str, stage: usize, changes: usize) -> Result<()> {
    for k in 0..changes {
        for i in 0..3 {
            let name = name(stage, k, i);
            api.delete_now("v1", "Service", ns, &name)?;
            api.delete_now(
                "discovery.k8s.io/v1",
                "EndpointSlice",
                ns,
                &format!("{name}-1"),
            )?;
        }
    }
    Ok(())
}
