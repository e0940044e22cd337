//! The agent's background loops, in one place: IPAM housekeeping, the reload (SIGHUP, IPPool
//! changes), and the shutdown signal. (The dataplane's own loops run on its driver thread, `reconcile::driver`,
//! and the SNAT conntrack cleaner in `dataplane::cleaner`.)
use std::sync::Arc;
use std::time::Duration;

use calix_core::ipam::{Policy, Pool};

use crate::pod_network::mtu::PodMtu;
use crate::pod_network::Node;
use calix_dataplane::Reload;

/// Leak GC, empty-block release and handle- and affinity-record repair, every `every`.
pub fn spawn_housekeeping(node: Arc<Node>, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match node.housekeep(std::time::Instant::now()).await {
                Ok(s) => tracing::debug!(
                    released = s.released.len(),
                    candidates = s.candidates,
                    blocks_released = s.blocks_released.len(),
                    handles_repaired = s.handles_repaired,
                    affinities_repaired = s.affinities_repaired,
                    "housekeeping pass"
                ),
                Err(e) => tracing::warn!(error = %e, "housekeeping pass failed"),
            }
        }
    });
}

/// How often a pool change that was refused (a pool under live addresses) is tried again when
/// the pools come from IPPool objects: it takes effect once it is safe.
const DEFERRED_POOLS_RETRY: Duration = Duration::from_secs(10);

/// What a reload applies: the settings read again (from the config file and flags, and the
/// cluster's part), and whether something changed that only a restart applies.
#[derive(Debug, Clone)]
pub struct Reloaded {
    /// Every pool as this node's allocator sees it.
    pub pools: Vec<Pool>,
    pub policy: Policy,
    pub pod_mtu: PodMtu,
    /// The XDP deny list and failsafe ports, SNAT's settings.
    pub dataplane: Reload,
    /// Something changed that only a restart applies (dataplane, tc_attach, uplinks,
    /// xdp.enabled, xdp.mode, resync_interval_secs, `[routes]`, `[vxlan]`, `bgp.enabled`, a
    /// pool's `vxlan`).
    pub needs_restart: bool,
    /// For the log: the Service CIDRs and this node's labels now.
    pub service_cidrs: Vec<String>,
    pub node_labels: std::collections::BTreeMap<String, String>,
    /// The cluster's IPPools not served, by name, with why.
    pub refused_pools: Vec<(String, String)>,
    /// The BGP speaker's settings (applied while it runs), and the BGPPeers refused.
    pub bgp: Option<crate::bgp::settings::BgpSettings>,
    pub refused_bgp_peers: Vec<(String, String)>,
}

/// Objects of the cluster refused (IPPools, BGPPeers): name, why.
pub type Refusals = Vec<(String, String)>;

/// Logs each BGPPeer of `refused` (name, why) and posts a Warning Event on the Node.
pub fn report_refused_bgp_peers(node: &Node, refused: &[(String, String)]) {
    for (name, why) in refused {
        tracing::error!(peer = %name, reason = %why, "BGPPeer refused; the other peers are used");
        node.notices.warning(
            "BGPPeerRefused",
            crate::notice::Subject::Node,
            format!("BGPPeer {name} is not used: {why}"),
        );
    }
}

/// Logs each IPPool of `refused` (name, why) and posts a Warning Event on the Node.
pub fn report_refused_pools(node: &Node, refused: &[(String, String)]) {
    for (name, why) in refused {
        tracing::error!(pool = %name, reason = %why, "IPPool refused; the other pools are served");
        node.notices.warning(
            "IPPoolRefused",
            crate::notice::Subject::Node,
            format!("IPPool {name} is not served: {why}"),
        );
    }
}

/// SIGHUP, or a change in the cluster (`cluster_changes`, with the `kubernetes` datastore:
/// IPPools, this node's Node, ServiceCIDRs; see `crate::kubernetes::cluster`): `reread` reads the
/// config again (the file, overridden by the same flags, merged with the cluster's part) into
/// what a reload applies ([`Reloaded`]); pool changes that are safe, the XDP deny list and
/// failsafe ports, the SNAT exclusions and Service CIDRs and the nftables tables are applied.
/// What only a restart applies is named in a warning. A pool change refused as unsafe is
/// tried again every [`DEFERRED_POOLS_RETRY`] until it applies or is undone; in the cluster, a
/// refused change or config is also a Warning Event on the Node. Applied pools also go to
/// route distribution (`routes`, once it runs) and the BGP speaker (`bgp`), whose rule for
/// blocks depends on them; the speaker also takes its new settings (peers added, removed or
/// changed, its AS number, the Service ranges) while it runs. A BGPPeer refused is reported
/// when it first is. An
/// IPPool refused (`refused`: those the start reported) is reported when it first is.
pub fn spawn_reload<F>(
    node: Arc<Node>,
    (mut refused, refused_peers): (Refusals, Refusals),
    reread: F,
    mut cluster_changes: Option<tokio::sync::mpsc::UnboundedReceiver<&'static str>>,
    routes: Arc<std::sync::OnceLock<Arc<crate::distribution::RoutesHandle>>>,
    bgp: Arc<std::sync::OnceLock<Arc<crate::bgp::speaker::BgpHandle>>>,
) where
    F: Fn() -> anyhow::Result<Reloaded> + Send + 'static,
{
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot listen for SIGHUP: config reload disabled");
            return;
        };
        let mut deferred = false;
        let mut refused_peers = refused_peers;
        loop {
            let why = tokio::select! {
                s = hup.recv() => match s {
                    Some(()) => "SIGHUP",
                    None => return,
                },
                Some(what) = async {
                    match cluster_changes.as_mut() {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    // One pass for a burst of changes.
                    if let Some(rx) = cluster_changes.as_mut() {
                        while rx.try_recv().is_ok() {}
                    }
                    what
                }
                _ = tokio::time::sleep(DEFERRED_POOLS_RETRY), if deferred => "deferred IPPool change",
            };
            let cfg = match reread() {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), "{why}: config rejected; keeping the running one");
                    if cluster_changes.is_some() {
                        node.notices.warning(
                            "ConfigRefused",
                            crate::notice::Subject::Node,
                            format!("{why}: the agent keeps its running config: {e:#}"),
                        );
                    }
                    continue;
                }
            };
            let new: Vec<_> = cfg
                .refused_pools
                .iter()
                .filter(|r| !refused.contains(r))
                .cloned()
                .collect();
            report_refused_pools(&node, &new);
            refused = cfg.refused_pools.clone();
            let new: Vec<_> = cfg
                .refused_bgp_peers
                .iter()
                .filter(|r| !refused_peers.contains(r))
                .cloned()
                .collect();
            report_refused_bgp_peers(&node, &new);
            refused_peers = cfg.refused_bgp_peers.clone();
            if let (Some(b), Some(mut s)) = (bgp.get(), cfg.bgp.clone()) {
                s.blocks = node.ipam.pools();
                b.reconfigure(s).await;
            }
            if cfg.needs_restart {
                tracing::warn!(
                    "{why}: dataplane, tc_attach, uplinks, xdp.enabled, xdp.mode, \
                     resync_interval_secs, [routes], [vxlan], bgp.enabled and pools' vxlan take \
                     effect when the agent restarts"
                );
            }
            match node.set_pools(cfg.pools, cfg.policy).await {
                Ok(()) => {
                    deferred = false;
                    node.set_pod_mtu(cfg.pod_mtu.clone());
                    if let Some(r) = routes.get() {
                        // With the blocks IPAM retains under a refused change.
                        r.set_block_pools(node.ipam.pools()).await;
                    }
                    if let Some(b) = bgp.get() {
                        b.set_pools(node.ipam.pools()).await;
                    }
                }
                Err(e) => {
                    let again = deferred;
                    deferred = cluster_changes.is_some();
                    if deferred {
                        tracing::error!(error = %e, "{why}: pool change rejected; keeping the running pools and trying again every {DEFERRED_POOLS_RETRY:?}");
                        if !again {
                            node.notices.warning(
                                "IPPoolRefused",
                                crate::notice::Subject::Node,
                                format!(
                                    "{why}: pool change refused, tried again every {}s: {e}",
                                    DEFERRED_POOLS_RETRY.as_secs()
                                ),
                            );
                        }
                    } else {
                        tracing::error!(error = %e, "{why}: pool change rejected; keeping the running pools");
                    }
                }
            }
            match node.endpoints.reload_dataplane(cfg.dataplane).await {
                Ok(()) => tracing::info!(service_cidrs = ?cfg.service_cidrs,
                    node_labels = ?cfg.node_labels, "{why}: dataplane settings reloaded"),
                Err(e) => tracing::error!(error = %format!("{:#}", anyhow::Error::new(e)),
                    "{why}: cannot apply the dataplane settings"),
            }
        }
    });
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
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
