//! The connection to the Kubernetes API: a kubeconfig file, or the pod's service account
//! (in-cluster). One [`kube::Client`] per agent, shared by the datastore and whatever else in the
//! agent reads the API.
use std::path::PathBuf;
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::DatastoreError;

/// How to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeConfig {
    /// A kubeconfig file (its current context); `None`: the service account of the pod the
    /// agent runs in (`KUBERNETES_SERVICE_HOST`, the mounted token and CA).
    pub kubeconfig: Option<PathBuf>,
    /// Per-request timeout (and connect timeout); watches have none.
    pub timeout: Duration,
    /// Attempts per operation while the API server is unreachable or overloaded, with
    /// exponential backoff between them.
    pub attempts: u32,
}

/// Builds the client. It does not contact the API server: an agent may start before it is
/// up. Fails on a kubeconfig that cannot be read or used, or outside a pod without one.
pub async fn connect(cfg: &KubeConfig) -> Result<kube::Client, DatastoreError> {
    let refused = |detail: String| DatastoreError::Unavailable {
        backend: "kubernetes",
        attempts: 0,
        detail,
    };
    let mut config = match &cfg.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .map_err(|e| refused(format!("kubeconfig {}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| refused(format!("kubeconfig {}: {e}", path.display())))?
        }
        None => kube::Config::incluster().map_err(|e| {
            refused(format!(
                "no kubeconfig configured and not in a pod ({e}): set datastore.kubeconfig"
            ))
        })?,
    };
    config.connect_timeout = Some(cfg.timeout);
    // The store retries with its own bounds (and knows which writes it may retry).
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| refused(format!("kubernetes client: {e}")))
}
