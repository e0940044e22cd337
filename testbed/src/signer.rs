//! calix-signer beside a test bed's API server, with exactly the chart's permissions: its
//! own ServiceAccount, bound to the rules of `charts/calix/files/rbac/signer*.yaml` (names
//! filled in: the test's signer name, CA Secret and ConfigMap), running in the API server's
//! namespace until dropped. And the agents' certificate rules of the same directory
//! ([`agent_certificate_rules`]), for a test's agents.
use std::path::PathBuf;
use std::process::Child;
use std::sync::Mutex;

use serde_json::Value;

use crate::k8s::KubeApi;
use crate::process::{command_in, spawn_logged};
use crate::{Error, Result};

/// The placeholders of the chart's RBAC files, and the signer name they carry.
pub const CA_SECRET_PLACEHOLDER: &str = "CALIX_CA_SECRET";
pub const CA_CONFIG_MAP_PLACEHOLDER: &str = "CALIX_CA_CONFIG_MAP";
pub const CHART_SIGNER_NAME: &str = "calix.dev/routes";

/// The rules of the chart's `files/rbac/<file>`, with `replace` applied to the text first.
pub fn chart_rules(file: &str, replace: &[(&str, &str)]) -> Result<Vec<Value>> {
    let path = crate::k8s::crds_dir()
        .parent()
        .map(|c| c.join("files/rbac").join(file))
        .unwrap_or_default();
    let mut text =
        std::fs::read_to_string(&path).map_err(Error::io(format!("read {}", path.display())))?;
    for (from, to) in replace {
        text = text.replace(from, to);
    }
    serde_saphyr::from_str(&text).map_err(|e| Error::Unexpected {
        what: path.display().to_string(),
        found: e.to_string(),
        expected: "a list of RBAC rules".into(),
    })
}

/// What a test's signer answers for and keeps.
#[derive(Debug, Clone)]
pub struct SignerSetup {
    /// Its signerName (unique per test: several signers share one API server).
    pub signer_name: String,
    /// The namespace of its Secret, ConfigMap and ServiceAccount.
    pub namespace: String,
    pub ca_secret: String,
    pub ca_config_map: String,
    pub service_account: String,
    /// The agents' ServiceAccount, `<namespace>/<name>`.
    pub agents: String,
    pub lifetime_secs: u64,
}

/// The agents' rules of the chart for `setup`: CertificateSigningRequests (cluster-wide) and
/// the bundle's ConfigMap (in `setup.namespace`).
pub fn agent_certificate_rules(setup: &SignerSetup) -> Result<(Vec<Value>, Vec<Value>)> {
    Ok((
        chart_rules("agent-certificates.yaml", &[])?,
        chart_rules(
            "agent-certificates-namespace.yaml",
            &[(CA_CONFIG_MAP_PLACEHOLDER, &setup.ca_config_map)],
        )?,
    ))
}

/// A running calix-signer. Killed on drop.
pub struct Signer {
    pub setup: SignerSetup,
    pub log: PathBuf,
    child: Mutex<Option<Child>>,
}

impl Signer {
    /// Its ServiceAccount bound to the chart's signer rules (for `setup`), then the process,
    /// started (not waited for: its first act is making the CA).
    pub fn start(api: &KubeApi, setup: SignerSetup) -> Result<Self> {
        let sa = &setup.service_account;
        api.service_account(&setup.namespace, sa)?;
        let replace = [
            (CHART_SIGNER_NAME, setup.signer_name.as_str()),
            (CA_SECRET_PLACEHOLDER, setup.ca_secret.as_str()),
            (CA_CONFIG_MAP_PLACEHOLDER, setup.ca_config_map.as_str()),
        ];
        api.grant(
            sa,
            None,
            &setup.namespace,
            sa,
            chart_rules("signer.yaml", &replace)?,
        )?;
        api.grant(
            sa,
            Some(&setup.namespace),
            &setup.namespace,
            sa,
            chart_rules("signer-namespace.yaml", &replace)?,
        )?;
        let token = api.token(&setup.namespace, sa, None)?;
        let kubeconfig = api.kubeconfig_for(&token)?;
        let log = api.dir.join(format!("{sa}.log"));
        let ns = api.ns.as_ref().map(|n| PathBuf::from(n.path()));
        let mut cmd = command_in(ns.as_deref(), crate::bin("calix-signer"), None, true)?;
        cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--signer-name={}", setup.signer_name))
            .arg(format!("--agent-service-account={}", setup.agents))
            .arg(format!("--namespace={}", setup.namespace))
            .arg(format!("--ca-secret={}", setup.ca_secret))
            .arg(format!("--ca-config-map={}", setup.ca_config_map))
            .arg(format!("--lifetime-secs={}", setup.lifetime_secs))
            .arg("--log-level=info");
        let child = spawn_logged(&mut cmd, &log)?;
        Ok(Self {
            setup,
            log,
            child: Mutex::new(Some(child)),
        })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops it (SIGKILL).
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Signer {
    fn drop(&mut self) {
        self.kill();
    }
}
