//! calix-signer: signs the route-distribution certificates calix's agents ask for through
//! CertificateSigningRequests (signerName `calix.dev/routes`), for their own node only; keeps
//! its CA in a Secret and publishes the bundle the agents trust in a ConfigMap. The chart
//! runs one (a Deployment on the host network). What it decides and why: the library's
//! `signer` module; this file only reads the flags and starts it.
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use calix_agent::signer::{controller, SignerConfig};
use calix_datastore::kubernetes::{connect, KubeConfig};
use calix_pki::ROUTES_SIGNER;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "calix-signer",
    version,
    about = "signs calix's route-distribution certificates"
)]
struct Flags {
    /// The signerName answered for.
    #[arg(long, default_value = ROUTES_SIGNER)]
    signer_name: String,
    /// `<namespace>/<name>` of the agents' ServiceAccount: the only requester signed for.
    #[arg(long)]
    agent_service_account: String,
    /// Where the CA's Secret and the bundle's ConfigMap live (default: the pod's namespace,
    /// $POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    namespace: String,
    /// The Secret with the CA (`tls.crt`, `tls.key`); made when absent.
    #[arg(long, default_value = "calix-routes-ca")]
    ca_secret: String,
    /// The ConfigMap whose `ca.crt` is the agents' trust bundle.
    #[arg(long, default_value = "calix-routes-ca")]
    ca_config_map: String,
    /// The issued certificates' lifetime, seconds (agents renew at 60–70 % of it).
    #[arg(long, default_value_t = 86_400)]
    lifetime_secs: u64,
    /// The CA's lifetime when it is made, days.
    #[arg(long, default_value_t = 3650)]
    ca_validity_days: u64,
    /// A kubeconfig (default: the pod's ServiceAccount).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Log filter.
    #[arg(long, default_value = "info")]
    log_level: String,
}

fn main() -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run())
}

async fn run() -> Result<()> {
    let f = Flags::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&f.log_level)
                .with_context(|| format!("bad --log-level {:?}", f.log_level))?,
        )
        .with_writer(calix_log::Escaping(std::io::stderr))
        .with_ansi(false)
        .init();
    let Some((ns, name)) = f
        .agent_service_account
        .split_once('/')
        .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains('/'))
    else {
        bail!(
            "--agent-service-account {:?}: expected <namespace>/<name>, e.g. kube-system/calix",
            f.agent_service_account
        );
    };
    if f.lifetime_secs < 10 {
        bail!("--lifetime-secs {}: at least 10", f.lifetime_secs);
    }
    if !f
        .signer_name
        .split_once('/')
        .is_some_and(|(d, p)| !d.is_empty() && !p.is_empty())
    {
        bail!(
            "--signer-name {:?}: expected <domain>/<path>",
            f.signer_name
        );
    }
    let cfg = SignerConfig {
        signer_name: f.signer_name,
        agent_service_account: (ns.to_string(), name.to_string()),
        namespace: f.namespace,
        ca_secret: f.ca_secret,
        ca_config_map: f.ca_config_map,
        lifetime: Duration::from_secs(f.lifetime_secs),
        ca_validity: Duration::from_secs(f.ca_validity_days.saturating_mul(86_400)),
    };
    let client = connect(&KubeConfig {
        kubeconfig: f.kubeconfig,
        timeout: Duration::from_secs(10),
        attempts: 1,
    })
    .await
    .context("the Kubernetes API")?;
    tokio::select! {
        r = controller::run(client, cfg) => r.context("calix-signer stopped")?,
        _ = tokio::signal::ctrl_c() => {}
        _ = sigterm() => {}
    }
    tracing::info!("stopped");
    Ok(())
}

async fn sigterm() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}
