//! What `calixctl policy <pod>` shows: one endpoint's policy as the agent computed it (the
//! policies that select it, each direction's rules with whom and which ports they open, the
//! rules that cannot be enforced), and the agent's calculation as a whole. Plain text and
//! numbers, so the agent and calixctl share one contract (JSON over the local API).
use std::fmt;

use serde::{Deserialize, Serialize};

use super::cluster::Cluster;
use super::endpoint::{Allow, Direction, EndpointPolicy, PeerMatch, Ports};
use super::model::{Namespaces, PodKey};
use super::sets::SetKey;
use crate::selector::LabelSelector;

/// The agent's policy calculation, and one endpoint's policy when one was asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyReport {
    pub node: String,
    /// Whether NetworkPolicy is followed here (Kubernetes mode).
    pub enabled: bool,
    /// Whether the first listing of namespaces, pods and policies is in.
    pub ready: bool,
    pub namespaces: usize,
    pub pods: usize,
    pub policies: usize,
    /// Address sets that rules name.
    pub sets: usize,
    /// This node's pods with a computed policy.
    pub local_endpoints: usize,
    /// Changes applied since the agent started.
    pub changes: u64,
    /// What the dataplane holds of it: the last programming's outcome (None: not programmed
    /// yet, or a dataplane that enforces no policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataplane: Option<String>,
    pub endpoint: Option<EndpointReport>,
}

/// One endpoint's policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointReport {
    /// `namespace/name`.
    pub pod: String,
    /// Whether the pod is on this node (only then is its policy programmed here).
    pub local: bool,
    /// On the host's network: NetworkPolicy does not apply.
    pub host_network: bool,
    pub policies: Vec<String>,
    /// None: not isolated in that direction (everything allowed).
    pub ingress: Option<Vec<RuleReport>>,
    pub egress: Option<Vec<RuleReport>>,
    /// Rules that allow nothing because they cannot be enforced.
    pub problems: Vec<String>,
    /// Packets the dataplane denied to the pod and from it (None: not counted here, e.g. the
    /// pod is on another node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied_ingress: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied_egress: Option<u64>,
}

/// A packet NetworkPolicy denied (`calixctl monitor --drops`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DroppedPacket {
    /// When (RFC 3339, UTC; to the dataplane's coarse clock).
    pub time: String,
    /// `namespace/name` of the endpoint's pod (None: an endpoint the agent cannot name).
    pub pod: Option<String>,
    /// Its host veth.
    pub interface: Option<String>,
    /// `ingress` (to the pod) or `egress` (from it).
    pub direction: String,
    /// `TCP`, `UDP`, `SCTP`, `ICMP`, `ICMPv6`, or the protocol's number.
    pub protocol: String,
    pub pod_address: String,
    pub pod_port: Option<u16>,
    pub peer_address: String,
    pub peer_port: Option<u16>,
    /// `namespace/name` of the pod the peer address is, when the agent knows one.
    pub peer_pod: Option<String>,
    /// Why: `no rule allows it`, `revoked by a policy change`, `headers cannot be read`.
    pub why: String,
    /// Packets denied on that CPU just before this one and left out (rate limit).
    pub suppressed: u32,
}

/// One thing a direction allows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleReport {
    /// `namespace/name` of the policy.
    pub policy: String,
    /// The rule's index in the policy's ingress or egress.
    pub rule: usize,
    /// Whom: `any`, or the set (its selector or CIDR).
    pub peer: String,
    /// Which ports: `any`, ranges like `TCP/80`, `TCP/8000-8080`, or `TCP/<named port>`.
    pub ports: String,
    /// Addresses in the set now (None: any peer).
    pub members: Option<usize>,
    /// How many times the rule decided for this endpoint since the agent started: new
    /// connections (and packets without a connection) it let through, and flows it let go on
    /// after a change (None: not counted here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hits: Option<u64>,
}

impl EndpointReport {
    /// Fills in the dataplane's counts: `hits` by (the policy's `namespace/name`, direction,
    /// rule index), and the packets denied each way.
    pub fn with_counts(
        mut self,
        hits: &std::collections::BTreeMap<(String, Direction, usize), u64>,
        denied_ingress: u64,
        denied_egress: u64,
    ) -> Self {
        for (d, rules) in [
            (Direction::Ingress, &mut self.ingress),
            (Direction::Egress, &mut self.egress),
        ] {
            for r in rules.iter_mut().flatten() {
                r.hits = Some(
                    hits.get(&(r.policy.clone(), d, r.rule))
                        .copied()
                        .unwrap_or(0),
                );
            }
        }
        self.denied_ingress = Some(denied_ingress);
        self.denied_egress = Some(denied_egress);
        self
    }
}

impl EndpointReport {
    /// The report of `pod` in `cluster` (None: no such pod). `local`: whether it is on this
    /// node.
    pub fn of(cluster: &Cluster, pod: &PodKey, local: bool) -> Option<Self> {
        let p = cluster.pod(pod)?;
        let Some(ep) = cluster.endpoint(pod) else {
            return Some(Self {
                pod: pod.to_string(),
                local,
                host_network: p.host_network,
                ..Self::default()
            });
        };
        Some(Self::from_policy(cluster, pod, local, &ep))
    }

    fn from_policy(cluster: &Cluster, pod: &PodKey, local: bool, ep: &EndpointPolicy) -> Self {
        let rules = |d: Direction| {
            ep.direction(d)
                .map(|allows| allows.iter().map(|a| rule_report(cluster, a)).collect())
        };
        Self {
            pod: pod.to_string(),
            local,
            host_network: false,
            policies: ep.policies.iter().map(ToString::to_string).collect(),
            ingress: rules(Direction::Ingress),
            egress: rules(Direction::Egress),
            problems: ep.problems.iter().map(ToString::to_string).collect(),
            denied_ingress: None,
            denied_egress: None,
        }
    }
}

fn rule_report(cluster: &Cluster, a: &Allow) -> RuleReport {
    let (peer, members) = match &a.peer {
        PeerMatch::Any => ("any".to_string(), None),
        PeerMatch::Set(s) => (
            s.to_string(),
            Some(cluster.members(s).iter().filter(|m| !m.excluded).count()),
        ),
    };
    RuleReport {
        policy: a.policy.to_string(),
        rule: a.rule,
        peer,
        ports: a.ports.to_string(),
        members,
        hits: None,
    }
}

/// A pod selector as text: its requirements, or `every pod`.
fn pods_text(s: &LabelSelector) -> String {
    if s.match_labels.is_empty() && s.match_expressions.is_empty() {
        "every pod".to_string()
    } else {
        format!("pods {s}")
    }
}

impl fmt::Display for SetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pods { namespaces, pods } => match namespaces {
                Namespaces::Named(ns) => write!(f, "{} in {ns}", pods_text(pods)),
                Namespaces::Selected(s)
                    if s.match_labels.is_empty() && s.match_expressions.is_empty() =>
                {
                    write!(f, "{} in every namespace", pods_text(pods))
                }
                Namespaces::Selected(s) => {
                    write!(f, "{} in namespaces {s}", pods_text(pods))
                }
            },
            Self::Block { cidr, except } => {
                write!(f, "{cidr}")?;
                if !except.is_empty() {
                    let e: Vec<String> = except.iter().map(ToString::to_string).collect();
                    write!(f, " except {}", e.join(","))?;
                }
                Ok(())
            }
            Self::NamedPort {
                within,
                protocol,
                name,
            } => match within {
                Some(w) => write!(f, "{w}, with port {protocol}/{name}"),
                None => write!(f, "any pod with port {protocol}/{name}"),
            },
        }
    }
}

impl fmt::Display for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Any => f.write_str("any"),
            Self::OfMember(p) => write!(f, "{p}/<named port>"),
            Self::Ranges(ranges) => {
                let parts: Vec<String> = ranges
                    .iter()
                    .map(|r| match (r.first, r.last) {
                        (0, u16::MAX) => format!("{}/any", r.protocol),
                        (a, b) if a == b => format!("{}/{a}", r.protocol),
                        (a, b) => format!("{}/{a}-{b}", r.protocol),
                    })
                    .collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}
