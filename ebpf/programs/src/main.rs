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

mod conntrack;
mod counters;
mod doors;
mod flows;
mod forward;
mod from_pod;
mod host_dev;
mod maps;
mod nat;
mod packet;
mod policy;
mod to_pod;
mod xdp;

use aya_ebpf::{
    bindings::TC_ACT_OK,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
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
