//! Child processes: commands run for their output, daemons started inside a network namespace
//! (pinned to a CPU, dying with their parent), waiting for a daemon to answer, stopping it.
use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{Error, Result};

/// Runs a command and returns its output; panics if it cannot be started.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs a command and panics unless it succeeds.
pub fn run_ok(cmd: &mut Command) -> Output {
    checked(cmd).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs a command; its output, or an error unless it succeeded.
pub fn checked(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().map_err(|source| Error::Spawn {
        cmd: format!("{cmd:?}"),
        source,
    })?;
    if !out.status.success() {
        return Err(Error::Failed {
            cmd: format!("{cmd:?}"),
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out)
}

/// Runs a command and returns its stdout; an error unless it succeeded.
pub fn stdout(cmd: &mut Command) -> Result<String> {
    Ok(String::from_utf8_lossy(&checked(cmd)?.stdout).into_owned())
}

/// Runs a command (stdin closed) and parses its stdout as JSON.
pub fn json(cmd: &mut Command) -> Result<Value> {
    let text = stdout(cmd.stdin(Stdio::null()))?;
    serde_json::from_str(&text).map_err(|_| Error::NotJson {
        what: format!("{cmd:?}"),
        text,
    })
}

/// The number at `path` in a JSON value.
pub fn num(v: &Value, path: &[&str]) -> Result<f64> {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .ok_or_else(|| Error::Missing {
            field: path.join("."),
            value: v.to_string(),
        })
}

/// `program` as a command that runs in the network namespace at `netns` (by `setns` in the
/// child, keeping the caller's mount namespace: unlike `ip netns exec`, which remounts /sys, so
/// that a daemon pins into the host's bpffs and a plugin call costs no extra mount), with `cpu`
/// its only CPU, and with `die_with_parent` killed when the thread that started it exits.
pub fn command_in(
    netns: Option<&Path>,
    program: impl AsRef<OsStr>,
    cpu: Option<usize>,
    die_with_parent: bool,
) -> Result<Command> {
    let ns = netns
        .map(|p| std::fs::File::open(p).map_err(Error::io(format!("open {}", p.display()))))
        .transpose()?;
    // Built before the fork: nothing allocates in the child.
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut cpus: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if let Some(c) = cpu {
        // SAFETY: CPU_SET writes one bit of the set (it ignores out-of-range CPUs).
        unsafe { libc::CPU_SET(c, &mut cpus) };
    }
    let mut cmd = Command::new(program);
    // SAFETY: setns, sched_setaffinity and prctl are async-signal-safe and touch no memory of
    // the parent; the namespace fd stays open (moved into the closure) until exec.
    unsafe {
        cmd.pre_exec(move || {
            let failed = ns
                .as_ref()
                .is_some_and(|f| libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0)
                || (cpu.is_some()
                    && libc::sched_setaffinity(0, std::mem::size_of_val(&cpus), &cpus) != 0)
                || (die_with_parent && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0);
            if failed {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// A log file for a child's stdout and stderr.
pub fn log_to(path: &Path) -> Result<(Stdio, Stdio)> {
    let f = std::fs::File::create(path).map_err(Error::io(format!("create {}", path.display())))?;
    let g = f
        .try_clone()
        .map_err(Error::io(format!("dup {}", path.display())))?;
    Ok((g.into(), f.into()))
}

/// Spawns `cmd` (stdin closed, output to `log`).
pub fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child> {
    let (out, err) = log_to(log)?;
    cmd.stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|source| Error::Spawn {
            cmd: format!("{cmd:?}"),
            source,
        })
}

/// Polls `ready` every 50 ms until it holds; fails with `log`'s content when `child` exits
/// first or `timeout` passes.
pub fn wait_ready(
    what: &str,
    child: &mut Child,
    log: &Path,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return Ok(());
        }
        let exited = child.try_wait().ok().flatten();
        if exited.is_some() || Instant::now() > deadline {
            return Err(Error::NotReady {
                what: what.to_string(),
                exited,
                log: std::fs::read_to_string(log).unwrap_or_default(),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops a child: SIGTERM (so an agent removes its socket), up to `grace`, then SIGKILL;
/// reaped either way.
pub fn terminate(child: &mut Child, grace: Duration) {
    // SAFETY: plain kill(2) on our own, not yet reaped, child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A child process killed and reaped on drop (a server a test or bench started).
pub struct Guarded(pub Child);

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Panics unless running as root, with a clear message.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the calix integration tests need root (network namespaces, eBPF)"
    );
}

/// target/<profile> of the running binary: a test binary lives in target/<profile>/deps, a
/// workspace binary (xtask) in target/<profile> itself.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .expect("the running binary lives in a directory");
    match dir.file_name() {
        Some(name) if name == "deps" => dir.parent().unwrap_or(dir).to_path_buf(),
        _ => dir.to_path_buf(),
    }
}

/// Path of a workspace binary built next to this test (target/<profile>/<name>).
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (`cargo build --workspace --bins`, or `cargo xtask test`)",
        p.display()
    );
    p
}

/// The upgrade-test build of the eBPF programs (`cargo xtask test` builds it):
/// `target/ebpf/calix-upgrade-test.bpf.o`.
pub fn upgrade_test_object() -> PathBuf {
    let target = bin_dir()
        .parent()
        .expect("target/<profile> has a parent")
        .to_path_buf();
    let p = target.join("ebpf").join("calix-upgrade-test.bpf.o");
    assert!(
        p.exists(),
        "{} is missing: `cargo xtask test` builds it (the eBPF programs with --features upgrade-test)",
        p.display()
    );
    p
}
