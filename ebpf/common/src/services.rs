//! Kubernetes Services at the sockets (issue 24): the maps the cgroup `sock_addr` programs read
//! to send a connection (TCP `connect`, UDP `sendmsg`) to a Service's frontend to one of its
//! backends instead, and to show the frontend again to the socket (`getpeername`,
//! `recvmsg`). Addresses and ports are in network byte order, an IPv4 address in the first 4
//! bytes of the 16.

/// Hash: [`SvcKey`] → [`SvcValue`]: each frontend this node translates (`[services]
/// frontends` entries).
pub const SVC_FRONTENDS_MAP: &str = "CALIX_SVC_FRONTS";
/// Hash: [`SvcBackendKey`] → [`SvcBackend`]: the backends of each frontend, by its id and
/// their index (`[services] backends` entries).
pub const SVC_BACKENDS_MAP: &str = "CALIX_SVC_BACKS";
/// LRU hash: [`SvcRevKey`] → [`SvcRevValue`]: which frontend a UDP socket's backend stands
/// for, so that its replies come from the frontend (`recvmsg`).
pub const SVC_REV_MAP: &str = "CALIX_SVC_REV";
/// LRU hash: [`SvcFwdKey`] → [`SvcBackendKey`]: the backend an unconnected UDP socket's
/// datagrams to a frontend go to, so that they all go to the same one (as kube-proxy's
/// conntrack keeps a UDP flow on one backend) until the frontend's backends change.
pub const SVC_FWD_MAP: &str = "CALIX_SVC_FWD";
/// LRU hash: [`SvcAffKey`] → [`SvcAffValue`]: `sessionAffinity: ClientIP`, the backend each
/// client (its network namespace: a pod, or the node's own processes) was last sent to by a
/// frontend, and when.
pub const SVC_AFFINITY_MAP: &str = "CALIX_SVC_AFF";
/// Hash: [`SvcNodeKey`] → `u32` (1): the addresses a NodePort answers on, every node's of the
/// cluster (its Nodes' `InternalIP` and `ExternalIP`). A NodePort frontend is keyed with its
/// family's unspecified address (all zeros) in [`SVC_FRONTENDS_MAP`]: a call to one of these
/// addresses that is no frontend of its own looks for the port there. One entry per port,
/// whatever the number of nodes; a pod reaching another node's NodePort is translated at its
/// socket too, as one reaching its own node's.
pub const SVC_NODES_MAP: &str = "CALIX_SVC_NODES";
/// LRU per-CPU hash: [`SvcKey`] → [`SvcCounters`]: what each frontend did at the sockets (and,
/// for an external key, with flows from outside)
/// (`calixctl services`, the per-Service metrics). The programs add an entry the first time a
/// frontend translates or refuses; the agent removes a frontend's with it, and the LRU keeps
/// the map bounded whatever happens between.
pub const SVC_COUNTERS_MAP: &str = "CALIX_SVC_COUNT";
/// LRU hash: [`SvcFlowKey`] → [`SvcFlow`]: the flows from outside the node that `from_host_dev`
/// translated (NodePorts, external and LoadBalancer addresses), both ways: a client's flow to
/// a frontend ([`SVC_FLOW_IN`]: to its backend) and the backend's replies ([`SVC_FLOW_OUT`]:
/// from its frontend).
pub const SVC_FLOWS_MAP: &str = "CALIX_SVC_FLOWS";
/// Hash: a frontend's backends id ([`SvcValue::id`], `u32`) → [`SvcMaglev`]: the Maglev
/// lookup table of an external frontend (a NodePort at this node's address, an external or
/// LoadBalancer address), written under the same id as its backends (and before its frontend
/// entry points there). A flow from outside picks its backend by its slot in the table: every
/// node that knows the same backends builds the same table, and a change of backends moves few
/// flows beyond those it must. An external frontend without a table (more backends than
/// [`SVC_MAGLEV_MAX_BACKENDS`], or written by an older build) picks by the hash modulo the
/// backends' count.
pub const SVC_MAGLEV_MAP: &str = "CALIX_SVC_MAGLEV";
/// A Maglev table's slots (a prime): each backend holds ⌊M/N⌋ or ⌈M/N⌉ of them.
pub const SVC_MAGLEV_SLOTS: u32 = 1021;
/// The table's rows as the map holds them: the slots, padded to a power of two so that a
/// program's index is bounded by a mask the verifier follows.
pub const SVC_MAGLEV_ROWS: usize = 1024;
const _: () =
    assert!(SVC_MAGLEV_ROWS.is_power_of_two() && SVC_MAGLEV_SLOTS as usize <= SVC_MAGLEV_ROWS);
/// Backends beyond this many get no table (their shares would differ by more than ~10%):
/// such a frontend picks uniformly by the hash.
pub const SVC_MAGLEV_MAX_BACKENDS: usize = SVC_MAGLEV_SLOTS as usize / 10;
/// Entries of [`SVC_MAGLEV_MAP`]: a table per external frontend at most, and one more while a
/// frontend's new table is written before its old one goes.
pub const SVC_MAGLEV_ENTRIES: u32 = DEFAULT_SVC_FRONTENDS + 1;
/// Per-CPU array of one [`SvcScratch`]: the per-packet path's keys and values, built there
/// rather than on the programs' 512-byte stack.
pub const SVC_SCRATCH_MAP: &str = "CALIX_SVC_SCRATCH";
/// Entries of [`SVC_FLOWS_MAP`] (two per flow; the least recently used go first).
pub const SVC_FLOW_ENTRIES: u32 = 262_144;
/// `skb->mark` of a translated packet from outside whose backend is on another node: the host
/// stack routes it there and masquerades it to the node's address (its replies come back
/// here to be translated again).
pub const SVC_MASQ_MARK: u32 = 0x0ca1_2000;
/// Entries of [`SVC_COUNTERS_MAP`] (the default room for frontends: a frontend the LRU evicted
/// starts counting again from zero).
pub const SVC_COUNTER_ENTRIES: u32 = 65_536;
/// Entries of [`SVC_NODES_MAP`]: node addresses beyond it are not translated (and said).
pub const SVC_NODE_ENTRIES: u32 = 16_384;
/// Default sizes of the maps.
pub const DEFAULT_SVC_FRONTENDS: u32 = 65_536;
pub const DEFAULT_SVC_BACKENDS: u32 = 262_144;
pub const SVC_REV_ENTRIES: u32 = 65_536;
pub const SVC_AFFINITY_ENTRIES: u32 = 65_536;
/// A client's remembered backend is looked for among at most this many backends of its
/// frontend after they changed (a frontend of more picks again past them).
pub const SVC_AFFINITY_SCAN: u32 = 256;

/// [`SvcKey::family`].
pub const SVC_V4: u8 = 4;
pub const SVC_V6: u8 = 6;
/// Or-ed into [`SvcKey::family`]: a frontend for clients outside the cluster, translated per
/// packet where they arrive (`from_host_dev`): a NodePort at one of this node's addresses, an
/// external or LoadBalancer address. The socket programs never look such a key up.
pub const SVC_EXTERNAL: u8 = 0x80;
/// [`SvcFlowKey::dir`].
pub const SVC_FLOW_IN: u8 = 1;
pub const SVC_FLOW_OUT: u8 = 2;

/// [`SvcValue::flags`]: no backend; refuse the connection (kube-proxy's ICMP reject).
pub const SVC_REJECT: u32 = 1;
/// [`SvcValue::flags`]: a `Local` policy with no backend on this node; refuse too.
pub const SVC_DROP: u32 = 2;

/// A frontend: address, port, protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SvcKey {
    pub addr: [u8; 16],
    pub port: u16,
    /// IPPROTO_TCP or IPPROTO_UDP.
    pub proto: u8,
    /// [`SVC_V4`] or [`SVC_V6`].
    pub family: u8,
}

/// Where a frontend sends new connections: `count` backends under `id` (indices 0..count).
/// The agent writes a changed frontend's backends under a new id, then this value, then
/// removes the old id's: a program never reads half a change.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcValue {
    pub id: u32,
    pub count: u32,
    pub flags: u32,
    /// `sessionAffinity: ClientIP`: seconds a client keeps its backend since its last
    /// connection to the frontend; 0 for none. (Padding in the first builds of layout 4:
    /// what they wrote reads as none.)
    pub affinity_secs: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcBackendKey {
    pub id: u32,
    pub index: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcBackend {
    pub addr: [u8; 16],
    pub port: u16,
    pub family: u8,
    pub _pad: u8,
}

/// A UDP socket (its cookie) and the backend it sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcRevKey {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub family: u8,
    pub _pad: u8,
    pub _pad2: u32,
}

/// A UDP socket (its cookie) and the frontend it sends to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcFwdKey {
    pub cookie: u64,
    pub front: SvcKey,
    pub _pad: u32,
}

/// The frontend that backend stands for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcRevValue {
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
}

/// A client (its network namespace's cookie) and a frontend, for session affinity.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcAffKey {
    pub netns: u64,
    pub front: SvcKey,
    pub _pad: u32,
}

/// The backend a client was last sent to, when (`bpf_ktime_get_ns`), and where it was then:
/// index `index` of the frontend's backends under `id` (looked for again by address and port
/// once the frontend's backends changed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcAffValue {
    pub seen_ns: u64,
    pub id: u32,
    pub index: u32,
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
    pub _pad2: u32,
}

/// A frontend's counters (per CPU in the map; summed when read).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcCounters {
    /// Connections sent to a backend: TCP and UDP `connect`, and each unconnected UDP socket's
    /// first datagram to the frontend (and its first after the frontend's backends changed);
    /// for an external key, each new flow from outside.
    pub connections: u64,
    /// Calls refused: no endpoint, or a `Local` policy with none here (ECONNREFUSED).
    pub refused: u64,
}

impl SvcCounters {
    /// Adds `other` into `self` (used to sum the per-CPU values).
    pub fn accumulate(&mut self, other: &SvcCounters) {
        self.connections = self.connections.wrapping_add(other.connections);
        self.refused = self.refused.wrapping_add(other.refused);
    }
}

/// One direction of a translated flow from outside: `IN`, the client (`a`) to a frontend (`b`);
/// `OUT`, the backend (`a`) to the client (`b`). Addresses in 16 bytes (IPv4 in the first 4),
/// ports in network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcFlowKey {
    pub a: [u8; 16],
    pub b: [u8; 16],
    pub a_port: u16,
    pub b_port: u16,
    pub proto: u8,
    /// [`SVC_V4`] or [`SVC_V6`].
    pub family: u8,
    /// [`SVC_FLOW_IN`] or [`SVC_FLOW_OUT`].
    pub dir: u8,
    pub _pad: u8,
}

/// `IN`: the backend the flow goes to; `OUT`: the frontend its replies come from, and the
/// interface the client's packets arrived on (its replies leave by it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcFlow {
    pub addr: [u8; 16],
    pub port: u16,
    /// `IN`: the backend is on another node ([`SVC_MASQ_MARK`]).
    pub remote: u8,
    pub _pad: u8,
    /// `OUT`: the client's interface.
    pub ifindex: u32,
}

/// The per-packet path's working space ([`SVC_SCRATCH_MAP`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcScratch {
    pub key: SvcFlowKey,
    pub back_key: SvcFlowKey,
    pub flow: SvcFlow,
    pub back: SvcFlow,
    pub front: SvcKey,
    pub backend: SvcBackendKey,
    /// Zeros: a frontend's first counters.
    pub zero: SvcCounters,
}

/// An external frontend's Maglev table ([`SVC_MAGLEV_MAP`]): slot → index of its backends
/// (rows past [`SVC_MAGLEV_SLOTS`] are never read).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SvcMaglev {
    pub slots: [u16; SVC_MAGLEV_ROWS],
}

impl Default for SvcMaglev {
    fn default() -> Self {
        Self {
            slots: [0; SVC_MAGLEV_ROWS],
        }
    }
}

/// The hash a flow from outside picks its backend by (its Maglev slot, or its index), of the
/// client's IPv4 address and port (network byte order; 0 with `sessionAffinity: ClientIP`).
/// The same on every node and in every build: FNV-1a 32 with a finalizer.
#[inline(always)]
pub fn svc_client_hash(addr: [u8; 4], port: u16) -> u32 {
    fnv_finish(fnv_port(fnv(FNV_OFFSET, &addr), port))
}

/// [`svc_client_hash`] of an IPv6 client: its 16 bytes and port.
#[inline(always)]
pub fn svc_client_hash6(addr: &[u8; 16], port: u16) -> u32 {
    fnv_finish(fnv_port(fnv(FNV_OFFSET, addr), port))
}

const FNV_OFFSET: u32 = 0x811c_9dc5;

/// FNV-1a 32 over `bytes`, from `h`.
#[inline(always)]
fn fnv(mut h: u32, bytes: &[u8]) -> u32 {
    for b in bytes {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// [`fnv`] over the port's bytes as the packet has them.
#[inline(always)]
fn fnv_port(h: u32, port: u16) -> u32 {
    fnv(h, &port.to_ne_bytes())
}

/// The finalizer: FNV's low bits alone spread poorly.
#[inline(always)]
fn fnv_finish(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^ (h >> 13)
}

/// A node's address, for [`SVC_NODES_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SvcNodeKey {
    pub addr: [u8; 16],
    /// [`SVC_V4`] or [`SVC_V6`].
    pub family: u8,
    pub _pad: [u8; 3],
}
