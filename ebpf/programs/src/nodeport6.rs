//! Services for clients outside the cluster over IPv6, per packet: what `nodeport` does for
//! IPv4 (a NodePort at one of this node's IPv6 addresses, an external or LoadBalancer IPv6
//! address), the same way: a TCP SYN or a UDP datagram picks a backend (`nodeport::pick`: the
//! frontend's Maglev table), the flow is remembered both ways, a backend here gets the packet
//! straight into its pod with the client's address and its replies leave from the frontend by
//! the client's interface, one on another node is reached through the host stack, marked for
//! its masquerade (`ip6 calix-services`), its replies translated back in `to_host_dev`.
//!
//! No extension headers: a packet with any (and every fragment) is the host stack's. IPv6
//! has no header checksum; the pseudo-header's address changes the transport checksum a
//! 32-bit word at a time.
//!
//! Lean on the stack: the callers' frames (`from_pod`, `from_host_dev`) leave about 100
//! bytes, and an IPv6 address is 16. The addresses go from the packet straight into this CPU's
//! scratch entry and are used from there; nothing of 16 bytes is copied onto the stack.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK},
    cty::c_long,
    programs::TcContext,
};
use calix_common::{
    svc_client_hash6, LocalEndpoint, SvcFlowKey, SvcScratch, SVC_EXTERNAL, SVC_FLOW_IN,
    SVC_FLOW_OUT, SVC_MASQ_MARK, SVC_V6,
};

use crate::maps::{CALIX_LOCAL_V6, CALIX_SVC_FLOWS};
use crate::nodeport::{
    count_front, out_by, pick, ports_at, scratch, Ports, CHOSEN, DROP, NOT_OURS_VERDICT,
    NO_LOCAL_ENDPOINT, TCP_ACK, TCP_SYN, TO_LOCAL,
};
use crate::packet::{self, Ipv6, ETH_HLEN, IPPROTO_TCP, IPPROTO_UDP};

/// Offsets in the frame of the IPv6 header's source and destination, and of the transport
/// header (no extension headers).
const IP6_SRC: usize = ETH_HLEN + 8;
const IP6_DST: usize = ETH_HLEN + 24;
const L4: usize = ETH_HLEN + packet::v6::LEN;

/// What this path needs of an IPv6 header, by value: 4 bytes in a register (a reference to
/// the caller's `Ipv6` would put its 40 bytes on the caller's stack).
#[derive(Clone, Copy)]
pub struct Head {
    next_hdr: u8,
    hop_limit: u8,
    payload_len: u16,
}

impl Head {
    #[inline(always)]
    pub fn of(ip: &Ipv6) -> Self {
        Self {
            next_hdr: ip.next_hdr,
            hop_limit: ip.hop_limit,
            payload_len: ip.payload_len,
        }
    }
}

/// TCP or UDP ports (network byte order) of a packet whose next header is TCP or UDP; `None`
/// for anything else (extension headers, fragments: the stack's).
#[inline(always)]
fn ports(ctx: &TcContext, ip: Head) -> Option<Ports> {
    ports_at(ctx, ip.next_hdr, L4, usize::from(ip.payload_len))
}

/// Copies 16 bytes from `from` to `to` (no stack: loads and stores).
#[inline(always)]
fn copy16(to: *mut [u8; 16], from: *const [u8; 16]) {
    // SAFETY: both point at 16 bytes the verifier checks (the packet's linear data, a map
    // entry); they never overlap.
    unsafe { core::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, 16) }
}

/// The packet's flow key in direction `dir` (its source → its destination) in `k`, its
/// addresses straight from the packet.
#[inline(always)]
fn load_key(ctx: &TcContext, k: *mut SvcFlowKey, proto: u8, dir: u8, p: &Ports) -> Option<()> {
    let base = packet::linear(ctx, ETH_HLEN + packet::v6::LEN)?;
    // SAFETY: the header lies in the linear data (`linear`); `k` is in this CPU's scratch
    // entry, which nothing else uses meanwhile.
    unsafe {
        copy16(&mut (*k).a, (base + IP6_SRC) as *const [u8; 16]);
        copy16(&mut (*k).b, (base + IP6_DST) as *const [u8; 16]);
        (*k).a_port = p.sport;
        (*k).b_port = p.dport;
        (*k).proto = proto;
        (*k).family = SVC_V6;
        (*k).dir = dir;
        (*k)._pad = 0;
    }
    Some(())
}

/// `from_host_dev`: a packet from outside to an external IPv6 frontend goes to its backend.
/// As `nodeport::from_outside_v4`: [`NOT_OURS_VERDICT`], [`TO_LOCAL`] (the caller finds the
/// endpoint with [`local_dst`]), [`NO_LOCAL_ENDPOINT`] or a tc verdict.
#[inline(always)]
pub fn from_outside(ctx: &mut TcContext, ip: Head) -> Result<i32, c_long> {
    match choose(ctx, ip)? {
        CHOSEN => translate(ctx, ip),
        other => Ok(other),
    }
}

/// The flow's backend, held or chosen now, in this CPU's `(*scratch).flow`: [`CHOSEN`],
/// [`NOT_OURS_VERDICT`] or [`NO_LOCAL_ENDPOINT`].
#[inline(never)]
fn choose(ctx: &TcContext, ip: Head) -> Result<i32, c_long> {
    // A hop limit about to expire: the stack sends the ICMP error.
    if ip.hop_limit <= 1 {
        return Ok(NOT_OURS_VERDICT);
    }
    let (Some(p), Some(s)) = (ports(ctx, ip), scratch()) else {
        return Ok(NOT_OURS_VERDICT);
    };
    let proto = ip.next_hdr;
    // SAFETY: `s` is this CPU's scratch entry; the maps' values are read in place.
    unsafe {
        if load_key(ctx, &mut (*s).key, proto, SVC_FLOW_IN, &p).is_none() {
            return Ok(NOT_OURS_VERDICT);
        }
        // A TCP SYN begins a connection anew (as for IPv4).
        let syn = proto == IPPROTO_TCP && p.flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
        if !syn {
            if let Some(f) = CALIX_SVC_FLOWS.get_ptr(&(*s).key) {
                // As in `reply_of`.
                packet::copy_words(&mut (*s).flow, f);
                return Ok(CHOSEN);
            }
        }
        let fk = &mut (*s).front;
        copy16(&mut fk.addr, &(*s).key.b);
        fk.port = p.dport;
        fk.proto = proto;
        fk.family = SVC_V6 | SVC_EXTERNAL;
        let client: *const [u8; 16] = &(*s).key.a;
        let b = match pick(
            s,
            proto,
            p.flags,
            |sport| svc_client_hash6(&*client, sport),
            p.sport,
        ) {
            Ok(b) => b,
            Err(DROP) => return Ok(NO_LOCAL_ENDPOINT),
            Err(_) => return Ok(NOT_OURS_VERDICT),
        };
        // To the backend; its replies, from the frontend by the client's interface.
        copy16(&mut (*s).flow.addr, &(*b).addr);
        (*s).flow.port = (*b).port;
        (*s).flow.remote = u8::from(CALIX_LOCAL_V6.get_ptr(&(*b).addr).is_none());
        (*s).flow._pad = 0;
        (*s).flow.ifindex = 0;
        copy16(&mut (*s).back.addr, &(*s).key.b);
        (*s).back.port = p.dport;
        (*s).back.remote = 0;
        (*s).back._pad = 0;
        (*s).back.ifindex = (*ctx.skb.skb).ifindex;
        let bk = &mut (*s).back_key;
        copy16(&mut bk.a, &(*b).addr);
        copy16(&mut bk.b, &(*s).key.a);
        bk.a_port = (*b).port;
        bk.b_port = p.sport;
        bk.proto = proto;
        bk.family = SVC_V6;
        bk.dir = SVC_FLOW_OUT;
        bk._pad = 0;
        CALIX_SVC_FLOWS.insert(&(*s).key, &(*s).flow, 0)?;
        CALIX_SVC_FLOWS.insert(&(*s).back_key, &(*s).back, 0)?;
    }
    count_front(s, true);
    Ok(CHOSEN)
}

/// The packet to the backend [`choose`] left in the scratch: [`TO_LOCAL`], or on to the host
/// stack marked for its masquerade (a backend on another node).
#[inline(never)]
fn translate(ctx: &mut TcContext, ip: Head) -> Result<i32, c_long> {
    let (Some(p), Some(s)) = (ports(ctx, ip), scratch()) else {
        return Ok(NOT_OURS_VERDICT);
    };
    // SAFETY: `s` is this CPU's scratch entry, which `choose` just wrote: the key's `b` is
    // the packet's destination (the frontend), the flow's address the backend's.
    unsafe {
        let (front, backend) = (&(*s).key.b, &(*s).flow.addr);
        rewrite(
            ctx,
            ip.next_hdr,
            &p,
            false,
            (front, p.dport),
            (backend, (*s).flow.port),
        )?;
        if CALIX_LOCAL_V6.get_ptr(backend).is_some() {
            return Ok(TO_LOCAL);
        }
    }
    ctx.set_mark(SVC_MASQ_MARK);
    Ok(TC_ACT_OK)
}

/// The local endpoint [`from_outside`] translated the packet to ([`TO_LOCAL`]).
#[inline(never)]
pub fn local_dst(ctx: &TcContext) -> Option<*const LocalEndpoint> {
    let dst: [u8; 16] = packet::load(ctx, IP6_DST).ok()?;
    CALIX_LOCAL_V6.get_ptr(&dst)
}

/// The source (`src`) or destination address and port replaced, with the transport checksum
/// (a UDP zero checksum stays zero). The hop limit is left alone.
#[inline(always)]
fn rewrite(
    ctx: &mut TcContext,
    proto: u8,
    p: &Ports,
    src: bool,
    old: (*const [u8; 16], u16),
    new: (*const [u8; 16], u16),
) -> Result<(), c_long> {
    let l4 = usize::from(p.l4);
    let csum_off = usize::from(p.csum_off);
    let mangled = if proto == IPPROTO_UDP {
        u64::from(BPF_F_MARK_MANGLED_0)
    } else {
        0
    };
    let word = |a: *const [u8; 16], i: usize| -> u64 {
        // SAFETY: `a` points at 16 bytes (see `copy16`); `i` < 4.
        u64::from(unsafe { core::ptr::read_unaligned((a as *const u32).add(i)) })
    };
    for i in 0..4 {
        ctx.l4_csum_replace(
            csum_off,
            word(old.0, i),
            word(new.0, i),
            mangled | u64::from(BPF_F_PSEUDO_HDR) | 4,
        )?;
    }
    ctx.l4_csum_replace(csum_off, u64::from(old.1), u64::from(new.1), mangled | 2)?;
    ctx.store(if src { l4 } else { l4 + 2 }, &new.1, 0)?;
    // SAFETY: `new.0` points at 16 bytes in a map entry, read by the helper.
    ctx.store(if src { IP6_SRC } else { IP6_DST }, unsafe { &*new.0 }, 0)
}

/// Whether the packet is a backend's reply to a client outside: its frontend and the
/// client's interface in this CPU's `(*scratch).back`, the packet's flow key (backend →
/// client) in `(*scratch).key`.
#[inline(always)]
fn reply_of(ctx: &TcContext, ip: Head, p: &Ports) -> Option<*mut SvcScratch> {
    let s = scratch()?;
    // SAFETY: `s` is this CPU's scratch entry; the flow's value is copied in place.
    unsafe {
        load_key(ctx, &mut (*s).key, ip.next_hdr, SVC_FLOW_OUT, p)?;
        // Word by word: a struct copy compiles to a call of the byte-wise `memmove`.
        packet::copy_words(&mut (*s).back, CALIX_SVC_FLOWS.get_ptr(&(*s).key)?);
    }
    Some(s)
}

/// A backend's reply, `s` from [`reply_of`]: its source (the backend's address and port)
/// replaced by the frontend's.
#[inline(always)]
fn rewrite_reply(
    ctx: &mut TcContext,
    ip: Head,
    p: &Ports,
    s: *mut SvcScratch,
) -> Result<(), c_long> {
    // SAFETY: `s` is this CPU's scratch entry, which `reply_of` just wrote.
    unsafe {
        let (backend, front) = (&(*s).key.a, &(*s).back.addr);
        rewrite(
            ctx,
            ip.next_hdr,
            p,
            true,
            (backend, p.sport),
            (front, (*s).back.port),
        )
    }
}

/// `from_pod`: a local backend's reply to a client outside leaves from the frontend, by the
/// interface the client's packets came in on (as `nodeport::reply_from_pod_v4`). `None`: not
/// such a reply.
#[inline(never)]
pub fn reply_from_pod(ctx: &mut TcContext, ip: Head) -> Result<Option<i32>, c_long> {
    // A hop limit about to expire: the stack sends the ICMP error.
    if ip.hop_limit <= 1 {
        return Ok(None);
    }
    let Some(p) = ports(ctx, ip) else {
        return Ok(None);
    };
    let Some(s) = reply_of(ctx, ip, &p) else {
        return Ok(None);
    };
    rewrite_reply(ctx, ip, &p, s)?;
    // SAFETY: `s` is this CPU's scratch entry, which `reply_of` just wrote.
    let ifindex = unsafe { (*s).back.ifindex };
    ctx.store(packet::v6::HOP_LIMIT, &(ip.hop_limit - 1), 0)?;
    Ok(Some(out_by(ctx, ifindex)))
}

/// `to_host_dev`: a remote backend's reply, which the host stack took back from its
/// masquerade and routed out to the client, leaves from the frontend.
#[inline(never)]
pub fn reply_after_stack(ctx: &mut TcContext, ip: Head) -> Result<(), c_long> {
    let Some(p) = ports(ctx, ip) else {
        return Ok(());
    };
    if let Some(s) = reply_of(ctx, ip, &p) {
        rewrite_reply(ctx, ip, &p, s)?;
    }
    Ok(())
}
