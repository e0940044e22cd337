//! A node's credentials write only what is that node's (issue 20, items 1b and 1c), against a
//! real kube-apiserver v1.36.2 (`KubeApi::shared`) with the chart's node authority installed
//! (charts/calix/files/authority/, through calix_testbed::authority):
//! - what a node's ServiceAccount token carries: bound to a pod on the node (as a DaemonSet
//!   pod's projected token) or to the Node, the node's name in
//!   `extra["authentication.kubernetes.io/node-name"]`; unbound, none;
//! - the rogue node: a node of the cluster (its namespace on the underlay, its Node object,
//!   its route-distribution certificate, its agent's pod-bound token; its agent stopped by the
//!   attacker) tries every attack on the other nodes while their real agents (kubernetes
//!   datastore, route distribution) serve pods that ping each other throughout: writes to
//!   another node's blocks, allocations, handles, affinities, CalixNode and endpoints (each
//!   refused naming its rule; its own writes admitted), a certificate for another node's name
//!   (denied by calix-signer), posing as another node at a Routes door with its own
//!   certificate or a forged one (refused), and 64 idle connections to each other node's
//!   Routes door (the other nodes' streams never drop). No ping is lost, nothing of the
//!   victim's changes;
//! - the rules about a node's own records (keys, names, labels, CIDRs, sequence numbers, the
//!   release of a block still holding an allocation, finalizers).
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use calix_testbed::k8s::BoundTo;
use calix_testbed::signer::Signer;
use calix_testbed::{unique, Cluster, KubeApi};
use common::certs::{ask, condition, request, setup, try_watch, AGENT_SA, NS};
use common::flood::Flood;
use serde_json::{json, Value};

mod common;

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
    api.service_account_with_role("kube-system", "calix-agent", &cluster_role(&api.dir))
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

/// `ping -i 0.2` from a pod's namespace to `dst` until [`Pinger::stop`].
struct Pinger {
    child: std::process::Child,
    what: String,
}

impl Pinger {
    fn start(ns: &str, dst: &str) -> Self {
        let child = std::process::Command::new("ip")
            .args([
                "netns", "exec", ns, "ping", "-n", "-i", "0.2", "-W", "1", dst,
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("ping");
        Self {
            child,
            what: format!("{ns} -> {dst}"),
        }
    }

    /// SIGINT, then (transmitted, received) from ping's summary.
    fn stop(self) -> (u64, u64) {
        // SAFETY: a signal to the child we spawned (ip netns exec execs ping in place).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let out = self.child.wait_with_output().expect("ping's output");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.contains("packets transmitted"))
            .unwrap_or_else(|| panic!("{}: no summary in {text}", self.what));
        let nums: Vec<u64> = line
            .split(',')
            .filter_map(|part| part.split_whitespace().next()?.parse().ok())
            .collect();
        (nums[0], nums[1])
    }
}

/// What one write as the rogue came to: `Ok` (admitted) or the API server's code and message.
type Outcome = Result<(), (u16, String)>;

fn outcome<T>(r: Result<T, kube::Error>) -> Outcome {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => Err((0, e.to_string())),
    }
}

fn calix_api(c: &kube::Client, kind: &str) -> kube::Api<kube::api::DynamicObject> {
    let gvk = kube::api::GroupVersionKind::gvk("calix.dev", "v1", kind);
    kube::Api::all_with(c.clone(), &kube::api::ApiResource::from_gvk(&gvk))
}

async fn create(c: &kube::Client, object: &Value) -> Outcome {
    let kind = object["kind"].as_str().unwrap_or_default();
    let obj: kube::api::DynamicObject = serde_json::from_value(object.clone()).expect("object");
    outcome(calix_api(c, kind).create(&Default::default(), &obj).await)
}

async fn replace(c: &kube::Client, object: &Value) -> Outcome {
    let kind = object["kind"].as_str().unwrap_or_default();
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let obj: kube::api::DynamicObject = serde_json::from_value(object.clone()).expect("object");
    outcome(
        calix_api(c, kind)
            .replace(name, &Default::default(), &obj)
            .await,
    )
}

async fn get(c: &kube::Client, kind: &str, name: &str) -> Value {
    let o = calix_api(c, kind)
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("get {kind} {name}: {e}"));
    serde_json::to_value(o).expect("json")
}

async fn delete(c: &kube::Client, kind: &str, name: &str) -> Outcome {
    outcome(calix_api(c, kind).delete(name, &Default::default()).await)
}

/// A calix record as the agent writes it: `kind` `name`, key annotation `key`, node label
/// `label` (none when empty), `spec`.
fn record(kind: &str, name: &str, key: &str, label: &str, spec: Value) -> Value {
    let mut o = json!({
        "apiVersion": "calix.dev/v1", "kind": kind,
        "metadata": {"name": name, "annotations": {"calix.dev/key": key}},
        "spec": spec,
    });
    if !label.is_empty() {
        o["metadata"]["labels"] = json!({ "calix.dev/node": label });
    }
    o
}

/// The one object of `kind` labelled `calix.dev/node=<node>` that `pick` chooses.
fn victim(api: &KubeApi, kind: &str, node: &str, pick: impl Fn(&Value) -> bool) -> Value {
    api.list("calix.dev/v1", kind, &format!("calix.dev/node={node}"))
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .find(|o| pick(o))
        .unwrap_or_else(|| panic!("no {kind} of {node}"))
}

/// Node `i`'s Routes door's counters (`calixctl nodes -o json`).
fn door_of(c: &Cluster, i: usize) -> Value {
    c.nodes[i]
        .agent()
        .calixctl_json(&["nodes"])
        .unwrap_or_else(|e| panic!("{e}"))["door"]
        .clone()
}

/// Node `i`'s stream from peer `peer`: (state, snapshots received).
fn a_b_stream(c: &Cluster, i: usize, peer: &str) -> (String, u64) {
    let report = c.nodes[i]
        .agent()
        .calixctl_json(&["nodes"])
        .unwrap_or_else(|e| panic!("{e}"));
    report["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == peer)
        .map(|p| {
            (
                p["state"].as_str().unwrap_or_default().to_string(),
                p["snapshots"].as_u64().unwrap_or(0),
            )
        })
        .unwrap_or_default()
}

#[test]
fn a_rogue_node_is_refused_everything_that_is_not_its_own_while_the_other_nodes_pods_keep_their_traffic(
) {
    let api = KubeApi::shared();
    let ca = calix_testbed::tls::Ca::new("calix-test-ca").expect("CA");
    let u = unique("r");
    let cluster =
        calix_testbed::Cluster::create(calix_testbed::Dataplane::Kernel, &[1, 1, 1], |i, c| {
            let token = api.agent_token(c.name(i)).unwrap_or_else(|e| panic!("{e}"));
            let kubeconfig = api
                .wire_as(&c.nodes[i].ns, &token)
                .unwrap_or_else(|e| panic!("{e}"));
            format!(
                "uplinks = [\"eth0\"]\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\n\
                 [kubernetes]\npod_gone_grace_secs = 3600\n{}",
                kubeconfig.display(),
                c.routes_config(i, &ca, "grace_secs = 5")
                    .unwrap_or_else(|e| panic!("{e}"))
            )
        });
    // Nodes a and b, and the rogue: node 2, whose agent never runs (its attacker stopped it).
    let (a, b) = (cluster.name(0).to_string(), cluster.name(1).to_string());
    for i in [0, 1, 2] {
        node_object(
            &api,
            cluster.name(i),
            json!({"calix.dev/test": u}),
            &[("InternalIP", &cluster.address(i))],
        );
    }
    api.apply(json!({
        "apiVersion": "calix.dev/v1", "kind": "IPPool", "metadata": {"name": u},
        "spec": {"cidr": "10.244.0.0/16", "blockSize": 26, "nodeSelector": {"calix.dev/test": u}},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    // A signer for the cluster's certificate requests (the agents here use certificate files;
    // the rogue's requests are what it judges), and the agents' right to make requests.
    let sign = setup(&u, 3600);
    let (certs, _) =
        calix_testbed::signer::agent_certificate_rules(&sign).unwrap_or_else(|e| panic!("{e}"));
    api.grant(
        &format!("{AGENT_SA}-{u}-requests"),
        None,
        NS,
        AGENT_SA,
        certs,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let signer = Signer::start(&api, sign.clone()).unwrap_or_else(|e| panic!("{e}"));
    cluster.nodes[0].start_agent();
    cluster.nodes[1].start_agent();
    let pa = api.node_pod(&cluster.nodes[0], "a");
    let pb = api.node_pod(&cluster.nodes[1], "b");
    calix_testbed::wait_for(
        "the pods reach each other across the nodes",
        std::time::Duration::from_secs(60),
        || (pa.ns.ping(&pb.ip(), 1) && pb.ns.ping(&pa.ip(), 1)).then_some(()),
        || cluster.nodes[0].agent_log(),
    );
    let pings = [
        Pinger::start(&pa.ns.name, &pb.ip()),
        Pinger::start(&pb.ns.name, &pa.ip()),
    ];

    // The victim's records: node a's block (pod a's), handle, affinity, node record, endpoint.
    let block = victim(&api, "IPAMBlock", &a, |o| {
        o["spec"]["allocations"]
            .as_object()
            .is_some_and(|m| !m.is_empty())
    });
    let block_name = block["metadata"]["name"]
        .as_str()
        .expect("name")
        .to_string();
    let handle = victim(&api, "IPAMHandle", &a, |_| true);
    let affinity = victim(&api, "BlockAffinity", &a, |_| true);
    let node_record = api
        .get("calix.dev/v1", "CalixNode", None, &a)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("node a's CalixNode");
    let endpoint = victim(&api, "CalixEndpoint", &a, |_| true);
    let free = (10..60)
        .map(|o: u32| o.to_string())
        .find(|o| block["spec"]["allocations"].get(o).is_none())
        .expect("a free offset in node a's block");
    let next_seq = block["spec"]["next_seq"].as_u64().expect("next_seq");

    // The rogue: a node of the cluster with its agent's real credentials (a token of the
    // agents' ServiceAccount bound to a pod on it), and the same ServiceAccount's token
    // bound to nothing.
    let rogue = cluster.name(2).to_string();
    let token = api.agent_token(&rogue).unwrap_or_else(|e| panic!("{e}"));
    let unbound = api
        .service_account_token(
            calix_testbed::authority::AGENT_NAMESPACE,
            calix_testbed::authority::AGENT_SERVICE_ACCOUNT,
            &cluster_role(&api.dir),
        )
        .unwrap_or_else(|e| panic!("{e}"));

    let (rogue2, a2) = (rogue.clone(), a.clone());
    let mut claim = block.clone();
    claim["spec"]["affinity"] = json!(rogue);
    claim["metadata"]["labels"]["calix.dev/node"] = json!(rogue);
    let mut release = block.clone();
    release["spec"]["affinity"] = json!("");
    release["metadata"]["labels"] = json!({});
    let mut foreign = block.clone();
    foreign["spec"]["allocations"][&free] = json!({
        "handle": "k8s-pod-network:forged", "ifname": "eth0", "node": a, "seq": next_seq,
    });
    foreign["spec"]["next_seq"] = json!(next_seq + 1);
    let (pod_offset, _) = block["spec"]["allocations"]
        .as_object()
        .and_then(|m| m.iter().next())
        .expect("an allocation");
    let pod_offset = pod_offset.clone();
    let mut modified = block.clone();
    modified["spec"]["allocations"][&pod_offset]["handle"] = json!("k8s-pod-network:stolen");
    let mut removed = block.clone();
    removed["spec"]["allocations"]
        .as_object_mut()
        .expect("allocations")
        .remove(&pod_offset);
    let mut lowered = block.clone();
    lowered["spec"]["next_seq"] = json!(1);
    let mut owned = block.clone();
    owned["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "v1", "kind": "Node", "name": rogue, "uid": "00000000-0000-0000-0000-000000000000",
    }]);
    let mut borrowed = block.clone();
    borrowed["spec"]["allocations"][&free] = json!({
        "handle": "k8s-pod-network:rogue", "ifname": "eth0", "node": rogue, "seq": next_seq,
    });
    borrowed["spec"]["next_seq"] = json!(next_seq + 1);
    let mut handle_taken = handle.clone();
    handle_taken["spec"]["node"] = json!(rogue);
    handle_taken["metadata"]["labels"]["calix.dev/node"] = json!(rogue);
    let mut node_taken = node_record.clone();
    node_taken["spec"]["addresses"] = json!(["172.31.1.66"]);
    let flat = |c: &str| c.replace(['/', ':'], "-");
    let own_block = "10.244.200.0/26";
    let (handle2, affinity2, endpoint2) = (handle.clone(), affinity.clone(), endpoint.clone());
    let block_name2 = block_name.clone();
    let results = api.with_token(&token, move |c| async move {
        let mut r: Vec<(&'static str, &'static [&'static str], Outcome)> = Vec::new();
        let block_of = |cidr: &str, affinity: &str| {
            record(
                "IPAMBlock",
                &flat(cidr),
                &format!("ipam/blocks/{}", flat(cidr)),
                affinity,
                json!({"cidr": cidr, "affinity": affinity, "allocations": {}, "next_seq": 1}),
            )
        };
        // Blocks.
        r.push((
            "a /32 block inside the pool, affine to itself",
            &["block-pool"],
            create(&c, &block_of("10.244.7.9/32", &rogue2)).await,
        ));
        r.push((
            "the block 0.0.0.0/0, affine to itself",
            &["block-cidr", "block-pool"],
            create(&c, &block_of("0.0.0.0/0", &rogue2)).await,
        ));
        r.push((
            "node a's block claimed",
            &["block-claim"],
            replace(&c, &claim).await,
        ));
        r.push((
            "node a's block released",
            &["block-release"],
            replace(&c, &release).await,
        ));
        r.push((
            "an allocation in node a's block under node a's name",
            &["block-allocation"],
            replace(&c, &foreign).await,
        ));
        r.push((
            "node a's allocation changed",
            &["block-allocation"],
            replace(&c, &modified).await,
        ));
        r.push((
            "node a's allocation removed",
            &["block-allocation"],
            replace(&c, &removed).await,
        ));
        r.push((
            "node a's block's sequence numbers set back",
            &["block-seq"],
            replace(&c, &lowered).await,
        ));
        r.push((
            "an owner reference on node a's block",
            &["record-metadata"],
            replace(&c, &owned).await,
        ));
        r.push((
            "node a's block deleted",
            &["block-delete"],
            delete(&c, "IPAMBlock", &block_name2).await,
        ));
        // Handles and affinities.
        r.push((
            "a handle record of node a",
            &["handle-owner"],
            create(
                &c,
                &record(
                    "IPAMHandle",
                    &format!("{rogue2}-h"),
                    "ipam/handles/k8s-pod-network:forged/eth0",
                    &a2,
                    json!({"node": a2, "addresses": []}),
                ),
            )
            .await,
        ));
        r.push((
            "node a's handle record taken over",
            &["handle-owner"],
            replace(&c, &handle_taken).await,
        ));
        r.push((
            "node a's handle record deleted",
            &["handle-owner"],
            delete(
                &c,
                "IPAMHandle",
                handle2["metadata"]["name"].as_str().unwrap_or_default(),
            )
            .await,
        ));
        r.push((
            "an affinity record of node a",
            &["affinity-owner"],
            create(
                &c,
                &record(
                    "BlockAffinity",
                    &format!("{rogue2}-a"),
                    &format!("ipam/affinities/{a2}/{}", flat("10.244.201.0/26")),
                    &a2,
                    json!({"node": a2, "cidr": "10.244.201.0/26"}),
                ),
            )
            .await,
        ));
        r.push((
            "node a's affinity record deleted",
            &["affinity-owner"],
            delete(
                &c,
                "BlockAffinity",
                affinity2["metadata"]["name"].as_str().unwrap_or_default(),
            )
            .await,
        ));
        // Node records and endpoints.
        r.push((
            "node a's CalixNode overwritten",
            &["node-owner"],
            replace(&c, &node_taken).await,
        ));
        r.push((
            "a CalixEndpoint under node a",
            &["endpoint-owner"],
            create(
                &c,
                &record(
                    "CalixEndpoint",
                    &format!("{rogue2}-e1"),
                    &format!("endpoints/{a2}/forged/eth0"),
                    &a2,
                    json!({"container_id": "forged", "ifname": "eth0", "host_ifname": "eth0",
                        "netns": "", "pod_namespace": "", "pod_name": "", "addresses": [],
                        "handle": "k8s-pod-network:forged"}),
                ),
            )
            .await,
        ));
        r.push((
            "its own CalixEndpoint labelled as node a's",
            &["endpoint-label"],
            create(
                &c,
                &record(
                    "CalixEndpoint",
                    &format!("{rogue2}-e2"),
                    &format!("endpoints/{rogue2}/c2/eth0"),
                    &a2,
                    json!({"container_id": "c2", "ifname": "eth0", "host_ifname": "cali2",
                        "netns": "", "pod_namespace": "", "pod_name": "", "addresses": [],
                        "handle": "k8s-pod-network:c2"}),
                ),
            )
            .await,
        ));
        r.push((
            "node a's CalixEndpoint deleted",
            &["endpoint-owner"],
            delete(
                &c,
                "CalixEndpoint",
                endpoint2["metadata"]["name"].as_str().unwrap_or_default(),
            )
            .await,
        ));
        // What is its own: admitted (the rules are about whose, not about the kind).
        let own_node = record(
            "CalixNode",
            &rogue2,
            &format!("nodes/{rogue2}"),
            "",
            json!({"name": rogue2}),
        );
        r.push(("its own CalixNode", &[], create(&c, &own_node).await));
        r.push((
            "its own block claimed",
            &[],
            create(&c, &block_of(own_block, &rogue2)).await,
        ));
        let mut released = get(&c, "IPAMBlock", &flat(own_block)).await;
        released["spec"]["affinity"] = json!("");
        released["metadata"]["labels"] = json!({});
        r.push((
            "its own empty block released",
            &[],
            replace(&c, &released).await,
        ));
        r.push((
            "its own released block deleted",
            &[],
            delete(&c, "IPAMBlock", &flat(own_block)).await,
        ));
        let own_affinity = record(
            "BlockAffinity",
            &format!("{rogue2}-a2"),
            &format!("ipam/affinities/{rogue2}/{}", flat(own_block)),
            &rogue2,
            json!({"node": rogue2, "cidr": own_block}),
        );
        r.push((
            "its own affinity record",
            &[],
            create(&c, &own_affinity).await,
        ));
        r.push((
            "its own affinity record deleted",
            &[],
            delete(&c, "BlockAffinity", &format!("{rogue2}-a2")).await,
        ));
        let own_handle = record(
            "IPAMHandle",
            &format!("{rogue2}-h2"),
            "ipam/handles/k8s-pod-network:rogue/eth0",
            &rogue2,
            json!({"node": rogue2, "addresses": []}),
        );
        r.push(("its own handle record", &[], create(&c, &own_handle).await));
        r.push((
            "its own handle record deleted",
            &[],
            delete(&c, "IPAMHandle", &format!("{rogue2}-h2")).await,
        ));
        r.push((
            "an address borrowed from node a's block",
            &[],
            replace(&c, &borrowed).await,
        ));
        let own_endpoint = record(
            "CalixEndpoint",
            &format!("{rogue2}-e3"),
            &format!("endpoints/{rogue2}/c3/eth0"),
            &rogue2,
            json!({"container_id": "c3", "ifname": "eth0", "host_ifname": "cali3",
                "netns": "", "pod_namespace": "", "pod_name": "", "addresses": [],
                "handle": "k8s-pod-network:c3"}),
        );
        r.push((
            "its own CalixEndpoint",
            &[],
            create(&c, &own_endpoint).await,
        ));
        r.push((
            "its own CalixEndpoint deleted",
            &[],
            delete(&c, "CalixEndpoint", &format!("{rogue2}-e3")).await,
        ));
        r.push((
            "its own CalixNode deleted",
            &[],
            delete(&c, "CalixNode", &rogue2).await,
        ));
        r
    });
    // The same ServiceAccount with a token bound to no node: nothing at all.
    let r2 = rogue.clone();
    let unbound_results = api.with_token(&unbound, move |c| async move {
        vec![(
            "its own CalixNode, with a token bound to no node",
            &["node-identity"][..],
            create(
                &c,
                &record(
                    "CalixNode",
                    &format!("{r2}-x"),
                    &format!("nodes/{r2}-x"),
                    "",
                    json!({"name": format!("{r2}-x")}),
                ),
            )
            .await,
        )]
    });

    // From the rogue's place in the network. A certificate for another node's name, asked for
    // with the rogue's own token: denied.
    for victim in [&a, &b] {
        let r = ask(&api, &token, &sign, &request(victim, &[victim]).0);
        let d = condition(&r, "Denied").unwrap_or_else(|| {
            panic!("a request for {victim} as {rogue}: {r:#}\n{}", signer.log())
        });
        assert_eq!(d["reason"], "OtherNode", "{d}");
        assert!(r["status"]["certificate"].is_null(), "{r:#}");
    }
    // Its own certificate (its node's files), claiming to be node b at node a's door; and one
    // for node b from a CA of its own making with the cluster CA's name: refused.
    let rogue_tls = cluster.nodes[2].dir.join("tls");
    let read =
        |f: String| std::fs::read_to_string(rogue_tls.join(f)).expect("the rogue's TLS files");
    let (own_cert, own_key) = (read(format!("{rogue}.crt")), read(format!("{rogue}.key")));
    let forged = calix_testbed::tls::Ca::new("calix-test-ca")
        .and_then(|f| f.issue(&b))
        .expect("a forged certificate");
    for (what, cert, key) in [
        ("its own certificate", &own_cert, &own_key),
        ("a forged certificate", &forged.cert_pem, &forged.key_pem),
    ] {
        let got = try_watch(&cluster, 2, 0, &b, &ca.pem(), cert, key);
        assert!(
            got.is_err(),
            "{what}, posing as node b at node a's door: {got:?}"
        );
        eprintln!("{what}, posing as node b at node a's door: {got:?}");
    }
    assert!(
        door_of(&cluster, 0)["refused_identity"].as_u64() >= Some(1),
        "{}",
        door_of(&cluster, 0)
    );
    // 64 idle connections from the rogue to each other node's Routes door, for 12 s (more than
    // two handshake timeouts): a's and b's streams from each other never drop or start over.
    let door = |i: usize| SocketAddr::new(cluster.address(i).parse().expect("address"), 5474);
    let floods = [0, 1].map(|i| Flood::start(&cluster.nodes[2].ns, vec![None; 64], door(i)));
    let before = [a_b_stream(&cluster, 0, &b), a_b_stream(&cluster, 1, &a)];
    assert!(before.iter().all(|(state, _)| state == "up"), "{before:?}");
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(12) {
        let now = [a_b_stream(&cluster, 0, &b), a_b_stream(&cluster, 1, &a)];
        assert_eq!(
            now,
            before,
            "a's and b's streams from each other in the rogue's flood: [connected, closed at \
             once, held, timed out, failed] {:?} {:?}",
            floods[0].get(),
            floods[1].get()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    for (i, f) in floods.iter().enumerate() {
        let [connected, ..] = f.get();
        eprintln!(
            "the rogue's flood of node {i}'s door: {:?}; the door: {}",
            f.get(),
            door_of(&cluster, i)
        );
        assert!(
            connected >= 8,
            "the flood of node {i}'s door reached it: {:?}",
            f.get()
        );
    }
    drop(floods);
    drop(signer);

    // The pods keep pinging a while after the last attempt: long enough for anything that had
    // got through to reach the agents' watches and routes.
    std::thread::sleep(std::time::Duration::from_secs(5));
    let lost: Vec<(u64, u64)> = pings.into_iter().map(Pinger::stop).collect();
    let mut wrong = Vec::new();
    for (what, rules, got) in results.iter().chain(unbound_results.iter()) {
        let ok = match (rules.is_empty(), got) {
            (true, Ok(())) => true,
            (false, Err((403, msg))) => rules.iter().any(|r| msg.contains(&format!("(rule {r})"))),
            _ => false,
        };
        eprintln!("{what}: {got:?}");
        if !ok {
            wrong.push(format!("{what}: expected {rules:?}, got {got:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Nothing of node a's changed: its block only by the borrowing, which is undone now.
    let now = api
        .get("calix.dev/v1", "IPAMBlock", None, &block_name)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("node a's block");
    assert_eq!(now["spec"]["affinity"], a.as_str(), "{now}");
    for (offset, alloc) in block["spec"]["allocations"]
        .as_object()
        .expect("allocations")
    {
        assert_eq!(now["spec"]["allocations"][offset], *alloc, "{now}");
    }
    let mut undo = now.clone();
    undo["spec"]["allocations"]
        .as_object_mut()
        .expect("allocations")
        .remove(&free);
    api.with_token(&token, move |c| async move {
        assert_eq!(
            replace(&c, &undo).await,
            Ok(()),
            "the borrowed address back"
        );
    });
    for (kind, o) in [
        ("IPAMHandle", &handle),
        ("BlockAffinity", &affinity),
        ("CalixEndpoint", &endpoint),
    ] {
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        let now = api
            .get("calix.dev/v1", kind, None, name)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("node a's {kind} is gone"));
        assert_eq!(now["spec"], o["spec"], "{kind}");
        assert_eq!(
            now["metadata"]["resourceVersion"], o["metadata"]["resourceVersion"],
            "{kind}"
        );
    }
    let now = api
        .get("calix.dev/v1", "CalixNode", None, &a)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("node a's CalixNode");
    assert_eq!(now["spec"], node_record["spec"]);
    // The pods' traffic, both ways, throughout: at most one ping lost each way (a margin for a
    // loaded machine; the attacks were refused before they changed anything).
    for (i, (sent, got)) in lost.iter().enumerate() {
        eprintln!("pings {i}: {got}/{sent}");
        assert!(*sent >= 25, "pings {i}: only {sent} sent");
        assert!(sent - got <= 1, "pings {i}: {got} of {sent} answered");
    }
    // (Other tests share the API server: only nodes a's and b's findings are this test's.)
    let out = cluster.nodes[0].calixctl(&["ipam", "check", "-o", "json"]);
    let check: Value = serde_json::from_slice(&out.stdout).expect("ipam check's JSON");
    assert!(
        check["findings"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|f| f["node"] != a.as_str() && f["node"] != b.as_str()),
        "{check}"
    );
    // The agents' own writes (claims, handles, affinities, node records, endpoints): all
    // admitted.
    for n in &cluster.nodes[..2] {
        let log = n.agent_log();
        let refused = calix_testbed::authority::refusals(&log);
        assert!(refused.is_empty(), "{}", refused.join("\n"));
    }
    drop((pa, pb));
    for n in [&a, &b, &rogue] {
        let _ = api.delete_in("v1", "Pod", "kube-system", &format!("calix-agent-{n}"));
        let _ = api.delete("v1", "Node", n);
    }
    let _ = api.delete("calix.dev/v1", "IPPool", &u);
}

#[test]
fn the_rules_about_a_nodes_own_records_hold_too() {
    // What a node may not do even to its own records: each refused by its own rule, the honest
    // write next to it admitted (so no rule refuses the agent's own writes by mistake).
    let api = KubeApi::shared();
    let u = unique("o");
    // A pool no node selects: blocks of it are this test's alone.
    api.apply(json!({
        "apiVersion": "calix.dev/v1", "kind": "IPPool", "metadata": {"name": u},
        "spec": {"cidr": "10.246.0.0/16", "blockSize": 26, "nodeSelector": {"calix.dev/test": u}},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let me = unique("me");
    let token = api.agent_token(&me).unwrap_or_else(|e| panic!("{e}"));
    let m = me.clone();
    let results = api.with_token(&token, move |c| async move {
        let mut r: Vec<(&'static str, Option<&'static str>, Outcome)> = Vec::new();
        let cidr = "10.246.1.0/26";
        let block = |affinity: &str, label: &str, allocations: Value, next_seq: u64| {
            record(
                "IPAMBlock",
                "10.246.1.0-26",
                "ipam/blocks/10.246.1.0-26",
                label,
                json!({"cidr": cidr, "affinity": affinity, "allocations": allocations,
                    "next_seq": next_seq}),
            )
        };
        let mine =
            json!({"5": {"handle": "k8s-pod-network:c1", "ifname": "eth0", "node": m, "seq": 1}});
        // Blocks.
        let mut misnamed = block(&m, &m, json!({}), 1);
        misnamed["metadata"]["name"] = json!("10.246.2.0-26");
        r.push((
            "a block named as another CIDR",
            Some("block-key"),
            create(&c, &misnamed).await,
        ));
        let mut noncanonical = block(&m, &m, json!({}), 1);
        noncanonical["spec"]["cidr"] = json!("10.246.1.7/26");
        noncanonical["metadata"]["name"] = json!("10.246.1.7-26");
        noncanonical["metadata"]["annotations"]["calix.dev/key"] =
            json!("ipam/blocks/10.246.1.7-26");
        r.push((
            "a block on a host address",
            Some("block-cidr"),
            create(&c, &noncanonical).await,
        ));
        r.push((
            "a block whose allocation's sequence number is not below next_seq",
            Some("block-seq"),
            create(&c, &block(&m, &m, mine.clone(), 1)).await,
        ));
        r.push((
            "a block labelled as another node's",
            Some("block-label"),
            create(&c, &block(&m, "someone-else", json!({}), 1)).await,
        ));
        r.push((
            "its own block, with its allocation",
            None,
            create(&c, &block(&m, &m, mine.clone(), 2)).await,
        ));
        let stored = get(&c, "IPAMBlock", "10.246.1.0-26").await;
        let mut released = stored.clone();
        released["spec"]["affinity"] = json!("");
        released["metadata"]["labels"] = json!({});
        r.push((
            "its own block released with an allocation in it",
            Some("block-release"),
            replace(&c, &released).await,
        ));
        let mut moved = stored.clone();
        moved["spec"]["cidr"] = json!("10.246.3.0/26");
        // (The key is the CIDR's and never changes: block-key refuses before block-cidr.)
        r.push((
            "its block's CIDR changed",
            Some("block-key"),
            replace(&c, &moved).await,
        ));
        let mut rekeyed = stored.clone();
        rekeyed["metadata"]["annotations"]["calix.dev/key"] = json!("ipam/blocks/other");
        r.push((
            "its block's key changed",
            Some("key-immutable"),
            replace(&c, &rekeyed).await,
        ));
        let mut finalized = stored.clone();
        finalized["metadata"]["finalizers"] = json!(["example.com/keep"]);
        r.push((
            "a finalizer on its block",
            Some("record-metadata"),
            replace(&c, &finalized).await,
        ));
        let mut emptied = stored.clone();
        emptied["spec"]["allocations"] = json!({});
        r.push(("its allocation released", None, replace(&c, &emptied).await));
        let mut released = get(&c, "IPAMBlock", "10.246.1.0-26").await;
        released["spec"]["affinity"] = json!("");
        released["metadata"]["labels"] = json!({});
        r.push((
            "its empty block released",
            None,
            replace(&c, &released).await,
        ));
        r.push((
            "the released block deleted",
            None,
            delete(&c, "IPAMBlock", "10.246.1.0-26").await,
        ));
        // Handles, affinities, node records, endpoints.
        r.push((
            "a handle record outside ipam/handles/",
            Some("handle-key"),
            create(
                &c,
                &record(
                    "IPAMHandle",
                    &format!("{m}-h"),
                    "nodes/x",
                    &m,
                    json!({"node": m, "addresses": []}),
                ),
            )
            .await,
        ));
        r.push((
            "an affinity record whose key names another block than its spec",
            Some("affinity-owner"),
            create(
                &c,
                &record(
                    "BlockAffinity",
                    &format!("{m}-a"),
                    &format!("ipam/affinities/{m}/10.246.9.0-26"),
                    &m,
                    json!({"node": m, "cidr": "10.246.1.0/26"}),
                ),
            )
            .await,
        ));
        r.push((
            "an affinity record labelled as another node's",
            Some("affinity-label"),
            create(
                &c,
                &record(
                    "BlockAffinity",
                    &format!("{m}-a"),
                    &format!("ipam/affinities/{m}/10.246.1.0-26"),
                    "someone-else",
                    json!({"node": m, "cidr": "10.246.1.0/26"}),
                ),
            )
            .await,
        ));
        r.push((
            "its CalixNode saying it is another node",
            Some("node-owner"),
            create(
                &c,
                &record(
                    "CalixNode",
                    &m,
                    &format!("nodes/{m}"),
                    "",
                    json!({"name": "someone-else"}),
                ),
            )
            .await,
        ));
        r.push((
            "an endpoint whose key disagrees with its spec",
            Some("endpoint-owner"),
            create(
                &c,
                &record(
                    "CalixEndpoint",
                    &format!("{m}-e"),
                    &format!("endpoints/{m}/c1/eth0"),
                    &m,
                    json!({"container_id": "c2", "ifname": "eth0", "host_ifname": "cali1",
                        "netns": "", "pod_namespace": "", "pod_name": "", "addresses": [],
                        "handle": "k8s-pod-network:c1"}),
                ),
            )
            .await,
        ));
        r
    });
    let mut wrong = Vec::new();
    for (what, rule, got) in &results {
        eprintln!("{what}: {got:?}");
        let ok = match (rule, got) {
            (None, Ok(())) => true,
            (Some(rule), Err((403, msg))) => msg.contains(&format!("(rule {rule})")),
            _ => false,
        };
        if !ok {
            wrong.push(format!("{what}: expected {rule:?}, got {got:?}"));
        }
    }
    let _ = api.delete("calix.dev/v1", "IPAMBlock", "10.246.1.0-26");
    let _ = api.delete_in("v1", "Pod", "kube-system", &format!("calix-agent-{me}"));
    let _ = api.delete("calix.dev/v1", "IPPool", &u);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
