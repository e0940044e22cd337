//! A Kubernetes node in a network namespace: a private containerd 1.6 with its CRI plugin (its
//! own root, state, sockets and runc root under the node's directory; the CNI config and plugin
//! dirs given by the caller; images imported from OCI tarballs, since nothing can be pulled)
//! and the upstream kubelet v1.36.2 from `../shared/k8s/bin` (its own root dir, pod logs and
//! KubeletConfiguration as `../shared/k8s/README.md` says this machine needs), registered with
//! a [`crate::KubeApi`] under the namespace's name.
//!
//! Drop stops the kubelet, removes what it left (containers and their tasks, sandboxes' network
//! namespaces, shims, mounts under the node's directory, cgroups of the containers), stops
//! containerd and removes the directory.
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::netns::Netns;
use crate::process::{checked, command_in, spawn_logged, terminate};
use crate::{Error, Result};

/// The containerd namespace the CRI plugin uses.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// The pause image every node imports (the CRI plugin's `sandbox_image`).
pub const PAUSE_IMAGE: &str = "localhost/calix-test/pause:1";
/// A busybox image every node imports for test pods (`sleep`, `sh`, `ping`, `nc`, `httpd`...).
pub const BUSYBOX_IMAGE: &str = "localhost/calix-test/busybox:1";

/// Where a node's CNI plugin looks.
pub struct CniDirs {
    /// The CRI plugin's `bin_dir`.
    pub bin: PathBuf,
    /// The CRI plugin's `conf_dir`.
    pub conf: PathBuf,
}

impl CniDirs {
    /// `<dir>/cni-bin` with Debian's reference plugins (`/usr/lib/cni`, linked) and `calix`
    /// (`plugin`, linked), and `<dir>/cni-net.d` with calix's conflist: `calix` (the network
    /// config `calix`, e.g. [`crate::Node::conf`]), then `portmap` for hostPorts.
    pub fn create(dir: &Path, calix: serde_json::Value, plugin: &Path) -> Result<Self> {
        let dirs = Self {
            bin: dir.join("cni-bin"),
            conf: dir.join("cni-net.d"),
        };
        for d in [&dirs.bin, &dirs.conf] {
            std::fs::create_dir_all(d).map_err(Error::io(format!("create {}", d.display())))?;
        }
        let link = |from: &Path, to: PathBuf| {
            std::os::unix::fs::symlink(from, &to)
                .map_err(Error::io(format!("link {}", to.display())))
        };
        if let Ok(rd) = std::fs::read_dir("/usr/lib/cni") {
            for e in rd.filter_map(|e| e.ok()) {
                link(&e.path(), dirs.bin.join(e.file_name()))?;
            }
        }
        link(plugin, dirs.bin.join("calix"))?;
        let conflist = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "calix",
            "plugins": [
                calix,
                {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true},
            ],
        });
        let path = dirs.conf.join("10-calix.conflist");
        std::fs::write(&path, conflist.to_string())
            .map_err(Error::io(format!("write {}", path.display())))?;
        Ok(dirs)
    }
}

/// A busybox web server Pod on node `node`: `httpd` on 8080 answering its own name (the page
/// `GET /` gives), `labels`, and the hostPort `host_port` when given.
pub fn web_pod(
    name: &str,
    node: &str,
    labels: serde_json::Value,
    host_port: Option<u16>,
) -> serde_json::Value {
    let mut port = serde_json::json!({"containerPort": 8080});
    if let Some(p) = host_port {
        port["hostPort"] = p.into();
    }
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "web", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c",
                    format!("echo {name} > /tmp/index.html && exec httpd -f -p 8080 -h /tmp")],
                "ports": [port],
            }],
        },
    })
}

/// `GET http://<addr>/` (HTTP/1.0; `addr` with its port, else 80) from the network namespace
/// at `netns` (a pod's sandbox, [`KubeNode::pod_netns`], or any other), on a thread that
/// entered it: the body, trimmed; `None` when it fails. (Debian's static busybox `wget`
/// crashes when run outside its image.)
pub fn http_get(netns: &str, addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(netns).ok()?;
    let addr: std::net::SocketAddr = addr
        .parse()
        .or_else(|_| format!("{addr}:80").parse())
        .ok()?;
    std::thread::spawn(move || {
        // SAFETY: setns(2) of this thread only, on a namespace fd we hold.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return None;
        }
        let t = Duration::from_secs(2);
        let mut s = std::net::TcpStream::connect_timeout(&addr, t).ok()?;
        s.set_read_timeout(Some(t)).ok()?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").ok()?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).ok()?;
        let (_, body) = answer.split_once("\r\n\r\n")?;
        Some(body.trim().to_string())
    })
    .join()
    .ok()
    .flatten()
}

/// A kubelet node. See the module doc.
pub struct KubeNode {
    pub name: String,
    pub dir: PathBuf,
    pub node_ip: String,
    netns: PathBuf,
    sock: PathBuf,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    proxy: Option<Child>,
    /// Whether [`KubeNode::stop`] (or drop) has run.
    torn_down: bool,
}

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
fn host_hold() {
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
    /// containerd and the kubelet in `ns` (node name `ns.name`, InternalIP `node_ip`, an
    /// address of `ns`), the kubelet talking to the API server by `kubeconfig`; files in
    /// `<dir>`. Returns once the kubelet has registered its Node (not yet Ready: that needs
    /// the CNI config in `cni.conf`).
    pub fn start(
        ns: &Netns,
        dir: &Path,
        kubeconfig: &Path,
        node_ip: &str,
        cni: &CniDirs,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(Error::io(format!("create {}", dir.display())))?;
        let mut node = Self {
            name: ns.name.clone(),
            dir: dir.to_path_buf(),
            node_ip: node_ip.to_string(),
            netns: ns.path().into(),
            sock: dir.join("containerd.sock"),
            containerd: None,
            kubelet: None,
            proxy: None,
            torn_down: false,
        };
        host_hold();
        node.start_containerd(cni)?;
        node.import_images()?;
        node.start_kubelet(kubeconfig)?;
        Ok(node)
    }

    /// The containerd socket (for `ctr --address`).
    pub fn containerd_socket(&self) -> &Path {
        &self.sock
    }

    pub fn kubelet_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("kubelet.log")).unwrap_or_default()
    }

    pub fn containerd_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// Every container's log (the kubelet's `podLogsDir`), each headed by its path.
    pub fn container_logs(&self) -> String {
        fn walk(dir: &Path, out: &mut String) {
            let Ok(rd) = std::fs::read_dir(dir) else {
                return;
            };
            for e in rd.filter_map(|e| e.ok()) {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else {
                    out.push_str(&format!("{}:\n", p.display()));
                    out.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
                }
            }
        }
        let mut out = String::new();
        walk(&self.dir.join("pod-logs"), &mut out);
        out
    }

    /// The tails of the kubelet's and containerd's logs, for a failure message.
    pub fn logs_tail(&self, lines: usize) -> String {
        let tail = |s: String| {
            let v: Vec<&str> = s.lines().collect();
            v[v.len().saturating_sub(lines)..].join("\n")
        };
        format!(
            "--- kubelet ---\n{}\n--- containerd ---\n{}\n--- containers' logs ---\n{}",
            tail(self.kubelet_log()),
            tail(self.containerd_log()),
            tail(self.container_logs())
        )
    }

    /// `ctr` against this node's containerd, in the CRI namespace.
    pub fn ctr(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address")
            .arg(&self.sock)
            .args(["--namespace", CRI_NAMESPACE])
            .args(args);
        c
    }

    /// Imports the OCI image tarball at `tar` (e.g. the calix image).
    pub fn import(&self, tar: &Path) -> Result<()> {
        checked(
            self.ctr(&["images", "import", "--snapshotter", "native"])
                .arg(tar)
                .stdin(std::process::Stdio::null()),
        )
        .map(|_| ())
    }

    fn start_containerd(&mut self, cni: &CniDirs) -> Result<()> {
        let d = self.dir.display();
        let config = format!(
            r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{d}/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
"#,
            sock = self.sock.display(),
            bin = cni.bin.display(),
            conf = cni.conf.display(),
        );
        let path = self.dir.join("containerd.toml");
        std::fs::write(&path, config).map_err(Error::io(format!("write {}", path.display())))?;
        let log = self.dir.join("containerd.log");
        let mut cmd = command_in(Some(&self.netns), "containerd", None, false)?;
        cmd.arg("--config").arg(&path);
        self.containerd = Some(spawn_logged(&mut cmd, &log)?);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let up = self
                .ctr(&["version"])
                .stdin(std::process::Stdio::null())
                .output()
                .is_ok_and(|o| o.status.success());
            if up {
                return Ok(());
            }
            let exited = self
                .containerd
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "containerd".into(),
                    exited,
                    log: self.containerd_log(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The pause image (busybox sleeping forever) and the busybox test image.
    fn import_images(&self) -> Result<()> {
        for (name, cmd) in [
            (PAUSE_IMAGE, &["/bin/sleep", "2147483647"][..]),
            (BUSYBOX_IMAGE, &["/bin/sh"][..]),
        ] {
            let tar = self.dir.join(format!(
                "{}.oci.tar",
                name.rsplit('/').next().unwrap_or(name)
            ));
            let data = crate::image::busybox_oci_tar(name, cmd)?;
            std::fs::write(&tar, data).map_err(Error::io(format!("write {}", tar.display())))?;
            self.import(&tar)?;
        }
        Ok(())
    }

    fn start_kubelet(&mut self, kubeconfig: &Path) -> Result<()> {
        let bin = crate::k8s::k8s_binary("kubelet")?;
        let d = self.dir.display();
        for sub in ["kubelet", "pod-logs"] {
            let p = self.dir.join(sub);
            std::fs::create_dir_all(&p).map_err(Error::io(format!("create {}", p.display())))?;
        }
        let config = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
localStorageCapacityIsolation: false
evictionHard: {{}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
containerRuntimeEndpoint: unix://{sock}
resolvConf: ""
podLogsDir: {d}/pod-logs
staticPodPath: ""
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
address: {ip}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
serializeImagePulls: false
"#,
            sock = self.sock.display(),
            ip = self.node_ip,
        );
        let path = self.dir.join("kubelet.yaml");
        std::fs::write(&path, config).map_err(Error::io(format!("write {}", path.display())))?;
        let log = self.dir.join("kubelet.log");
        let mut cmd = command_in(Some(&self.netns), &bin, None, false)?;
        cmd.arg(format!("--config={}", path.display()))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--root-dir={d}/kubelet"))
            .arg(format!("--hostname-override={}", self.name))
            .arg(format!("--node-ip={}", self.node_ip))
            .arg("--v=2");
        self.kubelet = Some(spawn_logged(&mut cmd, &log)?);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.kubelet_log().contains("Successfully registered node") {
                return Ok(());
            }
            let exited = self
                .kubelet
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "kubelet".into(),
                    exited,
                    log: self.kubelet_log(),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Starts kube-proxy in iptables mode in the node's namespace (`--conntrack-max-per-core
    /// 0`: the conntrack table is the machine's), talking to the API server by `kubeconfig`.
    /// Returns once it answers on its healthz port with its rules synced.
    pub fn start_kube_proxy(&mut self, kubeconfig: &Path) -> Result<()> {
        let bin = crate::k8s::k8s_binary("kube-proxy")?;
        let log = self.dir.join("kube-proxy.log");
        let mut cmd = command_in(Some(&self.netns), &bin, None, false)?;
        cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--hostname-override={}", self.name))
            .arg("--proxy-mode=iptables")
            .arg("--conntrack-max-per-core=0")
            .arg("--oom-score-adj=0")
            .arg("--metrics-bind-address=127.0.0.1:10249")
            .arg("--healthz-bind-address=127.0.0.1:10256")
            .arg("--v=2");
        self.proxy = Some(spawn_logged(&mut cmd, &log)?);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("SyncProxyRules complete") || text.contains("syncProxyRules complete")
            {
                return Ok(());
            }
            let exited = self
                .proxy
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "kube-proxy".into(),
                    exited,
                    log: text,
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The network namespace (`/var/run/netns/cni-…`) of the running pod `namespace/name`'s
    /// sandbox, from containerd's labels.
    pub fn pod_netns(&self, namespace: &str, name: &str) -> Option<String> {
        let out = self
            .ctr(&[
                "containers",
                "ls",
                "-q",
                &format!("labels.\"io.kubernetes.pod.name\"=={name}"),
                &format!("labels.\"io.kubernetes.pod.namespace\"=={namespace}"),
                "labels.\"io.cri-containerd.kind\"==sandbox",
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|id| self.netns_of(id.trim()))
            .find(|p| Path::new(p).exists())
    }

    /// IDs of the containers (sandboxes included) containerd still has.
    pub fn containers(&self) -> Vec<String> {
        self.ctr(&["containers", "ls", "-q"])
            .stdin(std::process::Stdio::null())
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The network namespace path of container `id`'s spec (a sandbox's `/var/run/netns/cni-…`).
    fn netns_of(&self, id: &str) -> Option<String> {
        let out = self
            .ctr(&["containers", "info", id])
            .stdin(std::process::Stdio::null())
            .output()
            .ok()?;
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        info["Spec"]["linux"]["namespaces"]
            .as_array()?
            .iter()
            .find(|n| n["type"] == "network")
            .and_then(|n| n["path"].as_str())
            .filter(|p| !p.is_empty())
            .map(String::from)
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
        if let Some(mut p) = self.proxy.take() {
            terminate(&mut p, Duration::from_secs(2));
        }
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
