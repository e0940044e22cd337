//! Which CertificateSigningRequests calix-signer signs, pure: the request must come from the
//! agents' ServiceAccount, with credentials bound to a node (the API server's
//! `authentication.kubernetes.io/node-name`, which no requester can write), and ask for that
//! node alone — subject exactly CN = the node, one DNS subject alternative name = the node,
//! no other extension or attribute, usages among those a Routes certificate has — with a key
//! calix takes, for a Node that exists (the same one the credentials were bound to, when
//! they carry its UID). Anything else is refused with a reason (CamelCase) and a message
//! that says what to change.
use std::collections::BTreeMap;

use calix_pki::request::{self, RequestKey};
use calix_pki::Name;

/// The node the requester's credentials are bound to (set by the API server).
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// That node's UID.
pub const NODE_UID_EXTRA: &str = "authentication.kubernetes.io/node-uid";
/// Usages a request may ask for (the certificate gets digital signature, server auth and
/// client auth whatever it asks).
pub const ALLOWED_USAGES: [&str; 4] = [
    "digital signature",
    "key encipherment",
    "server auth",
    "client auth",
];

/// Whom and what the signer signs for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub signer_name: String,
    /// The agents' user name: `system:serviceaccount:<namespace>:<name>`.
    pub agent_user: String,
}

/// What a request object says (its spec, as the API server recorded it).
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    pub username: &'a str,
    pub extra: &'a BTreeMap<String, Vec<String>>,
    pub usages: &'a [String],
    /// `spec.request`: the PKCS#10 request, PEM.
    pub request: &'a [u8],
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// CamelCase, for the condition's `reason`.
    pub reason: &'static str,
    pub message: String,
}

fn deny(reason: &'static str, message: String) -> Denial {
    Denial { reason, message }
}

/// A request that passed every check but the Node's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    pub node: String,
    /// The node UID the credentials carry, if any.
    pub node_uid: Option<String>,
    pub key: RequestKey,
}

/// Every check that needs no API call.
pub fn check(policy: &Policy, asked: &Asked<'_>) -> Result<Granted, Denial> {
    if asked.username != policy.agent_user {
        return Err(deny(
            "NotCalixAgent",
            format!(
                "requested by {:?}: {} signs only for calix's agents ({})",
                asked.username, policy.signer_name, policy.agent_user
            ),
        ));
    }
    let node = match asked.extra.get(NODE_NAME_EXTRA).map(Vec::as_slice) {
        None | Some([]) => {
            return Err(deny(
                "NoNodeBinding",
                format!(
                    "the requester's credentials are not bound to a node (no {NODE_NAME_EXTRA}): \
                     an agent asks with its pod's token, which the API server binds to the pod's node"
                ),
            ))
        }
        Some([one]) => one.clone(),
        Some(many) => {
            return Err(deny(
                "MoreThanOneNode",
                format!("the requester's credentials name {} nodes: {many:?}", many.len()),
            ))
        }
    };
    let node_uid = match asked.extra.get(NODE_UID_EXTRA).map(Vec::as_slice) {
        Some([uid]) => Some(uid.clone()),
        _ => None,
    };
    if crate::distribution::tls::server_name(&node).is_err() {
        return Err(deny(
            "NodeNameNotDns",
            format!("node name {node:?} is not a DNS name: no certificate can name it"),
        ));
    }
    let facts = request::parse_pem(asked.request)
        .map_err(|e| deny("BadRequest", format!("spec.request: {e}")))?;
    match facts.names.as_slice() {
        [Name::Dns(n)] if n == &node => {}
        [Name::Dns(n)] => {
            return Err(deny(
                "OtherNode",
                format!("asks for a certificate naming {n:?}, but the requester is the agent of node {node:?}"),
            ))
        }
        [other] => {
            return Err(deny(
                "NotADnsName",
                format!("asks for the name {other}: a node's certificate names its node in one DNS name ({node:?})"),
            ))
        }
        names => {
            return Err(deny(
                "NotOneName",
                format!(
                    "asks for {} names ({}): a node's certificate names its node alone ({node:?})",
                    names.len(),
                    names.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                ),
            ))
        }
    }
    let cn = facts.common_names();
    if facts.subject.len() != 1 || cn != [node.as_str()] {
        let subject: Vec<String> = facts
            .subject
            .iter()
            .map(|(oid, v)| format!("{oid}={}", v.as_deref().unwrap_or("<not a string>")))
            .collect();
        return Err(deny(
            if cn.len() == 1 && cn[0] != node {
                "OtherNode"
            } else {
                "BadSubject"
            },
            format!(
                "subject [{}]: it must be exactly CN={node}",
                subject.join(", ")
            ),
        ));
    }
    if !facts.other_extensions.is_empty() || !facts.other_attributes.is_empty() {
        return Err(deny(
            "UnexpectedExtensions",
            format!(
                "the request carries extensions or attributes other than the subject alternative name: {:?}",
                facts
                    .other_extensions
                    .iter()
                    .chain(&facts.other_attributes)
                    .collect::<Vec<_>>()
            ),
        ));
    }
    if let Some(u) = asked
        .usages
        .iter()
        .find(|u| !ALLOWED_USAGES.contains(&u.as_str()))
    {
        return Err(deny(
            "BadUsages",
            format!("usage {u:?} is not one of a Routes certificate's: {ALLOWED_USAGES:?}"),
        ));
    }
    Ok(Granted {
        node,
        node_uid,
        key: facts.key,
    })
}

/// The Node as the API has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeState {
    Missing,
    Present { uid: String },
}

/// The Node must exist, and be the one the credentials were bound to.
pub fn check_node(g: &Granted, node: &NodeState) -> Result<(), Denial> {
    match (node, &g.node_uid) {
        (NodeState::Missing, _) => Err(deny(
            "NoSuchNode",
            format!("there is no Node {:?}", g.node),
        )),
        (NodeState::Present { uid }, Some(bound)) if uid != bound => Err(deny(
            "NodeReplaced",
            format!(
                "the requester's credentials are bound to Node {:?} with UID {bound}, which is now UID {uid}",
                g.node
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DnType, KeyPair, SanType};

    const AGENT: &str = "system:serviceaccount:kube-system:calix";

    fn policy() -> Policy {
        Policy {
            signer_name: "calix.dev/routes".into(),
            agent_user: AGENT.into(),
        }
    }

    fn extra(node: &[&str]) -> BTreeMap<String, Vec<String>> {
        let mut m = BTreeMap::new();
        m.insert(
            "authentication.kubernetes.io/pod-name".into(),
            vec!["calix-x".into()],
        );
        if !node.is_empty() {
            m.insert(
                NODE_NAME_EXTRA.into(),
                node.iter().map(|n| n.to_string()).collect(),
            );
            m.insert(NODE_UID_EXTRA.into(), vec!["uid-1".into()]);
        }
        m
    }

    /// A request with subject `cn` (none: empty) and DNS names `sans`.
    fn request(cn: Option<&str>, sans: &[&str]) -> Vec<u8> {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(cn) = cn {
            p.distinguished_name.push(DnType::CommonName, cn);
        }
        p.subject_alt_names = sans
            .iter()
            .map(|n| SanType::DnsName(n.to_string().try_into().expect("ia5")))
            .collect();
        p.serialize_request(&key)
            .expect("csr")
            .pem()
            .expect("pem")
            .into_bytes()
    }

    fn usages() -> Vec<String> {
        ["digital signature", "server auth", "client auth"]
            .iter()
            .map(|u| u.to_string())
            .collect()
    }

    fn decide(user: &str, node: &[&str], req: &[u8], usages: &[String]) -> Result<Granted, Denial> {
        let extra = extra(node);
        check(
            &policy(),
            &Asked {
                username: user,
                extra: &extra,
                usages,
                request: req,
            },
        )
    }

    fn reason(r: Result<Granted, Denial>) -> &'static str {
        match r {
            Ok(g) => panic!("granted {g:?}"),
            Err(d) => {
                assert!(!d.message.is_empty());
                d.reason
            }
        }
    }

    #[test]
    fn an_agent_asking_for_its_own_node_is_granted() {
        let g = decide(
            AGENT,
            &["node-a"],
            &request(Some("node-a"), &["node-a"]),
            &usages(),
        )
        .expect("granted");
        assert_eq!(g.node, "node-a");
        assert_eq!(g.node_uid.as_deref(), Some("uid-1"));
        assert_eq!(
            check_node(
                &g,
                &NodeState::Present {
                    uid: "uid-1".into()
                }
            ),
            Ok(())
        );
    }

    #[test]
    fn another_nodes_name_two_names_or_no_node_binding_are_denied() {
        let u = usages();
        // Node a's credentials, node b's name: in the SAN, in the CN, or both.
        assert_eq!(
            reason(decide(
                AGENT,
                &["node-a"],
                &request(Some("node-b"), &["node-b"]),
                &u
            )),
            "OtherNode"
        );
        assert_eq!(
            reason(decide(
                AGENT,
                &["node-a"],
                &request(Some("node-b"), &["node-a"]),
                &u
            )),
            "OtherNode"
        );
        let d = decide(
            AGENT,
            &["node-a"],
            &request(Some("node-a"), &["node-a", "node-b"]),
            &u,
        )
        .expect_err("two names");
        assert_eq!(d.reason, "NotOneName");
        assert!(d.message.contains("DNS:node-b"), "{}", d.message);
        assert_eq!(
            reason(decide(
                AGENT,
                &["node-a"],
                &request(Some("node-a"), &[]),
                &u
            )),
            "NotOneName"
        );
        // A token not bound to a node, or bound to two.
        let d = decide(AGENT, &[], &request(Some("node-a"), &["node-a"]), &u).expect_err("unbound");
        assert_eq!(d.reason, "NoNodeBinding");
        assert!(d.message.contains(NODE_NAME_EXTRA), "{}", d.message);
        assert_eq!(
            reason(decide(AGENT, &["a", "b"], &request(Some("a"), &["a"]), &u)),
            "MoreThanOneNode"
        );
        // Not the agents' ServiceAccount, even bound to the right node.
        assert_eq!(
            reason(decide(
                "system:serviceaccount:default:web",
                &["node-a"],
                &request(Some("node-a"), &["node-a"]),
                &u
            )),
            "NotCalixAgent"
        );
        assert_eq!(
            reason(decide(
                "admin",
                &["node-a"],
                &request(Some("node-a"), &["node-a"]),
                &u
            )),
            "NotCalixAgent"
        );
    }

    #[test]
    fn anything_beyond_the_nodes_name_is_denied() {
        let u = usages();
        assert_eq!(
            reason(decide(AGENT, &["node-a"], &request(None, &["node-a"]), &u)),
            "BadSubject"
        );
        // O=system:masters next to the CN.
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(vec!["node-a".to_string()]).expect("params");
        p.distinguished_name.push(DnType::CommonName, "node-a");
        p.distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        let pem = p.serialize_request(&key).expect("csr").pem().expect("pem");
        let d = decide(AGENT, &["node-a"], pem.as_bytes(), &u).expect_err("O");
        assert_eq!(d.reason, "BadSubject");
        assert!(d.message.contains("system:masters"), "{}", d.message);
        // An IP address instead of the DNS name.
        let mut p = CertificateParams::default();
        p.distinguished_name.push(DnType::CommonName, "node-a");
        p.subject_alt_names = vec![SanType::IpAddress("10.0.0.1".parse().expect("ip"))];
        let pem = p.serialize_request(&key).expect("csr").pem().expect("pem");
        assert_eq!(
            reason(decide(AGENT, &["node-a"], pem.as_bytes(), &u)),
            "NotADnsName"
        );
        // A CA's key usage asked for.
        let mut p = CertificateParams::new(vec!["node-a".to_string()]).expect("params");
        p.distinguished_name.push(DnType::CommonName, "node-a");
        p.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
        let pem = p.serialize_request(&key).expect("csr").pem().expect("pem");
        assert_eq!(
            reason(decide(AGENT, &["node-a"], pem.as_bytes(), &u)),
            "UnexpectedExtensions"
        );
        // Usages of the object.
        let mut cert_sign = u.clone();
        cert_sign.push("cert sign".into());
        assert_eq!(
            reason(decide(
                AGENT,
                &["node-a"],
                &request(Some("node-a"), &["node-a"]),
                &cert_sign
            )),
            "BadUsages"
        );
        // Garbage, a node name no certificate can carry.
        assert_eq!(
            reason(decide(
                AGENT,
                &["node-a"],
                b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
                &u
            )),
            "BadRequest"
        );
        assert_eq!(
            reason(decide(
                AGENT,
                &["10.0.0.1"],
                &request(Some("10.0.0.1"), &[]),
                &u
            )),
            "NodeNameNotDns"
        );
    }

    #[test]
    fn the_node_must_exist_and_be_the_one_the_credentials_were_bound_to() {
        let g = decide(
            AGENT,
            &["node-a"],
            &request(Some("node-a"), &["node-a"]),
            &usages(),
        )
        .expect("granted");
        assert_eq!(
            check_node(&g, &NodeState::Missing).map_err(|d| d.reason),
            Err("NoSuchNode")
        );
        assert_eq!(
            check_node(
                &g,
                &NodeState::Present {
                    uid: "uid-2".into()
                }
            )
            .map_err(|d| d.reason),
            Err("NodeReplaced")
        );
        let unbound_uid = Granted {
            node_uid: None,
            ..g
        };
        assert_eq!(
            check_node(
                &unbound_uid,
                &NodeState::Present {
                    uid: "uid-2".into()
                }
            ),
            Ok(())
        );
    }
}
