//! What a demo or bench run names `<prefix>-<pid>[-…]` (network namespaces, bpffs pin roots,
//! directories in `$TMPDIR`, cgroups on the v2 hierarchy, and the processes whose command line
//! mentions them): the leftovers of runs that died without cleaning up are removed at the next
//! run's start, and a run lists what it left to prove it left nothing.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;

use crate::util::output;

/// The pid in `name` when it is `<prefix>-<pid>` or `<prefix>-<pid>-…` and that process is
/// gone: a leftover of a run that died without cleaning up.
pub fn stale_pid(name: &str, prefix: &str) -> Option<u32> {
    let pid = name
        .strip_prefix(prefix)?
        .strip_prefix('-')?
        .split('-')
        .next()?
        .parse::<u32>()
        .ok()?;
    (!Path::new(&format!("/proc/{pid}")).exists()).then_some(pid)
}

/// The network namespaces named `<prefix>-…`.
fn namespaces() -> Result<Vec<String>> {
    Ok(output(Command::new("ip").args(["netns", "list"]))?
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect())
}

/// Where runs keep pin roots, directories and cgroups (the services bench's, on the v2
/// hierarchy).
fn roots() -> [PathBuf; 3] {
    [
        PathBuf::from("/sys/fs/bpf"),
        std::env::temp_dir(),
        PathBuf::from("/sys/fs/cgroup/unified"),
    ]
}

/// Removes the namespaces, pin roots and directories that runs named `<prefix>-<pid>…` left
/// when they died without cleaning up (their pid is gone).
pub fn remove_stale(prefix: &str) -> Result<()> {
    for name in namespaces()? {
        if stale_pid(&name, prefix).is_some() {
            println!("      removing stale namespace {name}");
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
    }
    for root in roots() {
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            if stale_pid(&e.file_name().to_string_lossy(), prefix).is_some() {
                println!("      removing stale {}", e.path().display());
                // A cgroup's files cannot be removed, only the empty directory.
                let _ =
                    std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_dir(e.path()));
            }
        }
    }
    Ok(())
}

/// Whether `name` is `run` or starts with `run-`: one run's (`calix-demo-12` is not
/// `calix-demo-123`'s).
fn of_run(name: &str, run: &str) -> bool {
    name.strip_prefix(run)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
}

/// Everything of run `run` (`<prefix>-<pid>`) still there: namespaces, pin roots, directories,
/// and processes with a `run-…` name or path on their command line (an agent's node name,
/// etcd's data directory).
pub fn left_behind(run: &str) -> Result<Vec<String>> {
    let mut left: Vec<String> = namespaces()?
        .into_iter()
        .filter(|n| of_run(n, run))
        .map(|n| format!("network namespace {n}"))
        .collect();
    for root in roots() {
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            if of_run(&e.file_name().to_string_lossy(), run) {
                left.push(e.path().display().to_string());
            }
        }
    }
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue; // gone meanwhile, or not a process
        };
        let mentions = cmdline
            .split(|b| *b == 0)
            .map(String::from_utf8_lossy)
            .any(|arg| arg.split('/').any(|part| of_run(part, run)));
        if mentions {
            let argv = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            left.push(format!(
                "process {} ({})",
                e.file_name().to_string_lossy(),
                argv.trim()
            ));
        }
    }
    Ok(left)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    use super::*;

    #[test]
    fn stale_names_need_a_dead_pid() {
        let me = std::process::id();
        assert_eq!(stale_pid(&format!("cxb-{me}-ebpf"), "cxb"), None);
        assert_eq!(stale_pid(&format!("cxb-{me}"), "cxb"), None);
        assert_eq!(stale_pid("cxb-ipam-123", "cxb"), None);
        assert_eq!(stale_pid("cxbother", "cxb"), None);
        assert_eq!(stale_pid("calix-demo", "calix-demo"), None);
        // pid_max is at most 2^22: this pid cannot exist.
        assert_eq!(stale_pid("cxb-4294967295-kern-a", "cxb"), Some(4294967295));
        assert_eq!(stale_pid("cxb-4294967295", "cxb"), Some(4294967295));
        assert_eq!(
            stale_pid("calix-demo-4294967295-node0", "calix-demo"),
            Some(4294967295)
        );
    }

    #[test]
    fn a_run_owns_its_names_only() {
        assert!(of_run("calix-demo-12", "calix-demo-12"));
        assert!(of_run("calix-demo-12-node0", "calix-demo-12"));
        assert!(!of_run("calix-demo-123-node0", "calix-demo-12"));
        assert!(!of_run("calix-demo", "calix-demo-12"));
    }

    #[test]
    fn a_live_process_naming_the_run_is_found() {
        let run = format!("cxl-{}-{}", std::process::id(), line!());
        // A sleep whose argv[0] is a path of the run (as etcd's data directory is etcd's).
        let mut child = Command::new("sleep")
            .arg0(format!("/tmp/{run}-x/data"))
            .arg("30")
            .spawn()
            .expect("sleep");
        // spawn returns once the child has exec'd, but the kernel sets the new argv's bounds
        // a moment later (after the parent wakes), so /proc/<pid>/cmdline can still be empty:
        // look until the child is listed, for at most 5 s.
        let pid = child.id().to_string();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let left = loop {
            let left = left_behind(&run).expect("left_behind");
            if left.iter().any(|l| l.contains(&pid)) || std::time::Instant::now() > deadline {
                break left;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        let _ = child.kill();
        let _ = child.wait();
        assert!(left.iter().any(|l| l.contains(&pid)), "{left:?}");
        assert!(left_behind(&run).expect("left_behind").is_empty());
    }
}
