//! kube-proxy (v1.36.2, from `../shared/k8s/bin`) in a node's network namespace, in iptables
//! or nftables mode: what calix replaces, run where a test, the e2e cluster or a bench wants
//! it. `--conntrack-max-per-core=0`: the conntrack table is the machine's, not the node's.
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use crate::process::{checked, command_in, spawn_logged, terminate};
use crate::{Error, Result};

/// kube-proxy's `--proxy-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    Iptables,
    Nftables,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
        }
    }
}

/// A running kube-proxy; terminated on drop (its rules stay with the namespace:
/// [`KubeProxy::stop`] removes them).
pub struct KubeProxy {
    child: Option<Child>,
    netns: PathBuf,
    mode: ProxyMode,
    log: PathBuf,
}

impl KubeProxy {
    /// Starts kube-proxy in `mode` in the namespace at `netns` as node `node`, talking to the
    /// API server by `kubeconfig`, logging to `log`. Returns once its first sync is done.
    pub fn start(
        netns: &Path,
        node: &str,
        kubeconfig: &Path,
        mode: ProxyMode,
        log: PathBuf,
    ) -> Result<Self> {
        let bin = crate::k8s::k8s_binary("kube-proxy")?;
        let mut cmd = command_in(Some(netns), &bin, None, false)?;
        cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--hostname-override={node}"))
            .arg(format!("--proxy-mode={}", mode.as_str()))
            .arg("--conntrack-max-per-core=0")
            .arg("--oom-score-adj=0")
            .arg("--metrics-bind-address=127.0.0.1:10249")
            .arg("--healthz-bind-address=127.0.0.1:10256")
            .arg("--v=2");
        let mut p = Self {
            child: Some(spawn_logged(&mut cmd, &log)?),
            netns: netns.to_path_buf(),
            mode,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = p.log();
            if text.contains("SyncProxyRules complete") || text.contains("syncProxyRules complete")
            {
                return Ok(p);
            }
            let exited = p.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: format!("kube-proxy ({})", mode.as_str()),
                    exited,
                    log: text,
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn mode(&self) -> ProxyMode {
        self.mode
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops it and removes its rules from the namespace (`kube-proxy --cleanup`), as when an
    /// operator removes it from a node.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut c) = self.child.take() else {
            return Ok(());
        };
        terminate(&mut c, Duration::from_secs(2));
        let bin = crate::k8s::k8s_binary("kube-proxy")?;
        let mut cmd = command_in(Some(&self.netns), &bin, None, false)?;
        cmd.arg("--cleanup")
            .arg(format!("--proxy-mode={}", self.mode.as_str()));
        checked(&mut cmd).map(drop)
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            terminate(&mut c, Duration::from_secs(2));
        }
    }
}
