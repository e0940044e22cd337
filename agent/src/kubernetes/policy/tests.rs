use calix_core::policy::model::{Namespaces, Peer, PortMatch, PortRef, Protocol};
use k8s_openapi::api::core::v1::Pod as KubePod;
use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::{pod, policy};

fn np(json: serde_json::Value) -> calix_core::policy::model::Policy {
    let np: NetworkPolicy = serde_json::from_value(json).expect("a NetworkPolicy");
    policy(&np).expect("namespace and name")
}

fn meta() -> serde_json::Value {
    serde_json::json!({"namespace": "a", "name": "p"})
}

#[test]
fn policy_types_as_kubernetes_defaults_them() {
    // No policyTypes, no egress: ingress only (a default deny of ingress).
    let p = np(serde_json::json!({"metadata": meta(), "spec": {"podSelector": {}}}));
    assert_eq!((p.ingress, p.egress), (Some(vec![]), None));
    // No policyTypes, egress rules: both.
    let p = np(
        serde_json::json!({"metadata": meta(), "spec": {"podSelector": {},
        "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}]}}),
    );
    assert_eq!(p.ingress, Some(vec![]));
    assert_eq!(p.egress.expect("egress").len(), 1);
    // policyTypes: [Egress] with no rules: egress default deny, ingress untouched.
    let p = np(
        serde_json::json!({"metadata": meta(), "spec": {"podSelector": {},
        "policyTypes": ["Egress"]}}),
    );
    assert_eq!((p.ingress, p.egress), (None, Some(vec![])));
    // A type Kubernetes does not have: both directions closed, the rule says why.
    let p = np(
        serde_json::json!({"metadata": meta(), "spec": {"podSelector": {},
        "policyTypes": ["Sideways"]}}),
    );
    let rules = p.ingress.expect("closed");
    assert!(rules[0].check().is_err());
    assert!(p.egress.expect("closed")[0].check().is_err());
}

#[test]
fn peers_with_kubernetes_meaning() {
    let p = np(
        serde_json::json!({"metadata": meta(), "spec": {"podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [
            {"podSelector": {"matchLabels": {"app": "fe"}}},
            {"namespaceSelector": {"matchLabels": {"team": "x"}}},
            {"namespaceSelector": {}, "podSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["1"]}]}},
            {"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.5.0/24"]}}
        ], "ports": [{"port": "http"}, {"port": 8000, "endPort": 8080, "protocol": "TCP"}, {"protocol": "SCTP"}]}]}}),
    );
    let r = &p.ingress.expect("ingress")[0];
    assert!(r.check().is_ok(), "{r:?}");
    match &r.peers[0] {
        Peer::Pods {
            namespaces: Namespaces::Named(ns),
            pods,
        } => {
            assert_eq!(ns, "a");
            assert_eq!(pods.match_labels["app"], "fe");
        }
        other => panic!("{other:?}"),
    }
    match &r.peers[1] {
        Peer::Pods {
            namespaces: Namespaces::Selected(s),
            pods,
        } => {
            assert_eq!(s.match_labels["team"], "x");
            assert_eq!(*pods, Default::default());
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(&r.peers[2], Peer::Pods { namespaces: Namespaces::Selected(s), pods }
        if *s == Default::default() && pods.match_expressions.len() == 1)
    );
    assert!(matches!(&r.peers[3], Peer::Block { except, .. } if except.len() == 1));
    assert_eq!(
        r.ports,
        vec![
            PortMatch {
                protocol: Protocol::Tcp,
                port: Some(PortRef::Name("http".into())),
                end_port: None
            },
            PortMatch {
                protocol: Protocol::Tcp,
                port: Some(PortRef::Number(8000)),
                end_port: Some(8080)
            },
            PortMatch {
                protocol: Protocol::Sctp,
                port: None,
                end_port: None
            },
        ]
    );
}

#[test]
fn what_cannot_be_read_allows_nothing() {
    for (peer_or_port, says) in [
        (
            serde_json::json!({"from": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Like", "values": ["x"]}]}}]}),
            "operator \"Like\"",
        ),
        (
            serde_json::json!({"from": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}),
            "ipBlock",
        ),
        (
            serde_json::json!({"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}),
            "beside a selector",
        ),
        (serde_json::json!({"from": [{}]}), "neither"),
        (
            serde_json::json!({"ports": [{"port": 70000}]}),
            "not a port",
        ),
        (serde_json::json!({"ports": [{"port": 0}]}), "not a port"),
        (
            serde_json::json!({"ports": [{"port": 80, "protocol": "ICMP"}]}),
            "protocol \"ICMP\"",
        ),
        (
            serde_json::json!({"ports": [{"port": 80, "endPort": -1}]}),
            "endPort",
        ),
    ] {
        let p = np(
            serde_json::json!({"metadata": meta(), "spec": {"podSelector": {}, "ingress": [peer_or_port]}}),
        );
        let r = &p.ingress.expect("ingress")[0];
        let e = r.check().expect_err("unreadable");
        assert!(e.to_string().contains(says), "{e} should say {says}");
        assert!(
            r.peers.is_empty() && r.ports.is_empty(),
            "nothing kept of it: {r:?}"
        );
    }
    // A podSelector that cannot be read: the policy selects the whole namespace.
    let p = np(
        serde_json::json!({"metadata": meta(), "spec": {"podSelector":
        {"matchExpressions": [{"key": "a", "operator": "Near"}]}, "ingress": [{}]}}),
    );
    assert!(p.selector_problem().is_some_and(|w| w.contains("Near")));
}

#[test]
fn a_pods_addresses_named_ports_and_host_network() {
    let kp: KubePod = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "a", "name": "web", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "c", "ports": [
            {"name": "http", "containerPort": 8080},
            {"name": "dns", "containerPort": 53, "protocol": "UDP"},
            {"containerPort": 9000}
        ]}]},
        "status": {"podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}
    }))
    .expect("a Pod");
    let p = pod(&kp).expect("keyed");
    assert_eq!(p.ips.len(), 2);
    assert_eq!(p.named_port("http", Protocol::Tcp), Some(8080));
    assert_eq!(p.named_port("dns", Protocol::Udp), Some(53));
    assert_eq!(p.named_port("dns", Protocol::Tcp), None);
    assert_eq!(p.ports.len(), 2, "unnamed ports are not named ports");
    assert!(!p.host_network);
    let kp: KubePod = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "a", "name": "h"},
        "spec": {"hostNetwork": true, "containers": []},
        "status": {"podIP": "192.168.1.5"}
    }))
    .expect("a Pod");
    let p = pod(&kp).expect("keyed");
    assert!(p.host_network);
    assert_eq!(
        p.ips,
        vec!["192.168.1.5".parse::<std::net::IpAddr>().expect("ip")]
    );
}
