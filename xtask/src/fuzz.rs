//! `cargo xtask fuzz [--seconds N]`: runs every cargo-fuzz target (fuzz/) for N seconds each
//! and fails on any crash. Installs cargo-fuzz when it is missing. The targets:
//! - `cni_input`: the CNI plugin's input parsing (CNI env, CNI_ARGS, stdin config, version,
//!   veth name, result rendering);
//! - `route_stream`: the decoder of a peer's route stream (calix-core's `wire::Assembler`,
//!   from protobuf bytes on), within its bounds;
//! - `bgp_message`: the BGP speaker (calix-bgp) fed a peer's byte stream: framing, decoding,
//!   the session and the peer's routes within its prefix limit.
//!
//! Each target's corpus grows in fuzz/corpus/<target> (not committed); the committed seeds are
//! in fuzz/seeds/<target> and its dictionary, if it has one, in fuzz/<target>.dict. A crash
//! leaves its input in fuzz/artifacts/<target>/; reproduce it with
//! `cargo +nightly fuzz run <target> <file>`.
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

/// Every target, in the order they run.
const TARGETS: [&str; 3] = ["cni_input", "route_stream", "bgp_message"];

/// `cargo +nightly ...` through the rustup proxy, without the toolchain pin of the `cargo`
/// that runs xtask.
fn nightly_cargo() -> Command {
    let mut c = Command::new("cargo");
    c.env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .arg("+nightly");
    c
}

fn has_cargo_fuzz() -> bool {
    nightly_cargo()
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn artifacts(dir: &Path) -> BTreeSet<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default()
}

pub fn run_fuzz(seconds: u64) -> Result<()> {
    let root = util::workspace_root();
    let fuzz = root.join("fuzz");
    println!("[1/3] cargo-fuzz and the nightly toolchain");
    if !nightly_cargo()
        .args(["--version"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        bail!("the nightly toolchain is missing: run `cargo xtask setup` first");
    }
    if has_cargo_fuzz() {
        println!("      cargo-fuzz … ok");
    } else {
        println!("      cargo-fuzz … missing; cargo install cargo-fuzz --locked");
        run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))?;
        if !has_cargo_fuzz() {
            bail!("cargo-fuzz is still not runnable after installing it");
        }
    }

    println!("[2/3] building the fuzz targets {TARGETS:?} (nightly, AddressSanitizer)");
    run(nightly_cargo().current_dir(&root).args(["fuzz", "build"]))?;

    for target in TARGETS {
        println!("[3/3] fuzzing {target} for {seconds}s");
        fuzz_one(&root, &fuzz, target, seconds)?;
    }
    Ok(())
}

/// Runs `target` for `seconds`; fails on a crash.
fn fuzz_one(root: &Path, fuzz: &Path, target: &str, seconds: u64) -> Result<()> {
    let corpus = fuzz.join("corpus").join(target);
    std::fs::create_dir_all(&corpus).with_context(|| format!("creating {}", corpus.display()))?;
    let seeds = fuzz.join("seeds").join(target);
    let artifact_dir = fuzz.join("artifacts").join(target);
    let before = artifacts(&artifact_dir);
    let dict = fuzz.join(format!("{target}.dict"));
    let mut cmd = nightly_cargo();
    cmd.current_dir(root)
        .args(["fuzz", "run", target])
        .arg(&corpus);
    if seeds.is_dir() {
        // libFuzzer writes new inputs to the first corpus directory only: the seeds stay.
        cmd.arg(&seeds);
    }
    cmd.arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg("-timeout=30")
        .arg("-print_final_stats=1");
    if dict.is_file() {
        cmd.arg(format!("-dict={}", dict.display()));
    }
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run cargo fuzz")?;
    // libFuzzer reports on stderr; its NEW/REDUCE/NEW_FUNC lines and the recommended
    // dictionary are counted, not echoed.
    let mut quiet = 0u64;
    let mut last_status = String::new();
    let mut in_dict = false;
    if let Some(err) = child.stderr.take() {
        for line in BufReader::new(err).lines() {
            let line = line?;
            let mut words = line.split_whitespace();
            let first = words.next().unwrap_or_default();
            let second = words.next().unwrap_or_default();
            let progress = first.starts_with('#') && line.contains(" cov: ");
            if progress {
                last_status.clone_from(&line);
            }
            if line.starts_with("###### Recommended dictionary") {
                in_dict = true;
            }
            let hide = in_dict
                || first == "NEW_FUNC"
                || first.starts_with("NEW_FUNC[")
                || (progress && matches!(second, "NEW" | "REDUCE"));
            if line.starts_with("###### End of recommended dictionary") {
                in_dict = false;
            }
            if hide {
                quiet += 1;
            } else {
                eprintln!("{line}");
            }
        }
    }
    let status = child.wait()?;
    let crashes: Vec<PathBuf> = artifacts(&artifact_dir)
        .difference(&before)
        .cloned()
        .collect();
    println!("({quiet} progress lines not shown; last: {last_status})");
    if !status.success() || !crashes.is_empty() {
        let list: Vec<String> = crashes.iter().map(|p| p.display().to_string()).collect();
        bail!(
            "fuzzing {target} failed ({status}); crash inputs: [{}]. Reproduce with \
             `cargo +nightly fuzz run {target} <input>`",
            list.join(", ")
        );
    }
    println!("fuzz: {target} ran {seconds}s without a crash");
    Ok(())
}
