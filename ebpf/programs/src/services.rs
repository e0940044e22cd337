//! Kubernetes Services at the sockets (`calix_common::services`): a connection to a Service's
//! frontend goes to one of its backends from its first packet, with no per-packet NAT. TCP and
//! connected UDP: `connect` rewrites the destination, `getpeername` shows the frontend again.
//! Unconnected UDP: `sendmsg` rewrites each datagram's destination and remembers, per socket,
//! which frontend the backend stands for; `recvmsg` shows the frontend as the source of the
//! replies. A frontend with no backend refuses the connection: the caller sees ECONNREFUSED,
//! as after kube-proxy's ICMP reject.
//!
//! Return values: 1 lets the call go on (rewritten or not), 0 refuses it.
#![cfg_attr(feature = "bench-floor", allow(dead_code))]

use aya_ebpf::{
    helpers::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns,
        bpf_set_retval,
    },
    programs::SockAddrContext,
};
use calix_common::{
    SvcAffKey, SvcAffValue, SvcBackend, SvcBackendKey, SvcCounters, SvcFwdKey, SvcKey, SvcNodeKey,
    SvcRevKey, SvcRevValue, SvcValue, SVC_AFFINITY_SCAN, SVC_DROP, SVC_REJECT, SVC_V4, SVC_V6,
};

use crate::maps::{
    CALIX_SVC_AFF, CALIX_SVC_BACKS, CALIX_SVC_COUNT, CALIX_SVC_FRONTS, CALIX_SVC_FWD,
    CALIX_SVC_NODES, CALIX_SVC_REV,
};
use crate::packet;

const ALLOW: i32 = 1;
const REFUSE: i32 = 0;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;
const ECONNREFUSED: i32 = 111;

/// The frontend the call names, as a key (`None`: neither TCP nor UDP).
#[inline(always)]
fn key(ctx: &SockAddrContext, v6: bool) -> Option<SvcKey> {
    // SAFETY: the context the kernel passed; these fields are readable in every sock_addr
    // program of this family.
    let sa = unsafe { &*ctx.sock_addr };
    let proto = match sa.protocol {
        IPPROTO_TCP | IPPROTO_UDP => sa.protocol as u8,
        _ => return None,
    };
    Some(SvcKey {
        // The words as the kernel holds them: network order in memory.
        addr: packet::addr16(if v6 {
            sa.user_ip6
        } else {
            [sa.user_ip4, 0, 0, 0]
        }),
        port: sa.user_port as u16,
        proto,
        family: if v6 { SVC_V6 } else { SVC_V4 },
    })
}

/// Writes `addr`/`port` (network order, as stored) as the call's destination.
#[inline(always)]
fn set_dest(ctx: &SockAddrContext, v6: bool, addr: &[u8; 16], port: u16) {
    // SAFETY: as in `key`; these fields are writable in connect, sendmsg, recvmsg and
    // getpeername programs.
    let sa = unsafe { &mut *ctx.sock_addr };
    if v6 {
        for i in 0..4 {
            sa.user_ip6[i] = u32::from_ne_bytes([
                addr[i * 4],
                addr[i * 4 + 1],
                addr[i * 4 + 2],
                addr[i * 4 + 3],
            ]);
        }
    } else {
        sa.user_ip4 = u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]);
    }
    sa.user_port = u32::from(port);
}

/// `connect` and `sendmsg`: a frontend's call goes to one of its backends, remembered for the
/// socket so that `recvmsg` and `getpeername` can show the frontend again. `sticky`
/// (`sendmsg`): the socket's earlier datagrams to the frontend chose a backend; the next ones
/// go there too while the frontend's backends are unchanged.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, v6: bool, sticky: bool) -> i32 {
    let Some(to) = key(ctx, v6) else {
        return ALLOW;
    };
    let Some((k, front)) = frontend(&to) else {
        return ALLOW;
    };
    if front.flags & (SVC_REJECT | SVC_DROP) != 0 || front.count == 0 {
        count(&k, false);
        // SAFETY: a helper on the program's own return value.
        unsafe { bpf_set_retval(-ECONNREFUSED) };
        return REFUSE;
    }
    // SAFETY: the helper takes the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let fk = SvcFwdKey {
        cookie,
        front: k,
        _pad: 0,
    };
    let earlier = if sticky {
        // SAFETY: a read-only lookup; the value is copied out at once.
        unsafe { CALIX_SVC_FWD.get(&fk) }
            .copied()
            .filter(|b| b.id == front.id && b.index < front.count)
            .and_then(|bk| backend(&bk).map(|b| (bk, b)))
    } else {
        None
    };
    let b = match earlier {
        Some((_, b)) => b,
        None => {
            let Some((bk, b)) = pick(ctx, &k, &front) else {
                // The agent is between two writes of this frontend: leave the call as it is.
                return ALLOW;
            };
            if sticky {
                let _ = CALIX_SVC_FWD.insert(&fk, &bk, 0);
            }
            count(&k, true);
            b
        }
    };
    if b.family != k.family {
        return ALLOW;
    }
    set_dest(ctx, v6, &b.addr, b.port);
    let rk = SvcRevKey {
        cookie,
        addr: b.addr,
        port: b.port,
        family: k.family,
        ..SvcRevKey::default()
    };
    let rv = SvcRevValue {
        addr: to.addr,
        port: to.port,
        _pad: 0,
    };
    // A full table forgets the least recently used: that socket's peer then shows as the
    // backend, its traffic unaffected.
    let _ = CALIX_SVC_REV.insert(&rk, &rv, 0);
    ALLOW
}

/// Counts a connection sent to a backend of frontend `k` (`connected`), or one refused, in
/// this CPU's entry (added the first time: the LRU bounds the map).
#[inline(always)]
fn count(k: &SvcKey, connected: bool) {
    let c = match CALIX_SVC_COUNT.get_ptr_mut(k) {
        Some(c) => c,
        None => {
            // BPF_NOEXIST (1): another CPU's call may have added it meanwhile.
            let mut zero = core::mem::MaybeUninit::<SvcCounters>::uninit();
            // SAFETY: a local of `u64`s (8-byte aligned), all zero once written: a valid value
            // (`SvcCounters::default()` compiles to a call of the byte-wise `memset`).
            let zero = unsafe {
                packet::zero_words(zero.as_mut_ptr());
                zero.assume_init_ref()
            };
            let _ = CALIX_SVC_COUNT.insert(k, zero, 1);
            match CALIX_SVC_COUNT.get_ptr_mut(k) {
                Some(c) => c,
                None => return,
            }
        }
    };
    // SAFETY: this CPU's value of a per-CPU map, which no other CPU writes.
    unsafe {
        if connected {
            (*c).connections += 1;
        } else {
            (*c).refused += 1;
        }
    }
}

/// The frontend `to` names and its key: its own, else (`to` a node's address) the NodePort of
/// its port, keyed with the unspecified address.
#[inline(always)]
fn frontend(to: &SvcKey) -> Option<(SvcKey, SvcValue)> {
    // SAFETY: a read-only lookup; the value is copied out at once.
    if let Some(v) = unsafe { CALIX_SVC_FRONTS.get(to) } {
        return Some((*to, *v));
    }
    // Neither key's zero bytes are written as bytes (that compiles to a call of the byte-wise
    // `memset`): the node key is built from 4-byte words, the any-address key's address
    // zeroed in 8-byte words.
    let a = &to.addr;
    let word = |i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
    let family = u32::from_ne_bytes([to.family, 0, 0, 0]);
    const _: () =
        assert!(core::mem::size_of::<SvcNodeKey>() == 20 && core::mem::size_of::<SvcKey>() == 20);
    // SAFETY: 20 bytes of plain data either way (checked above): the address, then the
    // family and three zero bytes of padding.
    let node: SvcNodeKey =
        unsafe { core::mem::transmute([word(0), word(4), word(8), word(12), family]) };
    // SAFETY: a read-only lookup.
    unsafe { CALIX_SVC_NODES.get(&node) }?;
    /// 8-byte alignment for a key on the stack, so that its address is zeroed in words.
    #[repr(C, align(8))]
    struct Aligned(SvcKey);
    let mut any = Aligned(*to);
    // SAFETY: the address is 16 bytes of plain data at the start of the 8-byte aligned
    // wrapper.
    unsafe { packet::zero_words(&mut any.0.addr) };
    // SAFETY: a read-only lookup; the value is copied out at once.
    unsafe { CALIX_SVC_FRONTS.get(&any.0) }.map(|v| (any.0, *v))
}

#[inline(always)]
fn backend(bk: &SvcBackendKey) -> Option<SvcBackend> {
    // SAFETY: a read-only lookup; the value is copied out at once.
    unsafe { CALIX_SVC_BACKS.get(bk) }.copied()
}

#[inline(always)]
fn same(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let mut d = 0u8;
    for i in 0..16 {
        d |= a[i] ^ b[i];
    }
    d == 0
}

/// The backend a new connection of this socket to `front` goes to. Without session affinity,
/// any. With it (`sessionAffinity: ClientIP`; the client is the socket's network namespace:
/// a pod, or the node's own processes), the one this client was last sent to, while it is
/// still one of the frontend's (found by address and port among the first
/// [`SVC_AFFINITY_SCAN`] once they changed) and its last connection is more recent than the
/// timeout; else any, remembered. `None`: the agent is between two writes of the frontend.
#[inline(always)]
fn pick(
    ctx: &SockAddrContext,
    k: &SvcKey,
    front: &SvcValue,
) -> Option<(SvcBackendKey, SvcBackend)> {
    // SAFETY: a helper without arguments.
    let index = unsafe { bpf_get_prandom_u32() } % front.count;
    let any = SvcBackendKey {
        id: front.id,
        index,
    };
    if front.affinity_secs == 0 {
        return backend(&any).map(|b| (any, b));
    }
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.sock_addr as *mut _) };
    let ak = SvcAffKey {
        netns,
        front: *k,
        _pad: 0,
    };
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let timeout = u64::from(front.affinity_secs) * 1_000_000_000;
    // SAFETY: a read-only lookup; the value is copied out at once.
    let kept = unsafe { CALIX_SVC_AFF.get(&ak) }
        .copied()
        .filter(|a| now.wrapping_sub(a.seen_ns) < timeout)
        .and_then(|a| find(front, &a));
    let (bk, b) = match kept {
        Some(x) => x,
        None => (any, backend(&any)?),
    };
    let v = SvcAffValue {
        seen_ns: now,
        id: bk.id,
        index: bk.index,
        addr: b.addr,
        port: b.port,
        ..SvcAffValue::default()
    };
    // A full table forgets the least recently used client: its next connection picks again.
    let _ = CALIX_SVC_AFF.insert(&ak, &v, 0);
    Some((bk, b))
}

/// Where `a`'s backend is among `front`'s now, if it still is.
#[inline(always)]
fn find(front: &SvcValue, a: &SvcAffValue) -> Option<(SvcBackendKey, SvcBackend)> {
    let is = |b: &SvcBackend| b.port == a.port && same(&b.addr, &a.addr);
    if a.id == front.id && a.index < front.count {
        let bk = SvcBackendKey {
            id: a.id,
            index: a.index,
        };
        return backend(&bk).filter(is).map(|b| (bk, b));
    }
    for index in 0..SVC_AFFINITY_SCAN {
        if index >= front.count {
            break;
        }
        let bk = SvcBackendKey {
            id: front.id,
            index,
        };
        if let Some(b) = backend(&bk).filter(is) {
            return Some((bk, b));
        }
    }
    None
}

/// `recvmsg` (and `getpeername` for connected UDP): a backend's reply shows the frontend it
/// stands for as its source.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, v6: bool) -> i32 {
    let Some(k) = key(ctx, v6) else {
        return ALLOW;
    };
    // SAFETY: the helper takes the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let rk = SvcRevKey {
        cookie,
        addr: k.addr,
        port: k.port,
        family: k.family,
        ..SvcRevKey::default()
    };
    // SAFETY: a read-only lookup; the value is copied out at once.
    if let Some(front) = (unsafe { CALIX_SVC_REV.get(&rk) }).copied() {
        set_dest(ctx, v6, &front.addr, front.port);
    }
    ALLOW
}
