//! One pod on a kubelet-managed node (issue 14's last acceptance item): a real kube-apiserver
//! v1.36.2 (in a namespace of its own) and a node namespace running the upstream kubelet with
//! a private containerd 1.6 (CRI), the calix agent (kubernetes datastore) and the calix CNI
//! plugin in the CRI plugin's `bin_dir`/`conf_dir`. A Pod with `nodeName` set goes Running,
//! its status shows the address calix gave it, the node reaches it; deleting it (the kubelet
//! confirming) releases everything: the address, the endpoint, the veth, the route.
use std::path::Path;
use std::time::{Duration, Instant};

use calix_testbed::kubelet::BUSYBOX_IMAGE;
use calix_testbed::{bin, unique, wait_for, CniDirs, Dataplane, KubeApi, KubeNode, Node};
use serde_json::{json, Value};

/// The CRI plugin's CNI dirs under `dir`: Debian's reference plugins and `calix` in `bin`,
/// calix's conflist (calix, then portmap) for `node`'s agent in `conf`.
fn cni_dirs(dir: &Path, node: &Node) -> CniDirs {
    let dirs = CniDirs {
        bin: dir.join("cni-bin"),
        conf: dir.join("cni-net.d"),
    };
    std::fs::create_dir_all(&dirs.bin).expect("cni bin dir");
    std::fs::create_dir_all(&dirs.conf).expect("cni conf dir");
    if let Ok(rd) = std::fs::read_dir("/usr/lib/cni") {
        for e in rd.filter_map(Result::ok) {
            let _ = std::os::unix::fs::symlink(e.path(), dirs.bin.join(e.file_name()));
        }
    }
    std::os::unix::fs::symlink(bin("calix"), dirs.bin.join("calix")).expect("calix plugin");
    let conflist = json!({
        "cniVersion": "1.0.0",
        "name": "calix",
        "plugins": [
            node.conf(json!({})),
            {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true},
        ],
    });
    std::fs::write(dirs.conf.join("10-calix.conflist"), conflist.to_string()).expect("conflist");
    dirs
}

/// The address of `ifname` in `node` (the one the API server's veth gave it).
fn address_of(node: &Node, ifname: &str) -> String {
    let out = node.ns.exec_ok(&["ip", "-j", "-4", "addr", "show", ifname]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("ip -j");
    v[0]["addr_info"][0]["local"]
        .as_str()
        .expect("an IPv4 address")
        .to_string()
}

fn pod(api: &KubeApi, label: &str) -> Option<Value> {
    api.list("v1", "Pod", &format!("calix.dev/test={label}"))
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .next()
}

#[test]
fn a_pod_the_kubelet_starts_gets_its_calix_address_and_its_deletion_releases_everything() {
    let started = Instant::now();
    let api = KubeApi::in_namespace();
    let node = Node::create(Dataplane::under_test(), None);
    let kubeconfig = api.wire(&node.ns).unwrap_or_else(|e| panic!("{e}"));
    let node_ip = address_of(&node, "kube0");
    let mut node = node.with_config(&format!(
        "[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\ntimeout_ms = 5000\nattempts = 40\n",
        kubeconfig.display()
    ));
    {
        let name = node.ns.name.clone();
        let spec = &mut node.agent_mut().spec;
        spec.node_name_flag = false;
        spec.env = vec![("CALIX_NODE_NAME".into(), name)];
    }
    let u = unique("kp");
    let pool = "10.74.0.0/24";
    api.apply(json!({
        "apiVersion": "calix.dev/v1", "kind": "IPPool", "metadata": {"name": u},
        "spec": {"cidr": pool, "blockSize": 28},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let cni = cni_dirs(&node.dir, &node);
    let kube = KubeNode::start(&node.ns, &node.dir.join("k8s"), &kubeconfig, &node_ip, &cni)
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("kubelet registered after {:?}", started.elapsed());
    node.start_agent();
    // (No controller-manager makes the namespace's default ServiceAccount, which admission
    // wants.)
    api.apply(json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": "default"},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let name = format!("{u}-web");
    api.apply(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"calix.dev/test": u}},
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
    api.delete_in("v1", "Pod", "default", &name)
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
    eprintln!("released after {:?}", started.elapsed());
    let left = kube.stop();
    assert!(left.is_empty(), "the kubelet node left behind: {left:?}");
    api.delete("calix.dev/v1", "IPPool", &u)
        .unwrap_or_else(|e| panic!("{e}"));
}
