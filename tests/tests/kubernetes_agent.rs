//! The agent in Kubernetes (issue 14, item 2), against a real kube-apiserver v1.36.2 (one for
//! the whole binary, `KubeApi::shared`; the restart test has its own): agents named by the
//! downward API's environment variable, authenticated as a ServiceAccount bound only to the
//! chart's ClusterRole (charts/calix/templates/clusterrole.yaml); their Node's labels moving
//! the pool selection and its addresses recorded; the Service CIDRs from ServiceCIDR objects;
//! Events; the Pods bound to a node and the cleanup of endpoints whose pod is gone (deleted
//! while the agent was down, replaced by a new pod of the same name, or deleted while it
//! runs); watches across an API server restart; route distribution's peers from Node objects.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use calix_proto::v1 as pb;
use calix_testbed::tls::Ca;
use calix_testbed::{unique, wait_for, Cluster, Dataplane, KubeApi, Node, Pod};
use serde_json::{json, Value};

/// The chart's ClusterRole for the agent with the kubernetes datastore: the rules the chart's
/// template includes (charts/calix/files/rbac/), as one ClusterRole in a file of `dir`.
fn cluster_role(dir: &std::path::Path) -> PathBuf {
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
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "calix-agent"},
        "rules": rules,
    });
    let path = dir.join("clusterrole.json");
    std::fs::write(&path, role.to_string()).expect("write the ClusterRole");
    path
}

/// A token of the agent's ServiceAccount, bound to the chart's ClusterRole and nothing else.
fn agent_token(api: &KubeApi) -> String {
    api.service_account_token("kube-system", "calix-agent", &cluster_role(&api.dir))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A node (kernel dataplane) on `api` as `token`, named only by `CALIX_NODE_NAME` (no
/// `--node-name`), with `extra` config appended after `[datastore]`; not started.
fn agent_node(api: &KubeApi, token: &str, extra: &str) -> Node {
    let probe = Node::create(Dataplane::Kernel, None);
    let kubeconfig = api
        .wire_as(&probe.ns, token)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut node = probe.with_config(&format!(
        "[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\ntimeout_ms = 5000\nattempts = 40\n{extra}",
        kubeconfig.display()
    ));
    let name = node.ns.name.clone();
    let spec = &mut node.agent_mut().spec;
    spec.node_name_flag = false;
    spec.env = vec![("CALIX_NODE_NAME".into(), name)];
    node
}

/// Applies Node `name` with `labels` and `addresses` (type, address) in its status.
fn node_object(api: &KubeApi, name: &str, labels: Value, addresses: &[(&str, &str)]) {
    let meta = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    let mut object = meta.clone();
    object["metadata"]["labels"] = labels;
    api.apply(object).unwrap_or_else(|e| panic!("{e}"));
    let addresses: Vec<Value> = addresses
        .iter()
        .map(|(t, a)| json!({"type": t, "address": a}))
        .collect();
    api.patch_status(meta, json!({ "addresses": addresses }))
        .unwrap_or_else(|e| panic!("{e}"));
}

fn ippool(name: &str, cidr: &str, selector: Value) -> Value {
    json!({
        "apiVersion": "calix.dev/v1",
        "kind": "IPPool",
        "metadata": {"name": name},
        "spec": {"cidr": cidr, "blockSize": 28, "nodeSelector": selector},
    })
}

/// A Pod `default/name` bound to `node`, labelled `app: web`; its UID.
fn pod_object(api: &KubeApi, name: &str, node: &str) -> String {
    pod_in(api, "default", name, node, json!({}))
}

/// A Pod `namespace/name` bound to `node` with `annotations`, labelled `app: web`; its UID.
fn pod_in(api: &KubeApi, namespace: &str, name: &str, node: &str, annotations: Value) -> String {
    // (No controller-manager makes the namespace's default ServiceAccount, which admission
    // wants.)
    api.apply(json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": namespace},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let pod = api
        .apply(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": "web"},
                "annotations": annotations},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "pause"}]},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    pod["metadata"]["uid"]
        .as_str()
        .expect("the pod's UID")
        .to_string()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// One IPv4 address for `handle`, through the agent's gRPC API, for pod `default/<pod>`.
fn allocate(node: &Node, handle: &str, pod: &str) -> Result<String, tonic::Status> {
    rt().block_on(async {
        let ch = calix_proto::connect_unix(&node.socket, Duration::from_secs(30))
            .await
            .expect("connect to the agent");
        let r = pb::ipam_client::IpamClient::new(ch)
            .allocate(pb::AllocateRequest {
                handle: handle.into(),
                ifname: "eth0".into(),
                ipv4: true,
                attributes: [("namespace", "default"), ("pod", pod)]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            })
            .await?
            .into_inner();
        Ok(r.addresses[0].address.clone())
    })
}

/// Addresses `node` holds (others share the API server).
fn used(node: &Node) -> u64 {
    ipam_show(node)["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["node"] == node.ns.name.as_str())
        .and_then(|n| n["used"].as_u64())
        .unwrap_or(0)
}

fn ipam_show(node: &Node) -> Value {
    node.agent()
        .calixctl_json(&["ipam", "show"])
        .unwrap_or_else(|e| panic!("calixctl ipam show: {e}"))
}

/// Waits until the pools the agent allocates from (the enabled ones its node selects) are
/// `want`.
fn wait_pools(node: &Node, want: &[&str]) {
    wait_for(
        &format!("the agent allocates from {want:?}"),
        Duration::from_secs(30),
        || {
            let pools: Vec<String> = ipam_show(node)["pools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["disabled"] == false)
                .filter_map(|p| p["cidr"].as_str().map(String::from))
                .collect();
            (pools == want).then_some(())
        },
        || node.agent_log(),
    );
}

/// The Events whose reason is `reason` about `kind` `name`.
fn events(api: &KubeApi, reason: &str, kind: &str, name: &str) -> Vec<Value> {
    api.list("v1", "Event", "")
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .filter(|e| {
            e["reason"] == reason
                && e["involvedObject"]["kind"] == kind
                && e["involvedObject"]["name"] == name
        })
        .collect()
}

/// The endpoints `calixctl endpoints -o json` shows, by pod name.
fn endpoints_by_pod(node: &Node) -> std::collections::BTreeMap<String, Value> {
    node.endpoints()["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["podName"].as_str().unwrap_or_default().to_string(),
                e.clone(),
            )
        })
        .collect()
}

#[test]
fn an_agent_with_only_its_cluster_role_follows_its_node_and_the_service_cidrs() {
    let api = KubeApi::shared();
    let token = agent_token(&api);
    let u = unique("a");
    let node = agent_node(&api, &token, "");
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u, "zone": "a"}),
        &[("InternalIP", "192.0.2.10"), ("Hostname", &name)],
    );
    for (zone, cidr) in [("a", "10.71.0.0/24"), ("b", "10.71.1.0/24")] {
        api.apply(ippool(
            &format!("{u}-{zone}"),
            cidr,
            json!({"calix.dev/test": u, "zone": zone}),
        ))
        .unwrap_or_else(|e| panic!("{e}"));
    }
    node.start_agent();
    let log = || node.agent_log();
    assert!(!node.agent_args(&[]).iter().any(|a| a == "--node-name"));
    assert!(
        log()
            .lines()
            .any(|l| l.contains("starting calix-agent") && l.contains(&name)),
        "{}",
        log()
    );
    // Its Node's labels select pool a; its record carries the Node's InternalIP first.
    wait_pools(&node, &["10.71.0.0/24"]);
    let a = allocate(&node, "net:a1", "first").expect("allocate");
    assert!(a.starts_with("10.71.0."), "{a}");
    let show = ipam_show(&node);
    let me = show["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["node"] == name.as_str())
        .unwrap_or_else(|| panic!("{show}"))
        .clone();
    assert_eq!(me["addresses"][0], "192.0.2.10", "{me}");
    // A label change moves the selection, with no restart.
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u, "zone": "b"}),
        &[("InternalIP", "192.0.2.10")],
    );
    wait_pools(&node, &["10.71.1.0/24"]);
    let b = allocate(&node, "net:b1", "second").expect("allocate");
    assert!(b.starts_with("10.71.1."), "{b}");
    assert!(log().contains("Node change"), "{}", log());
    // The API server's own ServiceCIDR (--service-cluster-ip-range), then a new one, are
    // Service addresses: handed to the dataplane as service_cidrs.
    assert!(log().contains("10.96.0.0/16"), "{}", log());
    let svc = format!("{u}-svc");
    api.apply(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": svc}, "spec": {"cidrs": ["10.212.0.0/24"]},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the new ServiceCIDR reaches the dataplane",
        Duration::from_secs(30),
        || {
            log()
                .lines()
                .any(|l| {
                    l.contains("ServiceCIDR change: dataplane settings reloaded")
                        && l.contains("10.212.0.0/24")
                        && l.contains("10.96.0.0/16")
                })
                .then_some(())
        },
        log,
    );
    api.delete("networking.k8s.io/v1", "ServiceCIDR", &svc)
        .unwrap_or_else(|e| panic!("{e}"));
    // A node no pool selects: the allocation fails, and the pod gets a Warning Event.
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u, "zone": "none"}),
        &[("InternalIP", "192.0.2.10")],
    );
    wait_pools(&node, &[]);
    let hungry = format!("{u}-hungry");
    let e = allocate(&node, "net:c1", &hungry).expect_err("no pool");
    assert!(e.message().contains("pool"), "{e:?}");
    let posted = wait_for(
        "a Warning Event IPAMExhausted on the pod",
        Duration::from_secs(20),
        || {
            let ev = events(&api, "IPAMExhausted", "Pod", &hungry);
            (!ev.is_empty()).then_some(ev)
        },
        log,
    );
    assert_eq!(posted[0]["type"], "Warning");
    assert_eq!(posted[0]["source"]["host"], name.as_str());
    assert!(
        posted[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no enabled IPv4 pool")),
        "{}",
        posted[0]
    );
    // All of it with the ClusterRole alone, which allows no more than the agent needs.
    let refused = api.with_token(&token, |c| async move {
        use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
        let mut refused = Vec::new();
        let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::all(c.clone());
        if let Err(kube::Error::Api(s)) = secrets.list(&ListParams::default()).await {
            refused.push(("list secrets", s.code));
        }
        let pools: Api<DynamicObject> = Api::all_with(
            c.clone(),
            &kube::api::ApiResource {
                group: "calix.dev".into(),
                version: "v1".into(),
                api_version: "calix.dev/v1".into(),
                kind: "IPPool".into(),
                plural: "ippools".into(),
            },
        );
        let patch = json!({"spec": {"disabled": true}});
        if let Err(kube::Error::Api(s)) = pools
            .patch("any", &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            refused.push(("patch an IPPool", s.code));
        }
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c);
        if let Err(kube::Error::Api(s)) = nodes.delete("any", &Default::default()).await {
            refused.push(("delete a Node", s.code));
        }
        refused
    });
    assert_eq!(
        refused,
        [
            ("list secrets", 403),
            ("patch an IPPool", 403),
            ("delete a Node", 403)
        ]
    );
    for zone in ["a", "b"] {
        api.delete("calix.dev/v1", "IPPool", &format!("{u}-{zone}"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// `default/<name>`'s endpoint on `node` is gone: not listed, its veth and address gone.
fn wait_endpoints(node: &Node, want: &[&str]) {
    wait_for(
        &format!("the endpoints are those of {want:?}"),
        Duration::from_secs(30),
        || {
            let have: Vec<String> = endpoints_by_pod(node).into_keys().collect();
            (have == want).then_some(())
        },
        || node.agent_log(),
    );
}

#[test]
fn endpoints_of_pods_that_are_gone_are_cleaned_up_also_those_deleted_while_the_agent_was_down() {
    let api = KubeApi::shared();
    let token = agent_token(&api);
    let u = unique("b");
    let node = agent_node(
        &api,
        &token,
        "[kubernetes]\npod_gone_grace_secs = 1\npod_check_interval_secs = 1\n",
    );
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u}),
        &[("InternalIP", "192.0.2.11")],
    );
    api.apply(ippool(&u, "10.72.0.0/24", json!({"calix.dev/test": u})))
        .unwrap_or_else(|e| panic!("{e}"));
    node.start_agent();
    wait_pools(&node, &["10.72.0.0/24"]);
    let names: Vec<String> = (1..=3).map(|i| format!("{u}-p{i}")).collect();
    let uids: Vec<String> = names.iter().map(|p| pod_object(&api, p, &name)).collect();
    let pods: Vec<Pod> = names
        .iter()
        .zip(&uids)
        .map(|(p, uid)| Pod::add_k8s(&node, "default", p, uid, Value::Null))
        .collect();
    // The Pod watch tells calixctl whose each endpoint is.
    let eps = wait_for(
        "every endpoint shows its pod",
        Duration::from_secs(20),
        || {
            let eps = endpoints_by_pod(&node);
            (eps.len() == 3 && eps.values().all(|e| e["podLabels"]["app"] == "web")).then_some(eps)
        },
        || node.agent_log(),
    );
    for (p, uid) in names.iter().zip(&uids) {
        assert_eq!(eps[p]["podUID"], uid.as_str(), "{}", eps[p]);
        assert_eq!(eps[p]["podPhase"], "Pending", "{}", eps[p]);
    }
    assert_eq!(used(&node), 3);
    // The agent is down while p1 is deleted and p2 is replaced by a new pod of its name.
    node.stop_agent();
    api.delete_now("v1", "Pod", "default", &names[0])
        .unwrap_or_else(|e| panic!("{e}"));
    api.delete_now("v1", "Pod", "default", &names[1])
        .unwrap_or_else(|e| panic!("{e}"));
    let new_uid = pod_object(&api, &names[1], &name);
    assert_ne!(new_uid, uids[1]);
    node.start_agent();
    wait_endpoints(&node, &[&names[2]]);
    // (The veth goes right after the endpoint, then the cleanup is logged.)
    wait_for(
        "the gone pods' veths are deleted, and each cleanup logged with its reason",
        Duration::from_secs(10),
        || {
            let log = node.agent_log();
            (node.cali_links() == [pods[2].host_ifname()]
                && log.contains("no longer exists: its endpoint is cleaned up")
                && log.contains("is now another pod"))
            .then_some(())
        },
        || format!("{:?}\n{}", node.cali_links(), node.agent_log()),
    );
    assert_eq!(used(&node), 1, "{}", ipam_show(&node));
    let cleaned = wait_for(
        "Events about the cleanup on the Node",
        Duration::from_secs(20),
        || {
            let ev = events(&api, "EndpointCleanedUp", "Node", &name);
            (ev.len() >= 2).then_some(ev)
        },
        || node.agent_log(),
    );
    assert_eq!(cleaned[0]["type"], "Normal");
    // While it runs: a deletion is seen by the watch.
    api.delete_now("v1", "Pod", "default", &names[2])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_endpoints(&node, &[]);
    wait_for(
        "the last veth is deleted",
        Duration::from_secs(10),
        || node.cali_links().is_empty().then_some(()),
        || format!("{:?}", node.cali_links()),
    );
    assert_eq!(used(&node), 0);
    drop(pods);
    api.delete_now("v1", "Pod", "default", &names[1])
        .unwrap_or_else(|e| panic!("{e}"));
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn pod_and_namespace_annotations_choose_pools_and_fixed_addresses_and_bad_ones_are_named() {
    let api = KubeApi::shared();
    let token = agent_token(&api);
    let u = unique("e");
    let node = agent_node(&api, &token, "");
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u}),
        &[("InternalIP", "192.0.2.13")],
    );
    for (pool, cidr) in [("x", "10.75.0.0/24"), ("y", "10.75.1.0/24")] {
        api.apply(ippool(
            &format!("{u}-{pool}"),
            cidr,
            json!({"calix.dev/test": u}),
        ))
        .unwrap_or_else(|e| panic!("{e}"));
    }
    // The namespace's pools: y.
    api.apply(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": u, "annotations": {"calix.dev/ipv4pools": format!("[\"{u}-y\"]")}},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    node.start_agent();
    wait_pools(&node, &["10.75.0.0/24", "10.75.1.0/24"]);
    let add = |pod: &str, annotations: Value| {
        let uid = pod_in(&api, &u, pod, &name, annotations);
        Pod::try_add_k8s(&node, &u, pod, &uid, Value::Null)
    };
    let from_ns = add("a", json!({}));
    assert!(from_ns.result.success, "{}", from_ns.result.stdout);
    assert!(from_ns.ip().starts_with("10.75.1."), "{}", from_ns.ip());
    let own = add("b", json!({"calix.dev/ipv4pools": "[\"10.75.0.0/24\"]"}));
    assert!(own.result.success, "{}", own.result.stdout);
    assert!(
        own.ip().starts_with("10.75.0."),
        "the pod's own over its namespace's: {}",
        own.ip()
    );
    let fixed = add("c", json!({"calix.dev/ipAddrs": "[\"10.75.0.77\"]"}));
    assert!(fixed.result.success, "{}", fixed.result.stdout);
    assert_eq!(fixed.ip(), "10.75.0.77");
    // Bad annotations: a CNI error naming the annotation, nothing allocated.
    for (pod, annotations, annotation, says) in [
        (
            "d",
            json!({"calix.dev/ipv4pools": "x"}),
            "calix.dev/ipv4pools",
            "not a JSON list",
        ),
        (
            "e",
            json!({"calix.dev/ipv4pools": "[\"nope\"]"}),
            "calix.dev/ipv4pools",
            "names no IPPool",
        ),
        (
            "f",
            json!({"calix.dev/ipAddrs": "[\"10.75.0.77\"]"}),
            "calix.dev/ipAddrs",
            "in use",
        ),
        (
            "g",
            json!({"calix.dev/ipAddrs": "[\"10.99.99.1\"]"}),
            "calix.dev/ipAddrs",
            "not in any enabled pool",
        ),
    ] {
        let bad = add(pod, annotations);
        assert!(!bad.result.success, "{pod}: {}", bad.result.stdout);
        let err: Value = serde_json::from_str(&bad.result.stdout).expect("CNI error JSON");
        let msg = err["msg"].as_str().unwrap_or_default();
        assert!(
            msg.contains(annotation)
                && msg.contains(&format!("pod {u}/{pod}"))
                && msg.contains(says),
            "{pod}: {err}"
        );
    }
    assert_eq!(used(&node), 3, "{}", ipam_show(&node));
    drop((from_ns, own, fixed));
    for pool in ["x", "y"] {
        api.delete("calix.dev/v1", "IPPool", &format!("{u}-{pool}"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// `calixctl --kubeconfig <admin> <args>`, run where the API server listens (no agent, no
/// socket).
fn calixctl_on_cluster(api: &KubeApi, args: &[&str]) -> std::process::Output {
    let ns = api.ns.as_ref().expect("the API server's namespace");
    calix_testbed::run(
        std::process::Command::new("ip")
            .args(["netns", "exec", &ns.name])
            .arg(calix_testbed::bin("calixctl"))
            .arg("--kubeconfig")
            .arg(api.kubeconfig())
            .args(args),
    )
}

#[test]
fn calixctl_shows_checks_and_releases_from_a_kubeconfig_with_the_agent_down() {
    let api = KubeApi::shared();
    let token = agent_token(&api);
    let u = unique("f");
    let node = agent_node(&api, &token, "");
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u}),
        &[("InternalIP", "192.0.2.14")],
    );
    api.apply(ippool(&u, "10.76.0.0/24", json!({"calix.dev/test": u})))
        .unwrap_or_else(|e| panic!("{e}"));
    node.start_agent();
    wait_pools(&node, &["10.76.0.0/24"]);
    let addrs: Vec<String> = (0..3)
        .map(|i| allocate(&node, &format!("net:f{i}"), "f").expect("allocate"))
        .map(|a| a.split('/').next().unwrap_or(&a).to_string())
        .collect();
    let by_socket = ipam_show(&node);
    node.stop_agent();
    // Show: the same report as through the agent, for this node and its pool.
    let out = calixctl_on_cluster(&api, &["ipam", "show", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let show: Value = serde_json::from_slice(&out.stdout).expect("json");
    let of = |r: &Value, n: &str| -> Value {
        r["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|x| x["node"] == n)
            .cloned()
            .unwrap_or(Value::Null)
    };
    assert_eq!(of(&show, &name), of(&by_socket, &name), "{show}");
    assert_eq!(of(&show, &name)["used"], 3);
    assert!(
        show["pools"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["cidr"] == "10.76.0.0/24"),
        "{show}"
    );
    let table = calixctl_on_cluster(&api, &["ipam", "show"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains(&name));
    // Check: this node's allocations have no endpoint; exit 1.
    let out = calixctl_on_cluster(&api, &["ipam", "check", "-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let check: Value = serde_json::from_slice(&out.stdout).expect("json");
    let mut leaks: Vec<String> = check["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == "leak" && f["node"] == name.as_str())
        .filter_map(|f| f["address"].as_str().map(String::from))
        .collect();
    leaks.sort();
    let mut want = addrs.clone();
    want.sort();
    assert_eq!(leaks, want, "{check}");
    // Release one: committed on its block, its handle record follows.
    let out = calixctl_on_cluster(&api, &["ipam", "release", "--ip", &addrs[0], "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(r["released"], json!([addrs[0]]), "{r}");
    let again = calixctl_on_cluster(&api, &["ipam", "release", "--ip", &addrs[0], "-o", "json"]);
    let r: Value = serde_json::from_slice(&again.stdout).expect("json");
    assert_eq!(r["unchanged"], json!([addrs[0]]), "{r}");
    // The handle record followed (no orphan), and the agent, back, agrees: two left.
    let out = calixctl_on_cluster(&api, &["ipam", "check", "-o", "json"]);
    let check: Value = serde_json::from_slice(&out.stdout).expect("json");
    let mine: Vec<&Value> = check["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["node"] == name.as_str())
        .collect();
    assert_eq!(mine.len(), 2, "{check}");
    assert!(mine.iter().all(|f| f["kind"] == "leak"), "{check}");
    node.start_agent();
    assert_eq!(used(&node), 2);
    for a in &addrs[1..] {
        assert!(calixctl_on_cluster(&api, &["ipam", "release", "--ip", a])
            .status
            .success());
    }
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_node_and_pod_watches_carry_on_after_the_api_server_restarts() {
    let api = Arc::new(KubeApi::in_namespace());
    let node = agent_node(
        &api,
        calix_testbed::k8s::ADMIN_TOKEN,
        "[kubernetes]\npod_gone_grace_secs = 1\npod_check_interval_secs = 1\n",
    );
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"zone": "a"}),
        &[("InternalIP", "192.0.2.12")],
    );
    for (zone, cidr) in [("a", "10.73.0.0/24"), ("b", "10.73.1.0/24")] {
        api.apply(ippool(zone, cidr, json!({ "zone": zone })))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    node.start_agent();
    wait_pools(&node, &["10.73.0.0/24"]);
    let uid = pod_object(&api, "p1", &name);
    let pod = Pod::add_k8s(&node, "default", "p1", &uid, Value::Null);
    wait_endpoints(&node, &["p1"]);
    api.restart_apiserver();
    // Both watches went through the restart (the new watch cache answers the old
    // resourceVersion with 410: the followers list again).
    node_object(
        &api,
        &name,
        json!({"zone": "b"}),
        &[("InternalIP", "192.0.2.12")],
    );
    wait_pools(&node, &["10.73.1.0/24"]);
    api.delete_now("v1", "Pod", "default", "p1")
        .unwrap_or_else(|e| panic!("{e}"));
    wait_endpoints(&node, &[]);
    wait_for(
        "the veth is deleted",
        Duration::from_secs(10),
        || node.cali_links().is_empty().then_some(()),
        || format!("{:?}", node.cali_links()),
    );
    assert_eq!(used(&node), 0);
    drop(pod);
}

#[test]
fn route_distribution_finds_its_peers_in_the_node_objects() {
    let api = KubeApi::shared();
    let ca = Ca::new("calix-test-ca").expect("CA");
    let u = unique("d");
    let cluster = Cluster::create(Dataplane::Kernel, &[1, 1, 2], |i, c| {
        let kubeconfig = api.wire(&c.nodes[i].ns).unwrap_or_else(|e| panic!("{e}"));
        format!(
            "uplinks = [\"eth0\"]\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\n\
             [kubernetes]\npod_gone_grace_secs = 3600\n{}",
            kubeconfig.display(),
            c.routes_config(i, &ca, "grace_secs = 5")
                .unwrap_or_else(|e| panic!("{e}"))
        )
    });
    let node = |i: usize| {
        node_object(
            &api,
            cluster.name(i),
            json!({"calix.dev/test": u}),
            &[
                ("InternalIP", &cluster.address(i)),
                ("InternalIP", &cluster.address6(i)),
            ],
        )
    };
    node(0);
    node(1);
    api.apply(ippool(&u, "10.74.0.0/16", json!({"calix.dev/test": u})))
        .unwrap_or_else(|e| panic!("{e}"));
    cluster.start();
    let up = |i: usize| -> Vec<String> {
        let nodes = cluster.nodes[i]
            .agent()
            .calixctl_json(&["nodes"])
            .unwrap_or_else(|e| panic!("calixctl nodes: {e}"));
        nodes["peers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["state"] == "up")
            .map(|p| {
                format!(
                    "{} {}",
                    p["name"].as_str().unwrap_or_default(),
                    p["endpoint"].as_str().unwrap_or_default()
                )
            })
            .collect()
    };
    let peer = |j: usize| format!("{} {}:5474", cluster.name(j), cluster.address(j));
    // Node 2 runs an agent (its node record announces it) but has no Node object yet: not
    // a peer.
    wait_for(
        "node 0 follows node 1, at its InternalIP",
        Duration::from_secs(30),
        || (up(0) == [peer(1)]).then_some(()),
        || format!("{:?}\n{}", up(0), cluster.nodes[0].agent_log()),
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(up(0), [peer(1)]);
    node(2);
    wait_for(
        "node 0 follows nodes 1 and 2",
        Duration::from_secs(30),
        || (up(0) == [peer(1), peer(2)]).then_some(()),
        || format!("{:?}\n{}", up(0), cluster.nodes[0].agent_log()),
    );
    // Pods on each node reach each other: the routes go through the Node objects'
    // addresses, directly on subnet 1, through VXLAN to subnet 2.
    let pods: Vec<Pod> = (0..3).map(|i| Pod::add(&cluster.nodes[i], "p")).collect();
    for j in [1, 2] {
        wait_for(
            &format!("the pod on node 0 reaches the pod on node {j}"),
            Duration::from_secs(20),
            || pods[0].ns.ping(&pods[j].ip(), 1).then_some(()),
            || {
                let routes = cluster.nodes[0].calixctl(&["routes"]);
                format!(
                    "{}\n{}",
                    String::from_utf8_lossy(&routes.stdout),
                    cluster.nodes[0].agent_log()
                )
            },
        );
    }
    // A Node deleted from the cluster is no longer a peer.
    api.delete("v1", "Node", cluster.name(1))
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "node 0 stops following node 1",
        Duration::from_secs(30),
        || (up(0) == [peer(2)]).then_some(()),
        || format!("{:?}", up(0)),
    );
    drop(pods);
    for i in [0, 2] {
        api.delete("v1", "Node", cluster.name(i))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// An IPAMBlock object as anyone who may write IPAMBlocks (every agent's ServiceAccount) can
/// create it: `name`, and `cidr` affine to `node`.
fn ipam_block(name: &str, cidr: &str, node: &str) -> Value {
    json!({
        "apiVersion": "calix.dev/v1",
        "kind": "IPAMBlock",
        "metadata": {"name": name},
        "spec": {"cidr": cidr, "affinity": node, "allocations": {}, "next_seq": 1},
    })
}

/// Issue 20, items 1a and 6, with the kubernetes datastore against a real API server of its
/// own (the forged 0.0.0.0/0 block is cluster-wide): IPAMBlocks forged with the agent's own
/// ServiceAccount token — 0.0.0.0/0 and a /32 over the node's pod's address affine to a
/// rogue node, and one whose CIDR does not parse — are ignored and reported (ipam check, an
/// Event on the Node, the metric), and the agent goes on allocating and claiming blocks.
/// Before, the block that does not decode failed every listing of the blocks, so every
/// allocation, and 0.0.0.0/0 left no block to claim.
#[test]
fn forged_and_undecodable_ipam_blocks_are_ignored_and_reported_in_kubernetes() {
    let api = KubeApi::in_namespace();
    let token = agent_token(&api);
    let node = agent_node(&api, &token, "[ipam]\nleakCheckIntervalSecs = 1\n");
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"zone": "a"}),
        &[("InternalIP", "192.0.2.15")],
    );
    let mut pool = ippool("forged", "10.78.0.0/24", json!({"zone": "a"}));
    pool["spec"]["blockSize"] = json!(30);
    api.apply(pool).unwrap_or_else(|e| panic!("{e}"));
    node.start_agent();
    wait_pools(&node, &["10.78.0.0/24"]);
    let first = allocate(&node, "net:k0", "k").expect("first address");
    let first = first.split('/').next().unwrap_or(&first).to_string();
    let rogue = "cxt-rogue";
    let forged = [
        ipam_block("0.0.0.0-0", "0.0.0.0/0", rogue),
        ipam_block(&format!("{first}-32"), &format!("{first}/32"), rogue),
        ipam_block("10.78.0.128-30", "not a cidr", rogue),
    ];
    api.with_token(&token, |client| async move {
        let blocks: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(
            client,
            &kube::api::ApiResource {
                group: "calix.dev".into(),
                version: "v1".into(),
                api_version: "calix.dev/v1".into(),
                kind: "IPAMBlock".into(),
                plural: "ipamblocks".into(),
            },
        );
        for b in forged {
            let obj: kube::api::DynamicObject = serde_json::from_value(b).expect("object");
            blocks
                .create(&kube::api::PostParams::default(), &obj)
                .await
                .expect("the agent's token may create IPAMBlocks");
        }
    });
    // Three more addresses: the first /30 holds three, so a second block is claimed.
    for i in 1..4 {
        allocate(&node, &format!("net:k{i}"), "k")
            .unwrap_or_else(|e| panic!("allocation {i} beside the forged blocks: {e}"));
    }
    let show = ipam_show(&node);
    let blocks: Vec<&str> = show["blocks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["cidr"].as_str())
        .collect();
    assert_eq!(blocks, ["10.78.0.0/30", "10.78.0.4/30"], "{show}");
    // (ipam check exits 1 on findings.)
    let out = node.calixctl(&["ipam", "check", "-o", "json"]);
    let check: Value = serde_json::from_slice(&out.stdout).expect("ipam check json");
    let rows: std::collections::BTreeSet<(String, String)> = check["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == "ignored-block")
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or_default().to_string();
            (s("block"), s("rule"))
        })
        .collect();
    let want: std::collections::BTreeSet<(String, String)> = [
        ("0.0.0.0/0".to_string(), "outside_pools"),
        (format!("{first}/32"), "block_size"),
        ("ipam/blocks/10.78.0.128-30".to_string(), "undecodable"),
    ]
    .into_iter()
    .map(|(b, r)| (b, r.to_string()))
    .collect();
    assert_eq!(rows, want, "{check}");
    // An Event on the Node for each.
    wait_for(
        "an IPAMBlockIgnored Event per forged block on the Node",
        Duration::from_secs(30),
        || (events(&api, "IPAMBlockIgnored", "Node", &name).len() >= 3).then_some(()),
        || format!("{:#?}", events(&api, "IPAMBlockIgnored", "Node", &name)),
    );
    let (_, metrics) = node.http_get("/metrics").expect("/metrics");
    assert!(
        metrics.contains("calix_ipam_ignored_blocks{rule=\"undecodable\"} 1"),
        "{metrics}"
    );
    // calixctl on the cluster, with no agent, reports them too.
    let out = calixctl_on_cluster(&api, &["ipam", "check"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("ignored-block (outside_pools)") && text.contains("0.0.0.0/0"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
