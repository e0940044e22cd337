//! Every map the programs use, each defined once and pinned by name: the agent gives the loader
//! a per-node, per-layout-version pin directory, so a restarted agent (or a new build with the
//! same layout) reuses the very maps the running programs use. Names and sizes come from
//! `calix_common`.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{
        Array, HashMap, LpmTrie, LruHashMap, LruPerCpuHashMap, PerCpuArray, PerCpuHashMap, RingBuf,
    },
};
use calix_common::{
    direct_bucket, AgentPorts, CtEntry, CtKey, DirectEndpoint, DropCount, DropKey,
    EndpointCounters, EndpointInfo, EventBudget, FailsafePort, FlowKey, LocalEndpoint, NatConfig,
    PolicyFlow, PolicyFlowKeyV4, PolicyHitKey, PolicyKey, PolicyOpeners, PolicyPair, PolicyScratch,
    PolicyState, PolicySyn, StackFlow, SvcAffKey, SvcAffValue, SvcBackend, SvcBackendKey,
    SvcCounters, SvcFlow, SvcFlowKey, SvcFwdKey, SvcKey, SvcMaglev, SvcNodeKey, SvcRevKey,
    SvcRevValue, SvcScratch, SvcValue, DEFAULT_CT_ENTRIES, DEFAULT_POLICY_ENTRIES,
    DEFAULT_POLICY_FLOWS, DEFAULT_SVC_BACKENDS, DEFAULT_SVC_FRONTENDS, MAX_DENY_CIDRS,
    MAX_DROP_KEYS, MAX_ENDPOINTS, MAX_FAILSAFE_PORTS, MAX_HOST_ADDRS, MAX_NO_SNAT_CIDRS,
    MAX_PEER_ADDRS, MAX_POLICY_HITS, MAX_POLICY_PREFIXES, MAX_POOLS, MAX_STACK_FLOWS,
    POLICY_EVENTS_BYTES, POLICY_OPENERS, POLICY_PAIRS, SVC_AFFINITY_ENTRIES, SVC_COUNTER_ENTRIES,
    SVC_FLOW_ENTRIES, SVC_MAGLEV_ENTRIES, SVC_NODE_ENTRIES, SVC_REV_ENTRIES,
};

/// Flows the host stack handled for a local pod; their replies go back through the stack.
/// A plain hash: a full table refuses the flow (and marks its endpoint), never evicts.
#[map(name = "CALIX_STACK_FLOWS")]
pub static CALIX_STACK_FLOWS: HashMap<FlowKey, StackFlow> =
    HashMap::pinned(MAX_STACK_FLOWS, BPF_F_NO_PREALLOC);

/// Endpoint slot → `STACK_MARKED` when the endpoint has a flow in `CALIX_STACK_FLOWS`.
#[map(name = "CALIX_STACK_EPS")]
pub static CALIX_STACK_EPS: Array<u32> = Array::pinned(MAX_ENDPOINTS, 0);

/// Endpoint slot → its overflow mark (0: none).
#[map(name = "CALIX_STACK_OVF")]
pub static CALIX_STACK_OVF: Array<u32> = Array::pinned(MAX_ENDPOINTS, 0);

/// Endpoint slot → the overflow mark the agent has cleared.
#[map(name = "CALIX_STACK_CLEARED")]
pub static CALIX_STACK_CLEARED: Array<u32> = Array::pinned(MAX_ENDPOINTS, 0);

/// Endpoint slot → that endpoint's counters. The agent zeroes a slot when it hands it out.
#[map(name = "CALIX_COUNTERS")]
pub static CALIX_COUNTERS: PerCpuArray<EndpointCounters> = PerCpuArray::pinned(MAX_ENDPOINTS, 0);

/// Host-side veth ifindex → the addresses the endpoint may send from, and its slot.
#[map(name = "CALIX_ENDPOINTS")]
pub static CALIX_ENDPOINTS: HashMap<u32, EndpointInfo> = HashMap::pinned(MAX_ENDPOINTS, 0);

/// The same, direct-mapped by ifindex (see `calix_common::ENDPOINTS_DIRECT_MAP`).
#[map(name = "CALIX_EP_DIRECT")]
pub static CALIX_EP_DIRECT: Array<DirectEndpoint> = Array::pinned(MAX_ENDPOINTS, 0);

/// The endpoint whose host veth is `ifindex`: from its direct-mapped bucket when the bucket
/// holds it (an array lookup, inlined by the verifier), else from the hash map. `None`: not
/// an endpoint the agent registered. The pointer is valid until the program returns.
#[inline(always)]
pub fn endpoint(ifindex: u32) -> Option<*const EndpointInfo> {
    if let Some(d) = CALIX_EP_DIRECT.get_ptr(direct_bucket(ifindex)) {
        // SAFETY: a pointer from a successful array lookup, valid until the program returns.
        // The agent may rewrite the bucket meanwhile: each field is read as written (aligned
        // words), and a bucket is only ever handed from a gone endpoint to a new one whose
        // interface runs no program yet.
        if unsafe { (*d).ifindex } == ifindex {
            // SAFETY: as above.
            return Some(unsafe { &(*d).info });
        }
    }
    CALIX_ENDPOINTS.get_ptr(&ifindex)
}

/// A local pod's IPv4 address → where to deliver to it.
#[map(name = "CALIX_LOCAL_V4")]
pub static CALIX_LOCAL_V4: HashMap<[u8; 4], LocalEndpoint> = HashMap::pinned(MAX_ENDPOINTS, 0);

/// A local pod's IPv6 address → where to deliver to it.
#[map(name = "CALIX_LOCAL_V6")]
pub static CALIX_LOCAL_V6: HashMap<[u8; 16], LocalEndpoint> = HashMap::pinned(MAX_ENDPOINTS, 0);

/// (ifindex, reason) → packets and bytes dropped.
#[map(name = "CALIX_DROPS")]
pub static CALIX_DROPS: PerCpuHashMap<DropKey, DropCount> = PerCpuHashMap::pinned(MAX_DROP_KEYS, 0);

/// The IPv4 pools.
#[map(name = "CALIX_POOLS_V4")]
pub static CALIX_POOLS_V4: LpmTrie<[u8; 4], u32> = LpmTrie::pinned(MAX_POOLS, BPF_F_NO_PREALLOC);

/// The IPv6 pools.
#[map(name = "CALIX_POOLS_V6")]
pub static CALIX_POOLS_V6: LpmTrie<[u8; 16], u32> = LpmTrie::pinned(MAX_POOLS, BPF_F_NO_PREALLOC);

/// IPv4 source prefixes the uplink's XDP prefilter drops.
#[map(name = "CALIX_DENY_V4")]
pub static CALIX_DENY_V4: LpmTrie<[u8; 4], u32> =
    LpmTrie::pinned(MAX_DENY_CIDRS, BPF_F_NO_PREALLOC);

/// IPv6 source prefixes the uplink's XDP prefilter drops.
#[map(name = "CALIX_DENY_V6")]
pub static CALIX_DENY_V6: LpmTrie<[u8; 16], u32> =
    LpmTrie::pinned(MAX_DENY_CIDRS, BPF_F_NO_PREALLOC);

/// TCP/UDP destination ports the XDP prefilter never drops.
#[map(name = "CALIX_FAILSAFE")]
pub static CALIX_FAILSAFE: HashMap<FailsafePort, u32> = HashMap::pinned(MAX_FAILSAFE_PORTS, 0);

/// The node's own IPv4 addresses: the only destinations the XDP failsafe ports apply to.
#[map(name = "CALIX_HOST_V4")]
pub static CALIX_HOST_V4: HashMap<[u8; 4], u32> = HashMap::pinned(MAX_HOST_ADDRS, 0);

/// The node's own IPv6 addresses.
#[map(name = "CALIX_HOST_V6")]
pub static CALIX_HOST_V6: HashMap<[u8; 16], u32> = HashMap::pinned(MAX_HOST_ADDRS, 0);

/// Conntrack entries (see `calix_common::CT_MAP`).
#[map(name = "CALIX_CT")]
pub static CALIX_CT: HashMap<CtKey, CtEntry> = HashMap::pinned(DEFAULT_CT_ENTRIES, 0);

/// Endpoint (host veth ifindex) → flows it opened less those the programs removed.
#[map(name = "CALIX_CT_OWNED")]
pub static CALIX_CT_OWNED: HashMap<u32, u32> = HashMap::pinned(MAX_ENDPOINTS, 0);

/// Endpoint → its flows the agent removed (written by the agent only).
#[map(name = "CALIX_CT_FREED")]
pub static CALIX_CT_FREED: HashMap<u32, u32> = HashMap::pinned(MAX_ENDPOINTS, 0);

/// The agent's `[nat]` settings, one entry.
#[map(name = "CALIX_NAT_CFG")]
pub static CALIX_NAT_CFG: Array<NatConfig> = Array::pinned(1, 0);

/// IPv4 destinations reached without SNAT: every pool, and `non_masquerade_cidrs`.
#[map(name = "CALIX_NO_SNAT_V4")]
pub static CALIX_NO_SNAT_V4: LpmTrie<[u8; 4], u32> =
    LpmTrie::pinned(MAX_NO_SNAT_CIDRS, BPF_F_NO_PREALLOC);

/// The calix agents' TCP ports that pods may not reach on a node's address.
#[map(name = "CALIX_AGENT_PORTS")]
pub static CALIX_AGENT_PORTS: Array<AgentPorts> = Array::pinned(1, 0);

/// The other nodes' IPv4 addresses (this node's own are `CALIX_HOST_V4`).
#[map(name = "CALIX_PEERS_V4")]
pub static CALIX_PEERS_V4: HashMap<[u8; 4], u32> =
    HashMap::pinned(MAX_PEER_ADDRS, BPF_F_NO_PREALLOC);

/// The other nodes' IPv6 addresses.
#[map(name = "CALIX_PEERS_V6")]
pub static CALIX_PEERS_V6: HashMap<[u8; 16], u32> =
    HashMap::pinned(MAX_PEER_ADDRS, BPF_F_NO_PREALLOC);

/// NetworkPolicy: an IPv4 prefix → its identity.
#[map(name = "CALIX_POL_IDS_V4")]
pub static CALIX_POL_IDS_V4: LpmTrie<[u8; 4], u32> =
    LpmTrie::pinned(MAX_POLICY_PREFIXES, BPF_F_NO_PREALLOC);

/// NetworkPolicy: an IPv6 prefix → its identity.
#[map(name = "CALIX_POL_IDS_V6")]
pub static CALIX_POL_IDS_V6: LpmTrie<[u8; 16], u32> =
    LpmTrie::pinned(MAX_POLICY_PREFIXES, BPF_F_NO_PREALLOC);

/// NetworkPolicy: {slot, direction, identity, protocol, port} prefixes → the allowing rule.
#[map(name = "CALIX_POLICY")]
pub static CALIX_POLICY: LpmTrie<PolicyKey, u32> =
    LpmTrie::pinned(DEFAULT_POLICY_ENTRIES, BPF_F_NO_PREALLOC);

/// NetworkPolicy: an endpoint's slot → whether it is isolated, and its generation.
#[map(name = "CALIX_POL_STATE")]
pub static CALIX_POL_STATE: Array<PolicyState> = Array::pinned(MAX_ENDPOINTS, 0);

/// NetworkPolicy: the flows isolated endpoints let through.
#[map(name = "CALIX_POL_FLOWS")]
pub static CALIX_POL_FLOWS: LruHashMap<FlowKey, PolicyFlow> =
    LruHashMap::pinned(DEFAULT_POLICY_FLOWS, 0);

/// NetworkPolicy: the IPv4 flows of isolated endpoints, in 16-byte keys.
#[map(name = "CALIX_POL_FLOWS_V4")]
pub static CALIX_POL_FLOWS_V4: LruHashMap<PolicyFlowKeyV4, PolicyFlow> =
    LruHashMap::pinned(DEFAULT_POLICY_FLOWS, 0);

/// NetworkPolicy: whether two endpoints of this node allow each other every TCP packet, one
/// cache per CPU.
#[map(name = "CALIX_POL_PAIRS")]
pub static CALIX_POL_PAIRS: PerCpuArray<PolicyPair> = PerCpuArray::pinned(POLICY_PAIRS, 0);

/// NetworkPolicy: the rules that let the last new TCP connection between two endpoints of
/// this node through, one memo per CPU.
#[map(name = "CALIX_POL_SYNS")]
pub static CALIX_POL_SYNS: PerCpuArray<PolicySyn> = PerCpuArray::pinned(POLICY_PAIRS, 0);

/// NetworkPolicy: the ports each of two endpoints of this node opened TCP connections to on
/// the other while their pair passed every TCP packet (those connections keep no flow entry).
#[map(name = "CALIX_POL_OPENERS")]
pub static CALIX_POL_OPENERS: HashMap<u32, PolicyOpeners> = HashMap::pinned(POLICY_OPENERS, 0);

/// NetworkPolicy: the verdict's working space, one per CPU.
#[map(name = "CALIX_POL_SCRATCH")]
pub static CALIX_POL_SCRATCH: PerCpuArray<PolicyScratch> = PerCpuArray::pinned(1, 0);

/// NetworkPolicy: how often each rule decided, per endpoint.
#[map(name = "CALIX_POL_HITS")]
pub static CALIX_POL_HITS: PerCpuHashMap<PolicyHitKey, u64> =
    PerCpuHashMap::pinned(MAX_POLICY_HITS, BPF_F_NO_PREALLOC);

/// NetworkPolicy: the packets it denied, for `calixctl monitor --drops`.
#[map(name = "CALIX_POL_EVENTS")]
pub static CALIX_POL_EVENTS: RingBuf = RingBuf::pinned(POLICY_EVENTS_BYTES, 0);

/// NetworkPolicy: the drop events' rate limit, one per CPU.
#[map(name = "CALIX_POL_EVBUDGET")]
pub static CALIX_POL_EVBUDGET: PerCpuArray<EventBudget> = PerCpuArray::pinned(1, 0);

const _: () = assert!(crate::str_eq(
    calix_common::POLICY_PAIRS_MAP,
    "CALIX_POL_PAIRS"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_SYNS_MAP,
    "CALIX_POL_SYNS"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_OPENERS_MAP,
    "CALIX_POL_OPENERS"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_HITS_MAP,
    "CALIX_POL_HITS"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_EVENTS_MAP,
    "CALIX_POL_EVENTS"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_EVENT_BUDGET_MAP,
    "CALIX_POL_EVBUDGET"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_SCRATCH_MAP,
    "CALIX_POL_SCRATCH"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_IDS_V4_MAP,
    "CALIX_POL_IDS_V4"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_IDS_V6_MAP,
    "CALIX_POL_IDS_V6"
));
const _: () = assert!(crate::str_eq(calix_common::POLICY_MAP, "CALIX_POLICY"));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_STATE_MAP,
    "CALIX_POL_STATE"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_FLOWS_MAP,
    "CALIX_POL_FLOWS"
));
const _: () = assert!(crate::str_eq(
    calix_common::POLICY_FLOWS_V4_MAP,
    "CALIX_POL_FLOWS_V4"
));
const _: () = assert!(crate::str_eq(calix_common::CT_MAP, "CALIX_CT"));
const _: () = assert!(crate::str_eq(
    calix_common::AGENT_PORTS_MAP,
    "CALIX_AGENT_PORTS"
));
const _: () = assert!(crate::str_eq(calix_common::PEERS_V4_MAP, "CALIX_PEERS_V4"));
const _: () = assert!(crate::str_eq(calix_common::PEERS_V6_MAP, "CALIX_PEERS_V6"));
const _: () = assert!(crate::str_eq(calix_common::CT_OWNED_MAP, "CALIX_CT_OWNED"));
const _: () = assert!(crate::str_eq(calix_common::CT_FREED_MAP, "CALIX_CT_FREED"));
const _: () = assert!(crate::str_eq(calix_common::NAT_CONFIG_MAP, "CALIX_NAT_CFG"));
const _: () = assert!(crate::str_eq(
    calix_common::NO_SNAT_V4_MAP,
    "CALIX_NO_SNAT_V4"
));

// `#[map(name = ...)]` takes a literal only; keep each in step with the const the agent uses.
const _: () = assert!(crate::str_eq(calix_common::COUNTERS_MAP, "CALIX_COUNTERS"));
const _: () = assert!(crate::str_eq(
    calix_common::STACK_FLOWS_MAP,
    "CALIX_STACK_FLOWS"
));
const _: () = assert!(crate::str_eq(
    calix_common::STACK_EPS_MAP,
    "CALIX_STACK_EPS"
));
const _: () = assert!(crate::str_eq(
    calix_common::STACK_OVERFLOW_MAP,
    "CALIX_STACK_OVF"
));
const _: () = assert!(crate::str_eq(
    calix_common::STACK_CLEARED_MAP,
    "CALIX_STACK_CLEARED"
));
const _: () = assert!(crate::str_eq(
    calix_common::ENDPOINTS_MAP,
    "CALIX_ENDPOINTS"
));
const _: () = assert!(crate::str_eq(
    calix_common::ENDPOINTS_DIRECT_MAP,
    "CALIX_EP_DIRECT"
));
const _: () = assert!(crate::str_eq(calix_common::LOCAL_V4_MAP, "CALIX_LOCAL_V4"));
const _: () = assert!(crate::str_eq(calix_common::LOCAL_V6_MAP, "CALIX_LOCAL_V6"));
const _: () = assert!(crate::str_eq(calix_common::DROPS_MAP, "CALIX_DROPS"));
const _: () = assert!(crate::str_eq(calix_common::POOLS_V4_MAP, "CALIX_POOLS_V4"));
const _: () = assert!(crate::str_eq(calix_common::POOLS_V6_MAP, "CALIX_POOLS_V6"));
const _: () = assert!(crate::str_eq(calix_common::DENY_V4_MAP, "CALIX_DENY_V4"));
const _: () = assert!(crate::str_eq(calix_common::DENY_V6_MAP, "CALIX_DENY_V6"));
const _: () = assert!(crate::str_eq(calix_common::FAILSAFE_MAP, "CALIX_FAILSAFE"));
const _: () = assert!(crate::str_eq(calix_common::HOST_V4_MAP, "CALIX_HOST_V4"));
const _: () = assert!(crate::str_eq(calix_common::HOST_V6_MAP, "CALIX_HOST_V6"));

/// Services at the sockets: each frontend (`calix_common::SVC_FRONTENDS_MAP`).
#[map(name = "CALIX_SVC_FRONTS")]
pub static CALIX_SVC_FRONTS: HashMap<SvcKey, SvcValue> =
    HashMap::pinned(DEFAULT_SVC_FRONTENDS, BPF_F_NO_PREALLOC);

/// Each frontend's backends (`calix_common::SVC_BACKENDS_MAP`).
#[map(name = "CALIX_SVC_BACKS")]
pub static CALIX_SVC_BACKS: HashMap<SvcBackendKey, SvcBackend> =
    HashMap::pinned(DEFAULT_SVC_BACKENDS, BPF_F_NO_PREALLOC);

/// Which frontend a UDP socket's backend stands for (`calix_common::SVC_REV_MAP`).
#[map(name = "CALIX_SVC_REV")]
pub static CALIX_SVC_REV: LruHashMap<SvcRevKey, SvcRevValue> =
    LruHashMap::pinned(SVC_REV_ENTRIES, 0);

/// The backend each unconnected UDP socket's datagrams to a frontend go to
/// (`calix_common::SVC_FWD_MAP`).
#[map(name = "CALIX_SVC_FWD")]
pub static CALIX_SVC_FWD: LruHashMap<SvcFwdKey, SvcBackendKey> =
    LruHashMap::pinned(SVC_REV_ENTRIES, 0);

/// Session affinity: each client's backend per frontend (`calix_common::SVC_AFFINITY_MAP`).
#[map(name = "CALIX_SVC_AFF")]
pub static CALIX_SVC_AFF: LruHashMap<SvcAffKey, SvcAffValue> =
    LruHashMap::pinned(SVC_AFFINITY_ENTRIES, 0);

/// The addresses a NodePort answers on: every node's (`calix_common::SVC_NODES_MAP`).
#[map(name = "CALIX_SVC_NODES")]
pub static CALIX_SVC_NODES: HashMap<SvcNodeKey, u32> =
    HashMap::pinned(SVC_NODE_ENTRIES, BPF_F_NO_PREALLOC);

/// What each frontend did at the sockets (`calix_common::SVC_COUNTERS_MAP`).
#[map(name = "CALIX_SVC_COUNT")]
pub static CALIX_SVC_COUNT: LruPerCpuHashMap<SvcKey, SvcCounters> =
    LruPerCpuHashMap::pinned(SVC_COUNTER_ENTRIES, 0);

/// Flows from outside translated per packet, both ways (`calix_common::SVC_FLOWS_MAP`).
#[map(name = "CALIX_SVC_FLOWS")]
pub static CALIX_SVC_FLOWS: LruHashMap<SvcFlowKey, SvcFlow> =
    LruHashMap::pinned(SVC_FLOW_ENTRIES, 0);

/// External frontends' Maglev tables, by their backends' id (`calix_common::SVC_MAGLEV_MAP`).
#[map(name = "CALIX_SVC_MAGLEV")]
pub static CALIX_SVC_MAGLEV: HashMap<u32, SvcMaglev> =
    HashMap::pinned(SVC_MAGLEV_ENTRIES, BPF_F_NO_PREALLOC);

/// The per-packet Services path's working space (`calix_common::SVC_SCRATCH_MAP`).
#[map(name = "CALIX_SVC_SCRATCH")]
pub static CALIX_SVC_SCRATCH: PerCpuArray<SvcScratch> = PerCpuArray::pinned(1, 0);
