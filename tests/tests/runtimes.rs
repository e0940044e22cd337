//! Real container runtimes drive calix: two podman containers (Debian's podman 4.3, CNI network
//! backend) and two containerd containers (`ctr run --cni`, containerd 1.6) get their network from
//! the calix plugin, ping each other, and their teardown leaves nothing behind: no `cali*` link, no
//! route to the pool, no endpoint, no allocation, no container, task or namespace. Run as root.
//!
//! Both runtimes create the pod namespaces and exec the plugin from the root network namespace, so
//! the agent runs there ([`RootAgent`], one at a time: the two tests take turns). Everything else
//! is private to the test: podman's storage, run and tmp dirs and its containers.conf, a
//! containerd daemon with its own root, state and socket, the images (a busybox-static rootfs, and
//! an OCI image tarball built from it), the CNI config and plugin dirs. The plugin dir holds a
//! small wrapper that logs every CNI call the runtime makes before it execs the real `calix`.
use calix_testbed::{bin, require_root, run, unique, RootAgent};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Commands with a deadline.

/// Runs `cmd` (stdin closed) and waits at most `secs`. Output goes through files in `dir`, not
/// pipes, so a daemon the command leaves behind (conmon, a containerd shim) cannot hold it open.
fn try_run_in(dir: &Path, cmd: &mut Command, secs: u64) -> Result<Output, String> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let (out_p, err_p) = (
        dir.join(format!("cmd{n}.out")),
        dir.join(format!("cmd{n}.err")),
    );
    let files = std::fs::File::create(&out_p).and_then(|o| Ok((o, std::fs::File::create(&err_p)?)));
    let (out_f, err_f) =
        files.map_err(|e| format!("cannot create output files in {dir:?}: {e}"))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out_f)
        .stderr(err_f)
        .spawn()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(secs);
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                let err = std::fs::read_to_string(&err_p).unwrap_or_default();
                return Err(format!("{cmd:?} did not finish within {secs}s: {err}"));
            }
        }
    };
    let out = Output {
        status,
        stdout: std::fs::read(&out_p).unwrap_or_default(),
        stderr: std::fs::read(&err_p).unwrap_or_default(),
    };
    let _ = std::fs::remove_file(out_p);
    let _ = std::fs::remove_file(err_p);
    Ok(out)
}

fn run_in(dir: &Path, cmd: &mut Command, secs: u64) -> Output {
    try_run_in(dir, cmd, secs).unwrap_or_else(|e| panic!("{e}"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Panics unless every tool is on PATH, pointing at `cargo xtask setup`.
fn require_tools(tools: &[&str]) {
    for t in tools {
        let found = run(Command::new("sh").args(["-c", &format!("command -v {t}")]));
        assert!(
            found.status.success(),
            "`{t}` is not installed: run `cargo xtask setup` (podman, containerd, busybox-static)"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Host state the runtimes touch outside the test's own directory.

/// Host directories a runtime creates on first use (libcni's result cache, runc's state root,
/// containerd's shim socket dir). Those missing when the test starts are removed again at the end if empty.
struct HostDirs(Vec<PathBuf>);

impl HostDirs {
    /// `paths` parents first.
    fn record(paths: &[&str]) -> Self {
        Self(
            paths
                .iter()
                .map(PathBuf::from)
                .filter(|p| !p.exists())
                .collect(),
        )
    }

    fn cleanup(&self) {
        for p in self.0.iter().rev() {
            let _ = std::fs::remove_dir(p);
        }
    }
}

/// libcni (in podman and in ctr) caches each attachment's result here until DEL.
const CNI_CACHE: [&str; 2] = ["/var/lib/cni", "/var/lib/cni/results"];

/// Removes libcni cache entries of network `net` (only left when a DEL never ran).
fn remove_cni_cache(net: &str) {
    if let Ok(rd) = std::fs::read_dir(CNI_CACHE[1]) {
        for e in rd.filter_map(Result::ok) {
            if e.file_name()
                .to_string_lossy()
                .starts_with(&format!("{net}-"))
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Removes cgroup `name` (and its children) from every mounted hierarchy (v1 or v2).
fn remove_cgroup(name: &str) {
    fn rmdir_tree(p: &Path) {
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.filter_map(Result::ok) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    rmdir_tree(&e.path());
                }
            }
        }
        let _ = std::fs::remove_dir(p);
    }
    let base = Path::new("/sys/fs/cgroup");
    let mut roots = vec![base.to_path_buf()];
    if let Ok(rd) = std::fs::read_dir(base) {
        roots.extend(rd.filter_map(Result::ok).map(|e| e.path()));
    }
    for r in roots {
        let p = r.join(name);
        if p.is_dir() {
            rmdir_tree(&p);
        }
    }
}

/// Cgroups called `name` that still exist in some hierarchy.
fn cgroups_left(name: &str) -> Vec<PathBuf> {
    let base = Path::new("/sys/fs/cgroup");
    let mut roots = vec![base.to_path_buf()];
    if let Ok(rd) = std::fs::read_dir(base) {
        roots.extend(rd.filter_map(Result::ok).map(|e| e.path()));
    }
    roots
        .into_iter()
        .map(|r| r.join(name))
        .filter(|p| p.is_dir())
        .collect()
}

/// Mount points at or under `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<String> {
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

fn unmount_under(dir: &Path) {
    for m in mounts_under(dir) {
        let _ = Command::new("umount").args(["-l", &m]).status();
    }
}

// ---------------------------------------------------------------------------------------------
// CNI config and plugin dirs.

/// `<dir>/cni-bin`: Debian's reference plugins (loopback, …) and `calix`, a wrapper that appends
/// each call (verb, container ID, netns, args, stdin, exit code, stdout, stderr) to `log` and
/// execs the real plugin with the same environment and stdin.
fn cni_bin_dir(dir: &Path, log: &Path) -> PathBuf {
    let bin_dir = dir.join("cni-bin");
    std::fs::create_dir_all(&bin_dir).expect("cni bin dir");
    if let Ok(rd) = std::fs::read_dir("/usr/lib/cni") {
        for e in rd.filter_map(Result::ok) {
            let _ = std::os::unix::fs::symlink(e.path(), bin_dir.join(e.file_name()));
        }
    }
    assert!(
        bin_dir.join("loopback").exists(),
        "/usr/lib/cni/loopback is missing: install containernetworking-plugins"
    );
    let wrapper = format!(
        r#"#!/bin/sh
# calix-tests: log the CNI call, then run the real plugin.
log='{log}'
conf=$(cat)
printf '%s cid=%s netns=%s ifname=%s args=%s\n  stdin: %s\n' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_NETNS" "$CNI_IFNAME" "$CNI_ARGS" "$conf" >>"$log"
out=$(printf '%s' "$conf" | '{calix}' 2>>"$log")
rc=$?
printf '  -> %s exit %s: %s\n' "$CNI_COMMAND" "$rc" "$out" >>"$log"
printf '%s\n' "$out"
exit $rc
"#,
        log = log.display(),
        calix = bin("calix").display(),
    );
    let calix = bin_dir.join("calix");
    std::fs::write(&calix, wrapper).expect("write calix wrapper");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&calix, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    bin_dir
}

/// The calix conflist for network `name`, pointing at the test agent.
fn conflist(name: &str, agent: &RootAgent) -> String {
    json!({
        "cniVersion": "1.0.0",
        "name": name,
        "plugins": [{
            "type": "calix",
            "agent_socket": agent.socket.display().to_string(),
            "ipam": { "type": "calix-ipam" },
        }],
    })
    .to_string()
}

/// The CNI calls logged by the wrapper.
fn cni_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("cni-calls.log")).unwrap_or_default()
}

/// The logged outcomes of CNI calls that failed.
fn failed_calls(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.starts_with("  -> ") && !l.contains(" exit 0:"))
        .collect()
}

/// The verbs of the logged CNI calls, in order (`VERSION ADD … DEL`).
fn cni_verbs(log: &str) -> String {
    log.lines()
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split(' ').next())
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------------------------
// Shared checks.

fn assert_in_pool(ip: &str, agent: &RootAgent) {
    // The test pools are /24s: a.b.c.0/24.
    let prefix = agent.pool.rsplit_once('.').map_or("", |(net, _)| net);
    let prefix = format!("{prefix}.");
    assert!(
        ip.starts_with(&prefix),
        "{ip} is not from the pool {}",
        agent.pool
    );
}

/// The root namespace routes `ip` as a /32 to a `cali*` veth with protocol 202; returns the veth.
fn host_route(agent: &RootAgent, ip: &str) -> String {
    let routes = agent.pool_routes();
    let r = routes
        .iter()
        .find(|r| r["dst"] == ip)
        .unwrap_or_else(|| panic!("no host route to {ip}: {routes:?}"));
    let dev = r["dev"].as_str().unwrap_or_default().to_string();
    assert!(
        dev.starts_with("cali"),
        "route to {ip} is not via a cali veth: {r}"
    );
    assert_eq!(r["protocol"], "202", "route to {ip} is not calix's: {r}");
    assert!(
        agent.cali_links().contains(&dev),
        "{dev} is not in the root namespace"
    );
    dev
}

/// Both containers' endpoints are registered with eBPF attached on their veths, and the
/// programs counted the pings (3 echo requests each way, 3 replies).
fn assert_endpoints(agent: &RootAgent, veths: &[&str]) {
    let eps = agent.endpoints();
    let list = eps["endpoints"].as_array().cloned().unwrap_or_default();
    assert_eq!(list.len(), veths.len(), "endpoints: {eps}");
    for v in veths {
        let e = list
            .iter()
            .find(|e| e["hostInterface"] == *v)
            .unwrap_or_else(|| panic!("no endpoint on {v}: {eps}"));
        assert_eq!(e["bpfAttached"], true, "{e}");
        for k in ["fromPodPackets", "toPodPackets"] {
            let n = e["counters"][k].as_u64().unwrap_or(0);
            assert!(n >= 6, "{k} of {v} is {n}, not the 6 pings: {e}");
        }
    }
}

/// Teardown left nothing of calix's: no veth, no route, no endpoint, no allocation.
fn assert_calix_clean(agent: &RootAgent, log: &str) {
    let links = agent.cali_links();
    assert!(
        links.is_empty(),
        "cali links left: {links:?}\nCNI calls:\n{log}"
    );
    let routes = agent.pool_routes();
    assert!(
        routes.is_empty(),
        "routes to {} left: {routes:?}",
        agent.pool
    );
    let eps = agent.endpoints();
    assert_eq!(
        eps["endpoints"].as_array().map(Vec::len),
        Some(0),
        "endpoints left: {eps}\nCNI calls:\n{log}"
    );
    assert_eq!(
        agent.allocated(),
        0,
        "addresses left allocated\nCNI calls:\n{log}"
    );
}

/// `--ulimit` values every host accepts. The runtimes' defaults (nofile and nproc 1048576) can
/// exceed the host's hard limits, and without CAP_SYS_RESOURCE (as in some CI sandboxes) runc
/// then fails the start with "setrlimit: operation not permitted".
fn ulimits() -> [String; 2] {
    let hard = |res| {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we pass.
        unsafe { libc::getrlimit(res, &mut l) };
        l.rlim_max
    };
    [
        format!("nofile={0}:{0}", hard(libc::RLIMIT_NOFILE).min(1024)),
        format!("nproc={0}:{0}", hard(libc::RLIMIT_NPROC).min(4096)),
    ]
}

// ---------------------------------------------------------------------------------------------
// podman

/// A private podman: its own storage (vfs: no overlay mounts), run and tmp dirs, containers.conf
/// (CNI backend, runc, cgroupfs, file events), a CNI config dir with the calix network, and a
/// cgroup parent of its own. Drop removes every container and all of it.
struct Podman {
    dir: PathBuf,
    network: String,
    cgroup: String,
    host_dirs: HostDirs,
}

impl Podman {
    fn new(agent: &RootAgent) -> Self {
        require_tools(&["podman", "conmon", "runc"]);
        let name = unique("pm");
        let dir = std::env::temp_dir().join(&name);
        let pm = Self {
            // runc's state root: rootful podman gives runc no --root of its own.
            host_dirs: HostDirs::record(&[CNI_CACHE[0], CNI_CACHE[1], "/run/runc"]),
            network: format!("{name}-net"),
            cgroup: format!("{name}-cg"),
            dir,
        };
        let net_d = pm.dir.join("net.d");
        std::fs::create_dir_all(&net_d).expect("podman dirs");
        let cni_bin = cni_bin_dir(&pm.dir, &pm.dir.join("cni-calls.log"));
        std::fs::write(
            net_d.join(format!("{}.conflist", pm.network)),
            conflist(&pm.network, agent),
        )
        .expect("write conflist");
        // runc rather than crun: crun refuses hybrid cgroup v1/v2 hosts, runc runs on both.
        let conf = format!(
            r#"[network]
network_backend = "cni"
cni_plugin_dirs = ["{cni_bin}"]
network_config_dir = "{net_d}"
default_network = "{net}"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{dir}/tmp"
volume_path = "{dir}/volumes"
"#,
            cni_bin = cni_bin.display(),
            net_d = net_d.display(),
            net = pm.network,
            dir = pm.dir.display(),
        );
        std::fs::write(pm.dir.join("containers.conf"), conf).expect("containers.conf");
        pm
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("runroot"))
            .args(["--storage-driver", "vfs"])
            .args(args);
        c
    }

    fn run(&self, args: &[&str], secs: u64) -> Output {
        run_in(&self.dir, &mut self.cmd(args), secs)
    }

    fn ok(&self, args: &[&str], secs: u64) -> Output {
        let out = self.run(args, secs);
        assert!(
            out.status.success(),
            "podman {args:?} failed: {}\nCNI calls:\n{}",
            text(&out),
            cni_log(&self.dir)
        );
        out
    }

    /// `podman inspect <name>` of a container.
    fn inspect(&self, name: &str) -> Value {
        let out = self.ok(&["inspect", "--type", "container", name], 30);
        let v: Value = serde_json::from_slice(&out.stdout).expect("podman inspect json");
        v[0].clone()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        // Every container of this private storage, with CNI DEL while the agent still runs.
        let _ = try_run_in(&self.dir, &mut self.cmd(&["rm", "-a", "-f", "-t", "0"]), 60);
        unmount_under(&self.dir);
        remove_cgroup(&self.cgroup);
        remove_cni_cache(&self.network);
        self.host_dirs.cleanup();
        if std::thread::panicking() {
            eprintln!("--- CNI calls (podman) ---\n{}", cni_log(&self.dir));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn podman_containers_reach_each_other() {
    require_root();
    // The agent waits for the other test's agent to stop: time from here.
    let agent = RootAgent::start("pm", "10.251.10.0/24");
    let t0 = Instant::now();
    let pm = Podman::new(&agent);
    let rootfs = calix_testbed::image::busybox_rootfs(&pm.dir)
        .unwrap_or_else(|e| panic!("{e}"))
        .display()
        .to_string();
    let [nofile, nproc] = ulimits();
    let cgroup_parent = format!("/{}", pm.cgroup);
    let names = [unique("pa"), unique("pb")];
    for name in &names {
        pm.ok(
            &[
                "run",
                "-d",
                "--name",
                name,
                "--network",
                &pm.network,
                "--cap-add",
                "NET_RAW",
                "--ulimit",
                &nofile,
                "--ulimit",
                &nproc,
                "--cgroups",
                "no-conmon",
                "--cgroup-parent",
                &cgroup_parent,
                // Options end here: with --rootfs, what follows the rootfs is the command.
                "--rootfs",
                &rootfs,
                "/bin/sleep",
                "300",
            ],
            60,
        );
    }
    let info: Vec<Value> = names.iter().map(|n| pm.inspect(n)).collect();
    let ips: Vec<String> = info
        .iter()
        .map(|i| {
            i["NetworkSettings"]["Networks"][&pm.network]["IPAddress"]
                .as_str()
                .unwrap_or_else(|| panic!("no address on {}: {i}", pm.network))
                .to_string()
        })
        .collect();
    assert_ne!(ips[0], ips[1]);
    let netns: Vec<String> = info
        .iter()
        .map(|i| {
            i["NetworkSettings"]["SandboxKey"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let ids: Vec<String> = info
        .iter()
        .map(|i| i["Id"].as_str().unwrap_or_default().to_string())
        .collect();
    let mut veths = Vec::new();
    for ip in &ips {
        assert_in_pool(ip, &agent);
        veths.push(host_route(&agent, ip));
    }
    // The host veth is named from the container ID (podman passes no pod namespace).
    for (veth, id) in veths.iter().zip(&ids) {
        assert_eq!(veth, &format!("cali{}", &id[..11]));
    }

    for (from, to) in [(0, 1), (1, 0)] {
        let out = pm.run(
            &["exec", &names[from], "ping", "-c", "3", "-W", "2", &ips[to]],
            30,
        );
        assert!(
            out.status.success(),
            "{} cannot ping {}: {}",
            names[from],
            ips[to],
            text(&out)
        );
    }
    assert_endpoints(&agent, &[&veths[0], &veths[1]]);

    let t_down = Instant::now();
    pm.ok(&["rm", "-f", "-t", "0", &names[0], &names[1]], 60);
    let ps = pm.ok(&["ps", "-a", "--format", "json"], 30);
    let ps: Value = serde_json::from_slice(&ps.stdout).unwrap_or(Value::Null);
    assert_eq!(
        ps.as_array().map(Vec::len),
        Some(0),
        "containers left: {ps}"
    );
    for ns in &netns {
        assert!(
            !ns.is_empty() && !Path::new(ns).exists(),
            "netns {ns:?} left"
        );
    }
    let log = cni_log(&pm.dir);
    for id in &ids {
        assert!(
            log.contains(&format!("DEL cid={id} ")),
            "no DEL for {id}:\n{log}"
        );
    }
    let failed = failed_calls(&log);
    assert!(failed.is_empty(), "CNI calls failed: {failed:?}\n{log}");
    assert_calix_clean(&agent, &log);
    eprintln!(
        "podman: {:.1}s in all, teardown {:.1}s; CNI calls: {}",
        t0.elapsed().as_secs_f64(),
        t_down.elapsed().as_secs_f64(),
        cni_verbs(&log)
    );
}

// ---------------------------------------------------------------------------------------------
// containerd

/// The containerd namespace. The daemon is private, so the name need not be unique.
const CTR_NS: &str = "cxt";
const IMAGE: &str = "localhost/cxt-busybox:test";

/// A private containerd 1.6: root, state, sockets, opt dir and runc root under the test dir, the
/// CRI plugin off. `ctr run --cni` (through go-cni) reads the CNI config from /etc/cni/net.d and
/// plugins from /opt/cni/bin, with no flag or variable to change that, so each `ctr run` runs in a
/// private mount namespace where the test's dirs are bind-mounted over /etc/cni/net.d and /opt:
/// the host's dirs are never touched. Drop removes every task and container, stops the daemon
/// and removes all of it.
struct Containerd {
    dir: PathBuf,
    sock: PathBuf,
    network: String,
    cgroup: String,
    daemon: Option<Child>,
    /// `ctr run` processes (not detached: DEL comes from them once the task is gone).
    runs: Vec<(String, Child)>,
    host_dirs: HostDirs,
}

impl Containerd {
    fn start(agent: &RootAgent) -> Self {
        require_tools(&["containerd", "ctr", "runc", "unshare", "mount"]);
        for p in ["/etc/cni/net.d", "/opt"] {
            assert!(
                Path::new(p).is_dir(),
                "{p} must exist: it is the mount point for the test's CNI dirs"
            );
        }
        let name = unique("cd");
        let dir = std::env::temp_dir().join(&name);
        let mut cd = Self {
            host_dirs: HostDirs::record(&[
                CNI_CACHE[0],
                CNI_CACHE[1],
                "/run/containerd",
                "/run/containerd/s",
            ]),
            sock: dir.join("containerd.sock"),
            network: format!("{name}-net"),
            cgroup: format!("{name}-cg"),
            daemon: None,
            runs: Vec::new(),
            dir,
        };
        for d in ["net.d", "opt/cni", "fifo", "runc"] {
            std::fs::create_dir_all(cd.dir.join(d)).expect("containerd dirs");
        }
        let cni_bin = cni_bin_dir(&cd.dir, &cd.dir.join("cni-calls.log"));
        std::fs::rename(cni_bin, cd.dir.join("opt/cni/bin")).expect("opt/cni/bin");
        std::fs::write(
            cd.dir.join("net.d/10-calix.conflist"),
            conflist(&cd.network, agent),
        )
        .expect("write conflist");
        let config = format!(
            r#"version = 2
root = "{dir}/root"
state = "{dir}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{dir}/optdir"
"#,
            dir = cd.dir.display(),
            sock = cd.sock.display(),
        );
        std::fs::write(cd.dir.join("config.toml"), config).expect("config.toml");
        let log = std::fs::File::create(cd.dir.join("containerd.log")).expect("containerd log");
        let child = Command::new("containerd")
            .arg("--config")
            .arg(cd.dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn containerd");
        cd.daemon = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v = try_run_in(&cd.dir, &mut cd.ctr(&["version"]), 10);
            if v.is_ok_and(|o| o.status.success()) {
                return cd;
            }
            if let Some(Ok(Some(st))) = cd.daemon.as_mut().map(Child::try_wait) {
                panic!("containerd exited ({st}) at start:\n{}", cd.daemon_log());
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not come up:\n{}",
                cd.daemon_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    fn ctr(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address")
            .arg(&self.sock)
            .args(["--namespace", CTR_NS])
            .args(args);
        c
    }

    fn ok(&self, args: &[&str], secs: u64) -> Output {
        let out = run_in(&self.dir, &mut self.ctr(args), secs);
        assert!(
            out.status.success(),
            "ctr {args:?} failed: {}\nCNI calls:\n{}",
            text(&out),
            cni_log(&self.dir)
        );
        out
    }

    /// Starts `ctr run --cni --rm <image> <id> sleep 300` in the background, in a private mount
    /// namespace that shows the test's CNI dirs at /etc/cni/net.d and /opt/cni/bin.
    fn run_container(&mut self, id: &str) {
        let log = std::fs::File::create(self.dir.join(format!("run-{id}.log"))).expect("run log");
        let cgroup = format!("/{}/{id}", self.cgroup);
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(r#"mount --bind "$1" /etc/cni/net.d && mount --bind "$2" /opt && shift 2 && exec "$@""#)
            .arg("sh")
            .arg(self.dir.join("net.d"))
            .arg(self.dir.join("opt"))
            .arg("ctr")
            .arg("--address")
            .arg(&self.sock)
            .args(["--namespace", CTR_NS, "run", "--cni", "--rm", "--null-io"])
            .args(["--snapshotter", "native", "--cgroup", &cgroup])
            .arg("--runc-root")
            .arg(self.dir.join("runc"))
            .args([IMAGE, id, "sleep", "300"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("spawn ctr run");
        self.runs.push((id.to_string(), child));
    }

    fn run_log(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("run-{id}.log"))).unwrap_or_default()
    }

    /// Task statuses by container ID (`ctr tasks ls`).
    fn tasks(&self) -> Vec<(String, String)> {
        let out = self.ok(&["tasks", "ls"], 30);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((f.first()?.to_string(), f.get(2)?.to_string()))
            })
            .collect()
    }

    /// Waits until every `ctr run` has its task RUNNING (CNI ADD done, task started).
    fn wait_running(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let tasks = self.tasks();
            let running = |id: &str| tasks.iter().any(|(t, s)| t == id && s == "RUNNING");
            if self.runs.iter().all(|(id, _)| running(id)) {
                return;
            }
            for i in 0..self.runs.len() {
                if let Ok(Some(st)) = self.runs[i].1.try_wait() {
                    let id = self.runs[i].0.clone();
                    panic!(
                        "ctr run {id} exited ({st}): {}\nCNI calls:\n{}",
                        self.run_log(&id),
                        cni_log(&self.dir)
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "tasks not running after 60s: {tasks:?}\nCNI calls:\n{}",
                cni_log(&self.dir)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `argv` in container `id` (`ctr tasks exec`).
    fn exec(&self, id: &str, argv: &[&str], secs: u64) -> Output {
        static EXEC: AtomicU32 = AtomicU32::new(0);
        let exec_id = format!("x{}", EXEC.fetch_add(1, Ordering::Relaxed));
        let fifo = self.dir.join("fifo").display().to_string();
        let mut args = vec![
            "tasks",
            "exec",
            "--fifo-dir",
            &fifo,
            "--exec-id",
            &exec_id,
            id,
        ];
        args.extend_from_slice(argv);
        run_in(&self.dir, &mut self.ctr(&args), secs)
    }

    /// Waits for every `ctr run` process to finish; returns the IDs still running after `secs`.
    fn wait_runs_exit(&mut self, secs: u64) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let alive: Vec<String> = self
                .runs
                .iter_mut()
                .filter_map(|(id, c)| (!matches!(c.try_wait(), Ok(Some(_)))).then(|| id.clone()))
                .collect();
            if alive.is_empty() || Instant::now() >= deadline {
                return alive;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Pids of processes whose command line mentions this daemon's socket (its shims).
    fn shim_pids(&self) -> Vec<i32> {
        let sock = self.sock.display().to_string();
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        rd.filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&sock))
            })
            .collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let quiet = |cd: &Self, args: &[&str]| {
            let _ = try_run_in(&cd.dir, &mut cd.ctr(args), 30);
        };
        // Kill the tasks: each `ctr run` then runs CNI DEL (the agent is still up) and removes
        // its task and container.
        let ids: Vec<String> = self.runs.iter().map(|(id, _)| id.clone()).collect();
        for id in &ids {
            quiet(self, &["tasks", "kill", "--signal", "SIGKILL", id]);
        }
        if !self.wait_runs_exit(30).is_empty() {
            for (_, c) in &mut self.runs {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        for id in &ids {
            quiet(self, &["tasks", "delete", "--force", id]);
            quiet(self, &["containers", "delete", id]);
        }
        if let Some(mut d) = self.daemon.take() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while !matches!(d.try_wait(), Ok(Some(_))) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = d.kill();
            let _ = d.wait();
        }
        for pid in self.shim_pids() {
            // SAFETY: plain kill(2) of a shim of the daemon this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        unmount_under(&self.dir);
        remove_cgroup(&self.cgroup);
        remove_cni_cache(&self.network);
        self.host_dirs.cleanup();
        if std::thread::panicking() {
            eprintln!("--- CNI calls (ctr) ---\n{}", cni_log(&self.dir));
            for id in &ids {
                eprintln!("--- ctr run {id} ---\n{}", self.run_log(id));
            }
            eprintln!("--- containerd log (tail) ---");
            let log = self.daemon_log();
            let lines: Vec<&str> = log.lines().collect();
            for l in &lines[lines.len().saturating_sub(30)..] {
                eprintln!("{l}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The IPv4 address on eth0 inside container `id`.
fn ctr_ip(cd: &Containerd, id: &str) -> String {
    let out = cd.exec(id, &["ip", "-4", "-o", "addr", "show", "eth0"], 30);
    let t = String::from_utf8_lossy(&out.stdout).to_string();
    t.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .map(String::from)
        .unwrap_or_else(|| panic!("no IPv4 address on eth0 in {id}: {}", text(&out)))
}

#[test]
fn containerd_containers_reach_each_other() {
    require_root();
    // The agent waits for the other test's agent to stop: time from here.
    let agent = RootAgent::start("cd", "10.251.11.0/24");
    let t0 = Instant::now();
    let mut cd = Containerd::start(&agent);
    let tar = cd.dir.join("image.tar");
    std::fs::write(
        &tar,
        calix_testbed::image::busybox_oci_tar(IMAGE, &["/bin/sh"])
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .expect("write image tar");
    let tar = tar.display().to_string();
    cd.ok(&["images", "import", "--snapshotter", "native", &tar], 60);

    // ctr passes CNI_CONTAINERID "<namespace>-<id>" and no pod name; the veth is named from its
    // first 11 characters, so the IDs differ early.
    let pid = std::process::id();
    let ids = [format!("a{pid}"), format!("b{pid}")];
    for id in &ids {
        cd.run_container(id);
    }
    cd.wait_running();
    let ips: Vec<String> = ids.iter().map(|id| ctr_ip(&cd, id)).collect();
    assert_ne!(ips[0], ips[1]);
    let mut veths = Vec::new();
    for ip in &ips {
        assert_in_pool(ip, &agent);
        veths.push(host_route(&agent, ip));
    }
    for (from, to) in [(0, 1), (1, 0)] {
        let out = cd.exec(&ids[from], &["ping", "-c", "3", "-W", "2", &ips[to]], 30);
        assert!(
            out.status.success(),
            "{} cannot ping {}: {}",
            ids[from],
            ips[to],
            text(&out)
        );
    }
    assert_endpoints(&agent, &[&veths[0], &veths[1]]);

    // Teardown as ctr does it: the task dies, then `ctr run` DELs (with an empty netns: the
    // namespace died with the task) and removes the task and the container (--rm).
    let t_down = Instant::now();
    for id in &ids {
        cd.ok(&["tasks", "kill", "--signal", "SIGKILL", id], 30);
    }
    let alive = cd.wait_runs_exit(30);
    assert!(alive.is_empty(), "ctr run did not finish: {alive:?}");
    let tasks = cd.tasks();
    assert!(tasks.is_empty(), "tasks left: {tasks:?}");
    let containers = cd.ok(&["containers", "ls", "--quiet"], 30);
    let containers = String::from_utf8_lossy(&containers.stdout)
        .trim()
        .to_string();
    assert!(containers.is_empty(), "containers left: {containers}");
    let log = cni_log(&cd.dir);
    for id in &ids {
        assert!(
            log.contains(&format!("DEL cid={CTR_NS}-{id} netns= ")),
            "no DEL with an empty netns for {id}:\n{log}"
        );
    }
    let failed = failed_calls(&log);
    assert!(failed.is_empty(), "CNI calls failed: {failed:?}\n{log}");
    assert_calix_clean(&agent, &log);
    let cgroups = cgroups_left(&format!("{}/{}", cd.cgroup, ids[0]));
    assert!(cgroups.is_empty(), "task cgroups left: {cgroups:?}");
    eprintln!(
        "containerd: {:.1}s in all, teardown {:.1}s; CNI calls: {}",
        t0.elapsed().as_secs_f64(),
        t_down.elapsed().as_secs_f64(),
        cni_verbs(&log)
    );
}
