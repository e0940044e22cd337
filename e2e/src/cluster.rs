//! The cluster the chart is installed on: the control plane in a namespace of its own, two
//! kubelet nodes on the test underlay's two subnets (a third, when asked, on the first subnet
//! again), the calix image imported into each. (The nodes' route-distribution certificates
//! come through the Kubernetes API: nothing to issue.)
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use calix_testbed::k8s::dns::DnsServer;
use calix_testbed::{unique, Cluster, CniDirs, Dataplane, KubeApi, KubeNode, KubeletServes};
use serde_json::{json, Value};

use crate::node_state::NodePaths;
use crate::progress::Progress;
use crate::Mode;

/// The namespace the chart is installed in.
pub const RELEASE_NAMESPACE: &str = "kube-system";
/// The pods' pool (natOutgoing: the ClusterIP check goes from a natOutgoing pool).
pub const POOL: &str = "10.76.0.0/16";
/// The reference plugins a node's CNI bin dir has before calix is installed (a node
/// provisioned with containernetworking-plugins): the runtime's loopback, and portmap, which
/// the chart chains after calix for hostPorts.
const REFERENCE_PLUGINS: [&str; 2] = ["loopback", "portmap"];

pub struct E2eCluster {
    // Dropped in this order: the kubelet nodes, the node namespaces and underlay, the control
    // plane.
    pub kubes: Vec<KubeNode>,
    /// Each node's kubeconfig (kube-proxy's).
    kubeconfigs: Vec<PathBuf>,
    pub nodes: Cluster,
    /// The cluster DNS (`cluster.local`, in the API server's namespace): the upstream
    /// Services suite dials Services by name.
    dns: DnsServer,
    pub api: KubeApi,
    /// The chart's host paths (each node below them in a directory of its name).
    pub dir: PathBuf,
    /// Removes `dir` when the cluster is dropped without [`E2eCluster::stop`] (a failed check
    /// returns early): last, after the nodes' mounts below it are gone.
    _dir_gone: DirGone,
}

struct DirGone(PathBuf);

impl Drop for DirGone {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl E2eCluster {
    /// `count` kubelet nodes (2 or more): node `i` on subnet 1 when `i` is even, 2 when odd, so
    /// nodes 0 and 1 are always across the underlay's router from each other.
    pub fn start(p: &mut Progress, image: &Path, count: usize) -> Result<Self> {
        anyhow::ensure!(
            count >= 2,
            "the e2e cluster needs 2 nodes at least, not {count}"
        );
        p.step("control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler (v1.36.2), cluster DNS");
        let api = KubeApi::in_namespace();
        api.start_controllers()?;
        api.serve_in_cluster()?;
        let dns = api.cluster_dns()?;
        p.step(&format!("{count} nodes on the underlay's two subnets: containerd (CRI), kubelet; the calix image imported"));
        let subnets: Vec<u8> = (0..count).map(|i| [1, 2][i % 2]).collect();
        let nodes = Cluster::create(Dataplane::Ebpf, &subnets, |_, _| String::new());
        let dir = std::env::temp_dir().join(unique("e2e"));
        let dir_gone = DirGone(dir.clone());
        let mut kubes = Vec::new();
        let mut kubeconfigs = Vec::new();
        for (i, node) in nodes.nodes.iter().enumerate() {
            let kubeconfig = api.wire(&node.ns)?;
            let name = &node.ns.name;
            let cni = CniDirs {
                bin: dir.join("cni-bin").join(name),
                conf: dir.join("cni-net.d").join(name),
            };
            for d in [&cni.bin, &cni.conf] {
                std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
            }
            for plugin in REFERENCE_PLUGINS {
                let from = Path::new("/usr/lib/cni").join(plugin);
                std::fs::copy(&from, cni.bin.join(plugin)).with_context(|| {
                    format!(
                        "copy {} (Debian's containernetworking-plugins)",
                        from.display()
                    )
                })?;
            }
            let kube = KubeNode::start(
                &node.ns,
                &node.dir.join("k8s"),
                &kubeconfig,
                &nodes.address(i),
                &cni,
                KubeletServes {
                    client_ca: Some(&api.kubelet_client_ca()),
                    cluster_dns: Some(dns.addr.ip()),
                },
            )?;
            // Exec through the API (kubectl exec, the upstream suites' probes): the API
            // server dials this kubelet at its InternalIP.
            api.reach_kubelet(&node.ns, &nodes.address(i))?;
            kubeconfigs.push(kubeconfig);
            kube.import(image)
                .with_context(|| format!("import {} into {name}", image.display()))?;
            p.note(&format!(
                "node {name}: {} (subnet {}), registered",
                nodes.address(i),
                nodes.subnets[i]
            ));
            kubes.push(kube);
        }
        // The API server's proxy to pods (the upstream suites fetch pods' pages through it).
        if let Some(first) = nodes.nodes.first() {
            api.reach_pods(&first.ns, POOL)?;
        }
        Ok(Self {
            kubes,
            kubeconfigs,
            nodes,
            dns,
            api,
            _dir_gone: dir_gone,
            dir,
        })
    }

    /// The cluster's namespaces.
    pub fn namespaces(&self) -> Result<std::collections::BTreeSet<String>> {
        Ok(self
            .api
            .list("v1", "Namespace", "")?
            .iter()
            .filter_map(|n| n["metadata"]["name"].as_str().map(str::to_string))
            .collect())
    }

    /// Removes every namespace not in `keep`, its pods at once (grace period 0), and waits
    /// (3 min at most) until they are gone: what a conformance suite left (it deletes its
    /// namespaces without waiting, and a terminating-endpoints spec's pods take minutes).
    pub fn clear_namespaces(&self, keep: &std::collections::BTreeSet<String>) -> Result<()> {
        let extra = |all: std::collections::BTreeSet<String>| -> Vec<String> {
            all.difference(keep).cloned().collect()
        };
        for ns in extra(self.namespaces()?) {
            for pod in self.api.list("v1", "Pod", "")? {
                if pod["metadata"]["namespace"] == ns.as_str() {
                    if let Some(name) = pod["metadata"]["name"].as_str() {
                        self.api.delete_now("v1", "Pod", &ns, name)?;
                    }
                }
            }
            self.api.delete("v1", "Namespace", &ns)?;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
        loop {
            let left = extra(self.namespaces()?);
            if left.is_empty() {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                anyhow::bail!(
                    "the conformance suite's namespaces are not gone after 3 min: {left:?}\n{}",
                    self.show()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }

    /// kube-proxy (iptables mode) on every node when `want`, else none (stopped, its rules
    /// removed, as an operator removes it). Kernel mode keeps it; eBPF mode is installed beside
    /// it and then removes it, as docs/install.md says to.
    pub fn kube_proxy(&mut self, want: bool, p: &mut Progress) -> Result<()> {
        for (kube, kubeconfig) in self.kubes.iter_mut().zip(&self.kubeconfigs) {
            match (want, kube.kube_proxy_running()) {
                (true, false) => kube.start_kube_proxy(kubeconfig)?,
                (false, true) => kube.stop_kube_proxy()?,
                _ => continue,
            }
            p.note(&format!(
                "node {}: kube-proxy {}",
                kube.name,
                if want {
                    "started (iptables mode)"
                } else {
                    "stopped, its rules removed"
                }
            ));
        }
        Ok(())
    }

    /// How many kubelet nodes the cluster has.
    pub fn count(&self) -> usize {
        self.kubes.len()
    }

    /// Node `i`'s name.
    pub fn name(&self, i: usize) -> &str {
        self.nodes.name(i)
    }

    /// Where node `i` keeps what an uninstall must remove.
    pub fn paths(&self, i: usize) -> NodePaths {
        NodePaths {
            conflist: self
                .dir
                .join("cni-net.d")
                .join(self.name(i))
                .join("10-calix.conflist"),
            pins: Path::new("/sys/fs/bpf/calix").join(self.name(i)),
        }
    }

    /// The chart's values for `mode`: the image imported (never pulled), per-node host paths
    /// below [`E2eCluster::dir`], the uplinks, a natOutgoing pool, routes over mutual TLS with
    /// the chart's default: each node's certificate through the Kubernetes API (calix-signer).
    pub fn values(&self, mode: Mode) -> Value {
        let d = |s: &str| self.dir.join(s).display().to_string();
        // eBPF mode replaces kube-proxy: the API server reached directly, the socket programs
        // on this host's cgroup v2 root.
        let (host, port) = self.api.advertised().unwrap_or(("", 6443));
        let cgroup = if Path::new("/sys/fs/cgroup/unified/cgroup.procs").exists() {
            "/sys/fs/cgroup/unified"
        } else {
            "/sys/fs/cgroup"
        };
        json!({
            "image": {"repository": "localhost/calix", "pullPolicy": "Never"},
            "cniBinDir": d("cni-bin"),
            "cniNetDir": d("cni-net.d"),
            "runDir": d("run"),
            "stateDir": d("lib"),
            "hostPathsPerNode": true,
            "dataplane": mode.value(),
            "uplinks": ["eth0"],
            "pools": [{"name": "e2e-pods", "cidr": POOL, "blockSize": 26,
                "natOutgoing": true, "vxlan": "crossSubnet"}],
            "routes": {"enabled": true, "graceSecs": 30},
            // Faster rollouts and readiness than a production default (the same probes).
            "probes": {"readiness": {"periodSeconds": 1, "timeoutSeconds": 5, "failureThreshold": 3}},
            "terminationGracePeriodSeconds": 10,
            "test": {"timeoutSeconds": 90},
            // The external and LoadBalancer addresses the upstream Services suite gives
            // (TEST-NET-3), allowed as an operator allows theirs.
            "kubeProxyReplacement": {"enabled": mode == Mode::Ebpf, "cgroup": cgroup,
                "apiServer": {"host": host, "port": port},
                "externalCidrs": ["203.0.113.0/24"]},
        })
    }

    /// What went on, for an error: each node's kubelet log and the calix containers' logs.
    pub fn show(&self) -> String {
        self.kubes
            .iter()
            .map(|k| {
                let logs = k.container_logs();
                let tail: Vec<&str> = logs.lines().rev().take(60).collect();
                format!(
                    "=== node {} ===\n{}\n--- container logs (last 60 lines) ---\n{}",
                    k.name,
                    k.logs_tail(25),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Tears everything down; what is left behind (empty when all is gone).
    pub fn stop(self) -> Vec<String> {
        let Self {
            kubes,
            kubeconfigs: _,
            nodes,
            dns,
            api,
            dir,
            _dir_gone,
        } = self;
        let names: Vec<String> = kubes.iter().map(|k| k.name.clone()).collect();
        let mut left: Vec<String> = kubes.into_iter().flat_map(KubeNode::stop).collect();
        drop(nodes);
        drop(dns);
        drop(api);
        for name in names {
            let pins = Path::new("/sys/fs/bpf/calix").join(&name);
            if pins.exists() {
                left.push(format!("pins {}", pins.display()));
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            left.push(format!("{}: {e}", dir.display()));
        }
        left
    }
}
