//! What the policy calculation takes: NetworkPolicies, pods and namespaces as plain values
//! (the Kubernetes adapter converts the API's objects into these), and their checks.
use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::selector::{LabelSelector, SelectorError};

/// A pod's or a namespace's labels.
pub type Labels = BTreeMap<String, String>;

/// A transport protocol a NetworkPolicy port or a Service port names (TCP when it names none).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// From the Kubernetes API's name (`TCP`, `UDP`, `SCTP`; absent means TCP).
    pub fn parse(s: Option<&str>) -> Option<Self> {
        match s.unwrap_or("TCP") {
            "TCP" => Some(Self::Tcp),
            "UDP" => Some(Self::Udp),
            "SCTP" => Some(Self::Sctp),
            _ => None,
        }
    }

    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
            Self::Sctp => 132,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        })
    }
}

/// A port by number or by the name of a container port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PortRef {
    Number(u16),
    Name(String),
}

/// One entry of a rule's `ports`: a protocol and a port, a range (`endPort`) or every port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortMatch {
    pub protocol: Protocol,
    /// None: every port of the protocol.
    pub port: Option<PortRef>,
    /// The range's last port (only with a numeric `port`).
    pub end_port: Option<u16>,
}

/// Which namespaces a pod peer's pods come from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Namespaces {
    /// The policy's own namespace (a peer with a `podSelector` only).
    Named(String),
    /// Every namespace whose labels match (a peer with a `namespaceSelector`).
    Selected(LabelSelector),
}

/// One entry of a rule's `from` or `to`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Peer {
    /// Pods: those matching `pods` (empty: every pod) in `namespaces`.
    Pods {
        namespaces: Namespaces,
        pods: LabelSelector,
    },
    /// Addresses: `cidr` but not `except` (any address, pods' included).
    Block { cidr: IpNet, except: Vec<IpNet> },
}

/// One ingress or egress rule: traffic from (to) any of `peers` on any of `ports`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rule {
    /// Empty: every peer.
    pub peers: Vec<Peer>,
    /// Empty: every port and protocol.
    pub ports: Vec<PortMatch>,
    /// Why the adapter could not read the rule as written (an unknown operator or protocol, a
    /// port out of range): it then allows nothing.
    pub unreadable: Option<String>,
}

/// A policy's namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyKey {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A `networking.k8s.io/v1` NetworkPolicy, its `policyTypes` already applied: a direction the
/// policy does not name is `None` (it isolates nothing there); `Some(vec![])` isolates and
/// allows nothing (default deny).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub key: PolicyKey,
    /// The pods of its namespace it applies to (empty: all of them).
    pub pod_selector: LabelSelector,
    pub ingress: Option<Vec<Rule>>,
    pub egress: Option<Vec<Rule>>,
    /// Why the adapter could not read `podSelector`: the policy then selects every pod of its
    /// namespace and allows nothing.
    pub unreadable_selector: Option<String>,
}

/// A pod's namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl PodKey {
    /// `namespace/name`; a bare name is in `default`, as kubectl takes it.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (namespace, name) = s.split_once('/').unwrap_or(("default", s));
        if namespace.is_empty() || name.is_empty() || name.contains('/') {
            return Err(format!(
                "{s:?} is not a pod: expected <namespace>/<name> or <name>"
            ));
        }
        Ok(Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
        })
    }
}

impl fmt::Display for PodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A container port with a name (what a named policy port resolves to).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamedPort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// What the calculation needs of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub key: PodKey,
    pub labels: Labels,
    /// Its addresses (none yet: it matches no set).
    pub ips: Vec<IpAddr>,
    /// Its containers' named ports.
    pub ports: Vec<NamedPort>,
    /// On the node's network: not subject to policy, and not a pod peer (its address is the
    /// node's).
    pub host_network: bool,
}

impl Pod {
    /// The port its container port `name` of `protocol` is, if it has one.
    pub fn named_port(&self, name: &str, protocol: Protocol) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.name == name && p.protocol == protocol)
            .map(|p| p.port)
    }
}

/// Why a rule cannot be enforced as written (the API server refuses these; calix checks
/// again, as anything it reads may be hostile). The rule then allows nothing: the policy
/// still isolates its pods, and the problem is reported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("a selector: {0}")]
    Selector(#[from] SelectorError),
    #[error("ipBlock {cidr}: except {except} is not inside it")]
    ExceptOutside { cidr: IpNet, except: IpNet },
    #[error("port 0")]
    PortZero,
    #[error("endPort {end} without a numeric port")]
    EndPortWithoutPort { end: u16 },
    #[error("endPort {end} below port {port}")]
    EndPortBelowPort { port: u16, end: u16 },
    #[error("an empty port name")]
    EmptyPortName,
    #[error("{0}")]
    Unreadable(String),
}

impl Policy {
    /// Why its own selector cannot be read, if it cannot.
    pub fn selector_problem(&self) -> Option<String> {
        match (&self.unreadable_selector, self.pod_selector.validate()) {
            (Some(why), _) => Some(why.clone()),
            (None, Err(e)) => Some(e.to_string()),
            (None, Ok(())) => None,
        }
    }
}

impl Rule {
    /// Checks every peer and port of the rule.
    pub fn check(&self) -> Result<(), RuleError> {
        if let Some(why) = &self.unreadable {
            return Err(RuleError::Unreadable(why.clone()));
        }
        for peer in &self.peers {
            match peer {
                Peer::Pods { namespaces, pods } => {
                    pods.validate()?;
                    if let Namespaces::Selected(s) = namespaces {
                        s.validate()?;
                    }
                }
                Peer::Block { cidr, except } => {
                    if let Some(e) = except.iter().find(|e| !cidr.contains(*e)) {
                        return Err(RuleError::ExceptOutside {
                            cidr: *cidr,
                            except: *e,
                        });
                    }
                }
            }
        }
        for p in &self.ports {
            match (&p.port, p.end_port) {
                (Some(PortRef::Number(0)), _) | (_, Some(0)) => return Err(RuleError::PortZero),
                (Some(PortRef::Number(port)), Some(end)) if end < *port => {
                    return Err(RuleError::EndPortBelowPort { port: *port, end })
                }
                (Some(PortRef::Name(n)), _) if n.is_empty() => {
                    return Err(RuleError::EmptyPortName)
                }
                (None | Some(PortRef::Name(_)), Some(end)) => {
                    return Err(RuleError::EndPortWithoutPort { end })
                }
                _ => {}
            }
        }
        Ok(())
    }
}
