//! Traffic the host stack delivers to the pod (tc egress on the host-side `cali*` veth).
//! Traffic redirected by `from_pod`/`from_host_dev` skips this hook and is counted there.

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, programs::TcContext};

use crate::counters;

pub fn try_to_pod(ctx: &TcContext) -> Result<i32, c_long> {
    // SAFETY: a plain context access the verifier checks.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    counters::to_pod(ifindex, u64::from(ctx.len()));
    Ok(TC_ACT_OK)
}
