//! NetworkPolicy in the eBPF dataplane (issue 22): the maps, their keys and values. The layout
//! is calix-core's `policy::tables`: identities by longest match on the peer's address, then
//! per endpoint and direction the entries that allow {identity, protocol, port block}; flows
//! remembered per endpoint so that replies pass and a policy change re-checks established
//! flows (docs/decisions.md, "NetworkPolicy in eBPF: identities").

/// LPM trie: an IPv4 prefix (key: prefix length + `[u8; 4]`) → its identity (`u32`). Shared by
/// every endpoint of the node; an address under no prefix is [`POLICY_WORLD`].
pub const POLICY_IDS_V4_MAP: &str = "CALIX_POL_IDS_V4";
/// LPM trie: an IPv6 prefix (key: prefix length + `[u8; 16]`) → its identity.
pub const POLICY_IDS_V6_MAP: &str = "CALIX_POL_IDS_V6";
/// Most prefixes per family in the identity tries (allocated as used).
pub const MAX_POLICY_PREFIXES: u32 = 262_144;
/// LPM trie: [`PolicyKey`] → `u32`, the number of the rule that allows it. Allow entries only.
pub const POLICY_MAP: &str = "CALIX_POLICY";
/// Default size of [`POLICY_MAP`] (entries over every endpoint; `[policy] entries`).
pub const DEFAULT_POLICY_ENTRIES: u32 = 262_144;
/// Array: an endpoint's slot → [`PolicyState`]. Zeroed with the slot: not isolated.
pub const POLICY_STATE_MAP: &str = "CALIX_POL_STATE";
/// LRU hash: [`crate::FlowKey`] (as seen from the pod) → [`PolicyFlow`]: the flows of isolated
/// endpoints, so that replies pass and established flows are checked again after a change.
pub const POLICY_FLOWS_MAP: &str = "CALIX_POL_FLOWS";
/// Default size of [`POLICY_FLOWS_MAP`] and of [`POLICY_FLOWS_V4_MAP`], each (`[policy] flows`).
pub const DEFAULT_POLICY_FLOWS: u32 = 262_144;
/// LRU hash: [`PolicyFlowKeyV4`] → [`PolicyFlow`]: the IPv4 flows of isolated endpoints, in
/// keys of 16 bytes instead of [`crate::FlowKey`]'s 40 (every packet of an isolated pod hashes
/// and compares one); [`POLICY_FLOWS_MAP`] keeps the IPv6 ones. Added to layout 4 after its
/// first builds, which kept IPv4 flows in [`POLICY_FLOWS_MAP`]: the agent carries them over.
pub const POLICY_FLOWS_V4_MAP: &str = "CALIX_POL_FLOWS_V4";

/// Per-CPU array of [`POLICY_PAIRS`] [`PolicyPair`]s, at [`policy_pair_index`] of two
/// endpoints of this node: whether their rules allow every TCP packet between them both ways
/// (at both endpoints' generations), so that `from_pod` passes an established connection's
/// segments between them without looking their flow up. A cache the programs fill, each CPU
/// its own (no reader ever meets a half-written entry); pairs that share an index take
/// turns. Added to layout 4 after its first builds (which never open it; it starts empty).
pub const POLICY_PAIRS_MAP: &str = "CALIX_POL_PAIRS";
/// Entries of [`POLICY_PAIRS_MAP`], per CPU (a power of two).
pub const POLICY_PAIRS: u32 = 4096;

/// Per-CPU array of [`POLICY_PAIRS`] [`PolicySyn`]s, at [`policy_pair_index`] of two
/// endpoints of this node (the one that opens the connection first): the rules that let the
/// last new TCP connection between them in (the opener's egress rule, the other's ingress
/// rule) and the port it went to, so that the next SYN to that port takes them from here
/// instead of the tries. A cache the programs fill, each CPU its own, as
/// [`POLICY_PAIRS_MAP`]. Added to layout 4 after its first builds (which never open it; it
/// starts empty).
pub const POLICY_SYNS_MAP: &str = "CALIX_POL_SYNS";

/// Hash: [`policy_pair_slots`] of two endpoints of this node, the lower slot first →
/// [`PolicyOpeners`]: the ports each opened TCP connections to on the other while their pair
/// passed every TCP packet ([`PolicyPair`]); such connections keep no flow entry. Read after a
/// change, when a segment finds no entry: who opened its connection, so that the opener's
/// entry is written then and checked against the direction that opened it. Added to layout 4
/// after its first builds (which never open it; it starts empty).
pub const POLICY_OPENERS_MAP: &str = "CALIX_POL_OPENERS";
/// Records of [`POLICY_OPENERS_MAP`] (preallocated). A pair past it keeps flow entries.
pub const POLICY_OPENERS: u32 = 16_384;
/// Ports a [`PolicyOpeners`] holds, two to a 64-bit word. A port past them gets flow entries.
pub const POLICY_OPENER_PORTS: usize = 4;

/// Per-CPU hash: [`PolicyHitKey`] (an endpoint's slot, a rule's number) → `u64`, how many
/// times that rule decided for that endpoint (a new flow, a flow checked again after a change,
/// a packet judged alone). The agent removes a pair's count when the pair's entries go.
pub const POLICY_HITS_MAP: &str = "CALIX_POL_HITS";
/// Most (endpoint, rule) pairs counted; a pair past it is not counted (the verdict stands).
pub const MAX_POLICY_HITS: u32 = 65_536;
/// Ring buffer of [`PolicyDropEvent`]s: the packets policy denied, as they happen, at most
/// [`POLICY_EVENTS_PER_SEC`] per CPU (`calixctl monitor --drops`). With no reader it fills
/// up and the programs' writes fail: nothing waits for it.
pub const POLICY_EVENTS_MAP: &str = "CALIX_POL_EVENTS";
/// Bytes of [`POLICY_EVENTS_MAP`] (a power of two, a multiple of the page size).
pub const POLICY_EVENTS_BYTES: u32 = 256 * 1024;
/// Per-CPU array of one [`EventBudget`]: the drop events' rate limit.
pub const POLICY_EVENT_BUDGET_MAP: &str = "CALIX_POL_EVBUDGET";
/// The drop events' rate per CPU, and the burst allowed after a quiet time.
pub const POLICY_EVENTS_PER_SEC: u64 = 1_000;
pub const POLICY_EVENTS_BURST: u64 = 100;

/// Per-CPU array of one [`PolicyScratch`]: where the programs build the verdict's keys (the
/// BPF stack, 512 bytes for every frame of a call chain, is too small for them beside the fast
/// path's own).
pub const POLICY_SCRATCH_MAP: &str = "CALIX_POL_SCRATCH";

/// The identity of an address under no prefix.
pub const POLICY_WORLD: u32 = 0;
/// The identity of entries that allow every peer.
pub const POLICY_ANY_PEER: u32 = u32::MAX;
/// The identity of the Service ranges (`service_cidrs`): addresses the host stack translates
/// (kube-proxy's DNAT). Egress to them is judged after the translation, against the backend
/// that was chosen ([`POLICY_PENDING_MARK`]); no entry names this identity.
pub const POLICY_SERVICE: u32 = u32::MAX - 1;

/// [`PolicyState::flags`]: the endpoint is isolated for ingress.
pub const POL_ISOLATED_INGRESS: u32 = 1;
/// [`PolicyState::flags`]: the endpoint is isolated for egress.
pub const POL_ISOLATED_EGRESS: u32 = 2;
/// [`PolicyState::flags`]: a flow the endpoint let through is kept after a change that would
/// refuse it (`[policy] keep_established`), until it goes idle; new flows meet the new rules.
pub const POL_KEEP_ESTABLISHED: u32 = 4;

/// [`PolicyKey::dir`]: traffic to the pod.
pub const POL_DIR_INGRESS: u8 = 0;
/// [`PolicyKey::dir`]: traffic from the pod.
pub const POL_DIR_EGRESS: u8 = 1;

/// [`PolicyFlow::flags`]: the pod opened the flow (its egress allowed it).
pub const PF_FROM_POD: u32 = 1;
/// [`PolicyFlow::flags`]: the peer opened the flow (the pod's ingress allowed it).
pub const PF_TO_POD: u32 = 2;
/// [`PolicyFlow::flags`]: a change refused the flow: its packets are denied, also the TCP
/// segments that the mid-connection rule (a segment of no remembered flow passes when either
/// direction allows it) would let in, until a later change allows it again or it goes idle
/// (a TCP flow is then checked again against the direction that opened it; another is
/// forgotten).
pub const PF_REVOKED: u32 = 8;
/// [`PolicyFlow::flags`]: the pod's flow to a Service address ([`POLICY_SERVICE`]), before the
/// host stack's DNAT: its packets are judged after the DNAT, every one; the flow lets the
/// replies (from the Service address, after the stack undid the DNAT) back in.
pub const PF_SERVICE: u32 = 4;
/// [`PolicyFlow::flags`]: the pod sent a TCP FIN on the flow.
pub const PF_FIN_POD: u32 = 16;
/// [`PolicyFlow::flags`]: the peer sent a TCP FIN on the flow. With both, the next segment
/// without FIN (the last ACK) ends the entry, as a RST does.
pub const PF_FIN_PEER: u32 = 32;

/// [`PolicyFlow::flags`]: the pod opened the TCP connection to another endpoint of this node
/// whose rules, and the pod's, let every TCP packet between the two through ([`PS_PAIR`]): the
/// other endpoint's verdict allowed the SYN and wrote no entry of its own ([`PS_SENT`]). It
/// takes this one, mirrored, when a change asks who opened the connection.
pub const PF_PAIRED: u32 = 64;
/// [`PolicyFlow::flags`] of a [`PF_PAIRED`] entry: the other endpoint took it as its own (it
/// has an entry of the connection now, which its verdicts on the connection's FINs end).
/// Without this bit, the other endpoint keeps no entry, and its verdict on the pod's FIN is
/// not asked for: it would find nothing.
pub const PF_ADOPTED: u32 = 128;

/// `skb->mark` of a packet whose egress verdict waits for the host stack's DNAT: `from_pod`
/// sets it, with the sender's slot in bits 16–29 ([`policy_pending_mark`]), on a packet of an
/// egress-isolated pod to a Service address; the first calix hook after the stack (`to_pod`
/// of the backend's veth, `to_host_dev` of an uplink or VXLAN device) judges the packet
/// against the backend it now goes to and clears the mark; the node's nftables input chain
/// drops a marked packet the stack delivers to the node itself. Bits 30–31 are `10`: clear of
/// kube-proxy's marks (0x4000, 0x8000) and of [`crate::FAST_PATH_MARK`].
pub const POLICY_PENDING_MARK: u32 = 0x8000_0000;
/// The bits of `skb->mark` that say [`POLICY_PENDING_MARK`].
pub const POLICY_PENDING_MASK: u32 = 0xc000_0000;
const PENDING_SLOT_SHIFT: u32 = 16;
const PENDING_SLOT_BITS: u32 = 0x3fff;

/// The mark of a packet from the endpoint in `slot` whose verdict waits for the DNAT.
pub const fn policy_pending_mark(slot: u32) -> u32 {
    POLICY_PENDING_MARK | ((slot & PENDING_SLOT_BITS) << PENDING_SLOT_SHIFT)
}

/// The sender's slot, when `mark` is a [`policy_pending_mark`].
pub const fn policy_pending_slot(mark: u32) -> Option<u32> {
    if mark & POLICY_PENDING_MASK == POLICY_PENDING_MARK {
        Some((mark >> PENDING_SLOT_SHIFT) & PENDING_SLOT_BITS)
    } else {
        None
    }
}

/// Bits of a [`PolicyKey`] before the protocol: the slot, the direction, the identity.
pub const POLICY_KEY_PEER_BITS: u32 = 72;
/// Bits of a [`PolicyKey`] before the port.
pub const POLICY_KEY_PROTO_BITS: u32 = 80;
/// Bits of a whole [`PolicyKey`].
pub const POLICY_KEY_BITS: u32 = 96;

/// One endpoint's policy state ([`POLICY_STATE_MAP`] value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyState {
    /// `POL_ISOLATED_*` bits.
    pub flags: u32,
    /// Changed by the agent whenever the endpoint's verdicts may have changed (node-wide
    /// counter, never reused): a flow remembered under another generation is checked again.
    pub generation: u32,
}

/// The data of a [`POLICY_MAP`] key (after the LPM prefix length): big-endian fields, most
/// significant first, so that a prefix of the key leaves the protocol or the port open.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicyKey {
    /// The endpoint's slot, big-endian.
    pub slot: [u8; 4],
    /// `POL_DIR_*`.
    pub dir: u8,
    /// The peer's identity (or [`POLICY_ANY_PEER`]), big-endian.
    pub identity: [u8; 4],
    /// IP protocol number.
    pub proto: u8,
    /// The pod's port on ingress, the peer's on egress, big-endian (as in the packet).
    pub port: [u8; 2],
}

impl PolicyKey {
    pub const fn new(slot: u32, dir: u8, identity: u32, proto: u8, port_be: [u8; 2]) -> Self {
        Self {
            slot: slot.to_be_bytes(),
            dir,
            identity: identity.to_be_bytes(),
            proto,
            port: port_be,
        }
    }
}

/// An IPv4 flow as seen from a local pod ([`POLICY_FLOWS_V4_MAP`] key): [`crate::FlowKey`]'s
/// fields for IPv4, without its 24 bytes of zeroes and its family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicyFlowKeyV4 {
    pub pod: [u8; 4],
    pub peer: [u8; 4],
    /// Network byte order, as in [`crate::FlowKey`].
    pub pod_port: u16,
    pub peer_port: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

impl PolicyFlowKeyV4 {
    /// The key of `flow`, when it is an IPv4 flow.
    pub fn of(flow: &crate::FlowKey) -> Option<Self> {
        (flow.family == 4).then(|| Self {
            pod: [flow.pod[0], flow.pod[1], flow.pod[2], flow.pod[3]],
            peer: [flow.peer[0], flow.peer[1], flow.peer[2], flow.peer[3]],
            pod_port: flow.pod_port,
            peer_port: flow.peer_port,
            proto: flow.proto,
            _pad: [0; 3],
        })
    }

    /// The flow this key stands for.
    pub fn flow(&self) -> crate::FlowKey {
        let mut f = crate::FlowKey {
            pod_port: self.pod_port,
            peer_port: self.peer_port,
            proto: self.proto,
            family: 4,
            ..crate::FlowKey::default()
        };
        f.pod[..4].copy_from_slice(&self.pod);
        f.peer[..4].copy_from_slice(&self.peer);
        f
    }
}

/// A flow an isolated endpoint let through ([`POLICY_FLOWS_MAP`] and [`POLICY_FLOWS_V4_MAP`]
/// value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyFlow {
    /// `bpf_ktime_get_ns()` of the last packet (refreshed at most about once a second).
    pub last_seen_ns: u64,
    /// The endpoint's [`PolicyState::generation`] when the flow was last allowed.
    pub generation: u32,
    /// `PF_*`: who opened it.
    pub flags: u32,
}

/// What [`POLICY_PAIRS_MAP`] says of an endpoint and a peer endpoint on this node, both seen
/// at the generations it names: a verdict the programs wrote, never the agent. The endpoint's
/// egress and ingress rules, and the peer's, either allow every TCP packet between the two
/// addresses (`family` 4 or 6), or not (`family` 0: known, nothing to skip). A change of
/// either endpoint's generation makes it stale: the flows then decide, and the entry is
/// written again.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyPair {
    /// The peer's address (IPv4 in the first 4 bytes, the rest zero).
    pub peer: [u8; 16],
    /// The endpoint's [`PolicyState::generation`].
    pub generation: u32,
    /// The peer's [`PolicyState::generation`].
    pub peer_generation: u32,
    /// [`policy_pair_slots`] of the endpoint and the peer.
    pub slots: u32,
    /// 4 or 6 (the family of `peer`) when every TCP packet between the two passes both
    /// endpoints' rules both ways; 0 when not.
    pub family: u32,
}

/// What [`POLICY_SYNS_MAP`] says of the new TCP connections one endpoint of this node (the
/// opener) opened to another on one port: the rules that let the last one through. The tries
/// answer the same for every SYN between the two to that port for as long as both keep their
/// generations (a change of an endpoint's entries or isolation, or of any address's identity,
/// gives every endpoint it touches a new one), and the SYN memo only answers when the
/// [`PolicyPair`] of the two is current (the receiver's address checked).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicySyn {
    /// [`policy_pair_slots`] of the opener and the other endpoint.
    pub slots: u32,
    /// The opener's [`PolicyState::generation`].
    pub generation: u32,
    /// The other endpoint's [`PolicyState::generation`].
    pub peer_generation: u32,
    /// [`policy_syn_port`] of the connection's family and port.
    pub port: u32,
    /// The opener's egress rule that let it out (when `known` has [`SYN_EGRESS`]).
    pub egress_rule: u32,
    /// The other endpoint's ingress rule that let it in (when `known` has [`SYN_INGRESS`]).
    pub ingress_rule: u32,
    /// [`SYN_EGRESS`], [`SYN_INGRESS`]: which rules are known; [`SYN_RECORDED`].
    pub known: u32,
}

/// What [`POLICY_OPENERS_MAP`] holds for two endpoints of this node: up to
/// [`POLICY_OPENER_PORTS`] ports ([`policy_opener_word`]), each added with a
/// compare-and-exchange of the 64-bit word it shares with its neighbour (a map value is 8-byte
/// aligned; BPF's compare-and-exchange of 32-bit words needs 32-bit ALU code throughout),
/// never taken out while both endpoints exist. Aligned as the scratch's `addr`, where the
/// programs build a new one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyOpeners {
    pub ports: [u32; POLICY_OPENER_PORTS],
}

/// A port of a [`PolicyOpeners`]: the endpoint with the lower slot (`lower_opened`) or the
/// other opened TCP connections of `family` (4 or 6) to `port` (network order, as read from
/// the packet) on the other. Never 0.
pub const fn policy_opener_word(lower_opened: bool, family: u8, port: u16) -> u32 {
    (1 << 31) | ((lower_opened as u32) << 24) | ((family as u32) << 16) | port as u32
}

/// [`PolicySyn::known`]: the opener's egress rule.
pub const SYN_EGRESS: u32 = 1;
/// [`PolicySyn::known`]: the other endpoint's ingress rule.
pub const SYN_INGRESS: u32 = 2;
/// [`PolicySyn::known`]: the pair's [`PolicyOpeners`] holds the port as the opener's, noted
/// while both endpoints had the generations the entry names. A record is only taken out when
/// one of its slots opens, and an opened slot gets a new generation: while both generations
/// hold, so does the record, and a SYN the memo settles both ways has nothing to note.
/// Cleared whenever either generation is written again. (A build whose pins replace
/// [`POLICY_OPENERS_MAP`] empty must replace [`POLICY_SYNS_MAP`] too.)
pub const SYN_RECORDED: u32 = 4;

/// [`PolicySyn::port`] of a connection of `family` (4 or 6) to `port` (network order, as
/// read from the packet).
pub const fn policy_syn_port(family: u8, port: u16) -> u32 {
    ((family as u32) << 16) | port as u32
}

/// The [`POLICY_PAIRS_MAP`] index of the endpoint in `slot` and its peer in `peer_slot`:
/// every pair of the first 64 slots has its own.
pub const fn policy_pair_index(slot: u32, peer_slot: u32) -> u32 {
    ((slot << 6) ^ peer_slot) & (POLICY_PAIRS - 1)
}

/// The `slots` of a [`PolicyPair`]: the endpoint's slot, then the peer's (each under 2^16).
pub const fn policy_pair_slots(slot: u32, peer_slot: u32) -> u32 {
    (slot << 16) | peer_slot
}

/// [`PolicyDropEvent::why`]: no rule allows the packet.
pub const DENIED_NO_RULE: u8 = 1;
/// [`PolicyDropEvent::why`]: the packet's flow was allowed once, and a change revoked it.
pub const DENIED_REVOKED: u8 = 2;
/// [`PolicyDropEvent::why`]: the packet's headers cannot be read (fail closed).
pub const DENIED_UNREADABLE: u8 = 3;

/// A [`POLICY_HITS_MAP`] key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyHitKey {
    pub slot: u32,
    pub rule: u32,
}

/// A packet policy denied ([`POLICY_EVENTS_MAP`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyDropEvent {
    /// `bpf_ktime_get_coarse_ns()` (CLOCK_MONOTONIC_COARSE).
    pub ktime_ns: u64,
    /// The flow seen from the pod (as far as it was read: `why` [`DENIED_UNREADABLE`] may
    /// leave it partly empty).
    pub flow: crate::FlowKey,
    /// The endpoint's slot.
    pub slot: u32,
    /// The peer's identity ([`POLICY_WORLD`] when no prefix covers it).
    pub identity: u32,
    /// Events this CPU left out (rate limit) since the one before this.
    pub suppressed: u32,
    /// `POL_DIR_*`.
    pub dir: u8,
    /// `DENIED_*`.
    pub why: u8,
    pub _pad: [u8; 2],
}

/// The rate limit of the drop events, per CPU ([`POLICY_EVENT_BUDGET_MAP`] value): a token
/// bucket counted in nanoseconds of credit; and where the next event is built (the stack has
/// no room for it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventBudget {
    pub credit_ns: u64,
    pub last_ns: u64,
    /// Events left out since the last one sent.
    pub suppressed: u64,
    pub event: PolicyDropEvent,
}

/// [`PolicyScratch::flags`]: the packet has ports (or an echo identifier): its flow is
/// remembered.
pub const PS_KEYED: u32 = 1;
/// [`PolicyScratch::flags`]: a TCP SYN without ACK (a new connection, never a remembered one).
pub const PS_SYN: u32 = 2;
/// [`PolicyScratch::flags`]: IPv6 neighbour discovery or MLD (never subject to policy).
pub const PS_EXEMPT: u32 = 4;
/// [`PolicyScratch::flags`]: a TCP segment with FIN.
pub const PS_FIN: u32 = 8;
/// [`PolicyScratch::flags`]: a TCP segment with RST.
pub const PS_RST: u32 = 16;

/// [`PolicyScratch::flags`]: the packet goes between two endpoints of this node whose
/// [`PolicyPair`] is current and allows every TCP packet: a connection's last ACK then passes
/// without a lookup, so its entries go at the second FIN instead.
pub const PS_PAIR: u32 = 32;
/// [`PolicyScratch::flags`]: the packet goes between two endpoints of this node whose
/// [`PolicyPair`] is current; the other endpoint's slot is in the upper 16 bits
/// ([`PS_PEER_SHIFT`], with [`PS_LOCAL`]): a SYN may take its rules from the SYN memo
/// ([`PolicySyn`]).
pub const PS_PEER: u32 = 64;
/// [`PolicyScratch::flags`]: the receiver's verdict on a packet whose sender, an endpoint of
/// this node, judged it just before (and found or wrote the flow's entry on its side). With
/// [`PS_PAIR`] the receiver keeps no entry of its own: the sender's says who opened the
/// connection, should a change ask.
pub const PS_SENT: u32 = 128;
/// [`PolicyScratch::flags`]: the other end is an endpoint of this node, its slot in the upper
/// 16 bits ([`PS_PEER_SHIFT`]), whether their [`PolicyPair`] is current or not.
pub const PS_LOCAL: u32 = 256;
/// [`PolicyScratch::flags`]: with [`PS_PAIR`], both endpoints are isolated and neither keeps
/// established flows ([`PAIR_RECORDED`]): a new connection's opener is noted in their
/// [`PolicyOpeners`] instead of a flow entry.
pub const PS_RECORD: u32 = 512;
/// [`PolicyPair::family`] bit: both endpoints are isolated (every packet between them meets
/// the sender's verdict first) and neither keeps established flows after a change, so their
/// connections keep no flow entry; their openers are in [`POLICY_OPENERS_MAP`], and their
/// FINs pass on the pair like other segments.
pub const PAIR_RECORDED: u32 = 0x100;
/// Where [`PS_PEER`]'s slot starts in [`PolicyScratch::flags`].
pub const PS_PEER_SHIFT: u32 = 16;

/// The programs' working space for one verdict ([`POLICY_SCRATCH_MAP`] value). Each key lies
/// as the map it is looked up in wants it: `rule_len` + `rule` is a [`POLICY_MAP`] key,
/// `addr_len` + `addr` an identity trie's (IPv4 in the first 4 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyScratch {
    pub flow: crate::FlowKey,
    pub rule_len: u32,
    pub rule: PolicyKey,
    pub addr_len: u32,
    pub addr: [u8; 16],
    /// The peer's identity, once looked up.
    pub identity: u32,
    pub value: PolicyFlow,
    /// `PS_*` bits.
    pub flags: u32,
    /// Why the verdict denied (`DENIED_*`), once it did.
    pub why: u32,
}

/// How long a remembered flow lives after its last packet: TCP (established or not: a new
/// connection is always checked as new), and everything else.
pub const POLICY_FLOW_TCP_NS: u64 = 3_600 * 1_000_000_000;
pub const POLICY_FLOW_OTHER_NS: u64 = 120 * 1_000_000_000;

// Every slot fits the pending mark's 14 bits.
const _: () = assert!(crate::MAX_ENDPOINTS - 1 <= PENDING_SLOT_BITS);
// Every slot fits a pair's 16 bits.
const _: () = assert!(crate::MAX_ENDPOINTS <= 1 << 16 && POLICY_PAIRS.is_power_of_two());
