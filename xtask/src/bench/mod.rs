//! `cargo xtask bench <scenario>`: benchmarks on this machine, the way DESIGN.md §10 says gives
//! stable numbers: release binaries, every variant built side by side and interleaved
//! (repetitions outer, variants inner), medians with [min–max] over repetitions, the load
//! average recorded before each variant. Results go to stdout and to docs/bench/<scenario>.md.
mod cni;
mod dataplane;
mod harness;
mod ipam;
pub mod netperf;
mod snat;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::Value;

use crate::util::{self, output};

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
    /// IPAM allocations per second: calix-agent over gRPC with the embedded and the etcd
    /// datastore, against Debian's host-local plugin (a process per allocation).
    Ipam {
        /// Allocations per variant, phase and repetition.
        #[arg(long, default_value_t = 1000)]
        allocs: usize,
        /// Repetitions (each runs every variant once, in alternating order).
        #[arg(long, default_value_t = 4)]
        reps: usize,
    },
    /// Same-node pod-to-pod performance: calix eBPF and kernel mode against Debian's bridge
    /// plugin and a raw veth pair: connections/s (TCP_CRR), TCP_RR latency, iperf3 throughput,
    /// and the node's IpForwDatagrams.
    Dataplane {
        /// Repetitions (each runs every variant once, in rotating order) [default: 6; 2 with
        /// --quick].
        #[arg(long)]
        reps: Option<usize>,
        /// Seconds per measurement (TCP_CRR, TCP_RR, iperf3 each) [default: 3; 1 with --quick].
        #[arg(long)]
        secs: Option<u64>,
        /// Development mode: 2 repetitions of 1 s (numbers not worth publishing).
        #[arg(long)]
        quick: bool,
    },
    /// Pod → outside through calix eBPF SNAT against iptables/nftables MASQUERADE and routing
    /// without NAT (conn/s, TCP_RR, iperf3), and the XDP deny list's CPU per dropped packet
    /// against nftables drop rules.
    Snat {
        /// Repetitions (each runs every variant once, in rotating order) [default: 6; 2 with
        /// --quick].
        #[arg(long)]
        reps: Option<usize>,
        /// Seconds per measurement [default: 3; 1 with --quick].
        #[arg(long)]
        secs: Option<u64>,
        /// Development mode: 2 repetitions of 1 s, results in target/bench/.
        #[arg(long)]
        quick: bool,
        /// TOML appended to the calix SNAT node's agent config (e.g. a `[nat]` section).
        #[arg(long)]
        snat_config: Option<PathBuf>,
    },
}

pub fn run(scenario: Scenario) -> Result<()> {
    crate::util::ensure_bpffs()?;
    match scenario {
        Scenario::Cni { pods, reps } => cni::run(pods, reps),
        Scenario::Ipam { allocs, reps } => ipam::run(allocs, reps),
        Scenario::Dataplane { reps, secs, quick } => {
            let (r, s) = if quick { (2, 1) } else { (6, 3) };
            dataplane::run(reps.unwrap_or(r), secs.unwrap_or(s), quick)
        }
        Scenario::Snat {
            reps,
            secs,
            quick,
            snat_config,
        } => {
            let (r, s) = if quick { (2, 1) } else { (6, 3) };
            snat::run(reps.unwrap_or(r), secs.unwrap_or(s), quick, snat_config)
        }
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

/// The 1-minute load average.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|l| l.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// The revision of `root` (short hash), marked when the work tree has uncommitted changes.
pub fn git_rev(root: &Path) -> String {
    let rev = output(
        Command::new("git")
            .current_dir(root)
            .args(["rev-parse", "--short", "HEAD"]),
    )
    .map(|s| s.trim().to_string())
    .unwrap_or_else(|_| "unknown".into());
    let dirty = output(Command::new("git").current_dir(root).args([
        "status",
        "--porcelain",
        "--untracked-files=no",
    ]))
    .is_ok_and(|s| !s.trim().is_empty());
    if dirty {
        format!("{rev} (with uncommitted changes)")
    } else {
        rev
    }
}

/// The installed version of Debian's containernetworking-plugins.
pub fn cni_plugins_version() -> String {
    output(Command::new("dpkg-query").args(["-W", "-f=${Version}", "containernetworking-plugins"]))
        .unwrap_or_else(|_| "unknown".into())
}

/// docs/bench/, created if missing.
pub fn out_dir() -> Result<PathBuf> {
    let dir = util::workspace_root().join("docs").join("bench");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Stops a child the bench started: SIGTERM (so an agent removes its socket), up to 5 s, then
/// SIGKILL; reaped either way.
pub fn stop_child(mut child: Child) {
    // SAFETY: plain kill(2) on our own, not yet reaped, child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Polls `ready` every 50 ms until it holds; fails with `log`'s content when `child` exits
/// first or `timeout` passes.
pub fn wait_ready(
    what: &str,
    child: &mut Child,
    log: &Path,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return Ok(());
        }
        let exited = child.try_wait().ok().flatten();
        if exited.is_some() || Instant::now() > deadline {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            bail!("{what} did not come up:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `cmd` with no stdio; its fork-to-exit time (ms). Fails unless it succeeded.
pub fn timed_cmd(cmd: &mut Command) -> Result<f64> {
    let t0 = Instant::now();
    let st = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    let dt = ms(t0.elapsed());
    if !st.success() {
        bail!("{cmd:?} failed ({st})");
    }
    Ok(dt)
}

/// Where Debian's containernetworking-plugins live (also CNI_PATH).
pub const CNI_DIR: &str = "/usr/lib/cni";
/// PATH of every exec'd plugin.
pub const PATH_ENV: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// One CNI plugin under test, exec'd the way a container runtime does, in network namespace
/// `/run/netns/<node>` or, without one, in the bench's own.
pub struct Plugin {
    pub label: &'static str,
    pub binary: PathBuf,
    pub node: Option<String>,
    /// The network config, written to the plugin's stdin.
    pub conf: String,
}

/// One CNI call.
pub struct Call<'a> {
    pub command: &'a str,
    pub container_id: String,
    pub netns: String,
    pub args: String,
}

/// A command that runs in network namespace `node` the way a container runtime in that
/// namespace execs a plugin: plain fork+exec, the child `setns`es before exec. (`ip netns
/// exec` would add a mount namespace and a sysfs remount, ~1.6 ms, to every call.)
pub fn in_netns(program: &Path, node: &str) -> Result<Command> {
    netns_command(program, node, None, false)
}

/// Like [`in_netns`], and the child runs on CPU `cpu` only (`sched_setaffinity`, like
/// `taskset -c`) and dies with the bench (`PR_SET_PDEATHSIG`): for servers, clients and agents
/// the bench starts inside its namespaces.
pub fn in_netns_on(program: &Path, ns: &str, cpu: Option<usize>) -> Result<Command> {
    netns_command(program, ns, cpu, true)
}

fn netns_command(
    program: &Path,
    node: &str,
    cpu: Option<usize>,
    die_with_bench: bool,
) -> Result<Command> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let ns = std::fs::File::open(format!("/run/netns/{node}"))
        .with_context(|| format!("cannot open netns {node}"))?;
    // Built before the fork: nothing allocates in the child.
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut cpus: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if let Some(c) = cpu {
        // SAFETY: CPU_SET writes one bit of the set (it ignores out-of-range CPUs).
        unsafe { libc::CPU_SET(c, &mut cpus) };
    }
    let mut cmd = Command::new(program);
    // SAFETY: setns, sched_setaffinity and prctl are async-signal-safe and touch no memory of
    // the parent; the fd stays open (moved into the closure) until exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0
                || (cpu.is_some()
                    && libc::sched_setaffinity(0, std::mem::size_of_val(&cpus), &cpus) != 0)
                || (die_with_bench && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// The pid in `name` when it is `<prefix>-<pid>-…` (or `<prefix>-<pid>`) and that process is
/// gone: a leftover of a bench run that died without cleaning up.
pub fn stale_pid(name: &str, prefix: &str) -> Option<u32> {
    let pid = name
        .strip_prefix(prefix)?
        .strip_prefix('-')?
        .split('-')
        .next()?
        .parse::<u32>()
        .ok()?;
    (!Path::new(&format!("/proc/{pid}")).exists()).then_some(pid)
}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// From now on SIGINT and SIGTERM only set a flag ([`check_interrupted`]), so the bench stops
/// at the next check and its guards remove what it created (Ctrl-C also reaches the children,
/// which die and fail the running measurement).
pub fn catch_interrupts() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_interrupt as *const () as libc::sighandler_t) };
    }
}

/// Fails when SIGINT or SIGTERM arrived since [`catch_interrupts`].
pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

impl Plugin {
    fn spawn(&self, call: &Call) -> Result<Child> {
        let mut cmd = match &self.node {
            Some(node) => in_netns(&self.binary, node)?,
            None => Command::new(&self.binary),
        };
        cmd.env_clear()
            .env("PATH", PATH_ENV)
            .env("CNI_COMMAND", call.command)
            .env("CNI_CONTAINERID", &call.container_id)
            .env("CNI_NETNS", &call.netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_ARGS", &call.args)
            .env("CNI_PATH", CNI_DIR)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot exec {}", self.binary.display()))
    }

    /// Writes the config to the child's stdin and waits for it; fails unless it succeeded.
    pub fn finish(&self, call: &Call, mut child: Child) -> Result<Output> {
        if let Some(mut si) = child.stdin.take() {
            si.write_all(self.conf.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "{} {} of {} failed ({}): {}\n{}",
                self.label,
                call.command,
                call.container_id,
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out)
    }

    /// One call, timed fork-to-exit.
    pub fn timed(&self, call: &Call) -> Result<f64> {
        let t0 = Instant::now();
        let child = self.spawn(call)?;
        let out = self.finish(call, child)?;
        let dt = ms(t0.elapsed());
        self.result(call, &out)?;
        Ok(dt)
    }

    /// One call, untimed: its result (an ADD's, checked to hold an address; Null otherwise).
    pub fn call(&self, call: &Call) -> Result<Value> {
        let child = self.spawn(call)?;
        let out = self.finish(call, child)?;
        self.result(call, &out)
    }

    fn result(&self, call: &Call, out: &Output) -> Result<Value> {
        if call.command != "ADD" {
            return Ok(Value::Null);
        }
        let v: Value = serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "{} ADD printed non-JSON: {}",
                self.label,
                String::from_utf8_lossy(&out.stdout)
            )
        })?;
        if v["ips"][0]["address"].as_str().is_none() {
            bail!("{} ADD returned no address: {v}", self.label);
        }
        Ok(v)
    }

    /// `calls` all at once: wall time from the first fork to the last exit.
    pub fn concurrent(&self, calls: &[Call]) -> Result<f64> {
        let t0 = Instant::now();
        let mut children = Vec::with_capacity(calls.len());
        for c in calls {
            children.push(self.spawn(c)?);
        }
        let mut first_err = None;
        for (c, child) in calls.iter().zip(children) {
            if let Err(e) = self.finish(c, child) {
                first_err.get_or_insert(e);
            }
        }
        let dt = ms(t0.elapsed());
        match first_err {
            Some(e) => Err(e),
            None => Ok(dt),
        }
    }
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

// --- charts --------------------------------------------------------------------------------

/// One series of a bar chart: name, colour, one value per group (None: no bar).
pub type Series<'a> = (&'a str, plotters::style::RGBColor, Vec<Option<f64>>);

/// Grouped bars: one group per label, one bar per series, `label(series, group, value)` on
/// top of each bar, `unit` on the y axis; an optional dashed reference line.
pub fn panel<DB: plotters::prelude::DrawingBackend>(
    area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    unit: &str,
    groups: &[&str],
    series: &[Series],
    label: &dyn Fn(usize, usize, f64) -> String,
    reference: Option<(&str, f64)>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    let n = groups.len();
    let ymax = series
        .iter()
        .flat_map(|s| s.2.iter().flatten())
        .copied()
        .chain(reference.map(|r| r.1))
        .filter(|v| v.is_finite())
        .fold(1.0f64, f64::max)
        * 1.4;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)
        .map_err(|e| anyhow::anyhow!("chart: {e:?}"))?;
    let group_label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
            groups[i as usize].to_string()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&group_label)
        .y_label_formatter(&|v: &f64| format!("{v:.0}"))
        .y_desc(unit)
        .draw()
        .map_err(|e| anyhow::anyhow!("chart mesh: {e:?}"))?;
    let k = series.len() as f64;
    let width = 0.8 / k;
    for (si, (name, color, values)) in series.iter().enumerate() {
        let color = *color;
        let bars: Vec<(usize, f64, f64)> = values
            .iter()
            .enumerate()
            .filter_map(|(g, v)| {
                v.filter(|v| v.is_finite())
                    .map(|v| (g, g as f64 - 0.4 + si as f64 * width, v))
            })
            .collect();
        chart
            .draw_series(bars.iter().map(|&(_, x0, v)| {
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, v)], color.filled())
            }))
            .map_err(|e| anyhow::anyhow!("chart bars: {e:?}"))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
        let style = TextStyle::from(("sans-serif", 11).into_font())
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart
            .draw_series(bars.iter().map(|&(g, x0, v)| {
                Text::new(label(si, g, v), (x0 + width * 0.45, v), style.clone())
            }))
            .map_err(|e| anyhow::anyhow!("chart labels: {e:?}"))?;
    }
    if let Some((name, y)) = reference.filter(|r| r.1.is_finite()) {
        let line = BLACK.stroke_width(1);
        chart
            .draw_series(dashes(-0.5, n as f64 - 0.5, y).map(|seg| PathElement::new(seg, line)))
            .map_err(|e| anyhow::anyhow!("chart line: {e:?}"))?
            .label(format!("{name} ({} {unit})", fmt_ms(y)))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 10, y)], line));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| anyhow::anyhow!("chart legend: {e:?}"))?;
    Ok(())
}

/// Segments of a dashed horizontal line from `x0` to `x1` at `y`.
fn dashes(x0: f64, x1: f64, y: f64) -> impl Iterator<Item = Vec<(f64, f64)>> {
    let step = (x1 - x0) / 60.0;
    (0..30).map(move |i| {
        let a = x0 + 2.0 * i as f64 * step;
        vec![(a, y), (a + step, y)]
    })
}

/// A white SVG chart of `size` pixels at `path`, titled: the start of every bench's chart.
pub fn chart_root<'a>(
    path: &'a std::path::Path,
    size: (u32, u32),
    title: &str,
) -> Result<plotters::drawing::DrawingArea<plotters::backend::SVGBackend<'a>, plotters::coord::Shift>>
{
    use plotters::prelude::*;
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    Ok(root.titled(title, ("sans-serif", 18))?)
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
