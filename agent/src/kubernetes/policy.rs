//! NetworkPolicies, Pods and Namespaces as the policy calculation takes them
//! (`calix_core::policy::model`): the API's objects read with Kubernetes' meaning. What cannot
//! be read as written (an operator or protocol Kubernetes does not have, a port out of range,
//! a CIDR that does not parse, a peer with nothing or too much in it) is not guessed at: the
//! rule is marked unreadable and allows nothing, and the policy still isolates its pods.
use std::net::IpAddr;

use calix_core::policy::model::{
    NamedPort, Namespaces, Peer, Pod, PodKey, Policy, PolicyKey, PortMatch, PortRef, Protocol, Rule,
};
use calix_core::selector::{LabelSelector, Operator, Requirement};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod as KubePod;
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector as KubeSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub mod watch;

/// A NetworkPolicy as the calculation takes it. None without a namespace or name (the API
/// server always sets both).
pub fn policy(np: &NetworkPolicy) -> Option<Policy> {
    let key = PolicyKey {
        namespace: np.metadata.namespace.clone()?,
        name: np.metadata.name.clone()?,
    };
    let spec = np.spec.clone().unwrap_or_default();
    let (pod_selector, unreadable_selector) = match selector(&spec.pod_selector.unwrap_or_default())
    {
        Ok(s) => (s, None),
        Err(why) => (LabelSelector::default(), Some(why)),
    };
    let ingress: Vec<Rule> = spec
        .ingress
        .unwrap_or_default()
        .iter()
        .map(|r| rule(&key.namespace, r.from.as_deref(), r.ports.as_deref()))
        .collect();
    let egress: Vec<Rule> = spec
        .egress
        .unwrap_or_default()
        .iter()
        .map(|r| rule(&key.namespace, r.to.as_deref(), r.ports.as_deref()))
        .collect();
    // policyTypes as given; when absent (the API server sets it), Ingress always and Egress
    // when there are egress rules.
    let types = spec.policy_types.unwrap_or_default();
    let (mut wants_ingress, mut wants_egress) = if types.is_empty() {
        (true, !egress.is_empty())
    } else {
        (false, false)
    };
    let mut unknown = None;
    for t in &types {
        match t.as_str() {
            "Ingress" => wants_ingress = true,
            "Egress" => wants_egress = true,
            other => {
                unknown = Some(format!(
                    "policyTypes: {other:?} is neither Ingress nor Egress"
                ))
            }
        }
    }
    if let Some(why) = unknown {
        // Which directions it meant cannot be known: both isolated, nothing allowed.
        let closed = vec![Rule {
            unreadable: Some(why),
            ..Rule::default()
        }];
        return Some(Policy {
            key,
            pod_selector,
            ingress: Some(closed.clone()),
            egress: Some(closed),
            unreadable_selector,
        });
    }
    Some(Policy {
        key,
        pod_selector,
        ingress: wants_ingress.then_some(ingress),
        egress: wants_egress.then_some(egress),
        unreadable_selector,
    })
}

/// One rule: its peers (`from` or `to`) and ports.
fn rule(
    namespace: &str,
    peers: Option<&[NetworkPolicyPeer]>,
    ports: Option<&[NetworkPolicyPort]>,
) -> Rule {
    let read = || -> Result<Rule, String> {
        Ok(Rule {
            peers: peers
                .unwrap_or_default()
                .iter()
                .enumerate()
                .map(|(i, p)| peer(namespace, p).map_err(|e| format!("peer {i}: {e}")))
                .collect::<Result<_, _>>()?,
            ports: ports
                .unwrap_or_default()
                .iter()
                .enumerate()
                .map(|(i, p)| port(p).map_err(|e| format!("port {i}: {e}")))
                .collect::<Result<_, _>>()?,
            unreadable: None,
        })
    };
    read().unwrap_or_else(|why| Rule {
        unreadable: Some(why),
        ..Rule::default()
    })
}

fn peer(namespace: &str, p: &NetworkPolicyPeer) -> Result<Peer, String> {
    match (&p.ip_block, &p.namespace_selector, &p.pod_selector) {
        (Some(b), None, None) => {
            let parse = |s: &str| {
                s.parse::<IpNet>()
                    .map_err(|e| format!("ipBlock {s:?}: {e}"))
            };
            Ok(Peer::Block {
                cidr: parse(&b.cidr)?,
                except: b
                    .except
                    .iter()
                    .flatten()
                    .map(|e| parse(e))
                    .collect::<Result<_, _>>()?,
            })
        }
        (Some(_), _, _) => Err("ipBlock beside a selector".into()),
        (None, None, None) => Err("neither ipBlock nor a selector".into()),
        (None, ns, pods) => Ok(Peer::Pods {
            namespaces: match ns {
                Some(s) => Namespaces::Selected(
                    selector(s).map_err(|e| format!("namespaceSelector: {e}"))?,
                ),
                None => Namespaces::Named(namespace.to_string()),
            },
            pods: match pods {
                Some(s) => selector(s).map_err(|e| format!("podSelector: {e}"))?,
                None => LabelSelector::default(),
            },
        }),
    }
}

fn port(p: &NetworkPolicyPort) -> Result<PortMatch, String> {
    let number = |n: i32, what: &str| -> Result<u16, String> {
        u16::try_from(n)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{what} {n} is not a port"))
    };
    Ok(PortMatch {
        protocol: protocol(p.protocol.as_deref())?,
        port: match &p.port {
            None => None,
            Some(IntOrString::Int(n)) => Some(PortRef::Number(number(*n, "port")?)),
            Some(IntOrString::String(s)) => Some(PortRef::Name(s.clone())),
        },
        end_port: p.end_port.map(|n| number(n, "endPort")).transpose()?,
    })
}

/// A protocol as Kubernetes names it (TCP when none is).
pub fn protocol(p: Option<&str>) -> Result<Protocol, String> {
    Protocol::parse(p).ok_or_else(|| format!("protocol {:?}", p.unwrap_or_default()))
}

/// A `metav1.LabelSelector` as calix-core's.
pub fn selector(s: &KubeSelector) -> Result<LabelSelector, String> {
    let match_expressions = s
        .match_expressions
        .iter()
        .flatten()
        .map(|r| {
            let operator = match r.operator.as_str() {
                "In" => Operator::In,
                "NotIn" => Operator::NotIn,
                "Exists" => Operator::Exists,
                "DoesNotExist" => Operator::DoesNotExist,
                other => return Err(format!("operator {other:?}")),
            };
            Ok(Requirement {
                key: r.key.clone(),
                operator,
                values: r.values.clone().unwrap_or_default(),
            })
        })
        .collect::<Result<_, _>>()?;
    let selector = LabelSelector {
        match_labels: s.match_labels.clone().unwrap_or_default(),
        match_expressions,
    };
    selector.validate().map_err(|e| e.to_string())?;
    Ok(selector)
}

/// A Pod as the calculation takes it: its labels, addresses (`status.podIPs`), its
/// containers' named ports and whether it is on the host's network. None without a namespace
/// or name.
pub fn pod(p: &KubePod) -> Option<Pod> {
    let key = PodKey {
        namespace: p.metadata.namespace.clone()?,
        name: p.metadata.name.clone()?,
    };
    let spec = p.spec.as_ref();
    let status = p.status.as_ref();
    let mut ips: Vec<IpAddr> = status
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.ip.parse().ok())
        .collect();
    if ips.is_empty() {
        ips.extend(
            status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok()),
        );
    }
    let ports = spec
        .into_iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|cp| {
            Some(NamedPort {
                name: cp.name.clone()?,
                protocol: protocol(cp.protocol.as_deref()).ok()?,
                port: u16::try_from(cp.container_port).ok().filter(|n| *n > 0)?,
            })
        })
        .collect();
    Some(Pod {
        key,
        labels: p.metadata.labels.clone().unwrap_or_default(),
        ips,
        ports,
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
    })
}

#[cfg(test)]
mod tests;
