//! The dataplane behind one narrow trait: attach an endpoint's programs and map entries, detach
//! them, read counters. `ebpf` loads the tc programs (and `xdp`, the uplinks' XDP prefilter);
//! `kernel` leaves forwarding to the kernel's routes.
pub mod antispoof;
mod bpf;
pub mod cleaner;
pub mod doors;
pub mod ebpf;
pub mod host_addrs;
pub mod kernel_counts;
pub mod kernel_events;
pub mod kernel_policy;
pub mod masquerade;
pub mod nat;
mod nft;
pub mod pending;
pub mod pins;
pub mod slots;
pub mod stack_flows;
pub mod svc_masquerade;
pub mod tcx;
pub mod xdp;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use calix_common::{DropCount, DropKey, EndpointCounters};
use calix_kernel::host::HostKernel;
use calix_kernel::pod::node_settings;
use ipnet::IpNet;

pub use ebpf::EbpfDataplane;

use calix_core::model::EndpointRecord;
use calix_core::policy::model::PodKey;
use calix_core::policy::tables::Tables;

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("interface {ifname} does not exist on this node")]
    NoInterface { ifname: String },
    #[error(
        "interface {ifname} is another link now (ifindex {found}, the endpoint's was {expected}): \
         it belongs to a newer sandbox"
    )]
    Replaced {
        ifname: String,
        expected: u32,
        found: u32,
    },
    #[error(
        "interface {ifname} is not calix's ({found}): an endpoint is programmed only on the host \
         veth the plugin made for it (a cali… name carrying its owner alias)"
    )]
    NotCalix { ifname: String, found: String },
    #[error("loading the eBPF object failed")]
    Load(#[source] Box<aya::EbpfError>),
    #[error("bpffs pin directory {path}: {op} failed")]
    Pin {
        path: std::path::PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("eBPF program {name}: {op} failed")]
    Program {
        name: &'static str,
        op: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("eBPF map {name}: {op} failed")]
    Map {
        name: &'static str,
        op: &'static str,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    #[error("XDP on {ifname}: {op} failed")]
    Xdp {
        ifname: String,
        op: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(transparent)]
    Nftables(#[from] calix_kernel::nft::NftError),
    #[error("nfnetlink_log group {group} (kernel mode's policy drops)")]
    Nflog {
        group: u16,
        #[source]
        source: calix_kernel::nft::NetlinkError,
    },
    #[error("reading the node's addresses failed")]
    Addresses(#[source] nix::Error),
    #[error(transparent)]
    SlotsFull(#[from] slots::SlotsFull),
    /// Some endpoints' policy entries could not all be written (a full map): those endpoints
    /// are isolated with what was written, and deny the rest; the others are as asked.
    #[error(
        "NetworkPolicy is not fully programmed for {} endpoint(s) (slots {slots:?}), which deny          what could not be written",
        slots.len()
    )]
    PolicyIncomplete {
        slots: Vec<u32>,
        /// Their pods, as far as known.
        pods: Vec<calix_core::policy::model::PodKey>,
        #[source]
        source: Box<DataplaneError>,
    },
    #[error("{0}")]
    Driver(String),
    #[error("reading the kernel's state of {what} failed")]
    Kernel {
        what: String,
        #[source]
        source: Box<calix_kernel::netlink::NetlinkError>,
    },
}

/// What attaching an endpoint produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    pub ifindex: u32,
    pub bpf: bool,
}

/// What the dataplane needs to know of an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    /// The endpoint's identity, "containerID/ifname" ([`EndpointRecord::key`]): what the
    /// dataplane keys its state by, never the host interface's name, which a recreated pod
    /// reuses.
    pub key: String,
    pub host_ifname: String,
    /// The host veth's ifindex the endpoint was created with; `None` when unknown (records
    /// of older plugins), then whatever link has the name is taken.
    pub host_ifindex: Option<u32>,
    pub ipv4: Option<Ipv4Addr>,
    pub ipv6: Option<Ipv6Addr>,
    /// The pod interface's MAC; without it the endpoint is not a target for direct delivery
    /// (the host stack delivers to it).
    pub mac: Option<[u8; 6]>,
    /// The pod it belongs to (its NetworkPolicy); `None` outside Kubernetes.
    pub pod: Option<PodKey>,
}

impl EndpointSpec {
    pub fn from_record(r: &EndpointRecord) -> Self {
        let addrs: Vec<IpAddr> = r
            .addresses
            .iter()
            .filter_map(|a| {
                a.parse::<IpNet>()
                    .map(|n| n.addr())
                    .or_else(|_| a.parse())
                    .ok()
            })
            .collect();
        Self {
            key: r.id(),
            host_ifname: r.host_ifname.clone(),
            host_ifindex: (r.host_ifindex != 0).then_some(r.host_ifindex),
            ipv4: addrs.iter().find_map(|a| match a {
                IpAddr::V4(v) => Some(*v),
                IpAddr::V6(_) => None,
            }),
            ipv6: addrs.iter().find_map(|a| match a {
                IpAddr::V6(v) => Some(*v),
                IpAddr::V4(_) => None,
            }),
            mac: calix_kernel::mac::parse(&r.mac),
            pod: (!r.pod_name.is_empty()).then(|| PodKey {
                namespace: r.pod_namespace.clone(),
                name: r.pod_name.clone(),
            }),
        }
    }
}

/// Something the kernel no longer has as [`Dataplane::attach`] left it for an endpoint, or as
/// the dataplane left its node-wide objects ([`Dataplane::node_drift`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drift {
    /// calix's filter on the ingress (else egress) hook is missing or runs another program
    /// (`found`: the program there now).
    Filter { ingress: bool, found: Option<u32> },
    /// The endpoint's entry (addresses, flags) is missing or differs.
    EndpointEntry,
    /// The local-delivery entry of this address is missing or points at another endpoint.
    LocalEntry(IpAddr),
    /// A node-wide nftables table the dataplane owns (`table`: "family name") differs from
    /// what the agent wrote (`what`: how).
    NftTable { table: String, what: &'static str },
}

impl Drift {
    /// The repair kind it counts as (`calix_repairs_total{kind}`).
    pub fn kind(&self) -> &'static str {
        match self {
            Drift::Filter { .. } => "tc_filter",
            Drift::EndpointEntry => "endpoint_map",
            Drift::LocalEntry(_) => "local_map",
            Drift::NftTable { .. } => "nft_table",
        }
    }
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Drift::Filter { ingress, found } => write!(
                f,
                "the {} filter {}",
                if *ingress { "ingress" } else { "egress" },
                found.map_or_else(
                    || "is missing".to_string(),
                    |id| format!("runs program {id}, not ours")
                )
            ),
            Drift::EndpointEntry => write!(f, "the endpoint map entry is missing or wrong"),
            Drift::LocalEntry(a) => {
                write!(f, "the local-delivery entry of {a} is missing or wrong")
            }
            Drift::NftTable { table, what } => write!(f, "nftables table {table} {what}"),
        }
    }
}

/// Read-only access to the dataplane's counters, independent of the [`Dataplane`] (and of the
/// lock around it): listing endpoints and rendering /metrics read the maps without holding up
/// ADDs and DELs.
pub trait DataplaneStats: Send + Sync {
    /// The counters of the endpoint whose host veth is `ifindex`, summed over CPUs; `None` when
    /// there is no entry.
    fn counters(&self, ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError>;
    /// Every drop counter, summed over CPUs.
    fn drops(&self) -> Result<Vec<(DropKey, DropCount)>, DataplaneError>;
    /// Each endpoint's slot → the ifindex of its host veth (what the drop events name an
    /// endpoint by); empty when the dataplane has no slots.
    fn slots(&self) -> Result<std::collections::BTreeMap<u32, u32>, DataplaneError> {
        Ok(Default::default())
    }
    /// What each Services frontend did at the sockets (connections sent to a backend,
    /// calls refused), summed over CPUs; empty when the dataplane counts none.
    fn service_counters(
        &self,
    ) -> Result<Vec<(calix_common::SvcKey, calix_common::SvcCounters)>, DataplaneError> {
        Ok(Vec::new())
    }
    /// Packets NetworkPolicy denied (to the pod, from it) for each endpoint of `endpoints`
    /// (ifindex, host ifname), in order; zeros when the dataplane counts none.
    fn policy_denied(
        &self,
        endpoints: &[(u32, String)],
    ) -> Result<Vec<(u64, u64)>, DataplaneError> {
        Ok(vec![(0, 0); endpoints.len()])
    }
    /// What the live policy maps say of a packet of `proto` between the endpoint whose host
    /// veth is `ifindex` and `peer`, in direction `ingress` or not; `port` is the endpoint's
    /// port on ingress, the peer's on egress (0: none). `None` when there is no such endpoint
    /// or no maps to read.
    fn policy_verdict(
        &self,
        _ifindex: u32,
        _ingress: bool,
        _peer: std::net::IpAddr,
        _proto: u8,
        _port: u16,
    ) -> Result<Option<LiveVerdict>, DataplaneError> {
        Ok(None)
    }
    /// NetworkPolicy's counts of the endpoint whose host veth is `ifindex` (named
    /// `host_ifname`); `None` when there is no such endpoint or the dataplane counts none.
    fn policy_counts(
        &self,
        _ifindex: u32,
        _host_ifname: &str,
    ) -> Result<Option<PolicyCounts>, DataplaneError> {
        Ok(None)
    }
}

/// What an endpoint's NetworkPolicy maps say of a packet (`calixctl trace`), read from the
/// live maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveVerdict {
    /// Whether the endpoint is isolated in that direction (if not: everything passes).
    pub isolated: bool,
    /// The peer's identity in the maps (the agent's number, shifted; `calix_common`'s
    /// `POLICY_WORLD` when no prefix covers it, `POLICY_SERVICE` for a Service address).
    pub identity: u32,
    /// The rule an entry names, when one covers the packet.
    pub rule: Option<calix_core::policy::tables::RuleId>,
}

/// NetworkPolicy's counts of one endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyCounts {
    /// How many times each rule (its number in `calix_core::policy::tables`) decided for the
    /// endpoint: a new flow, a flow checked again after a change, or a packet judged alone.
    pub hits: std::collections::BTreeMap<calix_core::policy::tables::RuleId, u64>,
    /// Packets denied to the pod, and from it.
    pub denied_ingress: u64,
    pub denied_egress: u64,
}

/// Every method but [`Self::attach`] has a default that does nothing and finds nothing drifted
/// (what a dataplane that keeps no state of its own, e.g. a test's fake, would write); the eBPF
/// and kernel dataplanes implement them all.
pub trait Dataplane: Send {
    /// Programs the endpoint `ep.key` on its host-side veth `ep.host_ifname` (which must still
    /// be the link `ep.host_ifindex`, else [`DataplaneError::Replaced`]). Idempotent; on an
    /// interface that already runs (older) programs, replaces them atomically. Another
    /// endpoint programmed on the same interface name is forgotten (never detached: its link
    /// is gone or is this one).
    fn attach(&mut self, ep: &EndpointSpec) -> Result<Attached, DataplaneError>;
    /// Removes what `attach` did for endpoint `key`, and only what is still its own: map
    /// entries that point at its ifindex, filters only while its interface name still names
    /// its link (a recreated pod's veth of the same name keeps its programs). Idempotent.
    fn detach(&mut self, _key: &str) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// What differs now from what `attach` did for `ep` (its filters and map entries, read back
    /// from `kernel` and the maps); empty when nothing drifted. The caller repairs with
    /// `attach`, which rewrites all of it.
    fn verify(
        &self,
        _ep: &EndpointSpec,
        _kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        Ok(Vec::new())
    }
    /// What differs now from the node-wide objects the dataplane keeps (its nftables tables);
    /// empty when nothing drifted. Reads only. The caller repairs with [`Self::repair_node`].
    fn node_drift(&self) -> Result<Vec<Drift>, DataplaneError> {
        Ok(Vec::new())
    }
    /// Writes the node-wide objects again, as the last start or reload left them.
    fn repair_node(&mut self) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// Programs a host device — an uplink, or calix's VXLAN device — for traffic between
    /// nodes (eBPF: `from_host_dev` / `to_host_dev`, replaced in place). Idempotent.
    fn attach_host_dev(&mut self, _ifname: &str) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// What differs on host device `ifname` (link `index`) from what [`Self::attach_host_dev`]
    /// did; empty when nothing drifted. Reads only.
    fn verify_host_dev(
        &self,
        _ifname: &str,
        _index: u32,
        _kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        Ok(Vec::new())
    }
    /// The consumer of NetworkPolicy's drop events; `None` when the dataplane sends none.
    /// One consumer at a time.
    fn policy_events(&self) -> Result<Option<PolicyDrops>, DataplaneError> {
        Ok(None)
    }
    /// A reader of the counters that works without this object; `None` when the dataplane
    /// keeps none.
    fn stats(&self) -> Result<Option<Box<dyn DataplaneStats>>, DataplaneError> {
        Ok(None)
    }
    /// The pools (remote pod addresses are forwarded without the host stack).
    fn set_pools(&mut self, _pools: &[IpNet]) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// After the initial sync: forget map entries and detach programs of `cali*` interfaces
    /// that are not in `known` (host ifnames).
    fn reconcile(&mut self, _known: &[String]) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// The other nodes (route distribution's view, whenever it changes): pods may not reach
    /// the agents' ports on their addresses either ([`doors`]). Until it is called only this
    /// node's own addresses are closed.
    fn set_peer_nodes(&mut self, _peers: &doors::PeerNodes) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// A config reload (SIGHUP): what may change while running. The XDP deny list and failsafe
    /// ports, the SNAT exclusions, and the host's nftables tables (kernel mode's masquerade
    /// and anti-spoofing, eBPF mode's stack masquerade).
    fn reload(&mut self, _r: &Reload) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// NetworkPolicy: the tables this node's pods' endpoints enforce from now on
    /// (`calix_core::policy::tables`; a pod not in them is not isolated). Until the first call
    /// the dataplane keeps what it enforced before (an agent restart). An endpoint attached
    /// later gets its pod's entries before `attach` returns.
    fn set_policy(&mut self, _tables: Tables) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// Kubernetes Services translated at the sockets (eBPF, `[services] translate`): every
    /// frontend and where it sends new connections (or what changed of them), and the
    /// addresses NodePorts answer on; a
    /// UDP backend that left a frontend ends the connected sockets sent there, on the node
    /// and in `clients` (its pods' network namespaces). Kernel mode: kube-proxy; nothing here.
    fn set_services(
        &mut self,
        _services: &ebpf::services::Translation,
        _clients: &[std::path::PathBuf],
    ) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// Agent shutdown: leaves programs attached and maps pinned, so traffic keeps flowing
    /// while the agent is away.
    fn release(&mut self) {}
}

/// `e: cause: cause…`, for logs.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    calix_log::error_chain(e)
}

/// Resolves an interface name in the agent's network namespace.
pub fn ifindex(ifname: &str) -> Result<u32, DataplaneError> {
    nix::net::if_::if_nametoindex(ifname).map_err(|_| DataplaneError::NoInterface {
        ifname: ifname.to_string(),
    })
}

/// The ifindex of the endpoint's host veth, checked against the one it was created with.
pub fn endpoint_ifindex(ep: &EndpointSpec) -> Result<u32, DataplaneError> {
    let found = ifindex(&ep.host_ifname)?;
    match ep.host_ifindex {
        Some(expected) if expected != found => Err(DataplaneError::Replaced {
            ifname: ep.host_ifname.clone(),
            expected,
            found,
        }),
        _ => Ok(found),
    }
}

/// What a config reload may change in a running dataplane (already validated).
#[derive(Debug, Clone)]
pub struct Reload {
    pub xdp: xdp::XdpPolicy,
    pub nat: nat::NatSettings,
}

impl nat::NatSettings {
    /// Settings with the config's default sizes, ports and timeouts (`[nat]`), no pool and no
    /// exception: a start for tests (the agent's among them).
    pub fn example() -> Self {
        Self {
            nat_pools: Vec::new(),
            no_snat: Vec::new(),
            service: Vec::new(),
            service_v6: Vec::new(),
            conntrack_entries: calix_common::DEFAULT_CT_ENTRIES,
            ct_budget: calix_common::DEFAULT_CT_ENTRIES / 8,
            pressure_unanswered: std::time::Duration::from_secs(2),
            timeouts: nat::Timeouts {
                tcp_established: std::time::Duration::from_secs(21_600),
                tcp_syn: std::time::Duration::from_secs(60),
                tcp_closing: std::time::Duration::from_secs(10),
                udp: std::time::Duration::from_secs(60),
                icmp: std::time::Duration::from_secs(30),
            },
            port_min: 16_384,
            port_max: 32_767,
            tunnel_port: 4789,
            cleaner_interval: std::time::Duration::from_secs(5),
        }
    }
}

/// Kernel mode: no BPF; routes and proxy_arp (set by the CNI plugin) do the forwarding. It owns
/// three nftables tables: the natOutgoing masquerade, the pods' anti-spoofing, and the doors
/// (pods do not reach the agents' ports).
pub struct KernelDataplane {
    /// The masquerade's settings, from the start or the last reload (for repairs).
    nat: nat::NatSettings,
    doors: doors::DoorPolicy,
    /// The other nodes, as last told ([`Dataplane::set_peer_nodes`]).
    peers: doors::PeerNodes,
    /// The tables as the kernel held them after the agent wrote them.
    tables: Vec<nft::OwnedTable>,
    /// NetworkPolicy: the endpoints and what the agent wants ([`kernel_policy`]).
    policy: kernel_policy::KernelPolicy,
}

impl KernelDataplane {
    /// Installs (or replaces, atomically) the kernel mode's nftables tables.
    pub fn start(nat: &nat::NatSettings, doors: doors::DoorPolicy) -> Result<Self, DataplaneError> {
        let mut dp = Self {
            nat: nat.clone(),
            doors,
            peers: doors::PeerNodes::default(),
            tables: Vec::new(),
            policy: Default::default(),
        };
        dp.apply()?;
        Ok(dp)
    }

    fn apply(&mut self) -> Result<(), DataplaneError> {
        // Recorded as written so far: a later failure leaves what was written repairable.
        self.tables.clear();
        antispoof::apply()?;
        self.tables.push(nft::OwnedTable::record(
            antispoof::FAMILY,
            antispoof::TABLE,
        )?);
        masquerade::apply(&self.nat)?;
        self.tables.push(nft::OwnedTable::record(
            masquerade::FAMILY,
            masquerade::TABLE,
        )?);
        self.apply_doors()?;
        self.apply_policy()
    }

    /// The policy table, once the agent has said what it wants (until then an earlier
    /// agent's stays in force).
    fn apply_policy(&mut self) -> Result<(), DataplaneError> {
        self.tables
            .retain(|t| !t.is(kernel_policy::FAMILY, kernel_policy::TABLE));
        if self.policy.apply()? {
            self.tables.push(nft::OwnedTable::record(
                kernel_policy::FAMILY,
                kernel_policy::TABLE,
            )?);
        }
        Ok(())
    }

    fn apply_doors(&mut self) -> Result<(), DataplaneError> {
        self.tables.retain(|t| !t.is(doors::FAMILY, doors::TABLE));
        doors::apply(&doors::Doors::of(&self.doors, &self.peers))?;
        self.tables
            .push(nft::OwnedTable::record(doors::FAMILY, doors::TABLE)?);
        Ok(())
    }
}

/// The node's forwarding on for both families ([`node_settings`]), at start; the reconciler
/// keeps it so.
pub fn enable_forwarding() -> Result<(), DataplaneError> {
    for s in node_settings() {
        let file = s.file();
        if s.optional && !std::path::Path::new(&file).exists() {
            continue;
        }
        calix_kernel::netns::write_sysctl(&file, s.value).map_err(|e| DataplaneError::Kernel {
            what: format!("{file}={}", s.value),
            source: Box::new(e.into()),
        })?;
    }
    Ok(())
}

/// `calix-agent --uninstall`: calix's filters off every `cali*` interface and the uplinks, XDP
/// off the uplinks, the pins and both modes' nftables tables removed. Pods keep their routes
/// (kernel forwarding). Returns how many interfaces were cleared.
pub fn uninstall(cfg: &ebpf::EbpfConfig) -> Result<usize, DataplaneError> {
    let mut n = 0;
    let ifaces = nix::net::if_::if_nameindex().map_err(DataplaneError::Addresses)?;
    for i in ifaces.iter() {
        let name = i.name().to_string_lossy().into_owned();
        if name.starts_with("cali") || cfg.uplinks.contains(&name) {
            tcx::detach(&name, &cfg.tcx_links_dir());
            n += 1;
        }
    }
    // tcx links of other interfaces (calix's VXLAN devices).
    tcx::detach_all(&cfg.tcx_links_dir());
    let xdp_links = xdp::detach_except(&cfg.xdp_links_dir(), &[]);
    if let Err(e) = masquerade::remove() {
        tracing::warn!(error = %e, "cannot remove the masquerade table");
    }
    if let Err(e) = svc_masquerade::remove() {
        tracing::warn!(error = %e, "cannot remove the Services masquerade table");
    }
    if let Err(e) = antispoof::remove() {
        tracing::warn!(error = %e, "cannot remove the kernel-mode anti-spoofing table");
    }
    if let Err(e) = doors::remove() {
        tracing::warn!(error = %e, "cannot remove the doors table");
    }
    if let Err(e) = pending::remove() {
        tracing::warn!(error = %e, "cannot remove the pending-verdict table");
    }
    if let Err(e) = kernel_policy::remove() {
        tracing::warn!(error = %e, "cannot remove the kernel-mode policy table");
    }
    let dir = cfg.node_dir();
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(DataplaneError::Pin {
                path: dir,
                op: "remove",
                source,
            })
        }
    }
    tracing::info!(interfaces = n, xdp_links, pins = %dir.display(), "eBPF dataplane uninstalled");
    Ok(n)
}

/// Kernel mode's counters: NetworkPolicy's, from its nftables table (no per-endpoint packet
/// counters, no drop map).
struct KernelStats(kernel_counts::KernelCounts);

impl DataplaneStats for KernelStats {
    fn counters(&self, _ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError> {
        Ok(None)
    }
    fn drops(&self) -> Result<Vec<(DropKey, DropCount)>, DataplaneError> {
        Ok(Vec::new())
    }
    fn policy_counts(
        &self,
        _ifindex: u32,
        host_ifname: &str,
    ) -> Result<Option<PolicyCounts>, DataplaneError> {
        self.0.of(host_ifname, kernel_policy::read_counts)
    }
    fn policy_denied(
        &self,
        endpoints: &[(u32, String)],
    ) -> Result<Vec<(u64, u64)>, DataplaneError> {
        let names: Vec<&str> = endpoints.iter().map(|(_, n)| n.as_str()).collect();
        self.0.denied(&names, kernel_policy::read_counts)
    }
}

/// Where NetworkPolicy's drop events come from.
pub enum PolicyDrops {
    /// The eBPF programs' ring buffer.
    Ebpf(ebpf::PolicyEvents),
    /// Kernel mode's policy chains, through `nfnetlink_log`.
    Kernel(kernel_events::KernelDrops),
}

impl Dataplane for KernelDataplane {
    // What the kernel does by itself (no programs, maps or host devices to manage: it
    // forwards between nodes alone) is the trait's defaults.
    fn attach(&mut self, ep: &EndpointSpec) -> Result<Attached, DataplaneError> {
        let ifindex = endpoint_ifindex(ep)?;
        // Its pod's policy before the pod runs: a failure fails the ADD (never unpoliced).
        self.policy
            .attached(&ep.key, ep.pod.as_ref(), &ep.host_ifname);
        self.apply_policy()?;
        Ok(Attached {
            ifindex,
            bpf: false,
        })
    }
    fn detach(&mut self, key: &str) -> Result<(), DataplaneError> {
        if self.policy.detached(key) {
            self.apply_policy()?;
        }
        Ok(())
    }
    fn reconcile(&mut self, known: &[String]) -> Result<(), DataplaneError> {
        if self.policy.retain(known) {
            self.apply_policy()?;
        }
        Ok(())
    }
    fn set_policy(&mut self, tables: Tables) -> Result<(), DataplaneError> {
        self.policy.set(tables);
        self.apply_policy()
    }
    fn node_drift(&self) -> Result<Vec<Drift>, DataplaneError> {
        nft::drift_of(&self.tables)
    }
    fn stats(&self) -> Result<Option<Box<dyn DataplaneStats>>, DataplaneError> {
        Ok(Some(Box::new(KernelStats(self.policy.counts()))))
    }
    fn policy_events(&self) -> Result<Option<PolicyDrops>, DataplaneError> {
        kernel_events::KernelDrops::open().map(|d| Some(PolicyDrops::Kernel(d)))
    }
    fn repair_node(&mut self) -> Result<(), DataplaneError> {
        self.apply()
    }
    fn set_peer_nodes(&mut self, peers: &doors::PeerNodes) -> Result<(), DataplaneError> {
        if *peers == self.peers {
            return Ok(());
        }
        self.peers = peers.clone();
        self.apply_doors()
    }
    fn reload(&mut self, r: &Reload) -> Result<(), DataplaneError> {
        self.nat = r.nat.clone();
        self.apply()
    }
}

#[cfg(test)]
mod tests;
