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

/// A node's address, for [`SVC_NODES_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SvcNodeKey {
    pub addr: [u8; 16],
    /// [`SVC_V4`] or [`SVC_V6`].
    pub family: u8,
    pub _pad: [u8; 3],
}
