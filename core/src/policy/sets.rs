//! The address sets policy rules refer to, and who is in them. A rule names a set, not its
//! addresses: a pod's label change moves that pod in or out of the sets it touches, and no
//! endpoint's rules change (Calico's IP sets, in the same role).
use std::net::IpAddr;

use ipnet::IpNet;

use super::model::{Labels, Namespaces, Peer, Pod, Protocol};
use crate::selector::LabelSelector;

/// An address set: what one peer of a rule selects.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetKey {
    /// The addresses of the pods a pod peer selects (host-network pods never: their address
    /// is their node's).
    Pods {
        namespaces: Namespaces,
        pods: LabelSelector,
    },
    /// An ipBlock: its CIDR less its excepts.
    Block { cidr: IpNet, except: Vec<IpNet> },
    /// Egress to a named port: the pods of `within` (None: every pod) with a container port
    /// `name` of `protocol`, each member with its own pod's port number.
    NamedPort {
        within: Option<Box<SetKey>>,
        protocol: Protocol,
        name: String,
    },
}

/// One member of a set: addresses and, in a named-port set, the port at those addresses. An
/// `excluded` member is an ipBlock's except: the longest match landing on it finds nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Member {
    pub net: IpNet,
    pub port: Option<u16>,
    pub excluded: bool,
}

impl Member {
    fn address(ip: IpAddr, port: Option<u16>) -> Self {
        Self {
            net: IpNet::from(ip),
            port,
            excluded: false,
        }
    }
}

impl SetKey {
    /// The set one peer of a rule selects.
    pub fn of(peer: &Peer) -> Self {
        match peer {
            Peer::Pods { namespaces, pods } => Self::Pods {
                namespaces: namespaces.clone(),
                pods: pods.clone(),
            },
            Peer::Block { cidr, except } => {
                let mut except = except.clone();
                except.sort();
                except.dedup();
                Self::Block {
                    cidr: cidr.trunc(),
                    except,
                }
            }
        }
    }

    /// The members that are there whatever the pods: an ipBlock's CIDR and excepts.
    pub fn fixed_members(&self) -> Vec<Member> {
        match self {
            Self::Block { cidr, except } => std::iter::once(Member {
                net: *cidr,
                port: None,
                excluded: false,
            })
            .chain(except.iter().map(|e| Member {
                net: e.trunc(),
                port: None,
                excluded: true,
            }))
            .collect(),
            _ => Vec::new(),
        }
    }

    /// The members `pod` brings to the set, its namespace's labels being `ns_labels` (None:
    /// the namespace is not known yet, and no namespace selector matches it: closed, not
    /// open, until it is).
    pub fn members_of(&self, pod: &Pod, ns_labels: Option<&Labels>) -> Vec<Member> {
        if pod.host_network {
            return Vec::new();
        }
        match self {
            Self::Pods { .. } => {
                if self.holds(pod, ns_labels) {
                    pod.ips
                        .iter()
                        .map(|ip| Member::address(*ip, None))
                        .collect()
                } else {
                    Vec::new()
                }
            }
            Self::Block { .. } => Vec::new(),
            Self::NamedPort {
                within,
                protocol,
                name,
            } => {
                let Some(port) = pod.named_port(name, *protocol) else {
                    return Vec::new();
                };
                pod.ips
                    .iter()
                    .filter(|ip| match within.as_deref() {
                        None => true,
                        Some(w @ Self::Pods { .. }) => w.holds(pod, ns_labels),
                        Some(w) => w.contains_address(**ip),
                    })
                    .map(|ip| Member::address(*ip, Some(port)))
                    .collect()
            }
        }
    }

    /// Whether a pod set selects `pod` (false for other kinds).
    fn holds(&self, pod: &Pod, ns_labels: Option<&Labels>) -> bool {
        let Self::Pods { namespaces, pods } = self else {
            return false;
        };
        let in_namespace = match namespaces {
            Namespaces::Named(ns) => *ns == pod.key.namespace,
            Namespaces::Selected(s) => ns_labels.is_some_and(|l| s.matches(l)),
        };
        in_namespace && pods.matches(&pod.labels)
    }

    /// Whether an ipBlock set holds `ip` (in the CIDR, in no except; false for other kinds).
    pub fn contains_address(&self, ip: IpAddr) -> bool {
        match self {
            Self::Block { cidr, except } => {
                cidr.contains(&ip) && !except.iter().any(|e| e.contains(&ip))
            }
            _ => false,
        }
    }

    /// Whether its members depend on namespaces' labels.
    pub fn reads_namespaces(&self) -> bool {
        match self {
            Self::Pods { namespaces, .. } => matches!(namespaces, Namespaces::Selected(_)),
            Self::Block { .. } => false,
            Self::NamedPort { within, .. } => within.as_deref().is_some_and(Self::reads_namespaces),
        }
    }
}
