//! Types shared by the calix eBPF programs (kernel side, `no_std`) and the agent (user side).
//!
//! Every map key and value is `#[repr(C)]` with no implicit padding, so both sides agree on the
//! layout byte for byte; `tests.rs` pins each size. Addresses are stored as they appear in
//! packets (network byte order).
//!
//! Here: the map and program names, the map keys and values. Apart: why a packet is dropped
//! (`drop_reason.rs`), every published map layout (`layouts.rs`) and NetworkPolicy's maps
//! (`policy.rs`); all re-exported here.
#![no_std]

mod drop_reason;
mod layouts;
mod policy;
mod services;

pub use drop_reason::DropReason;
pub use layouts::{
    layout, str_eq, Layout, MapLayout, BPF_F_NO_PREALLOC, BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_HASH,
    BPF_MAP_TYPE_LPM_TRIE, BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_LRU_PERCPU_HASH,
    BPF_MAP_TYPE_PERCPU_ARRAY, BPF_MAP_TYPE_PERCPU_HASH, LAYOUTS,
};
pub use policy::*;
pub use services::*;

/// Version of the map layout below. Maps are pinned under `<pin root>/v<LAYOUT_VERSION>/`: a
/// build with a different layout never opens (half-reads) maps of another. Every map's type,
/// key and value size, `max_entries` and flags are in [`LAYOUTS`] under this number; a unit
/// test (here for the types, in the agent for the built object) fails when they change
/// without a new version.
pub const LAYOUT_VERSION: u32 = 4;

/// Per-CPU array: an endpoint's slot → [`EndpointCounters`]. The slot is the endpoint's index
/// in every per-endpoint array, below [`MAX_ENDPOINTS`]: the agent hands it out (and zeroes
/// the endpoint's entries) when it registers the endpoint, and writes it into the endpoint's
/// [`EndpointInfo`] and [`LocalEndpoint`]s, so a packet reaches these entries with array
/// lookups (inlined by the verifier) once it has either.
pub const COUNTERS_MAP: &str = "CALIX_COUNTERS";
/// Hash map: host-side ifindex of a `cali*` veth → [`EndpointInfo`] (anti-spoofing, the slot).
/// The endpoint table; the programs look in [`ENDPOINTS_DIRECT_MAP`] first.
pub const ENDPOINTS_MAP: &str = "CALIX_ENDPOINTS";
/// Array: [`direct_bucket`]`(ifindex)` → [`DirectEndpoint`]: a direct-mapped copy of
/// [`ENDPOINTS_MAP`] that the agent keeps in step with it, so the programs find an endpoint
/// with an array lookup (which the verifier inlines) instead of hashing its ifindex. A bucket
/// whose `ifindex` is not the packet's (free: 0, or another endpoint's whose ifindex shares
/// the bucket) sends the program to [`ENDPOINTS_MAP`]. The agent writes an endpoint into its
/// bucket when the bucket is free, stale or its own, and clears it when the endpoint goes.
pub const ENDPOINTS_DIRECT_MAP: &str = "CALIX_EP_DIRECT";
/// Hash map: a local pod's IPv4 address (`u32` as in the packet) → [`LocalEndpoint`].
pub const LOCAL_V4_MAP: &str = "CALIX_LOCAL_V4";
/// Hash map: a local pod's IPv6 address (`[u8; 16]`) → [`LocalEndpoint`].
pub const LOCAL_V6_MAP: &str = "CALIX_LOCAL_V6";
/// Per-CPU hash map: [`DropKey`] (ifindex, reason) → [`DropCount`]. Created by the programs.
pub const DROPS_MAP: &str = "CALIX_DROPS";
/// LPM trie: the IPv4 pools (key: prefix length + `[u8; 4]`, value: `u32` flags, unused so
/// far). Only traffic to pool addresses on other nodes is forwarded by `bpf_fib_lookup`;
/// anything else goes through the host stack (its netfilter, kube-proxy, masquerade).
pub const POOLS_V4_MAP: &str = "CALIX_POOLS_V4";
/// LPM trie: the IPv6 pools (key: prefix length + `[u8; 16]`).
pub const POOLS_V6_MAP: &str = "CALIX_POOLS_V6";
/// Maximum number of pools per family.
pub const MAX_POOLS: u32 = 256;
/// Hash map (not an LRU: nothing is evicted silently): [`FlowKey`] → [`StackFlow`]. Flows the
/// host stack delivered to a pod (`to_pod`) or routed out for one (`to_host_dev`): their
/// replies must go back through the host stack too, so that its conntrack can undo a NAT it
/// did (portmap hostPorts, kube-proxy services). The agent removes an entry once the host's
/// conntrack would have forgotten the flow. A flow that finds the table full marks its
/// endpoint as overflowing ([`STACK_OVERFLOW_MAP`]).
pub const STACK_FLOWS_MAP: &str = "CALIX_STACK_FLOWS";
/// Size of [`STACK_FLOWS_MAP`] (allocated as used: `BPF_F_NO_PREALLOC`).
pub const MAX_STACK_FLOWS: u32 = 262_144;
/// Array: an endpoint's slot → `u32`, [`STACK_MARKED`] when the endpoint has (or had) a flow
/// in [`STACK_FLOWS_MAP`], else 0: only marked endpoints' packets pay the flow lookup on the
/// fast path. Set by the programs as they record flows (and by the agent for flows an older
/// layout recorded); the agent zeroes it with the slot.
pub const STACK_EPS_MAP: &str = "CALIX_STACK_EPS";
/// Array: an endpoint's slot → `u32`, written by the programs only: 0, or
/// [`stack_overflow_mark`] of the last time one of the endpoint's flows could not be recorded
/// (the table was full). Then every packet of the endpoint that the fast path would check
/// against its flows goes to the stack instead, until the agent clears that mark
/// ([`STACK_CLEARED_MAP`]). An overflowing endpoint is marked in [`STACK_EPS_MAP`] too.
pub const STACK_OVERFLOW_MAP: &str = "CALIX_STACK_OVF";
/// Array: an endpoint's slot → `u32`, written by the agent only: the overflow mark of
/// [`STACK_OVERFLOW_MAP`] it has cleared (the programs ignore a mark not newer than this).
/// Kept apart so the agent never overwrites a mark the programs set meanwhile.
pub const STACK_CLEARED_MAP: &str = "CALIX_STACK_CLEARED";
/// The [`STACK_EPS_MAP`] value of a marked endpoint.
pub const STACK_MARKED: u32 = 1;

/// The [`STACK_OVERFLOW_MAP`] value for "a flow could not be recorded at `now_ns`"
/// (`bpf_ktime_get_ns`): the second plus one, never 0.
pub const fn stack_overflow_mark(now_ns: u64) -> u32 {
    (now_ns / 1_000_000_000) as u32 + 1
}

/// [`StackFlow::flags`]: a TCP FIN or RST was seen (the host's conntrack keeps the flow for
/// its TIME_WAIT/CLOSE timeout only).
pub const SF_CLOSING: u32 = 1;

/// A flow the host stack handled ([`STACK_FLOWS_MAP`] value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackFlow {
    /// `bpf_ktime_get_ns()` of the last packet that needed the entry (refreshed at most
    /// about once a second).
    pub last_seen_ns: u64,
    /// `SF_*` bits.
    pub flags: u32,
    pub _pad: u32,
}
/// LPM trie: IPv4 source prefixes the uplink's XDP prefilter drops (key: prefix length +
/// `[u8; 4]`, value: `u32`, unused). Maps added to a layout keep it compatible: an older build
/// never opens them, a newer one creates them next to the existing pins.
pub const DENY_V4_MAP: &str = "CALIX_DENY_V4";
/// LPM trie: IPv6 source prefixes the XDP prefilter drops (key: prefix length + `[u8; 16]`).
pub const DENY_V6_MAP: &str = "CALIX_DENY_V6";
/// Maximum number of deny prefixes per family.
pub const MAX_DENY_CIDRS: u32 = 65_536;
/// Hash map: [`FailsafePort`] → `u32` (unused). TCP/UDP destination ports the XDP prefilter
/// never drops, whatever the source: ssh, the agent's own ports.
pub const FAILSAFE_MAP: &str = "CALIX_FAILSAFE";
/// Maximum number of failsafe ports.
pub const MAX_FAILSAFE_PORTS: u32 = 256;
/// Hash map: an IPv4 address of the node itself (`[u8; 4]`) → `u32` (unused). The XDP
/// prefilter's failsafe ports apply only to packets addressed to one of these (not to pods or
/// anything else the node forwards to); the agent fills it from the node's interfaces and
/// keeps it current.
pub const HOST_V4_MAP: &str = "CALIX_HOST_V4";
/// Hash map: an IPv6 address of the node itself (`[u8; 16]`) → `u32` (unused).
pub const HOST_V6_MAP: &str = "CALIX_HOST_V6";
/// Maximum number of the node's own addresses per family.
pub const MAX_HOST_ADDRS: u32 = 4096;
/// Hash map: host-side veth ifindex → `u32`, written by the programs only (atomic adds): the
/// conntrack flows the endpoint opened minus those the programs removed. With
/// [`CT_FREED_MAP`] (the flows the agent removed) it gives the flows an endpoint holds,
/// checked against [`NatConfig::ct_budget`] before a new flow is admitted.
pub const CT_OWNED_MAP: &str = "CALIX_CT_OWNED";
/// Hash map: host-side veth ifindex → `u32`, written by the agent only: the endpoint's
/// conntrack flows the agent's cleaner (or `calixctl bpf conntrack --flush`) removed.
pub const CT_FREED_MAP: &str = "CALIX_CT_FREED";
/// Hash map: [`CtKey`] → [`CtEntry`]. SNAT connection tracking: two entries per flow, one
/// per direction (the pod's original tuple, and the reply tuple as it arrives at the node).
/// Sized by `[nat] conntrack_entries` (the agent sets `max_entries` at load). A plain hash,
/// not an LRU: a full table refuses new flows (counted as [`DropReason::ConntrackFull`])
/// instead of silently evicting live ones; the agent's cleaner removes expired entries.
pub const CT_MAP: &str = "CALIX_CT";
/// Default size of [`CT_MAP`] (entries; a flow takes two).
pub const DEFAULT_CT_ENTRIES: u32 = 262_144;
/// Array of one [`NatConfig`]: ports, timeouts, uplinks. Written by the agent at load.
pub const NAT_CONFIG_MAP: &str = "CALIX_NAT_CFG";
/// LPM trie: IPv4 destinations pods reach without SNAT (every configured pool, plus
/// `[nat] non_masquerade_cidrs`). Key: prefix length + `[u8; 4]`, value `u32` (unused).
pub const NO_SNAT_V4_MAP: &str = "CALIX_NO_SNAT_V4";
/// Maximum number of no-SNAT prefixes.
pub const MAX_NO_SNAT_CIDRS: u32 = 4096;
/// Uplinks [`NatConfig`] can name.
pub const MAX_NAT_UPLINKS: usize = 8;

/// Array of one [`AgentPorts`]: the TCP ports of the calix agents (Routes, metrics) that
/// pods may not reach on a node's address ([`HOST_V4_MAP`]: this node's, [`PEERS_V4_MAP`]:
/// the others'). `from_pod` drops such packets (`agent_port`). Written by the agent at start.
pub const AGENT_PORTS_MAP: &str = "CALIX_AGENT_PORTS";
/// The most ports [`AgentPorts`] holds.
pub const MAX_AGENT_PORTS: usize = 8;
/// Hash map: an IPv4 address of another node of the cluster (`[u8; 4]`) → `u32` (unused), as
/// route distribution knows the nodes (their records, or Kubernetes' Node objects); kept
/// current by the agent.
pub const PEERS_V4_MAP: &str = "CALIX_PEERS_V4";
/// Hash map: an IPv6 address of another node (`[u8; 16]`) → `u32` (unused).
pub const PEERS_V6_MAP: &str = "CALIX_PEERS_V6";
/// Maximum number of other nodes' addresses per family (allocated as used).
pub const MAX_PEER_ADDRS: u32 = 65_536;

/// The [`AGENT_PORTS_MAP`] value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentPorts {
    /// TCP destination ports, network byte order (as in the packet); 0: an unused slot.
    pub tcp: [u16; MAX_AGENT_PORTS],
}

/// Every map, for pinning, migration and cleanup.
pub const ALL_MAPS: [&str; 48] = [
    STACK_FLOWS_MAP,
    STACK_EPS_MAP,
    STACK_OVERFLOW_MAP,
    STACK_CLEARED_MAP,
    COUNTERS_MAP,
    ENDPOINTS_MAP,
    ENDPOINTS_DIRECT_MAP,
    LOCAL_V4_MAP,
    LOCAL_V6_MAP,
    DROPS_MAP,
    POOLS_V4_MAP,
    POOLS_V6_MAP,
    DENY_V4_MAP,
    DENY_V6_MAP,
    FAILSAFE_MAP,
    HOST_V4_MAP,
    HOST_V6_MAP,
    CT_MAP,
    CT_OWNED_MAP,
    CT_FREED_MAP,
    NAT_CONFIG_MAP,
    NO_SNAT_V4_MAP,
    AGENT_PORTS_MAP,
    PEERS_V4_MAP,
    PEERS_V6_MAP,
    POLICY_IDS_V4_MAP,
    POLICY_IDS_V6_MAP,
    POLICY_MAP,
    POLICY_STATE_MAP,
    POLICY_FLOWS_MAP,
    POLICY_FLOWS_V4_MAP,
    POLICY_PAIRS_MAP,
    POLICY_SYNS_MAP,
    POLICY_OPENERS_MAP,
    POLICY_SCRATCH_MAP,
    POLICY_HITS_MAP,
    POLICY_EVENTS_MAP,
    POLICY_EVENT_BUDGET_MAP,
    SVC_FRONTENDS_MAP,
    SVC_BACKENDS_MAP,
    SVC_REV_MAP,
    SVC_FWD_MAP,
    SVC_AFFINITY_MAP,
    SVC_NODES_MAP,
    SVC_COUNTERS_MAP,
    SVC_FLOWS_MAP,
    SVC_SCRATCH_MAP,
    SVC_MAGLEV_MAP,
];

/// Maximum number of endpoints (and local addresses per family) on one node: the slots, and
/// the buckets of [`ENDPOINTS_DIRECT_MAP`] (a power of two).
pub const MAX_ENDPOINTS: u32 = 16_384;
const _: () = assert!(MAX_ENDPOINTS.is_power_of_two());

/// The [`ENDPOINTS_DIRECT_MAP`] bucket of the endpoint whose host veth is `ifindex`.
pub const fn direct_bucket(ifindex: u32) -> u32 {
    ifindex & (MAX_ENDPOINTS - 1)
}
/// Maximum number of (ifindex, reason) drop counters.
pub const MAX_DROP_KEYS: u32 = 65_536;

/// tc ingress on each host-side `cali*` veth: traffic the pod sends.
pub const PROG_FROM_POD: &str = "from_pod";
/// tc egress on each host-side `cali*` veth: traffic delivered to the pod.
pub const PROG_TO_POD: &str = "to_pod";
/// tc ingress on the node's uplink: traffic arriving from other nodes.
pub const PROG_FROM_HOST_DEV: &str = "from_host_dev";
/// tc egress on the node's uplink: traffic leaving the node.
pub const PROG_TO_HOST_DEV: &str = "to_host_dev";
/// XDP on the node's uplink: the prefilter (deny list, malformed packets, failsafe ports).
pub const PROG_XDP_HOST_DEV: &str = "xdp_host_dev";
/// The tc classifiers (loaded as `SchedClassifier`, attached with cls_bpf).
pub const TC_PROGRAMS: [&str; 4] = [
    PROG_FROM_POD,
    PROG_TO_POD,
    PROG_FROM_HOST_DEV,
    PROG_TO_HOST_DEV,
];
/// The XDP programs (loaded as `Xdp`).
pub const XDP_PROGRAMS: [&str; 1] = [PROG_XDP_HOST_DEV];
/// The Services programs at the sockets (cgroup `sock_addr`; `services`): each program's
/// name, in the order the agent attaches them.
pub const SVC_PROGRAMS: [&str; 8] = [
    "svc_connect4",
    "svc_connect6",
    "svc_sendmsg4",
    "svc_sendmsg6",
    "svc_recvmsg4",
    "svc_recvmsg6",
    "svc_getpeername4",
    "svc_getpeername6",
];
/// Every program, for pinning, the object check and the verifier test: [`TC_PROGRAMS`], then
/// [`XDP_PROGRAMS`], then [`SVC_PROGRAMS`].
pub const ALL_PROGRAMS: [&str; 13] = [
    PROG_FROM_POD,
    PROG_TO_POD,
    PROG_FROM_HOST_DEV,
    PROG_TO_HOST_DEV,
    PROG_XDP_HOST_DEV,
    SVC_PROGRAMS[0],
    SVC_PROGRAMS[1],
    SVC_PROGRAMS[2],
    SVC_PROGRAMS[3],
    SVC_PROGRAMS[4],
    SVC_PROGRAMS[5],
    SVC_PROGRAMS[6],
    SVC_PROGRAMS[7],
];

/// The MAC address of every host-side `cali*` veth (the pods' gateway).
pub const HOST_VETH_MAC: [u8; 6] = [0xee; 6];

/// The EUI-64 link-local address (RFC 4291 appendix A) the kernel gives an interface with
/// `mac` (with `addr_gen_mode` eui64, the default).
pub const fn eui64_link_local(mac: [u8; 6]) -> [u8; 16] {
    [
        0xfe,
        0x80,
        0,
        0,
        0,
        0,
        0,
        0,
        mac[0] ^ 0x02,
        mac[1],
        mac[2],
        0xff,
        0xfe,
        mac[3],
        mac[4],
        mac[5],
    ]
}

/// The link-local address of every host-side `cali*` veth, fe80::ecee:eeff:feee:eeee: the
/// EUI-64 address of [`HOST_VETH_MAC`], and the pods' IPv6 gateway. Never a pod's source
/// address.
pub const HOST_VETH_LINK_LOCAL: [u8; 16] = eui64_link_local(HOST_VETH_MAC);

/// Packet and byte counters of one endpoint, seen from the host side of its veth.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointCounters {
    /// Packets the pod sent (tc ingress on the host veth).
    pub from_pod_packets: u64,
    pub from_pod_bytes: u64,
    /// Packets delivered to the pod (tc egress on the host veth, or redirected into it).
    pub to_pod_packets: u64,
    pub to_pod_bytes: u64,
}

impl EndpointCounters {
    /// Adds `other` into `self` (used to sum the per-CPU values).
    pub fn accumulate(&mut self, other: &EndpointCounters) {
        self.from_pod_packets = self.from_pod_packets.wrapping_add(other.from_pod_packets);
        self.from_pod_bytes = self.from_pod_bytes.wrapping_add(other.from_pod_bytes);
        self.to_pod_packets = self.to_pod_packets.wrapping_add(other.to_pod_packets);
        self.to_pod_bytes = self.to_pod_bytes.wrapping_add(other.to_pod_bytes);
    }
}

/// [`EndpointInfo::flags`]: the endpoint has an IPv4 address.
pub const EP_HAS_V4: u32 = 1;
/// [`EndpointInfo::flags`]: the endpoint has an IPv6 address.
pub const EP_HAS_V6: u32 = 2;
/// [`EndpointInfo::flags`]: the endpoint's IPv4 address is in a `natOutgoing` pool: its
/// traffic to destinations outside [`NO_SNAT_V4_MAP`] leaves with the node's address.
pub const EP_NAT_OUTGOING: u32 = 4;

/// What the programs know of the endpoint behind a host veth: the addresses it may send from,
/// and its slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointInfo {
    /// IPv4 address, network byte order as in the packet (valid with [`EP_HAS_V4`]).
    pub ipv4: [u8; 4],
    /// `EP_HAS_*` bits.
    pub flags: u32,
    /// IPv6 address (valid with [`EP_HAS_V6`]).
    pub ipv6: [u8; 16],
    /// Its index in the per-endpoint arrays ([`COUNTERS_MAP`], [`STACK_EPS_MAP`]...).
    pub slot: u32,
    pub _pad: u32,
}

/// An [`ENDPOINTS_DIRECT_MAP`] bucket: the endpoint it holds (its host veth's `ifindex`, 0 when
/// free) and that endpoint's [`ENDPOINTS_MAP`] value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectEndpoint {
    pub ifindex: u32,
    pub _pad: u32,
    pub info: EndpointInfo,
}

/// A pod on this node, by address: where to deliver to it without the host stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalEndpoint {
    /// ifindex of the pod's host-side veth (`bpf_redirect_peer` target).
    pub ifindex: u32,
    /// The endpoint's slot (as in its [`EndpointInfo`]).
    pub slot: u32,
    /// The pod's own MAC address (the Ethernet destination of delivered frames).
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
}

/// One flow as seen from a local pod: the same key for both directions.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The pod's address (IPv4 in the first 4 bytes, the rest zero).
    pub pod: [u8; 16],
    /// The other end's address.
    pub peer: [u8; 16],
    /// TCP/UDP ports, or the ICMP echo identifier in both, network byte order.
    pub pod_port: u16,
    pub peer_port: u16,
    /// IP protocol number.
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
    pub _pad: [u8; 2],
}

/// `skb->mark` that `from_pod` puts on packets it sends out through the FIB, so `to_host_dev`
/// can tell them from packets the host stack routed (it records only the latter's flows). The
/// packet leaves the node right after, so the mark is cleared there.
pub const FAST_PATH_MARK: u32 = 0x0ca1_1000;

/// The drop-counter reason the `upgrade-test` build of the programs counts every packet from a
/// pod under (without dropping it): how a test tells which build runs.
pub const UPGRADE_TEST_MARK: u32 = 255;

/// [`FailsafePort::proto`] values: the IP protocol numbers.
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Key of [`FAILSAFE_MAP`]: a TCP or UDP destination port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FailsafePort {
    /// Destination port, network byte order (as in the packet).
    pub port: u16,
    /// [`IPPROTO_TCP`] or [`IPPROTO_UDP`].
    pub proto: u8,
    pub _pad: u8,
}

/// Key of a drop counter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DropKey {
    /// Interface the packet was seen on.
    pub ifindex: u32,
    /// One of [`DropReason`] as `u32`.
    pub reason: u32,
}

/// Packets and bytes dropped for one [`DropKey`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropCount {
    pub packets: u64,
    pub bytes: u64,
}

impl DropCount {
    pub fn accumulate(&mut self, other: &DropCount) {
        self.packets = self.packets.wrapping_add(other.packets);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }
}

/// [`CtKey::dir`]: the pod's original tuple (pod → outside, before translation).
pub const CT_DIR_OUT: u8 = 0;
/// [`CtKey::dir`]: the reply tuple as it arrives (outside → node address, NAT port).
pub const CT_DIR_REPLY: u8 = 1;

/// A conntrack key: a 5-tuple as it appears in the packet (network byte order). ICMP echo
/// uses the identifier as both ports.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CtKey {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// [`CT_DIR_OUT`] or [`CT_DIR_REPLY`].
    pub dir: u8,
    pub _pad: [u8; 2],
}

impl CtKey {
    /// Whether the protocol has ports (TCP, UDP); ICMP echo uses its identifier as both.
    #[inline(always)]
    fn ported(&self) -> bool {
        self.proto == IPPROTO_TCP || self.proto == IPPROTO_UDP
    }

    /// The reply key of the flow whose original key is `self`, translated to (`nat_addr`,
    /// `nat_port`): the reply as it arrives at the node.
    #[inline(always)]
    pub fn reply(&self, nat_addr: [u8; 4], nat_port: u16) -> CtKey {
        CtKey {
            src: self.dst,
            dst: nat_addr,
            sport: if self.ported() { self.dport } else { nat_port },
            dport: nat_port,
            proto: self.proto,
            dir: CT_DIR_REPLY,
            _pad: [0; 2],
        }
    }

    /// The original key of the flow whose reply key is `self`, from the pod's (`addr`,
    /// `port`).
    #[inline(always)]
    pub fn original(&self, addr: [u8; 4], port: u16) -> CtKey {
        CtKey {
            src: addr,
            dst: self.src,
            sport: port,
            dport: if self.ported() { self.sport } else { port },
            proto: self.proto,
            dir: CT_DIR_OUT,
            _pad: [0; 2],
        }
    }
}

/// [`CtEntry::flags`]: this direction has sent a packet (a reply entry: the flow is answered).
pub const CT_F_SEEN: u16 = 1;
/// [`CtEntry::flags`]: this direction sent a TCP FIN.
pub const CT_F_FIN: u16 = 2;
/// [`CtEntry::flags`]: this direction sent a TCP RST.
pub const CT_F_RST: u16 = 4;
/// [`CtEntry::flags`]: this direction sent a TCP ACK without SYN (on the original entry: the
/// pod completed the handshake).
pub const CT_F_ACK: u16 = 8;
/// [`CtEntry::flags`]: TCP: [`CtEntry::seq_end`] is known.
pub const CT_F_SEQ: u16 = 16;
/// [`CtEntry::flags`]: TCP: window scaling is in effect for this direction's windows
/// ([`CtEntry::wscale`]); set by its SYN, cleared when the other side's SYN had no scale.
pub const CT_F_WSCALE: u16 = 32;
/// [`CtEntry::flags`]: TCP: [`CtEntry::last_ack`] is known.
pub const CT_F_LAST_ACK: u16 = 64;

/// A conntrack entry. Out entry: `addr`/`port` are the NAT address and port the flow leaves
/// with. Reply entry: the pod's address and port replies are translated back to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of this direction's last packet (refreshed at
    /// most about once a second per direction).
    pub last_seen_ns: u64,
    pub addr: [u8; 4],
    /// Network byte order.
    pub port: u16,
    /// `CT_F_*` bits of this direction.
    pub flags: u16,
    /// Original entries: when the cached route below was looked up (`bpf_ktime_get_ns`; 0:
    /// none). Packets of an established flow reuse it for up to a second instead of asking
    /// the FIB again.
    pub route_ns: u64,
    /// Original entries: the uplink the route leaves by.
    pub route_ifindex: u32,
    /// Original entries: the route's destination then source MAC (the frame's first 12
    /// bytes).
    pub route_macs: [u8; 12],
    /// TCP: this direction's next sequence number (the highest sequence number plus length
    /// seen), host byte order; valid with [`CT_F_SEQ`].
    pub seq_end: u32,
    /// TCP: the largest receive window this direction advertised, scaled, in bytes.
    pub max_win: u32,
    /// The endpoint the flow belongs to (its host-side veth ifindex; 0: unknown): its
    /// conntrack budget is charged for the flow.
    pub owner: u32,
    /// TCP: the acknowledgement number of this direction's latest segment (with
    /// [`CT_F_LAST_ACK`]): a RST answering that segment carries it as its sequence number.
    pub last_ack: u32,
    /// TCP: this direction's window scale shift (with [`CT_F_WSCALE`]).
    pub wscale: u8,
    pub _pad: [u8; 7],
}

/// What the SNAT programs need from the agent's `[nat]` config (one entry of
/// [`NAT_CONFIG_MAP`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatConfig {
    pub tcp_established_ns: u64,
    /// TCP until the handshake completes (a reply, then the pod's ACK).
    pub tcp_syn_ns: u64,
    /// TCP after a RST, or FIN both ways.
    pub tcp_closing_ns: u64,
    pub udp_ns: u64,
    pub icmp_ns: u64,
    /// The uplinks' ifindexes (0: unused slot): SNAT only for traffic routed out of one.
    pub uplinks: [u32; MAX_NAT_UPLINKS],
    /// NAT source ports (and ICMP identifiers), host byte order, inclusive.
    pub port_min: u16,
    pub port_max: u16,
    /// Non-zero: SNAT is on.
    pub enabled: u32,
    /// Conntrack flows one endpoint may hold ([`CT_OWNED_MAP`] − [`CT_FREED_MAP`]); 0: no
    /// limit.
    pub ct_budget: u32,
    /// The VXLAN device's UDP port, network byte order (as in the packet); 0: none. UDP to
    /// this port at one of the node's own addresses is the kernel's VXLAN socket's:
    /// `from_host_dev` passes it to the stack at once. Never a port of the NAT range (the
    /// agent leaves it 0 then: SNAT's replies come to those ports). Was padding before
    /// 2026-12-06: an older agent leaves it 0, an older program ignores it.
    pub tunnel_port: u16,
    pub _pad: u16,
}

impl NatConfig {
    /// How long a flow lives after its last packet, from both directions' flags (`reply`
    /// `None` when that entry is missing).
    pub fn timeout_ns(&self, proto: u8, out_flags: u16, reply_flags: Option<u16>) -> u64 {
        let reply = reply_flags.unwrap_or_default();
        match proto {
            IPPROTO_TCP => {
                let both = out_flags | reply;
                if both & CT_F_RST != 0 || (out_flags & reply & CT_F_FIN) != 0 {
                    self.tcp_closing_ns
                } else if !Self::answered(proto, out_flags, reply) {
                    self.tcp_syn_ns
                } else {
                    self.tcp_established_ns
                }
            }
            IPPROTO_UDP => self.udp_ns,
            _ => self.icmp_ns,
        }
    }

    /// Whether a flow is answered: TCP, the handshake completed (a reply, then an ACK from
    /// the pod); UDP and ICMP, a reply. Unanswered flows go first when the table fills up.
    pub fn answered(proto: u8, out_flags: u16, reply_flags: u16) -> bool {
        let replied = reply_flags & CT_F_SEEN != 0;
        if proto == IPPROTO_TCP {
            replied && out_flags & CT_F_ACK != 0
        } else {
            replied
        }
    }

    /// Whether TCP flags of both directions say the connection is over (RST, or FIN both
    /// ways): its ports may be reused by a new flow at once.
    pub fn tcp_closed(out_flags: u16, reply_flags: u16) -> bool {
        (out_flags | reply_flags) & CT_F_RST != 0 || (out_flags & reply_flags & CT_F_FIN) != 0
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY (all): plain old data, `#[repr(C)]`, no padding, every bit pattern valid.
    unsafe impl aya::Pod for super::EndpointCounters {}
    unsafe impl aya::Pod for super::EndpointInfo {}
    unsafe impl aya::Pod for super::DirectEndpoint {}
    unsafe impl aya::Pod for super::LocalEndpoint {}
    unsafe impl aya::Pod for super::DropKey {}
    unsafe impl aya::Pod for super::DropCount {}
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::FailsafePort {}
    unsafe impl aya::Pod for super::CtKey {}
    unsafe impl aya::Pod for super::CtEntry {}
    unsafe impl aya::Pod for super::NatConfig {}
    unsafe impl aya::Pod for super::StackFlow {}
    unsafe impl aya::Pod for super::AgentPorts {}
    unsafe impl aya::Pod for super::PolicyState {}
    unsafe impl aya::Pod for super::PolicyKey {}
    unsafe impl aya::Pod for super::PolicyFlow {}
    unsafe impl aya::Pod for super::PolicyFlowKeyV4 {}
    unsafe impl aya::Pod for super::PolicyPair {}
    unsafe impl aya::Pod for super::PolicySyn {}
    unsafe impl aya::Pod for super::PolicyOpeners {}
    unsafe impl aya::Pod for super::PolicyScratch {}
    unsafe impl aya::Pod for super::PolicyHitKey {}
    unsafe impl aya::Pod for super::PolicyDropEvent {}
    unsafe impl aya::Pod for super::EventBudget {}
    unsafe impl aya::Pod for super::SvcKey {}
    unsafe impl aya::Pod for super::SvcValue {}
    unsafe impl aya::Pod for super::SvcBackendKey {}
    unsafe impl aya::Pod for super::SvcBackend {}
    unsafe impl aya::Pod for super::SvcRevKey {}
    unsafe impl aya::Pod for super::SvcRevValue {}
    unsafe impl aya::Pod for super::SvcFwdKey {}
    unsafe impl aya::Pod for super::SvcAffKey {}
    unsafe impl aya::Pod for super::SvcNodeKey {}
    unsafe impl aya::Pod for super::SvcAffValue {}
    unsafe impl aya::Pod for super::SvcCounters {}
    unsafe impl aya::Pod for super::SvcFlowKey {}
    unsafe impl aya::Pod for super::SvcFlow {}
    unsafe impl aya::Pod for super::SvcScratch {}
    unsafe impl aya::Pod for super::SvcMaglev {}
}

#[cfg(test)]
mod tests;
