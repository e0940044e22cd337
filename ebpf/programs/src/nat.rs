//! SNAT (masquerade) for pods of `natOutgoing` pools, without the host stack either way.
//!
//! `from_pod` (through [`snat_v4`]): IPv4 TCP, UDP and ICMP echo requests from such a pod to a
//! destination outside `CALIX_NO_SNAT_V4` (pools, `non_masquerade_cidrs`) that the FIB routes
//! out of an uplink leave with the route's source address (`BPF_FIB_LOOKUP_SRC`) and a NAT
//! port from `conntrack`, straight out of the uplink (`bpf_redirect` / `bpf_redirect_neigh`).
//! `from_host_dev` (through [`reverse_v4`]): replies, and ICMP errors quoting a translated
//! packet, are translated back and delivered into the pod (`bpf_redirect_peer`).
//! Fragments, other protocols and other ICMP types continue into the host stack untranslated,
//! as does anything the FIB cannot settle or routes elsewhere than an uplink.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, BPF_FIB_LOOKUP_SRC, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR,
        TC_ACT_OK,
    },
    cty::c_long,
    cty::c_void,
    helpers::{bpf_fib_lookup, bpf_ktime_get_ns, bpf_loop, bpf_redirect, bpf_redirect_neigh},
    maps::lpm_trie::Key,
    programs::TcContext,
};
use calix_common::{
    CtEntry, CtKey, DropReason, NatConfig, CT_DIR_OUT, CT_DIR_REPLY, IPPROTO_TCP, IPPROTO_UDP,
};

use crate::conntrack::{self, TcpSeg, TCP_ACK, TCP_SYN};
use crate::counters::drop;
use crate::flows;
use crate::forward::{self, Ttl};
use crate::maps::{CALIX_CT, CALIX_LOCAL_V4, CALIX_NO_SNAT_V4};
use crate::packet::{Ipv4, ETH_HLEN, IPPROTO_ICMP};

const BPF_FIB_LKUP_RET_SUCCESS: c_long = 0;
const BPF_FIB_LKUP_RET_NO_NEIGH: c_long = 7;
/// Offsets in the IPv4 header.
const IP_CSUM: usize = 10;
const IP_SRC: usize = 12;
const IP_DST: usize = 16;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_ECHO: u8 = 8;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;

/// The transport fields NAT reads and rewrites.
struct Transport {
    /// Ports (ICMP echo: the identifier twice), as in the packet.
    sport: u16,
    dport: u16,
    /// Offset of the port (or identifier) on the pod's side of the flow.
    port_off: usize,
    /// Offset of the transport checksum.
    csum_off: usize,
    tcp_flags: u8,
    /// TCP: what conntrack tracks (zero for other protocols).
    tcp: TcpSeg,
}

/// TCP option kinds.
const TCPOPT_EOL: u8 = 0;
const TCPOPT_NOP: u8 = 1;
const TCPOPT_WSCALE: u8 = 3;
/// The most TCP options there can be (a 60-byte header).
const TCP_MAX_OPTS: usize = 40;

/// The window scale option of the TCP header at `l4` (`hlen` bytes, options included).
#[inline(always)]
fn wscale_option(ctx: &TcContext, l4: usize, hlen: usize) -> Option<u8> {
    let opts = hlen.checked_sub(20)?;
    if opts == 0 || opts > TCP_MAX_OPTS {
        return None;
    }
    // The 40 bytes that end where the options end (they begin inside the IPv4 header when
    // there are fewer options): one load of a fixed size.
    let mut walk = OptWalk {
        buf: ctx.load(l4 + hlen - TCP_MAX_OPTS).ok()?,
        at: (TCP_MAX_OPTS - opts) as u32,
        found: 0,
    };
    // bpf_loop: the verifier checks the step once, not once per option.
    // SAFETY: `opt_step` has bpf_loop's callback signature and reads `walk` only as
    // `OptWalk`; `walk` outlives the call.
    unsafe {
        bpf_loop(
            TCP_MAX_OPTS as u32,
            opt_step as *mut c_void,
            &mut walk as *mut OptWalk as *mut c_void,
            0,
        )
    };
    walk.found.checked_sub(1).map(|w| w as u8)
}

/// The state of a walk over TCP options.
#[repr(C)]
struct OptWalk {
    buf: [u8; TCP_MAX_OPTS],
    /// Offset of the next option in `buf`.
    at: u32,
    /// 1 + the window scale, once found.
    found: u32,
}

/// One option of an [`OptWalk`] (a bpf_loop callback): 0 goes on, 1 stops.
#[inline(never)]
extern "C" fn opt_step(_index: u64, walk: *mut c_void) -> c_long {
    // SAFETY: bpf_loop passes back the `OptWalk` `wscale_option` gave it.
    let w = unsafe { &mut *(walk as *mut OptWalk) };
    let at = w.at as usize;
    let (Some(&kind), len) = (w.buf.get(at), w.buf.get(at + 1).copied()) else {
        return 1;
    };
    match (kind, len) {
        (TCPOPT_EOL, _) | (_, None) => 1,
        (TCPOPT_NOP, _) => {
            w.at += 1;
            0
        }
        (TCPOPT_WSCALE, Some(3)) => {
            w.found = w.buf.get(at + 2).map_or(0, |s| u32::from(*s) + 1);
            1
        }
        (_, Some(len)) if len >= 2 => {
            w.at += u32::from(len);
            0
        }
        _ => 1,
    }
}

/// Reads the transport header at `l4` (`l4_len` bytes of IP payload). `from_pod`: TCP, UDP,
/// ICMP echo requests (the pod's port is the source); else TCP, UDP, ICMP echo replies (the
/// pod's port is the destination). `None` for anything else.
#[inline(always)]
fn transport(
    ctx: &TcContext,
    l4: usize,
    l4_len: usize,
    proto: u8,
    from_pod: bool,
) -> Option<Transport> {
    let side = if from_pod { 0 } else { 2 };
    match proto {
        IPPROTO_TCP => {
            if l4_len < 20 {
                return None;
            }
            let h: [u8; 16] = ctx.load(l4).ok()?;
            let hlen = usize::from(h[12] >> 4) * 4;
            if hlen < 20 || hlen > l4_len {
                return None;
            }
            let flags = h[13];
            let tcp = TcpSeg {
                seq: u32::from_be_bytes([h[4], h[5], h[6], h[7]]),
                ack: u32::from_be_bytes([h[8], h[9], h[10], h[11]]),
                flags,
                win: u16::from_be_bytes([h[14], h[15]]),
                len: (l4_len - hlen) as u32,
                wscale: if flags & TCP_SYN != 0 {
                    wscale_option(ctx, l4, hlen)
                } else {
                    None
                },
            };
            Some(Transport {
                sport: u16::from_ne_bytes([h[0], h[1]]),
                dport: u16::from_ne_bytes([h[2], h[3]]),
                port_off: l4 + side,
                csum_off: l4 + 16,
                tcp_flags: flags,
                tcp,
            })
        }
        IPPROTO_UDP => {
            if l4_len < 8 {
                return None;
            }
            let h: [u8; 4] = ctx.load(l4).ok()?;
            Some(Transport {
                sport: u16::from_ne_bytes([h[0], h[1]]),
                dport: u16::from_ne_bytes([h[2], h[3]]),
                port_off: l4 + side,
                csum_off: l4 + 6,
                tcp_flags: 0,
                tcp: TcpSeg::default(),
            })
        }
        IPPROTO_ICMP => {
            if l4_len < 8 {
                return None;
            }
            let h: [u8; 8] = ctx.load(l4).ok()?;
            let want = if from_pod { ICMP_ECHO } else { ICMP_ECHO_REPLY };
            if h[0] != want || h[1] != 0 {
                return None;
            }
            let id = u16::from_ne_bytes([h[4], h[5]]);
            Some(Transport {
                sport: id,
                dport: id,
                port_off: l4 + 4,
                csum_off: l4 + 2,
                tcp_flags: 0,
                tcp: TcpSeg::default(),
            })
        }
        _ => None,
    }
}

/// Rewrites the port at `t.port_off` and fixes the transport checksum for it and for the
/// address change in the pseudo header (TCP/UDP; a UDP zero checksum stays zero; ICMP: no
/// pseudo header). The kernel helpers keep CHECKSUM_PARTIAL and CHECKSUM_COMPLETE packets
/// right, which a checksum computed here could not.
#[inline(always)]
fn rewrite_l4(
    ctx: &mut TcContext,
    proto: u8,
    t: &Transport,
    old: ([u8; 4], u16),
    new: ([u8; 4], u16),
) -> Result<(), c_long> {
    let (old_a, new_a) = (
        u64::from(u32::from_ne_bytes(old.0)),
        u64::from(u32::from_ne_bytes(new.0)),
    );
    let (old_p, new_p) = (u64::from(old.1), u64::from(new.1));
    let flags = match proto {
        IPPROTO_TCP => 0,
        IPPROTO_UDP => u64::from(BPF_F_MARK_MANGLED_0),
        _ => {
            ctx.store(t.port_off, &new.1, 0)?;
            return ctx.l4_csum_replace(t.csum_off, old_p, new_p, 2);
        }
    };
    ctx.l4_csum_replace(
        t.csum_off,
        old_a,
        new_a,
        flags | u64::from(BPF_F_PSEUDO_HDR) | 4,
    )?;
    ctx.store(t.port_off, &new.1, 0)?;
    ctx.l4_csum_replace(t.csum_off, old_p, new_p, flags | 2)
}

/// The IPv4 header checksum after 16-bit words `old` became `new` (RFC 1624:
/// HC' = ~(~HC + ~m + m')).
#[inline(always)]
fn ip_csum(csum: [u8; 2], old: &[u8; 6], new: &[u8; 6]) -> [u8; 2] {
    let mut sum = u32::from(!u16::from_be_bytes(csum));
    let mut i = 0;
    while i < 6 {
        sum += u32::from(!u16::from_be_bytes([old[i], old[i + 1]]));
        sum += u32::from(u16::from_be_bytes([new[i], new[i + 1]]));
        i += 2;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    (!(sum as u16)).to_be_bytes()
}

/// Forwarding's TTL decrement (the caller checked TTL > 1) and the source (`src`) or
/// destination address replaced by `addr`, with the header checksum, in one store of the
/// header from the TTL to the destination address.
#[inline(always)]
fn rewrite_ip(ctx: &mut TcContext, ip: &Ipv4, src: bool, addr: [u8; 4]) -> Result<(), c_long> {
    let old_addr = if src { ip.src } else { ip.dst };
    let old = [
        ip.ttl,
        ip.proto,
        old_addr[0],
        old_addr[1],
        old_addr[2],
        old_addr[3],
    ];
    let new = [ip.ttl - 1, ip.proto, addr[0], addr[1], addr[2], addr[3]];
    let csum = ip_csum(ip.csum, &old, &new);
    let (s, d) = if src { (addr, ip.dst) } else { (ip.src, addr) };
    let h = [
        ip.ttl - 1,
        ip.proto,
        csum[0],
        csum[1],
        s[0],
        s[1],
        s[2],
        s[3],
        d[0],
        d[1],
        d[2],
        d[3],
    ];
    crate::packet::store(ctx, ETH_HLEN + 8, &h)
}

/// A route out of an uplink, from the FIB or from a flow's cache.
struct Route {
    ifindex: u32,
    /// Destination then source MAC; `None`: no neighbour entry yet.
    macs: Option<[u8; 12]>,
}

/// How long an established flow reuses its cached route before asking the FIB again.
const ROUTE_CACHE_NS: u64 = 1_000_000_000;

/// The FIB's route for `ip` from the pod behind `ifindex` and its source address
/// (`BPF_FIB_LOOKUP_SRC`); `None` unless it leaves by an uplink.
#[inline(always)]
fn lookup_route(
    ctx: &TcContext,
    cfg: &NatConfig,
    ifindex: u32,
    ip: &Ipv4,
) -> Option<(Route, [u8; 4])> {
    let mut buf = forward::FibBuf::uninit();
    let p = forward::fib_params_v4(&mut buf, ip, ifindex);
    // SAFETY: `p` is a valid, initialised bpf_fib_lookup and the size matches.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            p,
            core::mem::size_of::<FibParams>() as i32,
            BPF_FIB_LOOKUP_SRC,
        )
    };
    if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
        || !conntrack::is_uplink(cfg, p.ifindex)
    {
        return None;
    }
    let macs = (rc == BPF_FIB_LKUP_RET_SUCCESS).then(|| {
        let mut m = [0u8; 12];
        m[..6].copy_from_slice(&p.dmac);
        m[6..].copy_from_slice(&p.smac);
        m
    });
    // SAFETY: the lookup filled in the IPv4 source (BPF_FIB_LOOKUP_SRC) of this union.
    let src = unsafe { p.__bindgen_anon_3.ipv4_src }.to_ne_bytes();
    Some((
        Route {
            ifindex: p.ifindex,
            macs,
        },
        src,
    ))
}

/// Remembers `r` on the flow's original entry `o` (only a complete route: with MACs).
#[inline(always)]
fn cache_route(o: *mut CtEntry, r: &Route, now: u64) {
    if let Some(m) = r.macs {
        // SAFETY: `o` comes from a successful lookup; a racing writer stores an equally
        // valid route.
        unsafe {
            (*o).route_ifindex = r.ifindex;
            (*o).route_macs = m;
            (*o).route_ns = now;
        }
    }
}

/// Translates the pod's packet to (`nat_addr`, `nat_port`) and sends it out along `r`.
#[inline(always)]
fn send_out(
    ctx: &mut TcContext,
    ip: &Ipv4,
    t: &Transport,
    nat: ([u8; 4], u16),
    r: &Route,
) -> Result<i32, c_long> {
    rewrite_l4(ctx, ip.proto, t, (ip.src, t.sport), nat)?;
    rewrite_ip(ctx, ip, true, nat.0)?;
    // Tell `to_host_dev` this packet took the fast path.
    ctx.set_mark(calix_common::FAST_PATH_MARK);
    if let Some(m) = r.macs {
        crate::packet::store(ctx, 0, &m)?;
        // SAFETY: a plain helper call.
        return Ok(unsafe { bpf_redirect(r.ifindex, 0) } as i32);
    }
    // SAFETY: a plain helper call; a null neighbour means "use the FIB's next hop".
    Ok(unsafe { bpf_redirect_neigh(r.ifindex, core::ptr::null_mut(), 0, 0) } as i32)
}

/// `from_pod`'s last branch for an endpoint of a `natOutgoing` pool: IPv4 to anything that is
/// neither a pod here nor in a pool.
///
/// A flow already in the conntrack table goes out as it began, like netfilter's NAT: its
/// destination was checked (`CALIX_NO_SNAT_V4`, the stack's own flows) when it began, and its
/// route is reused from the entry for up to [`ROUTE_CACHE_NS`]. Only a new flow pays the
/// exclusion lookup, the FIB and the port allocation.
#[inline(always)]
pub fn snat_v4(ctx: &mut TcContext, ifindex: u32, slot: u32, ip: &Ipv4) -> Result<i32, c_long> {
    let Some(cfg) = conntrack::config() else {
        return Ok(TC_ACT_OK);
    };
    // A TTL about to expire: the stack sends the ICMP error.
    if ip.fragment() || ip.ttl <= 1 {
        return Ok(TC_ACT_OK);
    }
    let l4 = ETH_HLEN + ip.ihl;
    let l4_len = usize::from(ip.tot_len).saturating_sub(ip.ihl);
    let Some(t) = transport(ctx, l4, l4_len, ip.proto, true) else {
        return Ok(TC_ACT_OK);
    };
    let out = CtKey {
        src: ip.src,
        dst: ip.dst,
        sport: t.sport,
        dport: t.dport,
        proto: ip.proto,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
    };
    let bits = conntrack::flag_bits(ip.proto, t.tcp_flags);
    // SAFETY: a plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(o) = CALIX_CT.get_ptr_mut(&out) {
        let syn = ip.proto == IPPROTO_TCP && t.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
        if !syn || conntrack::restart_tcp(&out, o, now) {
            if ip.proto == IPPROTO_TCP {
                if t.tcp.rst() && !conntrack::rst_in_window(o, conntrack::reply_of(&out, o), &t.tcp)
                {
                    return Ok(drop(ctx, ifindex, DropReason::ConntrackRstInvalid));
                }
                conntrack::track_tcp(o, &t.tcp);
            }
            conntrack::touch(o, bits, now);
            // SAFETY: a pointer from a successful lookup. The fields are read one by one: a
            // copy of the whole entry would cost the frame 64 bytes of the verifier's 512.
            let (nat, route_ns) = unsafe { (((*o).addr, (*o).port), (*o).route_ns) };
            if route_ns != 0 && now.wrapping_sub(route_ns) < ROUTE_CACHE_NS {
                // SAFETY: as above.
                let r = unsafe {
                    Route {
                        ifindex: (*o).route_ifindex,
                        macs: Some((*o).route_macs),
                    }
                };
                return send_out(ctx, ip, &t, nat, &r);
            }
            // The route may have moved off the uplinks: then the stack takes the packet.
            let Some((r, _)) = lookup_route(ctx, cfg, ifindex, ip) else {
                return Ok(TC_ACT_OK);
            };
            cache_route(o, &r, now);
            return send_out(ctx, ip, &t, nat, &r);
        }
    }
    // A new flow. Not one to the host's own NAT (`service_cidrs`) or one never translated
    // (pools, `non_masquerade_cidrs`); not a TCP SYN-ACK either: that answers a connection
    // from outside, which no SNAT may touch.
    if CALIX_NO_SNAT_V4.get(&Key::new(32, ip.dst)).is_some()
        || (ip.proto == IPPROTO_TCP && t.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK)
    {
        return Ok(TC_ACT_OK);
    }
    let Some((r, route_src)) = lookup_route(ctx, cfg, ifindex, ip) else {
        return Ok(TC_ACT_OK);
    };
    // The reply of a flow the stack delivered (a hostPort, a service): the stack must undo
    // its own NAT.
    if !flows::fast_path_ok(slot, flows::has_ports_v4(ip), || {
        flows::key_v4(ctx, ip, true)
    }) {
        return Ok(TC_ACT_OK);
    }
    let nat_port = match conntrack::allocate(cfg, &out, route_src, bits, ifindex, now) {
        Ok(port) => port,
        Err(reason) => return Ok(drop(ctx, ifindex, reason)),
    };
    if let Some(o) = CALIX_CT.get_ptr_mut(&out) {
        cache_route(o, &r, now);
        if ip.proto == IPPROTO_TCP {
            conntrack::track_tcp(o, &t.tcp);
        }
    }
    send_out(ctx, ip, &t, (route_src, nat_port), &r)
}

/// `from_host_dev`, IPv4: a reply of a translated flow (or an ICMP error about one) is
/// translated back and delivered into its pod. `None`: not ours, carry on.
#[inline(always)]
pub fn reverse_v4(ctx: &mut TcContext, ip: &Ipv4) -> Result<Option<i32>, c_long> {
    let Some(cfg) = conntrack::config() else {
        return Ok(None);
    };
    // A TTL about to expire: the stack sends the ICMP error.
    if ip.fragment() || ip.ttl <= 1 {
        return Ok(None);
    }
    let l4 = ETH_HLEN + ip.ihl;
    let l4_len = usize::from(ip.tot_len).saturating_sub(ip.ihl);
    if ip.proto == IPPROTO_ICMP {
        let ty: u8 = ctx.load(l4).unwrap_or(ICMP_ECHO_REPLY);
        if matches!(
            ty,
            ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
        ) {
            return icmp_error(ctx, ip, l4, l4_len);
        }
    }
    let Some(t) = transport(ctx, l4, l4_len, ip.proto, false) else {
        return Ok(None);
    };
    // Only the NAT port range can be ours: skip the lookup for everything else.
    let port = u16::from_be(t.dport);
    if port < cfg.port_min || port > cfg.port_max {
        return Ok(None);
    }
    let rkey = CtKey {
        src: ip.src,
        dst: ip.dst,
        sport: t.sport,
        dport: t.dport,
        proto: ip.proto,
        dir: CT_DIR_REPLY,
        _pad: [0; 2],
    };
    let Some(r) = CALIX_CT.get_ptr_mut(&rkey) else {
        return Ok(None);
    };
    // SAFETY: a pointer from a successful lookup.
    let (pod, pod_port) = unsafe { ((*r).addr, (*r).port) };
    let Some(local) = CALIX_LOCAL_V4.get_ptr(&pod) else {
        return Ok(None);
    };
    // SAFETY: as above.
    let local = unsafe { *local };
    // SAFETY: a plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if ip.proto == IPPROTO_TCP {
        if t.tcp.rst() && !conntrack::rst_in_window(r, conntrack::out_of(&rkey, r), &t.tcp) {
            // SAFETY: a plain context access the verifier checks.
            let uplink = unsafe { (*ctx.skb.skb).ifindex };
            return Ok(Some(drop(ctx, uplink, DropReason::ConntrackRstInvalid)));
        }
        conntrack::track_tcp(r, &t.tcp);
        if t.tcp.syn() {
            conntrack::settle_wscale(&rkey.original(pod, pod_port), r);
        }
    }
    conntrack::touch(r, conntrack::flag_bits(ip.proto, t.tcp_flags), now);
    rewrite_l4(ctx, ip.proto, &t, (ip.dst, t.dport), (pod, pod_port))?;
    rewrite_ip(ctx, ip, false, pod)?;
    forward::deliver_local(ctx, &local).map(Some)
}

/// An ICMP error (destination unreachable, time exceeded, parameter problem) quoting a packet
/// of a translated flow: the outer destination, the quoted source address and port and every
/// checksum they are in (the quoted IP header's, the quoted transport's when present, the
/// ICMP message's) go back to the pod's.
#[inline(always)]
fn icmp_error(
    ctx: &mut TcContext,
    ip: &Ipv4,
    l4: usize,
    l4_len: usize,
) -> Result<Option<i32>, c_long> {
    // ICMP header, the quoted IPv4 header, 8 bytes of its transport header.
    if l4_len < 8 + 20 + 8 {
        return Ok(None);
    }
    let inner = l4 + 8;
    let Ok(h) = ctx.load::<[u8; 20]>(inner) else {
        return Ok(None);
    };
    let ihl = usize::from(h[0] & 0x0f) * 4;
    let in_src = [h[12], h[13], h[14], h[15]];
    let in_dst = [h[16], h[17], h[18], h[19]];
    let in_proto = h[9];
    if h[0] >> 4 != 4 || ihl < 20 || ihl > 60 || in_src != ip.dst || l4_len < 8 + ihl + 8 {
        return Ok(None);
    }
    let il4 = inner + ihl;
    let Ok(q) = ctx.load::<[u8; 8]>(il4) else {
        return Ok(None);
    };
    let (sport, dport, port_off, csum_off) = match in_proto {
        IPPROTO_TCP => (
            u16::from_ne_bytes([q[0], q[1]]),
            u16::from_ne_bytes([q[2], q[3]]),
            il4,
            // The quoted TCP checksum only when the error carries that much of the header.
            (l4_len >= 8 + ihl + 18).then_some(il4 + 16),
        ),
        IPPROTO_UDP => (
            u16::from_ne_bytes([q[0], q[1]]),
            u16::from_ne_bytes([q[2], q[3]]),
            il4,
            Some(il4 + 6),
        ),
        IPPROTO_ICMP if q[0] == ICMP_ECHO => {
            let id = u16::from_ne_bytes([q[4], q[5]]);
            (id, id, il4 + 4, Some(il4 + 2))
        }
        _ => return Ok(None),
    };
    let rkey = CtKey {
        src: in_dst,
        dst: in_src,
        sport: dport,
        dport: sport,
        proto: in_proto,
        dir: CT_DIR_REPLY,
        _pad: [0; 2],
    };
    let Some(r) = CALIX_CT.get_ptr(&rkey) else {
        return Ok(None);
    };
    // SAFETY: a pointer from a successful lookup.
    let (pod, pod_port) = unsafe { ((*r).addr, (*r).port) };
    let Some(local) = CALIX_LOCAL_V4.get_ptr(&pod) else {
        return Ok(None);
    };
    // SAFETY: as above.
    let local = unsafe { *local };
    let (node, pod_a) = (
        u64::from(u32::from_ne_bytes(in_src)),
        u64::from(u32::from_ne_bytes(pod)),
    );
    let (nat_p, pod_p) = (u64::from(sport), u64::from(pod_port));
    let icmp_csum = l4 + 2;
    // The outer destination (the ICMP checksum has no pseudo header).
    ctx.store(ETH_HLEN + IP_DST, &pod, 0)?;
    ctx.l3_csum_replace(ETH_HLEN + IP_CSUM, node, pod_a, 4)?;
    // The quoted source address, and the quoted header's checksum.
    ctx.store(inner + IP_SRC, &pod, 0)?;
    ctx.l4_csum_replace(icmp_csum, node, pod_a, 4)?;
    let old: u16 = ctx.load(inner + IP_CSUM)?;
    ctx.l3_csum_replace(inner + IP_CSUM, node, pod_a, 4)?;
    let new: u16 = ctx.load(inner + IP_CSUM)?;
    ctx.l4_csum_replace(icmp_csum, u64::from(old), u64::from(new), 2)?;
    // The quoted source port (or echo identifier).
    ctx.store(port_off, &pod_port, 0)?;
    ctx.l4_csum_replace(icmp_csum, nat_p, pod_p, 2)?;
    // The quoted transport checksum (not a UDP zero checksum: that stays zero).
    if let Some(off) = csum_off {
        let old: u16 = ctx.load(off)?;
        if !(in_proto == IPPROTO_UDP && old == 0) {
            let mangled = if in_proto == IPPROTO_UDP {
                u64::from(BPF_F_MARK_MANGLED_0)
            } else {
                0
            };
            // The pseudo header's address (not for ICMP, which has none); no
            // BPF_F_PSEUDO_HDR: that flag would also adjust skb->csum for the outer packet.
            if in_proto != IPPROTO_ICMP {
                ctx.l4_csum_replace(off, node, pod_a, mangled | 4)?;
            }
            ctx.l4_csum_replace(off, nat_p, pod_p, mangled | 2)?;
            let new: u16 = ctx.load(off)?;
            ctx.l4_csum_replace(icmp_csum, u64::from(old), u64::from(new), 2)?;
        }
    }
    let csum: [u8; 2] = ctx.load(ETH_HLEN + IP_CSUM)?;
    let ttl = Ttl::V4 {
        ttl: ip.ttl,
        proto: ip.proto,
        csum,
    };
    forward::to_local(ctx, &local, ttl, forward::Sent::NOTHING).map(Some)
}
