//! A bench's baseline: calix's binaries at another revision, built the way this run's are
//! (release), so that one run measures both, interleaved, and reports this build against it.
//!
//! The revision is checked out in a git worktree under `target/baseline/<commit>/src` and built
//! with its own target directory beside it; both stay for the next run, which builds only what
//! changed.
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::util::{self, output};

/// Binaries built from one revision.
#[derive(Clone, Debug)]
pub struct Baseline {
    /// As given on the command line, then its commit: what the report names.
    pub label: String,
    /// Its `target/release`.
    pub bins: PathBuf,
}

/// Builds `bins` (binary names of the workspace, e.g. `calix-agent`) at revision `rev`, for
/// `target` (a target triple, e.g. the plugin's static musl one) or the host.
pub fn build(rev: &str, bins: &[&str], target: Option<&str>) -> Result<Baseline> {
    let root = util::workspace_root();
    let commit = output(
        Command::new("git")
            .current_dir(&root)
            .args(["rev-parse", "--verify", "--short=12"])
            .arg(format!("{rev}^{{commit}}")),
    )
    .with_context(|| format!("--baseline {rev}: not a revision of this repository"))?
    .trim()
    .to_string();
    let dir = root.join("target").join("baseline").join(&commit);
    let src = dir.join("src");
    if !src.join("Cargo.toml").exists() {
        println!(
            "[setup] baseline {rev}: checking out {commit} in {}",
            src.display()
        );
        let _ = std::fs::remove_dir_all(&src);
        util::run(
            Command::new("git")
                .current_dir(&root)
                .args(["worktree", "add", "--force", "--detach"])
                .arg(&src)
                .arg(&commit),
        )?;
    }
    println!(
        "[setup] baseline {rev}: building {} at {commit} (cargo build --release)",
        bins.join(", ")
    );
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&src)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .args(["build", "--release"]);
    for b in bins {
        cmd.args(["--bin", b]);
    }
    let mut out = dir.join("target");
    if let Some(t) = target {
        cmd.args(["--target", t]);
        out = out.join(t);
    }
    util::run(&mut cmd)?;
    Ok(Baseline {
        label: format!("{rev} ({commit})"),
        bins: out.join("release"),
    })
}

/// What a traffic bench runs of a baseline: its agent's directory and its static plugin.
pub struct Calix {
    /// What the report names.
    pub label: String,
    /// Its `target/release`, with `calix-agent` in it.
    pub agent_bins: PathBuf,
    /// Its `calix` CNI plugin (static).
    pub plugin: PathBuf,
}

/// Builds revision `rev`'s agent (host) and static plugin.
pub fn calix(rev: &str) -> Result<Calix> {
    // The test bed asks the agent through calixctl (readiness, endpoints): the same revision's.
    let agent = build(rev, &["calix-agent", "calixctl"], None)?;
    let plugin = build(rev, &["calix"], Some(crate::setup::MUSL_TARGET))?;
    Ok(Calix {
        label: agent.label,
        agent_bins: agent.bins,
        plugin: plugin.bins.join("calix"),
    })
}
