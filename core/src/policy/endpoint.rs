//! One endpoint's policy: which policies select the pod, and what each direction allows, as
//! rules over address sets. Kubernetes' meaning: a pod is isolated in a direction when any
//! policy of its namespace that selects it names that direction; then it allows the union of
//! those policies' rules there, and nothing else. A pod no policy isolates allows everything.
use std::fmt;

use super::model::{Pod, Policy, PolicyKey, PortMatch, PortRef, Protocol, Rule};
use super::sets::SetKey;

/// Ingress (to the pod) or egress (from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    Ingress,
    Egress,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
        })
    }
}

/// Ports `first..=last` of `protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    pub protocol: Protocol,
    pub first: u16,
    pub last: u16,
}

/// Which ports an allow rule opens.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Ports {
    /// Every protocol and port (a rule without `ports`).
    Any,
    Ranges(Vec<PortRange>),
    /// The port that comes with the matched member of a named-port set, of this protocol.
    OfMember(Protocol),
}

/// Whom an allow rule opens to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PeerMatch {
    /// Every address (a rule without `from` / `to`).
    Any,
    Set(SetKey),
}

/// One thing a direction allows, and the policy rule it comes from (for counters, `calixctl
/// policy` and traces).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Allow {
    pub peer: PeerMatch,
    pub ports: Ports,
    pub policy: PolicyKey,
    /// The rule's index in the policy's `ingress` or `egress`.
    pub rule: usize,
}

/// A rule that cannot be enforced as written: it allows nothing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub policy: PolicyKey,
    pub direction: Option<Direction>,
    pub rule: Option<usize>,
    pub error: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.policy)?;
        if let Some(d) = self.direction {
            write!(f, " {d}")?;
        }
        if let Some(r) = self.rule {
            write!(f, " rule {r}")?;
        }
        write!(f, ": {}", self.error)
    }
}

/// What the policies make of one endpoint. `None` in a direction: not isolated there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointPolicy {
    pub ingress: Option<Vec<Allow>>,
    pub egress: Option<Vec<Allow>>,
    /// The policies that select it, in order.
    pub policies: Vec<PolicyKey>,
    /// Rules that allow nothing because they cannot be enforced; reported, never opened.
    pub problems: Vec<Problem>,
}

impl EndpointPolicy {
    pub fn direction(&self, d: Direction) -> Option<&[Allow]> {
        match d {
            Direction::Ingress => self.ingress.as_deref(),
            Direction::Egress => self.egress.as_deref(),
        }
    }

    /// Every set its rules name.
    pub fn sets(&self) -> impl Iterator<Item = &SetKey> {
        self.ingress
            .iter()
            .chain(&self.egress)
            .flatten()
            .filter_map(|a| match &a.peer {
                PeerMatch::Set(s) => Some(s),
                PeerMatch::Any => None,
            })
    }
}

/// Whether `policy` selects `pod` (same namespace, its selector matches). A selector that
/// cannot be read selects every pod of the namespace: such a policy isolates them all and
/// allows nothing, rather than leave any open.
pub fn selects(policy: &Policy, pod: &Pod) -> bool {
    policy.key.namespace == pod.key.namespace
        && (policy.selector_problem().is_some() || policy.pod_selector.matches(&pod.labels))
}

/// The endpoint policy of `pod` under `policies` (those of other namespaces are skipped).
/// None for a host-network pod: it is not subject to NetworkPolicy.
pub fn compute<'a>(
    pod: &Pod,
    policies: impl IntoIterator<Item = &'a Policy>,
) -> Option<EndpointPolicy> {
    if pod.host_network {
        return None;
    }
    let mut out = EndpointPolicy::default();
    for policy in policies.into_iter().filter(|p| selects(p, pod)) {
        out.policies.push(policy.key.clone());
        if let Some(why) = policy.selector_problem() {
            out.problems.push(Problem {
                policy: policy.key.clone(),
                direction: None,
                rule: None,
                error: format!("podSelector: {why}"),
            });
        }
        for (d, rules) in [
            (Direction::Ingress, &policy.ingress),
            (Direction::Egress, &policy.egress),
        ] {
            let Some(rules) = rules else { continue };
            let allows = match d {
                Direction::Ingress => out.ingress.get_or_insert_with(Vec::new),
                Direction::Egress => out.egress.get_or_insert_with(Vec::new),
            };
            for (i, rule) in rules.iter().enumerate() {
                if let Err(e) = rule.check() {
                    out.problems.push(Problem {
                        policy: policy.key.clone(),
                        direction: Some(d),
                        rule: Some(i),
                        error: e.to_string(),
                    });
                    continue;
                }
                expand(pod, &policy.key, i, d, rule, allows);
            }
        }
    }
    for allows in out.ingress.iter_mut().chain(out.egress.iter_mut()) {
        allows.sort();
        allows.dedup();
    }
    Some(out)
}

/// The allows of one checked rule. Named ports: on ingress the pod's own container port; on
/// egress the destination's, through a named-port set (a port name no pod has opens nothing).
fn expand(pod: &Pod, key: &PolicyKey, rule: usize, d: Direction, r: &Rule, out: &mut Vec<Allow>) {
    let peers: Vec<Option<SetKey>> = if r.peers.is_empty() {
        vec![None]
    } else {
        r.peers.iter().map(|p| Some(SetKey::of(p))).collect()
    };
    let allow = |peer: PeerMatch, ports: Ports| Allow {
        peer,
        ports,
        policy: key.clone(),
        rule,
    };
    if r.ports.is_empty() {
        out.extend(peers.into_iter().map(|p| allow(peer_match(p), Ports::Any)));
        return;
    }
    let mut ranges = Vec::new();
    let mut named = Vec::new();
    for p in &r.ports {
        match range(p) {
            Some(r) => ranges.push(r),
            None => {
                if let Some(PortRef::Name(n)) = &p.port {
                    match d {
                        Direction::Ingress => {
                            if let Some(port) = pod.named_port(n, p.protocol) {
                                ranges.push(PortRange {
                                    protocol: p.protocol,
                                    first: port,
                                    last: port,
                                });
                            }
                        }
                        Direction::Egress => named.push((p.protocol, n.clone())),
                    }
                }
            }
        }
    }
    if !ranges.is_empty() {
        ranges.sort();
        ranges.dedup();
        for p in &peers {
            out.push(allow(peer_match(p.clone()), Ports::Ranges(ranges.clone())));
        }
    }
    for (protocol, name) in named {
        for p in &peers {
            let set = SetKey::NamedPort {
                within: p.clone().map(Box::new),
                protocol,
                name: name.clone(),
            };
            out.push(allow(PeerMatch::Set(set), Ports::OfMember(protocol)));
        }
    }
}

fn peer_match(set: Option<SetKey>) -> PeerMatch {
    set.map_or(PeerMatch::Any, PeerMatch::Set)
}

/// A numeric port (or every port of the protocol) as a range; None for a named port.
fn range(p: &PortMatch) -> Option<PortRange> {
    let (first, last) = match &p.port {
        None => (0, u16::MAX),
        Some(PortRef::Number(n)) => (*n, p.end_port.unwrap_or(*n)),
        Some(PortRef::Name(_)) => return None,
    };
    Some(PortRange {
        protocol: p.protocol,
        first,
        last,
    })
}

/// Every set `policy`'s allows name, once per rule that names it: what [`compute`] makes of
/// its checked rules for any pod it selects (ingress named ports resolve on the pod itself and
/// name no set).
pub fn policy_sets(policy: &Policy) -> Vec<SetKey> {
    let mut out = Vec::new();
    for (d, rules) in [
        (Direction::Ingress, &policy.ingress),
        (Direction::Egress, &policy.egress),
    ] {
        for rule in rules.iter().flatten().filter(|r| r.check().is_ok()) {
            let peer_sets: Vec<SetKey> = rule.peers.iter().map(SetKey::of).collect();
            // On egress, a rule whose ports are all named names only named-port sets.
            let plain = d == Direction::Ingress
                || rule.ports.is_empty()
                || rule.ports.iter().any(|p| range(p).is_some());
            let mut sets = if plain { peer_sets.clone() } else { Vec::new() };
            if d == Direction::Egress {
                let peers: Vec<Option<SetKey>> = if rule.peers.is_empty() {
                    vec![None]
                } else {
                    peer_sets.into_iter().map(Some).collect()
                };
                for p in &rule.ports {
                    if let (Some(PortRef::Name(name)), None) = (&p.port, range(p)) {
                        for peer in &peers {
                            sets.push(SetKey::NamedPort {
                                within: peer.clone().map(Box::new),
                                protocol: p.protocol,
                                name: name.clone(),
                            });
                        }
                    }
                }
            }
            sets.sort();
            sets.dedup();
            out.extend(sets);
        }
    }
    out
}
