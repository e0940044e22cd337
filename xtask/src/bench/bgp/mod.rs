//! `cargo xtask bench bgp`: calix's BGP speaker against BIRD 2 (issue 23's acceptance), in
//! one run:
//! - [`prefixes`]: 10,000 prefixes to a receiving BIRD, from calix's speaker and from another
//!   BIRD, interleaved: until the receiver holds them all, and until a withdrawal is seen;
//! - [`idle`]: the agent's CPU and memory with 4 BGP peers, against the same agent with BGP
//!   off, side by side in one cluster;
//! - [`reach`]: a pod's ADD that needs a new block, until the block is reachable from outside
//!   the cluster through the router.
//!
//! BIRD runs from Debian's bird2 (`cargo xtask setup`); its control socket is spoken to
//! directly ([`bird`]). Everything is named `cxb-<pid>-…` and removed on drop, on error and
//! Ctrl-C too. Writes docs/bench/bgp.md and .svg (with `--quick`, target/bench/ instead).
mod bird;
mod idle;
mod prefixes;
mod reach;
mod report;

use anyhow::Result;

use super::harness::Bench;

/// Issue 23's targets.
const PREFIXES_RATIO: f64 = 1.0;
const REACH_P99_MS: f64 = 100.0;

/// How much of each part to run.
pub struct Args {
    /// Repetitions of the 10,000 prefixes (each sender once per repetition).
    pub prefix_reps: usize,
    /// Clusters of the CPU and memory part, and seconds each is idle.
    pub idle_reps: usize,
    pub idle_secs: u64,
    /// Pods of the new-block part.
    pub pods: usize,
    pub quick: bool,
}

pub fn run(a: Args) -> Result<()> {
    anyhow::ensure!(
        a.prefix_reps >= 1 && a.idle_reps >= 1 && a.idle_secs >= 1 && (1..=1000).contains(&a.pods),
        "--prefix-reps, --idle-reps and --idle-secs must be at least 1, --pods 1–1000"
    );
    let b = Bench::setup("the BGP benchmark", &["ip", "etcd", "bird"], &[])?;
    let bird_version = bird_version();
    let prefixes = prefixes::run(&b, a.prefix_reps)?;
    let idle = idle::run(&b, a.idle_reps, a.idle_secs)?;
    let reach = reach::run(&b, a.pods)?;
    b.done();
    let r = report::Report {
        args: a,
        bird_version,
        prefixes,
        idle,
        reach,
        bench: b,
    };
    Bench::publish("bgp", &r.markdown(), r.args.quick, |p| r.chart(p))
}

/// `BIRD version 2.0.12` (what `bird --version` prints, on stderr).
fn bird_version() -> String {
    std::process::Command::new("bird")
        .arg("--version")
        .output()
        .ok()
        .map(|o| {
            let s = String::from_utf8_lossy(&o.stderr).to_string()
                + &String::from_utf8_lossy(&o.stdout);
            s.lines().next().unwrap_or("BIRD").trim().to_string()
        })
        .unwrap_or_else(|| "BIRD".into())
}

#[cfg(test)]
mod tests {
    /// Every BIRD configuration the bench writes parses (`bird -p`), where BIRD is installed.
    #[test]
    fn bird_reads_the_configurations() {
        if std::process::Command::new("bird")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("bird is not installed: not checked");
            return;
        }
        let dir = std::env::temp_dir().join(format!("cxb-test-bird-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let confs = [
            ("receiver", super::prefixes::receiver_conf()),
            ("sender", super::prefixes::sender_conf()),
            ("idle", super::idle::bird_conf("172.31.1.1")),
            ("reach", super::reach::bird_conf("172.31.1.1")),
        ];
        for (name, conf) in confs {
            let path = dir.join(format!("{name}.conf"));
            std::fs::write(&path, conf).expect("written");
            let out = std::process::Command::new("bird")
                .arg("-p")
                .arg("-c")
                .arg(&path)
                .output()
                .expect("bird -p");
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
