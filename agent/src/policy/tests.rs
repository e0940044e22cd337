use std::collections::BTreeMap;

use calix_core::policy::cluster::Change;
use calix_core::policy::model::{Namespaces, Peer, Pod, PodKey, Policy, PolicyKey, Rule};
use calix_core::selector::LabelSelector;

use super::PolicyService;

fn sel(kv: &[(&str, &str)]) -> LabelSelector {
    LabelSelector {
        match_labels: kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        match_expressions: Vec::new(),
    }
}

fn pk(name: &str) -> PodKey {
    PodKey {
        namespace: "a".into(),
        name: name.into(),
    }
}

fn pod(name: &str, app: &str, ip: &str) -> Change {
    Change::Pod(Pod {
        key: pk(name),
        labels: BTreeMap::from([("app".to_string(), app.to_string())]),
        ips: vec![ip.parse().expect("ip")],
        ports: Vec::new(),
        host_network: false,
    })
}

/// Pods `app=web` take ingress from pods `app=client` only.
fn web_from_clients() -> Change {
    Change::Policy(Policy {
        key: PolicyKey {
            namespace: "a".into(),
            name: "web".into(),
        },
        pod_selector: sel(&[("app", "web")]),
        ingress: Some(vec![Rule {
            peers: vec![Peer::Pods {
                namespaces: Namespaces::Named("a".into()),
                pods: sel(&[("app", "client")]),
            }],
            ..Rule::default()
        }]),
        egress: None,
        unreadable_selector: None,
    })
}

#[test]
fn only_this_nodes_pods_are_computed_and_a_label_change_touches_only_whom_it_moves() {
    let svc = PolicyService::new("n1");
    svc.apply(
        Change::Namespace {
            name: "a".into(),
            labels: BTreeMap::new(),
        },
        false,
    );
    svc.apply(pod("web-here", "web", "10.0.0.1"), true);
    svc.apply(pod("web-there", "web", "10.0.1.1"), false);
    svc.apply(pod("other-here", "db", "10.0.0.2"), true);
    let applied = svc.apply(web_from_clients(), false);
    assert_eq!(
        (applied.endpoints, applied.changed),
        (1, 1),
        "web-here only"
    );
    let ep = svc.endpoint(&pk("web-here")).expect("computed");
    assert_eq!(ep.ingress.as_ref().map(Vec::len), Some(1));
    assert!(svc.endpoint(&pk("web-there")).is_none(), "not this node's");
    assert_eq!(
        svc.endpoint(&pk("other-here")).expect("computed").ingress,
        None,
        "no policy selects it: open"
    );

    // A pod on another node becomes a client: a set gains a member, no endpoint changes.
    let applied = svc.apply(pod("c", "client", "10.0.1.9"), false);
    assert_eq!((applied.sets, applied.changed), (1, 0));
    let r = svc.report(Some(&pk("web-here")));
    let rules = r
        .endpoint
        .as_ref()
        .and_then(|e| e.ingress.clone())
        .expect("isolated");
    assert_eq!(rules[0].members, Some(1));
    assert_eq!((r.pods, r.policies, r.local_endpoints), (4, 1, 2));

    // A pod that moves off this node is forgotten here.
    svc.apply(pod("web-here", "web", "10.0.0.1"), false);
    assert!(svc.endpoint(&pk("web-here")).is_none());
    assert!(
        !svc.report(Some(&pk("web-here")))
            .endpoint
            .expect("known")
            .local
    );
    // Gone.
    svc.apply(Change::PodGone(pk("other-here")), false);
    assert_eq!(svc.report(None).local_endpoints, 0);
}

/// A pod whose policy the dataplane could not fully write gets a Warning Event naming why;
/// other errors name no pod.
#[test]
fn a_pod_not_fully_programmed_gets_a_warning() {
    use std::sync::Arc;

    use calix_dataplane::DataplaneError;

    use crate::notice::{Notifier, Recorded, Severity, Subject};
    let notifier = Notifier::default();
    let seen = Arc::new(Recorded::default());
    notifier.set(seen.clone());
    let full = DataplaneError::PolicyIncomplete {
        slots: vec![3],
        pods: vec![pk("web")],
        source: Box::new(DataplaneError::Driver("no space left in the map".into())),
    };
    super::notice_not_programmed(&notifier, &full);
    super::notice_not_programmed(&notifier, &DataplaneError::Driver("other".into()));
    let got = seen.0.lock().expect("lock").clone();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].severity, Severity::Warning);
    assert_eq!(got[0].reason, "NetworkPolicyNotProgrammed");
    assert_eq!(
        got[0].subject,
        Subject::Pod {
            namespace: "a".into(),
            name: "web".into()
        }
    );
    assert!(
        got[0].message.contains("no space left"),
        "{}",
        got[0].message
    );
}
