//! Traffic delivered to the pod (tc egress on the host-side veth).

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, programs::TcContext};

use crate::counters;

pub fn try_to_pod(ctx: &TcContext) -> Result<i32, c_long> {
    let len = u64::from(ctx.len());
    counters::update(ctx, |c| {
        c.to_pod_packets = c.to_pod_packets.wrapping_add(1);
        c.to_pod_bytes = c.to_pod_bytes.wrapping_add(len);
    });
    Ok(TC_ACT_OK)
}
