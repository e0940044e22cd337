//! `calix-e2e` (run by `cargo xtask e2e`, as root): a real Kubernetes cluster on this machine
//! with calix installed from its own Helm chart and image, checked the way an operator would.
//!
//! - The control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
//!   v1.36.2 (`../shared/k8s`) in a namespace of their own.
//! - Two nodes (`--nodes`: more; three for the full Services suite, one of whose specs needs
//!   three schedulable nodes), each a network namespace on the test underlay (two subnets
//!   joined by a router: cross-node traffic goes through VXLAN), running containerd (CRI), the
//!   kubelet and kube-proxy (iptables mode): kept in kernel mode; in eBPF mode calix is
//!   installed beside it and replaces it (`kubeProxyReplacement`), then kube-proxy is removed,
//!   as docs/install.md says. Each node is its own directory for the chart's host paths
//!   (`hostPathsPerNode`), with the reference plugins loopback and portmap in its CNI bin dir.
//! - The calix image (`cargo xtask image`) imported into each node's containerd; the chart
//!   rendered by Helm's own library and applied in Helm's order; route distribution over
//!   mutual TLS, each node's certificate from the Kubernetes API (calix-signer signs it).
//! - For each dataplane mode: install, the DaemonSet ready, then the checks ([`checks`]),
//!   then uninstall and nothing of calix left on either node ([`node_state`]).
//! - Everything torn down, and nothing left behind.
//!
//! The whole run happens in a private mount namespace, with a bpffs of its own mounted shared
//! on /sys/fs/bpf (the agents mount it Bidirectional, as on a real node).
mod checks;
mod cluster;
mod conformance;
mod helm;
mod node_state;
mod progress;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;

use crate::cluster::E2eCluster;
use crate::progress::Progress;

#[derive(Parser, Debug)]
#[command(
    name = "calix-e2e",
    about = "calix installed from its chart on a real cluster"
)]
struct Args {
    /// The calix image (an OCI archive: `cargo xtask image`).
    #[arg(long)]
    image: PathBuf,
    /// The dataplane modes to install and check, in order.
    #[arg(long, value_delimiter = ',', default_value = "ebpf,kernel")]
    modes: Vec<Mode>,
    /// Also run these upstream conformance suites, in order, in each mode of
    /// `--conformance-modes`, after the checks (before the uninstall), and write each one's
    /// report to `--conformance-reports`.
    #[arg(long, value_delimiter = ',')]
    conformance: Vec<conformance::Suite>,
    /// The modes the suites run in (default: every mode of `--modes`).
    #[arg(long, value_delimiter = ',')]
    conformance_modes: Option<Vec<Mode>>,
    /// The directory each suite's report goes to, as `<suite>.md` (Markdown).
    #[arg(long)]
    conformance_reports: Option<PathBuf>,
    /// How many kubelet nodes (2 or more). Default: 3 when the full `services` suite runs (its
    /// ExternalTrafficPolicy-change spec needs 3 schedulable nodes), else 2.
    #[arg(long)]
    nodes: Option<usize>,
    /// The calix commit the report names.
    #[arg(long, default_value = "(unknown commit)")]
    commit: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Ebpf,
    Kernel,
}

impl Mode {
    pub fn value(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Kernel => "kernel",
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !args.image.is_file() {
        bail!(
            "no image at {} (cargo xtask image builds it)",
            args.image.display()
        );
    }
    private_mounts().context("a private mount namespace with a bpffs of its own")?;
    let started = Instant::now();
    let suite_modes: Vec<Mode> = match (args.conformance.is_empty(), &args.conformance_modes) {
        (true, _) => Vec::new(),
        (false, Some(m)) => m.clone(),
        (false, None) => args.modes.clone(),
    };
    let steps =
        2 + args.modes.len() * checks::STEPS + suite_modes.len() * args.conformance.len() + 1;
    let mut p = Progress::new(steps);
    let count = args.nodes.unwrap_or(
        match args.conformance.contains(&conformance::Suite::Services) {
            true => 3,
            false => 2,
        },
    );
    let mut cluster = E2eCluster::start(&mut p, &args.image, count)?;
    if !args.conformance.is_empty() {
        conformance::import_agnhost(&cluster)?;
        p.note("the upstream suites' agnhost image imported into every node");
    }
    let mut reports = Vec::new();
    let mut outcomes = Vec::new();
    for mode in &args.modes {
        // Both modes are installed with kube-proxy running (a cluster as it is before calix
        // replaces it); eBPF mode removes it once the agents are ready ([`checks::run`]).
        cluster.kube_proxy(true, &mut p)?;
        let suites: &[conformance::Suite] = if suite_modes.contains(mode) {
            &args.conformance
        } else {
            &[]
        };
        let checked = checks::run(&mut cluster, *mode, &mut p, suites, &mut outcomes);
        if checked.is_err() {
            // What the suites found stays, whatever failed after them.
            write_reports(&args, &outcomes, &suite_modes, count)?;
        }
        reports.push(checked?);
    }
    write_reports(&args, &outcomes, &suite_modes, count)?;
    let suite_failed: Vec<String> = outcomes
        .iter()
        .flat_map(|o| {
            o.failed()
                .into_iter()
                .map(move |c| format!("[{} {}] {}", o.suite.name(), o.mode.value(), c.name))
        })
        .collect();
    p.step("teardown: nodes (kubelet, containerd, kube-proxy if running), control plane, underlay");
    let left = cluster.stop();
    if !left.is_empty() {
        bail!("the e2e cluster left behind: {left:?}");
    }
    if !suite_failed.is_empty() {
        bail!(
            "{} spec(s) of the conformance suite failed:\n  {}",
            suite_failed.len(),
            suite_failed.join("\n  ")
        );
    }
    println!();
    println!("e2e passed in {:.1?}", started.elapsed());
    println!();
    println!("| mode | install to DaemonSet ready | pods Running | rollout restart | longest gap of the TCP flow | uninstall clean |");
    println!("|---|---|---|---|---|---|");
    for r in &reports {
        println!("{r}");
    }
    Ok(())
}

/// Each suite's report (of the modes it ran in so far, on `nodes` nodes) to
/// `--conformance-reports`.
fn write_reports(
    args: &Args,
    outcomes: &[conformance::Outcome],
    suite_modes: &[Mode],
    nodes: usize,
) -> Result<()> {
    let Some(dir) = &args.conformance_reports else {
        return Ok(());
    };
    for suite in &args.conformance {
        let mine: Vec<conformance::Outcome> = outcomes
            .iter()
            .filter(|o| o.suite == *suite)
            .cloned()
            .collect();
        if mine.is_empty() {
            continue;
        }
        let md = conformance::markdown(&mine, suite_modes, &args.commit, nodes);
        let path = dir.join(format!("{}.md", suite.name()));
        std::fs::write(&path, &md).with_context(|| format!("write {}", path.display()))?;
        println!("the {} suite's report: {}", suite.name(), path.display());
    }
    Ok(())
}

/// Unshares the mount namespace (still single-threaded: before anything starts), makes every
/// mount private to it, and mounts a bpffs of its own on /sys/fs/bpf, shared (what systemd
/// does on a real node; the chart mounts it Bidirectional).
fn private_mounts() -> Result<()> {
    // SAFETY: unshare(2) of this (single-threaded) process's mount namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(std::io::Error::last_os_error()).context("unshare(CLONE_NEWNS)");
    }
    let run = |argv: &[&str]| -> Result<()> {
        let status = std::process::Command::new(argv[0])
            .args(&argv[1..])
            .status()
            .with_context(|| format!("{argv:?}"))?;
        if !status.success() {
            bail!("{argv:?}: {status}");
        }
        Ok(())
    };
    run(&["mount", "--make-rprivate", "/"])?;
    // The machine's bpffs (stacked instances too) out of sight, here only: the mount found
    // at /sys/fs/bpf must be the shared one (containerd checks it for a Bidirectional mount).
    while is_bpffs("/sys/fs/bpf") {
        run(&["umount", "/sys/fs/bpf"])?;
    }
    run(&["mount", "-t", "bpf", "calix-e2e-bpffs", "/sys/fs/bpf"])?;
    run(&["mount", "--make-shared", "/sys/fs/bpf"])?;
    Ok(())
}

/// Whether `path` is a bpffs mount (statfs magic).
fn is_bpffs(path: &str) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let Ok(c) = std::ffi::CString::new(path) else {
        return false;
    };
    // SAFETY: statfs(2) into a zeroed struct we own, with a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0) && st.f_type as i64 == BPF_FS_MAGIC
}
