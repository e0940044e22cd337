//! calix-agent: config → build → run until SIGTERM/SIGINT.
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use std::time::Duration;

use calix_agent::agent::{Agent, Housekeeping};
use calix_agent::config::{AgentConfig, DataplaneMode, PoolConfig};
use calix_agent::dataplane::ebpf::EbpfConfig;
use calix_agent::dataplane::{antispoof, cleaner, host_addrs, masquerade, nat, xdp};
use calix_agent::dataplane::{Dataplane, EbpfDataplane, KernelDataplane};
use calix_agent::datastore::{Datastore, EmbeddedStore, EtcdStore};
use calix_agent::model::NodeRecord;
use calix_agent::{grpc, metrics, paths};
use clap::Parser;

#[derive(Parser, Debug, Clone)]
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
    /// bpffs directory for pins (this node's go below it).
    #[arg(long)]
    bpf_pin_root: Option<PathBuf>,
    /// Load the eBPF programs from this object file instead of the built-in ones.
    #[arg(long)]
    bpf_object: Option<PathBuf>,
    /// Remove this node's eBPF programs (from every cali* interface and the uplinks, the XDP
    /// prefilter included), map entries and pins, and the kernel mode's nftables tables, then
    /// exit. Pods keep their routes (kernel forwarding).
    #[arg(long)]
    uninstall: bool,
}

fn config(flags: Flags) -> Result<AgentConfig> {
    // (Called again on SIGHUP with the same flags: flags keep overriding the file.)
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
    if let Some(v) = flags.bpf_pin_root {
        c.bpf_pin_root = v;
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

/// This node's own addresses for its node record: global-scope addresses of every interface
/// but loopback and pod veths.
fn node_addresses() -> Vec<String> {
    let Ok(addrs) = host_addrs::interface_addresses() else {
        return Vec::new();
    };
    let mut out: Vec<String> = addrs
        .into_iter()
        .filter(|(ifname, _)| !ifname.starts_with("cali") && ifname != "lo")
        .filter_map(|(_, ip)| {
            let link_local = match ip {
                std::net::IpAddr::V4(v4) => v4.is_link_local(),
                std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
            };
            (!link_local && !ip.is_loopback()).then(|| ip.to_string())
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// `--uninstall`: filters off every cali* interface and the uplinks, XDP off the uplinks, pins
/// and the kernel mode's nftables tables removed.
fn uninstall_dataplane(cfg: &EbpfConfig) -> Result<()> {
    let mut n = 0;
    for i in nix::net::if_::if_nameindex()?.iter() {
        let name = i.name().to_string_lossy().into_owned();
        if name.starts_with("cali") || cfg.uplinks.contains(&name) {
            EbpfDataplane::detach_filters(&name);
            n += 1;
        }
    }
    let xdp_links = xdp::detach_except(&cfg.xdp_links_dir(), &[]);
    if let Err(e) = masquerade::remove() {
        tracing::warn!(error = %e, "cannot remove the kernel-mode masquerade table");
    }
    if let Err(e) = antispoof::remove() {
        tracing::warn!(error = %e, "cannot remove the kernel-mode anti-spoofing table");
    }
    let dir = cfg.node_dir();
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot remove {}", dir.display())),
    }
    tracing::info!(interfaces = n, xdp_links, pins = %dir.display(), "eBPF dataplane uninstalled");
    Ok(())
}

/// Opens the configured datastore.
async fn open_store(cfg: &AgentConfig) -> Result<Box<dyn Datastore>> {
    Ok(match cfg.datastore.kind.as_str() {
        "etcd" => Box::new(
            EtcdStore::connect(cfg.datastore.etcd())
                .await
                .with_context(|| format!("cannot reach etcd at {:?}", cfg.datastore.endpoints))?,
        ),
        _ => Box::new(EmbeddedStore::open(&cfg.datastore.path)?),
    })
}

/// Leak GC and empty-block release, every `leak_check_interval_secs`.
fn spawn_housekeeping(agent: Arc<Agent>, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match agent.housekeep(std::time::Instant::now()).await {
                Ok(s) => tracing::debug!(
                    released = s.released.len(),
                    candidates = s.candidates,
                    blocks_released = s.blocks_released.len(),
                    "housekeeping pass"
                ),
                Err(e) => tracing::warn!(error = %e, "housekeeping pass failed"),
            }
        }
    });
}

/// SIGHUP: re-read the config file and apply pool changes that are safe, and the XDP
/// prefilter's deny list and failsafe ports (in its maps; the attachment stays). `started` is
/// the config the agent started with: what only a restart applies is compared against it.
fn spawn_reload(
    agent: Arc<Agent>,
    flags: Flags,
    started: AgentConfig,
    mut xdp_filter: Option<xdp::XdpFilter>,
    mut nat_maps: Option<nat::NatMaps>,
) {
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot listen for SIGHUP: config reload disabled");
            return;
        };
        while hup.recv().await.is_some() {
            let cfg = match config(flags.clone()) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), "SIGHUP: config rejected; keeping the running one");
                    continue;
                }
            };
            if let Err(e) = agent.set_pools(cfg.node_pools(), cfg.ipam.policy()).await {
                tracing::error!(error = %e, "SIGHUP: pool change rejected; keeping the running pools");
            }
            reload_xdp(xdp_filter.as_mut(), &cfg, &started);
            reload_nat(nat_maps.as_mut(), &cfg, started.dataplane);
        }
    });
}

/// SIGHUP: the no-SNAT destinations (pools and `non_masquerade_cidrs`). Ports, timeouts and
/// which pools translate take effect at the next start. Kernel mode re-applies its nftables
/// masquerade whole (which pools translate included).
fn reload_nat(maps: Option<&mut nat::NatMaps>, cfg: &AgentConfig, mode: DataplaneMode) {
    if mode == DataplaneMode::Kernel {
        // (Also puts back the anti-spoofing table if something flushed the ruleset.)
        if let Err(e) = antispoof::apply() {
            tracing::error!(error = %e, "SIGHUP: cannot apply pod anti-spoofing");
        }
        match cfg.nat_settings() {
            Ok(s) => match masquerade::apply(&s) {
                Ok(()) => tracing::info!("SIGHUP: masquerade reloaded"),
                Err(e) => tracing::error!(error = %e, "SIGHUP: cannot apply the masquerade"),
            },
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: [nat] rejected; keeping the running one")
            }
        }
        return;
    }
    let Some(maps) = maps else {
        return;
    };
    match cfg.nat_settings() {
        Ok(s) => {
            match maps.set_no_snat(&s.untranslated()) {
                Ok(()) => tracing::info!("SIGHUP: SNAT exclusions and service_cidrs reloaded"),
                Err(e) => tracing::error!(error = %format!("{:#}", anyhow::Error::new(e)),
                    "SIGHUP: cannot update the SNAT exclusions"),
            }
            if let Err(e) = masquerade::apply_stack(&s) {
                tracing::error!(error = %e, "SIGHUP: cannot apply the host stack's masquerade");
            }
        }
        Err(e) => tracing::error!(error = %e, "SIGHUP: [nat] rejected; keeping the running one"),
    }
}

fn reload_xdp(filter: Option<&mut xdp::XdpFilter>, cfg: &AgentConfig, started: &AgentConfig) {
    let restart_only = |c: &AgentConfig| (c.xdp.enabled, c.xdp.mode, c.uplinks.clone());
    if restart_only(cfg) != restart_only(started) {
        tracing::warn!(
            "SIGHUP: xdp.enabled, xdp.mode and uplinks changed; they take effect when the agent restarts"
        );
    }
    let policy = match cfg.xdp_policy() {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: XDP policy rejected; keeping the running one");
            return;
        }
    };
    let Some(filter) = filter else {
        return; // The prefilter is off.
    };
    match filter.set_policy(&policy) {
        Ok(()) => tracing::info!("SIGHUP: XDP deny list and failsafe ports reloaded"),
        Err(e) => tracing::error!(error = %format!("{:#}", anyhow::Error::new(e)),
            "SIGHUP: cannot update the XDP prefilter's maps"),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let flags = Flags::parse();
    let uninstall = flags.uninstall;
    let bpf_object = flags.bpf_object.clone();
    let cfg = config(flags.clone())?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cfg.log_level)
                .with_context(|| format!("bad log_level {:?}", cfg.log_level))?,
        )
        // Control characters in logged values (pod names...) are escaped: one event, one line.
        .with_writer(calix_log::Escaping(std::io::stderr))
        .with_ansi(false)
        .init();
    tracing::info!(node = %cfg.node_name, dataplane = ?cfg.dataplane, datastore = %cfg.datastore.kind,
        pools = ?cfg.node_pools().iter().map(|p| p.cidr.to_string()).collect::<Vec<_>>(), "starting calix-agent");

    let ebpf_cfg = EbpfConfig {
        pin_root: cfg.bpf_pin_root.clone(),
        node: cfg.node_name.clone(),
        uplinks: cfg.uplinks.clone(),
        object: bpf_object,
        xdp: cfg.xdp_settings()?,
        nat: Some(cfg.nat_settings()?),
    };
    // Before anything is touched: one agent per node (an uninstall while one runs would pull
    // its programs from under it).
    let _instance = calix_agent::instance::InstanceLock::acquire(&cfg.socket)?;
    if uninstall {
        return uninstall_dataplane(&ebpf_cfg);
    }
    // The HTTP door comes up first: /healthz and /readyz answer 503 until the initial sync.
    let http = Arc::new(metrics::HttpState::default());
    if !cfg.metrics_addr.is_empty() {
        metrics::spawn(
            http.clone(),
            cfg.metrics_addr.clone(),
            metrics::HttpLimits::default(),
        );
    }
    enable_forwarding()?;
    let store = open_store(&cfg).await?;
    let pin_dir = ebpf_cfg.pin_dir();
    let (dataplane, xdp_filter, nat_maps): (Box<dyn Dataplane>, _, _) = match cfg.dataplane {
        DataplaneMode::Ebpf => {
            let mut dp = EbpfDataplane::load(ebpf_cfg)
                .context("cannot load the eBPF dataplane (try dataplane = \"kernel\")")?;
            let xdp_filter = dp.take_xdp();
            let nat_maps = dp.take_nat();
            // What the programs leave to the host stack (Service traffic it DNATs out of the
            // node, fragments, other protocols) is masqueraded there, on ports the programs
            // never hand out.
            masquerade::apply_stack(&cfg.nat_settings()?)
                .context("cannot set up the host stack's natOutgoing masquerade")?;
            // A table a kernel-mode run left behind: the programs guard the pods now.
            if let Err(e) = antispoof::remove() {
                tracing::warn!(error = %e, "cannot remove a kernel-mode anti-spoofing table");
            }
            (Box::new(dp), xdp_filter, nat_maps)
        }
        DataplaneMode::Kernel => {
            antispoof::apply().context("kernel mode: cannot set up pod anti-spoofing")?;
            masquerade::apply(&cfg.nat_settings()?)
                .context("kernel mode: cannot set up the natOutgoing masquerade")?;
            (Box::new(KernelDataplane), None, None)
        }
    };
    let node = NodeRecord {
        name: cfg.node_name.clone(),
        addresses: node_addresses(),
        labels: cfg.node_labels.clone(),
        agent_version: env!("CARGO_PKG_VERSION").into(),
    };
    let housekeeping = Housekeeping {
        leak_grace: Duration::from_secs(cfg.ipam.leak_grace_secs),
        empty_block_grace: Duration::from_secs(cfg.ipam.empty_block_grace_secs),
    };
    let agent = Arc::new(
        Agent::new(
            node,
            cfg.node_pools(),
            cfg.ipam.policy(),
            housekeeping,
            store,
            dataplane,
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    agent.resync().await;
    spawn_housekeeping(
        agent.clone(),
        Duration::from_secs(cfg.ipam.leak_check_interval_secs),
    );
    if cfg.dataplane == DataplaneMode::Ebpf {
        agent.set_conntrack(pin_dir.clone(), cfg.nat_settings()?.program_config(&[]));
        cleaner::spawn(pin_dir, cfg.nat_settings()?);
    }
    spawn_reload(agent.clone(), flags, cfg.clone(), xdp_filter, nat_maps);
    let socket = grpc::UnixSocket::bind(&cfg.socket)?;
    // Ready: synced, and the plugin can connect.
    http.set_ready(agent.clone());
    socket.serve(agent.clone(), shutdown_signal()).await?;
    agent.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}
