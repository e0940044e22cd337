//! `calix-probe serve` (the echo server of every node) and `calix-probe check` (the client):
//! the chart's `helm test` pod-to-pod check. See the library's docs.
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, Result};
use calix_probe::{api::Api, check, echo};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "calix-probe", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Echo one line per TCP connection, until SIGTERM.
    Serve {
        #[arg(long, default_value_t = 8080)]
        port: u16,
    },
    /// Wait for the echo DaemonSet, then reach every one of its pods.
    Check {
        #[arg(long, env = "POD_NAMESPACE")]
        namespace: String,
        /// The echo DaemonSet's name.
        #[arg(long)]
        daemonset: String,
        /// Label selector of its pods.
        #[arg(long)]
        selector: String,
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// A calix pool (repeatable): every address must be in one.
        #[arg(long = "pool")]
        pools: Vec<ipnet::IpNet>,
        /// This pod's address (downward API status.podIP).
        #[arg(long, env = "POD_IP")]
        own_ip: Option<IpAddr>,
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
        /// The service account's token and ca.crt (the kubelet mounts them here).
        #[arg(long, default_value = calix_probe::api::SERVICE_ACCOUNT_DIR)]
        service_account_dir: std::path::PathBuf,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Serve { port } => {
            let listener = tokio::net::TcpListener::bind(SocketAddr::from(([0u16; 8], port)))
                .await
                .with_context(|| format!("cannot listen on port {port}"))?;
            println!("serving echo on port {port}");
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                r = echo::serve(listener) => r.context("accepting")?,
                _ = term.recv() => println!("SIGTERM: done"),
            }
            Ok(())
        }
        Cmd::Check {
            namespace,
            daemonset,
            selector,
            port,
            pools,
            own_ip,
            timeout_secs,
            service_account_dir,
        } => {
            let api = Api::in_cluster(&service_account_dir).context("in-cluster API access")?;
            let plan = check::Plan {
                namespace,
                daemonset,
                selector,
                port,
                pools,
                own_ip,
                timeout: Duration::from_secs(timeout_secs),
            };
            let n = check::run(&api, &plan).await?;
            println!("pod-to-pod: all {n} echo pods answered");
            Ok(())
        }
    }
}
