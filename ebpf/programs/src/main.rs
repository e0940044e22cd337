//! calix eBPF programs. Entries only: each one names where it attaches and hands the packet to
//! its `try_*` function in the module of the same name.
//!
//! Verdicts: the agent attaches cls_bpf direct-action filters (clsact). `TC_ACT_OK` lets the
//! packet continue into the stack; `TC_ACT_SHOT` drops it (only through `counters::drop`, which
//! records the reason); `TC_ACT_REDIRECT` comes from the redirect helpers. A helper error fails
//! open (`TC_ACT_OK`): the host stack then handles the packet as it would without calix.
//! `xdp_host_dev` (XDP on the uplinks) answers `XDP_PASS` or, through `counters::drop_xdp`,
//! `XDP_DROP`.
#![no_std]
#![no_main]
// Atomic adds on map values (the BPF target has no `core::sync::atomic` integers).
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod bits;
mod conntrack;
mod counters;
mod doors;
mod flows;
mod forward;
mod from_pod;
mod host_dev;
mod maps;
mod nat;
mod nodeport;
mod nodeport6;
mod packet;
mod policy;
mod services;
mod to_pod;
mod xdp;

use aya_ebpf::{
    bindings::TC_ACT_OK,
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};

/// tc ingress on each host-side `cali*` veth: packets the pod sends.
#[classifier]
pub fn from_pod(mut ctx: TcContext) -> i32 {
    // Fail open: a helper error must never cost the pod its traffic.
    match from_pod::try_from_pod(&mut ctx) {
        Ok(verdict) => verdict,
        Err(_) => TC_ACT_OK,
    }
}

/// tc egress on each host-side `cali*` veth: packets the host delivers to the pod.
#[classifier]
pub fn to_pod(mut ctx: TcContext) -> i32 {
    // Fail open, as in `from_pod`.
    match to_pod::try_to_pod(&mut ctx) {
        Ok(verdict) => verdict,
        Err(_) => TC_ACT_OK,
    }
}

/// tc ingress on the node's uplink: packets from other nodes.
#[classifier]
pub fn from_host_dev(mut ctx: TcContext) -> i32 {
    match host_dev::try_from_host_dev(&mut ctx) {
        Ok(verdict) => verdict,
        Err(_) => TC_ACT_OK,
    }
}

/// tc egress on the node's uplink: packets leaving the node.
#[classifier]
pub fn to_host_dev(mut ctx: TcContext) -> i32 {
    match host_dev::try_to_host_dev(&mut ctx) {
        Ok(verdict) => verdict,
        Err(_) => TC_ACT_OK,
    }
}

/// XDP on the node's uplink, before the host stack allocates anything: the prefilter (deny
/// list by source, malformed IP headers, failsafe ports).
#[xdp(frags)]
pub fn xdp_host_dev(ctx: XdpContext) -> u32 {
    xdp::try_xdp_host_dev(&ctx)
}

// The ELF symbol of each entry is its program name; the agent looks them up by these consts.
const _: () = assert!(str_eq(calix_common::PROG_FROM_POD, "from_pod"));
const _: () = assert!(str_eq(calix_common::PROG_TO_POD, "to_pod"));
const _: () = assert!(str_eq(calix_common::PROG_FROM_HOST_DEV, "from_host_dev"));
const _: () = assert!(str_eq(calix_common::PROG_TO_HOST_DEV, "to_host_dev"));
const _: () = assert!(str_eq(calix_common::PROG_XDP_HOST_DEV, "xdp_host_dev"));

/// `&str` equality usable in `const` context (for the name checks above and in `maps`).
pub(crate) use calix_common::str_eq;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable path into here, so this is never executed.
    loop {}
}

/// cgroup `connect4`: TCP and connected UDP to a Service's IPv4 frontend go to a backend.
#[cgroup_sock_addr(connect4)]
pub fn svc_connect4(ctx: SockAddrContext) -> i32 {
    services::translate(&ctx, false, false)
}

/// cgroup `connect6`: as `svc_connect4`, IPv6.
#[cgroup_sock_addr(connect6)]
pub fn svc_connect6(ctx: SockAddrContext) -> i32 {
    services::translate(&ctx, true, false)
}

/// cgroup `sendmsg4`: an unconnected UDP datagram to an IPv4 frontend goes to a backend.
#[cgroup_sock_addr(sendmsg4)]
pub fn svc_sendmsg4(ctx: SockAddrContext) -> i32 {
    services::translate(&ctx, false, true)
}

/// cgroup `sendmsg6`: as `svc_sendmsg4`, IPv6.
#[cgroup_sock_addr(sendmsg6)]
pub fn svc_sendmsg6(ctx: SockAddrContext) -> i32 {
    services::translate(&ctx, true, true)
}

/// cgroup `recvmsg4`: a backend's UDP reply shows the frontend as its source.
#[cgroup_sock_addr(recvmsg4)]
pub fn svc_recvmsg4(ctx: SockAddrContext) -> i32 {
    services::reverse(&ctx, false)
}

/// cgroup `recvmsg6`: as `svc_recvmsg4`, IPv6.
#[cgroup_sock_addr(recvmsg6)]
pub fn svc_recvmsg6(ctx: SockAddrContext) -> i32 {
    services::reverse(&ctx, true)
}

/// cgroup `getpeername4`: a translated socket names the frontend as its peer.
#[cgroup_sock_addr(getpeername4)]
pub fn svc_getpeername4(ctx: SockAddrContext) -> i32 {
    services::reverse(&ctx, false)
}

/// cgroup `getpeername6`: as `svc_getpeername4`, IPv6.
#[cgroup_sock_addr(getpeername6)]
pub fn svc_getpeername6(ctx: SockAddrContext) -> i32 {
    services::reverse(&ctx, true)
}
