//! The node's daemons: containerd with its CRI plugin (and the test images), the kubelet,
//! kube-proxy.
use std::path::Path;
use std::time::{Duration, Instant};

use super::{CniDirs, KubeNode, BUSYBOX_IMAGE, PAUSE_IMAGE};
use crate::k8s::{KubeProxy, ProxyMode};
use crate::process::{command_in, spawn_logged};
use crate::{Error, Result};

impl KubeNode {
    pub(super) fn start_containerd(&mut self, cni: &CniDirs) -> Result<()> {
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
        // A host name of the node's own (a UTS namespace, as its network namespace): its
        // hostNetwork pods share containerd's, and say the node's name as on a machine of
        // their own (the upstream suites check a hostNetwork backend's hostname).
        let host = std::ffi::CString::new(self.name.clone()).map_err(|_| Error::Kube {
            what: "the node's host name".into(),
            detail: format!("{:?} has a NUL", self.name),
        })?;
        // SAFETY: unshare and sethostname are async-signal-safe; `host` was built before the
        // fork and is only read.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                let len = host.as_bytes().len();
                if libc::unshare(libc::CLONE_NEWUTS) != 0
                    || libc::sethostname(host.as_ptr(), len) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
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
    pub(super) fn import_images(&self) -> Result<()> {
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

    pub(super) fn start_kubelet(&mut self, kubeconfig: &Path) -> Result<()> {
        let bin = crate::k8s::k8s_binary("kubelet")?;
        // The node's own cgroup (every hierarchy), below which its pods go (the kubelet's
        // `cgroupRoot`, with QoS cgroups: the containers' parent is the pod's cgroup there), as
        // on a machine of its own: what is attached there (calix's socket programs) sees this
        // node's pods, not another node's of this machine.
        for root in super::teardown::cgroup_hierarchies() {
            let p = root.join(&self.name);
            std::fs::create_dir_all(&p).map_err(Error::io(format!("create {}", p.display())))?;
        }
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
cgroupsPerQOS: true
cgroupRoot: /{name}
enforceNodeAllocatable: []
failSwapOn: false
localStorageCapacityIsolation: true
evictionHard: {{}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
containerRuntimeEndpoint: unix://{sock}
resolvConf: ""
{dns}podLogsDir: {d}/pod-logs
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
  x509:
    clientCAFile: "{client_ca}"
authorization:
  mode: AlwaysAllow
serializeImagePulls: false
"#,
            sock = self.sock.display(),
            name = self.name,
            dns = self
                .cluster_dns
                .map(|a| format!(
                    "clusterDNS: [\"{a}\"]\nclusterDomain: {}\n",
                    crate::k8s::dns::CLUSTER_DOMAIN
                ))
                .unwrap_or_default(),
            ip = self.node_ip,
            client_ca = self
                .client_ca
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
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

    /// Starts kube-proxy in iptables mode in the node's namespace ([`crate::k8s::KubeProxy`]),
    /// talking to the API server by `kubeconfig`. Returns once its rules are synced.
    pub fn start_kube_proxy(&mut self, kubeconfig: &Path) -> Result<()> {
        let log = self.dir.join("kube-proxy.log");
        self.proxy = Some(KubeProxy::start(
            &self.netns,
            &self.name,
            kubeconfig,
            ProxyMode::Iptables,
            log,
        )?);
        Ok(())
    }

    /// Whether kube-proxy runs here.
    pub fn kube_proxy_running(&self) -> bool {
        self.proxy.is_some()
    }

    /// Stops kube-proxy and removes its rules from the node's namespace (`kube-proxy
    /// --cleanup`), as when an operator removes it from a node.
    pub fn stop_kube_proxy(&mut self) -> Result<()> {
        match self.proxy.take() {
            Some(mut p) => p.stop(),
            None => Ok(()),
        }
    }
}
