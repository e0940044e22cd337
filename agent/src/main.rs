//! calix-agent: config → build → run until SIGTERM/SIGINT.
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use calix_agent::agent::Agent;
use calix_agent::config::{AgentConfig, DataplaneMode, PoolConfig};
use calix_agent::dataplane::{Dataplane, EbpfDataplane, KernelDataplane};
use calix_agent::datastore::EmbeddedStore;
use calix_agent::ipam::Pool;
use calix_agent::{grpc, paths};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "calix-agent", version, about = "calix node agent")]
struct Flags {
    /// Config file (TOML). Missing is fine at the default path.
    #[arg(long, short = 'c', env = "CALIX_CONFIG")]
    config: Option<PathBuf>,
    /// This node's name (default: config, then the hostname).
    #[arg(long)]
    node_name: Option<String>,
    /// gRPC unix socket.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Embedded datastore file.
    #[arg(long)]
    datastore_path: Option<PathBuf>,
    /// `ebpf` or `kernel`.
    #[arg(long)]
    dataplane: Option<DataplaneMode>,
    /// Replace the configured pools with this one (repeatable), e.g. 10.244.0.0/16.
    #[arg(long = "pool")]
    pools: Vec<ipnet::IpNet>,
    /// Log filter, e.g. info or calix_agent=debug.
    #[arg(long)]
    log_level: Option<String>,
}

fn config(flags: Flags) -> Result<AgentConfig> {
    let (path, required) = match &flags.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(paths::CONFIG_FILE), false),
    };
    let mut c = AgentConfig::load(&path, required)?;
    if let Some(v) = flags.node_name {
        c.node_name = v;
    }
    if c.node_name.is_empty() {
        c.node_name = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_default();
    }
    if let Some(v) = flags.socket {
        c.socket = v;
    }
    if let Some(v) = flags.datastore_path {
        c.datastore.path = v;
    }
    if let Some(v) = flags.dataplane {
        c.dataplane = v;
    }
    if !flags.pools.is_empty() {
        c.pools = flags.pools.into_iter().map(PoolConfig::new).collect();
    }
    if let Some(v) = flags.log_level {
        c.log_level = v;
    }
    c.validate()?;
    Ok(c)
}

/// Pods reach each other and the node through this node's forwarding.
fn enable_forwarding() -> Result<()> {
    for (path, value) in [
        ("/proc/sys/net/ipv4/ip_forward", "1"),
        ("/proc/sys/net/ipv6/conf/all/forwarding", "1"),
    ] {
        std::fs::write(path, value).with_context(|| format!("cannot set {path}={value}"))?;
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let cfg = config(Flags::parse())?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cfg.log_level)
                .with_context(|| format!("bad log_level {:?}", cfg.log_level))?,
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    tracing::info!(node = %cfg.node_name, dataplane = ?cfg.dataplane, pools = ?cfg.pools.iter().map(|p| p.cidr.to_string()).collect::<Vec<_>>(), "starting calix-agent");

    enable_forwarding()?;
    let store = EmbeddedStore::open(&cfg.datastore.path)?;
    let dataplane: Box<dyn Dataplane> = match cfg.dataplane {
        DataplaneMode::Ebpf => Box::new(
            EbpfDataplane::load()
                .context("cannot load the eBPF dataplane (try dataplane = \"kernel\")")?,
        ),
        DataplaneMode::Kernel => Box::new(KernelDataplane),
    };
    let pools = cfg
        .pools
        .iter()
        .map(|p| Pool {
            cidr: p.cidr,
            block_size: p.block_size(),
            disabled: p.disabled,
        })
        .collect();
    let agent = Arc::new(Agent::new(
        cfg.node_name.clone(),
        pools,
        Box::new(store),
        dataplane,
    )?);
    agent.resync().await;
    grpc::serve_unix(agent.clone(), &cfg.socket, shutdown_signal())
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            )
        })?;
    agent.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}
