//! Header offsets and reads. The tc programs read and write the headers at fixed offsets
//! (Ethernet, the IPv4 and IPv6 fixed headers: the fast path) with direct packet access
//! ([`linear`], [`load`], [`store`]); everything past them (transport headers, extension
//! headers, ICMP payloads) with the helpers (`ctx.load`, `ctx.store`), which fail cleanly on a
//! short packet instead of needing bounds proofs for the verifier. XDP (`xdp.rs`) uses direct
//! packet access with its own bounds checks.

use core::mem::size_of;

use aya_ebpf::{cty::c_long, programs::TcContext};

/// The address of the frame's first `len` bytes, once they are in the skb's linear data:
/// where the kernel keeps the headers of nearly every packet, else pulled there
/// (`bpf_skb_pull_data`). `None` when the frame is shorter. Valid until the next helper that
/// changes the packet (a store, a checksum update, a pull); `len` must be a constant at every
/// call site (the verifier refuses a packet pointer moved by an offset it cannot bound).
#[inline(always)]
pub fn linear(ctx: &TcContext, len: usize) -> Option<usize> {
    if ctx.data() + len > ctx.data_end() {
        ctx.pull_data(len as u32).ok()?;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    (data + len <= end).then_some(data)
}

/// Reads a `T` at `off` bytes into the frame (through [`linear`]: `off` a constant).
#[inline(always)]
pub fn load<T: Copy>(ctx: &TcContext, off: usize) -> Result<T, c_long> {
    let base = linear(ctx, off + size_of::<T>()).ok_or(-1)?;
    // SAFETY: the bytes lie below the end of the linear data (checked by `linear`, and by the
    // verifier); `read_unaligned`: headers sit at any alignment.
    Ok(unsafe { core::ptr::read_unaligned((base + off) as *const T) })
}

/// Writes `v` at `off` bytes into the frame, no checksum updated (through [`linear`]: `off` a
/// constant). A program that writes packets directly makes the kernel unclone a cloned skb's
/// header before it runs.
#[inline(always)]
pub fn store<T: Copy>(ctx: &mut TcContext, off: usize, v: &T) -> Result<(), c_long> {
    let base = linear(ctx, off + size_of::<T>()).ok_or(-1)?;
    // SAFETY: as in `load`; the kernel made the header writable (see above).
    unsafe { core::ptr::write_unaligned((base + off) as *mut T, *v) };
    Ok(())
}

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_ARP: u16 = 0x0806;
/// 802.1Q and 802.1ad VLAN tags (4 bytes before the inner EtherType).
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
pub const VLAN_HLEN: usize = 4;

/// IPv4: the fixed header is read whole ([`ipv4`]); the forwarding code writes from the TTL on.
pub mod v4 {
    /// The TTL's offset from the start of the frame (TTL, protocol, checksum follow).
    pub const TTL: usize = super::ETH_HLEN + 8;
    pub const MIN_LEN: usize = 20;
}

/// IPv6: the fixed header is read whole ([`ipv6`]).
pub mod v6 {
    /// The hop limit's offset from the start of the frame.
    pub const HOP_LIMIT: usize = super::ETH_HLEN + 7;
    pub const LEN: usize = 40;
}

/// Offsets inside an IPv4-over-Ethernet ARP packet.
pub mod arp {
    pub const HTYPE: usize = super::ETH_HLEN;
    pub const PTYPE: usize = super::ETH_HLEN + 2;
    pub const HLEN_PLEN: usize = super::ETH_HLEN + 4;
    pub const SPA: usize = super::ETH_HLEN + 14;
    pub const LEN: usize = 28;
}

/// The frame's EtherType (host order).
#[inline(always)]
pub fn ethertype(ctx: &TcContext) -> Result<u16, c_long> {
    Ok(u16::from_be(load::<u16>(ctx, 12)?))
}

/// An IPv4 header that passed validation.
pub struct Ipv4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub proto: u8,
    pub tot_len: u16,
    /// Header length in bytes (options included).
    pub ihl: usize,
    /// The flags and fragment offset as in the packet (network order), read through
    /// [`Ipv4::fragment`] and [`Ipv4::later_fragment`]. Kept raw, not as two booleans decided
    /// at parse time: each boolean would be a branch whose two outcomes the verifier follows
    /// separately through everything after the parse (it doubled the instructions it walks).
    pub frag: u16,
    pub ttl: u8,
    /// The header checksum as in the packet.
    pub csum: [u8; 2],
}

impl Ipv4 {
    /// A fragment (more fragments follow, or not the first): no transport header to read.
    #[inline(always)]
    pub fn fragment(&self) -> bool {
        self.frag & 0x3fff != 0
    }

    /// A fragment other than the first (offset > 0): it holds no transport header at all.
    #[inline(always)]
    pub fn later_fragment(&self) -> bool {
        self.frag & 0x1fff != 0
    }
}

/// Reads and validates the IPv4 header: `None` when it is truncated or invalid. IP options
/// (IHL > 5) and fragments are fine: only the addresses are needed to forward.
#[inline(always)]
pub fn ipv4(ctx: &TcContext) -> Option<Ipv4> {
    let len = ctx.len() as usize;
    if len < ETH_HLEN + v4::MIN_LEN {
        return None;
    }
    let p = linear(ctx, ETH_HLEN + v4::MIN_LEN)? as *const u8;
    // SAFETY: the header lies in the linear data (`linear`).
    let b = |i: usize| unsafe { *p.add(ETH_HLEN + i) };
    let ver_ihl = b(0);
    let ihl = usize::from(ver_ihl & 0x0f) * 4;
    let tot_len = u16::from_be_bytes([b(2), b(3)]);
    if ver_ihl >> 4 != 4
        || ihl < v4::MIN_LEN
        || usize::from(tot_len) < ihl
        || ETH_HLEN + usize::from(tot_len) > len
    {
        return None;
    }
    Some(Ipv4 {
        src: [b(12), b(13), b(14), b(15)],
        dst: [b(16), b(17), b(18), b(19)],
        proto: b(9),
        tot_len,
        ihl,
        frag: u16::from_be_bytes([b(6), b(7)]),
        ttl: b(8),
        csum: [b(10), b(11)],
    })
}

/// An IPv6 header that passed validation.
pub struct Ipv6 {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub next_hdr: u8,
    pub payload_len: u16,
    pub hop_limit: u8,
}

/// Reads and validates the IPv6 fixed header: `None` when it is truncated or invalid.
#[inline(always)]
pub fn ipv6(ctx: &TcContext) -> Option<Ipv6> {
    let len = ctx.len() as usize;
    if len < ETH_HLEN + v6::LEN {
        return None;
    }
    let h: [u8; v6::LEN] = load(ctx, ETH_HLEN).ok()?;
    let payload_len = u16::from_be_bytes([h[4], h[5]]);
    if h[0] >> 4 != 6 || ETH_HLEN + v6::LEN + usize::from(payload_len) > len {
        return None;
    }
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&h[8..24]);
    dst.copy_from_slice(&h[24..40]);
    Some(Ipv6 {
        src,
        dst,
        next_hdr: h[6],
        payload_len,
        hop_limit: h[7],
    })
}

/// The sender protocol address of an IPv4-over-Ethernet ARP packet; `None` when it is too
/// short or not IPv4-over-Ethernet.
#[inline(always)]
pub fn arp_sender(ctx: &TcContext) -> Option<[u8; 4]> {
    if (ctx.len() as usize) < ETH_HLEN + arp::LEN {
        return None;
    }
    let htype = u16::from_be(ctx.load::<u16>(arp::HTYPE).ok()?);
    let ptype = u16::from_be(ctx.load::<u16>(arp::PTYPE).ok()?);
    let hlen_plen = u16::from_be(ctx.load::<u16>(arp::HLEN_PLEN).ok()?);
    if htype != 1 || ptype != ETH_P_IP || hlen_plen != 0x0604 {
        return None;
    }
    ctx.load(arp::SPA).ok()
}

/// Zeroes the `T` at `p` in 8-byte stores: zeroing a struct (`Default`, `mem::zeroed`, or its
/// zero fields one by one) compiles on the BPF target to a call of the byte-wise `memset` (a
/// loop of one store per byte).
///
/// # Safety
/// `p` is valid for writes of a `T`, 8-byte aligned, and all-zero is a valid `T`.
#[inline(always)]
pub unsafe fn zero_words<T>(p: *mut T) {
    const { assert!(core::mem::size_of::<T>() % 8 == 0) };
    let words = p as *mut u64;
    for i in 0..core::mem::size_of::<T>() / 8 {
        // SAFETY: within the `T` (a whole number of words, checked above), aligned (the
        // caller's promise). Volatile, or the compiler merges the stores back into `memset`.
        unsafe { words.add(i).write_volatile(0) }
    }
}

/// Copies the `T` at `src` to `dst` in 4-byte loads and stores: a struct's copy (`*dst =
/// *src`) compiles on the BPF target to a call of the byte-wise `memmove` or `memcpy`.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of a `T`, both 4-byte aligned; `T` is plain
/// data.
#[inline(always)]
pub unsafe fn copy_words<T>(dst: *mut T, src: *const T) {
    const { assert!(core::mem::size_of::<T>() % 4 == 0) };
    let (to, from) = (dst as *mut u32, src as *const u32);
    for i in 0..core::mem::size_of::<T>() / 4 {
        // SAFETY: within both `T`s (a whole number of words, checked above), aligned (the
        // caller's promise). Volatile, or the compiler merges them back into a call.
        unsafe { to.add(i).write_volatile(from.add(i).read_volatile()) }
    }
}

/// A 16-byte address field from four 4-byte words (an IPv4 address: `[addr, 0, 0, 0]`). A
/// key's address built as bytes, its zero tail set by `..Default::default()`, a `[0; 16]` or a
/// loop, compiles on the BPF target to a call of the byte-wise `memset` (a loop of one store
/// per byte); words are a few stores.
#[inline(always)]
pub fn addr16(words: [u32; 4]) -> [u8; 16] {
    // SAFETY: both are 16 bytes of plain data, for which every bit pattern is valid.
    unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) }
}

/// [`addr16`] of an IPv4 address: the address, then 12 zero bytes.
#[inline(always)]
pub fn v4_addr16(a: [u8; 4]) -> [u8; 16] {
    addr16([u32::from_ne_bytes(a), 0, 0, 0])
}

/// fe80::/10.
#[inline(always)]
pub fn is_v6_link_local(a: &[u8; 16]) -> bool {
    a[0] == 0xfe && (a[1] & 0xc0) == 0x80
}

/// ::
#[inline(always)]
pub fn is_v6_unspecified(a: &[u8; 16]) -> bool {
    let mut i = 0;
    while i < 16 {
        if a[i] != 0 {
            return false;
        }
        i += 1;
    }
    true
}

pub const IPPROTO_ICMP: u8 = 1;
pub use calix_common::{IPPROTO_TCP, IPPROTO_UDP};
pub const IPPROTO_ICMPV6: u8 = 58;

/// IPv6 extension headers (next-header values) [`v6_upper`] steps over.
pub const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_FRAGMENT: u8 = 44;
pub const IPPROTO_AH: u8 = 51;
pub const IPPROTO_DSTOPTS: u8 = 60;
/// The most extension headers [`v6_upper`] follows. Real traffic carries one or two (a
/// hop-by-hop header on MLD, a fragment header); a longer chain is not followed, and what it
/// hides is treated as unknown by the callers.
pub const MAX_V6_EXT_HEADERS: usize = 8;

/// Where an IPv6 packet's upper-layer header starts, past its extension headers.
#[derive(Clone, Copy)]
pub struct V6Upper {
    /// Its protocol (next-header value); [`IPPROTO_FRAGMENT`] for a fragment other than the
    /// first, which holds no upper-layer header.
    pub proto: u8,
    /// Its offset from the start of the frame.
    pub off: usize,
    /// A fragment header came first (neighbour discovery is never fragmented: RFC 6980).
    pub fragmented: bool,
}

/// Follows an IPv6 packet's extension headers — hop-by-hop, routing, destination options,
/// authentication, and the fragment header of a first fragment — from next header `next`
/// at offset `off` (the end of the fixed header) to the upper-layer header. `end` is where
/// the IP payload ends; `read` reads the four bytes at an offset (a header's next header and
/// length, and a fragment header's offset). `None` when a header is cut short, runs past
/// `end`, or the chain is longer than [`MAX_V6_EXT_HEADERS`].
///
/// Both the tc programs (`bpf_skb_load_bytes`) and XDP (direct packet access) walk with it.
#[inline(always)]
pub fn v6_upper(
    next: u8,
    off: usize,
    end: usize,
    read: impl Fn(usize) -> Option<[u8; 4]>,
) -> Option<V6Upper> {
    let mut up = V6Upper {
        proto: next,
        off,
        fragmented: false,
    };
    let mut i = 0;
    while i <= MAX_V6_EXT_HEADERS {
        if !matches!(
            up.proto,
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_FRAGMENT | IPPROTO_AH | IPPROTO_DSTOPTS
        ) {
            return Some(up);
        }
        // Every extension header is at least 8 bytes long.
        if i == MAX_V6_EXT_HEADERS || up.off + 8 > end {
            return None;
        }
        let h = read(up.off)?;
        let len = match up.proto {
            IPPROTO_FRAGMENT => {
                up.fragmented = true;
                // A later fragment: its bytes continue the first one's payload.
                if u16::from_be_bytes([h[2], h[3]]) & 0xfff8 != 0 {
                    return Some(up);
                }
                8
            }
            IPPROTO_AH => (usize::from(h[1]) + 2) * 4,
            _ => (usize::from(h[1]) + 1) * 8,
        };
        up.proto = h[0];
        up.off += len;
        i += 1;
    }
    None
}

/// (source, destination) "ports" of a transport header at `l4` (bytes into the frame, `l4_len`
/// bytes of IP payload), in
/// network byte order: TCP/UDP ports, or the ICMP/ICMPv6 echo identifier twice. `None` for
/// anything else (other protocols, other ICMP types, a truncated header): such packets never
/// take the fast path.
#[inline(always)]
pub fn ports(ctx: &TcContext, l4: usize, l4_len: usize, proto: u8) -> Option<(u16, u16)> {
    // The ports (or the echo identifier) must lie inside the IP payload, not in frame padding.
    let need = match proto {
        IPPROTO_TCP | IPPROTO_UDP => 4,
        _ => 8,
    };
    if l4_len < need {
        return None;
    }
    match proto {
        IPPROTO_TCP | IPPROTO_UDP => {
            let p: [u8; 4] = ctx.load(l4).ok()?;
            Some((
                u16::from_ne_bytes([p[0], p[1]]),
                u16::from_ne_bytes([p[2], p[3]]),
            ))
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let ty: u8 = ctx.load(l4).ok()?;
            // Echo request/reply: 8/0 (ICMP), 128/129 (ICMPv6).
            if matches!(
                (proto, ty),
                (IPPROTO_ICMP, 0 | 8) | (IPPROTO_ICMPV6, 128 | 129)
            ) {
                let id: u16 = ctx.load(l4 + 4).ok()?;
                Some((id, id))
            } else {
                None
            }
        }
        _ => None,
    }
}
