//! Checks for what the eBPF build needs, so a missing piece is named instead of surfacing as a
//! cryptic cargo error: the nightly toolchain, its `rust-src`, and bpf-linker.

use std::{
    env,
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

use crate::{BuildError, TOOLCHAIN};

/// What the nested build runs with.
pub(crate) struct Tools {
    /// The rustup proxy `cargo` (it understands `+nightly`).
    pub cargo: PathBuf,
    /// `PATH` for the nested cargo: the caller's, plus the directory holding bpf-linker.
    pub path: OsString,
}

pub(crate) fn check() -> Result<Tools, BuildError> {
    let cargo_bin = cargo_bin_dir();
    let proxy = |name: &str| {
        let in_cargo_bin = cargo_bin.join(name);
        if in_cargo_bin.is_file() {
            in_cargo_bin
        } else {
            PathBuf::from(name)
        }
    };

    let sysroot = nightly_sysroot(&proxy("rustc"))?;
    let core = sysroot.join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if !core.is_file() {
        return Err(BuildError::RustSrcMissing { path: core });
    }

    let mut dirs: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    let linker_dir = dirs
        .iter()
        .chain(std::iter::once(&cargo_bin))
        .find(|dir| dir.join("bpf-linker").is_file())
        .cloned()
        .ok_or_else(|| BuildError::BpfLinkerMissing {
            cargo_bin: cargo_bin.clone(),
        })?;
    if !dirs.contains(&linker_dir) {
        dirs.insert(0, linker_dir);
    }
    let path = env::join_paths(&dirs).unwrap_or_else(|_| env::var_os("PATH").unwrap_or_default());

    Ok(Tools {
        cargo: proxy("cargo"),
        path,
    })
}

/// `$CARGO_HOME/bin`, where rustup's proxies and `cargo install`ed tools live.
pub fn cargo_bin_dir() -> PathBuf {
    let home = env::var_os("CARGO_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from(".cargo"));
    home.join("bin")
}

/// The nightly toolchain's sysroot, which also proves the toolchain is installed.
fn nightly_sysroot(rustc: &Path) -> Result<PathBuf, BuildError> {
    let mut cmd = Command::new(rustc);
    cmd.arg(format!("+{TOOLCHAIN}"))
        .args(["--print", "sysroot"]);
    crate::env::clean(&mut cmd);
    let command = crate::describe(&cmd);
    let missing = |detail: String| BuildError::NightlyMissing {
        command: command.clone(),
        detail,
    };
    let out = cmd.output().map_err(|e| missing(e.to_string()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let detail = stderr
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .unwrap_or("no output");
        return Err(missing(format!("{}: {detail}", out.status)));
    }
    let sysroot = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if sysroot.is_empty() {
        return Err(missing("printed no sysroot".into()));
    }
    Ok(PathBuf::from(sysroot))
}
