//! Where a CPU's time goes during a load: `perf record` of the software `cpu-clock` event on
//! one CPU (this machine's virtual CPUs expose no hardware counters), reported by symbol for
//! the given commands only (the bench's own processes and the CPU's softirq thread, not what
//! others run on the same CPU).
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::util::output;

/// Samples per second.
const FREQUENCY: &str = "4999";
/// Symbols below this share (%) are left out.
const PERCENT_LIMIT: &str = "0.1";

/// Runs `load` while sampling CPU `cpu` into `data` (a file, replaced); the symbols that took
/// at least 0.1 % of the samples of `comms` (share in %, `[k]`/`[.]` and name), largest first.
pub fn profile(
    cpu: usize,
    comms: &[&str],
    data: &Path,
    load: impl FnOnce() -> Result<()>,
) -> Result<Vec<(f64, String)>> {
    let rec = Command::new("perf")
        .args(["record", "-q", "-e", "cpu-clock", "-F", FREQUENCY, "-C"])
        .arg(cpu.to_string())
        .arg("-o")
        .arg(data)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting perf record")?;
    // perf needs a moment to open its events before the load starts.
    std::thread::sleep(Duration::from_millis(300));
    let loaded = load();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(rec.id() as libc::pid_t, libc::SIGINT) };
    let out = rec.wait_with_output().context("waiting for perf record")?;
    loaded?;
    // perf finishes its file on SIGINT, then re-raises the signal to exit by it.
    use std::os::unix::process::ExitStatusExt;
    if !out.status.success() && out.status.signal() != Some(libc::SIGINT) {
        bail!(
            "perf record failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = output(
        Command::new("perf")
            .args(["report", "--stdio", "-q", "--no-children", "--sort", "sym"])
            .args([
                "--percent-limit",
                PERCENT_LIMIT,
                "--comms",
                &comms.join(","),
                "-i",
            ])
            .arg(data),
    )?;
    Ok(parse(&text))
}

/// `perf report --stdio -q --sort sym` lines: `  12.34%  [k] name`.
fn parse(text: &str) -> Vec<(f64, String)> {
    text.lines()
        .filter_map(|l| {
            let (share, sym) = l.trim().split_once('%')?;
            Some((share.trim().parse().ok()?, sym.trim().to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lines_give_share_and_symbol() {
        let text = "    12.50%  [k] fib_table_lookup           \n     1.02%  [.] main\n\n";
        assert_eq!(
            parse(text),
            [
                (12.5, "[k] fib_table_lookup".to_string()),
                (1.02, "[.] main".to_string())
            ]
        );
    }
}
