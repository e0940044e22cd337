//! Agent configuration: a TOML file with `#[serde(default)]` sections; command-line flags
//! override single keys (see main.rs). Defaults are written once, here.
use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::dataplane::xdp::{self, Failsafe, XdpMode, XdpPolicy, XdpSettings};
use crate::paths;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{key} = {value} is out of range: {min}–{max}")]
    OutOfRange {
        key: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
    #[error("cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML for calix-agent")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("pool {cidr}: blockSize {block_size} is out of range (IPv4 20–32, IPv6 116–128)")]
    BlockSize { cidr: IpNet, block_size: u8 },
    #[error("pool {cidr}: blockSize {block_size} is smaller than the pool's own prefix /{prefix}")]
    BlockLargerThanPool {
        cidr: IpNet,
        block_size: u8,
        prefix: u8,
    },
    #[error("node name is empty: set `node_name` in the config or pass --node-name")]
    NoNodeName,
    #[error("node name {name:?} has a '/' or a control character: calix keys a node's records by its name")]
    BadNodeName { name: String },
    #[error("pool {cidr}: namespaceSelector")]
    NamespaceSelector {
        cidr: IpNet,
        #[source]
        source: crate::selector::SelectorError,
    },
    #[error(
        "pool {cidr}: a namespaceSelector needs datastore type \"kubernetes\" (the agent reads \
         pods' namespaces from the API); with another datastore no pod could match it"
    )]
    NamespaceSelectorNeedsKubernetes { cidr: IpNet },
    #[error("pools {a} and {b} overlap: every address must belong to one pool")]
    Overlap { a: IpNet, b: IpNet },
    #[error("pool {cidr} is configured twice")]
    Duplicate { cidr: IpNet },
    #[error("datastore type {kind:?} is unknown: use \"embedded\", \"etcd\" or \"kubernetes\"")]
    DatastoreKind { kind: String },
    #[error(
        "with datastore type \"kubernetes\" the pools are IPPool objects (kubectl get ippools): \
         remove [[pools]] from the config and --pool from the command line"
    )]
    PoolsInKubernetes,
    #[error("datastore.{key} must be {what}")]
    Datastore {
        key: &'static str,
        what: &'static str,
    },
    #[error("datastore type \"etcd\" needs `endpoints`, e.g. [\"http://10.0.0.1:2379\"]")]
    NoEtcdEndpoints,
    #[error("kubernetes.{key} must be {what}")]
    Kubernetes {
        key: &'static str,
        what: &'static str,
    },
    #[error("ipam.{key} must be {what}")]
    Ipam {
        key: &'static str,
        what: &'static str,
    },
    #[error(
        "xdp.deny_cidrs: {entry:?} is neither a CIDR (e.g. \"192.0.2.0/24\", \"2001:db8::/32\") nor an address"
    )]
    XdpCidr { entry: String },
    #[error("xdp.failsafe_ports: {entry:?} is not <tcp|udp>:<port 1–65535> (e.g. \"tcp:22\")")]
    XdpPort { entry: String },
    #[error("xdp.{key}: more than {max} entries{per}")]
    XdpTooMany {
        key: &'static str,
        max: usize,
        per: &'static str,
    },
    #[error(
        "nat.non_masquerade_cidrs: {entry:?} is not an IPv4 CIDR or address (e.g. \"192.168.0.0/16\")"
    )]
    NatCidr { entry: String },
    #[error(
        "nat.service_cidrs: {entry:?} is not a CIDR or address (e.g. \"10.96.0.0/12\", \"fd00:96::/108\")"
    )]
    ServiceCidr { entry: String },
    #[error("nat.service_cidrs: {service} overlaps pool {pool}: pod addresses cannot be Service addresses")]
    ServiceOverlapsPool { service: IpNet, pool: IpNet },
    #[error("nat.{key} must be {what}")]
    Nat {
        key: &'static str,
        what: &'static str,
    },
    #[error("routes.{key} must be {what}")]
    Routes {
        key: &'static str,
        what: &'static str,
    },
    #[error(
        "routes.enabled needs mutual TLS between nodes: set routes.tls.cert, .key and .ca (PEM files), or routes.tls.source = \"kubernetes\" (a certificate through the Kubernetes API), or routes.plaintext = true on a trusted network"
    )]
    RoutesNoTls,
    #[error(
        "routes.enabled needs `uplinks`: the interfaces other nodes are reached through (routes leave through them, the VXLAN devices sit on the first), e.g. [\"eth0\"]"
    )]
    RoutesNoUplinks,
    #[error("vxlan.{key} must be {what}")]
    Vxlan {
        key: &'static str,
        what: &'static str,
    },
    #[error("xdp.enabled needs dataplane = \"ebpf\"")]
    XdpNeedsEbpf,
    #[error(
        "xdp.enabled needs `uplinks`: the interfaces the prefilter attaches to, e.g. [\"eth0\"]"
    )]
    XdpNoUplinks,
}

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
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ebpf" => Ok(Self::Ebpf),
            "kernel" => Ok(Self::Kernel),
            other => Err(format!(
                "unknown dataplane {other:?}: use \"ebpf\" or \"kernel\""
            )),
        }
    }
}

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
    pub tc_attach: crate::dataplane::tcx::TcAttach,
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
    pub pools: Vec<PoolConfig>,
    /// Whether the config file or the command line named pools (the defaults aside).
    #[serde(skip)]
    pub pools_configured: bool,
    /// The XDP prefilter on the uplinks.
    pub xdp: XdpConfig,
    /// SNAT of `natOutgoing` pools (eBPF dataplane).
    pub nat: NatConfig,
    /// Route distribution between nodes.
    pub routes: RoutesConfig,
    /// The VXLAN device that carries pod traffic across subnets (pools' `vxlan`).
    pub vxlan: VxlanConfig,
    /// What the agent does in a Kubernetes cluster (the `kubernetes` datastore).
    pub kubernetes: KubernetesConfig,
    /// Whether pods may reach the agents' ports on the nodes' addresses.
    pub doors: DoorsConfig,
}

/// The agents' TCP ports and pods (`[doors]`). By default no pod reaches an agent's Routes
/// or metrics port on any node's address (its own node's or another's): they are dropped on
/// the pod's own node. The node itself (the kubelet's probes, host-network pods) always
/// does. Read at start.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DoorsConfig {
    /// Pods may reach the metrics port (`metrics_addr`) on the nodes' addresses: Prometheus
    /// running in a pod (hostNetwork Prometheus needs nothing).
    pub pods_reach_metrics: bool,
    /// Pods may reach the Routes port: never needed by calix (only nodes get past its door
    /// anyway, before TLS); for a debugging tool in a pod.
    pub pods_reach_routes: bool,
}

/// The agent in a Kubernetes cluster (`[kubernetes]`, with the `kubernetes` datastore).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// An endpoint whose pod is gone for this long (and still gone when the API server is
    /// asked) is cleaned up: forgotten, its addresses released, its veth deleted (seconds).
    pub pod_gone_grace_secs: u64,
    /// How often endpoints are checked against this node's Pods (and after each Pod
    /// deletion), seconds; 1 or more.
    pub pod_check_interval_secs: u64,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            pod_gone_grace_secs: 30,
            pod_check_interval_secs: 10,
        }
    }
}

/// Route distribution between nodes (`[routes]`): each agent serves `calix.v1.Routes` on TCP
/// and follows its peers (the other nodes' records in the datastore).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutesConfig {
    /// Serve and follow routes. Off for a single node (the embedded datastore); on for a
    /// cluster.
    pub enabled: bool,
    /// Where the Routes service listens: `:port` (the default, `:5474`) on this node's own
    /// addresses — its next hops, one per family, what peers dial and its record carries —
    /// or `address:port` on that one address (`0.0.0.0:5474` / `[::]:5474`: every address of
    /// the node; strangers are still refused before TLS).
    pub listen: String,
    /// The addresses this node advertises (the next hop of its routes; what peers dial and
    /// check a certificate's node against): one IPv4 and/or one IPv6. Empty: the first global
    /// address of each family on the first uplink.
    pub node_addresses: Vec<String>,
    /// Who talks to whom: `mesh` (every node follows every other) or `reflectors` (nodes
    /// follow only the agents with `reflector = true`, which follow everyone).
    pub topology: Topology,
    /// This agent relays every node's routes (with `topology = "reflectors"`).
    pub reflector: bool,
    /// With the kubernetes datastore: the Node label (`<label> = "true"`) that makes a node a
    /// route reflector, for its own agent and for every agent following it. The default is
    /// in `node-restriction.kubernetes.io/`, which a kubelet cannot set on its own Node (the
    /// NodeRestriction admission plugin), so a node cannot make itself a reflector.
    pub reflector_label: String,
    /// How long a peer's routes stay after its stream drops (graceful restart), seconds.
    pub grace_secs: u64,
    /// Mutual TLS between nodes: PEM files. The certificate's SAN names this node.
    pub tls: TlsConfig,
    /// Plain text between nodes instead of mutual TLS: only on a network you trust (warned
    /// at start).
    pub plaintext: bool,
}

impl Default for RoutesConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: format!(":{ROUTES_PORT}"),
            node_addresses: Vec::new(),
            topology: Topology::Mesh,
            reflector: false,
            reflector_label: REFLECTOR_LABEL.into(),
            grace_secs: 120,
            tls: TlsConfig::default(),
            plaintext: false,
        }
    }
}

impl RoutesConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled {
            return Ok(());
        }
        if self.listen_on().is_none() {
            return Err(ConfigError::Routes {
                key: "listen",
                what: "\":port\" (this node's addresses) or \"address:port\", with a port of 1–65535, e.g. \":5474\", \"192.0.2.10:5474\" or \"[::]:5474\"",
            });
        }
        if !is_label_key(&self.reflector_label) {
            return Err(ConfigError::Routes {
                key: "reflector_label",
                what: "a Kubernetes label key ([prefix/]name, e.g. \"node-restriction.kubernetes.io/calix-route-reflector\")",
            });
        }
        for a in &self.node_addresses {
            if a.parse::<std::net::IpAddr>().is_err() {
                return Err(ConfigError::Routes {
                    key: "node_addresses",
                    what: "IP addresses, e.g. [\"192.0.2.10\"]",
                });
            }
        }
        if !self.plaintext {
            self.tls.validate()?;
        }
        Ok(())
    }

    /// The port of `listen`.
    pub fn listen_port(&self) -> Option<u16> {
        self.listen_on().map(ListenOn::port)
    }

    /// What `listen` says; `None` when it is not `:port` or `address:port` (port 1–65535).
    pub fn listen_on(&self) -> Option<ListenOn> {
        if let Some(port) = self.listen.strip_prefix(':') {
            return port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .map(|port| ListenOn::NodeAddresses { port });
        }
        self.listen
            .parse::<std::net::SocketAddr>()
            .ok()
            .filter(|a| a.port() != 0)
            .map(ListenOn::Address)
    }
}

/// Where the Routes service listens (`routes.listen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenOn {
    /// `:port`: on this node's own addresses (its next hops).
    NodeAddresses { port: u16 },
    /// `address:port`: on that address (unspecified: every address).
    Address(std::net::SocketAddr),
}

impl ListenOn {
    pub fn port(self) -> u16 {
        match self {
            ListenOn::NodeAddresses { port } => port,
            ListenOn::Address(a) => a.port(),
        }
    }
}

/// Whether `key` is a Kubernetes label key: an optional DNS subdomain prefix and `/`, then a
/// name of at most 63 characters of `[A-Za-z0-9_.-]`, starting and ending alphanumeric.
pub fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    let prefix_ok = prefix.is_none_or(|p| {
        p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && l.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && l.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
    });
    name_ok && prefix_ok
}

/// Who follows whom (`routes.topology`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    #[default]
    Mesh,
    Reflectors,
}

/// Mutual TLS between nodes (`[routes.tls]`): where this node's certificate and the CA come
/// from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// `files`: the PEM files below. `kubernetes`: a key made on this node, in memory, and
    /// its certificate through the Kubernetes API (a CertificateSigningRequest for
    /// `signer_name`, renewed before it expires), the CA from `ca_config_map`.
    pub source: CertSource,
    /// This node's certificate (chain); its one SAN is the node's name.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA that signs every node's certificate.
    pub ca: PathBuf,
    /// With `kubernetes`: the signer that issues route-distribution certificates.
    pub signer_name: String,
    /// With `kubernetes`: `<namespace>/<name>` of the ConfigMap whose `ca.crt` is the trust
    /// bundle (the signer publishes it).
    pub ca_config_map: String,
}

/// Where a node's route-distribution certificate comes from (`routes.tls.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CertSource {
    #[default]
    Files,
    Kubernetes,
}

/// The signer calix-signer answers for, by default (`routes.tls.signer_name`).
pub const ROUTES_SIGNER: &str = "calix.dev/routes";

impl Default for TlsConfig {
    fn default() -> Self {
        Self {
            source: CertSource::Files,
            cert: PathBuf::new(),
            key: PathBuf::new(),
            ca: PathBuf::new(),
            signer_name: ROUTES_SIGNER.into(),
            ca_config_map: "kube-system/calix-routes-ca".into(),
        }
    }
}

impl TlsConfig {
    pub fn is_set(&self) -> bool {
        [&self.cert, &self.key, &self.ca]
            .iter()
            .all(|p| !p.as_os_str().is_empty())
    }

    /// `ca_config_map` as (namespace, name).
    pub fn ca_config_map(&self) -> Option<(&str, &str)> {
        self.ca_config_map
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        match self.source {
            CertSource::Files if !self.is_set() => Err(ConfigError::RoutesNoTls),
            CertSource::Files => Ok(()),
            CertSource::Kubernetes => {
                let signer = self.signer_name.split_once('/');
                if !signer.is_some_and(|(d, p)| !d.is_empty() && !p.is_empty()) {
                    return Err(ConfigError::Routes {
                        key: "tls.signer_name",
                        what: "a signer name <domain>/<path>, e.g. \"calix.dev/routes\"",
                    });
                }
                if self.ca_config_map().is_none() {
                    return Err(ConfigError::Routes {
                        key: "tls.ca_config_map",
                        what: "<namespace>/<name> of a ConfigMap, e.g. \"kube-system/calix-routes-ca\"",
                    });
                }
                Ok(())
            }
        }
    }
}

/// The default port of `calix.v1.Routes` between nodes.
pub const ROUTES_PORT: u16 = 5474;

/// The default `routes.reflector_label`.
pub const REFLECTOR_LABEL: &str = "node-restriction.kubernetes.io/calix-route-reflector";

/// The VXLAN device (`[vxlan]`), used for pools with `vxlan = "always"`, and with
/// `"crossSubnet"` for peers outside this node's subnets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VxlanConfig {
    /// VXLAN network identifier (1–16777215).
    pub vni: u32,
    /// UDP port.
    pub port: u16,
}

impl Default for VxlanConfig {
    fn default() -> Self {
        Self {
            vni: 4096,
            port: 4789,
        }
    }
}

impl VxlanConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=0xff_ffff).contains(&self.vni) {
            return Err(ConfigError::Vxlan {
                key: "vni",
                what: "1–16777215",
            });
        }
        if self.port == 0 {
            return Err(ConfigError::Vxlan {
                key: "port",
                what: "1–65535",
            });
        }
        Ok(())
    }
}

/// How traffic to a pool's addresses on another node travels (a pool's `vxlan`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    Default,
    schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum VxlanMode {
    /// Routed to the node's address; the nodes must share a subnet (or the network must
    /// route pod addresses).
    Never,
    /// Routed directly to a node on one of this node's subnets, through VXLAN otherwise.
    #[default]
    CrossSubnet,
    /// Always through VXLAN.
    Always,
}

/// SNAT of `natOutgoing` pools' traffic to the outside (`[nat]`); eBPF dataplane, IPv4.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatConfig {
    /// IPv4 destinations (CIDRs or addresses) reached without SNAT, besides every pool.
    /// Reloaded on SIGHUP.
    pub non_masquerade_cidrs: Vec<String>,
    /// Addresses the host stack NATs itself (kube-proxy: the Service cluster IP ranges,
    /// externalIPs, load-balancer IPs; IPv4 or IPv6): pods' traffic to them always goes
    /// through the host stack, never the programs' SNAT. Reloaded on SIGHUP.
    pub service_cidrs: Vec<String>,
    /// Size of the BPF conntrack table in entries (two per flow). A changed size migrates
    /// the flows into a table of the new size at the next start.
    pub conntrack_entries: u32,
    /// Conntrack flows one endpoint may hold; a new flow beyond it is dropped
    /// (`conntrack_budget`). Default: a quarter of the table (`conntrack_entries / 8`);
    /// 0: no limit.
    pub conntrack_flows_per_endpoint: Option<u32>,
    /// When the table is three quarters full, flows without an answer (TCP: handshake not
    /// completed) expire after this many idle seconds, so established flows keep room.
    pub pressure_unanswered_secs: u64,
    pub tcp_established_secs: u64,
    /// TCP until the handshake completes (a reply, then the pod's ACK).
    pub tcp_syn_secs: u64,
    /// TCP after RST, or FIN both ways.
    pub tcp_closing_secs: u64,
    pub udp_secs: u64,
    pub icmp_secs: u64,
    /// NAT source ports (and ICMP echo identifiers), inclusive. The default stays below the
    /// kernel's ip_local_port_range (32768–60999) so the node's own connections never collide.
    pub port_min: u16,
    pub port_max: u16,
    /// How often the agent removes expired conntrack entries.
    pub cleaner_interval_secs: u64,
}

impl Default for NatConfig {
    fn default() -> Self {
        Self {
            non_masquerade_cidrs: Vec::new(),
            service_cidrs: Vec::new(),
            conntrack_entries: calix_common::DEFAULT_CT_ENTRIES,
            conntrack_flows_per_endpoint: None,
            pressure_unanswered_secs: 2,
            tcp_established_secs: 21_600,
            tcp_syn_secs: 60,
            tcp_closing_secs: 10,
            udp_secs: 60,
            icmp_secs: 30,
            port_min: 16_384,
            port_max: 32_767,
            cleaner_interval_secs: 5,
        }
    }
}

/// The XDP prefilter on the uplinks (`[xdp]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct XdpConfig {
    /// Attach `xdp_host_dev` to every uplink.
    pub enabled: bool,
    /// `auto` (native where the driver supports it, else generic), `native` or `generic`.
    pub mode: XdpMode,
    /// Source CIDRs (or single addresses), IPv4 and IPv6, whose packets are dropped.
    /// Reloaded on SIGHUP.
    pub deny_cidrs: Vec<String>,
    /// `<tcp|udp>:<port>` destination ports never dropped, whatever the source. Replaces the
    /// default `["tcp:22"]`; the agent's metrics port (`metrics_addr`) is always added.
    /// Reloaded on SIGHUP.
    pub failsafe_ports: Vec<String>,
}

impl Default for XdpConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            mode: XdpMode::Auto,
            deny_cidrs: Vec::new(),
            failsafe_ports: vec!["tcp:22".into()],
        }
    }
}

/// How the node's IPAM grows and cleans up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct IpamConfig {
    /// Never borrow addresses from another node's block.
    pub strict_affinity: bool,
    /// Most blocks this node may claim.
    pub max_blocks_per_node: usize,
    /// How often leak GC compares allocations with live endpoints (seconds).
    pub leak_check_interval_secs: u64,
    /// An allocation without an endpoint for this long is a leak and is released (seconds).
    pub leak_grace_secs: u64,
    /// A block of this node that stays empty this long is released (seconds).
    pub empty_block_grace_secs: u64,
}

impl Default for IpamConfig {
    fn default() -> Self {
        Self {
            strict_affinity: false,
            max_blocks_per_node: 1024,
            leak_check_interval_secs: 60,
            leak_grace_secs: 600,
            empty_block_grace_secs: 900,
        }
    }
}

impl IpamConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }

    pub fn policy(&self) -> crate::ipam::Policy {
        crate::ipam::Policy {
            strict_affinity: self.strict_affinity,
            max_blocks_per_node: self.max_blocks_per_node,
        }
    }
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
            pools: vec![PoolConfig::new(
                "10.244.0.0/16".parse().expect("constant CIDR"),
            )],
            pools_configured: false,
            xdp: XdpConfig::default(),
            nat: NatConfig::default(),
            routes: RoutesConfig::default(),
            vxlan: VxlanConfig::default(),
            kubernetes: KubernetesConfig::default(),
            doors: DoorsConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatastoreConfig {
    /// `embedded` (a local file; single node), `etcd` (shared by several nodes) or
    /// `kubernetes` (custom resources in the cluster's API).
    #[serde(rename = "type")]
    pub kind: String,
    /// Embedded: the snapshot file (the journal is `<path>.journal`).
    pub path: PathBuf,
    /// etcd: client URLs.
    pub endpoints: Vec<String>,
    /// etcd: prefix of every calix key.
    pub prefix: String,
    /// kubernetes: a kubeconfig file; empty: the service account of the agent's pod.
    pub kubeconfig: PathBuf,
    /// etcd, kubernetes: per-request timeout in milliseconds.
    pub timeout_ms: u64,
    /// etcd, kubernetes: attempts per operation while the backend is unreachable (exponential
    /// backoff).
    pub attempts: u32,
}

impl DatastoreConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        match self.kind.as_str() {
            "embedded" => Ok(()),
            "etcd" if self.endpoints.is_empty() => Err(ConfigError::NoEtcdEndpoints),
            "etcd" | "kubernetes" => Ok(()),
            other => Err(ConfigError::DatastoreKind { kind: other.into() }),
        }
    }

    pub fn is_kubernetes(&self) -> bool {
        self.kind == "kubernetes"
    }

    pub fn kubernetes(&self) -> crate::datastore::KubeConfig {
        crate::datastore::KubeConfig {
            kubeconfig: (!self.kubeconfig.as_os_str().is_empty()).then(|| self.kubeconfig.clone()),
            timeout: std::time::Duration::from_millis(self.timeout_ms),
            attempts: self.attempts,
        }
    }

    pub fn etcd(&self) -> crate::datastore::EtcdConfig {
        crate::datastore::EtcdConfig {
            endpoints: self.endpoints.clone(),
            prefix: self.prefix.clone(),
            timeout: std::time::Duration::from_millis(self.timeout_ms),
            attempts: self.attempts,
        }
    }
}

impl Default for DatastoreConfig {
    fn default() -> Self {
        Self {
            kind: "embedded".into(),
            path: PathBuf::from(paths::EMBEDDED_STORE),
            endpoints: Vec::new(),
            prefix: "/calix/".into(),
            kubeconfig: PathBuf::new(),
            timeout_ms: 2000,
            attempts: 12,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PoolConfig {
    #[schemars(with = "String")]
    pub cidr: IpNet,
    /// Prefix length of the per-node blocks; default 26 (IPv4) / 122 (IPv6).
    #[serde(default)]
    pub block_size: Option<u8>,
    /// Masquerade traffic from this pool to destinations outside every pool.
    #[serde(default)]
    pub nat_outgoing: bool,
    /// A disabled pool hands out no new addresses.
    #[serde(default)]
    pub disabled: bool,
    /// `never`, `crossSubnet` (default) or `always`: how pod traffic to this pool's
    /// addresses on other nodes travels.
    #[serde(default)]
    pub vxlan: VxlanMode,
    /// Only nodes carrying every one of these labels (`node_labels`) allocate from the pool;
    /// empty: every node.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub node_selector: std::collections::BTreeMap<String, String>,
    /// Only pods whose Namespace's labels match this selector (matchLabels /
    /// matchExpressions, as a NetworkPolicy's) get addresses from the pool, however they ask
    /// (by default, by a pool annotation, or by a fixed address); absent: every namespace.
    /// Needs the `kubernetes` datastore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<crate::selector::LabelSelector>,
    /// Block sizes the pool had before `blockSize` (each in blockSize's range): blocks of
    /// these sizes, made before the change, still count. A block of any other size is
    /// ignored by every node (docs/decisions.md, "Blocks are well-formed or ignored").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous_block_sizes: Vec<u8>,
}

impl PoolConfig {
    pub fn new(cidr: IpNet) -> Self {
        Self {
            cidr,
            block_size: None,
            nat_outgoing: false,
            disabled: false,
            vxlan: VxlanMode::default(),
            node_selector: Default::default(),
            namespace_selector: None,
            previous_block_sizes: Vec::new(),
        }
    }

    /// Whether a node with `labels` uses this pool.
    pub fn selects(&self, labels: &std::collections::BTreeMap<String, String>) -> bool {
        self.node_selector
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }

    pub fn block_size(&self) -> u8 {
        self.block_size.unwrap_or(match self.cidr {
            IpNet::V4(_) => 26,
            IpNet::V6(_) => 122,
        })
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let range = crate::ipam::wellformed::block_sizes(matches!(self.cidr, IpNet::V4(_)));
        for bs in
            std::iter::once(self.block_size()).chain(self.previous_block_sizes.iter().copied())
        {
            if !range.contains(&bs) {
                return Err(ConfigError::BlockSize {
                    cidr: self.cidr,
                    block_size: bs,
                });
            }
            if bs < self.cidr.prefix_len() {
                return Err(ConfigError::BlockLargerThanPool {
                    cidr: self.cidr,
                    block_size: bs,
                    prefix: self.cidr.prefix_len(),
                });
            }
        }
        if let Some(sel) = &self.namespace_selector {
            sel.validate()
                .map_err(|source| ConfigError::NamespaceSelector {
                    cidr: self.cidr,
                    source,
                })?;
        }
        Ok(())
    }
}

/// A day, in seconds: the longest most durations of the config may be.
pub const DAY: u64 = 86_400;

/// One number of the config and its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounded {
    /// Its key in the config file (`section.key`).
    pub key: &'static str,
    pub value: u64,
    pub min: u64,
    pub max: u64,
}

impl Bounded {
    fn new(key: &'static str, value: impl Into<u64>, min: u64, max: u64) -> Self {
        Self {
            key,
            value: value.into(),
            min,
            max,
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        if (self.min..=self.max).contains(&self.value) {
            Ok(())
        } else {
            Err(ConfigError::OutOfRange {
                key: self.key,
                value: self.value,
                min: self.min,
                max: self.max,
            })
        }
    }
}

impl AgentConfig {
    /// Every duration and size of the config with its bounds, in one place: what
    /// [`AgentConfig::validate`] checks, and what the chart's values.schema.json may not exceed
    /// (tests/tests/chart.rs holds them together). Durations stay far below what an `Instant`
    /// or a timer can add without overflowing, sizes below what the node can hold.
    pub fn bounded(&self) -> Vec<Bounded> {
        let (k, n, i, r, d) = (
            &self.kubernetes,
            &self.nat,
            &self.ipam,
            &self.routes,
            &self.datastore,
        );
        let week = 7 * DAY;
        vec![
            Bounded::new("resync_interval_secs", self.resync_interval_secs, 1, DAY),
            Bounded::new(
                "kubernetes.pod_gone_grace_secs",
                k.pod_gone_grace_secs,
                0,
                DAY,
            ),
            Bounded::new(
                "kubernetes.pod_check_interval_secs",
                k.pod_check_interval_secs,
                1,
                3_600,
            ),
            Bounded::new("routes.grace_secs", r.grace_secs, 1, DAY),
            Bounded::new("datastore.timeout_ms", d.timeout_ms, 1, 300_000),
            Bounded::new("datastore.attempts", d.attempts, 1, 1_000),
            Bounded::new(
                "ipam.maxBlocksPerNode",
                i.max_blocks_per_node as u64,
                1,
                65_536,
            ),
            Bounded::new(
                "ipam.leakCheckIntervalSecs",
                i.leak_check_interval_secs,
                1,
                DAY,
            ),
            Bounded::new("ipam.leakGraceSecs", i.leak_grace_secs, 0, week),
            Bounded::new(
                "ipam.emptyBlockGraceSecs",
                i.empty_block_grace_secs,
                0,
                week,
            ),
            Bounded::new("nat.conntrack_entries", n.conntrack_entries, 2, 1 << 24),
            Bounded::new(
                "nat.pressure_unanswered_secs",
                n.pressure_unanswered_secs,
                1,
                3_600,
            ),
            Bounded::new("nat.tcp_established_secs", n.tcp_established_secs, 1, week),
            Bounded::new("nat.tcp_syn_secs", n.tcp_syn_secs, 1, 3_600),
            Bounded::new("nat.tcp_closing_secs", n.tcp_closing_secs, 1, 3_600),
            Bounded::new("nat.udp_secs", n.udp_secs, 1, DAY),
            Bounded::new("nat.icmp_secs", n.icmp_secs, 1, 3_600),
            Bounded::new(
                "nat.cleaner_interval_secs",
                n.cleaner_interval_secs,
                1,
                3_600,
            ),
        ]
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

    /// Checks what serde cannot: block sizes, a node name.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node_name.trim().is_empty() {
            return Err(ConfigError::NoNodeName);
        }
        if self.node_name.contains('/') || self.node_name.chars().any(char::is_control) {
            return Err(ConfigError::BadNodeName {
                name: self.node_name.clone(),
            });
        }
        for b in self.bounded() {
            b.check()?;
        }
        self.datastore.validate()?;
        if self.datastore.is_kubernetes() && self.pools_configured {
            return Err(ConfigError::PoolsInKubernetes);
        }
        self.ipam.validate()?;
        self.routes.validate()?;
        self.vxlan.validate()?;
        self.xdp_policy()?;
        self.nat_settings()?;
        if self.xdp.enabled && self.dataplane != DataplaneMode::Ebpf {
            return Err(ConfigError::XdpNeedsEbpf);
        }
        if self.xdp.enabled && self.uplinks.is_empty() {
            return Err(ConfigError::XdpNoUplinks);
        }
        if self.routes.enabled && self.uplinks.is_empty() {
            return Err(ConfigError::RoutesNoUplinks);
        }
        self.pools.iter().try_for_each(PoolConfig::validate)?;
        if let Some(p) = self
            .pools
            .iter()
            .find(|p| p.namespace_selector.is_some() && !self.datastore.is_kubernetes())
        {
            return Err(ConfigError::NamespaceSelectorNeedsKubernetes { cidr: p.cidr });
        }
        for (i, a) in self.pools.iter().enumerate() {
            for b in &self.pools[i + 1..] {
                if a.cidr == b.cidr {
                    return Err(ConfigError::Duplicate { cidr: a.cidr });
                }
                if a.cidr.contains(&b.cidr.network()) || b.cidr.contains(&a.cidr.network()) {
                    return Err(ConfigError::Overlap {
                        a: a.cidr,
                        b: b.cidr,
                    });
                }
            }
        }
        Ok(())
    }

    /// The XDP prefilter's policy: the deny list and the failsafe ports (the configured ones
    /// plus the metrics port), each entry checked.
    pub fn xdp_policy(&self) -> Result<XdpPolicy, ConfigError> {
        let mut deny = Vec::new();
        for entry in &self.xdp.deny_cidrs {
            let net = xdp::parse_deny(entry).ok_or_else(|| ConfigError::XdpCidr {
                entry: entry.clone(),
            })?;
            if !deny.contains(&net) {
                deny.push(net);
            }
        }
        for v4 in [true, false] {
            let n = deny
                .iter()
                .filter(|n| matches!(n, IpNet::V4(_)) == v4)
                .count();
            if n > XdpPolicy::MAX_DENY_PER_FAMILY {
                return Err(ConfigError::XdpTooMany {
                    key: "deny_cidrs",
                    max: XdpPolicy::MAX_DENY_PER_FAMILY,
                    per: if v4 { " of IPv4" } else { " of IPv6" },
                });
            }
        }
        let mut failsafe = Vec::new();
        for entry in &self.xdp.failsafe_ports {
            let port: Failsafe = entry.parse().map_err(|()| ConfigError::XdpPort {
                entry: entry.clone(),
            })?;
            failsafe.push(port);
        }
        // The agent's own TCP ports: metrics, and the Routes service when enabled.
        let metrics_port = self
            .metrics_addr
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .filter(|p| *p != 0);
        if let Some(port) = metrics_port {
            failsafe.push(Failsafe {
                proto: xdp::L4Proto::Tcp,
                port,
            });
        }
        // Peers' route streams: the cluster must not lose its routes to a deny entry.
        if let Some(port) = self
            .routes
            .enabled
            .then(|| self.routes.listen_port())
            .flatten()
        {
            failsafe.push(Failsafe {
                proto: xdp::L4Proto::Tcp,
                port,
            });
        }
        failsafe.sort();
        failsafe.dedup();
        if failsafe.len() > XdpPolicy::MAX_FAILSAFE {
            return Err(ConfigError::XdpTooMany {
                key: "failsafe_ports",
                max: XdpPolicy::MAX_FAILSAFE,
                per: "",
            });
        }
        Ok(XdpPolicy { deny, failsafe })
    }

    /// The TCP ports closed to pods ([`crate::dataplane::doors`]): the metrics port when it
    /// listens beyond loopback, the Routes port (this node's and the other nodes') when route
    /// distribution is on, each unless `[doors]` lets pods in.
    pub fn door_policy(&self) -> crate::dataplane::doors::DoorPolicy {
        let mut ports = std::collections::BTreeSet::new();
        let metrics = self.metrics_addr.parse::<std::net::SocketAddr>().ok();
        if let Some(m) = metrics.filter(|m| !m.ip().is_loopback() && m.port() != 0) {
            if !self.doors.pods_reach_metrics {
                ports.insert(m.port());
            }
        }
        let routes = self.routes.enabled && !self.doors.pods_reach_routes;
        if routes {
            ports.extend(self.routes.listen_port());
        }
        crate::dataplane::doors::DoorPolicy {
            ports,
            peer_routes_ports: routes,
        }
    }

    /// The XDP prefilter's settings when it is enabled.
    pub fn xdp_settings(&self) -> Result<Option<XdpSettings>, ConfigError> {
        if !self.xdp.enabled {
            return Ok(None);
        }
        Ok(Some(XdpSettings {
            mode: self.xdp.mode,
            policy: self.xdp_policy()?,
        }))
    }

    /// SNAT's settings: `natOutgoing` IPv4 pools (of this node), no-SNAT destinations (every
    /// pool, whatever node it is for, plus `non_masquerade_cidrs`), sizes and timeouts.
    pub fn nat_settings(&self) -> Result<crate::dataplane::nat::NatSettings, ConfigError> {
        use crate::dataplane::nat::{NatSettings, Timeouts};
        use std::time::Duration;
        let n = &self.nat;
        let v4 = |p: &IpNet| match p {
            IpNet::V4(n) => Some(n.trunc()),
            IpNet::V6(_) => None,
        };
        let mut no_snat: Vec<ipnet::Ipv4Net> =
            self.pools.iter().filter_map(|p| v4(&p.cidr)).collect();
        for entry in &n.non_masquerade_cidrs {
            let net = match xdp::parse_deny(entry) {
                Some(IpNet::V4(net)) => net,
                _ => {
                    return Err(ConfigError::NatCidr {
                        entry: entry.clone(),
                    })
                }
            };
            if !no_snat.contains(&net) {
                no_snat.push(net);
            }
        }
        if no_snat.len() > calix_common::MAX_NO_SNAT_CIDRS as usize {
            return Err(ConfigError::Nat {
                key: "non_masquerade_cidrs",
                what: "at most 4096 entries, pools included",
            });
        }
        if n.port_min == 0 || n.port_max < n.port_min {
            return Err(ConfigError::Nat {
                key: "port_min/port_max",
                what: "a range 1 ≤ port_min ≤ port_max ≤ 65535",
            });
        }
        if n.port_min <= 1024 && n.port_max == u16::MAX {
            return Err(ConfigError::Nat {
                key: "port_min/port_max",
                what: "a range that leaves ports of 1024–65535 to the host's own masquerade",
            });
        }
        if n.conntrack_entries < 2 {
            return Err(ConfigError::Nat {
                key: "conntrack_entries",
                what: "at least 2",
            });
        }
        let ct_budget = n
            .conntrack_flows_per_endpoint
            .unwrap_or(n.conntrack_entries / 8);
        if ct_budget > i32::MAX as u32 {
            return Err(ConfigError::Nat {
                key: "conntrack_flows_per_endpoint",
                what: "at most 2147483647",
            });
        }
        let mut service = Vec::new();
        for entry in &n.service_cidrs {
            let net = xdp::parse_deny(entry).ok_or_else(|| ConfigError::ServiceCidr {
                entry: entry.clone(),
            })?;
            if let Some(pool) = self.pools.iter().find(|p| {
                p.cidr.contains(&net.network()) || net.contains(&p.cidr.trunc().network())
            }) {
                return Err(ConfigError::ServiceOverlapsPool {
                    service: net,
                    pool: pool.cidr,
                });
            }
            if let IpNet::V4(v4) = net {
                if !service.contains(&v4) {
                    service.push(v4);
                }
            }
        }
        if no_snat.len() + service.len() > calix_common::MAX_NO_SNAT_CIDRS as usize {
            return Err(ConfigError::Nat {
                key: "non_masquerade_cidrs/service_cidrs",
                what: "at most 4096 entries together, pools included",
            });
        }
        for b in self.bounded().iter().filter(|b| b.key.starts_with("nat.")) {
            b.check()?;
        }
        Ok(NatSettings {
            nat_pools: self
                .pools
                .iter()
                .filter(|p| p.nat_outgoing && p.selects(&self.node_labels))
                .filter_map(|p| v4(&p.cidr))
                .collect(),
            no_snat,
            service,
            conntrack_entries: n.conntrack_entries,
            ct_budget,
            pressure_unanswered: Duration::from_secs(n.pressure_unanswered_secs),
            timeouts: Timeouts {
                tcp_established: Duration::from_secs(n.tcp_established_secs),
                tcp_syn: Duration::from_secs(n.tcp_syn_secs),
                tcp_closing: Duration::from_secs(n.tcp_closing_secs),
                udp: Duration::from_secs(n.udp_secs),
                icmp: Duration::from_secs(n.icmp_secs),
            },
            port_min: n.port_min,
            port_max: n.port_max,
            cleaner_interval: Duration::from_secs(n.cleaner_interval_secs),
        })
    }

    /// Every pool as this node's allocator sees it: one whose `nodeSelector` does not select
    /// this node is disabled here (no new addresses from it), not gone — the addresses the node
    /// holds in it stay valid, so a label change never counts as removing a pool under live
    /// addresses, and the dataplane still knows the pool's addresses as pods'.
    pub fn node_pools(&self) -> Vec<crate::ipam::Pool> {
        self.pools
            .iter()
            .map(|p| crate::ipam::Pool {
                cidr: p.cidr.trunc(),
                block_size: p.block_size(),
                disabled: p.disabled || !p.selects(&self.node_labels),
                restricted: p.namespace_selector.is_some(),
                previous_block_sizes: p.previous_block_sizes.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        let c = AgentConfig::from_toml("").expect("parse");
        assert_eq!(c, AgentConfig::default());
        assert_eq!(c.pools[0].block_size(), 26);
        assert_eq!(c.dataplane, DataplaneMode::Ebpf);
    }

    #[test]
    fn full_file_parses() {
        let c = AgentConfig::from_toml(
            r#"
            node_name = "node-a"
            socket = "/tmp/a.sock"
            dataplane = "kernel"
            tc_attach = "tc"
            [datastore]
            type = "embedded"
            path = "/tmp/store.json"
            [[pools]]
            cidr = "10.10.0.0/16"
            blockSize = 28
            natOutgoing = true
            [[pools]]
            cidr = "fd00:10::/64"
            "#,
        )
        .expect("parse");
        assert_eq!(c.node_name, "node-a");
        assert_eq!(c.dataplane, DataplaneMode::Kernel);
        assert_eq!(c.tc_attach, crate::dataplane::tcx::TcAttach::Tc);
        assert_eq!(c.datastore.path, PathBuf::from("/tmp/store.json"));
        assert_eq!(c.pools.len(), 2);
        assert_eq!(c.pools[0].block_size(), 28);
        assert!(c.pools[0].nat_outgoing);
        assert_eq!(c.pools[1].block_size(), 122);
        c.validate().expect("valid");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        assert!(AgentConfig::from_toml("nodename = \"x\"").is_err());
        assert!(AgentConfig::from_toml("dataplane = \"xdp\"").is_err());
        assert!(AgentConfig::from_toml("tc_attach = \"netkit\"").is_err());
        assert!(AgentConfig::from_toml("[[pools]]\ncidr = \"10.0.0.0/33\"").is_err());
    }

    #[test]
    fn block_size_out_of_range_names_the_pool() {
        let mut c = AgentConfig {
            node_name: "n".into(),
            ..Default::default()
        };
        c.pools[0].block_size = Some(19);
        let err = c.validate().expect_err("19 is out of range").to_string();
        assert!(err.contains("10.244.0.0/16"), "{err}");
        c.pools[0] = PoolConfig::new("10.0.0.0/28".parse().expect("cidr"));
        c.pools[0].block_size = Some(26);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::BlockLargerThanPool { .. })
        ));
    }

    #[test]
    fn previous_block_sizes_are_checked_like_the_block_size_and_reach_the_allocator() {
        let text = "node_name = \"n\"\n[[pools]]\ncidr = \"10.0.0.0/16\"\nblockSize = 28\npreviousBlockSizes = [26, 24]";
        let c = AgentConfig::from_toml(text).expect("parse");
        c.validate().expect("valid");
        assert_eq!(c.node_pools()[0].previous_block_sizes, [26, 24]);
        for bad in ["[19]", "[15]", "[33]"] {
            let c = AgentConfig::from_toml(&format!(
                "node_name = \"n\"\n[[pools]]\ncidr = \"10.0.0.0/16\"\npreviousBlockSizes = {bad}"
            ))
            .expect("parse");
            let err = c.validate().expect_err(bad).to_string();
            assert!(err.contains("10.0.0.0/16"), "{bad}: {err}");
        }
    }

    #[test]
    fn overlapping_pools_name_both() {
        let c = AgentConfig::from_toml(
            "node_name = \"n\"\n[[pools]]\ncidr = \"10.0.0.0/16\"\n[[pools]]\ncidr = \"10.0.128.0/20\"",
        )
        .expect("parse");
        let err = c.validate().expect_err("overlap").to_string();
        assert!(
            err.contains("10.0.0.0/16") && err.contains("10.0.128.0/20"),
            "{err}"
        );
    }

    #[test]
    fn kubernetes_takes_a_kubeconfig_and_refuses_configured_pools() {
        let c = AgentConfig::from_toml(
            "node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"/etc/calix/kubeconfig\"\n",
        )
        .expect("parse");
        c.validate().expect("valid");
        let k = c.datastore.kubernetes();
        assert_eq!(
            k.kubeconfig.as_deref(),
            Some(Path::new("/etc/calix/kubeconfig"))
        );
        assert_eq!((k.timeout.as_millis(), k.attempts), (2000, 12));
        // No kubeconfig: the pod's service account.
        let c = AgentConfig::from_toml("node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\n")
            .expect("parse");
        assert_eq!(c.datastore.kubernetes().kubeconfig, None);
        // Pools are IPPool objects there: [[pools]] is an error that says so.
        let c = AgentConfig::from_toml(
            "node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\n[[pools]]\ncidr = \"10.1.0.0/16\"\n",
        )
        .expect("parse");
        let e = c.validate().expect_err("pools refused");
        assert!(matches!(e, ConfigError::PoolsInKubernetes), "{e}");
        assert!(e.to_string().contains("IPPool"), "{e}");
        let mut c = AgentConfig::from_toml(
            "node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\nattempts = 0\n",
        )
        .expect("parse");
        assert!(matches!(
            c.validate(),
            Err(ConfigError::OutOfRange {
                key: "datastore.attempts",
                ..
            })
        ));
        c.datastore.kind = "etcd".into();
        c.datastore.endpoints = vec!["http://127.0.0.1:2379".into()];
        assert!(matches!(
            c.validate(),
            Err(ConfigError::OutOfRange {
                key: "datastore.attempts",
                ..
            })
        ));
    }

    #[test]
    fn node_selector_picks_pools_and_etcd_needs_endpoints() {
        let mut c = AgentConfig::from_toml(
            r#"
            node_name = "n"
            node_labels = { zone = "a" }
            [ipam]
            strictAffinity = true
            maxBlocksPerNode = 4
            [datastore]
            type = "etcd"
            [[pools]]
            cidr = "10.1.0.0/16"
            nodeSelector = { zone = "a" }
            [[pools]]
            cidr = "10.2.0.0/16"
            nodeSelector = { zone = "b" }
            "#,
        )
        .expect("parse");
        assert!(matches!(c.validate(), Err(ConfigError::NoEtcdEndpoints)));
        c.datastore.endpoints = vec!["http://127.0.0.1:2379".into()];
        c.validate().expect("valid");
        let pools = c.node_pools();
        assert_eq!(pools.len(), 2);
        assert_eq!(pools[0].cidr.to_string(), "10.1.0.0/16");
        assert!(!pools[0].disabled);
        assert!(pools[1].disabled, "zone b's pool: nothing new from it here");
        assert!(c.ipam.policy().strict_affinity);
        assert_eq!(c.ipam.policy().max_blocks_per_node, 4);
        c.datastore.kind = "consul".into();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::DatastoreKind { .. })
        ));
    }

    #[test]
    fn a_namespace_selector_restricts_a_pool_and_needs_kubernetes() {
        let text = r#"
            node_name = "n"
            [[pools]]
            cidr = "10.1.0.0/16"
            [[pools]]
            cidr = "10.2.0.0/16"
            namespaceSelector = { matchLabels = { tenant = "a" }, matchExpressions = [
                { key = "env", operator = "NotIn", values = ["prod"] } ] }
            "#;
        let mut c = AgentConfig::from_toml(text).expect("parse");
        let sel = c.pools[1].namespace_selector.clone().expect("the selector");
        assert_eq!(sel.to_string(), "tenant=a,env notin (prod)");
        let pools = c.node_pools();
        assert!(!pools[0].restricted && pools[1].restricted);
        assert!(!pools[1].disabled);
        let e = c.validate().expect_err("embedded datastore");
        assert!(
            matches!(e, ConfigError::NamespaceSelectorNeedsKubernetes { .. }),
            "{e}"
        );
        assert!(e.to_string().contains("10.2.0.0/16"), "{e}");
        // With the kubernetes datastore the pools are IPPools, validated the same way.
        c.datastore.kind = "kubernetes".into();
        c.pools_configured = false;
        c.validate().expect("valid");
        c.pools[1].namespace_selector = Some(
            serde_json::from_str(r#"{"matchExpressions": [{"key": "tenant", "operator": "In"}]}"#)
                .expect("parse"),
        );
        let e = c.validate().expect_err("In without values");
        assert!(matches!(e, ConfigError::NamespaceSelector { .. }), "{e}");
        assert!(
            format!("{:#}", anyhow::Error::from(e)).contains("needs at least one value"),
            "the source says why"
        );
    }

    #[test]
    fn xdp_section_parses_and_names_bad_entries() {
        let c = AgentConfig::from_toml(
            r#"
            node_name = "n"
            uplinks = ["eth0"]
            metrics_addr = "0.0.0.0:9191"
            [xdp]
            enabled = true
            mode = "generic"
            deny_cidrs = ["192.0.2.0/24", "198.51.100.7", "2001:db8::/32", "192.0.2.9/24"]
            failsafe_ports = ["tcp:2222", "udp:53"]
            "#,
        )
        .expect("parse");
        c.validate().expect("valid");
        let s = c.xdp_settings().expect("settings").expect("enabled");
        assert_eq!(s.mode, XdpMode::Generic);
        let deny: Vec<String> = s.policy.deny.iter().map(ToString::to_string).collect();
        assert_eq!(
            deny,
            ["192.0.2.0/24", "198.51.100.7/32", "2001:db8::/32"],
            "host bits cleared, duplicates folded"
        );
        let ports: Vec<String> = s.policy.failsafe.iter().map(ToString::to_string).collect();
        assert_eq!(
            ports,
            ["tcp:2222", "tcp:9191", "udp:53"],
            "metrics port added"
        );

        let mut bad = c.clone();
        bad.xdp.deny_cidrs.push("192.0.2.0/33".into());
        let err = bad.validate().expect_err("bad CIDR").to_string();
        assert!(err.contains("192.0.2.0/33"), "{err}");
        let mut bad = c.clone();
        bad.xdp.failsafe_ports.push("tcp:ssh".into());
        let err = bad.validate().expect_err("bad port").to_string();
        assert!(err.contains("tcp:ssh"), "{err}");
        let mut bad = c.clone();
        bad.uplinks.clear();
        assert!(matches!(bad.validate(), Err(ConfigError::XdpNoUplinks)));
        bad.dataplane = DataplaneMode::Kernel;
        assert!(matches!(bad.validate(), Err(ConfigError::XdpNeedsEbpf)));
        assert!(AgentConfig::from_toml("[xdp]\nmode = \"offload\"").is_err());
    }

    #[test]
    fn xdp_is_off_by_default_with_ssh_and_metrics_failsafe() {
        let c = AgentConfig {
            node_name: "n".into(),
            ..Default::default()
        };
        c.validate().expect("valid");
        assert_eq!(c.xdp_settings().expect("settings"), None);
        let ports: Vec<String> = c
            .xdp_policy()
            .expect("policy")
            .failsafe
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(ports, ["tcp:22", "tcp:9091"]);
    }

    #[test]
    fn nat_section_parses_and_is_checked() {
        let c = AgentConfig::from_toml(
            r#"
            node_name = "n"
            uplinks = ["eth0"]
            [[pools]]
            cidr = "10.10.0.0/16"
            natOutgoing = true
            [[pools]]
            cidr = "10.20.0.0/16"
            [[pools]]
            cidr = "fd00:10::/64"
            natOutgoing = true
            [nat]
            non_masquerade_cidrs = ["192.168.0.0/16", "172.16.0.9"]
            conntrack_entries = 1000
            tcp_established_secs = 100
            tcp_syn_secs = 20
            tcp_closing_secs = 3
            udp_secs = 30
            icmp_secs = 10
            port_min = 20000
            port_max = 20999
            cleaner_interval_secs = 2
            "#,
        )
        .expect("parse");
        c.validate().expect("valid");
        let s = c.nat_settings().expect("settings");
        let strs = |v: &[ipnet::Ipv4Net]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(
            strs(&s.nat_pools),
            ["10.10.0.0/16"],
            "IPv4 natOutgoing pools only"
        );
        assert_eq!(
            strs(&s.no_snat),
            [
                "10.10.0.0/16",
                "10.20.0.0/16",
                "192.168.0.0/16",
                "172.16.0.9/32"
            ]
        );
        assert_eq!(
            (s.port_min, s.port_max, s.conntrack_entries),
            (20000, 20999, 1000)
        );
        assert_eq!(s.timeouts.tcp_closing.as_secs(), 3);
        let mut bad = c.clone();
        bad.nat.non_masquerade_cidrs.push("2001:db8::/32".into());
        assert!(matches!(bad.validate(), Err(ConfigError::NatCidr { .. })));
        let mut bad = c.clone();
        bad.nat.port_max = 100;
        assert!(matches!(bad.validate(), Err(ConfigError::Nat { .. })));
        let mut bad = c;
        bad.nat.udp_secs = 0;
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::OutOfRange {
                key: "nat.udp_secs",
                ..
            })
        ));
        let d = NatConfig::default();
        assert!(d.port_max < 32768, "below the kernel's ephemeral ports");
    }

    /// `service_cidrs`: IPv4 and IPv6 ranges (or addresses), never a pool's; the IPv4 ones
    /// join what the programs never translate (SIGHUP reloads them with the rest).
    #[test]
    fn service_cidrs_parse_and_never_overlap_pools() {
        let text = r#"
            node_name = "n"
            [[pools]]
            cidr = "10.244.0.0/16"
            natOutgoing = true
            [nat]
            non_masquerade_cidrs = ["192.168.0.0/16"]
            service_cidrs = ["10.96.0.0/12", "fd00:96::/108", "203.0.113.7"]
            "#;
        let c = AgentConfig::from_toml(text).expect("parse");
        c.validate().expect("valid");
        let s = c.nat_settings().expect("settings");
        let strs = |v: &[ipnet::Ipv4Net]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(strs(&s.service), ["10.96.0.0/12", "203.0.113.7/32"]);
        assert_eq!(
            strs(&s.untranslated()),
            [
                "10.244.0.0/16",
                "192.168.0.0/16",
                "10.96.0.0/12",
                "203.0.113.7/32"
            ]
        );
        let mut bad = c.clone();
        bad.nat.service_cidrs = vec!["10.96.0.0/33".into()];
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::ServiceCidr { entry }) if entry == "10.96.0.0/33"
        ));
        let mut bad = c.clone();
        bad.nat.service_cidrs = vec!["10.0.0.0/8".into()];
        let err = bad.validate().expect_err("a Service range over the pool");
        assert!(
            matches!(err, ConfigError::ServiceOverlapsPool { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("10.244.0.0/16"), "{err}");
        let mut bad = c;
        bad.nat.service_cidrs = vec!["10.244.5.0/24".into()];
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::ServiceOverlapsPool { .. })
        ));
    }

    /// The per-endpoint budget defaults to a quarter of the table's flows; 0 turns it off.
    #[test]
    fn the_conntrack_budget_and_pressure_settings() {
        let c = AgentConfig::from_toml("node_name = \"n\"\n[nat]\nconntrack_entries = 64\n")
            .expect("parse");
        let s = c.nat_settings().expect("settings");
        assert_eq!(s.ct_budget, 8);
        assert_eq!(s.program_config(&[1]).ct_budget, 8);
        assert_eq!(s.pressure_unanswered, std::time::Duration::from_secs(2));
        let c = AgentConfig::from_toml(
            "node_name = \"n\"\n[nat]\nconntrack_flows_per_endpoint = 0\npressure_unanswered_secs = 5\n",
        )
        .expect("parse");
        let s = c.nat_settings().expect("settings");
        assert_eq!((s.ct_budget, s.pressure_unanswered.as_secs()), (0, 5));
        let mut bad = c.clone();
        bad.nat.pressure_unanswered_secs = 0;
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::OutOfRange {
                key: "nat.pressure_unanswered_secs",
                ..
            })
        ));
        let mut bad = c.clone();
        bad.nat.conntrack_flows_per_endpoint = Some(u32::MAX);
        assert!(matches!(bad.validate(), Err(ConfigError::Nat { .. })));
        // The programs' ports must leave the host's masquerade some.
        let mut bad = c;
        (bad.nat.port_min, bad.nat.port_max) = (1024, 65535);
        assert!(matches!(bad.validate(), Err(ConfigError::Nat { .. })));
    }

    #[test]
    fn missing_node_name_is_an_error() {
        assert!(matches!(
            AgentConfig::default().validate(),
            Err(ConfigError::NoNodeName)
        ));
        for bad in ["a/b", "a\nb"] {
            let c = AgentConfig {
                node_name: bad.into(),
                ..AgentConfig::default()
            };
            assert!(
                matches!(c.validate(), Err(ConfigError::BadNodeName { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn missing_default_file_is_defaults_but_required_file_is_error() {
        let p = Path::new("/nonexistent/calix/agent.toml");
        assert_eq!(
            AgentConfig::load(p, false).expect("defaults"),
            AgentConfig::default()
        );
        assert!(matches!(
            AgentConfig::load(p, true),
            Err(ConfigError::Read { .. })
        ));
    }

    #[test]
    fn pods_reach_no_agent_port_unless_allowed() {
        let mut c = AgentConfig::from_toml(
            "metrics_addr = \"0.0.0.0:9091\"\n[routes]\nenabled = true\nlisten = \":6000\"\nplaintext = true\n",
        )
        .expect("parse");
        assert_eq!(c.doors, DoorsConfig::default());
        let p = c.door_policy();
        assert_eq!(p.ports, [6000, 9091].into());
        assert!(p.peer_routes_ports);
        c.doors = AgentConfig::from_toml("[doors]\npods_reach_metrics = true\n")
            .expect("parse")
            .doors;
        assert_eq!(c.door_policy().ports, [6000].into(), "Prometheus in a pod");
        c.doors.pods_reach_routes = true;
        let p = c.door_policy();
        assert!(p.ports.is_empty() && !p.peer_routes_ports, "{p:?}");
        // Metrics on loopback only: no pod reaches it anyway; routes off: no Routes port.
        let d = AgentConfig::default();
        assert!(d.door_policy().ports.is_empty(), "{:?}", d.door_policy());
        assert!(AgentConfig::from_toml("[doors]\npods_reach_everything = true\n").is_err());
    }

    #[test]
    fn routes_and_vxlan_parse_and_validate() {
        let text = r#"
            node_name = "n1"
            uplinks = ["eth0"]
            [routes]
            enabled = true
            listen = "0.0.0.0:5474"
            node_addresses = ["192.0.2.10"]
            topology = "reflectors"
            grace_secs = 30
            [routes.tls]
            cert = "/etc/calix/tls/node.crt"
            key = "/etc/calix/tls/node.key"
            ca = "/etc/calix/tls/ca.crt"
            [vxlan]
            vni = 7
            [[pools]]
            cidr = "10.244.0.0/16"
            vxlan = "always"
            [[pools]]
            cidr = "10.245.0.0/16"
        "#;
        let c = AgentConfig::from_toml(text).expect("parse");
        c.validate().expect("valid");
        assert_eq!(c.routes.topology, Topology::Reflectors);
        assert_eq!(c.pools[0].vxlan, VxlanMode::Always);
        assert_eq!(c.pools[1].vxlan, VxlanMode::CrossSubnet, "the default");
        assert_eq!((c.vxlan.vni, c.vxlan.port), (7, 4789));
        // The Routes port is failsafe for XDP.
        assert!(c
            .xdp_policy()
            .expect("policy")
            .failsafe
            .iter()
            .any(|f| f.port == 5474));

        let mut bad = c.clone();
        bad.routes.tls = TlsConfig::default();
        assert!(matches!(bad.validate(), Err(ConfigError::RoutesNoTls)));
        bad.routes.plaintext = true;
        bad.validate().expect("plain text when asked for");
        // A certificate through the Kubernetes API: no files needed, a signer and a
        // ConfigMap named.
        let k = AgentConfig::from_toml(
            "node_name = \"n1\"\nuplinks = [\"eth0\"]\n[routes]\nenabled = true\n[routes.tls]\nsource = \"kubernetes\"\n",
        )
        .expect("parse");
        k.validate().expect("kubernetes source");
        assert_eq!(k.routes.tls.source, CertSource::Kubernetes);
        assert_eq!(k.routes.tls.signer_name, "calix.dev/routes");
        assert_eq!(
            k.routes.tls.ca_config_map(),
            Some(("kube-system", "calix-routes-ca"))
        );
        for (signer, cm, key) in [
            ("calix.dev", "kube-system/x", "tls.signer_name"),
            ("/routes", "kube-system/x", "tls.signer_name"),
            ("calix.dev/routes", "x", "tls.ca_config_map"),
            ("calix.dev/routes", "ns/", "tls.ca_config_map"),
            ("calix.dev/routes", "a/b/c", "tls.ca_config_map"),
        ] {
            let mut bad = k.clone();
            bad.routes.tls.signer_name = signer.into();
            bad.routes.tls.ca_config_map = cm.into();
            match bad.validate() {
                Err(ConfigError::Routes { key: k, .. }) => assert_eq!(k, key, "{signer} {cm}"),
                other => panic!("{signer} {cm}: {other:?}"),
            }
        }
        assert!(
            AgentConfig::from_toml("[routes.tls]\nsource = \"secret\"\n").is_err(),
            "an unknown source"
        );
        let mut bad = c.clone();
        bad.uplinks.clear();
        let err = bad.validate().expect_err("no uplinks");
        assert!(matches!(err, ConfigError::RoutesNoUplinks), "{err}");
        assert!(err.to_string().contains("uplinks"), "{err}");
        assert_eq!(
            c.routes.listen_on(),
            Some(ListenOn::Address("0.0.0.0:5474".parse().expect("addr")))
        );
        assert_eq!(
            RoutesConfig::default().listen_on(),
            Some(ListenOn::NodeAddresses { port: 5474 }),
            "the node's own addresses by default"
        );
        for (listen, want) in [
            (":6000", Some(ListenOn::NodeAddresses { port: 6000 })),
            (
                "[fd00::1]:5474",
                Some(ListenOn::Address("[fd00::1]:5474".parse().expect("addr"))),
            ),
            ("0.0.0.0", None),
            (":0", None),
            (":", None),
            ("node-a:5474", None),
            ("192.0.2.1:99999", None),
        ] {
            let mut r = c.routes.clone();
            r.listen = listen.into();
            assert_eq!(r.listen_on(), want, "{listen}");
            let mut bad = c.clone();
            bad.routes.listen = listen.into();
            if want.is_none() {
                let err = bad.validate().expect_err(listen);
                assert!(
                    matches!(err, ConfigError::Routes { key: "listen", .. }),
                    "{listen}: {err}"
                );
                assert!(err.to_string().contains("\":5474\""), "{err}");
            } else {
                bad.validate().expect(listen);
            }
        }
        let mut bad = c.clone();
        bad.routes.node_addresses = vec!["node-a".into()];
        assert!(matches!(bad.validate(), Err(ConfigError::Routes { .. })));
        let mut bad = c.clone();
        bad.vxlan.vni = 1 << 24;
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::Vxlan { key: "vni", .. })
        ));
        assert!(AgentConfig::from_toml(
            "[[pools]]\ncidr = \"10.0.0.0/8\"\nvxlan = \"sometimes\"\n"
        )
        .is_err());
        // Off (the default): nothing of it is checked.
        let mut off = c;
        off.routes = RoutesConfig {
            enabled: false,
            listen: "nonsense".into(),
            ..RoutesConfig::default()
        };
        off.validate().expect("routes off");
    }

    /// A config with `key` (`section.name` or `name`) set to `value`, with what validation
    /// needs besides (a node name; routes on over plain text, so that routes.* counts).
    fn with(key: &str, value: u64) -> Result<AgentConfig, String> {
        let (section, name) = key.split_once('.').unwrap_or(("", key));
        let mut text = "node_name = \"n\"\nuplinks = [\"eth0\"]\n".to_string();
        if section.is_empty() {
            text.push_str(&format!("{name} = {value}\n"));
        }
        let mut routes = "[routes]\nenabled = true\nplaintext = true\n".to_string();
        if section == "routes" {
            routes.push_str(&format!("{name} = {value}\n"));
        } else if !section.is_empty() {
            text.push_str(&format!("[{section}]\n{name} = {value}\n"));
        }
        text.push_str(&routes);
        let c = AgentConfig::from_toml(&text).map_err(|e| format!("{text}: {e}"))?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn every_duration_and_size_has_a_bound_and_one_past_it_is_refused_naming_it() {
        let c = AgentConfig::default();
        for b in c.bounded() {
            with(b.key, b.max).unwrap_or_else(|e| panic!("{}'s maximum is refused: {e}", b.key));
            let e = with(b.key, b.max + 1).expect_err(b.key);
            assert!(
                e.contains(b.key) && e.contains(&b.max.to_string()),
                "{}: {e}",
                b.key
            );
            if b.min > 0 {
                let e = with(b.key, b.min - 1).expect_err(b.key);
                assert!(e.contains(b.key), "{}: {e}", b.key);
            }
        }
        // What used to panic the routes task (an Instant plus the grace period).
        let e = with("routes.grace_secs", i64::MAX as u64).expect_err("a huge grace period");
        assert!(e.contains("routes.grace_secs"), "{e}");
    }

    #[test]
    fn every_number_of_the_config_is_bounded() {
        // Numbers bounded by their type or a check of their own.
        let elsewhere = [
            "vxlan.vni",
            "vxlan.port",
            "nat.port_min",
            "nat.port_max",
            "nat.conntrack_flows_per_endpoint",
        ];
        let c = AgentConfig::default();
        let bounded: Vec<&str> = c.bounded().iter().map(|b| b.key).collect();
        let tree = toml::Value::try_from(&c).expect("the config as TOML");
        let mut numbers = Vec::new();
        fn walk(v: &toml::Value, path: String, out: &mut Vec<String>) {
            match v {
                toml::Value::Integer(_) | toml::Value::Float(_) => out.push(path),
                toml::Value::Table(t) if path != "pools" => {
                    for (k, v) in t {
                        let p = if path.is_empty() {
                            k.clone()
                        } else {
                            format!("{path}.{k}")
                        };
                        walk(v, p, out);
                    }
                }
                _ => {}
            }
        }
        walk(&tree, String::new(), &mut numbers);
        assert!(numbers.len() > 10, "{numbers:?}");
        for n in &numbers {
            assert!(
                bounded.contains(&n.as_str()) || elsewhere.contains(&n.as_str()),
                "{n} has no bound in AgentConfig::bounded()"
            );
        }
    }
}
