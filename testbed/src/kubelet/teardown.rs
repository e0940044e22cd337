//! A node's end: its daemons stopped and what they left on the host removed (containers and
//! their tasks, sandboxes' namespaces, shims, mounts, cgroups, log links); and what the nodes
//! of this process share on the host, put back when the last one stops.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::KubeNode;
use crate::process::terminate;

/// The machine-wide sysctls the kubelet sets at start (its "kernel tunables":
/// `vm.overcommit_memory=1`, `kernel.panic=10`, `kernel.panic_on_oops=1`...). Their values
/// before the first node of this process started are put back when its last node stops.
const KUBELET_SYSCTLS: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// What the nodes of this process share on the host: the sysctls' values from before the
/// first node, the host directories absent then, and how many nodes run.
struct HostState {
    sysctls: Vec<(String, String)>,
    absent_dirs: Vec<PathBuf>,
    nodes: usize,
}

static HOST: std::sync::Mutex<HostState> = std::sync::Mutex::new(HostState {
    sysctls: Vec::new(),
    absent_dirs: Vec::new(),
    nodes: 0,
});

/// Counts a node in; the first one records [`KUBELET_SYSCTLS`] and the host directories the
/// daemons will create.
pub(super) fn host_hold() {
    let mut g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    if g.nodes == 0 {
        g.absent_dirs = absent_host_dirs();
        g.sysctls = KUBELET_SYSCTLS
            .iter()
            .filter_map(|k| {
                let v = std::fs::read_to_string(format!("/proc/sys/{k}")).ok()?;
                Some((k.to_string(), v.trim().to_string()))
            })
            .collect();
    }
    g.nodes += 1;
}

/// Counts a node out; the last one writes the sysctls back and removes the host directories
/// the daemons created (when empty).
fn host_release() {
    let mut g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    g.nodes = g.nodes.saturating_sub(1);
    if g.nodes == 0 {
        for (k, v) in std::mem::take(&mut g.sysctls) {
            let _ = std::fs::write(format!("/proc/sys/{k}"), v);
        }
        for d in std::mem::take(&mut g.absent_dirs).iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Host directories a node's daemons create outside its own directory (parents first):
/// the kubelet's container log links, containerd's shim socket dir.
const HOST_DIRS: [&str; 3] = [
    "/var/log/containers",
    "/run/containerd",
    "/run/containerd/s",
];

/// The cgroup (in every hierarchy) below which containerd's CRI plugin puts the containers
/// when the kubelet runs without QoS cgroups.
const CRI_CGROUP: &str = "k8s.io";

impl KubeNode {
    /// Stops the node (see the module doc) and returns what is left of it afterwards: shims,
    /// mounts, sandboxes' namespaces, cgroups, host directories (empty when all is gone).
    pub fn stop(mut self) -> Vec<String> {
        self.teardown()
    }

    fn teardown(&mut self) -> Vec<String> {
        if self.torn_down {
            return Vec::new();
        }
        self.torn_down = true;
        drop(self.proxy.take());
        if let Some(mut k) = self.kubelet.take() {
            terminate(&mut k, Duration::from_secs(5));
        }
        // What the kubelet left: kill the tasks, delete the containers, their sandboxes'
        // namespaces and cgroups.
        let mut netns = Vec::new();
        let mut cgroups = Vec::new();
        for id in self.containers() {
            netns.extend(self.netns_of(&id));
            cgroups.extend(self.cgroup_of(&id));
            let _ = self
                .ctr(&["tasks", "kill", "-s", "SIGKILL", &id])
                .stdin(std::process::Stdio::null())
                .output();
        }
        std::thread::sleep(Duration::from_millis(300));
        for id in self.containers() {
            let _ = self
                .ctr(&["tasks", "delete", "-f", &id])
                .stdin(std::process::Stdio::null())
                .output();
            let _ = self
                .ctr(&["containers", "delete", &id])
                .stdin(std::process::Stdio::null())
                .output();
        }
        if let Some(mut c) = self.containerd.take() {
            terminate(&mut c, Duration::from_secs(5));
        }
        for pid in self.shim_pids() {
            // SAFETY: kill(2) of a shim of this node's containerd.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for p in netns.iter().filter(|p| Path::new(p).exists()) {
            let _ = Command::new("umount")
                .arg(p)
                .stderr(std::process::Stdio::null())
                .status();
            let _ = std::fs::remove_file(p);
        }
        for m in mounts_under(&self.dir) {
            let _ = Command::new("umount").args(["-l", &m]).status();
        }
        // The containers' cgroups, then the node's own (the kubelet's `cgroupRoot`: its QoS
        // and pod cgroups below it).
        cgroups.push(format!("/{}", self.name));
        for c in &cgroups {
            remove_cgroup(c);
        }
        // The kubelet's links to its containers' logs (it removes them with the containers,
        // which it did not get to).
        for link in self.log_links() {
            let _ = std::fs::remove_file(link);
        }
        host_release();
        let mut left: Vec<String> = self
            .shim_pids()
            .iter()
            .map(|p| format!("shim process {p}"))
            .collect();
        left.extend(
            mounts_under(&self.dir)
                .into_iter()
                .map(|m| format!("mount {m}")),
        );
        left.extend(
            netns
                .iter()
                .filter(|p| Path::new(p).exists())
                .map(|p| format!("sandbox namespace {p}")),
        );
        left.extend(
            cgroups
                .iter()
                .filter(|c| !cgroup_dirs(c).is_empty())
                .map(|c| format!("cgroup {c}")),
        );
        let _ = std::fs::remove_dir_all(&self.dir);
        if self.dir.exists() {
            left.push(format!("directory {}", self.dir.display()));
        }
        left
    }

    /// The cgroup path of container `id`'s spec.
    fn cgroup_of(&self, id: &str) -> Option<String> {
        let out = self
            .ctr(&["containers", "info", id])
            .stdin(std::process::Stdio::null())
            .output()
            .ok()?;
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        info["Spec"]["linux"]["cgroupsPath"]
            .as_str()
            .filter(|p| !p.is_empty())
            .map(String::from)
    }

    /// The kubelet's links in `/var/log/containers` to this node's container logs.
    fn log_links(&self) -> Vec<PathBuf> {
        let Ok(rd) = std::fs::read_dir(HOST_DIRS[0]) else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| std::fs::read_link(p).is_ok_and(|t| t.starts_with(&self.dir)))
            .collect()
    }

    /// Pids of processes whose command line names this node's containerd socket (its shims).
    fn shim_pids(&self) -> Vec<i32> {
        let sock = self.sock.display().to_string();
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&sock))
            })
            .collect()
    }
}

impl Drop for KubeNode {
    fn drop(&mut self) {
        let left = self.teardown();
        if !left.is_empty() {
            eprintln!("kubelet node {}: left behind: {left:?}", self.name);
        }
    }
}

/// [`HOST_DIRS`] and the CRI cgroups that do not exist yet (parents first).
fn absent_host_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = HOST_DIRS.iter().map(PathBuf::from).collect();
    dirs.extend(cgroup_roots().into_iter().map(|r| r.join(CRI_CGROUP)));
    dirs.retain(|d| !d.exists());
    dirs
}

/// The mounted cgroup hierarchies (v2's root, v1's controllers).
fn cgroup_roots() -> Vec<PathBuf> {
    let base = Path::new("/sys/fs/cgroup");
    let mut roots = vec![base.to_path_buf()];
    if let Ok(rd) = std::fs::read_dir(base) {
        roots.extend(
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path()),
        );
    }
    roots
}

/// The mounted cgroup hierarchies themselves (v2's root, each v1 controller's; not the tmpfs
/// they are mounted on in a hybrid layout).
pub(super) fn cgroup_hierarchies() -> Vec<PathBuf> {
    cgroup_roots()
        .into_iter()
        .filter(|r| r.join("cgroup.procs").exists())
        .collect()
}

/// The directories of cgroup `path` in every hierarchy.
fn cgroup_dirs(path: &str) -> Vec<PathBuf> {
    let rel = path.trim_start_matches('/');
    if rel.is_empty() || rel.contains("..") {
        return Vec::new();
    }
    cgroup_roots()
        .into_iter()
        .map(|r| r.join(rel))
        .filter(|p| p.is_dir())
        .collect()
}

/// Mount points at or under `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let prefix = dir.display().to_string();
    let mut v: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| m.replace("\\040", " "))
        .filter(|m| m == &prefix || m.starts_with(&format!("{prefix}/")))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.len()));
    v
}

/// Removes cgroup `path` (and its children) from every hierarchy.
fn remove_cgroup(path: &str) {
    fn rmdir_tree(p: &Path) {
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.filter_map(|e| e.ok()) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    rmdir_tree(&e.path());
                }
            }
        }
        let _ = std::fs::remove_dir(p);
    }
    for p in cgroup_dirs(path) {
        rmdir_tree(&p);
    }
}
