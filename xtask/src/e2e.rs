//! `cargo xtask e2e`: calix installed from its Helm chart on a real cluster on this machine
//! (control plane and kubelet nodes from ../shared/k8s, containerd, kube-proxy), in eBPF
//! then kernel mode, checked and uninstalled; see e2e/src/main.rs. The image is built first
//! (`cargo xtask image`), unless `--image` names one.
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

pub fn run_e2e(
    image: Option<PathBuf>,
    modes: &str,
    conformance: Option<&str>,
    conformance_modes: Option<&str>,
    nodes: Option<usize>,
) -> Result<()> {
    util::require_root("the e2e run")?;
    let started = Instant::now();
    println!("[1/5] prerequisites");
    crate::setup::run()?;
    util::ensure_bpffs()?;
    println!("[2/5] the Kubernetes binaries (../shared/k8s, v1.36.2)");
    let k8s = util::workspace_root().join("../shared/k8s/bin");
    if !k8s.join("kubelet.xz").is_file() {
        bail!(
            "no Kubernetes binaries in {} (see docs/testing.md, \"The end-to-end run\")",
            k8s.display()
        );
    }
    let image = match image {
        Some(p) => {
            println!("[3/5] the calix image: {}", p.display());
            p
        }
        None => {
            println!("[3/5] the calix image (cargo xtask image)");
            crate::image::run_image()?
        }
    };
    println!("[4/5] building calix-e2e and running it: install, check, uninstall ({modes})");
    run(util::cargo().args(["build", "-p", "calix-e2e", "--bin", "calix-e2e"]))?;
    let bin = util::workspace_root().join("target/debug/calix-e2e");
    let mut cmd = Command::new(&bin);
    cmd.arg("--image").arg(&image).arg("--modes").arg(modes);
    if let Some(n) = nodes {
        cmd.arg("--nodes").arg(n.to_string());
    }
    if let Some(suites) = conformance {
        let docs = util::workspace_root().join("docs/conformance");
        std::fs::create_dir_all(&docs).with_context(|| format!("create {}", docs.display()))?;
        cmd.arg("--conformance")
            .arg(suites)
            .arg("--conformance-reports")
            .arg(&docs)
            .arg("--commit")
            .arg(commit());
        if let Some(m) = conformance_modes {
            cmd.arg("--conformance-modes").arg(m);
        }
    }
    let status = cmd
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    println!("[5/5] checking that the run left nothing behind");
    let leaks = crate::test::leftovers()?;
    let left = match leaks.is_empty() {
        true => String::new(),
        false => format!("the e2e run left things behind:\n  {}", leaks.join("\n  ")),
    };
    if !status.success() {
        bail!(
            "calix-e2e failed ({status}){}",
            if left.is_empty() {
                String::new()
            } else {
                format!("; {left}")
            }
        );
    }
    if !left.is_empty() {
        bail!("{left}");
    }
    for suite in conformance.into_iter().flat_map(|s| s.split(',')) {
        println!("the {suite} suite's report: docs/conformance/{suite}.md");
    }
    println!(
        "e2e done in {:.0} s (image build included), nothing left behind",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `git describe`-style name of the tree the run tests: the short commit, `+dirty` when the
/// work tree differs from it.
fn commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(util::workspace_root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(head) = git(&["rev-parse", "--short", "HEAD"]) else {
        return "(not a git checkout)".into();
    };
    match git(&["status", "--porcelain", "--untracked-files=no"]) {
        Some(s) if !s.is_empty() => format!("{head}+dirty"),
        _ => head,
    }
}
