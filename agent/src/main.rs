//! calix-agent: flags and config, then the pieces wired together, then run until SIGTERM.
//! What each piece does lives in the library; this file only connects them.
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use calix_agent::bgp::peer_task::Stop as BgpStop;
use calix_agent::bgp::speaker;
use calix_agent::config::flags::{self, Flags};
use calix_agent::config::DataplaneMode;
use calix_agent::distribution::tls::CertSource;
use calix_agent::endpoints::EndpointRegistry;
use calix_agent::instance::InstanceLock;
use calix_agent::ipam::IpamService;
use calix_agent::kubernetes::certificates;
use calix_agent::kubernetes::cluster::Cluster;
use calix_agent::kubernetes::directory::KubePods;
use calix_agent::kubernetes::events::EventRecorder;
use calix_agent::kubernetes::owner::{Owner, Stop};
use calix_agent::kubernetes::podipam::PodIpamSource;
use calix_agent::kubernetes::pods;
use calix_agent::kubernetes::policy::watch as policy_watch;
use calix_agent::kubernetes::services::watch as services_watch;
use calix_agent::pod_network::Node;
use calix_agent::policy::PolicyService;
use calix_agent::reconcile::driver::{Driver, Timing};
use calix_agent::reconcile::Backoff;
use calix_agent::remote_routes::{RemoteSources, Source};
use calix_agent::services::ServicesService;
use calix_agent::{distribution, local_api, metrics, tasks, uninstall};
use calix_core::model::NodeRecord;
use calix_dataplane::{self, cleaner, host_addrs, Dataplane, EbpfDataplane, KernelDataplane};
use calix_kernel::host::NetlinkHost;
use clap::Parser;

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
    let mut cfg = flags::read(flags.clone(), None)?;
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
    let mut ebpf_cfg = cfg.ebpf_config(flags.bpf_object.clone())?;
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
    calix_dataplane::enable_forwarding()?;
    let opened = calix_datastore::open(&cfg.datastore.backend())
        .await
        .with_context(|| format!("cannot open the {} datastore", cfg.datastore.kind))?;
    let store = opened.store;
    // NetworkPolicy's first listings (every Pod of the cluster: the longest read at start) go
    // on while the agent reads the rest and loads the dataplane.
    let policy_listings = cfg
        .datastore
        .is_kubernetes()
        .then(|| tokio::spawn(policy_watch::load(store.clone())));
    // With the kubernetes datastore the pools are the IPPool objects, and the node's labels
    // and addresses and the Service CIDRs come from the cluster too: read them now (the
    // dataplane's SNAT settings need them), follow them once the agent runs.
    let cluster = if cfg.datastore.is_kubernetes() {
        let (cluster, followers) = Cluster::load(store.clone(), &cfg.node_name, cfg.bgp.enabled)
            .await
            .context("cannot read the IPPools, Nodes and ServiceCIDRs")?;
        cfg = flags::read(flags.clone(), Some(&cluster))
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
    let routes_settings = cfg.routes_settings()?;
    let routes_tls = distribution::task::tls_for(
        &cfg.node_name,
        routes_settings.as_ref().and_then(|s| s.tls.as_ref()),
    )
    .context("route distribution ([routes.tls])")?;
    if let (Some(live), CertSource::Kubernetes) = (&routes_tls, cfg.routes.tls.source) {
        let client = match opened.kube.clone() {
            Some(c) => c,
            None => calix_datastore::kubernetes::connect(&calix_datastore::KubeConfig {
                kubeconfig: None,
                timeout: Duration::from_secs(10),
                attempts: 1,
            })
            .await
            .context("routes.tls.source = \"kubernetes\" needs the Kubernetes API")?,
        };
        certificates::spawn(client, cfg.certificate_settings(), live.clone());
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
    // The Services counters are read apart from the endpoints' (each reader its own maps).
    let service_stats = dataplane.stats()?;
    // Drop events are a view: without them (kernel mode's log group taken by another
    // listener) the agent runs, and `calixctl monitor --drops` says why.
    let policy_events = dataplane.policy_events().unwrap_or_else(|e| {
        tracing::warn!(error = %format!("{:#}", anyhow::Error::from(e)), "policy drop events unavailable");
        None
    });
    let driver = Driver::spawn(
        NetlinkHost::new,
        dataplane,
        cfg.underlay(),
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
    // Where the peers come from: the agents' node records, or Kubernetes' Nodes.
    let peers: Arc<dyn distribution::nodes::NodeSource> = match cfg.peering()? {
        Some(p) => Arc::new(p),
        None => Arc::new(distribution::nodes::Records),
    };
    let routes_start = match routes_settings {
        Some(s) => Some(
            distribution::task::Start::new(s, &addresses, routes_tls.clone(), peers)
                .await
                .context("route distribution ([routes]) cannot start")?,
        ),
        None => None,
    };
    if let Some(s) = &routes_start {
        addresses = distribution::task::record_addresses(addresses, &s.next_hops);
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
        reflector: routes_start.as_ref().is_some_and(|s| s.reflector),
    };
    // The routes to other nodes' pods: route distribution's and the BGP speaker's, merged.
    let bgp_settings = cfg.bgp_settings()?;
    let running: Vec<Source> = [
        (routes_start.is_some(), Source::Distribution),
        (bgp_settings.is_some(), Source::Bgp),
    ]
    .into_iter()
    .filter_map(|(on, s)| on.then_some(s))
    .collect();
    let remote_routes = RemoteSources::new(Arc::new(driver.clone()), &running);
    let policy_driver = driver.clone();
    let services_driver = driver.clone();
    let ipam = IpamService::new(
        record,
        cfg.node_pools(),
        cfg.ipam.policy(),
        cfg.housekeeping(),
        store.clone(),
    )
    .await?;
    let endpoints = EndpointRegistry::load(&cfg.node_name, store.clone(), driver, stats).await?;
    let node = Arc::new(Node::new(ipam, endpoints));
    node.set_pod_mtu(cfg.pod_mtu());
    // Whether a stop is a restart or an uninstall (see kubernetes::owner), followed from now on.
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
    tasks::report_refused_pools(&node, &cfg.refused_pools);
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
            let _ = node.pods.set(Arc::new(KubePods {
                pods: pods.clone(),
                ipam: PodIpamSource::new(store.clone(), &cfg.node_name, cluster.clone()),
            }));
            pods::spawn(
                pods,
                follower,
                node.clone(),
                store.clone(),
                cfg.pods_config(),
            );
            (Some(cluster), Some(rx))
        }
        None => (None, None),
    };
    // NetworkPolicy (Kubernetes mode): namespaces, every pod and the policies, followed and
    // calculated for this node's pods (calixctl policy), and programmed into the dataplane
    // once the first listings are in (until then the pinned policy stays as it was).
    let policy = if let Some(listings) = policy_listings {
        let watches = listings
            .await
            .context("the NetworkPolicy listings' task")?
            .context("cannot read the Namespaces, Pods and NetworkPolicies")?;
        let service = Arc::new(PolicyService::new(&cfg.node_name));
        http.set_policy(service.clone());
        let (changed, follow) = tokio::sync::watch::channel(0u64);
        policy_watch::spawn(watches, service.clone(), cfg.node_name.clone(), changed);
        tokio::spawn(calix_agent::policy::program(service.clone(), follow, {
            let node = node.clone();
            move |t| {
                let (driver, node) = (policy_driver.clone(), node.clone());
                async move {
                    let r = driver.set_policy(t).await;
                    if let Err(e) = &r {
                        calix_agent::policy::notice_not_programmed(&node.notices, e);
                    }
                    r
                }
            }
        }));
        Some(service)
    } else {
        None
    };
    // Services (Kubernetes mode, `[services] enabled`): followed and calculated for this node
    // (calixctl services); not programmed yet.
    let services = if cfg.services.enabled && cfg.datastore.is_kubernetes() {
        let rules = calix_core::services::admit::Admission {
            external_cidrs: cfg.services_external_cidrs()?,
            node_addresses: cfg
                .routes
                .node_addresses
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect(),
            pools: node.ipam.pools().iter().map(|p| p.cidr).collect(),
        };
        let limits = calix_core::services::state::Limits {
            frontends: cfg.services.frontends as usize,
            backends: cfg.services.backends as usize,
        };
        let zone = cfg.node_labels.get("topology.kubernetes.io/zone").cloned();
        let service = Arc::new(ServicesService::new(
            &cfg.node_name,
            zone,
            rules.clone(),
            limits,
        ));
        let watches = services_watch::load(store.clone())
            .await
            .context("cannot read the Services and EndpointSlices")?;
        http.set_services(service.clone());
        let (changed, follow) = tokio::sync::watch::channel(0u64);
        if cfg.services.translate {
            if let Some(stats) = service_stats {
                service.set_counters(stats);
            }
            // kube-proxy's health check node ports, since it is not there to serve them.
            tokio::spawn(calix_agent::health_ports::serve(
                service.clone(),
                follow.clone(),
                calix_agent::health_ports::bind_all,
            ));
            let node_addresses = rules.node_addresses.clone();
            let driver = services_driver.clone();
            let pods = node.clone();
            tokio::spawn(calix_agent::services::program(
                service.clone(),
                node_addresses,
                follow,
                move |f| {
                    let driver = driver.clone();
                    let pods = pods.clone();
                    async move {
                        // Where clients' UDP sockets sent to a backend that goes are ended.
                        let clients = pods
                            .endpoints
                            .records()
                            .await
                            .into_iter()
                            .filter(|r| !r.netns.is_empty())
                            .map(|r| std::path::PathBuf::from(r.netns))
                            .collect();
                        driver.set_services(f, clients).await
                    }
                },
            ));
        }
        services_watch::spawn(
            watches,
            service.clone(),
            rules,
            {
                let node = node.clone();
                move |n| {
                    node.notices.warning(
                        n.reason,
                        calix_agent::notice::Subject::Service {
                            namespace: n.service.namespace,
                            name: n.service.name,
                        },
                        n.message,
                    )
                }
            },
            changed,
        );
        Some(service)
    } else {
        None
    };
    let routes_handle = Arc::new(std::sync::OnceLock::new());
    let bgp_handle = Arc::new(std::sync::OnceLock::new());
    let started = cfg.clone();
    tasks::spawn_reload(
        node.clone(),
        (
            started.refused_pools.clone(),
            started.bgp.refused_peers.clone(),
        ),
        move || Ok(flags::read(reread_flags.clone(), cluster.as_ref())?.reloaded(&started)?),
        cluster_changes,
        routes_handle.clone(),
        bgp_handle.clone(),
    );
    let routes = match routes_start {
        Some(mut s) => Some(Arc::new({
            // The pools IPAM works with: a block it retains under a refused pool change is
            // still this node's to advertise.
            s.blocks = node.ipam.pools();
            // Other nodes' `calixctl trace` asks this one for its pods' verdicts.
            s.verdicts = policy.clone().map(|policy| {
                Arc::new(calix_agent::policy::trace::PeerVerdicts {
                    node: node.clone(),
                    policy,
                }) as Arc<dyn distribution::server::Verdicts>
            });
            distribution::task::start(s, store.clone(), remote_routes.sink(Source::Distribution))
                .await
                .context("route distribution ([routes]) cannot start")?
        })),
        None => None,
    };
    if let Some(r) = &routes {
        http.set_routes(r.clone());
        let _ = routes_handle.set(r.clone());
    }
    // BGP with the data centre's routers: this node's blocks out, the peers' routes in.
    tasks::report_refused_bgp_peers(&node, &cfg.bgp.refused_peers);
    let bgp = match bgp_settings {
        Some(mut s) => {
            s.blocks = node.ipam.pools();
            let b = Arc::new(
                speaker::start(
                    s,
                    store.clone(),
                    remote_routes.sink(Source::Bgp),
                    node.notices.clone(),
                )
                .context("the BGP speaker ([bgp]) cannot start")?,
            );
            http.set_bgp(b.clone());
            let _ = bgp_handle.set(b.clone());
            Some(b)
        }
        None => None,
    };
    let socket = local_api::UnixSocket::bind(&cfg.socket)?;
    // Ready: synced, and the plugin can connect.
    http.set_ready(node.clone());
    let monitor = match policy_events {
        Some(events) => Some(
            calix_agent::policy::monitor::spawn(events, node.clone(), policy.clone())
                .context("cannot follow the policy drop events")?,
        ),
        None => None,
    };
    socket
        .serve(
            node.clone(),
            routes.clone(),
            calix_agent::local_api::Reports {
                bgp: bgp.clone(),
                services,
            },
            policy,
            monitor,
            tasks::shutdown_signal(),
        )
        .await?;
    // Asked first, while the agent may still ask (see kubernetes::owner).
    let stop = match &owner {
        Some(o) => o.on_stop().await,
        None => Stop::Restart,
    };
    // Peers see this agent's streams end and keep its routes for their grace period.
    if let Some(r) = &routes {
        r.shutdown().await;
    }
    // A restart leaves the routers this node's routes (graceful restart); an uninstall
    // withdraws them.
    if let Some(b) = &bgp {
        let how = match stop {
            Stop::Uninstall => BgpStop::ForGood,
            _ => BgpStop::Restart,
        };
        b.shutdown(how).await;
    }
    node.endpoints.shutdown().await;
    if stop == Stop::Uninstall {
        uninstall::node(&ebpf_uninstall, &uninstall_scope).await?;
    }
    tracing::info!("stopped");
    Ok(())
}
