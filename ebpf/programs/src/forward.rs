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
use calix_common::{
    DropReason, LocalEndpoint, HOST_VETH_MAC, PS_LOCAL, PS_PAIR, PS_PEER, PS_PEER_SHIFT,
};
use core::mem::{size_of, MaybeUninit};

use crate::counters;
use crate::packet::{self, v4, v6, Ipv4, Ipv6};
use crate::policy::{self, Pair};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const BPF_FIB_LKUP_RET_SUCCESS: c_long = 0;
const BPF_FIB_LKUP_RET_NO_NEIGH: c_long = 7;

/// What the TTL / hop-limit step needs, taken from the header the caller already parsed.
#[derive(Clone, Copy)]
pub enum Ttl {
    V4 { ttl: u8, proto: u8, csum: [u8; 2] },
    V6 { hop_limit: u8 },
}

impl Ttl {
    pub fn of_v4(ip: &Ipv4) -> Self {
        Ttl::V4 {
            ttl: ip.ttl,
            proto: ip.proto,
            csum: ip.csum,
        }
    }

    pub fn of_v6(ip: &Ipv6) -> Self {
        Ttl::V6 {
            hop_limit: ip.hop_limit,
        }
    }
}

/// Decrements the TTL (IPv4, with the header checksum updated incrementally: RFC 1624) or the
/// hop limit (IPv6) as forwarding does, in one store; `false` if it would expire (the host
/// stack then sends the ICMP error).
#[inline(always)]
fn dec_ttl(ctx: &mut TcContext, t: Ttl) -> Result<bool, c_long> {
    match t {
        Ttl::V4 { ttl, proto, csum } => {
            if ttl <= 1 {
                return Ok(false);
            }
            // TTL and protocol form one 16-bit word of the checksum: HC' = ~(~HC + ~m + m').
            let m = u16::from_be_bytes([ttl, proto]);
            let m2 = u16::from_be_bytes([ttl - 1, proto]);
            let hc = u16::from_be_bytes(csum);
            let mut sum = u32::from(!hc) + u32::from(!m) + u32::from(m2);
            sum = (sum & 0xffff) + (sum >> 16);
            sum = (sum & 0xffff) + (sum >> 16);
            let new = (!(sum as u16)).to_be_bytes();
            packet::store(ctx, v4::TTL, &[ttl - 1, proto, new[0], new[1]])?;
            Ok(true)
        }
        Ttl::V6 { hop_limit } => {
            if hop_limit <= 1 {
                return Ok(false);
            }
            packet::store(ctx, v6::HOP_LIMIT, &(hop_limit - 1))?;
            Ok(true)
        }
    }
}

/// Writes the Ethernet destination and source.
#[inline(always)]
fn set_macs(ctx: &mut TcContext, dst: &[u8; 6], src: &[u8; 6]) -> Result<(), c_long> {
    let p = packet::linear(ctx, 12).ok_or(-1)? as *mut u8;
    for i in 0..6 {
        // SAFETY: the first 12 bytes lie in the linear data (`linear`), made writable by the
        // kernel before the program ran.
        unsafe {
            *p.add(i) = dst[i];
            *p.add(6 + i) = src[i];
        }
    }
    Ok(())
}

/// What the sender's side already settled of a frame for a pod on this node, in one word (it
/// lives across the helper calls between the sender's verdict and the delivery: one stack
/// slot, not one per field).
#[derive(Clone, Copy)]
pub struct Sent(u32);

impl Sent {
    /// The sender's egress verdict on this very packet left its flow in the policy scratch
    /// (`policy::ALLOW_READ`).
    const READ: u32 = 1;
    /// Both verdicts are settled (no endpoint isolated, the pair cache passed it, or the
    /// sender's verdict settled the receiver's too: `policy::ALLOW_BOTH`).
    const PASSED: u32 = 2;
    /// The pair cache allows every TCP packet between the two (`calix_common::PS_PAIR` for
    /// the receiver's verdict).
    const PAIR: u32 = 4;
    /// The pair cache is to learn this pair once the packet passes; the sender's slot in the
    /// upper 16 bits.
    const LEARN: u32 = 8;
    /// The pair's entry is current: a SYN may take its rules from the SYN memo
    /// (`calix_common::PS_PEER` for the receiver's verdict); the sender's slot in the upper
    /// 16 bits.
    const KNOWN: u32 = 16;

    /// A frame from anywhere but a pod of this node's own fast path.
    pub const NOTHING: Self = Self(0);
    /// Both verdicts settled.
    pub const PASSED_BOTH: Self = Self(Self::PASSED);

    /// After the sender's egress verdict (`read`: it left the flow in the scratch), with what
    /// the pair cache said of the sender in `slot` and the receiver.
    #[inline(always)]
    pub fn judged(read: bool, pair: Pair, slot: u32) -> Self {
        let w = if read { Self::READ } else { 0 };
        let pair = match pair {
            Pair::Allowed | Pair::Recorded => Self::PAIR | Self::KNOWN,
            Pair::Checked => Self::KNOWN,
            Pair::Stale => Self::LEARN,
            Pair::Unasked | Pair::Open => return Self(w),
        };
        Self(w | pair | (slot << 16))
    }

    #[inline(always)]
    fn has(self, bit: u32) -> bool {
        self.0 & bit != 0
    }

    /// `PS_*` bits for the receiver's verdict.
    #[inline(always)]
    fn extra(self) -> u32 {
        let pair = if self.has(Self::PAIR) { PS_PAIR } else { 0 };
        let known = if self.has(Self::KNOWN) { PS_PEER } else { 0 };
        if self.0 & (Self::KNOWN | Self::LEARN) != 0 {
            pair | known | PS_LOCAL | ((self.0 >> 16) << PS_PEER_SHIFT)
        } else {
            pair
        }
    }

    /// The sender's slot, when the pair cache is to learn the pair.
    #[inline(always)]
    fn learn(self) -> Option<u32> {
        self.has(Self::LEARN).then_some(self.0 >> 16)
    }
}

/// Delivers the frame straight into the pod behind `ep` (its veth peer's ingress).
#[inline(always)]
pub fn to_local(
    ctx: &mut TcContext,
    ep: &LocalEndpoint,
    t: Ttl,
    sent: Sent,
) -> Result<i32, c_long> {
    if !dec_ttl(ctx, t)? {
        return Ok(TC_ACT_OK);
    }
    deliver(ctx, ep, sent)
}

/// As [`to_local`] for a packet whose TTL the caller already decremented. The pod's ingress
/// policy first: this path skips its veth's `to_pod`.
#[inline(always)]
pub fn deliver_local(ctx: &mut TcContext, ep: &LocalEndpoint) -> Result<i32, c_long> {
    deliver(ctx, ep, Sent::NOTHING)
}

#[inline(always)]
fn deliver(ctx: &mut TcContext, ep: &LocalEndpoint, sent: Sent) -> Result<i32, c_long> {
    let allowed = sent.has(Sent::PASSED)
        || !policy::isolated(ep.slot)
        || if sent.has(Sent::READ) {
            policy::ingress_of_sent(ep.slot, sent.extra())
        } else {
            policy::ingress(ctx.skb.skb, ep.slot, sent.extra())
        };
    if !allowed {
        policy::report_denied(ep.slot, calix_common::POL_DIR_INGRESS);
        return Ok(counters::drop(ctx, ep.ifindex, DropReason::PolicyIngress));
    }
    if let Some(from) = sent.learn() {
        policy::learn_pair(ctx.skb.skb, from, ep.slot);
    }
    set_macs(ctx, &ep.mac, &HOST_VETH_MAC)?;
    counters::to_pod(ep.slot, u64::from(ctx.len()));
    // SAFETY: a plain helper call; the kernel validates the ifindex.
    Ok(unsafe { bpf_redirect_peer(ep.ifindex, 0) } as i32)
}

/// Looks the destination up in the kernel's FIB and sends the frame out of the resulting
/// interface; anything the FIB cannot settle (local delivery, no route, blackhole...) goes to
/// the host stack.
#[inline(always)]
fn via_fib(ctx: &mut TcContext, p: &mut FibParams, t: Ttl) -> Result<i32, c_long> {
    // SAFETY: `p` is a valid, initialised bpf_fib_lookup and the size matches.
    let rc = unsafe { bpf_fib_lookup(ctx.skb.skb as *mut _, p, size_of::<FibParams>() as i32, 0) };
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Ok(TC_ACT_OK);
    }
    if !dec_ttl(ctx, t)? {
        return Ok(TC_ACT_OK);
    }
    // Tell `to_host_dev` this packet took the fast path (it records only stack-routed flows).
    ctx.set_mark(calix_common::FAST_PATH_MARK);
    if rc == BPF_FIB_LKUP_RET_SUCCESS {
        set_macs(ctx, &p.dmac, &p.smac)?;
        // SAFETY: a plain helper call.
        return Ok(unsafe { bpf_redirect(p.ifindex, 0) } as i32);
    }
    // No neighbour entry yet: let the kernel resolve it and fill in the addresses.
    // SAFETY: a plain helper call; a null neighbour means "use the FIB's next hop".
    Ok(unsafe { bpf_redirect_neigh(p.ifindex, core::ptr::null_mut(), 0, 0) } as i32)
}

/// Room on the stack for the FIB lookup's parameters, 8-byte aligned so that they are zeroed
/// in eight 8-byte stores: `core::mem::zeroed()` of the 64-byte struct compiles to a call of
/// the byte-wise `memset` (64 iterations of a loop, on every packet to another node).
#[repr(C, align(8))]
pub struct FibBuf(MaybeUninit<FibParams>);

impl FibBuf {
    /// Room for parameters, filled in by [`fib_params_v4`] (or zeroed first by this module).
    #[inline(always)]
    pub fn uninit() -> Self {
        Self(MaybeUninit::uninit())
    }

    /// The parameters, all zero (their documented initial state).
    #[inline(always)]
    fn zeroed(&mut self) -> &mut FibParams {
        const _: () = assert!(size_of::<FibBuf>() == size_of::<FibParams>());
        // SAFETY: a reference to the buffer (8-byte aligned by its type), no more than the
        // parameters (checked above).
        unsafe { packet::zero_words(self) };
        // SAFETY: every byte was just written; bpf_fib_lookup is plain data (integers,
        // arrays, unions of integers), for which all-zero is a valid value.
        unsafe { self.0.assume_init_mut() }
    }
}

/// The FIB lookup parameters of an IPv4 packet arriving on `ifindex`. `tot_len` stays 0: the
/// kernel then checks the skb itself against the egress device's MTU, which a GSO packet (TCP
/// from a pod: one frame of many segments, cut at the egress) passes; its IP header's length
/// would not, and every such packet would take the host stack.
#[inline(always)]
pub fn fib_params_v4<'a>(buf: &'a mut FibBuf, ip: &Ipv4, ifindex: u32) -> &'a mut FibParams {
    let p = buf.zeroed();
    p.family = AF_INET;
    p.l4_protocol = ip.proto;
    p.ifindex = ifindex;
    p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(ip.src);
    p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(ip.dst);
    p
}

/// IPv4 to another node.
#[inline(always)]
pub fn remote_v4(ctx: &mut TcContext, ip: &Ipv4, ifindex: u32) -> Result<i32, c_long> {
    let mut buf = FibBuf::uninit();
    via_fib(ctx, fib_params_v4(&mut buf, ip, ifindex), Ttl::of_v4(ip))
}

/// IPv6 to another node (`tot_len` 0, as in [`fib_params_v4`]).
#[inline(always)]
pub fn remote_v6(ctx: &mut TcContext, ip: &Ipv6, ifindex: u32) -> Result<i32, c_long> {
    let mut buf = FibBuf::uninit();
    let p = buf.zeroed();
    p.family = AF_INET6;
    p.l4_protocol = ip.next_hdr;
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
    via_fib(ctx, p, Ttl::of_v6(ip))
}
