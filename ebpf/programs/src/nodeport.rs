//! Services for clients outside the cluster, per packet: a NodePort at one of this node's
//! addresses, an external or a LoadBalancer address, reached from beyond the nodes (the
//! socket programs never see those clients).
//!
//! `from_host_dev` ([`from_outside_v4`]): a TCP SYN or a UDP datagram to an external frontend
//! (`SVC_EXTERNAL` keys of `CALIX_SVC_FRONTS`, the backends of the traffic policy at this
//! node) picks a backend by a hash of the client's address and port, by its slot in the
//! frontend's Maglev table (`CALIX_SVC_MAGLEV`; its address alone with
//! `sessionAffinity: ClientIP`; every node picks the same for the same client while the
//! backends are the same), and the flow is remembered
//! both ways (`CALIX_SVC_FLOWS`). The destination becomes the backend's:
//! - a backend on this node gets the packet straight into its pod (its ingress policy first),
//!   with the client's own address: `externalTrafficPolicy: Local` keeps it, as kube-proxy;
//!   the pod's replies are translated back in `from_pod` ([`reply_from_pod_v4`]) and sent out
//!   by the interface the client's packets came in on;
//! - a backend on another node (`Cluster`): the packet goes to the host stack marked
//!   `SVC_MASQ_MARK`, which routes it there and masquerades it to the node's address (the
//!   agent's nftables table), so its replies come back here; leaving by the uplink they are
//!   translated back in `to_host_dev` ([`reply_after_stack_v4`]).
//!
//! `Local` with no endpoint here: dropped and counted (`service_no_local_endpoint`), as
//! kube-proxy drops. New flows and refusals add to the frontend's counters, as the socket
//! programs' do. No endpoint at all, and anything not ours (other protocols, fragments,
//! a TCP segment of an unknown flow other than a SYN): the host stack, which answers a port
//! nothing listens on with a RST or an ICMP port unreachable: kube-proxy's reject.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK},
    cty::c_long,
    helpers::bpf_redirect_neigh,
    programs::TcContext,
};
use calix_common::{
    svc_client_hash, SvcBackend, SvcFlow, SvcFlowKey, SvcScratch, SVC_DROP, SVC_EXTERNAL,
    SVC_FLOW_IN, SVC_FLOW_OUT, SVC_MAGLEV_ROWS, SVC_MAGLEV_SLOTS, SVC_MASQ_MARK, SVC_REJECT,
    SVC_V4,
};

use crate::maps::{
    CALIX_LOCAL_V4, CALIX_SVC_BACKS, CALIX_SVC_COUNT, CALIX_SVC_FLOWS, CALIX_SVC_FRONTS,
    CALIX_SVC_MAGLEV, CALIX_SVC_SCRATCH,
};
use crate::packet::{self, Ipv4, ETH_HLEN, IPPROTO_TCP, IPPROTO_UDP};

/// Offsets in the frame of the IPv4 header's checksum, source and destination.
pub const IP_CSUM: usize = ETH_HLEN + 10;
const IP_SRC: usize = ETH_HLEN + 12;
pub const IP_DST: usize = ETH_HLEN + 16;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_ACK: u8 = 0x10;

/// The transport fields translation reads; offsets as `u16` (a frame is at most 64 KiB): the
/// struct is on the stack of every caller.
pub(crate) struct Ports {
    pub sport: u16,
    pub dport: u16,
    pub l4: u16,
    pub csum_off: u16,
    /// TCP flags (0 for UDP).
    pub flags: u8,
}

/// TCP or UDP ports (network byte order) of an unfragmented packet; `None` for anything else.
#[inline(always)]
fn ports(ctx: &TcContext, ip: &Ipv4) -> Option<Ports> {
    if ip.fragment() {
        return None;
    }
    let l4_len = usize::from(ip.tot_len).saturating_sub(ip.ihl);
    ports_at(ctx, ip.proto, ETH_HLEN + ip.ihl, l4_len)
}

/// The ports of a `proto` (TCP or UDP) header at `l4`, `l4_len` bytes to its packet's end
/// (either family's).
#[inline(always)]
pub(crate) fn ports_at(ctx: &TcContext, proto: u8, l4: usize, l4_len: usize) -> Option<Ports> {
    let (csum_off, need) = match proto {
        IPPROTO_TCP => (l4 + 16, 20),
        IPPROTO_UDP => (l4 + 6, 8),
        _ => return None,
    };
    if l4_len < need {
        return None;
    }
    let (sport, dport) = packet::ports(ctx, l4, l4_len, proto)?;
    let flags = if proto == IPPROTO_TCP {
        ctx.load::<u8>(l4 + 13).ok()?
    } else {
        0
    };
    Some(Ports {
        sport,
        dport,
        l4: l4 as u16,
        csum_off: csum_off as u16,
        flags,
    })
}

#[inline(always)]
fn narrow(a: &[u8; 16]) -> [u8; 4] {
    [a[0], a[1], a[2], a[3]]
}

/// The source (`src`) or destination address and port replaced, with the IPv4 header and
/// transport checksums (a UDP zero checksum stays zero). The TTL is left alone.
#[inline(always)]
fn rewrite(
    ctx: &mut TcContext,
    proto: u8,
    p: &Ports,
    src: bool,
    old: ([u8; 4], u16),
    new: ([u8; 4], u16),
) -> Result<(), c_long> {
    let l4 = usize::from(p.l4);
    let csum_off = usize::from(p.csum_off);
    let (addr_off, port_off) = if src { (IP_SRC, l4) } else { (IP_DST, l4 + 2) };
    let (old_a, new_a) = (
        u64::from(u32::from_ne_bytes(old.0)),
        u64::from(u32::from_ne_bytes(new.0)),
    );
    let mangled = if proto == IPPROTO_UDP {
        u64::from(BPF_F_MARK_MANGLED_0)
    } else {
        0
    };
    ctx.l4_csum_replace(
        csum_off,
        old_a,
        new_a,
        mangled | u64::from(BPF_F_PSEUDO_HDR) | 4,
    )?;
    ctx.l4_csum_replace(csum_off, u64::from(old.1), u64::from(new.1), mangled | 2)?;
    ctx.store(port_off, &new.1, 0)?;
    ctx.l3_csum_replace(IP_CSUM, old_a, new_a, 4)?;
    ctx.store(addr_off, &new.0, 0)
}

/// This CPU's working space: the keys and values are built there, not on the stack (the
/// callers' frames are near the verifier's 512 bytes).
#[inline(always)]
pub(crate) fn scratch() -> Option<*mut SvcScratch> {
    CALIX_SVC_SCRATCH.get_ptr_mut(0)
}

/// Writes the flow's key in direction `dir`, `a` → `b`, at `k`.
#[inline(always)]
fn set_key(k: *mut SvcFlowKey, proto: u8, dir: u8, a: ([u8; 4], u16), b: ([u8; 4], u16)) {
    // SAFETY: `k` points into this CPU's scratch entry, which nothing else uses meanwhile.
    unsafe {
        (*k).a = packet::v4_addr16(a.0);
        (*k).b = packet::v4_addr16(b.0);
        (*k).a_port = a.1;
        (*k).b_port = b.1;
        (*k).proto = proto;
        (*k).family = SVC_V4;
        (*k).dir = dir;
        (*k)._pad = 0;
    }
}

/// Writes `addr` (IPv4 in the first 4 bytes) and `port` into the flow value at `f`.
#[inline(always)]
fn set_flow(f: *mut SvcFlow, addr: [u8; 4], port: u16, remote: u8, ifindex: u32) {
    // SAFETY: as in `set_key`.
    unsafe {
        (*f).addr = packet::v4_addr16(addr);
        (*f).port = port;
        (*f).remote = remote;
        (*f)._pad = 0;
        (*f).ifindex = ifindex;
    }
}

/// What becomes of a packet to an external frontend that no flow holds yet.
pub(crate) const NOT_OURS: u8 = 0;
/// `Local` and no endpoint here.
pub(crate) const DROP: u8 = 1;
/// A backend was chosen: the flow is remembered both ways and `(*s).flow` says where to.
const TO: u8 = 2;

/// The backend of a new flow (its source port `sport`, TCP flags `tcp_flags`) to the external
/// frontend in `(*s).front`, which the caller wrote: by its slot in the frontend's Maglev
/// table, else by the hash modulo its backends' count (`hash` of the client's port, or of 0
/// with `sessionAffinity: ClientIP`). `Err`: [`NOT_OURS`] or [`DROP`] (counted).
#[inline(always)]
pub(crate) fn pick(
    s: *mut SvcScratch,
    proto: u8,
    tcp_flags: u8,
    hash: impl FnOnce(u16) -> u32,
    sport: u16,
) -> Result<*const SvcBackend, u8> {
    // SAFETY: `s` is this CPU's scratch entry (see `scratch`); the lookups' values are read
    // field by field.
    unsafe {
        let Some(v) = CALIX_SVC_FRONTS.get_ptr(&(*s).front) else {
            return Err(NOT_OURS);
        };
        let (id, count, flags, affinity) = ((*v).id, (*v).count, (*v).flags, (*v).affinity_secs);
        // Only a SYN begins a TCP flow: a segment of a flow this node does not hold (a reply
        // the host stack masqueraded, a stray ACK) is not translated, nor counted.
        if proto == IPPROTO_TCP && tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
            return Err(if flags & SVC_DROP != 0 {
                DROP
            } else {
                NOT_OURS
            });
        }
        if flags & SVC_DROP != 0 {
            count_front(s, false);
            return Err(DROP);
        }
        if flags & SVC_REJECT != 0 || count == 0 {
            // The host stack refuses it (nothing listens on the port).
            count_front(s, false);
            return Err(NOT_OURS);
        }
        (*s).backend.id = id;
        // `sessionAffinity: ClientIP`: the client's address alone picks, so every connection
        // of a client meets the same backend while the backends stay the same.
        let h = hash(if affinity != 0 { 0 } else { sport });
        (*s).backend.index = match CALIX_SVC_MAGLEV.get_ptr(&id) {
            // Its slot in the frontend's Maglev table: the same backend on every node.
            Some(t) => {
                let slot = h % SVC_MAGLEV_SLOTS;
                // Read back through memory: the mask stays for the verifier, which does not
                // bound a remainder (the compiler would drop a mask it knows is a no-op).
                let slot = core::ptr::read_volatile(&slot) as usize & (SVC_MAGLEV_ROWS - 1);
                u32::from((*t).slots[slot])
            }
            None => h % count,
        };
        // `None`: the agent is between two writes of the frontend: the next SYN picks again.
        CALIX_SVC_BACKS
            .get_ptr(&(*s).backend)
            .map(|b| b as *const SvcBackend)
            .ok_or(NOT_OURS)
    }
}

/// A new flow from `client` to the frontend `front`: its backend, remembered both ways.
#[inline(always)]
fn begin(
    s: *mut SvcScratch,
    proto: u8,
    p: &Ports,
    client: [u8; 4],
    front: [u8; 4],
    uplink: u32,
) -> Result<u8, c_long> {
    // SAFETY: `s` is this CPU's scratch entry (see `scratch`); the lookups' values are read
    // field by field.
    unsafe {
        let fk = &mut (*s).front;
        fk.addr = packet::v4_addr16(front);
        fk.port = p.dport;
        fk.proto = proto;
        fk.family = SVC_V4 | SVC_EXTERNAL;
        let b = match pick(
            s,
            proto,
            p.flags,
            |sport| svc_client_hash(client, sport),
            p.sport,
        ) {
            Ok(b) => b,
            Err(verdict) => return Ok(verdict),
        };
        let backend = [(*b).addr[0], (*b).addr[1], (*b).addr[2], (*b).addr[3]];
        let port = (*b).port;
        let remote = u8::from(CALIX_LOCAL_V4.get_ptr(&backend).is_none());
        set_flow(&mut (*s).flow, backend, port, remote, 0);
        set_flow(&mut (*s).back, front, p.dport, 0, uplink);
        set_key(
            &mut (*s).back_key,
            proto,
            SVC_FLOW_OUT,
            (backend, port),
            (client, p.sport),
        );
        CALIX_SVC_FLOWS.insert(&(*s).key, &(*s).flow, 0)?;
        CALIX_SVC_FLOWS.insert(&(*s).back_key, &(*s).back, 0)?;
    }
    count_front(s, true);
    Ok(TO)
}

/// Counts a flow from outside sent to a backend of the frontend in `(*s).front`
/// (`connected`), or one refused, in this CPU's entry of the Services' counters (as the
/// socket programs count theirs; added the first time).
#[inline(always)]
pub(crate) fn count_front(s: *mut SvcScratch, connected: bool) {
    // SAFETY: `s` is this CPU's scratch entry; the counters' value is this CPU's, which no
    // other CPU writes.
    unsafe {
        let k = &(*s).front;
        let c = match CALIX_SVC_COUNT.get_ptr_mut(k) {
            Some(c) => c,
            None => {
                // SAFETY: a field of the scratch (a map value) holding `u64`s: 8-byte aligned.
                packet::zero_words(&mut (*s).zero);
                // BPF_NOEXIST (1): another CPU's call may have added it meanwhile.
                let _ = CALIX_SVC_COUNT.insert(k, &(*s).zero, 1);
                match CALIX_SVC_COUNT.get_ptr_mut(k) {
                    Some(c) => c,
                    None => return,
                }
            }
        };
        if connected {
            (*c).connections += 1;
        } else {
            (*c).refused += 1;
        }
    }
}

/// [`from_outside_v4`]: not ours, carry on.
pub const NOT_OURS_VERDICT: i32 = -100;
/// [`from_outside_v4`]: translated to a backend on this node, for the caller to deliver (its
/// endpoint is the one of the packet's new destination).
pub const TO_LOCAL: i32 = -101;
/// [`from_outside_v4`]: `Local` and no endpoint here; for the caller to drop and count.
pub const NO_LOCAL_ENDPOINT: i32 = -102;
/// [`choose_v4`]: the backend is in this CPU's `(*scratch).flow`.
pub(crate) const CHOSEN: i32 = -103;

/// `from_host_dev`, IPv4: a packet from outside to an external frontend goes to its backend.
/// A tc verdict, [`NOT_OURS_VERDICT`], [`TO_LOCAL`] or [`NO_LOCAL_ENDPOINT`].
///
/// Two functions of their own (BPF-to-BPF calls), one after the other, each on a small frame
/// of its own: the caller's is near the verifier's 512 bytes; the delivery into a pod and the
/// drop counter are the caller's (its frame already has them).
#[inline(always)]
pub fn from_outside_v4(ctx: &mut TcContext, ip: &Ipv4) -> Result<i32, c_long> {
    match choose_v4(ctx, ip)? {
        CHOSEN => translate_v4(ctx, ip),
        other => Ok(other),
    }
}

/// The flow's backend, held or chosen now: [`CHOSEN`], [`NOT_OURS_VERDICT`] or
/// [`NO_LOCAL_ENDPOINT`].
#[inline(never)]
fn choose_v4(ctx: &TcContext, ip: &Ipv4) -> Result<i32, c_long> {
    // A TTL about to expire: the stack sends the ICMP error.
    if ip.ttl <= 1 {
        return Ok(NOT_OURS_VERDICT);
    }
    let Some(p) = ports(ctx, ip) else {
        return Ok(NOT_OURS_VERDICT);
    };
    let Some(s) = scratch() else {
        return Ok(NOT_OURS_VERDICT);
    };
    // SAFETY: `s` is this CPU's scratch entry; the flow's fields are read one by one.
    unsafe {
        set_key(
            &mut (*s).key,
            ip.proto,
            SVC_FLOW_IN,
            (ip.src, p.sport),
            (ip.dst, p.dport),
        );
        // A TCP SYN begins a connection anew: a client reusing its port after a flow ended
        // meets the backends as they are now (the old flow's may be gone).
        let syn = ip.proto == IPPROTO_TCP && p.flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
        if !syn {
            if let Some(f) = CALIX_SVC_FLOWS.get_ptr(&(*s).key) {
                let (backend, port) = (narrow(&(*f).addr), (*f).port);
                set_flow(&mut (*s).flow, backend, port, 0, 0);
                return Ok(CHOSEN);
            }
        }
    }
    // SAFETY: a plain context access the verifier checks.
    let uplink = unsafe { (*ctx.skb.skb).ifindex };
    Ok(match begin(s, ip.proto, &p, ip.src, ip.dst, uplink)? {
        TO => CHOSEN,
        DROP => NO_LOCAL_ENDPOINT,
        _ => NOT_OURS_VERDICT,
    })
}

/// The packet to the backend [`choose_v4`] left in the scratch: [`TO_LOCAL`], or on to the
/// host stack marked for its masquerade (a backend on another node).
#[inline(never)]
fn translate_v4(ctx: &mut TcContext, ip: &Ipv4) -> Result<i32, c_long> {
    let (Some(p), Some(s)) = (ports(ctx, ip), scratch()) else {
        return Ok(NOT_OURS_VERDICT);
    };
    // SAFETY: `s` is this CPU's scratch entry, which `choose_v4` just wrote.
    let (backend, port) = unsafe { (narrow(&(*s).flow.addr), (*s).flow.port) };
    rewrite(ctx, ip.proto, &p, false, (ip.dst, p.dport), (backend, port))?;
    if CALIX_LOCAL_V4.get_ptr(&backend).is_some() {
        return Ok(TO_LOCAL);
    }
    ctx.set_mark(SVC_MASQ_MARK);
    Ok(TC_ACT_OK)
}

/// The frontend (address, port) a backend's packet to a client answers for, and the client's
/// interface, if it is the reply of a flow from outside.
#[inline(always)]
fn reply_of(ctx: &TcContext, ip: &Ipv4) -> Option<(Ports, ([u8; 4], u16), u32)> {
    let p = ports(ctx, ip)?;
    let s = scratch()?;
    // SAFETY: `s` is this CPU's scratch entry; the flow's fields are read one by one.
    unsafe {
        set_key(
            &mut (*s).key,
            ip.proto,
            SVC_FLOW_OUT,
            (ip.src, p.sport),
            (ip.dst, p.dport),
        );
        let f = CALIX_SVC_FLOWS.get_ptr(&(*s).key)?;
        let front = (narrow(&(*f).addr), (*f).port);
        Some((p, front, (*f).ifindex))
    }
}

/// `from_pod`, IPv4: a local backend's reply to a client outside leaves from the frontend, by
/// the interface the client's packets came in on (`bpf_redirect_neigh`: the kernel's route
/// and neighbour from there); the host stack would take a packet from a node's own address
/// arriving on a veth for a martian. `None`: not such a reply.
// A function of its own (a BPF-to-BPF call), on a frame of its own.
#[inline(never)]
pub fn reply_from_pod_v4(ctx: &mut TcContext, ip: &Ipv4) -> Result<Option<i32>, c_long> {
    let Some((p, front, ifindex)) = reply_of(ctx, ip) else {
        return Ok(None);
    };
    // A TTL about to expire: the stack sends the ICMP error (about the untranslated packet,
    // which the client would not know; rare enough, as for kube-proxy's own forwarding).
    if ip.ttl <= 1 {
        return Ok(None);
    }
    rewrite(ctx, ip.proto, &p, true, (ip.src, p.sport), front)?;
    // Forwarding's TTL step: the TTL and protocol word and the header checksum.
    let old = u16::from_ne_bytes([ip.ttl, ip.proto]);
    let new = u16::from_ne_bytes([ip.ttl - 1, ip.proto]);
    ctx.l3_csum_replace(IP_CSUM, u64::from(old), u64::from(new), 2)?;
    ctx.store(ETH_HLEN + 8, &(ip.ttl - 1), 0)?;
    Ok(Some(out_by(ctx, ifindex)))
}

/// A reply leaves by the client's interface `ifindex`, past `to_host_dev`'s bookkeeping.
#[inline(always)]
pub(crate) fn out_by(ctx: &mut TcContext, ifindex: u32) -> i32 {
    // Tell `to_host_dev` this packet took the fast path.
    ctx.set_mark(calix_common::FAST_PATH_MARK);
    // SAFETY: a plain helper call; a null neighbour means "use the FIB's next hop".
    unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

/// `to_host_dev`, IPv4: a remote backend's reply, which the host stack took back from its
/// masquerade and routed out to the client, leaves from the frontend.
// A function of its own (a BPF-to-BPF call): its keys and values on a frame of their
// own, not on the caller's, which is near the verifier's 512 bytes.
#[inline(never)]
pub fn reply_after_stack_v4(ctx: &mut TcContext, ip: &Ipv4) -> Result<(), c_long> {
    if let Some((p, front, _)) = reply_of(ctx, ip) {
        rewrite(ctx, ip.proto, &p, true, (ip.src, p.sport), front)?;
    }
    Ok(())
}
