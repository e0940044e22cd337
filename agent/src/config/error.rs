//! What is wrong with a config: every error names the key (or the pool) and says what it
//! must be.
use std::path::PathBuf;

use ipnet::IpNet;

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
        source: calix_core::selector::SelectorError,
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
    #[error(
        "services.external_cidrs: {entry:?} is not a CIDR or address (e.g. \"203.0.113.0/24\")"
    )]
    ExternalCidr { entry: String },
    #[error("services.enabled needs the kubernetes datastore: Services are Kubernetes objects")]
    ServicesNeedKubernetes,
    #[error("services.translate needs services.enabled and the ebpf dataplane")]
    TranslateNeedsEbpf,
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
    #[error("bgp.{key} must be {what}")]
    Bgp { key: String, what: String },
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
