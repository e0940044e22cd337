//! Traffic the pod sends (tc ingress on the host-side veth).

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, programs::TcContext};

use crate::counters;

pub fn try_from_pod(ctx: &TcContext) -> Result<i32, c_long> {
    let len = u64::from(ctx.len());
    counters::update(ctx, |c| {
        c.from_pod_packets = c.from_pod_packets.wrapping_add(1);
        c.from_pod_bytes = c.from_pod_bytes.wrapping_add(len);
    });
    Ok(TC_ACT_OK)
}
