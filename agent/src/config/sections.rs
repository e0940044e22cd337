//! The config file's sections (`[datastore]`, `[ipam]`, `[xdp]`, `[nat]`, `[routes]`,
//! `[vxlan]`, `[kubernetes]`, `[doors]`): the serde schema, each with its defaults.
use std::path::PathBuf;

use calix_core::routes::peers::Topology;
use serde::{Deserialize, Serialize};

use crate::distribution::settings::ListenOn;
use crate::distribution::tls::CertSource;
use crate::paths;
use calix_dataplane::xdp::XdpMode;

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
            reflector_label: crate::kubernetes::peers::REFLECTOR_LABEL.into(),
            grace_secs: 120,
            tls: TlsConfig::default(),
            plaintext: false,
        }
    }
}

impl RoutesConfig {
    /// The port of `listen`.
    pub fn listen_port(&self) -> Option<u16> {
        self.listen_on().map(ListenOn::port)
    }

    /// What `listen` says; `None` when it is not `:port` or `address:port` (port 1–65535).
    pub fn listen_on(&self) -> Option<ListenOn> {
        ListenOn::parse(&self.listen)
    }
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

impl Default for TlsConfig {
    fn default() -> Self {
        Self {
            source: CertSource::Files,
            cert: PathBuf::new(),
            key: PathBuf::new(),
            ca: PathBuf::new(),
            signer_name: calix_pki::ROUTES_SIGNER.into(),
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
}

/// The default port of `calix.v1.Routes` between nodes.
pub const ROUTES_PORT: u16 = 5474;

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

/// NetworkPolicy in the eBPF dataplane (`[policy]`), read at start. A changed size carries the
/// entries into a map of the new size at the next start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Allow entries of every endpoint of the node together (allocated as used). An endpoint
    /// whose entries do not fit denies what is missing and is reported.
    pub entries: u32,
    /// Flows of isolated endpoints remembered, so that replies pass, per family (an LRU for
    /// IPv4 and one for IPv6, each allocated in full at start, about 100 bytes a flow; when
    /// full, the least recently used is forgotten and its next packet checked again as a new
    /// flow).
    pub flows: u32,
    /// A connection a policy change would refuse goes on until it goes idle (new connections
    /// meet the new rules), as Calico does; off (the default): refused from its next packet.
    pub keep_established: bool,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            entries: calix_common::DEFAULT_POLICY_ENTRIES,
            flows: calix_common::DEFAULT_POLICY_FLOWS,
            keep_established: false,
        }
    }
}

/// Kubernetes Services (`[services]`, Kubernetes datastore; issue 24). Today the agent follows
/// the cluster's Services and EndpointSlices and calculates what each node would program
/// (`calixctl services`); the dataplane does not translate them yet, so kube-proxy still must.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServicesConfig {
    /// Follow and calculate the cluster's Services.
    pub enabled: bool,
    /// Where a Service's `externalIPs` and LoadBalancer ingress addresses may be (CIDRs or
    /// addresses). Empty (the default): none is taken, so that whoever may create a Service
    /// cannot capture another's traffic (CVE-2020-8554). A node's, a pool's, a loopback,
    /// link-local, multicast or unspecified address never is, whatever this says.
    pub external_cidrs: Vec<String>,
    /// Room for frontends (a Service's address and port: each cluster IP, NodePort, external
    /// and LoadBalancer address of each port). A Service that does not fit in what is left is
    /// refused whole and reported; it never evicts another.
    pub frontends: u32,
    /// Room for backend entries: over every frontend, the backends it may send to.
    pub backends: u32,
    /// eBPF dataplane: translate the calculated Services at the sockets of every process in
    /// `cgroup` (connect, sendmsg, recvmsg, getpeername): a connection to a frontend goes to a
    /// backend from its first packet. Off: the programs are detached (kube-proxy translates).
    pub translate: bool,
    /// The cgroup (v2) whose processes' sockets are translated, its descendants included;
    /// default: the root of the v2 hierarchy, `/sys/fs/cgroup`: every process of the node. A
    /// path that is no cgroup v2 but has one at `unified` below it (a hybrid host's
    /// `/sys/fs/cgroup`) means that one.
    pub cgroup: Option<std::path::PathBuf>,
}

impl Default for ServicesConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            external_cidrs: Vec::new(),
            frontends: 65_536,
            backends: 262_144,
            translate: false,
            cgroup: None,
        }
    }
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
    pub fn is_kubernetes(&self) -> bool {
        self.kind == "kubernetes"
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
