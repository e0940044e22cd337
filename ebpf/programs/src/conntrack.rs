//! SNAT connection tracking: two entries per flow in `CALIX_CT` (a plain hash, sized by the
//! agent), one keyed by the pod's original tuple (→ NAT address and port), one by the reply
//! tuple as it arrives at the node (→ the pod's address and port). NAT ports are claimed
//! atomically by inserting the reply entry with `BPF_NOEXIST`: two pods with the same source
//! port to the same destination can never get the same NAT port. Expired entries are removed
//! by the agent's cleaner; the allocator also reuses an expired or closed (RST, FIN both ways)
//! flow's port at once.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LpmTrie},
};
use calix_common::{
    CtEntry, CtKey, DropReason, NatConfig, CT_DIR_OUT, CT_DIR_REPLY, CT_F_FIN, CT_F_RST, CT_F_SEEN,
    DEFAULT_CT_ENTRIES, IPPROTO_TCP, MAX_NAT_UPLINKS, MAX_NO_SNAT_CIDRS,
};

/// Conntrack entries (see `calix_common::CT_MAP`).
#[map(name = "CALIX_CT")]
pub static CALIX_CT: HashMap<CtKey, CtEntry> = HashMap::pinned(DEFAULT_CT_ENTRIES, 0);

/// The agent's `[nat]` settings, one entry.
#[map(name = "CALIX_NAT_CFG")]
pub static CALIX_NAT_CFG: Array<NatConfig> = Array::pinned(1, 0);

/// IPv4 destinations reached without SNAT: every pool, and `non_masquerade_cidrs`.
#[map(name = "CALIX_NO_SNAT_V4")]
pub static CALIX_NO_SNAT_V4: LpmTrie<[u8; 4], u32> =
    LpmTrie::pinned(MAX_NO_SNAT_CIDRS, BPF_F_NO_PREALLOC);

const _: () = assert!(crate::str_eq(calix_common::CT_MAP, "CALIX_CT"));
const _: () = assert!(crate::str_eq(calix_common::NAT_CONFIG_MAP, "CALIX_NAT_CFG"));
const _: () = assert!(crate::str_eq(
    calix_common::NO_SNAT_V4_MAP,
    "CALIX_NO_SNAT_V4"
));

const BPF_NOEXIST: u64 = 1;
const EEXIST: i64 = 17;
/// NAT ports tried for a new flow before giving up (counted as `nat_ports_exhausted`).
const PORT_TRIES: u32 = 32;
/// A direction's `last_seen_ns` is refreshed when older than this (fewer writes per packet).
const REFRESH_NS: u64 = 1_000_000_000;

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
    }
    f
}

/// Records a packet on `e`: new flag bits, and the time when it is stale enough.
#[inline(always)]
pub fn touch(e: *mut CtEntry, bits: u16, now: u64) {
    // SAFETY: `e` comes from a successful lookup and stays valid until the program returns;
    // concurrent writers only ever store newer times or add bits (benign races).
    unsafe {
        if (*e).flags & bits != bits {
            (*e).flags |= bits;
        }
        if now.wrapping_sub((*e).last_seen_ns) > REFRESH_NS {
            (*e).last_seen_ns = now;
        }
    }
}

/// The reply key of a flow with original key `out` leaving as (`nat_addr`, `nat_port`).
#[inline(always)]
pub fn reply_key(out: &CtKey, nat_addr: [u8; 4], nat_port: u16) -> CtKey {
    let sport = if out.proto == IPPROTO_TCP || out.proto == calix_common::IPPROTO_UDP {
        out.dport
    } else {
        // ICMP echo: the identifier is both "ports".
        nat_port
    };
    CtKey {
        src: out.dst,
        dst: nat_addr,
        sport,
        dport: nat_port,
        proto: out.proto,
        dir: CT_DIR_REPLY,
        _pad: [0; 2],
    }
}

/// The original key of the flow whose reply entry is (`rkey`, `r`).
#[inline(always)]
fn out_key_of(rkey: &CtKey, r: &CtEntry) -> CtKey {
    let dport = if rkey.proto == IPPROTO_TCP || rkey.proto == calix_common::IPPROTO_UDP {
        rkey.sport
    } else {
        r.port
    };
    CtKey {
        src: r.addr,
        dst: rkey.src,
        sport: r.port,
        dport,
        proto: rkey.proto,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
    }
}

/// Whether the flow that holds the reply key `rkey` may give its NAT port away: expired, or
/// a TCP connection that is over. Its entries are removed when so.
#[inline(always)]
fn reclaim(cfg: &NatConfig, rkey: &CtKey, now: u64) -> bool {
    let Some(r) = CALIX_CT.get_ptr(rkey) else {
        return true;
    };
    // SAFETY: a pointer from a successful lookup.
    let r = unsafe { *r };
    let okey = out_key_of(rkey, &r);
    let (out_flags, out_seen, out_matches) = match CALIX_CT.get_ptr(&okey) {
        // SAFETY: as above.
        Some(o) => unsafe { ((*o).flags, (*o).last_seen_ns, (*o).port == rkey.dport) },
        None => (0, 0, false),
    };
    let last = if out_matches && out_seen > r.last_seen_ns {
        out_seen
    } else {
        r.last_seen_ns
    };
    let closed = rkey.proto == IPPROTO_TCP && NatConfig::tcp_closed(out_flags, r.flags);
    let timeout = cfg.timeout_ns(rkey.proto, out_flags, Some(r.flags));
    if !closed && now.wrapping_sub(last) <= timeout {
        return false;
    }
    let _ = CALIX_CT.remove(rkey);
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

/// A new flow: claims a NAT port for it and writes both entries. Returns the NAT port
/// (network byte order), or the reason to drop the packet.
#[inline(always)]
pub fn allocate(
    cfg: &NatConfig,
    out: &CtKey,
    nat_addr: [u8; 4],
    bits: u16,
    now: u64,
) -> Result<u16, DropReason> {
    let min = u32::from(cfg.port_min);
    let max = u32::from(cfg.port_max);
    if min == 0 || max < min {
        return Err(DropReason::NatPortsExhausted);
    }
    let range = max - min + 1;
    // `checked_rem`: a `%` would keep a divide-by-zero panic path the verifier rejects.
    let Some(mut off) = hash(out).checked_rem(range) else {
        return Err(DropReason::NatPortsExhausted);
    };
    let reply_val = CtEntry {
        last_seen_ns: now,
        addr: out.src,
        port: out.sport,
        flags: 0,
        ..CtEntry::default()
    };
    let mut i = 0;
    while i < PORT_TRIES {
        let port = ((min + off) as u16).to_be();
        i += 1;
        off += 1;
        if off >= range {
            off = 0;
        }
        let rkey = reply_key(out, nat_addr, port);
        match CALIX_CT.insert(&rkey, &reply_val, BPF_NOEXIST) {
            Ok(()) => {}
            Err(e) if e == -EEXIST => {
                if !reclaim(cfg, &rkey, now)
                    || CALIX_CT.insert(&rkey, &reply_val, BPF_NOEXIST).is_err()
                {
                    continue;
                }
            }
            Err(_) => return Err(DropReason::ConntrackFull),
        }
        let out_val = CtEntry {
            last_seen_ns: now,
            addr: nat_addr,
            port,
            flags: bits,
            ..CtEntry::default()
        };
        return match CALIX_CT.insert(out, &out_val, BPF_NOEXIST) {
            Ok(()) => Ok(port),
            Err(e) => {
                let _ = CALIX_CT.remove(&rkey);
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
        };
    }
    Err(DropReason::NatPortsExhausted)
}

/// A TCP SYN (without ACK) on an original entry whose connection is over: the pod reuses
/// its tuple. Resets both directions' state when the reply entry is still this flow's, and
/// answers `false` when it is not (the entry is stale: the caller allocates anew).
#[inline(always)]
pub fn restart_tcp(out: &CtKey, o: *mut CtEntry, now: u64) -> bool {
    // SAFETY: `o` comes from a successful lookup.
    let (addr, port, flags) = unsafe { ((*o).addr, (*o).port, (*o).flags) };
    let rkey = reply_key(out, addr, port);
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
            (*o).flags = CT_F_SEEN;
            (*o).last_seen_ns = now;
        }
    }
    true
}
