//! One pod on a kubelet-managed node (issue 14's last acceptance item): a real kube-apiserver
//! v1.36.2 (in a namespace of its own) and a node namespace running the upstream kubelet with
//! a private containerd 1.6 (CRI), the calix agent (kubernetes datastore, as the agents'
//! ServiceAccount with a token bound to its Node, under the chart's node authority) and the
//! calix CNI plugin in the CRI plugin's `bin_dir`/`conf_dir`. A Pod with `nodeName` set goes
//! Running, its status shows the address calix gave it (from the pool its namespace's labels
//! select, not another tenant's), the node reaches it; deleting it (the kubelet confirming)
//! releases everything: the address, the endpoint, the veth, the route.
//!
//! Then two kubelet nodes (kube-controller-manager, kube-scheduler, kube-proxy in iptables
//! mode) on the test underlay's two subnets: pods reach each other across nodes (ping, TCP),
//! a ClusterIP Service from a pod on either node, a hostPort from outside the nodes, a TCP flow
//! carries on while both agents restart, and the pods' deletion releases every address.
use std::time::{Duration, Instant};

use calix_testbed::kubelet::{http_get, web_pod, BUSYBOX_IMAGE};
use calix_testbed::pod_net::{in_pod, Flow};
use calix_testbed::tls::Ca;
use calix_testbed::{
    bin, unique, wait_for, Cluster, CniDirs, Dataplane, KubeApi, KubeNode, KubeletServes, Node,
};
use serde_json::{json, Value};

/// The address of `ifname` in `node` (the one the API server's veth gave it).
fn address_of(node: &Node, ifname: &str) -> String {
    let out = node.ns.exec_ok(&["ip", "-j", "-4", "addr", "show", ifname]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("ip -j");
    v[0]["addr_info"][0]["local"]
        .as_str()
        .expect("an IPv4 address")
        .to_string()
}

/// The web pods' hostPort (the portmap plugin after calix in the conflist).
const HOST_PORT: u16 = 18080;

/// Writes `path`: the node's kubeconfig `wired` as the agents' ServiceAccount, with a token
/// bound to Node `node` (its kubelet registered it; a pod made for a pod-bound token would be
/// run by that kubelet), under the chart's node authority.
fn agent_kubeconfig_for(
    api: &KubeApi,
    node: &str,
    wired: &std::path::Path,
    path: &std::path::Path,
) {
    let token = api
        .agent_token_bound(node, calix_testbed::k8s::BoundTo::Node)
        .unwrap_or_else(|e| panic!("{e}"));
    api.kubeconfig_as(wired, &token, path)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Every write the agent made was its own node's: none refused by the node authority.
fn assert_admitted(node: &Node) {
    let log = node.agent_log();
    let refused = calix_testbed::authority::refusals(&log);
    assert!(refused.is_empty(), "{}", refused.join("\n"));
}

fn pod(api: &KubeApi, label: &str) -> Option<Value> {
    pods(api, &format!("calix.dev/test={label}"))
        .into_iter()
        .next()
}

fn pods(api: &KubeApi, selector: &str) -> Vec<Value> {
    api.list("v1", "Pod", selector)
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_pod_the_kubelet_starts_gets_its_calix_address_and_its_deletion_releases_everything() {
    let started = Instant::now();
    let api = KubeApi::in_namespace();
    let node = Node::create(Dataplane::under_test(), None);
    let kubeconfig = api.wire(&node.ns).unwrap_or_else(|e| panic!("{e}"));
    let node_ip = address_of(&node, "kube0");
    // The kubelet as the admin; the agent as the agents' ServiceAccount with a token bound to
    // the Node, once the kubelet has registered it (agent_kubeconfig).
    let agent_kubeconfig = node.dir.join("agent.kubeconfig");
    let mut node = node.with_config(&format!(
        "[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\ntimeout_ms = 5000\nattempts = 40\n",
        agent_kubeconfig.display()
    ));
    {
        let name = node.ns.name.clone();
        let spec = &mut node.agent_mut().spec;
        spec.node_name_flag = false;
        spec.env = vec![("CALIX_NODE_NAME".into(), name)];
    }
    let u = unique("kp");
    let pool = "10.74.0.0/24";
    // The pod's namespace is tenant u's; a pool of another tenant comes first by name and is
    // never used for it.
    let other = format!("{u}-0-other");
    for (name, cidr, tenant) in [
        (&other, "10.74.1.0/24", other.clone()),
        (&u, pool, u.clone()),
    ] {
        api.apply(json!({
            "apiVersion": "calix.dev/v1", "kind": "IPPool", "metadata": {"name": name},
            "spec": {"cidr": cidr, "blockSize": 28,
                     "namespaceSelector": {"matchLabels": {"calix.dev/tenant": tenant}}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    }
    api.apply(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": u, "labels": {"calix.dev/tenant": u}},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let cni = CniDirs::create(&node.dir, node.conf(json!({})), &bin("calix"))
        .unwrap_or_else(|e| panic!("{e}"));
    let kube = KubeNode::start(
        &node.ns,
        &node.dir.join("k8s"),
        &kubeconfig,
        &node_ip,
        &cni,
        KubeletServes::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("kubelet registered after {:?}", started.elapsed());
    agent_kubeconfig_for(&api, &node.ns.name, &kubeconfig, &agent_kubeconfig);
    node.start_agent();
    // (No controller-manager makes the namespace's default ServiceAccount, which admission
    // wants.)
    api.apply(json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": u},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let name = format!("{u}-web");
    api.apply(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": u, "labels": {"calix.dev/test": u}},
        "spec": {
            "nodeName": node.ns.name,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sleep", "3600"],
            }],
        },
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let show = || {
        format!(
            "{}\n--- agent ---\n{}",
            kube.logs_tail(40),
            node.agent_log()
        )
    };
    let running = wait_for(
        "the pod Running with an address",
        Duration::from_secs(90),
        || {
            pod(&api, &u).filter(|p| {
                p["status"]["phase"] == "Running" && p["status"]["podIP"].as_str().is_some()
            })
        },
        show,
    );
    eprintln!("pod running after {:?}", started.elapsed());
    let ip = running["status"]["podIP"]
        .as_str()
        .expect("podIP")
        .to_string();
    let addr: std::net::Ipv4Addr = ip.parse().expect("an IPv4 podIP");
    let net: ipnet::Ipv4Net = pool.parse().expect("pool");
    assert!(
        net.contains(&addr),
        "podIP {ip} is not in calix's pool {pool}"
    );
    // calix's own record of it: the endpoint, with the pod's name and UID.
    let eps = node.endpoints();
    let ep = eps["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["podName"] == name.as_str())
        .unwrap_or_else(|| panic!("no endpoint of {name}: {eps}"));
    assert_eq!(ep["podUID"], running["metadata"]["uid"], "{ep}");
    assert!(ep.to_string().contains(&ip), "{ep} lacks {ip}");
    assert_eq!(node.allocated(), 1);
    assert_eq!(node.cali_links().len(), 1, "{:?}", node.cali_links());
    assert!(node.ns.ping(&ip, 3), "the node cannot ping its pod at {ip}");
    // Deleting it: the kubelet stops the sandbox (CNI DEL) and confirms the deletion.
    api.delete_in("v1", "Pod", &u, &name)
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the pod gone from the API",
        Duration::from_secs(60),
        || pod(&api, &u).is_none().then_some(()),
        show,
    );
    wait_for(
        "the address, endpoint and veth released",
        Duration::from_secs(30),
        || {
            (node.allocated() == 0
                && node.cali_links().is_empty()
                && node.endpoints()["endpoints"]
                    .as_array()
                    .is_none_or(|a| a.is_empty()))
            .then_some(())
        },
        || format!("{:?}\n{}", node.cali_links(), show()),
    );
    let routes: Vec<Value> = node
        .ns
        .routes()
        .into_iter()
        .filter(|r| r["dst"].as_str().is_some_and(|d| d.starts_with(&ip)))
        .collect();
    assert!(routes.is_empty(), "a route to {ip} is left: {routes:?}");
    assert_admitted(&node);
    eprintln!("released after {:?}", started.elapsed());
    let left = kube.stop();
    assert!(left.is_empty(), "the kubelet node left behind: {left:?}");
    for p in [&u, &other] {
        api.delete("calix.dev/v1", "IPPool", p)
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn pods_on_two_kubelet_nodes_reach_each_other_and_a_cluster_ip_service_and_are_released() {
    let started = Instant::now();
    let api = KubeApi::in_namespace();
    api.start_controllers().unwrap_or_else(|e| panic!("{e}"));
    api.serve_in_cluster().unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "API server, controller-manager, scheduler after {:?}",
        started.elapsed()
    );
    let ca = Ca::new("calix-test-ca").expect("CA");
    let kubeconfigs = std::cell::RefCell::new(Vec::new());
    let cluster = Cluster::create(Dataplane::under_test(), &[1, 2], |i, c| {
        let kubeconfig = api.wire(&c.nodes[i].ns).unwrap_or_else(|e| panic!("{e}"));
        // (Written once the kubelet registered the node: agent_kubeconfig_for.)
        let text = format!(
            "uplinks = [\"eth0\"]\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\n{}",
            c.nodes[i].dir.join("agent.kubeconfig").display(),
            c.routes_config(i, &ca, "grace_secs = 5")
                .unwrap_or_else(|e| panic!("{e}"))
        );
        kubeconfigs.borrow_mut().push(kubeconfig);
        text
    });
    let kubeconfigs = kubeconfigs.into_inner();
    let u = unique("kc");
    let pool = "10.75.0.0/16";
    api.apply(json!({
        "apiVersion": "calix.dev/v1", "kind": "IPPool", "metadata": {"name": u},
        "spec": {"cidr": pool, "blockSize": 26},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let kubes: Vec<KubeNode> = (0..2)
        .map(|i| {
            let node = &cluster.nodes[i];
            let cni = CniDirs::create(&node.dir, node.conf(json!({})), &bin("calix"))
                .unwrap_or_else(|e| panic!("{e}"));
            let mut kube = KubeNode::start(
                &node.ns,
                &node.dir.join("k8s"),
                &kubeconfigs[i],
                &cluster.address(i),
                &cni,
                KubeletServes::default(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            kube.start_kube_proxy(&kubeconfigs[i])
                .unwrap_or_else(|e| panic!("{e}"));
            agent_kubeconfig_for(
                &api,
                cluster.name(i),
                &kubeconfigs[i],
                &node.dir.join("agent.kubeconfig"),
            );
            kube
        })
        .collect();
    cluster.start();
    eprintln!(
        "2 kubelet nodes, kube-proxy, agents after {:?}",
        started.elapsed()
    );
    let show = || {
        kubes
            .iter()
            .zip(&cluster.nodes)
            .map(|(k, n)| format!("{}\n--- agent ---\n{}", k.logs_tail(30), n.agent_log()))
            .collect::<Vec<_>>()
            .join("\n=====\n")
    };
    // A web server pod on each node (busybox httpd answering its pod's name), behind a
    // ClusterIP Service.
    let names: Vec<String> = (0..2).map(|i| format!("{u}-web{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        api.apply(web_pod(
            name,
            cluster.name(i),
            json!({"calix.dev/test": u, "app": u}),
            Some(HOST_PORT),
        ))
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let svc = api
        .apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": u, "namespace": "default"},
            "spec": {"selector": {"app": u}, "ports": [{"port": 80, "targetPort": 8080}]},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .expect("clusterIP")
        .to_string();
    let running = wait_for(
        "both pods Running with addresses",
        Duration::from_secs(120),
        || {
            let p = pods(&api, &format!("calix.dev/test={u}"));
            (p.len() == 2
                && p.iter().all(|p| {
                    p["status"]["phase"] == "Running" && p["status"]["podIP"].as_str().is_some()
                }))
            .then_some(p)
        },
        show,
    );
    eprintln!("pods running after {:?}", started.elapsed());
    let net: ipnet::Ipv4Net = pool.parse().expect("pool");
    let ip_of = |name: &str| -> String {
        let p = running
            .iter()
            .find(|p| p["metadata"]["name"] == name)
            .expect("the pod");
        let ip = p["status"]["podIP"].as_str().expect("podIP").to_string();
        assert!(
            net.contains(&ip.parse::<std::net::Ipv4Addr>().expect("IPv4")),
            "{name}'s podIP {ip} is not in calix's pool {pool}"
        );
        ip
    };
    let ips: Vec<String> = names.iter().map(|n| ip_of(n)).collect();
    let netns: Vec<String> = (0..2)
        .map(|i| {
            kubes[i]
                .pod_netns("default", &names[i])
                .unwrap_or_else(|| panic!("no sandbox namespace for {}", names[i]))
        })
        .collect();
    for (from, to) in [(0, 1), (1, 0)] {
        wait_for(
            &format!("pod {from} pings pod {to} at {} across nodes", ips[to]),
            Duration::from_secs(30),
            || in_pod(&netns[from], &["ping", "-c", "1", "-W", "1", &ips[to]]).map(|_| ()),
            show,
        );
        wait_for(
            &format!(
                "pod {from} gets pod {to}'s page from {}:8080 (TCP)",
                ips[to]
            ),
            Duration::from_secs(20),
            || {
                (http_get(&netns[from], &format!("{}:8080", ips[to])).as_deref()
                    == Some(names[to].as_str()))
                .then_some(())
            },
            show,
        );
    }
    eprintln!("pod to pod (ping, TCP) after {:?}", started.elapsed());
    // The Service, from a pod on either node: kube-proxy's DNAT picks either backend; both
    // answer within some tries.
    for (from, ns) in netns.iter().enumerate() {
        let mut seen = std::collections::BTreeSet::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while seen.len() < 2 {
            if let Some(b) = http_get(ns, &cluster_ip) {
                seen.insert(b);
            }
            assert!(
                Instant::now() < deadline,
                "from pod {from}, the Service {cluster_ip} answered only as {seen:?}\n{}",
                show()
            );
        }
    }
    eprintln!(
        "ClusterIP Service from both nodes after {:?}",
        started.elapsed()
    );
    // The hostPort, from outside the nodes (the underlay's router).
    let underlay = cluster.underlay().path();
    for (i, name) in names.iter().enumerate() {
        let addr = format!("{}:{HOST_PORT}", cluster.address(i));
        wait_for(
            &format!("node {i}'s hostPort {addr} answers as {name}"),
            Duration::from_secs(20),
            || (http_get(&underlay, &addr).as_deref() == Some(name.as_str())).then_some(()),
            show,
        );
    }
    eprintln!("hostPort after {:?}", started.elapsed());
    // In-cluster clients reach the API server through the `kubernetes` Service.
    for (i, ns) in netns.iter().enumerate() {
        wait_for(
            &format!("pod {i} connects to the kubernetes Service (10.96.0.1:443)"),
            Duration::from_secs(20),
            || {
                let f = std::fs::File::open(ns).ok()?;
                std::thread::spawn(move || {
                    use std::os::fd::AsRawFd;
                    // SAFETY: setns(2) of this thread only, on a namespace fd we hold.
                    (unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } == 0
                        && std::net::TcpStream::connect_timeout(
                            &"10.96.0.1:443".parse().expect("address"),
                            Duration::from_secs(2),
                        )
                        .is_ok())
                    .then_some(())
                })
                .join()
                .ok()
                .flatten()
            },
            show,
        );
    }
    // An established TCP flow from pod 0 to pod 1 carries on while both agents restart (what a
    // DaemonSet rollout does to them, one node after the other).
    let flow = Flow::start(&netns[0], &netns[1], &ips[1]);
    std::thread::sleep(Duration::from_millis(500));
    for node in &cluster.nodes {
        node.stop_agent();
        node.start_agent();
    }
    std::thread::sleep(Duration::from_millis(500));
    let (echoes, gap) = flow.stop();
    eprintln!(
        "TCP flow across both agents' restarts: {echoes} echoes, longest gap {gap:?} (after {:?})",
        started.elapsed()
    );
    assert!(
        gap < Duration::from_secs(2),
        "the flow stalled for {gap:?} while the agents restarted"
    );
    for name in &names {
        api.delete_in("v1", "Pod", "default", name)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    wait_for(
        "the pods gone from the API",
        Duration::from_secs(60),
        || {
            pods(&api, &format!("calix.dev/test={u}"))
                .is_empty()
                .then_some(())
        },
        show,
    );
    for (i, node) in cluster.nodes.iter().enumerate() {
        wait_for(
            &format!("node {i}'s address, endpoint and veth released"),
            Duration::from_secs(30),
            || {
                (node.cali_links().is_empty()
                    && node.endpoints()["endpoints"]
                        .as_array()
                        .is_none_or(|a| a.is_empty()))
                .then_some(())
            },
            show,
        );
    }
    assert_eq!(
        cluster.nodes[0].allocated(),
        0,
        "addresses left in the pool"
    );
    cluster.nodes.iter().for_each(assert_admitted);
    eprintln!("released after {:?}", started.elapsed());
    for k in kubes {
        let left = k.stop();
        assert!(left.is_empty(), "a kubelet node left behind: {left:?}");
    }
    api.delete_in("v1", "Service", "default", &u)
        .unwrap_or_else(|e| panic!("{e}"));
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}
