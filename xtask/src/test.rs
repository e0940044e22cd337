//! `cargo xtask test`: setup, build, every test (unit and root integration), then a check that
//! nothing was left behind (namespaces, links, bpffs pins).
use std::process::Command;

use anyhow::{bail, Result};

use crate::util::{self, output};

pub fn run_tests(extra: &[String]) -> Result<()> {
    util::require_root("the test suite")?;
    // First, as it takes seconds and builds nothing: the layers and structure of the crates.
    println!("[1/5] layers (cargo xtask layers)");
    crate::layers::run(false)?;
    println!("[2/5] prerequisites");
    crate::setup::run()?;
    util::ensure_bpffs()?;
    println!("[3/5] building every binary, and the upgrade-test build of the eBPF programs");
    util::build_bins()?;
    calix_ebpf_build::build_ebpf_feature(&calix_ebpf_build::ebpf_target_dir(), "upgrade-test")
        .map_err(|e| anyhow::anyhow!("building the upgrade-test eBPF object: {e}"))?;
    println!("[4/5] cargo test --workspace (eBPF dataplane), then the dataplane-agnostic suites again in kernel mode");
    let root = util::workspace_root();
    let result = cargo_test(&root, &["--workspace".to_string()], extra, None).and_then(|()| {
        cargo_test(
            &root,
            &["-p", "calix-tests", "--test", "cni_verbs"].map(String::from),
            extra,
            Some(("CALIX_TEST_DATAPLANE", "kernel")),
        )
    });
    println!("[5/5] checking that the tests left nothing behind");
    let leaks = leftovers()?;
    result?;
    if !leaks.is_empty() {
        bail!("tests left things behind:\n  {}", leaks.join("\n  "));
    }
    println!("nothing left behind");
    Ok(())
}

/// Runs `cargo test <which> <extra>` (with `env` set), streaming its output, and ends with one
/// summary line (`tests: N passed, N failed`) added up over every test binary.
fn cargo_test(
    root: &std::path::Path,
    which: &[String],
    extra: &[String],
    env: Option<(&str, &str)>,
) -> Result<()> {
    use std::io::{BufRead, BufReader};
    let mut cmd = util::cargo();
    // Every test binary runs even when one fails: a run shows all its failures.
    cmd.current_dir(root)
        .args(["test", "--no-fail-fast"])
        .args(which)
        .args(extra);
    if let Some((k, v)) = env {
        cmd.env(k, v);
        println!("--- again with {k}={v} ---");
    }
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn()?;
    let (mut passed, mut failed) = (0u64, 0u64);
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                let count = |word: &str| {
                    rest.split(';')
                        .find_map(|part| {
                            part.trim()
                                .strip_suffix(word)?
                                .trim()
                                .rsplit(' ')
                                .next()?
                                .parse::<u64>()
                                .ok()
                        })
                        .unwrap_or(0)
                };
                passed += count("passed");
                failed += count("failed");
            }
        }
    }
    let status = child.wait()?;
    println!("tests: {passed} passed, {failed} failed");
    if !status.success() {
        bail!("cargo test failed ({status})");
    }
    Ok(())
}

/// The names of calix's programs.
fn calix_common_programs() -> [&'static str; 5] {
    [
        "from_pod",
        "to_pod",
        "from_host_dev",
        "to_host_dev",
        "xdp_host_dev",
    ]
}

/// What a test run may have leaked: its namespaces, `cali*` links and calix's nftables tables in
/// this namespace, pins.
pub fn leftovers() -> Result<Vec<String>> {
    let mut leaks = Vec::new();
    for line in output(Command::new("ip").args(["netns", "list"]))?.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if name.starts_with("cxt") || name.starts_with("calix-demo") {
            leaks.push(format!("network namespace {name}"));
        }
    }
    for line in output(Command::new("ip").args(["-o", "link", "show"]))?.lines() {
        if let Some(name) = line.split(':').nth(1).map(str::trim) {
            if name.starts_with("cali") || name.starts_with("cxt") {
                leaks.push(format!("link {name}"));
            }
        }
    }
    // calix's nftables tables in this namespace (the tests' agents run in their own, but for
    // the runtimes' agent, which runs here and uninstalls when dropped).
    if let Ok(json) = output(Command::new("nft").args(["-j", "list", "tables"])) {
        let v: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
        for t in v["nftables"].as_array().into_iter().flatten() {
            let name = t["table"]["name"].as_str().unwrap_or_default();
            if name.starts_with("calix") {
                leaks.push(format!(
                    "nftables table {} {name}",
                    t["table"]["family"].as_str().unwrap_or("?")
                ));
            }
        }
    }
    if std::path::Path::new("/sys/fs/bpf/calix").exists() {
        leaks.push("bpffs pins under /sys/fs/bpf/calix".into());
    }
    // Programs still loaded (held by a filter, a pin or a process that outlived its test).
    if let Ok(json) = output(Command::new("bpftool").args(["-j", "prog", "show"])) {
        let progs: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
        for p in progs.as_array().into_iter().flatten() {
            let name = p["name"].as_str().unwrap_or_default();
            if calix_common_programs().contains(&name) {
                leaks.push(format!("BPF program {name} (id {})", p["id"]));
            }
        }
    }
    // Test nodes pin under /sys/fs/bpf/<node namespace name> (cxt...), the demos' under
    // calix-demo (one node) and calix-demo-<pid>-node<i> (--nodes 3).
    if let Ok(rd) = std::fs::read_dir("/sys/fs/bpf") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("cxt") || name.starts_with("cxb") || name.starts_with("calix-demo")
            {
                leaks.push(format!("bpffs pins under /sys/fs/bpf/{name}"));
            }
        }
    }
    Ok(leaks)
}
