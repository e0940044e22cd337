//! calix-agent: flags and config, then the pieces wired together, then run until SIGTERM.
//! What each piece does lives in the library; this file only connects them.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use calix_agent::config::{AgentConfig, CertSource, DataplaneMode, PoolConfig};
use calix_agent::dataplane::ebpf::EbpfConfig;
use calix_agent::dataplane::{
    self, cleaner, host_addrs, Dataplane, EbpfDataplane, KernelDataplane,
};
use calix_agent::endpoints::EndpointRegistry;
use calix_agent::instance::InstanceLock;
use calix_agent::ipam::service::Housekeeping;
use calix_agent::ipam::IpamService;
use calix_agent::k8s::certificates;
use calix_agent::k8s::cluster::Cluster;
use calix_agent::k8s::events::EventRecorder;
use calix_agent::k8s::owner::{Owner, Stop};
use calix_agent::k8s::podipam::PodIpamSource;
use calix_agent::k8s::pods::{self, PodsConfig};
use calix_agent::model::NodeRecord;
use calix_agent::node::mtu::PodMtu;
use calix_agent::node::Node;
use calix_agent::reconcile::driver::{Driver, Timing};
use calix_agent::reconcile::remote::Underlay;
use calix_agent::reconcile::Backoff;
use calix_agent::{datastore, grpc, metrics, paths, routes, tasks, uninstall};
use calix_kernel::host::NetlinkHost;
use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(name = "calix-agent", version, about = "calix node agent")]
struct Flags {
    /// Config file (TOML). Missing is fine at the default path.
    #[arg(long, short = 'c', env = "CALIX_CONFIG")]
    config: Option<PathBuf>,
    /// This node's name (default: $CALIX_NODE_NAME, $NODE_NAME — a DaemonSet sets one from
    /// the downward API, spec.nodeName —, then the config, then the hostname).
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
    /// prefilter included), map entries and pins, the kernel mode's nftables tables and
    /// calix's VXLAN devices (with the routes through them), then exit. Pods keep their
    /// routes (kernel forwarding), and so do direct routes to other nodes.
    #[arg(long)]
    uninstall: bool,
    /// With --uninstall: also every route calix added (pods' host routes, routes to other
    /// nodes) and the CNI config named by --cni-conf. Pods still running lose their network.
    #[arg(long, requires = "uninstall")]
    all: bool,
    /// The CNI network config (conflist) calix's install-cni wrote on this node, removed by
    /// `--uninstall --all` and when the agent's DaemonSet is deleted.
    #[arg(long)]
    cni_conf: Option<PathBuf>,
    /// `<namespace>/<name>` of the DaemonSet running this agent (kubernetes datastore; the
    /// chart sets it). When the agent stops because that DaemonSet was deleted (`helm
    /// uninstall`), it uninstalls calix from the node as `--uninstall --all` does; any other
    /// stop (a rolling update) leaves everything for the next agent.
    #[arg(long)]
    owner_daemonset: Option<calix_agent::k8s::owner::OwnerRef>,
    /// `<namespace>/<name>` of another DaemonSet of the same release (repeatable; the chart
    /// names the route reflectors' and everyone else's): while one of them stays, the deletion
    /// of --owner-daemonset is a topology switch (that DaemonSet takes the node over), not an
    /// uninstall.
    #[arg(long, requires = "owner_daemonset")]
    sibling_daemonset: Vec<calix_agent::k8s::owner::OwnerRef>,
}

/// The config file, overridden by the flags (and the node name's environment variables),
/// merged with the cluster's part once it is loaded (the `kubernetes` datastore: IPPools,
/// this node's Node, ServiceCIDRs).
fn config(flags: Flags, cluster: Option<&Cluster>) -> Result<AgentConfig> {
    // (Called again on SIGHUP and cluster changes with the same flags: flags keep overriding
    // the file.)
    let (path, required) = match &flags.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(paths::CONFIG_FILE), false),
    };
    let mut c = AgentConfig::load(&path, required)?;
    c.node_name = calix_agent::k8s::node_name(
        flags.node_name,
        |k| std::env::var(k).ok(),
        &c.node_name,
        || {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
        },
    );
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
        c.pools_configured = true;
    }
    if let Some(cluster) = cluster.filter(|_| c.datastore.is_kubernetes()) {
        cluster.apply(&mut c);
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

fn main() -> Result<()> {
    // Before the runtime's threads exist (calix_agent::memory).
    calix_agent::memory::configure_allocator();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run())
}

async fn run() -> Result<()> {
    let flags = Flags::parse();
    let mut cfg = config(flags.clone(), None)?;
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
    let mut ebpf_cfg = EbpfConfig {
        pin_root: cfg.bpf_pin_root.clone(),
        node: cfg.node_name.clone(),
        uplinks: cfg.uplinks.clone(),
        object: flags.bpf_object.clone(),
        xdp: cfg.xdp_settings()?,
        nat: Some(cfg.nat_settings()?),
        tc_attach: cfg.tc_attach,
        doors: cfg.door_policy(),
    };
    // Before anything is touched: one agent per node (an uninstall while one runs would pull
    // its programs from under it).
    let _instance = InstanceLock::acquire(&cfg.socket)?;
    let uninstall_scope = uninstall::Scope {
        all: true,
        cni_conf: flags.cni_conf.clone(),
    };
    if flags.uninstall {
        let scope = uninstall::Scope {
            all: flags.all,
            ..uninstall_scope
        };
        uninstall::node(&ebpf_cfg, &scope).await?;
        return Ok(());
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
    dataplane::enable_forwarding()?;
    let opened = datastore::open(&cfg.datastore)
        .await
        .with_context(|| format!("cannot open the {} datastore", cfg.datastore.kind))?;
    let store = opened.store;
    // With the kubernetes datastore the pools are the IPPool objects, and the node's labels
    // and addresses and the Service CIDRs come from the cluster too: read them now (the
    // dataplane's SNAT settings need them), follow them once the agent runs.
    let cluster = if cfg.datastore.is_kubernetes() {
        let (cluster, followers) = Cluster::load(store.clone(), &cfg.node_name)
            .await
            .context("cannot read the IPPools, Nodes and ServiceCIDRs")?;
        cfg = config(flags.clone(), Some(&cluster))
            .context("the cluster's IPPools, Node and ServiceCIDRs")?;
        ebpf_cfg.nat = Some(cfg.nat_settings()?);
        ebpf_cfg.doors = cfg.door_policy();
        tracing::info!(pools = ?cfg.node_pools().iter().map(|p| p.cidr.to_string()).collect::<Vec<_>>(),
            labels = ?cfg.node_labels, service_cidrs = ?cfg.nat.service_cidrs,
            node_addresses = ?cfg.routes.node_addresses, "from the cluster");
        Some((cluster, followers))
    } else {
        None
    };
    // Route distribution's TLS material: the files, read now; or this node's certificate
    // asked of the Kubernetes API from now on (usually in place long before the routes start).
    let routes_tls = routes::task::tls_for(&cfg).context("route distribution ([routes.tls])")?;
    if let (Some(live), CertSource::Kubernetes) = (&routes_tls, cfg.routes.tls.source) {
        let client = match opened.kube.clone() {
            Some(c) => c,
            None => datastore::kubernetes::connect(&datastore::KubeConfig {
                kubeconfig: None,
                timeout: Duration::from_secs(10),
                attempts: 1,
            })
            .await
            .context("routes.tls.source = \"kubernetes\" needs the Kubernetes API")?,
        };
        certificates::spawn(
            client,
            certificates::Settings::from_config(&cfg.node_name, &cfg.routes.tls),
            live.clone(),
        );
    }
    let pin_dir = ebpf_cfg.pin_dir();
    let ebpf_uninstall = ebpf_cfg.clone();
    let dataplane: Box<dyn Dataplane> = match cfg.dataplane {
        DataplaneMode::Ebpf => Box::new(
            EbpfDataplane::load(ebpf_cfg)
                .context("cannot load the eBPF dataplane (try dataplane = \"kernel\")")?,
        ),
        DataplaneMode::Kernel => Box::new(
            KernelDataplane::start(&cfg.nat_settings()?, cfg.door_policy())
                .context("kernel mode: cannot set up its nftables tables")?,
        ),
    };
    let stats = dataplane.stats()?;
    let driver = Driver::spawn(
        NetlinkHost::new,
        dataplane,
        Underlay::from_config(&cfg),
        Timing {
            resync: Duration::from_secs(cfg.resync_interval_secs),
            backoff: Backoff::default(),
        },
    )?;
    // Route distribution: what peers need of this node goes into its record.
    let mut addresses = host_addrs::record_addresses();
    // In Kubernetes the node's InternalIPs first: what the cluster knows it by.
    if let Some(node) = cluster.as_ref().and_then(|(c, _)| c.node()) {
        let mut known: Vec<String> = node
            .internal_ips()
            .iter()
            .map(ToString::to_string)
            .collect();
        for a in addresses {
            if !known.contains(&a) {
                known.push(a);
            }
        }
        addresses = known;
    }
    let routes_start = match cfg.routes.enabled {
        true => Some(
            routes::task::Start::from_config(&cfg, &addresses, routes_tls.clone())
                .await
                .context("route distribution ([routes]) cannot start")?,
        ),
        false => None,
    };
    if let Some(s) = &routes_start {
        addresses = routes::task::record_addresses(addresses, &s.next_hops);
    }
    let record = NodeRecord {
        name: cfg.node_name.clone(),
        addresses,
        labels: cfg.node_labels.clone(),
        agent_version: env!("CARGO_PKG_VERSION").into(),
        routes_endpoint: routes_start
            .as_ref()
            .map(|s| s.endpoint.clone())
            .unwrap_or_default(),
        reflector: routes_start.as_ref().is_some_and(|s| s.cfg.reflector),
    };
    let remote_routes = driver.clone();
    let housekeeping = Housekeeping {
        leak_grace: Duration::from_secs(cfg.ipam.leak_grace_secs),
        empty_block_grace: Duration::from_secs(cfg.ipam.empty_block_grace_secs),
    };
    let ipam = IpamService::new(
        record,
        cfg.node_pools(),
        cfg.ipam.policy(),
        housekeeping,
        store.clone(),
    )
    .await?;
    let endpoints = EndpointRegistry::load(&cfg.node_name, store.clone(), driver, stats).await?;
    let node = Arc::new(Node::new(ipam, endpoints));
    node.set_pod_mtu(PodMtu::from_config(&cfg));
    // Whether a stop is a restart or an uninstall (see k8s::owner), followed from now on.
    let owner = match (flags.owner_daemonset.clone(), opened.kube.clone()) {
        (Some(o), Some(client)) => Some(Owner::spawn(client, o, flags.sibling_daemonset.clone())),
        (Some(_), None) => anyhow::bail!("--owner-daemonset needs the kubernetes datastore"),
        (None, _) => None,
    };
    if let Some(client) = opened.kube.clone() {
        node.notices.set(Arc::new(EventRecorder::spawn(
            client,
            cfg.node_name.clone(),
        )));
    }
    // What the start found wrong with the stored blocks (later: each housekeeping pass).
    node.notice_ignored_blocks().await;
    // The initial sync: every recorded endpoint programmed, then the sweep.
    let pools = node.ipam.pools().iter().map(|p| p.cidr).collect();
    node.endpoints.start(pools).await?;
    tasks::spawn_housekeeping(
        node.clone(),
        Duration::from_secs(cfg.ipam.leak_check_interval_secs),
    );
    if cfg.dataplane == DataplaneMode::Ebpf {
        node.set_conntrack(pin_dir.clone(), cfg.nat_settings()?.program_config(&[]));
        cleaner::spawn(pin_dir, cfg.nat_settings()?);
    }
    let reread_flags = flags.clone();
    let (cluster, cluster_changes) = match cluster {
        Some((cluster, followers)) => {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            cluster.spawn_follow(followers, tx);
            // The Pods bound to this node: who each endpoint is, and the cleanup of the
            // endpoints of pods that are gone (also those deleted while the agent was down).
            let (pods, follower) = pods::load(store.clone(), &cfg.node_name)
                .await
                .context("cannot read this node's Pods")?;
            let _ = node.pods.set(pods.clone());
            let _ = node.pod_ipam.set(PodIpamSource::new(
                store.clone(),
                &cfg.node_name,
                cluster.clone(),
            ));
            pods::spawn(
                pods,
                follower,
                node.clone(),
                store.clone(),
                PodsConfig {
                    grace: Duration::from_secs(cfg.kubernetes.pod_gone_grace_secs),
                    every: Duration::from_secs(cfg.kubernetes.pod_check_interval_secs),
                },
            );
            (Some(cluster), Some(rx))
        }
        None => (None, None),
    };
    let routes_handle = Arc::new(std::sync::OnceLock::new());
    tasks::spawn_reload(
        node.clone(),
        move || config(reread_flags.clone(), cluster.as_ref()),
        cfg.clone(),
        cluster_changes,
        routes_handle.clone(),
    );
    let routes = match routes_start {
        Some(mut s) => Some(Arc::new({
            // The pools IPAM works with: a block it retains under a refused pool change is
            // still this node's to advertise.
            s.blocks = node.ipam.pools();
            routes::task::start(s, store, Arc::new(remote_routes))
                .await
                .context("route distribution ([routes]) cannot start")?
        })),
        None => None,
    };
    if let Some(r) = &routes {
        http.set_routes(r.clone());
        let _ = routes_handle.set(r.clone());
    }
    let socket = grpc::UnixSocket::bind(&cfg.socket)?;
    // Ready: synced, and the plugin can connect.
    http.set_ready(node.clone());
    socket
        .serve(node.clone(), routes.clone(), tasks::shutdown_signal())
        .await?;
    // Asked first, while the agent may still ask (see k8s::owner).
    let stop = match &owner {
        Some(o) => o.on_stop().await,
        None => Stop::Restart,
    };
    // Peers see this agent's streams end and keep its routes for their grace period.
    if let Some(r) = &routes {
        r.shutdown().await;
    }
    node.endpoints.shutdown().await;
    if stop == Stop::Uninstall {
        uninstall::node(&ebpf_uninstall, &uninstall_scope).await?;
    }
    tracing::info!("stopped");
    Ok(())
}
