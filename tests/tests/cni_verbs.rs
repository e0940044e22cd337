//! The calix CNI plugin against spec 1.1: CHECK, GC, STATUS, VERSION conversion, IPv6 and dual
//! stack, delegated IPAM, runtimeConfig, chaining with the reference plugins, concurrency, and
//! rollback. Real namespaces, the real binary, a real agent. Run as root.
use std::collections::HashSet;

use calix_testbed::{ConfList, Dataplane, Netns, Node, Pod};
use serde_json::{json, Value};

const DUAL: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\n[[pools]]\ncidr = \"fd00:10::/64\"\n";

fn msg(out: &calix_testbed::CniOutput) -> String {
    out.json
        .as_ref()
        .and_then(|j| j["msg"].as_str())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn check_passes_on_a_healthy_pod_and_catches_each_breakage() {
    let node = Node::start(Dataplane::under_test());
    let a = Pod::add(&node, "a");
    let out = a.check();
    assert!(out.success, "CHECK of a healthy pod failed: {out:?}");
    assert!(
        out.stdout.trim().is_empty(),
        "CHECK prints nothing on success"
    );

    // CHECK without prevResult is a config error.
    assert_eq!(a.call("CHECK", Value::Null).code(), Some(7));

    // The host route goes missing.
    node.ns
        .exec_ok(&["ip", "route", "del", &format!("{}/32", a.ip())]);
    let out = a.check();
    assert!(!out.success);
    assert!(msg(&out).contains("host route"), "{out:?}");

    // The pod's address goes missing.
    let b = Pod::add(&node, "b");
    b.ns.exec_ok(&[
        "ip",
        "addr",
        "del",
        &format!("{}/32", b.ip()),
        "dev",
        "eth0",
    ]);
    let out = b.check();
    assert!(!out.success);
    assert!(msg(&out).contains("missing on eth0"), "{out:?}");

    // The agent no longer holds the address (released behind the pod's back via GC).
    let c = Pod::add(&node, "c");
    assert!(c.check().success);
    let gc = c.call(
        "GC",
        json!({"cniVersion": "1.1.0", "cni.dev/valid-attachments": [
            {"containerID": a.container_id, "ifname": "eth0"},
            {"containerID": b.container_id, "ifname": "eth0"},
        ]}),
    );
    assert!(gc.success, "{gc:?}");
    let out = c.check();
    assert!(!out.success);
    assert!(
        msg(&out).contains("no endpoint") || msg(&out).contains("missing"),
        "{out:?}"
    );
}

#[test]
fn gc_releases_everything_not_in_valid_attachments() {
    let node = Node::start(Dataplane::under_test());
    let keep = Pod::add(&node, "keep");
    let gone1 = Pod::add(&node, "gone1");
    let gone2 = Pod::add(&node, "gone2");
    assert_eq!(node.allocated(), 3);
    // The older key is accepted too; another network's allocations are never touched.
    let other = Pod::add_with(&node, "other", json!({"name": "other-net"}));
    let out = keep.call(
        "GC",
        json!({"cniVersion": "1.1.0", "cni.dev/attachments": [
            {"containerID": keep.container_id, "ifname": "eth0"},
        ]}),
    );
    assert!(out.success, "{out:?}");
    assert_eq!(node.allocated(), 2, "GC left stale allocations");
    let links = node.cali_links();
    assert!(links.contains(&keep.host_ifname()));
    assert!(links.contains(&other.host_ifname()));
    assert!(
        !links.contains(&gone1.host_ifname()),
        "stale veth not deleted"
    );
    assert!(!links.contains(&gone2.host_ifname()));
    let eps = node.endpoints();
    assert_eq!(eps["endpoints"].as_array().map(Vec::len), Some(2), "{eps}");
    assert!(keep.ns.ping(&other.ip(), 1), "GC broke a live pod");
    // GC without the key is an error, not "release everything".
    assert_eq!(
        keep.call("GC", json!({"cniVersion": "1.1.0"})).code(),
        Some(7)
    );
    assert_eq!(node.allocated(), 2);
}

#[test]
fn status_reports_reachability_and_free_addresses() {
    let node = Node::start_with_config(
        Dataplane::under_test(),
        Some("[[pools]]\ncidr = \"10.250.0.0/30\"\nblockSize = 30\n"),
    );
    let status = |n: &Node| {
        calix_testbed::cni_call(
            &n.ns,
            "STATUS",
            "",
            "",
            "",
            "",
            &n.conf(json!({"cniVersion": "1.1.0"})).to_string(),
        )
    };
    let out = status(&node);
    assert!(out.success, "{out:?}");
    // Two usable addresses (.1, .2); fill them.
    let _p1 = Pod::add(&node, "p1");
    let _p2 = Pod::add(&node, "p2");
    let out = status(&node);
    assert_eq!(out.code(), Some(50), "{out:?}");
    assert!(msg(&out).contains("10.250.0.0/30"), "{out:?}");
    node.stop_agent();
    let out = status(&node);
    assert_eq!(out.code(), Some(51), "{out:?}");
}

#[test]
fn results_follow_the_requested_version() {
    let node = Node::start(Dataplane::under_test());
    for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let mut p = Pod::add_with(&node, "v", json!({"cniVersion": v}));
        let j = p.result.json.clone().unwrap_or_default();
        assert_eq!(j["cniVersion"], v);
        let has_version = j["ips"][0].get("version").is_some();
        assert_eq!(has_version, v.starts_with("0."), "{v}: {j}");
        assert!(p.check().success || v.starts_with("0.3"), "CHECK at {v}");
        p.del();
    }
    let p = Pod::try_add(&node, "old", json!({"cniVersion": "0.2.0"}));
    assert_eq!(p.result.code(), Some(1));
}

#[test]
fn ipv6_and_dual_stack() {
    let node = Node::start_with_config(Dataplane::under_test(), Some(DUAL));
    let extra = json!({"ipam": {"type": "calix-ipam", "assign_ipv6": "true"}});
    let a = Pod::add_with(&node, "a", extra.clone());
    let b = Pod::add_with(&node, "b", extra.clone());
    let (ia, ib) = (a.ips(), b.ips());
    assert_eq!(ia.len(), 2, "{:?}", a.result);
    let v6a = ia
        .iter()
        .find(|x| x.contains(':'))
        .expect("v6 of a")
        .clone();
    let v6b = ib
        .iter()
        .find(|x| x.contains(':'))
        .expect("v6 of b")
        .clone();
    assert!(v6a.starts_with("fd00:10::"));
    // /128 in the pod, default via the host veth's link-local, no DAD pending.
    let addrs =
        a.ns.exec_ok(&["ip", "-6", "-j", "addr", "show", "dev", "eth0"]);
    let addrs: Value = serde_json::from_slice(&addrs.stdout).expect("json");
    let info = addrs[0]["addr_info"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        info.iter()
            .any(|i| i["local"] == v6a.as_str() && i["prefixlen"] == 128),
        "{addrs}"
    );
    assert!(!info.iter().any(|i| i["tentative"] == true), "{addrs}");
    let r6 =
        a.ns.exec_ok(&["ip", "-6", "-j", "route", "show", "default"]);
    let r6: Value = serde_json::from_slice(&r6.stdout).expect("json");
    assert_eq!(r6[0]["gateway"], "fe80::ecee:eeff:feee:eeee", "{r6}");
    // Host side: proxy_ndp, /128 route.
    let h = a.host_ifname();
    let ndp = node
        .ns
        .exec_ok(&["cat", &format!("/proc/sys/net/ipv6/conf/{h}/proxy_ndp")]);
    assert_eq!(String::from_utf8_lossy(&ndp.stdout).trim(), "1");
    let v6on = node
        .ns
        .exec_ok(&["cat", &format!("/proc/sys/net/ipv6/conf/{h}/disable_ipv6")]);
    assert_eq!(String::from_utf8_lossy(&v6on.stdout).trim(), "0");
    let hr = node
        .ns
        .exec_ok(&["ip", "-6", "-j", "route", "show", &format!("{v6a}/128")]);
    assert!(String::from_utf8_lossy(&hr.stdout).contains(&h));
    assert!(a.ns.ping(&v6b, 3), "pod a cannot ping6 pod b");
    assert!(b.ns.ping(&ia[0], 2), "v4 still works");
    assert!(a.check().success);
}

#[test]
fn dual_stack_is_all_or_nothing() {
    // IPv6 pool with room for exactly one pod (fd00:20::, its Subnet-Router anycast address, is
    // reserved).
    let node = Node::start_with_config(
        Dataplane::under_test(),
        Some("[[pools]]\ncidr = \"10.244.0.0/16\"\n[[pools]]\ncidr = \"fd00:20::/127\"\nblockSize = 128\n"),
    );
    let extra = json!({"ipam": {"type": "calix-ipam", "assign_ipv6": true}});
    let _a = Pod::add_with(&node, "a", extra.clone());
    assert_eq!(node.allocated(), 2);
    let b = Pod::try_add(&node, "b", extra);
    assert!(!b.result.success);
    assert!(msg(&b.result).contains("IPv6"), "{:?}", b.result);
    assert_eq!(
        node.allocated(),
        2,
        "the IPv4 half of the failed ADD was not released"
    );
    assert_eq!(node.cali_links().len(), 1);
}

#[test]
fn delegated_host_local_ipam() {
    let node = Node::start(Dataplane::under_test());
    let data = node.dir.join("host-local");
    let extra = json!({"ipam": {"type": "host-local", "subnet": "10.77.0.0/24", "dataDir": data.display().to_string()}});
    let mut a = Pod::add_with(&node, "a", extra.clone());
    let b = Pod::add_with(&node, "b", extra.clone());
    assert!(a.ip().starts_with("10.77.0."), "{}", a.ip());
    assert_eq!(node.allocated(), 0, "calix-ipam must not be used");
    // host-local records each reservation as a file named after the address.
    let reserved = |ip: &str| data.join("calix-test").join(ip).exists();
    assert!(reserved(&a.ip()));
    assert!(a.ns.ping(&b.ip(), 2));
    assert!(a.check().success, "{:?}", a.check());
    let ip_a = a.ip();
    a.del();
    assert!(!reserved(&ip_a), "DEL was not delegated to host-local");
    assert!(reserved(&b.ip()));
}

#[test]
fn runtime_config_static_ip_mac_and_ip_forwarding() {
    let node = Node::start(Dataplane::under_test());
    let extra = json!({
        "runtimeConfig": {"ips": ["10.244.9.9/32"], "mac": "02:ca:11:00:00:09"},
        "container_settings": {"allow_ip_forwarding": true},
    });
    let a = Pod::add_with(&node, "a", extra);
    assert_eq!(a.ip(), "10.244.9.9");
    let mac = a.ns.exec_ok(&["cat", "/sys/class/net/eth0/address"]);
    assert_eq!(
        String::from_utf8_lossy(&mac.stdout).trim(),
        "02:ca:11:00:00:09"
    );
    assert_eq!(
        a.result
            .json
            .as_ref()
            .map(|j| j["interfaces"][1]["mac"].clone()),
        Some(json!("02:ca:11:00:00:09"))
    );
    let fwd = a.ns.exec_ok(&["cat", "/proc/sys/net/ipv4/ip_forward"]);
    assert_eq!(String::from_utf8_lossy(&fwd.stdout).trim(), "1");
    // The same static address for another pod: refused, nothing left behind.
    let b = Pod::try_add(
        &node,
        "b",
        json!({"runtimeConfig": {"ips": ["10.244.9.9"]}}),
    );
    assert!(!b.result.success);
    assert!(msg(&b.result).contains("in use"), "{:?}", b.result);
    assert_eq!(node.allocated(), 1);
    assert_eq!(node.cali_links().len(), 1);
}

#[test]
fn route_clash_rolls_back() {
    let node = Node::start(Dataplane::under_test());
    // Someone else already routes the address this pod asks for.
    node.ns
        .exec_ok(&["ip", "route", "add", "unreachable", "10.244.7.7/32"]);
    let p = Pod::try_add(
        &node,
        "a",
        json!({"runtimeConfig": {"ips": ["10.244.7.7"]}}),
    );
    assert!(!p.result.success);
    assert_eq!(p.result.code(), Some(101), "{:?}", p.result);
    assert_eq!(node.allocated(), 0);
    assert!(node.cali_links().is_empty());
    assert!(!p.ns.links().iter().any(|l| l == "eth0"));
    let routes = node.ns.exec_ok(&["ip", "route", "show", "10.244.7.7/32"]);
    assert!(
        String::from_utf8_lossy(&routes.stdout).contains("unreachable"),
        "rollback touched a foreign route"
    );
}

#[test]
fn add_of_an_existing_attachment_fails_and_harms_nothing() {
    let node = Node::start(Dataplane::under_test());
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    let again = a.call("ADD", Value::Null);
    assert!(!again.success);
    assert!(msg(&again).contains("already"), "{again:?}");
    assert!(a.ns.ping(&b.ip(), 1), "the original pod lost its network");
    assert_eq!(node.allocated(), 2);
    assert!(a.check().success);
}

#[test]
fn chained_with_portmap_bandwidth_and_tuning() {
    let node = Node::start(Dataplane::under_test());
    let list = ConfList {
        list: json!({
            "cniVersion": "1.0.0",
            "name": "calix-test",
            "plugins": [
                {"type": "calix", "agent_socket": node.socket.display().to_string()},
                {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true},
                {"type": "bandwidth", "ingressRate": 100_000_000, "ingressBurst": 1_000_000},
                {"type": "tuning", "sysctl": {"net.core.somaxconn": "511"}}
            ]
        }),
    };
    let pod = Netns::new("p");
    let cid = format!("{}c", pod.name);
    let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web";
    let rc =
        json!({"portMappings": [{"hostPort": 18080, "containerPort": 8080, "protocol": "tcp"}]});
    let result = list
        .add(&node, &cid, &pod.path(), args, &rc)
        .unwrap_or_else(|o| panic!("chained ADD failed: {o:?}\n{}", node.agent_log()));
    let ip = result["ips"][0]["address"]
        .as_str()
        .unwrap_or_default()
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    assert!(ip.starts_with("10.244."), "{result}");
    // tuning ran in the pod; bandwidth put a qdisc on the host veth.
    let som = pod.exec_ok(&["cat", "/proc/sys/net/core/somaxconn"]);
    assert_eq!(String::from_utf8_lossy(&som.stdout).trim(), "511");
    let host_if = result["interfaces"][0]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let q = node.ns.exec_ok(&["tc", "qdisc", "show", "dev", &host_if]);
    assert!(
        String::from_utf8_lossy(&q.stdout).contains("tbf"),
        "{}",
        String::from_utf8_lossy(&q.stdout)
    );
    // A hostPort reaches the pod through portmap: a server in the pod, a client in another pod.
    let mut server = pod
        .cmd(&["python3", "-c", "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',8080));s.listen(1);c,_=s.accept();c.sendall(b'calix-hostport');c.close()"])
        .spawn()
        .expect("server");
    let client = Pod::add(&node, "client");
    let mut got = String::new();
    for _ in 0..50 {
        let out = client.ns.exec(&["python3", "-c", &format!("import socket;s=socket.create_connection(('{}',18080),timeout=2);print(s.recv(64).decode())", node.node_ip)]);
        got = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if got == "calix-hostport" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(got, "calix-hostport", "hostPort did not reach the pod");
    // calix's CHECK against the final result of the whole chain. (Debian's portmap 1.1.1 fails
    // its own CHECK on a v4-only result: it looks for an IPv6 chain it never created.)
    let check_conf = {
        let mut c = node.conf(json!({"prevResult": result.clone()}));
        c["cniVersion"] = json!("1.0.0");
        c
    };
    let out = node.cni("CHECK", &cid, &pod.path(), args, &check_conf);
    assert!(
        out.success,
        "calix CHECK on the chained result failed: {out:?}"
    );
    // DEL through the whole chain, in reverse.
    list.run_reverse(&node, "DEL", &cid, &pod.path(), args, &rc, Some(&result))
        .unwrap_or_else(|o| panic!("chained DEL failed: {o:?}"));
    assert!(!node.cali_links().contains(&host_if));
    assert_eq!(
        node.allocated(),
        1,
        "only the client pod should hold an address"
    );
    let nat = node.ns.exec_ok(&["iptables-save", "-t", "nat"]);
    assert!(
        !String::from_utf8_lossy(&nat.stdout).contains("18080"),
        "portmap rules left"
    );
}

#[test]
fn fifty_concurrent_adds_get_distinct_addresses_and_del_races_safely() {
    let node = Node::start(Dataplane::under_test());
    let first = Pod::add(&node, "first");
    let pods: Vec<Pod> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..50)
            .map(|i| {
                let node = &node;
                s.spawn(move || Pod::try_add(node, &format!("c{i}"), Value::Null))
            })
            .collect();
        // A DEL of another pod racing the ADDs.
        let mut first = first;
        first.del();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let failed: Vec<_> = pods
        .iter()
        .filter(|p| !p.result.success)
        .map(|p| p.result.stdout.clone())
        .collect();
    assert!(
        failed.is_empty(),
        "{} ADDs failed: {failed:?}",
        failed.len()
    );
    let ips: HashSet<String> = pods.iter().map(Pod::ip).collect();
    assert_eq!(ips.len(), 50, "duplicate addresses");
    assert_eq!(node.allocated(), 50);
    assert_eq!(node.cali_links().len(), 50);
    assert!(pods[0].ns.ping(&pods[49].ip(), 1));
    drop(pods);
    assert_eq!(node.allocated(), 0);
    assert!(node.cali_links().is_empty());
}

#[test]
fn del_never_takes_another_attachments_veth() {
    let node = Node::start(Dataplane::under_test());
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    // A late DEL of an older sandbox of the same pod (same namespace/name, so the same derived
    // veth name) but another container ID: a's veth must survive, and so must its address.
    let stale_cid = format!("{}old", a.container_id);
    let out = node.cni("DEL", &stale_cid, "", &a.cni_args, &node.conf(Value::Null));
    assert!(out.success, "{out:?}");
    assert!(
        node.cali_links().contains(&a.host_ifname()),
        "DEL of another container took a's veth"
    );
    assert!(a.ns.ping(&b.ip(), 1));
    assert_eq!(node.allocated(), 2);
    // The veth carries its owner.
    let alias = node.ns.exec_ok(&[
        "cat",
        &format!("/sys/class/net/{}/ifalias", a.host_ifname()),
    ]);
    assert_eq!(
        String::from_utf8_lossy(&alias.stdout).trim(),
        format!("calix:{}/eth0", a.container_id)
    );
}
