//! Forwarding without the host stack: to a pod on this node with `bpf_redirect_peer`, to a pod
//! on another node with `bpf_fib_lookup` + `bpf_redirect_neigh`. Both decrement the TTL / hop
//! limit as the kernel's forwarding would; a packet whose TTL would expire goes to the host
//! stack, which sends the ICMP error.

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, TC_ACT_OK},
    cty::c_long,
    helpers::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_redirect_peer},
    programs::TcContext,
};
use calix_common::{LocalEndpoint, HOST_VETH_MAC};

use crate::counters;
use crate::packet::{v4, v6, Ipv4, Ipv6};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const BPF_FIB_LKUP_RET_SUCCESS: c_long = 0;
const BPF_FIB_LKUP_RET_NO_NEIGH: c_long = 7;

/// Decrements the IPv4 TTL and fixes the header checksum; `false` if the TTL would expire.
#[inline(always)]
fn dec_ttl_v4(ctx: &mut TcContext) -> Result<bool, c_long> {
    // TTL and protocol form one 16-bit word of the checksum.
    let old: u16 = ctx.load(v4::TTL)?;
    let ttl = old.to_ne_bytes()[0];
    if ttl <= 1 {
        return Ok(false);
    }
    let new = u16::from_ne_bytes([ttl - 1, old.to_ne_bytes()[1]]);
    ctx.l3_csum_replace(v4::CSUM, u64::from(old), u64::from(new), 2)?;
    ctx.store(v4::TTL, &(ttl - 1), 0)?;
    Ok(true)
}

/// Decrements the IPv6 hop limit (no checksum); `false` if it would expire.
#[inline(always)]
fn dec_hop_limit(ctx: &mut TcContext) -> Result<bool, c_long> {
    let hl: u8 = ctx.load(v6::HOP_LIMIT)?;
    if hl <= 1 {
        return Ok(false);
    }
    ctx.store(v6::HOP_LIMIT, &(hl - 1), 0)?;
    Ok(true)
}

/// Decrements the TTL (IPv4) or hop limit (IPv6) as forwarding does; `false` if it would
/// expire (the host stack then sends the ICMP error).
#[inline(always)]
fn dec_ttl(ctx: &mut TcContext, v4: bool) -> Result<bool, c_long> {
    if v4 {
        dec_ttl_v4(ctx)
    } else {
        dec_hop_limit(ctx)
    }
}

/// Delivers the frame straight into the pod behind `ep` (its veth peer's ingress).
#[inline(always)]
pub fn to_local(ctx: &mut TcContext, ep: &LocalEndpoint, v4: bool) -> Result<i32, c_long> {
    if !dec_ttl(ctx, v4)? {
        return Ok(TC_ACT_OK);
    }
    ctx.store(0, &ep.mac, 0)?;
    ctx.store(6, &HOST_VETH_MAC, 0)?;
    counters::to_pod(ep.ifindex, u64::from(ctx.len()));
    // SAFETY: a plain helper call; the kernel validates the ifindex.
    Ok(unsafe { bpf_redirect_peer(ep.ifindex, 0) } as i32)
}

/// Looks the destination up in the kernel's FIB and sends the frame out of the resulting
/// interface; anything the FIB cannot settle (local delivery, no route, blackhole...) goes to
/// the host stack.
#[inline(always)]
fn via_fib(ctx: &mut TcContext, mut p: FibParams, v4: bool) -> Result<i32, c_long> {
    // SAFETY: `p` is a valid, initialised bpf_fib_lookup and the size matches.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            &mut p,
            core::mem::size_of::<FibParams>() as i32,
            0,
        )
    };
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Ok(TC_ACT_OK);
    }
    if !dec_ttl(ctx, v4)? {
        return Ok(TC_ACT_OK);
    }
    // Tell `to_host_dev` this packet took the fast path (it records only stack-routed flows).
    ctx.set_mark(calix_common::FAST_PATH_MARK);
    if rc == BPF_FIB_LKUP_RET_SUCCESS {
        ctx.store(0, &p.dmac, 0)?;
        ctx.store(6, &p.smac, 0)?;
        // SAFETY: a plain helper call.
        return Ok(unsafe { bpf_redirect(p.ifindex, 0) } as i32);
    }
    // No neighbour entry yet: let the kernel resolve it and fill in the addresses.
    // SAFETY: a plain helper call; a null neighbour means "use the FIB's next hop".
    Ok(unsafe { bpf_redirect_neigh(p.ifindex, core::ptr::null_mut(), 0, 0) } as i32)
}

fn zeroed_params() -> FibParams {
    // SAFETY: bpf_fib_lookup is plain data (integers, arrays, unions of integers); all-zero is
    // its documented initial state.
    unsafe { core::mem::zeroed() }
}

/// IPv4 to another node.
#[inline(always)]
pub fn remote_v4(ctx: &mut TcContext, ip: &Ipv4, ifindex: u32) -> Result<i32, c_long> {
    let mut p = zeroed_params();
    p.family = AF_INET;
    p.l4_protocol = ip.proto;
    p.__bindgen_anon_1.tot_len = ip.tot_len;
    p.ifindex = ifindex;
    p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(ip.src);
    p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(ip.dst);
    via_fib(ctx, p, true)
}

/// IPv6 to another node.
#[inline(always)]
pub fn remote_v6(ctx: &mut TcContext, ip: &Ipv6, ifindex: u32) -> Result<i32, c_long> {
    let mut p = zeroed_params();
    p.family = AF_INET6;
    p.l4_protocol = ip.next_hdr;
    p.__bindgen_anon_1.tot_len = ip.payload_len;
    p.ifindex = ifindex;
    let words = |a: &[u8; 16]| {
        [
            u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
            u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
            u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
            u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
        ]
    };
    p.__bindgen_anon_3.ipv6_src = words(&ip.src);
    p.__bindgen_anon_4.ipv6_dst = words(&ip.dst);
    via_fib(ctx, p, false)
}
