//! calix eBPF programs. Entries only: each one names where it attaches and hands the packet to
//! its `try_*` function in the module of the same name.
//!
//! Verdicts: the agent attaches with TCX where the kernel has it (6.6+), else with a cls_bpf
//! direct-action filter. `TC_ACT_OK` (0, `TCX_PASS`) lets the packet continue into the stack and
//! ends the hook's program chain; `TC_ACT_UNSPEC` (-1, `TCX_NEXT`) would defer to whatever is
//! attached after us, which is not what a dataplane that owns `cali*` veths wants.
#![no_std]
#![no_main]

mod counters;
mod from_pod;
mod maps;
mod to_pod;

use aya_ebpf::{bindings::TC_ACT_OK, macros::classifier, programs::TcContext};

/// tc ingress on each host-side `cali*` veth: packets the pod sends.
#[classifier]
pub fn from_pod(ctx: TcContext) -> i32 {
    // Fail open: a helper error while counting must never cost the pod its traffic.
    match from_pod::try_from_pod(&ctx) {
        Ok(verdict) => verdict,
        Err(_) => TC_ACT_OK,
    }
}

/// tc egress on each host-side `cali*` veth: packets the host delivers to the pod.
#[classifier]
pub fn to_pod(ctx: TcContext) -> i32 {
    // Fail open, as in `from_pod`.
    match to_pod::try_to_pod(&ctx) {
        Ok(verdict) => verdict,
        Err(_) => TC_ACT_OK,
    }
}

// The ELF symbol of each entry is its program name; the agent looks them up by these consts.
const _: () = assert!(str_eq(calix_common::PROG_FROM_POD, "from_pod"));
const _: () = assert!(str_eq(calix_common::PROG_TO_POD, "to_pod"));

/// `&str` equality usable in `const` context (for the name checks above and in `maps`).
pub(crate) const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable path into here, so this is never executed.
    loop {}
}
