//! Per-endpoint packet and byte counters (a per-CPU array indexed by the endpoint's slot), and
//! the one drop path (tc and XDP).

use aya_ebpf::{
    bindings::{xdp_action::XDP_DROP, TC_ACT_SHOT},
    programs::TcContext,
};
use calix_common::{DropCount, DropKey, DropReason, EndpointCounters};

use crate::maps::{CALIX_COUNTERS, CALIX_DROPS};

/// Applies `f` to the counters of the endpoint in `slot` (from its `EndpointInfo` or
/// `LocalEndpoint`). A slot past the array is not counted.
#[inline(always)]
pub fn update(slot: u32, f: impl FnOnce(&mut EndpointCounters)) {
    if let Some(value) = CALIX_COUNTERS.get_ptr_mut(slot) {
        // SAFETY: the pointer comes from a successful lookup, and the value stays valid until
        // the program returns. A per-CPU value belongs to this CPU and a BPF program runs to
        // completion without migrating, so nothing else writes it meanwhile.
        f(unsafe { &mut *value });
    }
}

/// Counts a packet the pod sent.
#[cfg_attr(feature = "bench-floor", allow(dead_code))]
#[inline(always)]
pub fn from_pod(slot: u32, len: u64) {
    update(slot, |c| {
        c.from_pod_packets = c.from_pod_packets.wrapping_add(1);
        c.from_pod_bytes = c.from_pod_bytes.wrapping_add(len);
    });
}

/// Counts a packet delivered to the pod in `slot`.
#[inline(always)]
pub fn to_pod(slot: u32, len: u64) {
    update(slot, |c| {
        c.to_pod_packets = c.to_pod_packets.wrapping_add(1);
        c.to_pod_bytes = c.to_pod_bytes.wrapping_add(len);
    });
}

/// The one drop path: counts the packet under (ifindex, reason) and returns the drop verdict.
#[inline(always)]
pub fn drop(ctx: &TcContext, ifindex: u32, reason: DropReason) -> i32 {
    count_drop(ifindex, reason as u32, u64::from(ctx.len()));
    TC_ACT_SHOT
}

/// The one drop path of XDP programs: counts the frame (`len` bytes) under (ifindex, reason)
/// and returns `XDP_DROP`.
#[inline(always)]
pub fn drop_xdp(ifindex: u32, reason: DropReason, len: u64) -> u32 {
    count_drop(ifindex, reason as u32, len);
    XDP_DROP
}

/// Adds one packet of `len` bytes to the drop counter (ifindex, reason). A function of its
/// own (a BPF-to-BPF call), not inlined at every drop site: drops are the cold path, and one
/// copy keeps the programs' hot paths short and close together.
#[inline(never)]
fn count_drop(ifindex: u32, reason: u32, len: u64) {
    let key = DropKey { ifindex, reason };
    match CALIX_DROPS.get_ptr_mut(&key) {
        // SAFETY: as in `update`: a per-CPU value from a successful lookup.
        Some(v) => unsafe {
            (*v).packets = (*v).packets.wrapping_add(1);
            (*v).bytes = (*v).bytes.wrapping_add(len);
        },
        None => {
            // First drop of this kind here. If another CPU created the key meanwhile the
            // insert fails and this one packet goes uncounted on this CPU's first try: retry.
            let first = DropCount {
                packets: 1,
                bytes: len,
            };
            if CALIX_DROPS
                .insert(&key, &first, 1 /* BPF_NOEXIST */)
                .is_err()
            {
                if let Some(v) = CALIX_DROPS.get_ptr_mut(&key) {
                    // SAFETY: as above.
                    unsafe {
                        (*v).packets = (*v).packets.wrapping_add(1);
                        (*v).bytes = (*v).bytes.wrapping_add(len);
                    }
                }
            }
        }
    }
}

/// The `upgrade-test` build: counts each packet from a pod under reason 255 without dropping
/// it, so a test can tell which build's program runs.
#[cfg(feature = "upgrade-test")]
#[inline(always)]
pub fn mark_upgrade_build(ctx: &TcContext, ifindex: u32) {
    count_drop(
        ifindex,
        calix_common::UPGRADE_TEST_MARK,
        u64::from(ctx.len()),
    );
}
