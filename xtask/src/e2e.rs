//! `cargo xtask e2e`: calix installed from its Helm chart on a real cluster on this machine
//! (control plane and two kubelet nodes from ../shared/k8s, containerd, kube-proxy), in eBPF
//! then kernel mode, checked and uninstalled; see e2e/src/main.rs. The image is built first
//! (`cargo xtask image`), unless `--image` names one.
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

pub fn run_e2e(image: Option<PathBuf>, modes: &str) -> Result<()> {
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
    let status = Command::new(&bin)
        .arg("--image")
        .arg(&image)
        .arg("--modes")
        .arg(modes)
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
    println!(
        "e2e done in {:.0} s (image build included), nothing left behind",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
