//! `calixctl trace <src> <dst> <proto>/<port>`: the verdicts one packet would meet, gathered
//! here. An end on this node is answered from the live maps (eBPF) or from the tables the
//! kernel dataplane writes to nftables; an end on another node by that node's agent, from its
//! own live maps or tables (`calix.v1.Routes/Verdict`, over route distribution's mutual TLS:
//! [`PeerVerdicts`] answers it); when that node cannot be asked (no route distribution, or
//! it does not answer), from this agent's calculation of that pod's policy, the same
//! calculation its own agent programs, and the step says why.
use std::net::IpAddr;

use calix_common::POLICY_SERVICE;
use calix_core::policy::endpoint::Direction;
use calix_core::policy::model::PodKey;
use calix_core::policy::trace::{
    proto_name, Outcome, TraceReport, TraceStep, FROM_AGENT, FROM_CALCULATION, FROM_LIVE_MAPS,
};

use std::sync::Arc;

use calix_proto::v1 as pb;

use super::PolicyService;
use crate::distribution::server::Verdicts;
use crate::distribution::RoutesHandle;
use crate::pod_network::Node;

/// One end of the packet.
struct End {
    ip: IpAddr,
    pod: Option<PodKey>,
    host_network: bool,
    /// On this node: its host veth, and the ifindex its programs run on.
    local: Option<(String, Option<u32>)>,
}

impl End {
    fn text(&self) -> String {
        match &self.pod {
            Some(p) => format!("{} ({p})", self.ip),
            None => self.ip.to_string(),
        }
    }
}

/// The addresses `s` stands for (an address, or a pod's), and the pod.
fn candidates(
    policy: &PolicyService,
    s: &str,
) -> Result<(Vec<IpAddr>, Option<PodKey>, bool), String> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        let pod = policy
            .pod_with_address(ip)
            .and_then(|p| PodKey::parse(&p).ok());
        return Ok((vec![ip], pod, false));
    }
    let pod = PodKey::parse(s)
        .map_err(|_| format!("{s:?} is neither an address nor a pod (<namespace>/<name>)"))?;
    let (ips, host) = policy
        .pod_addresses(&pod)
        .ok_or_else(|| format!("pod {pod} is not known to the agent"))?;
    if ips.is_empty() {
        return Err(format!("pod {pod} has no address yet"));
    }
    Ok((ips, Some(pod), host))
}

/// The traced packet's ends, of one family (IPv4 first when both ends have it).
async fn ends(
    node: &Node,
    policy: &PolicyService,
    src: &str,
    dst: &str,
) -> Result<(End, End), String> {
    let (s_ips, s_pod, s_host) = candidates(policy, src)?;
    let (d_ips, d_pod, d_host) = candidates(policy, dst)?;
    let pick = |v6: bool| {
        Some((
            *s_ips.iter().find(|a| a.is_ipv6() == v6)?,
            *d_ips.iter().find(|a| a.is_ipv6() == v6)?,
        ))
    };
    let (s, d) = pick(false)
        .or_else(|| pick(true))
        .ok_or("the two ends have no address family in common")?;
    let local = |ip| async move {
        node.endpoints
            .local_with_address(ip)
            .await
            .map(|(i, x, _)| (i, x))
    };
    Ok((
        End {
            ip: s,
            pod: s_pod,
            host_network: s_host,
            local: local(s).await,
        },
        End {
            ip: d,
            pod: d_pod,
            host_network: d_host,
            local: local(d).await,
        },
    ))
}

/// The trace of a packet of `proto` (to port `port`) from `src` to `dst`: a pod
/// (`namespace/name`, or a name in `default`) or an address each.
#[allow(clippy::too_many_arguments)]
pub async fn trace(
    node: &Node,
    policy: &PolicyService,
    routes: Option<&RoutesHandle>,
    services: Option<&crate::services::ServicesService>,
    src: &str,
    dst: &str,
    proto: u8,
    port: u16,
) -> Result<TraceReport, String> {
    let (s, d) = ends(node, policy, src, dst).await?;
    let here = node.name().to_string();
    let ported = matches!(proto, 6 | 17 | 132);
    let mut steps = Vec::new();
    let step = |stage: &str, node: &str, outcome, detail: String, source: &str| TraceStep {
        stage: stage.into(),
        node: node.into(),
        outcome,
        detail,
        source: source.into(),
    };
    // The packet leaves its pod.
    let src_node = if s.local.is_some() {
        here.as_str()
    } else {
        "its node"
    };
    if s.local.is_some() {
        steps.push(step(
            "anti-spoofing",
            &here,
            Outcome::Pass,
            format!("{} is the pod's own address", s.ip),
            FROM_AGENT,
        ));
    }
    steps.push(
        end_step(
            node,
            policy,
            routes,
            &s,
            Direction::Egress,
            d.ip,
            proto,
            port,
        )
        .await,
    );
    // A Service's address: where the connection really goes (from a client beyond the
    // cluster, no pod's and no pool's: per packet where it arrives).
    let pools = node.ipam.pools();
    let pool_of = |ip: IpAddr| pools.iter().find(|p| p.cidr.contains(&ip));
    let outside = s.pod.is_none() && !s.host_network && pool_of(s.ip).is_none();
    if let Some((refused, detail)) = services
        .and_then(|sv| sv.trace_step(d.ip, proto, port, s.ip, outside))
        .filter(|_| ported)
    {
        let outcome = if refused {
            Outcome::Drop
        } else {
            Outcome::Note
        };
        steps.push(step("Service", src_node, outcome, detail, FROM_CALCULATION));
    }
    // Where it goes.
    let route = match (&d.local, pool_of(d.ip)) {
        (Some((ifname, _)), _) => format!("delivered on {here} to {ifname}"),
        (None, Some(p)) => format!("to another node: pool {}", p.cidr),
        (None, None) => "out of the cluster network (not a pool address)".to_string(),
    };
    steps.push(step("route", src_node, Outcome::Note, route, FROM_AGENT));
    let nat = match (pool_of(s.ip), pool_of(d.ip)) {
        (Some(p), None) if d.local.is_none() => format!(
            "the source is translated to the node's address if pool {} has natOutgoing \
             (eBPF: CALIX_NAT_CFG; kernel mode: nftables table ip calix)",
            p.cidr
        ),
        _ => "none: pod addresses stay as they are".to_string(),
    };
    steps.push(step("NAT", src_node, Outcome::Note, nat, FROM_AGENT));
    // It arrives.
    steps.push(
        end_step(
            node,
            policy,
            routes,
            &d,
            Direction::Ingress,
            s.ip,
            proto,
            port,
        )
        .await,
    );
    let packet = format!(
        "{} {} → {}{}",
        proto_name(proto),
        s.text(),
        if ported {
            match d.ip {
                IpAddr::V6(_) => format!("[{}]:{port}", d.ip),
                IpAddr::V4(_) => format!("{}:{port}", d.ip),
            }
        } else {
            d.ip.to_string()
        },
        d.pod
            .as_ref()
            .map(|p| format!(" ({p})"))
            .unwrap_or_default()
    );
    Ok(TraceReport {
        node: here,
        packet,
        steps,
    })
}

/// End `e`'s policy verdict in `d` on a packet with `peer`: from this node when `e` is one of
/// its pods, else asked of `e`'s node; from the calculation when that node cannot answer.
#[allow(clippy::too_many_arguments)]
async fn end_step(
    node: &Node,
    policy: &PolicyService,
    routes: Option<&RoutesHandle>,
    e: &End,
    d: Direction,
    peer: IpAddr,
    proto: u8,
    port: u16,
) -> TraceStep {
    if e.local.is_some() {
        return policy_step(node, policy, e, d, peer, proto, port, node.name()).await;
    }
    let asked = match (routes, &e.pod) {
        (Some(r), Some(_)) if !e.host_network => {
            let req = pb::VerdictRequest {
                node: String::new(),
                pod_address: e.ip.to_string(),
                peer_address: peer.to_string(),
                ingress: d == Direction::Ingress,
                protocol: u32::from(proto),
                port: u32::from(port),
            };
            Some(r.verdict_of(e.ip, req).await.and_then(|(n, json)| {
                serde_json::from_str::<TraceStep>(&json)
                    .map_err(|err| format!("node {n} answered what does not read: {err}"))
            }))
        }
        _ => None,
    };
    match asked {
        Some(Ok(step)) => step,
        Some(Err(why)) => {
            let mut step = policy_step(node, policy, e, d, peer, proto, port, "its node").await;
            step.detail = format!("{} ({why})", step.detail);
            step
        }
        None => policy_step(node, policy, e, d, peer, proto, port, "its node").await,
    }
}

/// What this node answers its peers' `Verdict` calls with: the step of a pod of this node,
/// as its own `calixctl trace` gives it.
pub struct PeerVerdicts {
    pub node: Arc<Node>,
    pub policy: Arc<PolicyService>,
}

#[tonic::async_trait]
impl Verdicts for PeerVerdicts {
    async fn verdict(&self, r: &pb::VerdictRequest) -> Result<String, String> {
        let addr = |s: &str, what: &str| {
            s.parse::<IpAddr>()
                .map_err(|_| format!("{what} {s:?} is not an address"))
        };
        let ip = addr(&r.pod_address, "pod_address")?;
        let peer = addr(&r.peer_address, "peer_address")?;
        let proto = u8::try_from(r.protocol).map_err(|_| "protocol: a number 0-255")?;
        let port = u16::try_from(r.port).map_err(|_| "port: 0-65535")?;
        let local = self
            .node
            .endpoints
            .local_with_address(ip)
            .await
            .map(|(i, x, _)| (i, x))
            .ok_or_else(|| format!("{ip} is no pod of node {}", self.node.name()))?;
        let (_, pod, host_network) = candidates(&self.policy, &r.pod_address)?;
        let end = End {
            ip,
            pod,
            host_network,
            local: Some(local),
        };
        let d = if r.ingress {
            Direction::Ingress
        } else {
            Direction::Egress
        };
        let step = policy_step(
            &self.node,
            &self.policy,
            &end,
            d,
            peer,
            proto,
            port,
            self.node.name(),
        )
        .await;
        serde_json::to_string(&step).map_err(|e| format!("cannot encode the step: {e}"))
    }
}

/// End `e`'s policy verdict in `d` on a packet with `peer` (`port`: the destination port).
#[allow(clippy::too_many_arguments)]
async fn policy_step(
    node: &Node,
    policy: &PolicyService,
    e: &End,
    d: Direction,
    peer: IpAddr,
    proto: u8,
    port: u16,
    at: &str,
) -> TraceStep {
    let stage = format!("{d} policy");
    let mk = |outcome, detail: String, source: &str| TraceStep {
        stage: stage.clone(),
        node: at.to_string(),
        outcome,
        detail,
        source: source.to_string(),
    };
    let Some(pod) = &e.pod else {
        return mk(
            Outcome::Note,
            format!("{} is not a pod: no NetworkPolicy of its own", e.ip),
            FROM_CALCULATION,
        );
    };
    if e.host_network {
        return mk(
            Outcome::Note,
            format!("{pod} is on the host's network: NetworkPolicy does not apply"),
            FROM_CALCULATION,
        );
    }
    let denied = || {
        let by = policy.policies_of(pod);
        format!(
            "{pod} is isolated for {d} ({}): no rule allows it",
            if by.is_empty() {
                "its policy is not known yet: fail closed".to_string()
            } else {
                format!("by {}", by.join(", "))
            }
        )
    };
    // The live maps, for an end on this node in the eBPF dataplane.
    if let Some((_, Some(ifindex))) = &e.local {
        let live = node
            .endpoints
            .live_verdict(*ifindex, d == Direction::Ingress, peer, proto, port)
            .await;
        match live {
            Ok(Some(v)) if !v.isolated => {
                return mk(
                    Outcome::Pass,
                    format!("{pod} is not isolated for {d}: everything allowed"),
                    FROM_LIVE_MAPS,
                )
            }
            Ok(Some(v)) if v.identity == POLICY_SERVICE && d == Direction::Egress => {
                return mk(
                    Outcome::Defer,
                    format!(
                        "{peer} is a Service address: judged after kube-proxy's DNAT, against \
                         the backend it picks (trace the backend's address)"
                    ),
                    FROM_LIVE_MAPS,
                )
            }
            Ok(Some(v)) => {
                return match v.rule {
                    Some(r) => mk(
                        Outcome::Pass,
                        format!(
                            "allowed by {}",
                            policy
                                .rule_name(r)
                                .unwrap_or_else(|| format!("rule number {r}"))
                        ),
                        FROM_LIVE_MAPS,
                    ),
                    None => mk(Outcome::Drop, denied(), FROM_LIVE_MAPS),
                }
            }
            Ok(None) => {}
            Err(err) => {
                return mk(
                    Outcome::Note,
                    format!("the live maps cannot be read: {err}"),
                    FROM_LIVE_MAPS,
                )
            }
        }
    }
    let source = if e.local.is_some() {
        // Kernel mode: the tables it writes to nftables come from this calculation.
        calix_core::policy::trace::FROM_NFTABLES
    } else {
        FROM_CALCULATION
    };
    match policy.computed_verdict(pod, d, peer, proto, port) {
        None => mk(
            Outcome::Note,
            format!("{pod}'s policy is not known"),
            FROM_CALCULATION,
        ),
        Some(Ok(None)) => mk(
            Outcome::Pass,
            format!("{pod} is not isolated for {d}: everything allowed"),
            source,
        ),
        Some(Ok(Some(rule))) => mk(Outcome::Pass, format!("allowed by {rule}"), source),
        Some(Err(())) => mk(Outcome::Drop, denied(), source),
    }
}
