//! The agent in Kubernetes (issue 14, item 2), against a real kube-apiserver v1.36.2 (one for
//! the whole binary, `KubeApi::shared`; the restart test has its own): agents named by the
//! downward API's environment variable, authenticated as a ServiceAccount bound only to the
//! chart's ClusterRole (charts/calix/templates/clusterrole.yaml), each with a token bound to a
//! pod on its node as a DaemonSet pod's is, under the chart's node authority
//! (templates/authority.yaml: every write must be the node's own); their Node's labels moving
//! the pool selection and its addresses recorded; the Service CIDRs from ServiceCIDR objects;
//! Events; the Pods bound to a node and the cleanup of endpoints whose pod is gone (deleted
//! while the agent was down, replaced by a new pod of the same name, or deleted while it
//! runs); watches across an API server restart; route distribution's peers from Node objects.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use calix_proto::v1 as pb;
use calix_testbed::k8s::{ippool, wait_pools};
use calix_testbed::pod_net::Flow;
use calix_testbed::tls::Ca;
use calix_testbed::{unique, wait_for, Cluster, Dataplane, KubeApi, Node, Pod};
use serde_json::{json, Value};

/// A token of the agents' ServiceAccount (bound to the chart's ClusterRole alone, under the
/// chart's node authority) for `node`, bound to a pod on it as a DaemonSet pod's is.
fn agent_token(api: &KubeApi, node: &str) -> String {
    api.agent_token(node).unwrap_or_else(|e| panic!("{e}"))
}

/// A node (kernel dataplane) on `api` as its agent's ServiceAccount ([`agent_token`]), named
/// only by `CALIX_NODE_NAME` (no `--node-name`), with `extra` config appended after
/// `[datastore]`; not started.
fn agent_node(api: &KubeApi, extra: &str) -> Node {
    agent_node_as(api, None, extra)
}

/// [`agent_node`], authenticated with `token` instead when given (the admin's, for a test
/// whose subject is not the agent's permissions).
fn agent_node_as(api: &KubeApi, token: Option<&str>, extra: &str) -> Node {
    agent_node_on(api, Dataplane::Kernel, token, extra)
}

/// As [`agent_node_as`], with `dataplane`.
fn agent_node_on(api: &KubeApi, dataplane: Dataplane, token: Option<&str>, extra: &str) -> Node {
    api.kubernetes_node(Node::create(dataplane, None), token, extra)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Every write the agent made was its own node's: none refused by the node authority.
fn assert_admitted(node: &Node) {
    let log = node.agent_log();
    let refused = calix_testbed::authority::refusals(&log);
    assert!(refused.is_empty(), "{}", refused.join("\n"));
}

/// Applies Node `name` with `labels` and `addresses` (type, address) in its status.
fn node_object(api: &KubeApi, name: &str, labels: Value, addresses: &[(&str, &str)]) {
    api.node_object(name, labels, addresses)
        .unwrap_or_else(|e| panic!("{e}"));
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
    let u = unique("a");
    let node = agent_node(&api, "");
    let name = node.ns.name.clone();
    let token = agent_token(&api, &name);
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
    assert_admitted(&node);
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
    let u = unique("b");
    let node = agent_node(
        &api,
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
    assert_admitted(&node);
    drop(pods);
    api.delete_now("v1", "Pod", "default", &names[1])
        .unwrap_or_else(|e| panic!("{e}"));
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn pod_and_namespace_annotations_choose_pools_and_fixed_addresses_and_bad_ones_are_named() {
    let api = KubeApi::shared();
    let u = unique("e");
    let node = agent_node(&api, "");
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
            "10.99.99.1 is not in any IPPool",
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
    assert_admitted(&node);
    drop((from_ns, own, fixed));
    for pool in ["x", "y"] {
        api.delete("calix.dev/v1", "IPPool", &format!("{u}-{pool}"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// An IPPool `name` of `cidr` (`blockSize` `block_size`) for the nodes labelled
/// `calix.dev/test: u`, with `namespace_selector` when not null.
fn ippool_for(name: &str, cidr: &str, block_size: u8, u: &str, namespace_selector: Value) -> Value {
    let mut pool = ippool(name, cidr, json!({"calix.dev/test": u}));
    pool["spec"]["blockSize"] = json!(block_size);
    if !namespace_selector.is_null() {
        pool["spec"]["namespaceSelector"] = namespace_selector;
    }
    pool
}

/// Applies Namespace `name` with `labels` and `annotations`.
fn namespace(api: &KubeApi, name: &str, labels: Value, annotations: Value) {
    api.namespace(name, labels, annotations)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The CNI ADD of pod `namespace/pod` (made with `annotations`) on `node` with network config
/// `conf`, which must fail: its CNI error, checked to be the agent's refusal (code 100) whose
/// message names each of `says`, and short.
fn refused_add(
    api: &KubeApi,
    node: &Node,
    (namespace, pod): (&str, &str),
    annotations: Value,
    conf: Value,
    says: &[&str],
) -> Value {
    let uid = pod_in(api, namespace, pod, &node.ns.name, annotations);
    let bad = Pod::try_add_k8s(node, namespace, pod, &uid, conf);
    assert!(
        !bad.result.success,
        "{namespace}/{pod} was not refused: {}",
        bad.result.stdout
    );
    let err: Value = serde_json::from_str(&bad.result.stdout)
        .unwrap_or_else(|e| panic!("{pod}: not CNI error JSON ({e}): {}", bad.result.stdout));
    let msg = err["msg"].as_str().unwrap_or_default();
    assert_eq!(err["code"], 100, "{pod}: {err}");
    for s in says {
        assert!(msg.contains(s), "{pod}: {s:?} not in {err}");
    }
    assert!(
        msg.len() < 1200,
        "{pod}: a long message: {} bytes",
        msg.len()
    );
    err
}

/// The CNI ADD of pod `namespace/pod` (made with `annotations`) on `node` with network config
/// `conf`, which must succeed.
fn added<'a>(
    api: &KubeApi,
    node: &'a Node,
    (namespace, pod): (&str, &str),
    annotations: Value,
    conf: Value,
) -> Pod<'a> {
    let uid = pod_in(api, namespace, pod, &node.ns.name, annotations);
    let p = Pod::try_add_k8s(node, namespace, pod, &uid, conf);
    assert!(
        p.result.success,
        "{namespace}/{pod}: {}\n{}",
        p.result.stdout,
        node.agent_log()
    );
    p
}

/// The blocks `node`'s agent shows as `owner`'s.
fn blocks_of(node: &Node, owner: &str) -> Vec<String> {
    ipam_show(node)["blocks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["affinity"] == owner)
        .filter_map(|b| b["cidr"].as_str().map(String::from))
        .collect()
}

#[test]
fn a_fixed_address_is_checked_like_every_allocation_and_refusals_name_the_rule() {
    let api = KubeApi::shared();
    let u = unique("x");
    let a = agent_node(&api, "[ipam]\nmaxBlocksPerNode = 2\n");
    let b = agent_node(&api, "");
    let (na, nb) = (a.ns.name.clone(), b.ns.name.clone());
    for (n, ip) in [(&na, "192.0.2.15"), (&nb, "192.0.2.16")] {
        node_object(&api, n, json!({"calix.dev/test": u}), &[("InternalIP", ip)]);
    }
    let pool = format!("{u}-p");
    api.apply(ippool_for(&pool, "10.77.0.0/24", 26, &u, Value::Null))
        .unwrap_or_else(|e| panic!("{e}"));
    namespace(&api, &u, json!({}), json!({}));
    a.start_agent();
    b.start_agent();
    wait_pools(&a, &["10.77.0.0/24"]);
    wait_pools(&b, &["10.77.0.0/24"]);
    let add = |node, pod, annotations| added(&api, node, (&u, pod), annotations, Value::Null);
    // a's block 10.77.0.0/26 and b's 10.77.0.64/26, of block size 26.
    let p1 = add(&a, "p1", json!({}));
    assert_eq!(p1.ip(), "10.77.0.1");
    let q1 = add(&b, "q1", json!({}));
    assert_eq!(q1.ip(), "10.77.0.64");
    // The pool's block size becomes 28: those blocks stay as they are.
    // The old size stays one the pool had (previousBlockSizes): its blocks still count.
    let mut resized = ippool_for(&pool, "10.77.0.0/24", 28, &u, Value::Null);
    resized["spec"]["previousBlockSizes"] = json!([26]);
    api.apply(resized).unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "a's agent uses blockSize 28",
        Duration::from_secs(30),
        || (ipam_show(&a)["pools"][0]["block_size"] == 28).then_some(()),
        || a.agent_log(),
    );
    let ip_addrs = |addr: &str| json!({"calix.dev/ipAddrs": format!("[\"{addr}\"]")});
    let fixed = |pod: &str| format!("annotation calix.dev/ipAddrs on pod {u}/{pod}");
    // p1's address, inside a's block of the old size.
    refused_add(
        &api,
        &a,
        (&u, "p2"),
        ip_addrs("10.77.0.1"),
        Value::Null,
        &[&fixed("p2"), "10.77.0.1 is already in use"],
    );
    refused_add(
        &api,
        &a,
        (&u, "p3"),
        ip_addrs("10.77.0.0"),
        Value::Null,
        &[&fixed("p3"), "network address of pool 10.77.0.0/24"],
    );
    refused_add(
        &api,
        &a,
        (&u, "p4"),
        ip_addrs("10.77.0.70"),
        Value::Null,
        &[
            &fixed("p4"),
            &format!("10.77.0.70 lies in block 10.77.0.64/26 of node {nb}"),
        ],
    );
    // A new block of the new size for a fixed address: a's second and last.
    let p5 = add(&a, "p5", ip_addrs("10.77.0.130"));
    assert_eq!(p5.ip(), "10.77.0.130");
    refused_add(
        &api,
        &a,
        (&u, "p6"),
        ip_addrs("10.77.0.200"),
        Value::Null,
        &[
            &fixed("p6"),
            "new block 10.77.0.192/28",
            &format!("node {na} already holds maxBlocksPerNode=2 blocks"),
        ],
    );
    // What a tenant may write: each a refusal naming the annotation.
    let many: Vec<String> = (1..=17).map(|i| format!("10.77.0.{i}")).collect();
    let huge = format!("[\"{}\"]", "9".repeat(100_000));
    for (pod, value, says) in [
        (
            "h1",
            serde_json::to_string(&many).expect("json"),
            "17 entries, at most 16",
        ),
        (
            "h2",
            r#"["10.77.0.9","10.77.0.9"]"#.to_string(),
            "more than one IPv4 address",
        ),
        (
            "h3",
            r#"["fd77::9"]"#.to_string(),
            "assigns no IPv6 addresses",
        ),
        ("h4", huge, "is not an IP address"),
        (
            "h5",
            r#"{"ip": "10.77.0.9"}"#.to_string(),
            "not a JSON list",
        ),
        (
            "h6",
            r#"["10.99.0.9"]"#.to_string(),
            "10.99.0.9 is not in any IPPool",
        ),
    ] {
        refused_add(
            &api,
            &a,
            (&u, pod),
            json!({"calix.dev/ipAddrs": value}),
            Value::Null,
            &[&fixed(pod), says],
        );
    }
    // Nothing was allocated by a refusal, and every address is in one block only.
    assert_eq!(used(&a), 2, "{}", ipam_show(&a));
    assert_eq!(used(&b), 1, "{}", ipam_show(&b));
    assert_eq!(blocks_of(&a, &na), ["10.77.0.0/26", "10.77.0.128/28"]);
    assert_eq!(blocks_of(&a, &nb), ["10.77.0.64/26"]);
    drop((p1, q1, p5));
    api.delete("calix.dev/v1", "IPPool", &pool)
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn pools_restricted_to_namespaces_serve_only_them_however_a_pod_asks() {
    let api = KubeApi::shared();
    let u = unique("n");
    let node = agent_node(&api, "");
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u}),
        &[("InternalIP", "192.0.2.17")],
    );
    let (ta, tb) = (format!("{u}-a"), format!("{u}-b"));
    let tenant = |t: &str| json!({"matchLabels": {"tenant": t}});
    // Listed by name, so a pool the namespace may not use comes first for every pod below.
    let (pa, shared, pb6, pa6) = (
        format!("{u}-0-a"),
        format!("{u}-1-shared"),
        format!("{u}-2-b6"),
        format!("{u}-3-a6"),
    );
    for pool in [
        ippool_for(&pa, "10.78.1.0/24", 28, &u, tenant(&ta)),
        ippool_for(
            &shared,
            "10.78.0.0/24",
            28,
            &u,
            json!({"matchExpressions": [{"key": "tenant", "operator": "NotIn", "values": [ta]}]}),
        ),
        ippool_for(&pb6, "fd78:2::/120", 124, &u, tenant(&tb)),
        ippool_for(&pa6, "fd78:1::/120", 124, &u, tenant(&ta)),
    ] {
        api.apply(pool).unwrap_or_else(|e| panic!("{e}"));
    }
    // Namespace a is tenant a's; c has no labels; d names tenant a's pool for its pods.
    let (ns_a, ns_c, ns_d) = (ta.clone(), format!("{u}-c"), format!("{u}-d"));
    namespace(&api, &ns_a, json!({"tenant": ta}), json!({}));
    namespace(&api, &ns_c, json!({}), json!({}));
    namespace(
        &api,
        &ns_d,
        json!({}),
        json!({"calix.dev/ipv4pools": format!("[\"{pa}\"]")}),
    );
    node.start_agent();
    wait_pools(
        &node,
        &[
            "10.78.1.0/24",
            "10.78.0.0/24",
            "fd78:2::/120",
            "fd78:1::/120",
        ],
    );
    let dual = json!({"ipam": {"type": "calix-ipam", "assign_ipv6": true}});
    let add = |ns, pod, annotations, conf| added(&api, &node, (ns, pod), annotations, conf);
    // By default: each namespace its own pools, never another's.
    let c1 = add(&ns_c, "c1", json!({}), Value::Null);
    assert!(
        c1.ip().starts_with("10.78.0."),
        "namespace c from the shared pool: {}",
        c1.ip()
    );
    let a1 = add(&ns_a, "a1", json!({}), Value::Null);
    assert!(
        a1.ip().starts_with("10.78.1."),
        "namespace a from its pool: {}",
        a1.ip()
    );
    // Annotations choose only among them.
    let not_c = format!("does not serve namespace {ns_c} (namespaceSelector tenant={ta})");
    refused_add(
        &api,
        &node,
        (&ns_c, "c2"),
        json!({"calix.dev/ipv4pools": format!("[\"{pa}\"]")}),
        Value::Null,
        &[
            &format!("annotation calix.dev/ipv4pools on pod {ns_c}/c2"),
            &format!("pool {pa} (10.78.1.0/24) {not_c}"),
        ],
    );
    refused_add(
        &api,
        &node,
        (&ns_d, "d1"),
        json!({}),
        Value::Null,
        &[
            &format!("annotation calix.dev/ipv4pools on namespace {ns_d}"),
            &format!("pool {pa} (10.78.1.0/24) does not serve namespace {ns_d}"),
        ],
    );
    refused_add(
        &api,
        &node,
        (&ns_c, "c3"),
        json!({"calix.dev/ipAddrs": "[\"10.78.1.9\"]"}),
        Value::Null,
        &[
            &format!("annotation calix.dev/ipAddrs on pod {ns_c}/c3"),
            &format!("10.78.1.9 is in pool {pa} (10.78.1.0/24), which {not_c}"),
        ],
    );
    refused_add(
        &api,
        &node,
        (&ns_a, "a2"),
        json!({"calix.dev/ipAddrs": "[\"10.78.0.9\"]"}),
        Value::Null,
        &[&format!(
            "10.78.0.9 is in pool {shared} (10.78.0.0/24), which does not serve namespace {ns_a} \
             (namespaceSelector tenant notin ({ta}))"
        )],
    );
    // A fixed IPv4 address leaves IPv6 to the namespace's pools.
    let a3 = add(
        &ns_a,
        "a3",
        json!({"calix.dev/ipAddrs": "[\"10.78.1.20\"]"}),
        dual.clone(),
    );
    let ips = a3.ips();
    assert_eq!(ips.len(), 2, "{ips:?}");
    assert_eq!(ips[0], "10.78.1.20");
    assert!(
        ips[1].starts_with("fd78:1::"),
        "IPv6 from tenant a's pool: {ips:?}"
    );
    // No IPv6 pool serves namespace c: refused, each pool and its rule named, nothing taken.
    refused_add(
        &api,
        &node,
        (&ns_c, "c4"),
        json!({}),
        dual.clone(),
        &[
            &format!("no IPv6 pool of this node serves namespace {ns_c}"),
            &format!("pool {pb6} (fd78:2::/120) does not serve namespace {ns_c} (namespaceSelector tenant={tb})"),
            &format!("pool {pa6} (fd78:1::/120) does not serve namespace {ns_c} (namespaceSelector tenant={ta})"),
        ],
    );
    refused_add(
        &api,
        &node,
        (&ns_c, "c5"),
        json!({"calix.dev/ipAddrs": "[\"10.78.0.30\"]"}),
        dual,
        &[&format!(
            "no IPv6 pool of this node serves namespace {ns_c}"
        )],
    );
    // An allocation that names no pod: never a pool with a namespaceSelector.
    let e = rt()
        .block_on(async {
            let ch = calix_proto::connect_unix(&node.socket, Duration::from_secs(30))
                .await
                .expect("connect to the agent");
            pb::ipam_client::IpamClient::new(ch)
                .allocate(pb::AllocateRequest {
                    handle: "net:no-pod".into(),
                    ifname: "eth0".into(),
                    ipv4: true,
                    ..Default::default()
                })
                .await
        })
        .expect_err("every IPv4 pool here has a namespaceSelector");
    assert!(e.message().contains("no enabled IPv4 pool"), "{e:?}");
    // The namespace's labels are read at each allocation: c becomes tenant a's.
    namespace(&api, &ns_c, json!({"tenant": ta}), json!({}));
    let c6 = add(&ns_c, "c6", json!({}), Value::Null);
    assert!(c6.ip().starts_with("10.78.1."), "{}", c6.ip());
    assert_eq!(used(&node), 5, "{}", ipam_show(&node));
    drop((c1, a1, a3, c6));
    for pool in [pa, shared, pb6, pa6] {
        api.delete("calix.dev/v1", "IPPool", &pool)
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
    let u = unique("f");
    let node = agent_node(&api, "");
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
    assert_admitted(&node);
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_node_and_pod_watches_carry_on_after_the_api_server_restarts() {
    let api = Arc::new(KubeApi::in_namespace());
    let node = agent_node(
        &api,
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
    assert_admitted(&node);
    drop(pod);
}

#[test]
fn route_distribution_finds_its_peers_in_the_node_objects() {
    let api = KubeApi::shared();
    let ca = Ca::new("calix-test-ca").expect("CA");
    let u = unique("d");
    let cluster = Cluster::create(Dataplane::Kernel, &[1, 1, 2], |i, c| {
        let kubeconfig = api
            .wire_as(&c.nodes[i].ns, &agent_token(&api, c.name(i)))
            .unwrap_or_else(|e| panic!("{e}"));
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
    let up = |i: usize| -> std::collections::BTreeSet<String> {
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
        || (up(0) == [peer(1)].into()).then_some(()),
        || format!("{:?}\n{}", up(0), cluster.nodes[0].agent_log()),
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(up(0), [peer(1)].into());
    node(2);
    wait_for(
        "node 0 follows nodes 1 and 2",
        Duration::from_secs(30),
        || (up(0) == [peer(1), peer(2)].into()).then_some(()),
        || format!("{:?}\n{}", up(0), cluster.nodes[0].agent_log()),
    );
    // Pods on each node reach each other: the routes go through the Node objects'
    // addresses, directly on subnet 1, through VXLAN to subnet 2.
    let pods: Vec<Pod> = (0..3)
        .map(|i| api.node_pod(&cluster.nodes[i], "p"))
        .collect();
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
        || (up(0) == [peer(2)].into()).then_some(()),
        || format!("{:?}", up(0)),
    );
    for n in &cluster.nodes {
        assert_admitted(n);
    }
    drop(pods);
    for i in [0, 2] {
        api.delete("v1", "Node", cluster.name(i))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// A DaemonSet `kube-system/name` (no controller runs here: it makes no pods; the agent under
/// test stands for its pod).
fn daemonset(api: &KubeApi, name: &str) {
    api.apply(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": "kube-system"},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "agent", "image": "pause"}]}},
        },
    }))
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Waits until the agent logged that it knows DaemonSet `name` to be in `state` (its watch's
/// view, `k8s::owner`) for the `n`th time.
fn wait_known(node: &Node, name: &str, state: &str, n: usize) {
    wait_for(
        &format!("the agent's watch sees DaemonSet {name} {state} ({n})"),
        Duration::from_secs(20),
        || {
            let seen = node
                .agent_log()
                .lines()
                .filter(|l| {
                    l.contains("a DaemonSet of calix")
                        && l.contains(&format!("kube-system/{name}"))
                        && l.contains(&format!("state={state}"))
                })
                .count();
            (seen >= n).then_some(())
        },
        || node.agent_log(),
    );
}

/// A conflist at `path` whose first plugin is `first` (calix's, or another network's).
fn conflist(path: &std::path::Path, first: &str) {
    let text = json!({"cniVersion": "1.1.0", "name": "k8s-pod-network",
        "plugins": [{"type": first}, {"type": "portmap", "capabilities": {"portMappings": true}}]});
    std::fs::write(path, text.to_string()).expect("write the conflist");
}

/// An agent (kubernetes datastore, the admin's token: the DaemonSet Role is the chart tests'
/// business) following DaemonSet `<u>-calix` with `<u>-calix-reflector` as its sibling, and
/// the conflist path it removes on an uninstall.
struct Owned {
    node: Node,
    own: String,
    sibling: String,
    conf: PathBuf,
}

impl Owned {
    fn new(api: &KubeApi) -> Self {
        let u = unique("o");
        let node = agent_node_as(api, Some(calix_testbed::k8s::ADMIN_TOKEN), "");
        let name = node.ns.name.clone();
        node_object(api, &name, json!({}), &[("InternalIP", "192.0.2.14")]);
        let conf = node.dir.join("10-calix.conflist");
        Self {
            node,
            own: format!("{u}-calix"),
            sibling: format!("{u}-calix-reflector"),
            conf,
        }
    }

    fn start(&self) {
        let flags = [
            format!("--owner-daemonset=kube-system/{}", self.own),
            format!("--sibling-daemonset=kube-system/{}", self.sibling),
            format!("--cni-conf={}", self.conf.display()),
        ];
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        self.node.start_agent_with(&flags);
    }

    /// Whether the agent's stop was logged as `what`.
    fn stop_said(&self, what: &str) -> bool {
        self.node
            .agent_log()
            .lines()
            .any(|l| l.contains("stopping:") && l.contains(what))
    }

    fn delete(&self, api: &KubeApi, name: &str) {
        api.delete_in("apps/v1", "DaemonSet", "kube-system", name)
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Issue 20, item 7: a deletion the DaemonSet came back from, or one seen before the API
/// server went away, is no uninstall: a stop then leaves everything in place.
#[test]
fn a_daemonset_seen_again_or_lost_from_sight_is_no_uninstall() {
    let api = KubeApi::in_namespace();
    let o = Owned::new(&api);
    // 1. Deleted, then created again (what the agent sees of `kubectl delete
    //    --cascade=orphan` and a re-create), then a stop with the API server unreachable.
    conflist(&o.conf, "calix");
    daemonset(&api, &o.own);
    o.start();
    wait_known(&o.node, &o.own, "Present", 1);
    o.delete(&api, &o.own);
    wait_known(&o.node, &o.own, "Absent", 1);
    daemonset(&api, &o.own);
    wait_known(&o.node, &o.own, "Present", 2);
    api.kill_apiserver();
    o.node.stop_agent();
    assert!(
        o.conf.exists(),
        "a live node was uninstalled: the conflist is gone\n{}",
        o.node.agent_log()
    );
    assert!(o.stop_said("a restart"), "{}", o.node.agent_log());
    // 2. Deleted, then the API server went away before the stop: what the watch saw is
    //    forgotten, and an unreachable API server is no deletion.
    api.start_apiserver().unwrap_or_else(|e| panic!("{e}"));
    o.start();
    wait_known(&o.node, &o.own, "Present", 1);
    o.delete(&api, &o.own);
    wait_known(&o.node, &o.own, "Absent", 1);
    api.kill_apiserver();
    wait_for(
        "the agent's watch loses the API server",
        Duration::from_secs(20),
        || {
            o.node
                .agent_log()
                .contains("lost sight of a DaemonSet")
                .then_some(())
        },
        || o.node.agent_log(),
    );
    o.node.stop_agent();
    assert!(
        o.conf.exists(),
        "a node was uninstalled on an unreachable API server\n{}",
        o.node.agent_log()
    );
    assert!(o.stop_said("a restart"), "{}", o.node.agent_log());
}

/// Issue 20, item 7: switching `routes.topology` from reflectors to mesh deletes the
/// reflectors' DaemonSet while the other takes their nodes over: no uninstall.
#[test]
fn a_topology_switch_is_no_uninstall() {
    let api = KubeApi::shared();
    let o = Owned::new(&api);
    conflist(&o.conf, "calix");
    daemonset(&api, &o.own);
    daemonset(&api, &o.sibling);
    o.start();
    wait_known(&o.node, &o.own, "Present", 1);
    wait_known(&o.node, &o.sibling, "Present", 1);
    o.delete(&api, &o.own);
    wait_known(&o.node, &o.own, "Absent", 1);
    o.node.stop_agent();
    assert!(
        o.conf.exists(),
        "a topology switch uninstalled the node\n{}",
        o.node.agent_log()
    );
    assert!(
        o.stop_said("stays (a topology switch"),
        "{}",
        o.node.agent_log()
    );
    o.delete(&api, &o.sibling);
}

/// Issue 20, item 7: an uninstall (every DaemonSet of the release deleted) removes the
/// conflist only when it is calix's, as `calix-install-cni --uninstall` does.
#[test]
fn an_uninstall_removes_only_calixs_conflist() {
    let api = KubeApi::shared();
    let o = Owned::new(&api);
    for (first, removed) in [("bridge", false), ("calix", true)] {
        conflist(&o.conf, first);
        daemonset(&api, &o.own);
        daemonset(&api, &o.sibling);
        o.start();
        wait_known(&o.node, &o.own, "Present", 1);
        wait_known(&o.node, &o.sibling, "Present", 1);
        o.delete(&api, &o.own);
        o.delete(&api, &o.sibling);
        wait_known(&o.node, &o.own, "Absent", 1);
        wait_known(&o.node, &o.sibling, "Absent", 1);
        o.node.stop_agent();
        assert!(o.stop_said("an uninstall"), "{}", o.node.agent_log());
        assert_eq!(
            !o.conf.exists(),
            removed,
            "a conflist whose first plugin is {first}\n{}",
            o.node.agent_log()
        );
    }
}

/// Issue 20, item 8: `routes.reflector_label` reaches every agent. Node 0 carries the custom
/// label; node 1 carries the old default (`calix.dev/route-reflector`), which must not count:
/// nodes 1 and 2 follow node 0 alone, node 0 follows both, and their pods reach each other
/// through it.
#[test]
fn a_custom_reflector_label_reaches_every_agent() {
    let api = KubeApi::shared();
    let ca = Ca::new("calix-test-ca").expect("CA");
    let u = unique("r");
    let label = format!("example.com/rr-{u}");
    let cluster = Cluster::create(Dataplane::Kernel, &[1, 1, 1], |i, c| {
        let kubeconfig = api.wire(&c.nodes[i].ns).unwrap_or_else(|e| panic!("{e}"));
        format!(
            "uplinks = [\"eth0\"]\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\n\
             [kubernetes]\npod_gone_grace_secs = 3600\n{}",
            kubeconfig.display(),
            c.routes_config(
                i,
                &ca,
                &format!(
                    "grace_secs = 5\ntopology = \"reflectors\"\nreflector_label = \"{label}\""
                )
            )
            .unwrap_or_else(|e| panic!("{e}"))
        )
    });
    for i in 0..3 {
        let mut labels = json!({"calix.dev/test": u});
        if i == 0 {
            labels[&label] = json!("true");
        }
        if i == 1 {
            labels["calix.dev/route-reflector"] = json!("true");
        }
        node_object(
            &api,
            cluster.name(i),
            labels,
            &[("InternalIP", &cluster.address(i))],
        );
    }
    api.apply(ippool(&u, "10.76.0.0/16", json!({"calix.dev/test": u})))
        .unwrap_or_else(|e| panic!("{e}"));
    cluster.start();
    let up = |i: usize| -> std::collections::BTreeSet<String> {
        let nodes = cluster.nodes[i]
            .agent()
            .calixctl_json(&["nodes"])
            .unwrap_or_else(|e| panic!("calixctl nodes: {e}"));
        nodes["peers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["state"] == "up")
            .filter_map(|p| p["name"].as_str().map(String::from))
            .collect::<std::collections::BTreeSet<String>>()
    };
    let name = |i: usize| cluster.name(i).to_string();
    for (i, want) in [
        (0, [name(1), name(2)].into()),
        (1, [name(0)].into()),
        (2, [name(0)].into()),
    ] {
        let want: std::collections::BTreeSet<String> = want;
        wait_for(
            &format!("node {i} follows {want:?}"),
            Duration::from_secs(30),
            || (up(i) == want).then_some(()),
            || format!("{:?}\n{}", up(i), cluster.nodes[i].agent_log()),
        );
    }
    let pods: Vec<Pod> = (0..3)
        .map(|i| api.node_pod(&cluster.nodes[i], "p"))
        .collect();
    for (a, b) in [(1, 2), (2, 1), (1, 0)] {
        wait_for(
            &format!(
                "the pod on node {a} reaches the pod on node {b} (through the reflector's routes)"
            ),
            Duration::from_secs(20),
            || pods[a].ns.ping(&pods[b].ip(), 1).then_some(()),
            || cluster.nodes[a].agent_log(),
        );
    }
    drop(pods);
    for i in 0..3 {
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
/// own (the forged 0.0.0.0/0 block is cluster-wide): IPAMBlocks forged by hand — 0.0.0.0/0 and a /32 over the node's pod's address affine to a
/// rogue node, and one whose CIDR does not parse — are ignored and reported (ipam check, an
/// Event on the Node, the metric), and the agent goes on allocating and claiming blocks.
/// Before, the block that does not decode failed every listing of the blocks, so every
/// allocation, and 0.0.0.0/0 left no block to claim.
#[test]
fn forged_and_undecodable_ipam_blocks_are_ignored_and_reported_in_kubernetes() {
    let api = KubeApi::in_namespace();
    // Forged by hand (the admin's token): the node authority would refuse an agent's token
    // a block affine to another node (tests/tests/authority.rs); here the question is what the
    // agents make of such objects, whoever wrote them.
    let token = calix_testbed::k8s::ADMIN_TOKEN.to_string();
    let node = agent_node(&api, "[ipam]\nleakCheckIntervalSecs = 1\n");
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
                .expect("the admin may create IPAMBlocks");
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

/// Pod `namespace/name` bound to `node` with `labels`, a container port `http` (TCP 8080), and
/// `ip` in its status, as a kubelet would report it.
fn pod_with_ip(api: &KubeApi, namespace: &str, name: &str, node: &str, labels: Value, ip: &str) {
    api.apply(json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": namespace},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let meta = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace}});
    let mut pod = meta.clone();
    pod["metadata"]["labels"] = labels;
    pod["spec"] = json!({"nodeName": node, "containers": [{"name": "c", "image": "pause",
        "ports": [{"name": "http", "containerPort": 8080}]}]});
    api.apply(pod).unwrap_or_else(|e| panic!("{e}"));
    api.patch_status(meta, json!({"podIP": ip, "podIPs": [{"ip": ip}]}))
        .unwrap_or_else(|e| panic!("{e}"));
}

/// A node on `dataplane` whose Node object (address `ip`) is labelled `calix.dev/test: u`, with
/// an IPPool `cidr` of its own (one CIDR in two IPPools of the shared API server would stop
/// every agent reading them), its agent started and the pool in use.
fn started_with_pool(api: &KubeApi, dataplane: Dataplane, u: &str, cidr: &str, ip: &str) -> Node {
    let node = agent_node_on(api, dataplane, None, "");
    api.started_with_pool(node, u, cidr, ip)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `calixctl policy <pod> -o json` once it satisfies `ok`.
fn wait_policy(node: &Node, pod: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    wait_for(
        what,
        Duration::from_secs(20),
        || {
            node.agent()
                .calixctl_json(&["policy", pod])
                .ok()
                .filter(|r| ok(r))
        },
        || {
            format!(
                "{:?}\n{}",
                node.agent().calixctl_json(&["policy", pod]),
                node.agent_log()
            )
        },
    )
}

#[test]
fn network_policies_namespaces_and_every_pod_are_followed_with_only_the_cluster_role() {
    let api = KubeApi::shared();
    let u = unique("np");
    let node = started_with_pool(&api, Dataplane::Kernel, &u, "10.81.0.0/24", "192.0.2.31");
    let name = node.ns.name.clone();
    let ns = format!("{u}-shop");
    namespace(&api, &ns, json!({"team": u}), json!({}));
    let elsewhere = format!("{u}-other-node");
    pod_with_ip(&api, &ns, "web", &name, json!({"app": "web"}), "10.81.0.5");
    pod_with_ip(
        &api,
        &ns,
        "c1",
        &elsewhere,
        json!({"role": "client"}),
        "10.74.0.1",
    );
    pod_with_ip(
        &api,
        &ns,
        "c2",
        &elsewhere,
        json!({"role": "other"}),
        "10.74.0.2",
    );
    let web = format!("{ns}/web");
    // Before any policy: known, here, open both ways.
    wait_policy(&node, &web, "the pod is known and open", |r| {
        r["ready"] == true
            && r["endpoint"]["local"] == true
            && r["endpoint"]["ingress"].is_null()
            && r["endpoint"]["egress"].is_null()
    });
    api.apply(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                "ports": [{"port": "http"}, {"protocol": "UDP", "port": 9000, "endPort": 9010}]
            }]
        }
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let r = wait_policy(&node, &web, "the policy isolates web", |r| {
        r["endpoint"]["ingress"].is_array()
    });
    let e = &r["endpoint"];
    assert_eq!(e["policies"], json!([format!("{ns}/web")]), "{r}");
    assert_eq!(
        e["egress"],
        json!([]),
        "egress isolated, nothing allowed: {r}"
    );
    let rule = &e["ingress"][0];
    assert_eq!(rule["peer"], format!("pods role=client in {ns}"), "{r}");
    assert_eq!(rule["ports"], "TCP/8080,UDP/9000-9010", "{r}");
    assert_eq!(rule["members"], 1, "{r}");
    // A pod on another node takes the label: the set grows, the rules stay.
    pod_with_ip(
        &api,
        &ns,
        "c2",
        &elsewhere,
        json!({"role": "client"}),
        "10.74.0.2",
    );
    wait_policy(&node, &web, "c2 joins the clients", |r| {
        r["endpoint"]["ingress"][0]["members"] == 2
    });
    // Another node's pod: known, not programmed here.
    let c1 = node
        .agent()
        .calixctl_json(&["policy", &format!("{ns}/c1")])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c1["endpoint"]["local"], false, "{c1}");
    // The policy goes: open again.
    api.delete_now("networking.k8s.io/v1", "NetworkPolicy", &ns, "web")
        .unwrap_or_else(|e| panic!("{e}"));
    // (The count of policies is cluster-wide: other tests write theirs meanwhile.)
    wait_policy(&node, &web, "open again without the policy", |r| {
        r["endpoint"]["ingress"].is_null() && r["endpoint"]["policies"] == json!([])
    });
    assert_admitted(&node);
    for p in ["web", "c1", "c2"] {
        api.delete_now("v1", "Pod", &ns, p)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Pod `namespace/name` with `labels`, bound to `node`, ADDed there, and its address in its
/// status (what the kubelet reports once the sandbox runs).
fn running_pod<'a>(
    api: &KubeApi,
    node: &'a Node,
    namespace: &str,
    name: &str,
    labels: Value,
) -> Pod<'a> {
    api.running_pod(node, namespace, name, labels)
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()))
}

/// NetworkPolicy enforced end to end in the eBPF dataplane: real pods (CNI ADD through the
/// agent), their Pod objects in a real API server, the agent holding only its ClusterRole. A
/// policy lets one client in: the other's packets are dropped, the client's pass, the
/// isolated pod's own traffic and its replies pass; across the agent's `kill -9` and restart
/// all of it holds; the policy gone, all pass again.
#[test]
fn network_policy_is_enforced_on_real_pods_in_the_ebpf_dataplane() {
    policy_enforced_on_real_pods(Dataplane::Ebpf, "npe", "10.82.0.0/24", "192.0.2.32");
}

/// The same in kernel mode (nftables).
#[test]
fn network_policy_is_enforced_on_real_pods_in_the_kernel_dataplane() {
    policy_enforced_on_real_pods(Dataplane::Kernel, "npk", "10.85.0.0/24", "192.0.2.38");
}

/// With `web` isolated and `client` let in: an established connection from the client meets a
/// change that keeps it allowed (another policy written) without a gap, and one that revokes
/// it (the client's label taken) stops it, both ways, until it is allowed again: no
/// established-flow shortcut (calico#6399).
fn established_flows_across_changes(api: &KubeApi, node: &Node, ns: &str, client: &Pod, web: &Pod) {
    let web_ip = web.ip();
    let show = || node.agent_log();
    let flow = Flow::start(&client.ns.path(), &web.ns.path(), &web_ip);
    std::thread::sleep(Duration::from_millis(500));
    api.apply(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "unrelated", "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app": "nobody"}}, "ingress": []}
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_secs(2));
    let (echoes, gap) = flow.stop();
    assert!(
        gap < Duration::from_millis(500),
        "an unrelated change cost the allowed flow {gap:?} ({echoes} echoes)"
    );
    let flow = Flow::start(&client.ns.path(), &web.ns.path(), &web_ip);
    std::thread::sleep(Duration::from_millis(500));
    let meta = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "client", "namespace": ns}});
    let label = |role: &str| {
        api.merge_patch(
            meta.clone(),
            json!({"metadata": {"labels": {"role": role}}}),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    };
    label("revoked");
    wait_for(
        "the client's label taken: refused",
        Duration::from_secs(20),
        || (!client.ns.ping(&web_ip, 1)).then_some(()),
        show,
    );
    std::thread::sleep(Duration::from_secs(2));
    label("client");
    wait_for(
        "the label back: let in again",
        Duration::from_secs(20),
        || client.ns.ping(&web_ip, 1).then_some(()),
        show,
    );
    // TCP retransmits with backoff: give the connection time to come back.
    std::thread::sleep(Duration::from_secs(8));
    let (echoes, gap) = flow.stop();
    assert!(
        gap >= Duration::from_secs(2),
        "the revoked connection went on: longest gap {gap:?} ({echoes} echoes)"
    );
    api.delete_now("networking.k8s.io/v1", "NetworkPolicy", ns, "unrelated")
        .unwrap_or_else(|e| panic!("{e}"));
}

/// `calixctl trace`: other's packet to web is dropped by web's ingress policy (the policy
/// named), the client's allowed by the policy's rule 0; from the live maps in eBPF, from the
/// tables written to nftables in kernel mode. A dropped packet's trace exits non-zero.
fn trace_names_the_deciding_rule(node: &Node, dataplane: Dataplane, ns: &str) {
    let trace = |src: &str, proto: &str| trace_to_web(node, ns, src, proto);
    let source = match dataplane {
        Dataplane::Ebpf => "live maps",
        Dataplane::Kernel => "tables written to nftables",
    };
    let (ok, v) = trace("other", "icmp");
    assert!(!ok, "a dropped packet's trace exits non-zero: {v}");
    let last = &v["steps"]
        .as_array()
        .expect("steps")
        .last()
        .cloned()
        .expect("a step");
    assert_eq!(last["stage"], "ingress policy", "{v}");
    assert_eq!(last["outcome"], "drop", "{v}");
    assert_eq!(last["source"], source, "{v}");
    assert!(
        last["detail"]
            .as_str()
            .is_some_and(|d| d.contains(&format!("by {ns}/web"))),
        "{v}"
    );
    let (ok, v) = trace("client", "tcp/80");
    assert!(ok, "{v}");
    let last = &v["steps"]
        .as_array()
        .expect("steps")
        .last()
        .cloned()
        .expect("a step");
    assert_eq!(last["outcome"], "pass", "{v}");
    assert_eq!(
        last["detail"],
        format!("allowed by policy {ns}/web ingress rule 0"),
        "{v}"
    );
    assert_eq!(last["source"], source, "{v}");
    let egress = &v["steps"][1];
    assert_eq!(egress["stage"], "egress policy", "{v}");
    assert_eq!(egress["outcome"], "pass", "{v}");
}

/// `calixctl monitor --drops` while `other` pings the isolated `web`: each denied packet as it
/// happens, named (eBPF: its ring of drop events; kernel mode: the drops its policy chains log
/// to `nfnetlink_log`).
fn monitor_sees_the_drops(node: &Node, dataplane: Dataplane, ns: &str, other: &Pod, web: &Pod) {
    use std::process::Stdio;
    let mut child = node
        .agent()
        .calixctl_command()
        .args(["monitor", "--drops", "--count", "2", "-o", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("calixctl monitor");
    let web_ip = web.ip();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("calixctl monitor --drops saw no 2 drops in 20 s");
        }
        other.ns.ping(&web_ip, 1);
    };
    let out = child.wait_with_output().expect("output");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    // Both dataplanes: the eBPF programs' ring, kernel mode's log group.
    assert!(status.success(), "{dataplane:?}: {stderr}");
    let events: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(events.len(), 2, "{stdout}");
    for e in &events {
        assert_eq!(e["pod"], format!("{ns}/web"), "{e}");
        assert_eq!(e["direction"], "ingress", "{e}");
        assert_eq!(e["protocol"], "ICMP", "{e}");
        assert_eq!(e["pod_address"], web_ip.as_str(), "{e}");
        assert_eq!(e["peer_address"], other.ip().as_str(), "{e}");
        assert_eq!(e["peer_pod"], format!("{ns}/other"), "{e}");
        assert_eq!(e["why"], "no rule allows it", "{e}");
    }
}

fn policy_enforced_on_real_pods(dataplane: Dataplane, tag: &str, cidr: &str, node_ip: &str) {
    let api = KubeApi::shared();
    let u = unique(tag);
    let node = started_with_pool(&api, dataplane, &u, cidr, node_ip);
    let ns = format!("{u}-np");
    namespace(&api, &ns, json!({}), json!({}));
    let web = running_pod(&api, &node, &ns, "web", json!({"app": "web"}));
    let client = running_pod(&api, &node, &ns, "client", json!({"role": "client"}));
    let other = running_pod(&api, &node, &ns, "other", json!({"role": "other"}));
    let (web_ip, other_ip) = (web.ip(), other.ip());
    assert!(other.ns.ping(&web_ip, 1), "open before any policy");
    web_lets_in_the_client(&api, &ns);
    let show = || node.agent_log();
    wait_for(
        "the policy drops other's packets to web",
        Duration::from_secs(20),
        || (!other.ns.ping(&web_ip, 1)).then_some(()),
        show,
    );
    assert!(client.ns.ping(&web_ip, 2), "the client is let in");
    assert!(
        web.ns.ping(&other_ip, 2),
        "web's own traffic and its replies pass"
    );
    assert!(!other.ns.ping(&web_ip, 2), "still dropped");
    established_flows_across_changes(&api, &node, &ns, &client, &web);
    let report = node
        .agent()
        .calixctl_json(&["policy"])
        .unwrap_or_else(|e| panic!("{e}"));
    let programmed = report["dataplane"].as_str().unwrap_or_default();
    assert!(
        programmed.ends_with(" entries") && !programmed.starts_with("not"),
        "calixctl policy says what the dataplane holds: {report}"
    );
    // Which rule let the client in, how often, and how much the policy denied: counted for
    // the endpoint, in both dataplanes (kernel mode: its nft counters, kept across the
    // rewrites the changes above made).
    let pod_report = node
        .agent()
        .calixctl_json(&["policy", &format!("{ns}/web")])
        .unwrap_or_else(|e| panic!("{e}"));
    let ep = &pod_report["endpoint"];
    assert_eq!(
        ep["ingress"][0]["policy"],
        format!("{ns}/web"),
        "{pod_report}"
    );
    assert!(
        ep["ingress"][0]["hits"].as_u64().is_some_and(|n| n > 0),
        "the client's rule counted its hits: {pod_report}"
    );
    assert!(
        ep["denied_ingress"].as_u64().is_some_and(|n| n > 0),
        "other's packets counted as denied: {pod_report}"
    );
    // Web's answers on the revoked connection above were refused too (counted by the
    // direction that met them in eBPF, by the revoking direction's reply chain in nftables).
    assert!(ep["denied_egress"].is_u64(), "{pod_report}");
    monitor_sees_the_drops(&node, dataplane, &ns, &other, &web);
    trace_names_the_deciding_rule(&node, dataplane, &ns);
    let (_, metrics) = node.http_get("/metrics").expect("/metrics");
    for line in [
        "calix_policy_ready 1",
        "calix_policy_isolated_endpoints{direction=\"ingress\"} 1",
        "calix_policy_isolated_endpoints{direction=\"egress\"} 0",
        "calix_policy_not_programmed 0",
    ] {
        assert!(metrics.contains(line), "{line} not in /metrics:\n{metrics}");
    }
    let denied = metrics
        .lines()
        .find(|l| {
            l.starts_with("calix_policy_denied_packets_total{")
                && l.contains(&format!("pod=\"{ns}/web\",direction=\"ingress\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok());
    assert!(
        denied.is_some_and(|n| n > 0),
        "web's denied packets on /metrics:\n{metrics}"
    );
    if dataplane == Dataplane::Ebpf {
        let drops = node
            .agent()
            .calixctl_json(&["bpf", "counters"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            drops.to_string().contains("policy_ingress"),
            "counted as policy drops: {drops}"
        );
    }
    // kill -9: the pinned policy stays in force while the agent is away, and after it is back
    // (before and after it has computed the policy again): no window open, none closed.
    node.kill_agent();
    assert!(!other.ns.ping(&web_ip, 2), "dropped with the agent down");
    assert!(
        client.ns.ping(&web_ip, 1),
        "the client let in with the agent down"
    );
    node.start_agent();
    for _ in 0..3 {
        assert!(!other.ns.ping(&web_ip, 1), "dropped after the restart");
        assert!(
            client.ns.ping(&web_ip, 1),
            "the client let in after the restart"
        );
    }
    wait_policy(
        &node,
        &format!("{ns}/web"),
        "the restarted agent has the policy",
        |r| r["ready"] == true && r["endpoint"]["ingress"].is_array(),
    );
    assert!(
        !other.ns.ping(&web_ip, 2),
        "dropped once the policy is computed again"
    );
    assert!(client.ns.ping(&web_ip, 1));
    api.delete_now("networking.k8s.io/v1", "NetworkPolicy", &ns, "web")
        .unwrap_or_else(|e| panic!("{e}"));
    // Should this fail: what the agent computed, what the live maps say, and the end of
    // its log (the start is the pools' and blocks' noise of the shared API server).
    let diagnosis = || {
        let web = format!("{ns}/web");
        let other = format!("{ns}/other");
        let log = node.agent_log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains("IPAMBlockIgnored") && !l.contains("IPAM block ignored"))
            .collect();
        format!(
            "policy: {:?}\ntrace: {:?}\nlog (end):\n{}",
            node.agent().calixctl_json(&["policy", &web]),
            node.agent().calixctl_json(&["trace", &other, &web, "icmp"]),
            lines[lines.len().saturating_sub(80)..].join("\n")
        )
    };
    wait_for(
        "the policy gone, other reaches web again",
        Duration::from_secs(20),
        || other.ns.ping(&web_ip, 1).then_some(()),
        diagnosis,
    );
}

/// IPPools that cannot be served (a CIDR already another IPPool's, one inside another's, a
/// block larger than the pool) are refused one by one, each named in a Warning Event on the
/// Node, and the agent starts and serves the others; one written while it runs is refused the
/// same way, and a valid one is served. (Before, one such object stopped every agent that
/// read it.) The CIDRs are this test's own: in the shared API server, a pool of another
/// test's CIDR would take it from that test.
#[test]
fn ippools_that_cannot_be_served_are_refused_one_by_one_and_the_others_served() {
    let api = KubeApi::shared();
    let u = unique("dup");
    let node = agent_node(&api, "");
    let name = node.ns.name.clone();
    node_object(
        &api,
        &name,
        json!({"calix.dev/test": u}),
        &[("InternalIP", "192.0.2.36")],
    );
    let sel = json!({"calix.dev/test": u});
    let apply = |n: &str, cidr: &str| {
        api.apply(ippool(&format!("{u}-{n}"), cidr, sel.clone()))
            .unwrap_or_else(|e| panic!("{e}"));
    };
    apply("a", "10.83.0.0/24");
    apply("b", "10.83.0.0/24");
    apply("c", "10.83.0.128/25");
    let mut bad = ippool(&format!("{u}-d"), "10.83.1.0/28", sel.clone());
    bad["spec"]["blockSize"] = json!(26);
    api.apply(bad).unwrap_or_else(|e| panic!("{e}"));
    node.start_agent();
    wait_pools(&node, &["10.83.0.0/24"]);
    let refusals = |want: usize| {
        wait_for(
            &format!("{want} IPPoolRefused Events on the Node"),
            Duration::from_secs(20),
            || {
                let ev = events(&api, "IPPoolRefused", "Node", &name);
                (ev.len() >= want).then_some(ev)
            },
            || node.agent_log(),
        )
    };
    let said = |ev: &[Value]| -> String {
        ev.iter()
            .filter_map(|e| e["message"].as_str())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let ev = refusals(3);
    let text = said(&ev);
    assert!(ev.iter().all(|e| e["type"] == "Warning"), "{ev:?}");
    assert!(
        text.contains(&format!(
            "IPPool {u}-b is not served: its CIDR 10.83.0.0/24 is IPPool {u}-a's"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "IPPool {u}-c is not served: 10.83.0.128/25 overlaps IPPool {u}-a"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("IPPool {u}-d is not served")),
        "{text}"
    );
    assert!(node.agent().exited().is_none(), "the agent runs");
    // While it runs: a valid pool is served, another duplicate refused.
    apply("e", "10.83.2.0/24");
    apply("f", "10.83.2.0/24");
    wait_pools(&node, &["10.83.0.0/24", "10.83.2.0/24"]);
    let text = said(&refusals(4));
    assert!(
        text.contains(&format!(
            "IPPool {u}-f is not served: its CIDR 10.83.2.0/24 is IPPool {u}-e's"
        )),
        "{text}"
    );
    for n in ["a", "b", "c", "d", "e", "f"] {
        api.delete("calix.dev/v1", "IPPool", &format!("{u}-{n}"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A policy deleted and written again, and a peer's label taken away and given back, with a
/// policy isolating the server in force throughout: the client is refused and let in again
/// each time (what `cargo xtask bench policy` measures the latency of).
#[test]
fn a_policy_and_a_label_toggled_are_enforced_each_time() {
    policy_and_label_toggled(Dataplane::Ebpf, "npt", "10.84.0.0/24", "192.0.2.37");
}

/// The same in kernel mode (nftables).
#[test]
fn a_policy_and_a_label_toggled_are_enforced_each_time_in_kernel_mode() {
    policy_and_label_toggled(Dataplane::Kernel, "nptk", "10.86.0.0/24", "192.0.2.39");
}

fn policy_and_label_toggled(dataplane: Dataplane, tag: &str, cidr: &str, node_ip: &str) {
    let api = KubeApi::shared();
    let u = unique(tag);
    let node = started_with_pool(&api, dataplane, &u, cidr, node_ip);
    let ns = format!("{u}-np");
    namespace(&api, &ns, json!({}), json!({}));
    let server = running_pod(&api, &node, &ns, "server", json!({"lat": "server"}));
    let client = running_pod(&api, &node, &ns, "client", json!({"access": "yes"}));
    let server_ip = server.ip();
    let policy = |name: &str, ingress: Value| {
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"podSelector": {"matchLabels": {"lat": "server"}},
                     "policyTypes": ["Ingress"], "ingress": ingress}
        })
    };
    let allow = policy(
        "allow",
        json!([{"from": [{"podSelector": {"matchLabels": {"access": "yes"}}}]}]),
    );
    api.apply(policy("isolate", json!([])))
        .unwrap_or_else(|e| panic!("{e}"));
    api.apply(allow.clone()).unwrap_or_else(|e| panic!("{e}"));
    let show = || {
        format!(
            "{:?}\n{}",
            node.agent()
                .calixctl_json(&["policy", &format!("{ns}/server")]),
            node.agent_log()
        )
    };
    let wait = |what: &str, open: bool| {
        wait_for(
            what,
            Duration::from_secs(10),
            || (client.ns.ping(&server_ip, 1) == open).then_some(()),
            show,
        )
    };
    wait("let in with allow", true);
    let meta = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "client", "namespace": ns}});
    for round in 0..2 {
        api.delete_in("networking.k8s.io/v1", "NetworkPolicy", &ns, "allow")
            .unwrap_or_else(|e| panic!("{e}"));
        wait(&format!("round {round}: refused, allow deleted"), false);
        api.apply(allow.clone()).unwrap_or_else(|e| panic!("{e}"));
        wait(&format!("round {round}: let in, allow written again"), true);
        api.merge_patch(
            meta.clone(),
            json!({"metadata": {"labels": {"access": "no"}}}),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        wait(&format!("round {round}: refused, label taken"), false);
        api.merge_patch(
            meta.clone(),
            json!({"metadata": {"labels": {"access": "yes"}}}),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        wait(&format!("round {round}: let in, label given back"), true);
    }
}

/// NetworkPolicy `ns/web`: pods `app: web` let in only pods `role: client` of `ns`.
fn web_lets_in_the_client(api: &KubeApi, ns: &str) {
    api.apply(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}]
        }
    }))
    .unwrap_or_else(|e| panic!("{e}"));
}

/// `calixctl trace <ns>/<src> <ns>/web <proto> -o json` on `node`: whether it exited 0, and
/// the report.
fn trace_to_web(node: &Node, ns: &str, src: &str, proto: &str) -> (bool, Value) {
    let out = node
        .agent()
        .calixctl_command()
        .args(["trace", &format!("{ns}/{src}"), &format!("{ns}/web"), proto])
        .args(["-o", "json"])
        .output()
        .expect("calixctl trace");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), v)
}

/// `calixctl trace` across nodes (eBPF): a pod's end on another node is answered by that
/// node's agent, from its live maps, over route distribution's mutual TLS
/// (`calix.v1.Routes/Verdict`): the deciding rule or the isolating policy, named, with the
/// node that answered; the trace of a dropped packet exits non-zero.
#[test]
fn trace_asks_the_node_a_traced_pod_lives_on() {
    let api = KubeApi::shared();
    let ca = Ca::new("calix-test-ca").expect("CA");
    let u = unique("tr");
    let cluster = Cluster::create(Dataplane::Ebpf, &[1, 1], |i, c| {
        let kubeconfig = api
            .wire_as(&c.nodes[i].ns, &agent_token(&api, c.name(i)))
            .unwrap_or_else(|e| panic!("{e}"));
        format!(
            "uplinks = [\"eth0\"]\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\n{}",
            kubeconfig.display(),
            c.routes_config(i, &ca, "")
                .unwrap_or_else(|e| panic!("{e}"))
        )
    });
    for i in 0..2 {
        node_object(
            &api,
            cluster.name(i),
            json!({"calix.dev/test": u}),
            &[("InternalIP", &cluster.address(i))],
        );
    }
    api.apply(ippool(&u, "10.87.0.0/16", json!({"calix.dev/test": u})))
        .unwrap_or_else(|e| panic!("{e}"));
    cluster.start();
    let ns = format!("{u}-ns");
    namespace(&api, &ns, json!({}), json!({}));
    let pod = |i: usize, name: &str, labels: Value| {
        api.running_pod(&cluster.nodes[i], &ns, name, labels)
            .unwrap_or_else(|e| panic!("pod {name}: {e}"))
    };
    let web = pod(1, "web", json!({"app": "web"}));
    let client = pod(0, "client", json!({"role": "client"}));
    let other = pod(0, "other", json!({"role": "other"}));
    web_lets_in_the_client(&api, &ns);
    let web_ip = web.ip();
    wait_for(
        "the client reaches web on the other node, and other does not",
        Duration::from_secs(30),
        || (client.ns.ping(&web_ip, 1) && !other.ns.ping(&web_ip, 1)).then_some(()),
        || cluster.nodes[1].agent_log(),
    );
    let trace =
        |on: usize, src: &str, proto: &str| trace_to_web(&cluster.nodes[on], &ns, src, proto);
    let step = |v: &Value, stage: &str| {
        v["steps"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["stage"] == stage)
            .cloned()
            .unwrap_or_else(|| panic!("no {stage} step: {v}"))
    };
    // From node 0: web's ingress is answered by node 1, from its live maps.
    let (ok, v) = trace(0, "client", "tcp/80");
    assert!(ok, "{v}");
    let ingress = step(&v, "ingress policy");
    assert_eq!(ingress["node"], cluster.name(1), "{v}");
    assert_eq!(ingress["source"], "live maps", "{v}");
    assert_eq!(ingress["outcome"], "pass", "{v}");
    assert_eq!(
        ingress["detail"],
        format!("allowed by policy {ns}/web ingress rule 0"),
        "{v}"
    );
    let (ok, v) = trace(0, "other", "icmp");
    assert!(!ok, "a dropped packet's trace exits non-zero: {v}");
    let ingress = step(&v, "ingress policy");
    assert_eq!(ingress["node"], cluster.name(1), "{v}");
    assert_eq!(ingress["source"], "live maps", "{v}");
    assert_eq!(ingress["outcome"], "drop", "{v}");
    assert!(
        ingress["detail"]
            .as_str()
            .is_some_and(|d| d.contains(&format!("by {ns}/web"))),
        "{v}"
    );
    // From node 1: the client's egress is answered by node 0 (not isolated), web's ingress
    // here.
    let (ok, v) = trace(1, "client", "tcp/80");
    assert!(ok, "{v}");
    let egress = step(&v, "egress policy");
    assert_eq!(egress["node"], cluster.name(0), "{v}");
    assert_eq!(egress["source"], "live maps", "{v}");
    assert_eq!(egress["outcome"], "pass", "{v}");
    assert_eq!(step(&v, "ingress policy")["node"], cluster.name(1), "{v}");
    drop((web, client, other));
    for i in 0..2 {
        api.delete("v1", "Node", cluster.name(i))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// `[services] enabled`: the agent follows Services and EndpointSlices with the chart's
/// ClusterRole and calculates them (`calixctl services`): a ClusterIP's backends from its
/// slice; an external address inside `external_cidrs` taken, one outside refused, and one
/// inside that is another Node's address refused too (CVE-2020-8554); a slice's bad endpoint skipped and said, the rest kept; a Service with no
/// endpoint rejects; the slice's change and the Service's deletion followed.
#[test]
fn services_and_endpoint_slices_are_followed_and_calculated() {
    let api = KubeApi::shared();
    let u = unique("svc");
    let node = agent_node(
        &api,
        "[services]\nenabled = true\nexternal_cidrs = [\"203.0.113.0/24\"]\n",
    );
    let node = api
        .started_with_pool(node, &u, "10.79.0.0/24", "192.0.2.41")
        .unwrap_or_else(|e| panic!("{e}"));
    let ns = format!("{u}-svc");
    namespace(&api, &ns, json!({}), json!({}));
    let service = |name: &str, external: &[&str]| {
        api.apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": ns, "name": name},
            "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
                     "externalIPs": external},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let slice = |name: &str, svc: &str, port: &str, addresses: &[&str]| {
        let endpoints: Vec<Value> = addresses
            .iter()
            .map(|a| json!({"addresses": [a], "conditions": {"ready": true}}))
            .collect();
        api.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": ns, "name": name,
                         "labels": {"kubernetes.io/service-name": svc}},
            "addressType": "IPv4",
            "ports": [{"name": port, "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    // Another node whose address lies inside the allowed CIDR: still never a Service's.
    node_object(
        &api,
        &format!("{u}-n2"),
        json!({}),
        &[("InternalIP", "203.0.113.50")],
    );
    let web = service("web", &["203.0.113.7", "198.51.100.7", "203.0.113.50"]);
    let cluster_ip = web["spec"]["clusterIP"]
        .as_str()
        .expect("a cluster IP")
        .to_string();
    service("empty", &[]);
    slice("web-1", "web", "http", &["10.79.1.5", "10.79.1.6"]);
    let show = || {
        node.agent()
            .calixctl_json(&["services"])
            .map(|v| v.to_string())
            .unwrap_or_else(|e| e.to_string())
            + "\n"
            + &node.agent_log()
    };
    let row = |name: &str| {
        let r = node.agent().calixctl_json(&["services"]).ok()?;
        r["list"]
            .as_array()?
            .iter()
            .find(|s| s["service"] == format!("{ns}/{name}"))
            .cloned()
    };
    let web_row = wait_for(
        "web calculated with its two backends, two addresses refused",
        Duration::from_secs(20),
        || {
            row("web").filter(|w| {
                w["frontends"][0]["internal"]["To"]
                    .as_array()
                    .is_some_and(|b| b.len() == 2)
                    && w["refused"].as_array().is_some_and(|r| r.len() == 2)
            })
        },
        show,
    );
    let fronts: Vec<(String, String)> = web_row["frontends"]
        .as_array()
        .expect("frontends")
        .iter()
        .map(|f| {
            (
                f["frontend"]["kind"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                f["frontend"]["address"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(
        fronts,
        [
            ("ClusterIp".to_string(), cluster_ip),
            ("External".to_string(), "203.0.113.7".to_string())
        ],
        "{web_row}"
    );
    assert_eq!(
        web_row["frontends"][0]["internal"]["To"][0],
        json!(["10.79.1.5", 8080]),
        "{web_row}"
    );
    let refused = &web_row["refused"];
    let mut refused: Vec<&str> = refused
        .as_array()
        .expect("refused")
        .iter()
        .filter_map(|r| r["address"].as_str())
        .collect();
    refused.sort_unstable();
    assert_eq!(refused, ["198.51.100.7", "203.0.113.50"], "{web_row}");
    let empty = row("empty").expect("the Service with no endpoint");
    assert_eq!(empty["frontends"][0]["internal"], "Reject", "{empty}");
    // One endpoint fewer; and a second slice whose port is no port of the Service: skipped
    // and said, the first slice's backend kept.
    slice("web-1", "web", "http", &["10.79.1.5"]);
    slice("web-2", "web", "metrics", &["10.79.1.7"]);
    let web_row = wait_for(
        "the changed slice followed",
        Duration::from_secs(20),
        || {
            row("web").filter(|w| {
                w["frontends"][0]["internal"]["To"]
                    .as_array()
                    .is_some_and(|b| b.len() == 1)
                    && w["problems"].as_array().is_some_and(|p| !p.is_empty())
            })
        },
        show,
    );
    assert!(
        web_row["problems"][0]["slice"]
            .as_str()
            .is_some_and(|s| s.ends_with("/web-2")),
        "the unmatched port said: {web_row}"
    );
    let table = node.agent().calixctl(&["services"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.status.success() && text.contains("calculated only"),
        "{text}"
    );
    assert!(text.contains("198.51.100.7 refused"), "{text}");
    // Each refusal an Event on the Service (one for the cluster, whichever node posts it),
    // and counted on /metrics.
    for (reason, says) in [
        ("ServiceAddressRefused", "198.51.100.7"),
        ("EndpointSliceSkipped", "web-2"),
    ] {
        wait_for(
            &format!("a {reason} Event on web"),
            Duration::from_secs(20),
            || {
                events(&api, reason, "Service", "web")
                    .into_iter()
                    .find(|e| {
                        e["involvedObject"]["namespace"] == ns.as_str()
                            && e["message"].as_str().is_some_and(|m| m.contains(says))
                    })
            },
            show,
        );
    }
    let (_, metrics) = node.http_get("/metrics").expect("/metrics");
    let gauge = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
    };
    assert_eq!(gauge("calix_services_ready "), Some(1), "{metrics}");
    assert!(
        gauge("calix_services_refused{reason=\"address\"}").is_some_and(|n| n >= 1),
        "{metrics}"
    );
    api.delete_now("v1", "Service", &ns, "web")
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the deleted Service gone",
        Duration::from_secs(20),
        || row("web").is_none().then_some(()),
        show,
    );
    assert_admitted(&node);
}
