//! Traffic the pod sends (tc ingress on the host-side `cali*` veth): anti-spoofing, then
//! forwarding.
//!
//! A pod may send untagged IPv4 from its address, untagged IPv6 from its address, ARP for its
//! IPv4 address, and IPv6 neighbour discovery from link-local or unspecified sources; every
//! other frame is dropped and counted with its reason (see `guard` below).
//!
//! A pod on this node gets the packet straight into its namespace
//! (`bpf_redirect_peer`); a pool address on another node goes out via the FIB; anything else
//! (the node itself, services, the outside world) continues into the host stack (an
//! egress-isolated pod's packets to a Service address marked: their policy verdict waits for
//! the stack's DNAT) — as do the
//! replies of flows the stack delivered (it may have NATed them, see `flows`), fragments, and
//! protocols other than TCP, UDP and ICMP echo — or is SNATed out (`natOutgoing`), but never
//! TCP to a calix agent's port on a node's address (`doors`).

// The bench-floor build uses little of this module.
#![cfg_attr(feature = "bench-floor", allow(unused_imports, dead_code))]

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, maps::lpm_trie::Key, programs::TcContext};
use calix_common::{
    policy_pending_mark, DropReason, EndpointInfo, LocalEndpoint, EP_HAS_V4, EP_HAS_V6,
    EP_NAT_OUTGOING, PS_LOCAL, PS_PAIR, PS_PEER, PS_PEER_SHIFT, PS_RECORD,
};

use crate::counters::{self, drop};
use crate::doors;
use crate::flows;
use crate::forward;
use crate::maps::{CALIX_LOCAL_V4, CALIX_LOCAL_V6, CALIX_POOLS_V4, CALIX_POOLS_V6};
use crate::nat;
use crate::packet::{
    self, v6, Ipv6, ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6,
    IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP,
};
use crate::policy::{self, Pair};

#[inline(always)]
pub fn try_from_pod(ctx: &mut TcContext) -> Result<i32, c_long> {
    #[cfg(feature = "bench-floor")]
    return floor(ctx);
    #[cfg(not(feature = "bench-floor"))]
    full(ctx)
}

/// The `bench-floor` build's `from_pod`: the least a same-node redirect needs, as the
/// benchmark's floor (direct packet reads, as calix's own). IPv4 only; everything else goes
/// to the stack.
#[cfg(feature = "bench-floor")]
#[inline(always)]
fn floor(ctx: &mut TcContext) -> Result<i32, c_long> {
    if packet::ethertype(ctx)? != ETH_P_IP {
        return Ok(TC_ACT_OK);
    }
    let dst: [u8; 4] = packet::load(ctx, packet::ETH_HLEN + 16)?;
    match CALIX_LOCAL_V4.get_ptr(&dst) {
        // SAFETY: a pointer from a successful lookup; a plain helper call.
        Some(l) => Ok(unsafe { aya_ebpf::helpers::bpf_redirect_peer((*l).ifindex, 0) } as i32),
        None => Ok(TC_ACT_OK),
    }
}

#[cfg(not(feature = "bench-floor"))]
#[inline(always)]
fn full(ctx: &mut TcContext) -> Result<i32, c_long> {
    // SAFETY: `ctx.skb.skb` is the `__sk_buff` the kernel passed to this program; reading a
    // field of it is a plain context access the verifier checks.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    #[cfg(feature = "upgrade-test")]
    counters::mark_upgrade_build(ctx, ifindex);
    // The one lookup by interface: the endpoint's addresses and its slot (its counters and
    // marks). An interface the agent has not (or no longer) registered: not ours to judge.
    let Some(ep) = crate::maps::endpoint(ifindex) else {
        return Ok(TC_ACT_OK);
    };
    // SAFETY: a pointer from a successful lookup, valid until the program returns.
    let ep: &EndpointInfo = unsafe { &*ep };
    counters::from_pod(ep.slot, u64::from(ctx.len()));
    // A VLAN tag: the kernel moves a received frame's (outer) tag into the skb's metadata
    // before tc runs, and the host stack may still strip priority tags (VLAN 0) after tc and
    // route what is inside, unchecked. A second tag stays in the header.
    // SAFETY: as above, a context read.
    if unsafe { (*ctx.skb.skb).vlan_present } != 0 {
        return Ok(drop(ctx, ifindex, DropReason::VlanTagged));
    }
    let Ok(ethertype) = packet::ethertype(ctx) else {
        return Ok(drop(ctx, ifindex, DropReason::EtherTypeNotAllowed));
    };
    match ethertype {
        ETH_P_IP => ipv4(ctx, ifindex, ep),
        ETH_P_IPV6 => ipv6(ctx, ifindex, ep),
        ETH_P_ARP => arp(ctx, ifindex, ep),
        ETH_P_8021Q | ETH_P_8021AD => Ok(drop(ctx, ifindex, DropReason::VlanTagged)),
        _ => Ok(drop(ctx, ifindex, DropReason::EtherTypeNotAllowed)),
    }
}

#[inline(always)]
fn ipv4(ctx: &mut TcContext, ifindex: u32, ep: &EndpointInfo) -> Result<i32, c_long> {
    let Some(ip) = packet::ipv4(ctx) else {
        return Ok(drop(ctx, ifindex, DropReason::MalformedV4));
    };
    if ep.flags & EP_HAS_V4 == 0 {
        return Ok(drop(ctx, ifindex, DropReason::FamilyNotAssigned));
    }
    if ip.src != ep.ipv4 {
        return Ok(drop(ctx, ifindex, DropReason::SpoofedV4));
    }
    let local = CALIX_LOCAL_V4.get_ptr(&ip.dst);
    let pair = match local {
        // SAFETY: a pointer from a successful lookup, valid until the program returns.
        Some(l) if ip.proto == IPPROTO_TCP => {
            policy::pair_v4(ep.slot, unsafe { (*l).slot }, &ip.dst)
        }
        _ => Pair::Unasked,
    };
    let plain = !ip.fragment()
        && ip.ihl == 20
        && policy::plain_segment::<{ ETH_HLEN + 20 }>(
            ctx,
            usize::from(ip.tot_len).saturating_sub(20),
            pair,
        );
    // Egress policy, once the source is the pod's own.
    let sent = match sender_policy(ctx, ifindex, ep.slot, pair, plain, local) {
        Ok(sent) => sent,
        Err(decided) => return Ok(decided),
    };
    let remote = local.is_none() && CALIX_POOLS_V4.get(&Key::new(32, ip.dst)).is_some();
    if (local.is_some() || remote)
        && !flows::fast_path_ok(ep.slot, flows::has_ports_v4(&ip), || {
            flows::key_v4(ctx, &ip, true)
        })
    {
        return Ok(TC_ACT_OK);
    }
    if let Some(local) = local {
        // SAFETY: as above.
        let local = unsafe { &*local };
        return forward::to_local(ctx, local, forward::Ttl::of_v4(&ip), sent);
    }
    if remote {
        return forward::remote_v4(ctx, &ip, ifindex);
    }
    // A backend's reply to a client outside that reached it through a Service here.
    if let Some(verdict) = crate::nodeport::reply_from_pod_v4(ctx, &ip)? {
        return Ok(verdict);
    }
    // To the stack or SNATed out: never to an agent's port on a node.
    if doors::v4(ctx, &ip) {
        return Ok(drop(ctx, ifindex, DropReason::AgentPort));
    }
    if ep.flags & EP_NAT_OUTGOING != 0 {
        return nat::snat_v4(ctx, ifindex, ep.slot, &ip);
    }
    Ok(TC_ACT_OK)
}

#[inline(always)]
fn ipv6(ctx: &mut TcContext, ifindex: u32, ep: &EndpointInfo) -> Result<i32, c_long> {
    let Some(ip) = packet::ipv6(ctx) else {
        return Ok(drop(ctx, ifindex, DropReason::MalformedV6));
    };
    // Link-local and unspecified sources: neighbour discovery, nothing else.
    if packet::is_v6_link_local(&ip.src) || packet::is_v6_unspecified(&ip.src) {
        return Ok(match guard::link_local(ctx, ep, &ip) {
            Ok(()) => TC_ACT_OK,
            Err(reason) => drop(ctx, ifindex, reason),
        });
    }
    if ep.flags & EP_HAS_V6 == 0 {
        return Ok(drop(ctx, ifindex, DropReason::FamilyNotAssigned));
    }
    if ip.src != ep.ipv6 {
        return Ok(drop(ctx, ifindex, DropReason::SpoofedV6));
    }
    // TCP and UDP (most of the traffic) need nothing more; anything else may be an
    // advertisement, which must be for the pod's own address.
    if ip.next_hdr != IPPROTO_TCP && ip.next_hdr != IPPROTO_UDP {
        if let Err(reason) = guard::own_source(ctx, ep, &ip) {
            return Ok(drop(ctx, ifindex, reason));
        }
    }
    let local = CALIX_LOCAL_V6.get_ptr(&ip.dst);
    let pair = match local {
        // SAFETY: a pointer from a successful lookup, valid until the program returns.
        Some(l) if ip.next_hdr == IPPROTO_TCP => {
            policy::pair_v6(ep.slot, unsafe { (*l).slot }, &ip.dst)
        }
        _ => Pair::Unasked,
    };
    let plain =
        policy::plain_segment::<{ ETH_HLEN + v6::LEN }>(ctx, usize::from(ip.payload_len), pair);
    let sent = match sender_policy(ctx, ifindex, ep.slot, pair, plain, local) {
        Ok(sent) => sent,
        Err(decided) => return Ok(decided),
    };
    let remote = local.is_none() && CALIX_POOLS_V6.get(&Key::new(128, ip.dst)).is_some();
    if (local.is_some() || remote)
        && !flows::fast_path_ok(ep.slot, flows::has_ports_v6(&ip), || {
            flows::key_v6(ctx, &ip, true)
        })
    {
        return Ok(TC_ACT_OK);
    }
    if let Some(local) = local {
        // SAFETY: as above.
        let local = unsafe { &*local };
        return forward::to_local(ctx, local, forward::Ttl::of_v6(&ip), sent);
    }
    if remote {
        return forward::remote_v6(ctx, &ip, ifindex);
    }
    // A backend's reply to a client outside that reached it through a Service here.
    if let Some(verdict) = crate::nodeport6::reply_from_pod(ctx, crate::nodeport6::Head::of(&ip))? {
        return Ok(verdict);
    }
    if doors::v6(ctx, &ip) {
        return Ok(drop(ctx, ifindex, DropReason::AgentPort));
    }
    Ok(TC_ACT_OK)
}

/// The egress policy of the endpoint in `slot` on the packet, with what the pair cache said
/// of it when it goes to a pod of this node (`pair`, `local`: the receiver; `plain`: a
/// segment the cache may pass without the flows, `policy::plain_segment`): `Ok` what the
/// receiver's verdict needs to know, else what becomes of the packet. The pair's answer read
/// both endpoints' states: an open pair (the common case, no policy) costs nothing more.
#[inline(always)]
fn sender_policy(
    ctx: &mut TcContext,
    ifindex: u32,
    slot: u32,
    pair: Pair,
    plain: bool,
    local: Option<*const LocalEndpoint>,
) -> Result<forward::Sent, i32> {
    // Neither side isolated, or both sides settled by the pair cache: no verdict to give.
    if plain || pair == Pair::Open {
        return Ok(forward::Sent::PASSED_BOTH);
    }
    let extra = match (pair, local) {
        // SAFETY: a pointer from a successful lookup, valid until the program returns.
        (Pair::Allowed | Pair::Recorded | Pair::Checked | Pair::Stale, Some(l)) => {
            let peer = PS_LOCAL | (unsafe { (*l).slot } << PS_PEER_SHIFT);
            match pair {
                Pair::Recorded => peer | PS_PEER | PS_PAIR | PS_RECORD,
                Pair::Allowed => peer | PS_PEER | PS_PAIR,
                Pair::Checked => peer | PS_PEER,
                _ => peer,
            }
        }
        _ => 0,
    };
    if matches!(pair, Pair::Stale | Pair::Checked) {
        if let Some(l) = local {
            // SAFETY: as above.
            policy::recall_opener(ctx.skb.skb, slot, unsafe { (*l).slot });
        }
    }
    match egress_policy(ctx, ifindex, slot, extra)? {
        policy::ALLOW_BOTH => Ok(forward::Sent::PASSED_BOTH),
        v @ (policy::ALLOW_NOTE | policy::ALLOW_NOTE_READ) => {
            if let Some(l) = local {
                // SAFETY: as above.
                policy::note_opener(slot, unsafe { (*l).slot });
            }
            if v == policy::ALLOW_NOTE {
                Ok(forward::Sent::PASSED_BOTH)
            } else {
                Ok(forward::Sent::judged(true, pair, slot))
            }
        }
        v => Ok(forward::Sent::judged(v == policy::ALLOW_READ, pair, slot)),
    }
}

/// The endpoint's egress policy on the packet: `Ok` when it goes on (not isolated for
/// egress, or allowed: the verdict, `policy::ALLOW`, `policy::ALLOW_READ` when it left the
/// packet's flow in the policy scratch, `policy::ALLOW_BOTH` when it settled the receiver's
/// too); else what becomes of it: dropped, or handed to the host stack marked with the
/// endpoint's slot when it goes to a Service address (its verdict then waits for the DNAT:
/// `to_pod` or `to_host_dev` judges it against the backend). `extra`: `PS_*` bits for the
/// verdict.
#[inline(always)]
fn egress_policy(ctx: &mut TcContext, ifindex: u32, slot: u32, extra: u32) -> Result<u8, i32> {
    if !policy::isolated(slot) {
        return Ok(policy::ALLOW);
    }
    match policy::egress(ctx.skb.skb, slot, extra) {
        v if v != policy::DENY && v != policy::DEFER => Ok(v),
        policy::DEFER => {
            ctx.set_mark(policy_pending_mark(slot));
            Err(TC_ACT_OK)
        }
        _ => {
            policy::report_denied(slot, calix_common::POL_DIR_EGRESS);
            Err(drop(ctx, ifindex, DropReason::PolicyEgress))
        }
    }
}

#[inline(always)]
fn arp(ctx: &mut TcContext, ifindex: u32, ep: &EndpointInfo) -> Result<i32, c_long> {
    let Some(sender) = packet::arp_sender(ctx) else {
        return Ok(drop(ctx, ifindex, DropReason::MalformedArp));
    };
    // 0.0.0.0 is an ARP probe (address conflict detection): harmless.
    if sender != [0; 4] && (ep.flags & EP_HAS_V4 == 0 || sender != ep.ipv4) {
        return Ok(drop(ctx, ifindex, DropReason::SpoofedArp));
    }
    Ok(TC_ACT_OK)
}

/// IPv6 neighbour discovery: what a pod may send beyond its own address.
///
/// From a link-local or unspecified source a pod's kernel sends router solicitations,
/// neighbour solicitations (duplicate address detection from `::`), neighbour advertisements
/// of its own addresses, and MLD reports (v1 report and done, v2 report; behind a hop-by-hop
/// header, from `::` before it has a link-local address). Nothing else from such a source
/// is allowed: it could only talk to the host (the kernel never forwards link-local
/// sources), and the pod has its own address for that. An advertisement (from any source)
/// must name the pod's own address, or the link-local address it comes from (Linux always
/// advertises an address from that very address); fragmented neighbour discovery is never
/// legitimate (RFC 6980). The host veth's own link-local address is never a pod's.
mod guard {
    use aya_ebpf::programs::TcContext;
    use calix_common::{DropReason, EndpointInfo, EP_HAS_V6, HOST_VETH_LINK_LOCAL};

    use super::{packet, v6, Ipv6, ETH_HLEN, IPPROTO_ICMPV6};

    const ND_ROUTER_SOLICIT: u8 = 133;
    const ND_NEIGHBOR_SOLICIT: u8 = 135;
    const ND_NEIGHBOR_ADVERT: u8 = 136;
    const MLD_REPORT: u8 = 131;
    const MLD_DONE: u8 = 132;
    const MLD2_REPORT: u8 = 143;
    /// An ICMPv6 header's length (type, code, checksum, and four more bytes).
    const ICMP6_HLEN: usize = 8;
    /// The target address follows the ICMPv6 header in solicitations and advertisements.
    const ND_TARGET: usize = ICMP6_HLEN;

    /// The ICMPv6 message of `ip`: (its type, its offset, whether a fragment header came
    /// first). `Ok(None)` when the packet carries no ICMPv6 header (another protocol, a later
    /// fragment, a header cut short); `Err` when the extension headers cannot be followed.
    #[inline(always)]
    fn icmp6(ctx: &TcContext, ip: &Ipv6) -> Result<Option<(u8, usize, bool)>, ()> {
        let end = end(ip);
        let read = |off: usize| ctx.load::<[u8; 4]>(off).ok();
        let Some(up) = packet::v6_upper(ip.next_hdr, ETH_HLEN + v6::LEN, end, read) else {
            return Err(());
        };
        if up.proto != IPPROTO_ICMPV6 || up.off + ICMP6_HLEN > end {
            return Ok(None);
        }
        Ok(ctx
            .load::<u8>(up.off)
            .ok()
            .map(|ty| (ty, up.off, up.fragmented)))
    }

    /// Where the IP payload ends.
    #[inline(always)]
    fn end(ip: &Ipv6) -> usize {
        ETH_HLEN + v6::LEN + usize::from(ip.payload_len)
    }

    /// Whether the advertisement at `l4` names an address the pod may advertise.
    #[inline(always)]
    fn advertises_own(ctx: &TcContext, ep: &EndpointInfo, ip: &Ipv6, l4: usize) -> bool {
        if l4 + ND_TARGET + 16 > end(ip) {
            return false;
        }
        let Ok(target) = ctx.load::<[u8; 16]>(l4 + ND_TARGET) else {
            return false;
        };
        (ep.flags & EP_HAS_V6 != 0 && target == ep.ipv6)
            || (packet::is_v6_link_local(&ip.src) && target == ip.src)
    }

    /// IPv6 from a link-local or unspecified source: neighbour discovery only.
    #[inline(always)]
    pub fn link_local(ctx: &TcContext, ep: &EndpointInfo, ip: &Ipv6) -> Result<(), DropReason> {
        if ip.src == HOST_VETH_LINK_LOCAL {
            return Err(DropReason::SpoofedV6);
        }
        let Ok(Some((ty, l4, false))) = icmp6(ctx, ip) else {
            return Err(DropReason::LinkLocalNotNd);
        };
        match ty {
            ND_ROUTER_SOLICIT | ND_NEIGHBOR_SOLICIT | MLD_REPORT | MLD_DONE | MLD2_REPORT => Ok(()),
            ND_NEIGHBOR_ADVERT if advertises_own(ctx, ep, ip, l4) => Ok(()),
            ND_NEIGHBOR_ADVERT => Err(DropReason::SpoofedNdTarget),
            _ => Err(DropReason::LinkLocalNotNd),
        }
    }

    /// IPv6 from the pod's own address that is not TCP or UDP: an advertisement must be for
    /// that address; a chain of extension headers too long to follow hides what it carries.
    #[inline(always)]
    pub fn own_source(ctx: &TcContext, ep: &EndpointInfo, ip: &Ipv6) -> Result<(), DropReason> {
        match icmp6(ctx, ip) {
            Err(()) => Err(DropReason::MalformedV6),
            Ok(Some((ND_NEIGHBOR_ADVERT, l4, _))) if !advertises_own(ctx, ep, ip, l4) => {
                Err(DropReason::SpoofedNdTarget)
            }
            Ok(_) => Ok(()),
        }
    }
}
