//! What every bench shares around its topology: setting up a run (root, tools, release
//! binaries, leftovers of dead runs, Ctrl-C), naming what it creates (`cxb-<pid>-<tag>`: the
//! test bed removes it on drop), the interleaved repetitions, what it was measured on, and
//! writing the report.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::traffic::{Tools, Traffic};
use calix_testbed::{AgentSpec, Dataplane, Netns, Node, CNI_DIR};
use plotters::style::RGBColor;

use crate::util::{self, output};

/// Prefix of everything a bench creates: `cxb-<pid>-<tag>` namespaces, nodes (their pin roots
/// `/sys/fs/bpf/cxb-<pid>-<tag>`, their directories) and the run's directory `$TMPDIR/cxb-<pid>`.
pub const PREFIX: &str = "cxb";

/// One bench run. Its directory goes on drop; what it creates through it goes with the test
/// bed's values (namespaces, nodes) when they drop.
pub struct Bench {
    pub prefix: String,
    pub dir: PathBuf,
    /// target/release.
    pub bins: PathBuf,
    /// The revision the binaries are built from (read before the build, not after the run).
    pub rev: String,
    pub machine: Machine,
    /// The CPU every measured client and server is pinned to.
    pub cpu: usize,
    started: Instant,
}

impl Bench {
    /// Checks the prerequisites (root, `tools` on PATH, `plugins` in /usr/lib/cni), builds the
    /// release binaries, removes what dead runs left, and from then on turns SIGINT and SIGTERM
    /// into an error at the next [`check_interrupted`].
    pub fn setup(what: &str, tools: &[&str], plugins: &[&str]) -> Result<Self> {
        util::require_root(what)?;
        for p in plugins.iter().map(|p| Path::new(CNI_DIR).join(p)) {
            if !p.exists() {
                bail!(
                    "{} is missing: install containernetworking-plugins (cargo xtask setup)",
                    p.display()
                );
            }
        }
        for tool in tools {
            if output(Command::new("sh").args(["-c", &format!("command -v {tool}")])).is_err() {
                bail!("{tool} is missing: cargo xtask setup installs it");
            }
        }
        let started = Instant::now();
        let rev = git_rev(&util::workspace_root());
        println!("[setup] building release binaries (cargo build --release --workspace --bins)");
        let bins = util::build_bins_release()?;
        crate::leftovers::remove_stale(PREFIX)?;
        crate::interrupt::catch();
        let machine = Machine::read();
        let prefix = format!("{PREFIX}-{}", std::process::id());
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            prefix,
            dir,
            bins,
            rev,
            cpu: if machine.cpus > 1 { 1 } else { 0 },
            machine,
            started,
        })
    }

    pub fn name(&self, tag: &str) -> String {
        format!("{}-{tag}", self.prefix)
    }

    /// Namespace `cxb-<pid>-<tag>`, loopback up.
    pub fn netns(&self, tag: &str) -> Result<Netns> {
        Ok(Netns::create(self.name(tag))?)
    }

    /// The release agent with `dataplane`.
    pub fn spec(&self, dataplane: Dataplane) -> AgentSpec {
        AgentSpec::new(self.bins.clone(), dataplane)
    }

    /// Node `cxb-<pid>-<tag>` with its agent running as `spec` says.
    pub fn node(&self, tag: &str, spec: AgentSpec) -> Result<Node> {
        Ok(Node::launch(self.name(tag), spec)?)
    }

    /// The traffic tools: the release xtask's netperf, pinned to [`Bench::cpu`].
    pub fn tools(&self) -> Tools {
        Tools {
            netperf: self.bins.join("xtask"),
            cpu: self.cpu,
        }
    }

    /// `Measured <date> by `cargo xtask bench <args>` on <CPU> × <n> (<n> CPUs), kernel <k>.
    /// calix <rev>`: how a report says what it was measured on, to go on with what calix was.
    pub fn measured(&self, args: &str) -> String {
        let m = &self.machine;
        format!(
            "Measured {} by `cargo xtask bench {args}` on {} × {} ({} CPUs), kernel {}. calix {}",
            m.date, m.cpu, m.cpus, m.cpus, m.kernel, self.rev
        )
    }

    /// Says the measurements are over (call it once everything is dropped).
    pub fn done(&self) {
        println!(
            "[done] measured in {:.0}s; servers and agents stopped, namespaces and pins removed",
            self.started.elapsed().as_secs_f64()
        );
    }

    /// Prints `md` and writes it to `<name>.md` and `chart` to `<name>.svg`: in docs/bench/, or
    /// with `quick` (numbers not worth publishing) in target/bench/.
    pub fn publish(
        name: &str,
        md: &str,
        quick: bool,
        chart: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<()> {
        println!("\n{md}");
        let root = util::workspace_root();
        let out = match quick {
            true => root.join("target").join("bench"),
            false => root.join("docs").join("bench"),
        };
        std::fs::create_dir_all(&out)?;
        let (md_path, svg) = (
            out.join(format!("{name}.md")),
            out.join(format!("{name}.svg")),
        );
        std::fs::write(&md_path, md)?;
        chart(&svg)?;
        println!("wrote {} and {}", md_path.display(), svg.display());
        Ok(())
    }
}

#[cfg(test)]
impl Bench {
    /// A bench that set nothing up, on a fixed machine: for rendering reports in unit tests.
    pub fn fake() -> Self {
        Self {
            prefix: format!("{PREFIX}-test"),
            // Never created; removed on drop if a test made it.
            dir: std::env::temp_dir().join(format!("{PREFIX}-test-{}", std::process::id())),
            bins: PathBuf::from("target/release"),
            rev: "0123abc".into(),
            machine: Machine {
                date: "2026-01-02 03:04 UTC".into(),
                kernel: "6.12.0-test".into(),
                cpu: "Test CPU @ 2.00GHz".into(),
                cpus: 2,
            },
            cpu: 1,
            started: Instant::now(),
        }
    }
}

/// Renders a report as [`Bench::publish`] writes it (`<name>.md`, `<name>.svg`) into the
/// directory `$XTASK_BENCH_RENDER` (to look at them), or a temporary one; returns the SVG.
#[cfg(test)]
pub fn render(name: &str, md: &str, chart: impl FnOnce(&Path) -> Result<()>) -> String {
    let dir = std::env::var_os("XTASK_BENCH_RENDER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("{PREFIX}-render-{}", std::process::id()))
        });
    std::fs::create_dir_all(&dir).expect("render directory");
    std::fs::write(dir.join(format!("{name}.md")), md).expect("markdown written");
    let svg = dir.join(format!("{name}.svg"));
    chart(&svg).expect("chart drawn");
    let text = std::fs::read_to_string(&svg).expect("chart written");
    if std::env::var_os("XTASK_BENCH_RENDER").is_none() {
        let _ = std::fs::remove_file(&svg);
        let _ = std::fs::remove_file(dir.join(format!("{name}.md")));
        let _ = std::fs::remove_dir(&dir);
    }
    text
}

/// `n` made-up samples around `x` (for reports rendered in tests).
#[cfg(test)]
pub fn around(x: f64, n: usize) -> Vec<f64> {
    (0..n).map(|i| x * (1.0 + 0.02 * i as f64)).collect()
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The variants of repetition `rep` (from 0) in their order: rotated by one every repetition,
/// or (`rotate` false) reversed every other one.
pub fn order<V: Copy>(variants: &[V], rep: usize, rotate: bool) -> Vec<V> {
    let mut v = variants.to_vec();
    let n = v.len().max(1);
    match rotate {
        true => v.rotate_left(rep % n),
        false if rep % 2 == 1 => v.reverse(),
        false => {}
    }
    v
}

/// Warms up `tr`, variant `label`'s traffic, retrying for `patience` (the first connections
/// may wait for routes to spread and devices to appear), and says so with the server's
/// `address` as the line shows it.
pub fn warm_up(
    tools: &Tools,
    label: &str,
    tr: &Traffic,
    address: &str,
    patience: Duration,
) -> Result<()> {
    let deadline = Instant::now() + patience;
    let w = loop {
        match tools.warm_up(tr) {
            Ok(w) => break w,
            Err(e) if Instant::now() >= deadline => {
                return Err(e).with_context(|| {
                    format!(
                        "{label}: {} cannot reach {} (warm-up)",
                        tr.client.name, tr.server_ip
                    )
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    println!(
        "[setup] {label}: {} → {} ({address}), warm-up RR p50 {:.1} µs",
        tr.client.name, tr.server.name, w.p50_us
    );
    Ok(())
}

/// What a bench compares (a variant, a filter): its label (in the report and the chart), its
/// tag (in the names of what it creates) and its colour (in the chart).
pub trait Compared: Copy {
    fn info(self) -> (&'static str, &'static str, RGBColor);

    fn label(self) -> &'static str {
        self.info().0
    }

    fn tag(self) -> &'static str {
        self.info().1
    }

    fn color(self) -> RGBColor {
        self.info().2
    }
}

/// Every repetition of `variants`, interleaved (the order rotated every repetition):
/// `measure` for each.
pub fn repetitions<V: Compared>(
    reps: usize,
    variants: &[V],
    mut measure: impl FnMut(V) -> Result<String>,
) -> Result<()> {
    for rep in 0..reps {
        repetition(
            rep,
            reps,
            &order(variants, rep, true),
            |v| v.label().into(),
            &mut measure,
        )?;
    }
    Ok(())
}

/// Repetition `rep` (from 0) of `reps`: `measure` for each of `variants` in turn, stopping at
/// Ctrl-C, each one's progress line printed.
pub fn repetition<V: Copy>(
    rep: usize,
    reps: usize,
    variants: &[V],
    label: impl Fn(V) -> String,
    mut measure: impl FnMut(V) -> Result<String>,
) -> Result<()> {
    for &v in variants {
        check_interrupted()?;
        // Ctrl-C kills the running client too: report the interrupt, not its failure.
        let line = measure(v)
            .or_else(|e| check_interrupted().and(Err(e)))
            .with_context(|| format!("{} (repetition {})", label(v), rep + 1))?;
        println!("[rep {}/{reps}] {} {line}", rep + 1, label(v));
    }
    Ok(())
}

/// `n` fork-to-exit times (ms) of `/bin/true` (exec'd in `ns`, or here): what every
/// process-per-call plugin pays before doing anything.
pub fn true_floor(n: usize, ns: Option<&Netns>) -> Result<Vec<f64>> {
    let cmd = || -> Result<Command> {
        match ns {
            Some(ns) => Ok(ns.command("/bin/true")?),
            None => Ok(Command::new("/bin/true")),
        }
    };
    (0..n).map(|_| timed_cmd(&mut cmd()?)).collect()
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
    let dt = t0.elapsed().as_secs_f64() * 1e3;
    if !st.success() {
        bail!("{cmd:?} failed ({st})");
    }
    Ok(dt)
}

// --- leftovers and interrupts: shared with the demo ----------------------------------------

pub use crate::interrupt::check as check_interrupted;

// --- what it was measured on ---------------------------------------------------------------

/// What the numbers were measured on: date, kernel, CPU model and count.
pub struct Machine {
    pub date: String,
    pub kernel: String,
    pub cpu: String,
    pub cpus: usize,
}

impl Machine {
    pub fn read() -> Self {
        let date = output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))
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

/// The revision of `root` (short hash), marked when the work tree has uncommitted changes
/// (outside docs/bench/).
fn git_rev(root: &Path) -> String {
    let git = |args: &[&str]| output(Command::new("git").current_dir(root).args(args));
    let rev = git(&["rev-parse", "--short", "HEAD"])
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    // The benches' own output (docs/bench/) is not the code that was measured.
    match git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":!docs/bench",
    ]) {
        Ok(s) if !s.trim().is_empty() => format!("{rev} (with uncommitted changes)"),
        _ => rev,
    }
}

/// The installed version of Debian's containernetworking-plugins.
pub fn cni_plugins_version() -> String {
    output(Command::new("dpkg-query").args(["-W", "-f=${Version}", "containernetworking-plugins"]))
        .unwrap_or_else(|_| "unknown".into())
}

/// The first line `program --version` prints (`program` when it prints nothing).
pub fn version(program: &str) -> String {
    output(Command::new(program).arg("--version"))
        .ok()
        .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
        .unwrap_or_else(|| program.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_rotate_or_reverse() {
        assert_eq!(order(&[1, 2, 3], 1, true), [2, 3, 1]);
        assert_eq!(order(&[1, 2, 3], 3, true), [1, 2, 3]);
        assert_eq!(order(&[1, 2, 3], 1, false), [3, 2, 1]);
        assert_eq!(order(&[1, 2, 3], 2, false), [1, 2, 3]);
    }
}
