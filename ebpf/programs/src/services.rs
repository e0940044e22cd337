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
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use calix_common::{
    SvcBackendKey, SvcFwdKey, SvcKey, SvcRevKey, SvcRevValue, SVC_DROP, SVC_REJECT, SVC_V4,
    SVC_V6,
};

use crate::maps::{CALIX_SVC_BACKS, CALIX_SVC_FRONTS, CALIX_SVC_FWD, CALIX_SVC_REV};

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
    let mut k = SvcKey {
        port: sa.user_port as u16,
        proto,
        family: if v6 { SVC_V6 } else { SVC_V4 },
        ..SvcKey::default()
    };
    if v6 {
        for i in 0..4 {
            k.addr[i * 4..i * 4 + 4].copy_from_slice(&sa.user_ip6[i].to_ne_bytes());
        }
    } else {
        k.addr[..4].copy_from_slice(&sa.user_ip4.to_ne_bytes());
    }
    Some(k)
}

/// Writes `addr`/`port` (network order, as stored) as the call's destination.
#[inline(always)]
fn set_dest(ctx: &SockAddrContext, v6: bool, addr: &[u8; 16], port: u16) {
    // SAFETY: as in `key`; these fields are writable in connect, sendmsg, recvmsg and
    // getpeername programs.
    let sa = unsafe { &mut *ctx.sock_addr };
    if v6 {
        for i in 0..4 {
            sa.user_ip6[i] =
                u32::from_ne_bytes([addr[i * 4], addr[i * 4 + 1], addr[i * 4 + 2], addr[i * 4 + 3]]);
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
    let Some(k) = key(ctx, v6) else {
        return ALLOW;
    };
    // SAFETY: a read-only lookup; the value is copied out at once.
    let Some(front) = (unsafe { CALIX_SVC_FRONTS.get(&k) }).copied() else {
        return ALLOW;
    };
    if front.flags & (SVC_REJECT | SVC_DROP) != 0 || front.count == 0 {
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
    } else {
        None
    };
    let bk = match earlier {
        Some(b) => b,
        None => {
            // SAFETY: a helper without arguments.
            let index = unsafe { bpf_get_prandom_u32() } % front.count;
            let bk = SvcBackendKey {
                id: front.id,
                index,
            };
            if sticky {
                let _ = CALIX_SVC_FWD.insert(&fk, &bk, 0);
            }
            bk
        }
    };
    // SAFETY: as above.
    let Some(b) = (unsafe { CALIX_SVC_BACKS.get(&bk) }).copied() else {
        // The agent is between two writes of this frontend: leave the call as it is.
        return ALLOW;
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
        addr: k.addr,
        port: k.port,
        _pad: 0,
    };
    // A full table forgets the least recently used: that socket's peer then shows as the
    // backend, its traffic unaffected.
    let _ = CALIX_SVC_REV.insert(&rk, &rv, 0);
    ALLOW
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
