//! Per-endpoint packet and byte counters.

use aya_ebpf::programs::TcContext;
use calix_common::EndpointCounters;

use crate::maps::CALIX_COUNTERS;

/// Applies `f` to the counters of the endpoint whose host-side veth the packet is on, if the
/// agent registered it. Never creates an entry: an unknown ifindex is simply not counted.
#[inline(always)]
pub fn update(ctx: &TcContext, f: impl FnOnce(&mut EndpointCounters)) {
    // SAFETY: `ctx.skb.skb` is the `__sk_buff` the kernel passed to this program; reading a
    // field of it is a plain context access the verifier checks.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    if let Some(value) = CALIX_COUNTERS.get_ptr_mut(&ifindex) {
        // SAFETY: the pointer comes from a successful lookup, and the value stays valid until
        // the program returns. A per-CPU value belongs to this CPU and a BPF program runs to
        // completion without migrating, so nothing else writes it meanwhile.
        f(unsafe { &mut *value });
    }
}
