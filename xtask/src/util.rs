//! Small helpers shared by the xtask commands: running commands, the workspace root.
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The workspace root (the parent of xtask/).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// Runs a command, inheriting stdout/stderr; fails with the command line if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

/// Runs a command and returns its stdout; fails with its stderr if it fails.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

/// Fails unless running as root.
pub fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} needs root (network namespaces, eBPF): run it with sudo or as root");
    }
    Ok(())
}

/// Mounts bpffs at /sys/fs/bpf if nothing is mounted there (a fresh machine, a container, a
/// new mount namespace), before anything that pins runs; says so when it mounts.
pub fn ensure_bpffs() -> Result<()> {
    if calix_kernel::bpffs::ensure_mounted()? {
        println!(
            "      mounted bpffs at {}",
            calix_kernel::bpffs::MOUNT_POINT
        );
    }
    Ok(())
}

/// The cargo that runs xtask, in the workspace root, without the variables `cargo run` set
/// for xtask itself (`CARGO_MANIFEST_DIR`, `CARGO_MANIFEST_PATH`, `CARGO_PKG_*`): build scripts
/// that watch one of them (ring's watches `CARGO_MANIFEST_DIR`) would otherwise re-run, and
/// everything above them rebuild, at every switch between a build from xtask and one from a
/// shell.
pub fn cargo() -> Command {
    let mut cmd = Command::new(env!("CARGO"));
    for (key, _) in std::env::vars_os() {
        let k = key.to_string_lossy();
        if k.starts_with("CARGO_MANIFEST_") || k.starts_with("CARGO_PKG_") {
            cmd.env_remove(&key);
        }
    }
    cmd.current_dir(workspace_root());
    cmd
}

/// Builds every binary of the workspace (debug profile) and returns target/debug.
pub fn build_bins() -> Result<PathBuf> {
    run(cargo().args(["build", "--workspace", "--bins"]))?;
    Ok(workspace_root().join("target").join("debug"))
}

/// Builds every binary of the workspace with the release profile and returns target/release
/// (benchmarks measure release binaries).
pub fn build_bins_release() -> Result<PathBuf> {
    run(cargo().args(["build", "--release", "--workspace", "--bins"]))?;
    Ok(workspace_root().join("target").join("release"))
}
