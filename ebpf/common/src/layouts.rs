//! Every published map layout: what a pinned map of each [`LAYOUT_VERSION`] must be (type, key
//! and value size, entries, flags) to be reused as it is.
// The map names and sizes the rows are made of.
use crate::*;

/// `enum bpf_map_type` values the layouts use.
pub const BPF_MAP_TYPE_HASH: u32 = 1;
pub const BPF_MAP_TYPE_ARRAY: u32 = 2;
pub const BPF_MAP_TYPE_PERCPU_HASH: u32 = 5;
pub const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
pub const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
pub const BPF_MAP_TYPE_LRU_PERCPU_HASH: u32 = 10;
pub const BPF_MAP_TYPE_LPM_TRIE: u32 = 11;
pub const BPF_MAP_TYPE_RINGBUF: u32 = 27;
/// Map flag: the map's elements are allocated as they are inserted.
pub const BPF_F_NO_PREALLOC: u32 = 1;

/// One map of a layout: what a pinned map must match to be reused as is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapLayout {
    pub name: &'static str,
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    /// For a map the agent sizes at load ([`CT_MAP`]), the default.
    pub max_entries: u32,
    pub flags: u32,
}

/// The maps of one [`LAYOUT_VERSION`].
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub version: u32,
    pub maps: &'static [MapLayout],
}

impl Layout {
    /// The map called `name`, if this layout has it.
    pub fn map(&self, name: &str) -> Option<&'static MapLayout> {
        self.maps.iter().find(|m| str_eq(m.name, name))
    }
}

const fn m(
    name: &'static str,
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    flags: u32,
) -> MapLayout {
    MapLayout {
        name,
        map_type,
        key_size,
        value_size,
        max_entries,
        flags,
    }
}

/// Every published layout, oldest first; append a row for a new version, never edit one (the
/// agent reads older pins by them, and the upgrade test recreates them from here).
pub const LAYOUTS: [Layout; 4] = [
    // Layout 1. `CtEntry` was 16 bytes in its first builds (no route cache) and 40 later,
    // without a version change: the agent migrates both.
    Layout {
        version: 1,
        maps: &[
            m(STACK_FLOWS_MAP, BPF_MAP_TYPE_LRU_HASH, 40, 8, 65_536, 0),
            m(STACK_EPS_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_ENDPOINTS, 0),
            m(
                COUNTERS_MAP,
                BPF_MAP_TYPE_PERCPU_HASH,
                4,
                32,
                MAX_ENDPOINTS,
                0,
            ),
            m(ENDPOINTS_MAP, BPF_MAP_TYPE_HASH, 4, 24, MAX_ENDPOINTS, 0),
            m(LOCAL_V4_MAP, BPF_MAP_TYPE_HASH, 4, 12, MAX_ENDPOINTS, 0),
            m(LOCAL_V6_MAP, BPF_MAP_TYPE_HASH, 16, 12, MAX_ENDPOINTS, 0),
            m(DROPS_MAP, BPF_MAP_TYPE_PERCPU_HASH, 8, 16, MAX_DROP_KEYS, 0),
            m(POOLS_V4_MAP, BPF_MAP_TYPE_LPM_TRIE, 8, 4, MAX_POOLS, 1),
            m(POOLS_V6_MAP, BPF_MAP_TYPE_LPM_TRIE, 20, 4, MAX_POOLS, 1),
            m(DENY_V4_MAP, BPF_MAP_TYPE_LPM_TRIE, 8, 4, MAX_DENY_CIDRS, 1),
            m(DENY_V6_MAP, BPF_MAP_TYPE_LPM_TRIE, 20, 4, MAX_DENY_CIDRS, 1),
            m(FAILSAFE_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_FAILSAFE_PORTS, 0),
            m(CT_MAP, BPF_MAP_TYPE_HASH, 16, 40, DEFAULT_CT_ENTRIES, 0),
            m(NAT_CONFIG_MAP, BPF_MAP_TYPE_ARRAY, 4, 80, 1, 0),
            m(
                NO_SNAT_V4_MAP,
                BPF_MAP_TYPE_LPM_TRIE,
                8,
                4,
                MAX_NO_SNAT_CIDRS,
                1,
            ),
        ],
    },
    // Layout 2: stack flows in a hash (no silent eviction) with a time and flags, overflow
    // marks; conntrack entries with TCP sequence tracking and an owner; the conntrack budget;
    // the node's own addresses (the XDP failsafe applies only to them).
    Layout {
        version: 2,
        maps: &[
            m(
                STACK_FLOWS_MAP,
                BPF_MAP_TYPE_HASH,
                40,
                16,
                MAX_STACK_FLOWS,
                1,
            ),
            m(STACK_EPS_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_ENDPOINTS, 0),
            m(STACK_CLEARED_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_ENDPOINTS, 0),
            m(
                COUNTERS_MAP,
                BPF_MAP_TYPE_PERCPU_HASH,
                4,
                32,
                MAX_ENDPOINTS,
                0,
            ),
            m(ENDPOINTS_MAP, BPF_MAP_TYPE_HASH, 4, 24, MAX_ENDPOINTS, 0),
            m(LOCAL_V4_MAP, BPF_MAP_TYPE_HASH, 4, 12, MAX_ENDPOINTS, 0),
            m(LOCAL_V6_MAP, BPF_MAP_TYPE_HASH, 16, 12, MAX_ENDPOINTS, 0),
            m(DROPS_MAP, BPF_MAP_TYPE_PERCPU_HASH, 8, 16, MAX_DROP_KEYS, 0),
            m(POOLS_V4_MAP, BPF_MAP_TYPE_LPM_TRIE, 8, 4, MAX_POOLS, 1),
            m(POOLS_V6_MAP, BPF_MAP_TYPE_LPM_TRIE, 20, 4, MAX_POOLS, 1),
            m(DENY_V4_MAP, BPF_MAP_TYPE_LPM_TRIE, 8, 4, MAX_DENY_CIDRS, 1),
            m(DENY_V6_MAP, BPF_MAP_TYPE_LPM_TRIE, 20, 4, MAX_DENY_CIDRS, 1),
            m(FAILSAFE_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_FAILSAFE_PORTS, 0),
            m(HOST_V4_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_HOST_ADDRS, 0),
            m(HOST_V6_MAP, BPF_MAP_TYPE_HASH, 16, 4, MAX_HOST_ADDRS, 0),
            m(CT_MAP, BPF_MAP_TYPE_HASH, 16, 64, DEFAULT_CT_ENTRIES, 0),
            m(CT_OWNED_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_ENDPOINTS, 0),
            m(CT_FREED_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_ENDPOINTS, 0),
            m(NAT_CONFIG_MAP, BPF_MAP_TYPE_ARRAY, 4, 88, 1, 0),
            m(
                NO_SNAT_V4_MAP,
                BPF_MAP_TYPE_LPM_TRIE,
                8,
                4,
                MAX_NO_SNAT_CIDRS,
                1,
            ),
        ],
    },
    // Layout 3: the per-endpoint counters and stack-flow marks in arrays indexed by the
    // endpoint's slot (in `EndpointInfo` and `LocalEndpoint`), overflow marks apart from the
    // plain ones; the endpoints also in a direct-mapped array by ifindex. Maps added since
    // (an older build of this layout never opens them, a newer one creates them next to the
    // pins): the agents' ports and the other nodes' addresses (issue 20); NetworkPolicy's
    // identities, entries, per-endpoint state and flows (issue 22).
    Layout {
        version: 3,
        maps: &LAYOUT_3,
    },
    // Layout 4: layout 3 and the Services maps (issue 24). Added since (an older build of
    // this layout never opens them, a newer one creates them next to the pins): session
    // affinity's map; the IPv4 policy flows in 16-byte keys (the agent carries the first
    // builds' IPv4 flows over from the 40-byte table); the policy pairs (a cache the programs
    // fill; empty is correct); the frontends' padding became their affinity timeout (0, none,
    // in what an older build wrote).
    Layout {
        version: 4,
        maps: &LAYOUT_4,
    },
];

/// The layout with this version, if one was published.
pub fn layout(version: u32) -> Option<&'static Layout> {
    LAYOUTS.iter().find(|l| l.version == version)
}

/// `&str` equality usable in `const` context.
pub const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

const LAYOUT_3: [MapLayout; LAYOUT_3_MAPS] = [
    m(
        STACK_FLOWS_MAP,
        BPF_MAP_TYPE_HASH,
        40,
        16,
        MAX_STACK_FLOWS,
        1,
    ),
    m(STACK_EPS_MAP, BPF_MAP_TYPE_ARRAY, 4, 4, MAX_ENDPOINTS, 0),
    m(
        STACK_OVERFLOW_MAP,
        BPF_MAP_TYPE_ARRAY,
        4,
        4,
        MAX_ENDPOINTS,
        0,
    ),
    m(
        STACK_CLEARED_MAP,
        BPF_MAP_TYPE_ARRAY,
        4,
        4,
        MAX_ENDPOINTS,
        0,
    ),
    m(
        COUNTERS_MAP,
        BPF_MAP_TYPE_PERCPU_ARRAY,
        4,
        32,
        MAX_ENDPOINTS,
        0,
    ),
    m(ENDPOINTS_MAP, BPF_MAP_TYPE_HASH, 4, 32, MAX_ENDPOINTS, 0),
    m(
        ENDPOINTS_DIRECT_MAP,
        BPF_MAP_TYPE_ARRAY,
        4,
        40,
        MAX_ENDPOINTS,
        0,
    ),
    m(LOCAL_V4_MAP, BPF_MAP_TYPE_HASH, 4, 16, MAX_ENDPOINTS, 0),
    m(LOCAL_V6_MAP, BPF_MAP_TYPE_HASH, 16, 16, MAX_ENDPOINTS, 0),
    m(DROPS_MAP, BPF_MAP_TYPE_PERCPU_HASH, 8, 16, MAX_DROP_KEYS, 0),
    m(POOLS_V4_MAP, BPF_MAP_TYPE_LPM_TRIE, 8, 4, MAX_POOLS, 1),
    m(POOLS_V6_MAP, BPF_MAP_TYPE_LPM_TRIE, 20, 4, MAX_POOLS, 1),
    m(DENY_V4_MAP, BPF_MAP_TYPE_LPM_TRIE, 8, 4, MAX_DENY_CIDRS, 1),
    m(DENY_V6_MAP, BPF_MAP_TYPE_LPM_TRIE, 20, 4, MAX_DENY_CIDRS, 1),
    m(FAILSAFE_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_FAILSAFE_PORTS, 0),
    m(HOST_V4_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_HOST_ADDRS, 0),
    m(HOST_V6_MAP, BPF_MAP_TYPE_HASH, 16, 4, MAX_HOST_ADDRS, 0),
    m(CT_MAP, BPF_MAP_TYPE_HASH, 16, 64, DEFAULT_CT_ENTRIES, 0),
    m(CT_OWNED_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_ENDPOINTS, 0),
    m(CT_FREED_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_ENDPOINTS, 0),
    m(NAT_CONFIG_MAP, BPF_MAP_TYPE_ARRAY, 4, 88, 1, 0),
    m(
        NO_SNAT_V4_MAP,
        BPF_MAP_TYPE_LPM_TRIE,
        8,
        4,
        MAX_NO_SNAT_CIDRS,
        1,
    ),
    m(AGENT_PORTS_MAP, BPF_MAP_TYPE_ARRAY, 4, 16, 1, 0),
    m(PEERS_V4_MAP, BPF_MAP_TYPE_HASH, 4, 4, MAX_PEER_ADDRS, 1),
    m(PEERS_V6_MAP, BPF_MAP_TYPE_HASH, 16, 4, MAX_PEER_ADDRS, 1),
    m(
        POLICY_IDS_V4_MAP,
        BPF_MAP_TYPE_LPM_TRIE,
        8,
        4,
        MAX_POLICY_PREFIXES,
        1,
    ),
    m(
        POLICY_IDS_V6_MAP,
        BPF_MAP_TYPE_LPM_TRIE,
        20,
        4,
        MAX_POLICY_PREFIXES,
        1,
    ),
    m(
        POLICY_MAP,
        BPF_MAP_TYPE_LPM_TRIE,
        16,
        4,
        DEFAULT_POLICY_ENTRIES,
        1,
    ),
    m(POLICY_STATE_MAP, BPF_MAP_TYPE_ARRAY, 4, 8, MAX_ENDPOINTS, 0),
    m(
        POLICY_FLOWS_MAP,
        BPF_MAP_TYPE_LRU_HASH,
        40,
        16,
        DEFAULT_POLICY_FLOWS,
        0,
    ),
    m(POLICY_SCRATCH_MAP, BPF_MAP_TYPE_PERCPU_ARRAY, 4, 104, 1, 0),
    m(
        POLICY_HITS_MAP,
        BPF_MAP_TYPE_PERCPU_HASH,
        8,
        8,
        MAX_POLICY_HITS,
        1,
    ),
    m(
        POLICY_EVENTS_MAP,
        BPF_MAP_TYPE_RINGBUF,
        0,
        0,
        POLICY_EVENTS_BYTES,
        0,
    ),
    m(
        POLICY_EVENT_BUDGET_MAP,
        BPF_MAP_TYPE_PERCPU_ARRAY,
        4,
        88,
        1,
        0,
    ),
];
const LAYOUT_3_MAPS: usize = 34;

const SERVICES_MAPS: [MapLayout; 10] = [
    m(
        SVC_FRONTENDS_MAP,
        BPF_MAP_TYPE_HASH,
        20,
        16,
        DEFAULT_SVC_FRONTENDS,
        1,
    ),
    m(
        SVC_BACKENDS_MAP,
        BPF_MAP_TYPE_HASH,
        8,
        20,
        DEFAULT_SVC_BACKENDS,
        1,
    ),
    m(
        SVC_REV_MAP,
        BPF_MAP_TYPE_LRU_HASH,
        32,
        20,
        SVC_REV_ENTRIES,
        0,
    ),
    m(
        SVC_FWD_MAP,
        BPF_MAP_TYPE_LRU_HASH,
        32,
        8,
        SVC_REV_ENTRIES,
        0,
    ),
    m(
        SVC_AFFINITY_MAP,
        BPF_MAP_TYPE_LRU_HASH,
        32,
        40,
        SVC_AFFINITY_ENTRIES,
        0,
    ),
    m(SVC_NODES_MAP, BPF_MAP_TYPE_HASH, 20, 4, SVC_NODE_ENTRIES, 1),
    m(
        SVC_COUNTERS_MAP,
        BPF_MAP_TYPE_LRU_PERCPU_HASH,
        20,
        16,
        SVC_COUNTER_ENTRIES,
        0,
    ),
    m(
        SVC_FLOWS_MAP,
        BPF_MAP_TYPE_LRU_HASH,
        40,
        24,
        SVC_FLOW_ENTRIES,
        0,
    ),
    m(SVC_SCRATCH_MAP, BPF_MAP_TYPE_PERCPU_ARRAY, 4, 176, 1, 0),
    m(
        SVC_MAGLEV_MAP,
        BPF_MAP_TYPE_HASH,
        4,
        2 * SVC_MAGLEV_ROWS as u32,
        SVC_MAGLEV_ENTRIES,
        1,
    ),
];

/// Maps added to layout 4 after its first builds (which never open them).
const ADDED_TO_4: [MapLayout; 4] = [
    m(
        POLICY_FLOWS_V4_MAP,
        BPF_MAP_TYPE_LRU_HASH,
        16,
        16,
        DEFAULT_POLICY_FLOWS,
        0,
    ),
    m(
        POLICY_PAIRS_MAP,
        BPF_MAP_TYPE_PERCPU_ARRAY,
        4,
        32,
        POLICY_PAIRS,
        0,
    ),
    m(
        POLICY_SYNS_MAP,
        BPF_MAP_TYPE_PERCPU_ARRAY,
        4,
        28,
        POLICY_PAIRS,
        0,
    ),
    m(
        POLICY_OPENERS_MAP,
        BPF_MAP_TYPE_HASH,
        4,
        16,
        POLICY_OPENERS,
        0,
    ),
];

const LAYOUT_4: [MapLayout; LAYOUT_3_MAPS + 14] = concat(
    concat::<LAYOUT_3_MAPS, 10, { LAYOUT_3_MAPS + 10 }>(LAYOUT_3, SERVICES_MAPS),
    ADDED_TO_4,
);

/// `a` then `b`, in `const` context.
const fn concat<const A: usize, const B: usize, const C: usize>(
    a: [MapLayout; A],
    b: [MapLayout; B],
) -> [MapLayout; C] {
    let mut out = [a[0]; C];
    let mut i = 0;
    while i < A {
        out[i] = a[i];
        i += 1;
    }
    while i < C {
        out[i] = b[i - A];
        i += 1;
    }
    out
}
