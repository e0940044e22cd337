//! SNAT connection tracking: two entries per flow in `CALIX_CT` (a plain hash, sized by the
//! agent), one keyed by the pod's original tuple (→ NAT address and port), one by the reply
//! tuple as it arrives at the node (→ the pod's address and port). NAT ports are claimed
//! atomically by inserting the reply entry with `BPF_NOEXIST`: two pods with the same source
//! port to the same destination can never get the same NAT port. Expired entries are removed
//! by the agent's cleaner; the allocator also reuses an expired or closed (RST, FIN both ways)
//! flow's port at once.
//!
//! TCP: each direction's entry tracks its next sequence number and largest (scaled) window,
//! so a RST is judged the way netfilter (and RFC 5961's receiver) does: only one in the
//! window closes the flow. Each flow is charged to the endpoint that opened it
//! (`CALIX_CT_OWNED`, less the agent's `CALIX_CT_FREED`), and an endpoint over its budget
//! opens no new flow.

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    cty::{c_long, c_void},
    helpers::bpf_loop,
    macros::map,
    maps::PerCpuArray,
};
use calix_common::{
    CtEntry, CtKey, DropReason, NatConfig, CT_F_ACK, CT_F_FIN, CT_F_LAST_ACK, CT_F_RST, CT_F_SEEN,
    CT_F_SEQ, CT_F_WSCALE, IPPROTO_TCP, MAX_NAT_UPLINKS,
};

use crate::{
    bits::FlagField,
    maps::{CALIX_CT, CALIX_CT_FREED, CALIX_CT_OWNED, CALIX_NAT_CFG},
};

const BPF_NOEXIST: u64 = 1;
const EEXIST: i64 = 17;
/// NAT ports tried for a new flow before giving up (counted as `nat_ports_exhausted`).
const PORT_TRIES: u32 = 32;
/// A direction's `last_seen_ns` is refreshed when older than this (fewer writes per packet).
const REFRESH_NS: u64 = 1_000_000_000;

/// [`CtEntry::flags`]: a flow's packets of one direction may run on two CPUs at once (a
/// delayed ACK and the FIN; the peer's ACK of a FIN and its own FIN), so bits are set and
/// cleared atomically, and only when they change.
const CT_FLAGS: FlagField = FlagField::at(
    core::mem::offset_of!(CtEntry, flags),
    core::mem::size_of::<u16>(),
);
const _: () = assert!(core::mem::align_of::<CtEntry>() == 8);

/// The largest TCP window scale shift (RFC 7323).
const MAX_WSCALE: u8 = 14;

/// TCP header flag bits.
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The SNAT settings when SNAT is on.
#[inline(always)]
pub fn config() -> Option<&'static NatConfig> {
    let cfg = CALIX_NAT_CFG.get(0)?;
    (cfg.enabled != 0).then_some(cfg)
}

/// Whether `ifindex` is one of the uplinks SNAT applies to.
#[inline(always)]
pub fn is_uplink(cfg: &NatConfig, ifindex: u32) -> bool {
    let mut i = 0;
    while i < MAX_NAT_UPLINKS {
        if cfg.uplinks[i] != 0 && cfg.uplinks[i] == ifindex {
            return true;
        }
        i += 1;
    }
    false
}

/// The `CT_F_*` bits a packet with TCP `flags` adds to its direction.
#[inline(always)]
pub fn flag_bits(proto: u8, tcp_flags: u8) -> u16 {
    let mut f = CT_F_SEEN;
    if proto == IPPROTO_TCP {
        if tcp_flags & TCP_FIN != 0 {
            f |= CT_F_FIN;
        }
        if tcp_flags & TCP_RST != 0 {
            f |= CT_F_RST;
        }
        if tcp_flags & (TCP_ACK | TCP_SYN) == TCP_ACK {
            f |= CT_F_ACK;
        }
    }
    f
}

/// What conntrack reads from a TCP segment.
#[derive(Clone, Copy, Default)]
pub struct TcpSeg {
    /// Host byte order.
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    /// The window field (unscaled).
    pub win: u16,
    /// Payload bytes.
    pub len: u32,
    /// A SYN's window scale option, if it has one.
    pub wscale: Option<u8>,
}

impl TcpSeg {
    #[inline(always)]
    pub fn rst(&self) -> bool {
        self.flags & TCP_RST != 0
    }

    #[inline(always)]
    pub fn syn(&self) -> bool {
        self.flags & TCP_SYN != 0
    }
}

/// Whether `a` comes after `b` in sequence space.
#[inline(always)]
fn after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Records what `seg` (not a RST) says of its direction `e`: its next sequence number, its
/// window scale (a SYN), the largest window it advertised and its acknowledgement number.
#[inline(always)]
pub fn track_tcp(e: *mut CtEntry, seg: &TcpSeg) {
    if seg.rst() {
        return;
    }
    let syn = seg.syn();
    let end = seg
        .seq
        .wrapping_add(seg.len)
        .wrapping_add(u32::from(syn))
        .wrapping_add(u32::from(seg.flags & TCP_FIN != 0));
    // SAFETY: `e` comes from a successful lookup and stays valid until the program returns;
    // a racing writer stores values of the same flow (benign), flag bits atomically.
    unsafe {
        if syn {
            match seg.wscale {
                Some(w) => {
                    (*e).wscale = if w > MAX_WSCALE { MAX_WSCALE } else { w };
                    if (*e).flags & CT_F_WSCALE == 0 {
                        CT_FLAGS.set(e, u64::from(CT_F_WSCALE));
                    }
                }
                None => {
                    (*e).wscale = 0;
                    if (*e).flags & CT_F_WSCALE != 0 {
                        CT_FLAGS.clear(e, u64::from(CT_F_WSCALE));
                    }
                }
            }
        }
        if (*e).flags & CT_F_SEQ == 0 {
            (*e).seq_end = end;
            CT_FLAGS.set(e, u64::from(CT_F_SEQ));
        } else if after(end, (*e).seq_end) {
            (*e).seq_end = end;
        }
        if seg.flags & TCP_ACK != 0 {
            if (*e).flags & CT_F_LAST_ACK == 0 {
                (*e).last_ack = seg.ack;
                CT_FLAGS.set(e, u64::from(CT_F_LAST_ACK));
            } else if (*e).last_ack != seg.ack {
                (*e).last_ack = seg.ack;
            }
        }
        let mut win = u32::from(seg.win);
        // A SYN's window is never scaled.
        if !syn && (*e).flags & CT_F_WSCALE != 0 {
            win <<= (*e).wscale & 0x0f;
        }
        if win > (*e).max_win {
            (*e).max_win = win;
        }
    }
}

/// After the reply direction's SYN (`r`, of the flow whose original key is `out`): window
/// scaling holds only when both SYNs had the option (RFC 7323); otherwise neither side scales.
#[inline(always)]
pub fn settle_wscale(out: &CtKey, r: *mut CtEntry) {
    // SAFETY: `r` comes from a successful lookup; so does `o` below.
    unsafe {
        let Some(o) = CALIX_CT.get_ptr_mut(out) else {
            return;
        };
        if (*o).flags & (*r).flags & CT_F_WSCALE == 0 {
            CT_FLAGS.clear(o, u64::from(CT_F_WSCALE));
            CT_FLAGS.clear(r, u64::from(CT_F_WSCALE));
            (*o).wscale = 0;
            (*r).wscale = 0;
        }
    }
}

/// Whether a RST from the direction `d` may close the flow, given the other direction `e`
/// (`None`: its entry is gone). A RST answering `e`'s latest segment: its sequence number is
/// that segment's acknowledgement number (RFC 793: `<SEQ=SEG.ACK><CTL=RST>`, e.g. a socket
/// in SYN-SENT refusing an ACK of an old connection on the same tuple). In the window: its
/// sequence number within the receiver's largest window of `d`'s next one. Before `d` has
/// sent anything: it must acknowledge the other side's SYN (RFC 793, SYN-SENT). Neither side
/// known (a flow carried over from an older layout): it cannot be judged and is accepted.
#[inline(always)]
pub fn rst_in_window(d: *const CtEntry, e: Option<*const CtEntry>, seg: &TcpSeg) -> bool {
    let Some(e) = e else {
        return true;
    };
    // SAFETY: both come from successful lookups and stay valid until the program returns
    // (fields are read one by one: no copy of the entries on the small BPF stack).
    unsafe {
        if (*e).flags & CT_F_LAST_ACK != 0 && seg.seq == (*e).last_ack {
            return true;
        }
        if (*d).flags & CT_F_SEQ != 0 {
            let off = (seg.seq.wrapping_sub((*d).seq_end) as i32).unsigned_abs();
            return off <= (*e).max_win;
        }
        if (*e).flags & CT_F_SEQ != 0 {
            return seg.flags & TCP_ACK != 0 && seg.ack == (*e).seq_end;
        }
    }
    true
}

/// The other direction's entry of the flow whose original entry is (`out`, `o`), when it is
/// still this flow's.
#[inline(always)]
pub fn reply_of(out: &CtKey, o: *const CtEntry) -> Option<*const CtEntry> {
    // SAFETY: `o` comes from a successful lookup; so does `r`.
    unsafe {
        let r = CALIX_CT.get_ptr(&out.reply((*o).addr, (*o).port))?;
        ((*r).addr == out.src && (*r).port == out.sport).then_some(r)
    }
}

/// The original entry of the flow whose reply entry is (`rkey`, `r`), when it is still this
/// flow's.
#[inline(always)]
pub fn out_of(rkey: &CtKey, r: *const CtEntry) -> Option<*const CtEntry> {
    // SAFETY: `r` comes from a successful lookup; so does `o`.
    unsafe {
        let o = CALIX_CT.get_ptr(&rkey.original((*r).addr, (*r).port))?;
        ((*o).addr == rkey.dst && (*o).port == rkey.dport).then_some(o)
    }
}

/// Whether `owner` may open another flow under `cfg.ct_budget`.
#[inline(always)]
fn within_budget(cfg: &NatConfig, owner: u32) -> bool {
    if cfg.ct_budget == 0 || owner == 0 {
        return true;
    }
    // SAFETY: plain reads of values from successful lookups.
    let owned = unsafe { CALIX_CT_OWNED.get(&owner) }.copied().unwrap_or(0);
    let freed = unsafe { CALIX_CT_FREED.get(&owner) }.copied().unwrap_or(0);
    (owned.wrapping_sub(freed) as i32) < cfg.ct_budget as i32
}

/// Adds `delta` to a count atomically (BPF's atomic instruction on cpu v1 only adds: one
/// less is 2^32 - 1).
#[inline(always)]
fn atomic_add(n: *mut u32, delta: u32) {
    // SAFETY: `n` points at a map value (aligned u32) that stays valid until the program
    // returns; every writer updates it atomically (the BPF target has no `AtomicU32`; this
    // is its atomic add instruction, the result unused).
    unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(n, delta) };
}

/// Adds one flow to `owner`'s count.
#[inline(always)]
fn charge(owner: u32) {
    if owner == 0 {
        return;
    }
    if let Some(n) = CALIX_CT_OWNED.get_ptr_mut(&owner) {
        atomic_add(n, 1);
    } else if CALIX_CT_OWNED.insert(&owner, &1, BPF_NOEXIST).is_err() {
        // Another CPU created it meanwhile.
        if let Some(n) = CALIX_CT_OWNED.get_ptr_mut(&owner) {
            atomic_add(n, 1);
        }
    }
}

/// Takes one flow off `owner`'s count (the programs removed it).
#[inline(always)]
fn refund(owner: u32) {
    if let Some(n) = CALIX_CT_OWNED.get_ptr_mut(&owner) {
        atomic_add(n, u32::MAX);
    }
}

/// Records a packet on `e`: new flag bits, and the time when it is stale enough.
#[inline(always)]
pub fn touch(e: *mut CtEntry, bits: u16, now: u64) {
    // SAFETY: `e` comes from a successful lookup and stays valid until the program returns;
    // concurrent writers only ever store newer times (benign) or add bits (atomically).
    unsafe {
        if (*e).flags & bits != bits {
            CT_FLAGS.set(e, u64::from(bits));
        }
        if now.wrapping_sub((*e).last_seen_ns) > REFRESH_NS {
            (*e).last_seen_ns = now;
        }
    }
}

/// Whether the flow that holds the reply key `rkey` may give its NAT port away: expired, or
/// a TCP connection that is over. Its entries are removed when so.
#[inline(always)]
fn reclaim(cfg: &NatConfig, rkey: &CtKey, now: u64) -> bool {
    let Some(r) = CALIX_CT.get_ptr(rkey) else {
        return true;
    };
    // SAFETY: a pointer from a successful lookup (fields read one by one: the BPF stack is
    // small).
    let (r_addr, r_port, r_flags, r_seen, r_owner) = unsafe {
        (
            (*r).addr,
            (*r).port,
            (*r).flags,
            (*r).last_seen_ns,
            (*r).owner,
        )
    };
    let okey = rkey.original(r_addr, r_port);
    let (out_flags, out_seen, out_matches) = match CALIX_CT.get_ptr(&okey) {
        // SAFETY: as above.
        Some(o) => unsafe { ((*o).flags, (*o).last_seen_ns, (*o).port == rkey.dport) },
        None => (0, 0, false),
    };
    let last = if out_matches && out_seen > r_seen {
        out_seen
    } else {
        r_seen
    };
    let closed = rkey.proto == IPPROTO_TCP && NatConfig::tcp_closed(out_flags, r_flags);
    let timeout = cfg.timeout_ns(rkey.proto, out_flags, Some(r_flags));
    if !closed && now.wrapping_sub(last) <= timeout {
        return false;
    }
    // Whoever removes the reply entry (here or the agent's cleaner) settles the budget.
    if CALIX_CT.remove(rkey).is_ok() {
        refund(r_owner);
    }
    if out_matches {
        let _ = CALIX_CT.remove(&okey);
    }
    true
}

/// A start in the port range that spreads flows (FNV-1a over the original tuple).
#[inline(always)]
fn hash(k: &CtKey) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let words = [
        u32::from_ne_bytes(k.src),
        u32::from_ne_bytes(k.dst),
        (u32::from(k.sport) << 16) | u32::from(k.dport),
        u32::from(k.proto),
    ];
    let mut i = 0;
    while i < 4 {
        h ^= words[i];
        h = h.wrapping_mul(0x0100_0193);
        h ^= h >> 15;
        i += 1;
    }
    h
}

/// The port search's state (one per CPU: a program runs to completion on its CPU).
#[map]
static PORT_SEARCH: PerCpuArray<PortSearch> = PerCpuArray::with_max_entries(1, 0);

/// [`PortSearch::outcome`] values.
const SEARCHING: u32 = 0;
const CLAIMED: u32 = 1;
const FULL: u32 = 2;

/// The state of a NAT port search (a bpf_loop over [`port_step`]).
#[repr(C)]
struct PortSearch {
    /// The reply key; its `dport` is the port being tried (the claimed one at the end).
    rkey: CtKey,
    /// The reply entry to insert.
    reply: CtEntry,
    now: u64,
    /// Port range start (host byte order) and size; the next offset in it.
    min: u32,
    range: u32,
    off: u32,
    /// [`SEARCHING`], [`CLAIMED`] or [`FULL`].
    outcome: u32,
    _pad: u32,
}

/// One try of a [`PortSearch`] (a bpf_loop callback): claims the next port by inserting its
/// reply entry (`BPF_NOEXIST`), after reclaiming it from an expired or closed flow. 0 goes
/// on, 1 stops.
#[inline(never)]
extern "C" fn port_step(_index: u64, _ctx: *mut c_void) -> c_long {
    let (Some(s), Some(cfg)) = (PORT_SEARCH.get_ptr_mut(0), config()) else {
        return 1;
    };
    // SAFETY: this CPU's scratch value `allocate` filled in, valid until the program
    // returns.
    let s = unsafe { &mut *s };
    let port = ((s.min + s.off) as u16).to_be();
    s.rkey.dport = port;
    if s.rkey.proto != IPPROTO_TCP && s.rkey.proto != calix_common::IPPROTO_UDP {
        // ICMP echo: the identifier is both "ports" (as in `CtKey::reply`).
        s.rkey.sport = port;
    }
    s.off += 1;
    if s.off >= s.range {
        s.off = 0;
    }
    match CALIX_CT.insert(&s.rkey, &s.reply, BPF_NOEXIST) {
        Ok(()) => {}
        Err(e) if e == -EEXIST => {
            if !reclaim(cfg, &s.rkey, s.now)
                || CALIX_CT.insert(&s.rkey, &s.reply, BPF_NOEXIST).is_err()
            {
                return 0;
            }
        }
        Err(_) => {
            s.outcome = FULL;
            return 1;
        }
    }
    s.outcome = CLAIMED;
    1
}

/// A new flow of the endpoint `owner`: claims a NAT port for it and writes both entries.
/// Returns the NAT port (network byte order), or the reason to drop the packet.
#[inline(always)]
pub fn allocate(
    cfg: &NatConfig,
    out: &CtKey,
    nat_addr: [u8; 4],
    bits: u16,
    owner: u32,
    now: u64,
) -> Result<u16, DropReason> {
    if !within_budget(cfg, owner) {
        return Err(DropReason::ConntrackBudget);
    }
    let min = u32::from(cfg.port_min);
    let max = u32::from(cfg.port_max);
    if min == 0 || max < min {
        return Err(DropReason::NatPortsExhausted);
    }
    let range = max - min + 1;
    // `checked_rem`: a `%` would keep a divide-by-zero panic path the verifier rejects.
    let Some(off) = hash(out).checked_rem(range) else {
        return Err(DropReason::NatPortsExhausted);
    };
    // The search's state lives in a per-CPU scratch map, not on the stack: the program's
    // stack and the callback's together must stay within 512 bytes.
    let Some(search) = PORT_SEARCH.get_ptr_mut(0) else {
        return Err(DropReason::NatPortsExhausted);
    };
    // SAFETY: this CPU's scratch value, valid until the program returns; nothing else runs
    // on this CPU meanwhile.
    let search = unsafe { &mut *search };
    // Field by field, in place: a `PortSearch { .. }` literal would be built on the stack
    // first, which the 512 bytes cannot spare.
    search.rkey = out.reply(nat_addr, 0);
    fill(&mut search.reply, now, out.src, out.sport, 0, owner);
    search.now = now;
    search.min = min;
    search.range = range;
    search.off = off;
    search.outcome = SEARCHING;
    // bpf_loop: the verifier checks one try, not each of them.
    // SAFETY: `port_step` has bpf_loop's callback signature.
    unsafe {
        bpf_loop(
            PORT_TRIES,
            port_step as *mut c_void,
            core::ptr::null_mut(),
            0,
        )
    };
    match search.outcome {
        CLAIMED => {}
        FULL => return Err(DropReason::ConntrackFull),
        _ => return Err(DropReason::NatPortsExhausted),
    }
    let port = search.rkey.dport;
    // The reply entry is in the table now: its scratch slot holds the original entry's value.
    fill(&mut search.reply, now, nat_addr, port, bits, owner);
    match CALIX_CT.insert(out, &search.reply, BPF_NOEXIST) {
        Ok(()) => {
            charge(owner);
            Ok(port)
        }
        Err(e) => {
            let _ = CALIX_CT.remove(&search.rkey);
            if e != -EEXIST {
                return Err(DropReason::ConntrackFull);
            }
            // Another CPU set the flow up meanwhile: use its port.
            match CALIX_CT.get_ptr(out) {
                // SAFETY: a pointer from a successful lookup.
                Some(o) => Ok(unsafe { (*o).port }),
                None => Err(DropReason::ConntrackFull),
            }
        }
    }
}

/// Sets every field of a new entry in place (no temporary on the stack).
#[inline(always)]
fn fill(e: &mut CtEntry, now: u64, addr: [u8; 4], port: u16, flags: u16, owner: u32) {
    // Zeroed first in 8-byte stores: its zero fields written one by one compile to calls of
    // `memset` (58 bytes' worth).
    const _: () = assert!(core::mem::align_of::<CtEntry>() == 8);
    // SAFETY: a reference (valid), 8-byte aligned (checked above); plain data.
    unsafe { crate::packet::zero_words(e) };
    e.last_seen_ns = now;
    e.addr = addr;
    e.port = port;
    e.flags = flags;
    e.owner = owner;
}

/// A TCP SYN (without ACK) on an original entry whose connection is over: the pod reuses
/// its tuple. Resets both directions' state when the reply entry is still this flow's, and
/// answers `false` when it is not (the entry is stale: the caller allocates anew).
#[inline(always)]
pub fn restart_tcp(out: &CtKey, o: *mut CtEntry, now: u64) -> bool {
    // SAFETY: `o` comes from a successful lookup.
    let (addr, port, flags) = unsafe { ((*o).addr, (*o).port, (*o).flags) };
    let rkey = out.reply(addr, port);
    let Some(r) = CALIX_CT.get_ptr_mut(&rkey) else {
        let _ = CALIX_CT.remove(out);
        return false;
    };
    // SAFETY: as above.
    unsafe {
        if (*r).addr != out.src || (*r).port != out.sport {
            let _ = CALIX_CT.remove(out);
            return false;
        }
        if NatConfig::tcp_closed(flags, (*r).flags) {
            (*r).flags = 0;
            (*r).last_seen_ns = now;
            (*r).seq_end = 0;
            (*r).max_win = 0;
            (*r).last_ack = 0;
            (*r).wscale = 0;
            (*o).flags = 0;
            (*o).last_seen_ns = now;
            (*o).seq_end = 0;
            (*o).max_win = 0;
            (*o).last_ack = 0;
            (*o).wscale = 0;
        }
    }
    true
}
