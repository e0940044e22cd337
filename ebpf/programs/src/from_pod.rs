//! Traffic the pod sends (tc ingress on the host-side `cali*` veth): anti-spoofing, then
//! forwarding. A pod on this node gets the packet straight into its namespace
//! (`bpf_redirect_peer`); a pool address on another node goes out via the FIB; anything else
//! (the node itself, services, the outside world) continues into the host stack — as do the
//! replies of flows the stack delivered (it may have NATed them, see `flows`), fragments, and
//! protocols other than TCP, UDP and ICMP echo.

// The bench-floor build uses little of this module.
#![cfg_attr(feature = "bench-floor", allow(unused_imports, dead_code))]

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, maps::lpm_trie::Key, programs::TcContext};
use calix_common::{DropReason, EndpointInfo, EP_HAS_V4, EP_HAS_V6, EP_NAT_OUTGOING};

use crate::counters::{self, drop};
use crate::flows;
use crate::forward;
use crate::maps::{
    CALIX_ENDPOINTS, CALIX_LOCAL_V4, CALIX_LOCAL_V6, CALIX_POOLS_V4, CALIX_POOLS_V6,
};
use crate::nat;
use crate::packet::{self, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6};

pub fn try_from_pod(ctx: &mut TcContext) -> Result<i32, c_long> {
    #[cfg(feature = "bench-floor")]
    return floor(ctx);
    #[cfg(not(feature = "bench-floor"))]
    full(ctx)
}

/// The `bench-floor` build's `from_pod`: the least a same-node redirect needs, as the
/// benchmark's floor. IPv4 only; everything else goes to the stack.
#[cfg(feature = "bench-floor")]
#[inline(always)]
fn floor(ctx: &mut TcContext) -> Result<i32, c_long> {
    if packet::ethertype(ctx)? != ETH_P_IP {
        return Ok(TC_ACT_OK);
    }
    let dst: [u8; 4] = ctx.load(packet::ETH_HLEN + 16)?;
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
    counters::from_pod(ifindex, u64::from(ctx.len()));
    #[cfg(feature = "upgrade-test")]
    counters::mark_upgrade_build(ctx, ifindex);
    // An interface the agent has not (or no longer) registered: not ours to judge.
    let Some(ep) = CALIX_ENDPOINTS.get_ptr(&ifindex) else {
        return Ok(TC_ACT_OK);
    };
    // SAFETY: a pointer from a successful lookup, valid until the program returns.
    let ep: EndpointInfo = unsafe { *ep };
    match packet::ethertype(ctx)? {
        ETH_P_IP => ipv4(ctx, ifindex, &ep),
        ETH_P_IPV6 => ipv6(ctx, ifindex, &ep),
        ETH_P_ARP => arp(ctx, ifindex, &ep),
        // Other protocols: the host stack decides (and normally drops them).
        _ => Ok(TC_ACT_OK),
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
    let remote = local.is_none() && CALIX_POOLS_V4.get(&Key::new(32, ip.dst)).is_some();
    if (local.is_some() || remote)
        && !flows::fast_path_ok(ifindex, flows::has_ports_v4(&ip), || {
            flows::key_v4(ctx, &ip, true)
        })
    {
        return Ok(TC_ACT_OK);
    }
    if let Some(local) = local {
        // SAFETY: as above.
        let local = unsafe { *local };
        return forward::to_local(ctx, &local, forward::Ttl::of_v4(&ip));
    }
    if remote {
        return forward::remote_v4(ctx, &ip, ifindex);
    }
    if ep.flags & EP_NAT_OUTGOING != 0 {
        return nat::snat_v4(ctx, ifindex, &ip);
    }
    Ok(TC_ACT_OK)
}

#[inline(always)]
fn ipv6(ctx: &mut TcContext, ifindex: u32, ep: &EndpointInfo) -> Result<i32, c_long> {
    let Some(ip) = packet::ipv6(ctx) else {
        return Ok(drop(ctx, ifindex, DropReason::MalformedV6));
    };
    // Link-local and unspecified sources are neighbour discovery, which every pod does.
    if packet::is_v6_link_local(&ip.src) || packet::is_v6_unspecified(&ip.src) {
        return Ok(TC_ACT_OK);
    }
    if ep.flags & EP_HAS_V6 == 0 {
        return Ok(drop(ctx, ifindex, DropReason::FamilyNotAssigned));
    }
    if ip.src != ep.ipv6 {
        return Ok(drop(ctx, ifindex, DropReason::SpoofedV6));
    }
    let local = CALIX_LOCAL_V6.get_ptr(&ip.dst);
    let remote = local.is_none() && CALIX_POOLS_V6.get(&Key::new(128, ip.dst)).is_some();
    if (local.is_some() || remote)
        && !flows::fast_path_ok(ifindex, flows::has_ports_v6(&ip), || {
            flows::key_v6(ctx, &ip, true)
        })
    {
        return Ok(TC_ACT_OK);
    }
    if let Some(local) = local {
        // SAFETY: as above.
        let local = unsafe { *local };
        return forward::to_local(ctx, &local, forward::Ttl::of_v6(&ip));
    }
    if remote {
        return forward::remote_v6(ctx, &ip, ifindex);
    }
    Ok(TC_ACT_OK)
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
