//! Route-distribution certificates through the Kubernetes API (issue 20, item 2), against a
//! real kube-apiserver v1.36.2 (one for the whole binary, `KubeApi::shared`), the real
//! calix-signer and real agents in node namespaces, each bound to exactly the chart's RBAC
//! (charts/calix/files/rbac/): no certificate file anywhere. Each agent authenticates as the
//! agents' ServiceAccount with a token bound to a Pod on its node, as the kubelet gives it.
//!
//! - agents get their certificates from the API and pods on different nodes reach each other;
//!   a node that joins gets routes within seconds, with no operator step (timed);
//! - with a 30 s lifetime, certificates are renewed (new serials, served at the door) under a
//!   TCP flow and a ping across nodes: no echo or ping lost, no stream reconnected;
//! - the signer denies, with a reason, a request for another node's name, one with two names,
//!   one from a token bound to no node, one from another ServiceAccount; it does not sign one
//!   somebody else approved for another node (Failed); a certificate a node got for itself is
//!   refused at another node's door when it claims a third node, and so is one naming two.
//!
//! Each test has a signer of its own (its own signerName, CA Secret and bundle ConfigMap); the
//! two with agents run one after the other (agents follow every Node of the shared API server).
use std::time::{Duration, Instant};

use calix_testbed::pod_net::Flow;
use calix_testbed::signer::{self, Signer, SignerSetup};
use calix_testbed::{unique, wait_for, Cluster, Dataplane, KubeApi};
use common::certs::{
    agent_rules, ask, base64, condition, decided, decode_base64, request, setup, try_watch,
    AGENT_SA, NS,
};
use serde_json::{json, Value};

mod common;

/// One cluster of agents at a time: agents follow every Node of the API server they share,
/// and two test beds' nodes have the same underlay addresses.
fn one_cluster_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static CLUSTERS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    CLUSTERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Node `name` as the kubelet registers it: `labels`, and `addresses` (type, address).
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

/// The stand-in agent pod of node `node` (what its agent's token is bound to).
fn agent_pod(node: &str) -> String {
    format!("calix-{node}")
}

/// Node `i` joins as a kubelet node does: its Node object (labelled for the test's pool, its
/// InternalIPs), its agent's pod-bound token, and its agent's config (kubernetes datastore,
/// routes with a certificate through the API; `grace` seconds of graceful restart). No
/// certificate, no key, no operator step.
fn join(api: &KubeApi, c: &mut Cluster, i: usize, u: &str, s: &SignerSetup, grace: u64) {
    let name = c.name(i).to_string();
    node_object(
        api,
        &name,
        json!({"calix.dev/test": u}),
        &[
            ("InternalIP", &c.address(i)),
            ("InternalIP", &c.address6(i)),
        ],
    );
    let token = api
        .pod_bound_token(NS, AGENT_SA, &agent_pod(&name), &name)
        .unwrap_or_else(|e| panic!("{e}"));
    let kubeconfig = api
        .wire_as(&c.nodes[i].ns, &token)
        .unwrap_or_else(|e| panic!("{e}"));
    let config = format!(
        "uplinks = [\"eth0\"]\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\n\
         timeout_ms = 5000\nattempts = 40\n[kubernetes]\npod_gone_grace_secs = 3600\n\
         [routes]\nenabled = true\ngrace_secs = {grace}\n[routes.tls]\nsource = \"kubernetes\"\n\
         signer_name = \"{}\"\nca_config_map = \"{NS}/{}\"\n",
        kubeconfig.display(),
        s.signer_name,
        s.ca_config_map
    );
    c.nodes[i].agent_mut().spec.config = Some(config);
}

fn ippool(name: &str, cidr: &str, u: &str) -> Value {
    json!({
        "apiVersion": "calix.dev/v1", "kind": "IPPool", "metadata": {"name": name},
        "spec": {"cidr": cidr, "blockSize": 28, "nodeSelector": {"calix.dev/test": u}},
    })
}

/// `calixctl nodes -o json` of node `i`.
fn nodes(c: &Cluster, i: usize) -> Value {
    c.nodes[i]
        .agent()
        .calixctl_json(&["nodes"])
        .unwrap_or_else(|e| panic!("calixctl nodes: {e}"))
}

/// The peers node `i` follows with a stream up.
fn up(c: &Cluster, i: usize) -> Vec<String> {
    let mut v: Vec<String> = nodes(c, i)["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["state"] == "up")
        .filter_map(|p| p["name"].as_str().map(String::from))
        .collect();
    v.sort();
    v
}

fn sorted(names: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    v.sort();
    v
}

/// The serial of the certificate node `to` serves at its Routes door, seen from node `from`
/// with openssl (which presents none: the handshake then fails, after the server's
/// certificate). Normalised like calixctl's: lowercase hex, `:` between bytes.
fn served_serial(c: &Cluster, from: usize, to: usize) -> Option<String> {
    let script = format!(
        "openssl s_client -connect {}:5474 -servername {} </dev/null 2>/dev/null | openssl x509 -noout -serial",
        c.address(to),
        c.name(to)
    );
    let out = c.nodes[from].ns.exec(&["sh", "-c", &script]);
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = text.trim().strip_prefix("serial=")?.to_lowercase();
    let hex = if !hex.len().is_multiple_of(2) {
        format!("0{hex}")
    } else {
        hex
    };
    Some(
        hex.as_bytes()
            .chunks(2)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect::<Vec<_>>()
            .join(":"),
    )
}

/// The trust bundle the signer published.
fn bundle(api: &KubeApi, s: &SignerSetup) -> String {
    wait_for(
        "the signer publishes the trust bundle",
        Duration::from_secs(30),
        || {
            api.get("v1", "ConfigMap", Some(NS), &s.ca_config_map)
                .ok()
                .flatten()
                .and_then(|cm| cm["data"]["ca.crt"].as_str().map(String::from))
        },
        String::new,
    )
}

/// Removes what a test put in the shared API server (its stand-in agent pods, Nodes, pool).
fn clean_up(api: &KubeApi, nodes: &[String], pool: Option<&str>) {
    for n in nodes {
        let _ = api.delete_now("v1", "Pod", NS, &agent_pod(n));
        let _ = api.delete("v1", "Node", n);
    }
    if let Some(pool) = pool {
        let _ = api.delete("calix.dev/v1", "IPPool", pool);
    }
}

#[test]
fn agents_get_certificates_from_the_api_and_a_node_that_joins_gets_routes_within_seconds() {
    let _one = one_cluster_at_a_time();
    let api = KubeApi::shared();
    let u = unique("c");
    let s = setup(&u, 3600);
    agent_rules(&api, &s);
    let sig = Signer::start(&api, s.clone()).unwrap_or_else(|e| panic!("{e}"));
    let mut c = Cluster::create(Dataplane::Kernel, &[1, 1, 2], |_, _| String::new());
    api.apply(ippool(&u, "10.75.0.0/16", &u))
        .unwrap_or_else(|e| panic!("{e}"));
    for i in 0..2 {
        join(&api, &mut c, i, &u, &s, 30);
    }
    for i in 0..2 {
        let config = c.nodes[i].agent().spec.config.clone().unwrap_or_default();
        assert!(
            !config.contains("cert =") && !config.contains("key ="),
            "no certificate file: {config}"
        );
        c.nodes[i]
            .agent()
            .start(&[])
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let (n0, n1, n2) = (
        c.name(0).to_string(),
        c.name(1).to_string(),
        c.name(2).to_string(),
    );
    wait_for(
        "nodes 0 and 1 have certificates and follow each other",
        Duration::from_secs(60),
        || (up(&c, 0) == [n1.clone()] && up(&c, 1) == [n0.clone()]).then_some(()),
        || {
            format!(
                "{}\n{}\n--- signer ---\n{}",
                nodes(&c, 0),
                c.nodes[0].agent_log(),
                sig.log()
            )
        },
    );
    // Each agent's certificate: from the Kubernetes API, its serial served at its door.
    for (i, other) in [(0, 1), (1, 0)] {
        let cert = &nodes(&c, i)["certificate"];
        assert_eq!(cert["source"], "kubernetes", "{cert}");
        assert!(cert["expires_in_secs"].as_i64() > Some(3000), "{cert}");
        assert_eq!(cert["issued"], 1, "{cert}");
        assert_eq!(
            served_serial(&c, other, i).as_deref(),
            cert["serial"].as_str(),
            "node {i} serves the certificate it reports"
        );
    }
    // The requests, as the API recorded them: the agents' ServiceAccount, bound to each node
    // by the API server; approved and signed by calix-signer.
    let csrs: Vec<Value> = api
        .list("certificates.k8s.io/v1", "CertificateSigningRequest", "")
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .filter(|r| r["spec"]["signerName"] == s.signer_name.as_str())
        .collect();
    for n in [&n0, &n1] {
        let mine: Vec<&Value> = csrs
            .iter()
            .filter(|r| r["spec"]["extra"]["authentication.kubernetes.io/node-name"] == json!([n]))
            .collect();
        assert_eq!(mine.len(), 1, "one request for {n}: {csrs:#?}");
        let r = mine[0];
        assert_eq!(
            r["spec"]["username"],
            format!("system:serviceaccount:{NS}:{AGENT_SA}")
        );
        assert_eq!(
            condition(r, "Approved").map(|c| c["reason"].clone()),
            Some(json!("CalixNodeIdentity"))
        );
        let pem = decode_base64(r["status"]["certificate"].as_str().unwrap_or_default());
        use rustls::pki_types::pem::PemObject;
        let der = rustls::pki_types::CertificateDer::from_pem_slice(&pem).expect("a certificate");
        let facts = calix_pki::cert::facts(der.as_ref()).expect("facts");
        assert_eq!(facts.names, [calix_pki::Name::Dns(n.to_string())]);
    }
    // Pods on the two nodes reach each other.
    {
        let p0 = api.node_pod(&c.nodes[0], "p");
        let p1 = api.node_pod(&c.nodes[1], "p");
        for (a, b) in [(&p0, &p1), (&p1, &p0)] {
            wait_for(
                &format!("{} reaches {}", a.ip(), b.ip()),
                Duration::from_secs(20),
                || a.ns.ping(&b.ip(), 1).then_some(()),
                || String::from_utf8_lossy(&c.nodes[0].calixctl(&["routes"]).stdout).into(),
            );
        }
    }

    // Node 2 joins, across a router: its Node registered, its agent's pod token, its agent.
    let t0 = Instant::now();
    join(&api, &mut c, 2, &u, &s, 30);
    c.nodes[2]
        .agent()
        .start(&[])
        .unwrap_or_else(|e| panic!("{e}"));
    let agent_up = t0.elapsed();
    wait_for(
        "node 2 has a certificate",
        Duration::from_secs(30),
        || nodes(&c, 2)["certificate"]["serial"].as_str().map(drop),
        || format!("{}\n{}", c.nodes[2].agent_log(), sig.log()),
    );
    let certified = t0.elapsed();
    wait_for(
        "node 2 follows nodes 0 and 1, and they follow it",
        Duration::from_secs(30),
        || {
            (up(&c, 2) == sorted(&[&n0, &n1]) && up(&c, 0).contains(&n2) && up(&c, 1).contains(&n2))
                .then_some(())
        },
        || format!("{}\n{}", nodes(&c, 2), c.nodes[2].agent_log()),
    );
    let followed = t0.elapsed();
    let p0 = api.node_pod(&c.nodes[0], "q");
    let p2 = api.node_pod(&c.nodes[2], "q");
    let t1 = Instant::now();
    for (a, b) in [(&p0, &p2), (&p2, &p0)] {
        wait_for(
            &format!("{} reaches {}", a.ip(), b.ip()),
            Duration::from_secs(20),
            || a.ns.ping(&b.ip(), 1).then_some(()),
            || String::from_utf8_lossy(&c.nodes[2].calixctl(&["routes"]).stdout).into(),
        );
    }
    let pinged = t1.elapsed();
    eprintln!(
        "node 2 joined: agent up {agent_up:.2?}, certificate {certified:.2?}, streams both ways \
         {followed:.2?} after its Node appeared; its pod reached node 0's both ways {pinged:.2?} \
         after their ADDs"
    );
    assert!(
        followed < Duration::from_secs(15),
        "a joining node had routes after {followed:?}"
    );

    // A compromised node's credentials: Node "rogue" and a token bound to a pod on it. Its
    // own certificate comes through the API like any node's, and names it alone...
    let rogue = unique("rogue");
    // (No address: known to every agent, followed by none.)
    node_object(&api, &rogue, json!({}), &[]);
    let token = api
        .pod_bound_token(NS, AGENT_SA, &agent_pod(&rogue), &rogue)
        .unwrap_or_else(|e| panic!("{e}"));
    let (req, key) = request(&rogue, &[&rogue]);
    let issued = ask(&api, &token, &s, &req);
    let cert = String::from_utf8(decode_base64(
        issued["status"]["certificate"].as_str().unwrap_or_default(),
    ))
    .expect("PEM");
    assert!(cert.contains("BEGIN CERTIFICATE"), "{issued:#}");
    let ca_pem = bundle(&api, &s);
    // ...and at node 0's door it cannot watch as node 1.
    let err = try_watch(&c, 2, 0, &n1, &ca_pem, &cert, &key).expect_err("rogue as node 1");
    assert!(
        err.contains(&format!("with the certificate of node {rogue:?}")),
        "{err}"
    );
    try_watch(&c, 2, 0, &rogue, &ca_pem, &cert, &key).expect("as itself, it may watch");
    // A certificate naming nodes 1 and 2 (made with the CA's key, which only the signer
    // reads: here the test's admin) identifies neither.
    let secret = api
        .get("v1", "Secret", Some(NS), &s.ca_secret)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the CA's Secret");
    let ca_key = String::from_utf8(decode_base64(
        secret["data"]["tls.key"].as_str().unwrap_or_default(),
    ))
    .expect("PEM");
    let ca = calix_testbed::tls::Ca::from_key_pem("calix routes CA", &ca_key).expect("CA");
    let two = ca.issue_names(&[&n1, &n2]).expect("cert");
    for as_node in [&n1, &n2] {
        let err = try_watch(&c, 2, 0, as_node, &ca_pem, &two.cert_pem, &two.key_pem)
            .expect_err("two names");
        assert!(err.contains("more than one"), "{err}");
    }
    let door = &nodes(&c, 0)["door"];
    assert!(door["refused_identity"].as_u64() >= Some(3), "{door}");
    drop((p0, p2));
    clean_up(&api, &[n0, n1, n2, rogue], Some(&u));
}

#[test]
fn certificates_are_renewed_before_they_expire_under_traffic_without_loss() {
    let _one = one_cluster_at_a_time();
    let api = KubeApi::shared();
    let u = unique("r");
    let s = setup(&u, 30);
    agent_rules(&api, &s);
    let sig = Signer::start(&api, s.clone()).unwrap_or_else(|e| panic!("{e}"));
    let mut c = Cluster::create(Dataplane::Kernel, &[1, 2], |_, _| String::new());
    api.apply(ippool(&u, "10.76.0.0/16", &u))
        .unwrap_or_else(|e| panic!("{e}"));
    for i in 0..2 {
        join(&api, &mut c, i, &u, &s, 30);
    }
    for i in 0..2 {
        c.nodes[i]
            .agent()
            .start(&[])
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let (n0, n1) = (c.name(0).to_string(), c.name(1).to_string());
    wait_for(
        "both nodes follow each other",
        Duration::from_secs(60),
        || (up(&c, 0) == [n1.clone()] && up(&c, 1) == [n0.clone()]).then_some(()),
        || format!("{}\n{}", c.nodes[0].agent_log(), sig.log()),
    );
    let p0 = api.node_pod(&c.nodes[0], "p");
    let p1 = api.node_pod(&c.nodes[1], "p");
    wait_for(
        "the pods reach each other (VXLAN: the nodes' subnets differ)",
        Duration::from_secs(20),
        || (p0.ns.ping(&p1.ip(), 1) && p1.ns.ping(&p0.ip(), 1)).then_some(()),
        || String::from_utf8_lossy(&c.nodes[0].calixctl(&["routes"]).stdout).into(),
    );
    let before: Vec<Value> = (0..2).map(|i| nodes(&c, i)).collect();
    for b in &before {
        assert_eq!(b["certificate"]["issued"], 1, "{b}");
    }
    // A TCP flow (an echo every 10 ms) and a ping across the nodes for 75 s: at least three
    // lifetimes of 30 s, renewed at 60-70 % of each.
    let flow = Flow::start(&p0.ns.path(), &p1.ns.path(), &p1.ip());
    let ping = p0
        .ns
        .cmd(&["ping", "-c", "75", "-i", "1", "-W", "2", "-q", &p1.ip()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ping");
    let started = Instant::now();
    let mut serials = [
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    ];
    let mut served = [
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    ];
    let mut least_left = [i64::MAX; 2];
    let mut tick = 0u32;
    while started.elapsed() < Duration::from_secs(75) {
        for (i, other) in [(0, 1), (1, 0)] {
            let cert = nodes(&c, i)["certificate"].clone();
            if let Some(serial) = cert["serial"].as_str() {
                serials[i].insert(serial.to_string());
            }
            least_left[i] = least_left[i].min(cert["expires_in_secs"].as_i64().unwrap_or(-1));
            if tick.is_multiple_of(3) {
                if let Some(s) = served_serial(&c, other, i) {
                    served[i].insert(s);
                }
            }
        }
        tick += 1;
        std::thread::sleep(Duration::from_secs(1));
    }
    let ping = ping.wait_with_output().expect("ping");
    let (echoes, gap) = flow.stop();
    let summary = String::from_utf8_lossy(&ping.stdout).into_owned();
    let after: Vec<Value> = (0..2).map(|i| nodes(&c, i)).collect();
    eprintln!(
        "75 s: serials {serials:?}, served {served:?}, least validity left {least_left:?} s;          {echoes} echoes, longest gap {gap:?}; ping: {}",
        summary.lines().filter(|l| l.contains("packets")).collect::<String>()
    );
    for i in 0..2 {
        let cert = &after[i]["certificate"];
        assert!(
            serials[i].len() >= 3 && cert["issued"].as_u64() >= Some(3),
            "node {i} renewed at least twice in 75 s: {:?} {cert}\n{}",
            serials[i],
            c.nodes[i].agent_log()
        );
        assert!(
            served[i].len() >= 2,
            "node {i} serves its renewed certificate: {:?}",
            served[i]
        );
        assert!(
            least_left[i] > 0,
            "node {i}'s certificate expired before it was renewed"
        );
        assert_eq!(cert["failures"], 0, "{cert}");
        // No stream dropped: the peer's first snapshot is still its only one, and the door
        // accepted no new connection.
        for (b, a) in before[i]["peers"]
            .as_array()
            .into_iter()
            .flatten()
            .zip(after[i]["peers"].as_array().into_iter().flatten())
        {
            assert_eq!(
                (&b["snapshots"], &b["state"]),
                (&a["snapshots"], &a["state"]),
                "node {i}: {a}"
            );
        }
        assert_eq!(
            before[i]["door"]["accepted"], after[i]["door"]["accepted"],
            "node {i}: a peer reconnected"
        );
    }
    assert!(
        summary.contains("75 packets transmitted, 75 received"),
        "ping lost packets: {summary}"
    );
    assert!(echoes > 2000, "{echoes} echoes in 75 s");
    assert!(
        gap < Duration::from_secs(1),
        "the TCP flow stalled for {gap:?}"
    );
    drop((p0, p1));
    clean_up(&api, &[n0, n1], Some(&u));
}

#[test]
fn the_signer_signs_only_an_agents_request_for_its_own_node_and_says_why_not() {
    let api = KubeApi::shared();
    let u = unique("d");
    let s = setup(&u, 3600);
    agent_rules(&api, &s);
    let (a, b) = (unique("a"), unique("b"));
    // (No address: no agent of another test follows them.)
    for n in [&a, &b] {
        node_object(&api, n, json!({}), &[]);
    }
    // Node a's agent's token; the agents' ServiceAccount with a token bound to no node; and
    // another ServiceAccount (allowed to ask, as a workload might be) bound to node a.
    let token_a = api
        .pod_bound_token(NS, AGENT_SA, &agent_pod(&a), &a)
        .unwrap_or_else(|e| panic!("{e}"));
    let unbound = api
        .token(NS, AGENT_SA, None)
        .unwrap_or_else(|e| panic!("{e}"));
    let web = format!("{u}-web");
    api.service_account(NS, &web)
        .unwrap_or_else(|e| panic!("{e}"));
    let (certs, _) = signer::agent_certificate_rules(&s).unwrap_or_else(|e| panic!("{e}"));
    api.grant(&web, None, NS, &web, certs)
        .unwrap_or_else(|e| panic!("{e}"));
    let web_pod = format!("{u}-web");
    let token_web = api
        .pod_bound_token(NS, &web, &web_pod, &a)
        .unwrap_or_else(|e| panic!("{e}"));

    // Before the signer runs: node a asks for node b's name, and an administrator approves
    // it by hand.
    let (req, _) = request(&b, &[&b]);
    let approved_by_hand = {
        let csr = json!({
            "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"generateName": "cxt-test-"},
            "spec": {"request": base64(req.as_bytes()), "signerName": s.signer_name,
                "usages": ["digital signature", "server auth", "client auth"]},
        });
        let name = api.with_token(&token_a, move |c| async move {
            use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
            let api: kube::Api<CertificateSigningRequest> = kube::Api::all(c);
            let obj: CertificateSigningRequest = serde_json::from_value(csr).expect("a CSR");
            api.create(&Default::default(), &obj)
                .await
                .map(|o| o.metadata.name.unwrap_or_default())
                .expect("create")
        });
        let n = name.clone();
        api.with_client(move |c| async move {
            use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
            let api: kube::Api<CertificateSigningRequest> = kube::Api::all(c);
            let patch = json!({"status": {"conditions": [{"type": "Approved", "status": "True",
                "reason": "AdminSaysSo", "message": "by hand"}]}});
            api.patch_approval(&n, &Default::default(), &kube::api::Patch::Merge(&patch))
                .await
                .expect("an admin approves");
        });
        name
    };
    let sig = Signer::start(&api, s.clone()).unwrap_or_else(|e| panic!("{e}"));

    let denied = |token: &str, req: &str, reason: &str, says: &str| {
        let r = ask(&api, token, &s, req);
        let d = condition(&r, "Denied").unwrap_or_else(|| panic!("not denied: {r:#}"));
        assert_eq!(d["reason"], reason, "{d}");
        let message = d["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{reason}: {message}");
        assert!(r["status"]["certificate"].is_null(), "{r:#}");
        eprintln!("denied {reason}: {message}");
    };
    denied(
        &token_a,
        &request(&b, &[&b]).0,
        "OtherNode",
        &format!("node {a:?}"),
    );
    denied(
        &token_a,
        &request(&a, &[&a, &b]).0,
        "NotOneName",
        &format!("DNS:{b}"),
    );
    denied(
        &unbound,
        &request(&a, &[&a]).0,
        "NoNodeBinding",
        "authentication.kubernetes.io/node-name",
    );
    denied(&token_web, &request(&a, &[&a]).0, "NotCalixAgent", &web);
    // The one approved by hand: refused all the same, marked Failed, never signed.
    let r = decided(&api, &approved_by_hand);
    let f = condition(&r, "Failed").unwrap_or_else(|| panic!("not failed: {r:#}"));
    assert_eq!(f["reason"], "OtherNode", "{f}");
    assert!(r["status"]["certificate"].is_null(), "{r:#}");
    // Node a's agent asking for node a: signed, naming a alone, for the signer's lifetime.
    let (req, _) = request(&a, &[&a]);
    let r = ask(&api, &token_a, &s, &req);
    let pem = decode_base64(r["status"]["certificate"].as_str().unwrap_or_default());
    use rustls::pki_types::pem::PemObject;
    let der = rustls::pki_types::CertificateDer::from_pem_slice(&pem)
        .unwrap_or_else(|_| panic!("no certificate: {r:#}\n{}", sig.log()));
    let facts = calix_pki::cert::facts(der.as_ref()).expect("facts");
    assert_eq!(facts.names, [calix_pki::Name::Dns(a.clone())]);
    let lifetime = facts
        .not_after
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    assert!(
        lifetime > Duration::from_secs(3500) && lifetime <= Duration::from_secs(3600),
        "{lifetime:?}"
    );
    // The agents' ServiceAccount may ask but not approve, not even its own.
    let (req, _) = request(&a, &[&a]);
    let name = {
        let csr = json!({
            "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"generateName": "cxt-test-"},
            "spec": {"request": base64(req.as_bytes()), "signerName": "calix.dev/nobody",
                "usages": ["digital signature"]},
        });
        api.with_token(&token_a, move |c| async move {
            use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
            let api: kube::Api<CertificateSigningRequest> = kube::Api::all(c);
            let obj: CertificateSigningRequest = serde_json::from_value(csr).expect("a CSR");
            let name = api
                .create(&Default::default(), &obj)
                .await
                .map(|o| o.metadata.name.unwrap_or_default())
                .expect("create");
            let patch = json!({"status": {"conditions": [{"type": "Approved", "status": "True",
                "reason": "Me", "message": "myself"}]}});
            let r = api
                .patch_approval(&name, &Default::default(), &kube::api::Patch::Merge(&patch))
                .await;
            assert!(
                matches!(&r, Err(kube::Error::Api(s)) if s.code == 403),
                "the agent approved a request: {r:?}"
            );
            name
        })
    };
    assert!(!name.is_empty());
    let log = sig.log();
    for reason in ["OtherNode", "NotOneName", "NoNodeBinding", "NotCalixAgent"] {
        assert!(
            log.contains(reason),
            "the signer's log lacks {reason}:\n{log}"
        );
    }
    let _ = api.delete_now("v1", "Pod", NS, &web_pod);
    clean_up(&api, &[a, b], None);
}
