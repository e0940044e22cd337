//! A node's credentials write only what is that node's (issue 20, items 1b and 1c), against a
//! real kube-apiserver v1.36.2: what a node's ServiceAccount token carries, and the chart's
//! ValidatingAdmissionPolicy that keys on it.
use calix_testbed::k8s::BoundTo;
use calix_testbed::{unique, KubeApi};
use serde_json::{json, Value};

/// The chart's ClusterRole for the agent (charts/calix/files/rbac/), as one file in `dir`.
fn cluster_role(dir: &std::path::Path) -> std::path::PathBuf {
    let rbac = calix_testbed::k8s::crds_dir()
        .parent()
        .expect("charts/calix")
        .join("files/rbac");
    let mut rules: Vec<Value> = Vec::new();
    for file in ["agent.yaml", "kubernetes-datastore.yaml"] {
        let text = std::fs::read_to_string(rbac.join(file)).expect("the chart's rules");
        let part: Vec<Value> = serde_saphyr::from_str(&text).expect("a list of rules");
        rules.extend(part);
    }
    let path = dir.join("authority-clusterrole.json");
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "calix-agent"}, "rules": rules,
    });
    std::fs::write(&path, role.to_string()).expect("write the ClusterRole");
    path
}

#[test]
fn a_node_token_names_its_node_and_an_unbound_one_names_none() {
    let api = KubeApi::shared();
    let node = unique("n");
    api.service_account("kube-system", "calix-agent", &cluster_role(&api.dir))
        .unwrap_or_else(|e| panic!("{e}"));
    let unbound = api
        .service_account_token("kube-system", "calix-agent", &cluster_role(&api.dir))
        .unwrap_or_else(|e| panic!("{e}"));
    for (what, token) in [
        (
            "pod-bound",
            api.node_token("kube-system", "calix-agent", &node, BoundTo::Pod)
                .unwrap_or_else(|e| panic!("{e}")),
        ),
        (
            "node-bound",
            api.node_token("kube-system", "calix-agent", &node, BoundTo::Node)
                .unwrap_or_else(|e| panic!("{e}")),
        ),
        ("unbound", unbound.clone()),
    ] {
        let me = api.whoami(&token).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("{what}: {me}");
        assert_eq!(
            me["username"], "system:serviceaccount:kube-system:calix-agent",
            "{what}: {me}"
        );
        let named = &me["extra"]["authentication.kubernetes.io/node-name"];
        if what == "unbound" {
            assert_eq!(*named, Value::Null, "{what}: {me}");
        } else {
            assert_eq!(*named, json!([node]), "{what}: {me}");
        }
    }
    api.delete_in("v1", "Pod", "kube-system", &format!("calix-agent-{node}"))
        .unwrap_or_else(|e| panic!("{e}"));
    api.delete("v1", "Node", &node)
        .unwrap_or_else(|e| panic!("{e}"));
}
