//! What the namespace benches (`dataplane`, `snat`) share: the guard that removes what a run
//! created, stale-run cleanup, running a tool for its JSON, and the kernel's BPF run-time
//! statistics of a program.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::{spread, stale_pid, stop_child};
use crate::util::{output, run as run_cmd};

/// Everything a bench run created; stopped and removed on drop (error, panic, Ctrl-C
/// included).
pub struct Guard {
    pub prefix: String,
    /// The bench's bpffs pin root (removed at the end unless another run still uses it).
    pub pin_root: &'static str,
    pub dir: PathBuf,
    pub namespaces: Vec<String>,
    pub servers: Vec<Child>,
    pub agents: Vec<Child>,
    pub pin_dirs: Vec<PathBuf>,
}

impl Guard {
    pub fn new(prefix: String, pin_root: &'static str, dir: PathBuf) -> Self {
        Self {
            prefix,
            pin_root,
            dir,
            namespaces: Vec::new(),
            servers: Vec::new(),
            agents: Vec::new(),
            pin_dirs: Vec::new(),
        }
    }

    /// Creates namespace `<prefix>-<name>` with its loopback up.
    pub fn netns(&mut self, name: &str) -> Result<String> {
        let full = format!("{}-{name}", self.prefix);
        // Recorded first: a half-created namespace is still removed.
        self.namespaces.push(full.clone());
        run_cmd(Command::new("ip").args(["netns", "add", &full]))?;
        run_cmd(Command::new("ip").args(["-n", &full, "link", "set", "lo", "up"]))?;
        Ok(full)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for c in self.servers.drain(..).chain(self.agents.drain(..)) {
            stop_child(c);
        }
        // Deleting a namespace deletes its links, their XDP and tc programs, its nft tables and
        // iptables rules with them.
        for n in self.namespaces.iter().rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
        }
        for d in &self.pin_dirs {
            let _ = std::fs::remove_dir_all(d);
        }
        // Gone unless another bench run still uses it.
        let _ = std::fs::remove_dir(self.pin_root);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Removes namespaces (`<prefix>-<pid>-…`) and pins under `pin_root` left by earlier runs that
/// died without cleaning up.
pub fn remove_stale(prefix: &str, pin_root: &str) -> Result<()> {
    for line in output(Command::new("ip").args(["netns", "list"]))?.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if stale_pid(name, prefix).is_some() {
            println!("      removing stale namespace {name}");
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
    if let Ok(entries) = std::fs::read_dir(pin_root) {
        for e in entries.flatten() {
            if stale_pid(&e.file_name().to_string_lossy(), prefix).is_some() {
                println!("      removing stale pins {}", e.path().display());
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(())
}

/// Whether process `pid`'s network namespace has a TCP socket listening on `port`.
pub fn listening(pid: u32, port: u16) -> bool {
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{f}"))
            .is_ok_and(|table| listens_on(&table, port))
    })
}

/// Whether a `/proc/net/tcp{,6}` table holds a LISTEN socket (state `0A`) on local `port`.
fn listens_on(table: &str, port: u16) -> bool {
    table.lines().skip(1).any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.len() > 3
            && cols[3] == "0A"
            && cols[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

/// A log file for a child's stdout and stderr.
pub fn log_to(path: &Path) -> Result<(Stdio, Stdio)> {
    let f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    Ok((f.try_clone()?.into(), f.into()))
}

/// Runs `cmd` and parses its stdout as JSON; fails with its stdout and stderr.
pub fn run_json(what: &str, cmd: &mut Command) -> Result<Value> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}\n{}",
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::from_str(&stdout).with_context(|| format!("{what} printed non-JSON: {stdout}"))
}

/// A number of a JSON result; fails when missing.
pub fn num(v: &Value, path: &[&str]) -> Result<f64> {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .with_context(|| format!("no {} in {v}", path.join(".")))
}

/// The median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    spread(v).0
}

/// One decimal; "–" for NaN (no measurement).
pub fn fmt_1(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.1}")
    }
}

/// Two decimals; "–" for NaN.
pub fn fmt_2(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.2}")
    }
}

const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// (run_time_ns, run_cnt) summed over every loaded BPF program named `name`, as the kernel
/// counts them with `bpf_stats_enabled`.
fn prog_stats(name: &str) -> Result<(u64, u64)> {
    let json = output(Command::new("bpftool").args(["-j", "prog", "show", "name", name]))?;
    // One program prints an object, several an array.
    let v: Value = serde_json::from_str(&json).context("bpftool's JSON")?;
    let progs = match v {
        Value::Array(a) => a,
        other => vec![other],
    };
    let field = |p: &Value, k: &str| p[k].as_u64().unwrap_or(0);
    Ok(progs.iter().fold((0, 0), |(t, n), p| {
        (t + field(p, "run_time_ns"), n + field(p, "run_cnt"))
    }))
}

/// Runs `load` with the kernel's BPF run-time statistics on (they cost two clock reads per run,
/// so never during a timed measurement) and returns program `name`'s average run time per run
/// (ns) and how many runs that is over. Only the loaded programs the load reaches should run
/// meanwhile: the statistics of every program of that name are summed.
pub fn program_run_time(name: &str, load: impl FnOnce() -> Result<()>) -> Result<(f64, u64)> {
    let before = std::fs::read_to_string(BPF_STATS_SYSCTL)?;
    std::fs::write(BPF_STATS_SYSCTL, "1")?;
    let measured = (|| {
        let (t0, n0) = prog_stats(name)?;
        load()?;
        let (t1, n1) = prog_stats(name)?;
        Ok::<_, anyhow::Error>((t1.saturating_sub(t0), n1.saturating_sub(n0)))
    })();
    std::fs::write(BPF_STATS_SYSCTL, before.trim())?;
    let (ns, runs) = measured?;
    if runs == 0 {
        bail!("{name} never ran during the load: is its program attached?");
    }
    Ok((ns as f64 / runs as f64, runs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_sockets_are_found_by_port() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0200F40A:1B59 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0200F40A:1451 0100F40A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1
";
        assert!(listens_on(table, 7001));
        // Established, not listening.
        assert!(!listens_on(table, 5201));
        assert!(!listens_on("", 7001));
    }
}
