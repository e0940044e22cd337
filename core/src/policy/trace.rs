//! `calixctl trace <src> <dst> <proto>/<port>`: every verdict one packet would meet, in the
//! order it meets them, each saying where its answer comes from (the live maps, or the
//! agent's calculation). The agent gathers the facts; this is the contract calixctl prints.
use serde::{Deserialize, Serialize};

/// Where a step's answer comes from.
pub const FROM_LIVE_MAPS: &str = "live maps";
pub const FROM_NFTABLES: &str = "tables written to nftables";
pub const FROM_CALCULATION: &str = "agent's calculation";
pub const FROM_AGENT: &str = "agent state";

/// What a step does with the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Drop,
    /// Decided later (egress to a Service: after the DNAT, against the backend).
    Defer,
    /// Nothing to decide here (a fact on the way).
    Note,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceStep {
    /// `anti-spoofing`, `egress policy`, `route`, `NAT`, `ingress policy`.
    pub stage: String,
    /// The node it happens on (`this node`, or the other node's name when known).
    pub node: String,
    pub outcome: Outcome,
    /// What decided: the rule (`policy ns/name ingress rule 0`), or why none did.
    pub detail: String,
    /// [`FROM_LIVE_MAPS`], [`FROM_NFTABLES`], [`FROM_CALCULATION`] or [`FROM_AGENT`].
    pub source: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceReport {
    pub node: String,
    /// The packet, e.g. `TCP 10.0.0.5 (shop/client) → 10.0.1.9:80 (shop/web)`.
    pub packet: String,
    pub steps: Vec<TraceStep>,
}

impl TraceReport {
    /// The first step that drops the packet, if one does.
    pub fn dropped_at(&self) -> Option<&TraceStep> {
        self.steps.iter().find(|s| s.outcome == Outcome::Drop)
    }

    /// One line: where it ends.
    pub fn conclusion(&self) -> String {
        match self.dropped_at() {
            Some(s) => format!("dropped by {} on {}: {}", s.stage, s.node, s.detail),
            None if self.steps.iter().any(|s| s.outcome == Outcome::Defer) => {
                "passes so far; its egress verdict waits for the backend kube-proxy picks"
                    .to_string()
            }
            None => "delivered".to_string(),
        }
    }
}

/// `<proto>/<port>` as calixctl takes it: `tcp/80`, `udp/53`, `sctp/9`, `icmp`, `icmpv6`, or
/// a protocol number (`47`); (protocol number, port).
pub fn parse_proto_port(s: &str) -> Result<(u8, u16), String> {
    let (proto, port) = match s.split_once('/') {
        Some((p, port)) => (
            p,
            Some(
                port.parse::<u16>()
                    .map_err(|_| format!("{port:?} is not a port (0-65535)"))?,
            ),
        ),
        None => (s, None),
    };
    let number = match proto.to_ascii_lowercase().as_str() {
        "tcp" => 6,
        "udp" => 17,
        "sctp" => 132,
        "icmp" => 1,
        "icmpv6" => 58,
        other => other.parse::<u8>().map_err(|_| {
            format!("{proto:?} is not a protocol: tcp, udp, sctp, icmp, icmpv6 or a number")
        })?,
    };
    let ported = matches!(number, 6 | 17 | 132);
    match (ported, port) {
        (true, Some(p)) => Ok((number, p)),
        (true, None) => Err(format!("{proto} needs a port: {proto}/<port>")),
        (false, Some(_)) => Err(format!("{proto} has no ports")),
        (false, None) => Ok((number, 0)),
    }
}

/// A protocol number's name.
pub fn proto_name(p: u8) -> String {
    match p {
        6 => "TCP".into(),
        17 => "UDP".into(),
        132 => "SCTP".into(),
        1 => "ICMP".into(),
        58 => "ICMPv6".into(),
        n => format!("protocol {n}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocols_and_ports_parse_as_operators_write_them() {
        assert_eq!(parse_proto_port("tcp/80"), Ok((6, 80)));
        assert_eq!(parse_proto_port("UDP/53"), Ok((17, 53)));
        assert_eq!(parse_proto_port("icmp"), Ok((1, 0)));
        assert_eq!(parse_proto_port("47"), Ok((47, 0)));
        assert!(parse_proto_port("tcp").is_err());
        assert!(parse_proto_port("tcp/70000").is_err());
        assert!(parse_proto_port("icmp/8").is_err());
        assert!(parse_proto_port("http/80").is_err());
    }

    #[test]
    fn the_conclusion_names_the_first_drop() {
        let step = |stage: &str, outcome| TraceStep {
            stage: stage.into(),
            node: "this node".into(),
            outcome,
            detail: "no rule allows it".into(),
            source: FROM_LIVE_MAPS.into(),
        };
        let mut r = TraceReport {
            steps: vec![
                step("egress policy", Outcome::Pass),
                step("route", Outcome::Note),
            ],
            ..TraceReport::default()
        };
        assert_eq!(r.conclusion(), "delivered");
        r.steps.push(step("ingress policy", Outcome::Drop));
        assert_eq!(
            r.conclusion(),
            "dropped by ingress policy on this node: no rule allows it"
        );
    }
}
