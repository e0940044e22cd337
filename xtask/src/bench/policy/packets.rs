//! The policy bench's packet-by-packet part: `dataplane/benches/policy_packets.rs`, built and
//! run by cargo (the program tests' harness: BPF_PROG_TEST_RUN on the programs as built), its
//! markdown section taken from its stdout, its progress passed through.
use anyhow::{bail, Context, Result};

use crate::util;

/// The section, from `reps` repetitions of `conns` connections per variant.
pub(super) fn run(reps: usize, conns: u32) -> Result<String> {
    println!("[packets] building and running dataplane/benches/policy_packets.rs");
    let out = util::cargo()
        .args([
            "bench",
            "-q",
            "-p",
            "calix-dataplane",
            "--bench",
            "policy_packets",
            "--",
            "--reps",
            &reps.to_string(),
            "--conns",
            &conns.to_string(),
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo bench --bench policy_packets")?;
    if !out.status.success() {
        bail!("policy_packets failed: {}", out.status);
    }
    let md = String::from_utf8(out.stdout).context("policy_packets' output")?;
    match md.find("## ") {
        Some(at) => Ok(md[at..].trim_end().to_string() + "\n\n"),
        None => bail!("policy_packets printed no section"),
    }
}
