//! The command line: the flags, and the config they override (with the node name's
//! environment variables, and the cluster's part with the `kubernetes` datastore).
use std::path::PathBuf;

use calix_core::ipam::pool::PoolSpec;
use clap::Parser;

use super::error::ConfigError;
use super::{AgentConfig, DataplaneMode};
use crate::kubernetes::cluster::Cluster;
use crate::paths;

#[derive(Parser, Debug, Clone)]
#[command(name = "calix-agent", version, about = "calix node agent")]
pub struct Flags {
    /// Config file (TOML). Missing is fine at the default path.
    #[arg(long, short = 'c', env = "CALIX_CONFIG")]
    pub config: Option<PathBuf>,
    /// This node's name (default: $CALIX_NODE_NAME, $NODE_NAME — a DaemonSet sets one from
    /// the downward API, spec.nodeName —, then the config, then the hostname).
    #[arg(long)]
    pub node_name: Option<String>,
    /// gRPC unix socket.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Embedded datastore file.
    #[arg(long)]
    pub datastore_path: Option<PathBuf>,
    /// `ebpf` or `kernel`.
    #[arg(long)]
    pub dataplane: Option<DataplaneMode>,
    /// Replace the configured pools with this one (repeatable), e.g. 10.244.0.0/16.
    #[arg(long = "pool")]
    pub pools: Vec<ipnet::IpNet>,
    /// Log filter, e.g. info or calix_agent=debug.
    #[arg(long)]
    pub log_level: Option<String>,
    /// bpffs directory for pins (this node's go below it).
    #[arg(long)]
    pub bpf_pin_root: Option<PathBuf>,
    /// Load the eBPF programs from this object file instead of the built-in ones.
    #[arg(long)]
    pub bpf_object: Option<PathBuf>,
    /// Remove this node's eBPF programs (from every cali* interface and the uplinks, the XDP
    /// prefilter included), map entries and pins, the kernel mode's nftables tables and
    /// calix's VXLAN devices (with the routes through them), then exit. Pods keep their
    /// routes (kernel forwarding), and so do direct routes to other nodes.
    #[arg(long)]
    pub uninstall: bool,
    /// With --uninstall: also every route calix added (pods' host routes, routes to other
    /// nodes) and the CNI config named by --cni-conf. Pods still running lose their network.
    #[arg(long, requires = "uninstall")]
    pub all: bool,
    /// The CNI network config (conflist) calix's install-cni wrote on this node, removed by
    /// `--uninstall --all` and when the agent's DaemonSet is deleted.
    #[arg(long)]
    pub cni_conf: Option<PathBuf>,
    /// `<namespace>/<name>` of the DaemonSet running this agent (kubernetes datastore; the
    /// chart sets it). When the agent stops because that DaemonSet was deleted (`helm
    /// uninstall`), it uninstalls calix from the node as `--uninstall --all` does; any other
    /// stop (a rolling update) leaves everything for the next agent.
    #[arg(long)]
    pub owner_daemonset: Option<crate::kubernetes::owner::OwnerRef>,
    /// `<namespace>/<name>` of another DaemonSet of the same release (repeatable; the chart
    /// names the route reflectors' and everyone else's): while one of them stays, the deletion
    /// of --owner-daemonset is a topology switch (that DaemonSet takes the node over), not an
    /// uninstall.
    #[arg(long, requires = "owner_daemonset")]
    pub sibling_daemonset: Vec<crate::kubernetes::owner::OwnerRef>,
}

/// The config file, overridden by the flags (and the node name's environment variables),
/// merged with the cluster's part once it is loaded (the `kubernetes` datastore: IPPools,
/// this node's Node, ServiceCIDRs).
pub fn read(flags: Flags, cluster: Option<&Cluster>) -> Result<AgentConfig, ConfigError> {
    // (Called again on SIGHUP and cluster changes with the same flags: flags keep overriding
    // the file.)
    let (path, required) = match &flags.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(paths::CONFIG_FILE), false),
    };
    let mut c = AgentConfig::load(&path, required)?;
    c.node_name = crate::kubernetes::node_name(
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
        c.pools = flags.pools.into_iter().map(PoolSpec::new).collect();
        c.pools_configured = true;
    }
    if let Some(cluster) = cluster.filter(|_| c.datastore.is_kubernetes()) {
        merge_cluster(&mut c, cluster);
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

/// Merges the cluster's part into `c` (read from the config file): the IPPools (unless the
/// file or the flags named pools, which validation refuses), this node's Node's labels (they
/// win), its InternalIPs as `routes.node_addresses` when none are configured, the reflector
/// label, and the ServiceCIDRs (see [`crate::kubernetes::cluster`]); IPPools that cannot be
/// served are left out, named in `refused_pools` ([`super::validate::admit_pools`]).
fn merge_cluster(c: &mut AgentConfig, cluster: &Cluster) {
    for cidr in cluster.service_cidrs() {
        if !c.nat.service_cidrs.contains(&cidr) {
            c.nat.service_cidrs.push(cidr);
        }
    }
    if !c.pools_configured {
        // (Configured pools are refused by validate().)
        (c.pools, c.refused_pools) =
            super::validate::admit_pools(cluster.named_pools(), &c.nat.service_cidrs);
    }
    if let Some(node) = cluster.node() {
        c.node_labels.extend(node.labels.clone());
        if c.routes.node_addresses.is_empty() {
            c.routes.node_addresses = node
                .internal_ips()
                .iter()
                .map(ToString::to_string)
                .collect();
        }
        if node
            .labels
            .get(&c.routes.reflector_label)
            .map(String::as_str)
            == Some("true")
        {
            c.routes.reflector = true;
        }
    }
    if let (true, Some(bgp)) = (c.bgp.enabled, cluster.bgp()) {
        let ips = cluster
            .node()
            .map(|n| n.internal_ips().iter().map(ToString::to_string).collect())
            .unwrap_or_default();
        c.bgp.merge_cluster(&c.node_name, &c.node_labels, ips, bgp);
    }
}
