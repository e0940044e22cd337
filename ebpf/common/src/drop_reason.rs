//! Why a program dropped a packet: the reasons, their stable values and names.

/// Why a program dropped a packet. Values are stable (they are in the counters map).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// IPv4 from a pod with a source address that is not the pod's.
    SpoofedV4 = 1,
    /// IPv6 from a pod with a source address that is neither the pod's nor link-local (or
    /// is the host veth's own link-local address).
    SpoofedV6 = 2,
    /// ARP from a pod claiming a sender address that is not the pod's.
    SpoofedArp = 3,
    /// An IPv4 header that is truncated or invalid (version, IHL, total length).
    MalformedV4 = 4,
    /// An IPv6 header that is truncated or invalid.
    MalformedV6 = 5,
    /// An ARP packet too short for an IPv4-over-Ethernet ARP.
    MalformedArp = 6,
    /// IPv4 from a pod that has no IPv4 address (or IPv6 from a pod without IPv6).
    FamilyNotAssigned = 7,
    /// XDP on the uplink: the source address is in the deny list (and the packet is not to a
    /// failsafe port).
    XdpDenied = 8,
    /// XDP on the uplink: a truncated or invalid IPv4 header (version, IHL, total length).
    XdpMalformedV4 = 9,
    /// XDP on the uplink: a truncated or invalid IPv6 header (version, payload length).
    XdpMalformedV6 = 10,
    /// SNAT: the connection-tracking table is full; the new flow's first packet is dropped.
    ConntrackFull = 11,
    /// SNAT: no free NAT port for the flow's destination within the bounded search.
    NatPortsExhausted = 12,
    /// A VLAN-tagged frame from a pod (802.1Q or 802.1ad; the tag in the skb's metadata, where
    /// the kernel puts a received frame's outer tag before tc, or in the header).
    VlanTagged = 13,
    /// A frame from a pod that is neither IPv4, IPv6 nor ARP (by its EtherType).
    EtherTypeNotAllowed = 14,
    /// IPv6 from a pod with a link-local or unspecified source that is not neighbour
    /// discovery (router/neighbour solicitation, neighbour advertisement, MLD report).
    LinkLocalNotNd = 15,
    /// A neighbour advertisement from a pod for a target that is not its own address.
    SpoofedNdTarget = 16,
    /// SNAT: the endpoint already holds its budget of conntrack flows
    /// (`[nat] conntrack_flows_per_endpoint`); the new flow's first packet is dropped.
    ConntrackBudget = 17,
    /// SNAT: a TCP RST of a translated flow whose sequence number is outside the window (or,
    /// before the other side has sent anything, that does not acknowledge its SYN): a blind
    /// reset. The flow stays as it was.
    ConntrackRstInvalid = 18,
    /// TCP from a pod to a calix agent's port (Routes, metrics) on a node's address: this
    /// node's or another's (issue 20). The port is an operator's to open (`[doors]`).
    AgentPort = 19,
    /// NetworkPolicy: the pod is isolated for ingress and no rule allows the packet (nor is
    /// it part of a flow one allowed).
    PolicyIngress = 20,
    /// NetworkPolicy: the pod is isolated for egress and no rule allows the packet.
    PolicyEgress = 21,
    /// A client outside the cluster reached a Service with `externalTrafficPolicy: Local` at
    /// a node with no endpoint of it (kube-proxy drops it too: the load balancer's health
    /// check has taken the node out).
    ServiceNoLocalEndpoint = 22,
}

impl DropReason {
    pub const ALL: [DropReason; 22] = [
        DropReason::SpoofedV4,
        DropReason::SpoofedV6,
        DropReason::SpoofedArp,
        DropReason::MalformedV4,
        DropReason::MalformedV6,
        DropReason::MalformedArp,
        DropReason::FamilyNotAssigned,
        DropReason::XdpDenied,
        DropReason::XdpMalformedV4,
        DropReason::XdpMalformedV6,
        DropReason::ConntrackFull,
        DropReason::NatPortsExhausted,
        DropReason::VlanTagged,
        DropReason::EtherTypeNotAllowed,
        DropReason::LinkLocalNotNd,
        DropReason::SpoofedNdTarget,
        DropReason::ConntrackBudget,
        DropReason::ConntrackRstInvalid,
        DropReason::AgentPort,
        DropReason::PolicyIngress,
        DropReason::PolicyEgress,
        DropReason::ServiceNoLocalEndpoint,
    ];

    /// The reason's name as `calixctl` and `/metrics` show it.
    pub const fn name(self) -> &'static str {
        match self {
            DropReason::SpoofedV4 => "spoofed_source_v4",
            DropReason::SpoofedV6 => "spoofed_source_v6",
            DropReason::SpoofedArp => "spoofed_arp_sender",
            DropReason::MalformedV4 => "malformed_ipv4",
            DropReason::MalformedV6 => "malformed_ipv6",
            DropReason::MalformedArp => "malformed_arp",
            DropReason::FamilyNotAssigned => "family_not_assigned",
            DropReason::XdpDenied => "xdp_denied_source",
            DropReason::XdpMalformedV4 => "xdp_malformed_ipv4",
            DropReason::XdpMalformedV6 => "xdp_malformed_ipv6",
            DropReason::ConntrackFull => "conntrack_full",
            DropReason::NatPortsExhausted => "nat_ports_exhausted",
            DropReason::VlanTagged => "vlan_tagged",
            DropReason::EtherTypeNotAllowed => "ethertype_not_allowed",
            DropReason::LinkLocalNotNd => "link_local_not_nd",
            DropReason::SpoofedNdTarget => "spoofed_nd_target",
            DropReason::ConntrackBudget => "conntrack_budget",
            DropReason::ConntrackRstInvalid => "ct_rst_out_of_window",
            DropReason::AgentPort => "agent_port",
            DropReason::PolicyIngress => "policy_ingress",
            DropReason::PolicyEgress => "policy_egress",
            DropReason::ServiceNoLocalEndpoint => "service_no_local_endpoint",
        }
    }

    pub fn from_u32(v: u32) -> Option<DropReason> {
        DropReason::ALL.into_iter().find(|r| *r as u32 == v)
    }
}
