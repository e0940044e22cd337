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
//!
//! Here: the node, its logs and its containers. `daemons.rs` starts containerd, the kubelet
//! and kube-proxy; `teardown.rs` stops them and removes what they left on the host.
mod daemons;
mod teardown;

use teardown::host_hold;
pub use teardown::mounts_under;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use crate::netns::Netns;
use crate::process::checked;
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
    proxy: Option<crate::k8s::KubeProxy>,
    /// The CA of the clients the kubelet serves (exec, logs, port-forward): the API server's
    /// ([`crate::KubeApi::kubelet_client_ca`]); `None`: it serves no one.
    client_ca: Option<PathBuf>,
    /// The cluster DNS its pods are given (`clusterDNS`, with `clusterDomain`
    /// [`crate::k8s::dns::CLUSTER_DOMAIN`]); `None`: none.
    cluster_dns: Option<std::net::IpAddr>,
    /// Whether [`KubeNode::stop`] (or drop) has run.
    torn_down: bool,
}

/// What a kubelet serves beyond running pods ([`KubeNode::start`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct KubeletServes<'a> {
    /// The CA of the clients it serves (exec, logs, port-forward): the API server's,
    /// [`crate::KubeApi::kubelet_client_ca`], for exec through the API; `None`: it serves no
    /// one.
    pub client_ca: Option<&'a Path>,
    /// The cluster DNS its pods' resolv.conf names ([`crate::KubeApi::cluster_dns`]).
    pub cluster_dns: Option<std::net::IpAddr>,
}

impl KubeNode {
    /// containerd and the kubelet in `ns` (node name `ns.name`, InternalIP `node_ip`, an
    /// address of `ns`), the kubelet talking to the API server by `kubeconfig`; files in
    /// `<dir>`. Returns once the kubelet has registered its Node (not yet Ready: that needs
    /// the CNI config in `cni.conf`). `serves`: its clients' CA and the cluster DNS.
    pub fn start(
        ns: &Netns,
        dir: &Path,
        kubeconfig: &Path,
        node_ip: &str,
        cni: &CniDirs,
        serves: KubeletServes,
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
            client_ca: serves.client_ca.map(Path::to_path_buf),
            cluster_dns: serves.cluster_dns,
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
}
