//! The node's uplink. `from_host_dev` (tc ingress): traffic from other nodes to a pod here goes
//! straight into the pod (`bpf_redirect_peer`) instead of through the host's routing — unless
//! it is the reply of a flow the host stack routed out (it may have NATed it: a service whose
//! backend is on another node), which goes back through the stack; and a client outside
//! reaching a NodePort, an external or LoadBalancer address goes to its backend (`nodeport`).
//! `to_host_dev` (tc egress): records those stack-routed pod flows, translates the replies of
//! Service flows from outside whose backend is on another node (`nodeport`), and judges what a
//! pod of this node sent to a Service address against the backend the stack's DNAT chose (the
//! pod's egress policy).

use aya_ebpf::{bindings::TC_ACT_OK, cty::c_long, programs::TcContext};

use crate::maps::{CALIX_HOST_V4, CALIX_HOST_V6, CALIX_LOCAL_V4, CALIX_LOCAL_V6, CALIX_NAT_CFG};
use crate::packet::{self, Ipv4, Ipv6, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_UDP};
use crate::{flows, forward, nodeport};

pub fn try_from_host_dev(ctx: &mut TcContext) -> Result<i32, c_long> {
    match packet::ethertype(ctx)? {
        ETH_P_IP => {
            // Malformed packets from the wire are the host stack's (and XDP's) to judge.
            let Some(ip) = packet::ipv4(ctx) else {
                return Ok(TC_ACT_OK);
            };
            if tunnel_v4(ctx, &ip) {
                return Ok(TC_ACT_OK);
            }
            // A pod here first: replies of SNATed flows are addressed to the node, never to a
            // pod, so pod traffic from other nodes skips the NAT lookup.
            // SAFETY: a pointer from a successful lookup, valid until the program returns.
            if let Some(local) = CALIX_LOCAL_V4.get_ptr(&ip.dst).map(|l| unsafe { &*l }) {
                if !flows::fast_path_ok(local.slot, flows::has_ports_v4(&ip), || {
                    flows::key_v4(ctx, &ip, false)
                }) {
                    return Ok(TC_ACT_OK);
                }
                return forward::to_local(
                    ctx,
                    local,
                    forward::Ttl::of_v4(&ip),
                    forward::Sent::NOTHING,
                );
            }
            // Replies of SNATed flows (and ICMP errors about them) go back to their pod.
            if let Some(verdict) = crate::nat::reverse_v4(ctx, &ip)? {
                return Ok(verdict);
            }
            // A client outside reaching a Service here.
            match crate::nodeport::from_outside_v4(ctx, &ip)? {
                nodeport::TO_LOCAL => {
                    // Translated: the destination is the backend's, and so is the checksum.
                    let (dst, csum) = (ctx.load(nodeport::IP_DST)?, ctx.load(nodeport::IP_CSUM)?);
                    // SAFETY: a pointer from a successful lookup, valid until the program
                    // returns.
                    match CALIX_LOCAL_V4.get_ptr(&dst).map(|l| unsafe { &*l }) {
                        Some(local) => {
                            let ttl = forward::Ttl::V4 {
                                ttl: ip.ttl,
                                proto: ip.proto,
                                csum,
                            };
                            forward::to_local(ctx, local, ttl, forward::Sent::NOTHING)
                        }
                        None => Ok(TC_ACT_OK),
                    }
                }
                verdict => Ok(outside_verdict(ctx, verdict)),
            }
        }
        ETH_P_IPV6 => {
            let Some(ip) = packet::ipv6(ctx) else {
                return Ok(TC_ACT_OK);
            };
            if tunnel_v6(ctx, &ip) {
                return Ok(TC_ACT_OK);
            }
            // SAFETY: as above.
            let local = match CALIX_LOCAL_V6.get_ptr(&ip.dst).map(|l| unsafe { &*l }) {
                Some(local) => {
                    if !flows::fast_path_ok(local.slot, flows::has_ports_v6(&ip), || {
                        flows::key_v6(ctx, &ip, false)
                    }) {
                        return Ok(TC_ACT_OK);
                    }
                    local
                }
                // A client outside reaching a Service here; a backend here is delivered as a
                // pod's packet is (one delivery in this frame, which is near the verifier's
                // 512 bytes).
                None => match crate::nodeport6::from_outside(ctx, crate::nodeport6::Head::of(&ip))?
                {
                    // SAFETY: as above.
                    nodeport::TO_LOCAL => {
                        match crate::nodeport6::local_dst(ctx).map(|l| unsafe { &*l }) {
                            Some(local) => local,
                            None => return Ok(TC_ACT_OK),
                        }
                    }
                    verdict => return Ok(outside_verdict(ctx, verdict)),
                },
            };
            forward::to_local(ctx, local, forward::Ttl::of_v6(&ip), forward::Sent::NOTHING)
        }
        _ => Ok(TC_ACT_OK),
    }
}

/// The VXLAN port as in the packet (`NatConfig::tunnel_port`), when the agent set one.
#[inline(always)]
fn tunnel_port() -> Option<u16> {
    CALIX_NAT_CFG
        .get(0)
        .map(|c| c.tunnel_port)
        .filter(|p| *p != 0)
}

/// Whether the packet is VXLAN for this node (UDP to the tunnel port at one of the node's own
/// addresses): the kernel's VXLAN socket decapsulates it, and its inner packet meets this
/// program again on `vxlan.calix`. Nothing of calix's is for it — no pod, no SNAT reply (the
/// port is none of NAT's), no Service (a Service on that port of a node's address would take
/// VXLAN's packets) — so it passes before any of their lookups: every packet of every other
/// node's pods comes this way, one per segment where the uplink does no GRO.
#[inline(always)]
fn tunnel_v4(ctx: &TcContext, ip: &Ipv4) -> bool {
    const DPORT: usize = ETH_HLEN + 20 + 2;
    if ip.proto != IPPROTO_UDP || ip.ihl != 20 || ip.tot_len < 28 || ip.fragment() {
        return false;
    }
    tunnel_port().is_some_and(|port| {
        packet::load::<u16>(ctx, DPORT).is_ok_and(|p| p == port)
            && CALIX_HOST_V4.get_ptr(&ip.dst).is_some()
    })
}

/// As [`tunnel_v4`], for VXLAN over IPv6 (UDP right after the fixed header).
#[inline(always)]
fn tunnel_v6(ctx: &TcContext, ip: &Ipv6) -> bool {
    const DPORT: usize = ETH_HLEN + packet::v6::LEN + 2;
    if ip.next_hdr != IPPROTO_UDP || ip.payload_len < 8 {
        return false;
    }
    tunnel_port().is_some_and(|port| {
        packet::load::<u16>(ctx, DPORT).is_ok_and(|p| p == port)
            && CALIX_HOST_V6.get_ptr(&ip.dst).is_some()
    })
}

/// What `from_outside` said of a packet other than a local backend: not ours (the stack's),
/// `Local` with no endpoint here (dropped and counted), or a tc verdict.
#[inline(always)]
fn outside_verdict(ctx: &mut TcContext, verdict: i32) -> i32 {
    match verdict {
        nodeport::NOT_OURS_VERDICT => TC_ACT_OK,
        nodeport::NO_LOCAL_ENDPOINT => {
            // SAFETY: a plain context access the verifier checks.
            let uplink = unsafe { (*ctx.skb.skb).ifindex };
            crate::counters::drop(
                ctx,
                uplink,
                calix_common::DropReason::ServiceNoLocalEndpoint,
            )
        }
        verdict => verdict,
    }
}

pub fn try_to_host_dev(ctx: &mut TcContext) -> Result<i32, c_long> {
    // SAFETY: a plain context access the verifier checks.
    let mark = unsafe { (*ctx.skb.skb).mark };
    if mark == calix_common::FAST_PATH_MARK {
        ctx.set_mark(0);
        return Ok(TC_ACT_OK);
    }
    if let Some(sender) = calix_common::policy_pending_slot(mark) {
        // Cleared here: a VXLAN device's packet keeps its mark into the uplink's hook.
        ctx.set_mark(0);
        if !crate::policy::after_nat(ctx.skb.skb, sender) {
            crate::policy::report_denied(sender, calix_common::POL_DIR_EGRESS);
            // Counted on the sender's veth (where the stack received it).
            // SAFETY: a plain context access the verifier checks.
            let sender_if = unsafe { (*ctx.skb.skb).ingress_ifindex };
            return Ok(crate::counters::drop(
                ctx,
                sender_if,
                calix_common::DropReason::PolicyEgress,
            ));
        }
    }
    // A remote backend's reply to a client outside, which the stack took back from its
    // masquerade: from the frontend.
    match packet::ethertype(ctx)? {
        ETH_P_IP => {
            if let Some(ip) = packet::ipv4(ctx) {
                crate::nodeport::reply_after_stack_v4(ctx, &ip)?;
            }
        }
        ETH_P_IPV6 => {
            if let Some(ip) = packet::ipv6(ctx) {
                crate::nodeport6::reply_after_stack(ctx, crate::nodeport6::Head::of(&ip))?;
            }
        }
        _ => {}
    }
    // A local pod's flow the stack routed out: its replies must come back through the stack.
    // SAFETY (both lookups): a pointer from a successful lookup, valid until the program
    // returns.
    let key = match packet::ethertype(ctx)? {
        ETH_P_IP => packet::ipv4(ctx).and_then(|ip| {
            let slot = unsafe { (*CALIX_LOCAL_V4.get_ptr(&ip.src)?).slot };
            let closing = flows::closing_v4(ctx, &ip);
            Some((flows::key_v4(ctx, &ip, true)?, slot, closing))
        }),
        ETH_P_IPV6 => packet::ipv6(ctx).and_then(|ip| {
            let slot = unsafe { (*CALIX_LOCAL_V6.get_ptr(&ip.src)?).slot };
            let closing = flows::closing_v6(ctx, &ip);
            Some((flows::key_v6(ctx, &ip, true)?, slot, closing))
        }),
        _ => None,
    };
    if let Some((k, slot, closing)) = key {
        flows::record(&k, slot, closing);
    }
    Ok(TC_ACT_OK)
}
