//! Per-endpoint packet and byte counters.

use aya_ebpf::programs::TcContext;
use calix_common::EndpointCounters;

use crate::maps::CALIX_COUNTERS;

/// The counters of the endpoint whose host-side veth the packet is on, if the agent registered
/// it. Never creates an entry: an unknown ifindex is simply not counted.
#[inline(always)]
pub fn endpoint(ctx: &TcContext) -> Option<&mut EndpointCounters> {
    // SAFETY: `ctx.skb.skb` is the `__sk_buff` the kernel passed to this program; reading a
    // field of it is a plain context access the verifier checks.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let value = CALIX_COUNTERS.get_ptr_mut(&ifindex)?;
    // SAFETY: a per-CPU map value belongs to this CPU, and a BPF program runs to completion
    // without migrating, so nothing else touches it while this reference lives.
    Some(unsafe { &mut *value })
}
