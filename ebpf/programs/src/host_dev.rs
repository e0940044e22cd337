//! The node's uplink. `from_host_dev` (tc ingress): traffic from other nodes to a pod here goes
//! straight into the pod (`bpf_redirect_peer`) instead of through the host's routing;
//! everything else continues into the host stack. `to_host_dev` (tc egress): traffic leaving
//! the node; passes (SNAT will hook in here).

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, programs::TcContext};

use crate::forward;
use crate::maps::{CALIX_LOCAL_V4, CALIX_LOCAL_V6};
use crate::packet::{self, ETH_P_IP, ETH_P_IPV6};

pub fn try_from_host_dev(ctx: &mut TcContext) -> Result<i32, c_long> {
    match packet::ethertype(ctx)? {
        ETH_P_IP => {
            // Malformed packets from the wire are the host stack's (and XDP's) to judge.
            let Some(ip) = packet::ipv4(ctx) else {
                return Ok(TC_ACT_OK);
            };
            match CALIX_LOCAL_V4.get_ptr(&ip.dst) {
                // SAFETY: a pointer from a successful lookup, valid until the program returns.
                Some(local) => forward::to_local(ctx, &unsafe { *local }, true),
                None => Ok(TC_ACT_OK),
            }
        }
        ETH_P_IPV6 => {
            let Some(ip) = packet::ipv6(ctx) else {
                return Ok(TC_ACT_OK);
            };
            match CALIX_LOCAL_V6.get_ptr(&ip.dst) {
                // SAFETY: as above.
                Some(local) => forward::to_local(ctx, &unsafe { *local }, false),
                None => Ok(TC_ACT_OK),
            }
        }
        _ => Ok(TC_ACT_OK),
    }
}

pub fn try_to_host_dev(_ctx: &TcContext) -> Result<i32, c_long> {
    Ok(TC_ACT_OK)
}
