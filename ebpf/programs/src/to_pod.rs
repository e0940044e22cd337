//! Traffic the host stack delivers to the pod (tc egress on the host-side `cali*` veth).
//! Traffic redirected by `from_pod`/`from_host_dev` skips this hook and is counted there.
//! A packet another pod of this node sent to a Service address meets that pod's egress policy
//! here first, after the stack's DNAT chose this pod as the backend.

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, programs::TcContext};
use calix_common::{policy_pending_slot, DropReason};

use crate::packet::{self, ETH_P_IP, ETH_P_IPV6};
use crate::{counters, flows, policy};

pub fn try_to_pod(ctx: &mut TcContext) -> Result<i32, c_long> {
    // SAFETY: a plain context access the verifier checks.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: as above.
    if let Some(sender) = policy_pending_slot(unsafe { (*ctx.skb.skb).mark }) {
        ctx.set_mark(0);
        if !policy::after_nat(ctx.skb.skb, sender) {
            policy::report_denied(sender, calix_common::POL_DIR_EGRESS);
            // Counted on the sender's veth (where the stack received it).
            // SAFETY: as above.
            let sender_if = unsafe { (*ctx.skb.skb).ingress_ifindex };
            return Ok(counters::drop(ctx, sender_if, DropReason::PolicyEgress));
        }
    }
    // An interface the agent has not (or no longer) registered: nothing to count or record.
    // SAFETY: a plain read of a value from a successful lookup.
    let Some(slot) = crate::maps::endpoint(ifindex).map(|e| unsafe { (*e).slot }) else {
        return Ok(TC_ACT_OK);
    };
    // SAFETY: as above. A packet the node itself sent (no input interface: it was not
    // forwarded): always allowed (kubelet probes), its flow remembered for the pod's policy;
    // its replies go to the node's own address, never the fast path: no stack flow to record.
    if unsafe { (*ctx.skb.skb).ingress_ifindex } == 0 {
        if policy::isolated(slot) {
            policy::from_node(ctx.skb.skb, slot);
        }
        counters::to_pod(slot, u64::from(ctx.len()));
        return Ok(TC_ACT_OK);
    }
    if policy::isolated(slot) && !policy::ingress(ctx.skb.skb, slot, 0) {
        policy::report_denied(slot, calix_common::POL_DIR_INGRESS);
        return Ok(counters::drop(ctx, ifindex, DropReason::PolicyIngress));
    }
    counters::to_pod(slot, u64::from(ctx.len()));
    // The stack delivered this flow: its replies must go back through the stack.
    let key = match packet::ethertype(ctx)? {
        ETH_P_IP => packet::ipv4(ctx)
            .and_then(|ip| Some((flows::key_v4(ctx, &ip, false)?, flows::closing_v4(ctx, &ip)))),
        ETH_P_IPV6 => packet::ipv6(ctx)
            .and_then(|ip| Some((flows::key_v6(ctx, &ip, false)?, flows::closing_v6(ctx, &ip)))),
        _ => None,
    };
    if let Some((k, closing)) = key {
        flows::record(&k, slot, closing);
    }
    Ok(TC_ACT_OK)
}
