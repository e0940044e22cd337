//! Agent configuration, parsed at the edge: a TOML file with `#[serde(default)]` sections
//! ([`AgentConfig`], [`sections`]); command-line flags and the node name's environment
//! variables override single keys ([`flags`]); with the `kubernetes` datastore the cluster's
//! part is merged in ([`flags::read`]). Defaults are written once, here and in [`sections`].
//!
//! - [`validate`]: what serde cannot check, every number's bounds ([`validate::Bounded`]);
//! - [`settings`]: the conversion into each module's own settings type (IPAM's pools and
//!   policy, the datastore's backend, the dataplane's NAT, XDP and doors, route distribution's,
//!   the underlay, a pod's MTU, the Kubernetes certificates and pods, a reload's);
//! - [`error`]: what is wrong, by key.
//!
//! No other module imports this one: each takes its own settings, and `main` hands them over.
pub mod bgp;
pub mod error;
pub mod flags;
pub mod sections;
pub mod settings;
pub mod validate;

use std::path::{Path, PathBuf};

use calix_core::ipam::pool::PoolSpec;
use serde::{Deserialize, Serialize};

use self::error::ConfigError;
use self::sections::{
    DatastoreConfig, DoorsConfig, IpamConfig, KubernetesConfig, NatConfig, PolicyConfig,
    RoutesConfig, ServicesConfig, VxlanConfig, XdpConfig,
};
use crate::paths;

/// Which dataplane programs pod traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneMode {
    /// tc eBPF programs on every `cali*` veth.
    #[default]
    Ebpf,
    /// Routes + proxy_arp + kernel forwarding only; no BPF (fallback and baseline).
    Kernel,
}

impl std::str::FromStr for DataplaneMode {
    type Err = UnknownDataplane;
    fn from_str(s: &str) -> Result<Self, UnknownDataplane> {
        match s {
            "ebpf" => Ok(Self::Ebpf),
            "kernel" => Ok(Self::Kernel),
            other => Err(UnknownDataplane(other.to_string())),
        }
    }
}

/// A dataplane name that is neither `ebpf` nor `kernel`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dataplane {0:?}: use \"ebpf\" or \"kernel\"")]
pub struct UnknownDataplane(pub String);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// This node's name; defaults to the hostname.
    pub node_name: String,
    /// gRPC unix socket for the CNI plugin and calixctl.
    pub socket: PathBuf,
    /// `ebpf` (default) or `kernel`.
    pub dataplane: DataplaneMode,
    /// How the eBPF dataplane's tc programs attach: `auto` (default: tcx links where the
    /// kernel has them, 6.6 and later, else cls_bpf filters), `tcx` or `tc` (cls_bpf filters
    /// on a clsact qdisc).
    pub tc_attach: calix_dataplane::tcx::TcAttach,
    /// `tracing` filter, e.g. "info" or "calix_agent=debug".
    pub log_level: String,
    /// bpffs directory for the pinned maps and programs (per node below it).
    pub bpf_pin_root: PathBuf,
    /// The node's uplink interfaces: `from_host_dev`/`to_host_dev` attach there.
    pub uplinks: Vec<String>,
    /// Prometheus `/metrics` listen address; empty: off.
    pub metrics_addr: String,
    /// How often the reconciler compares every endpoint with the kernel and repairs what
    /// drifted (reads only, when nothing did). 1 or more.
    pub resync_interval_secs: u64,
    pub datastore: DatastoreConfig,
    /// This node's labels, matched by pools' `nodeSelector`.
    pub node_labels: std::collections::BTreeMap<String, String>,
    pub ipam: IpamConfig,
    /// IP pools pods get their addresses from. With the `kubernetes` datastore they are the
    /// cluster's IPPool objects instead (configuring any here is an error).
    pub pools: Vec<PoolSpec>,
    /// Whether the config file or the command line named pools (the defaults aside).
    #[serde(skip)]
    pub pools_configured: bool,
    /// The cluster's IPPools not served, by name, with why (`validate::admit_pools`).
    #[serde(skip)]
    pub refused_pools: Vec<(String, String)>,
    /// The XDP prefilter on the uplinks.
    pub xdp: XdpConfig,
    /// SNAT of `natOutgoing` pools (eBPF dataplane).
    pub nat: NatConfig,
    /// The NetworkPolicy maps' sizes (eBPF dataplane).
    pub policy: PolicyConfig,
    /// Kubernetes Services: followed and calculated (issue 24).
    pub services: ServicesConfig,
    /// Route distribution between nodes.
    pub routes: RoutesConfig,
    /// The VXLAN device that carries pod traffic across subnets (pools' `vxlan`).
    pub vxlan: VxlanConfig,
    /// What the agent does in a Kubernetes cluster (the `kubernetes` datastore).
    pub kubernetes: KubernetesConfig,
    /// Whether pods may reach the agents' ports on the nodes' addresses.
    pub doors: DoorsConfig,
    /// BGP with the data centre's routers.
    pub bgp: bgp::BgpConfig,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            node_name: String::new(),
            socket: PathBuf::from(paths::AGENT_SOCKET),
            dataplane: DataplaneMode::default(),
            tc_attach: Default::default(),
            log_level: "info".into(),
            bpf_pin_root: PathBuf::from(paths::BPF_PIN_ROOT),
            uplinks: Vec::new(),
            metrics_addr: "127.0.0.1:9091".into(),
            resync_interval_secs: 30,
            datastore: DatastoreConfig::default(),
            node_labels: Default::default(),
            ipam: IpamConfig::default(),
            // A private range unlikely to clash with a node's own network.
            pools: vec![PoolSpec::new(
                "10.244.0.0/16".parse().expect("constant CIDR"),
            )],
            pools_configured: false,
            refused_pools: Vec::new(),
            xdp: XdpConfig::default(),
            nat: NatConfig::default(),
            policy: PolicyConfig::default(),
            services: ServicesConfig::default(),
            routes: RoutesConfig::default(),
            vxlan: VxlanConfig::default(),
            kubernetes: KubernetesConfig::default(),
            doors: DoorsConfig::default(),
            bgp: bgp::BgpConfig::default(),
        }
    }
}

impl AgentConfig {
    /// Reads `path`; a missing file at the default location means "all defaults".
    pub fn load(path: &Path, required: bool) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::from_toml(&text).map_err(|source| ConfigError::Parse {
                path: path.to_path_buf(),
                source: Box::new(source),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        let mut c: Self = toml::from_str(text)?;
        // Parsed once more as a table: whether `pools` was written (a default is not).
        c.pools_configured = toml::from_str::<toml::Table>(text)?.contains_key("pools");
        Ok(c)
    }
}

#[cfg(test)]
mod tests;
