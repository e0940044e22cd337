//! Two pods on one node talking through the calix CNI plugin, in both dataplanes; counters;
//! DEL idempotency; rollback of a failed ADD; clear errors; a new pod answering its node's
//! first ping at once. Run as root.
use calix_testbed::{bpf_map_u32_keys, bpf_maps_of, cni_call, Dataplane, Netns, Node, Pod};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn endpoint<'a>(eps: &'a Value, host_if: &str) -> &'a Value {
    eps["endpoints"]
        .as_array()
        .and_then(|a| a.iter().find(|e| e["hostInterface"] == host_if))
        .unwrap_or_else(|| panic!("endpoint {host_if} not listed in {eps}"))
}

fn two_pods_talk(dp: Dataplane) {
    let node = Node::start(dp);
    let mut a = Pod::add(&node, "a");
    let mut b = Pod::add(&node, "b");
    let (ip_a, ip_b) = (a.ip(), b.ip());
    assert_ne!(ip_a, ip_b);
    for ip in [&ip_a, &ip_b] {
        assert!(ip.starts_with("10.244."), "{ip} is not from the pool");
    }
    // Wiring: /32 in the pod, default via 169.254.1.1, host /32 route to the veth.
    let routes = a.ns.routes();
    assert!(
        routes
            .iter()
            .any(|r| r["dst"] == "default" && r["gateway"] == "169.254.1.1"),
        "{routes:?}"
    );
    let host_routes = node.ns.routes();
    assert!(
        host_routes
            .iter()
            .any(|r| r["dst"] == ip_a.as_str() && r["dev"] == a.host_ifname().as_str()),
        "no host route to {ip_a}: {host_routes:?}"
    );
    assert_eq!(a.host_ifname().len(), 15);
    // IPv4-only pod: no IPv6 on the host veth (no N identical link-locals).
    let v6off = node.ns.exec_ok(&[
        "cat",
        &format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", a.host_ifname()),
    ]);
    assert_eq!(String::from_utf8_lossy(&v6off.stdout).trim(), "1");
    assert!(a.host_ifname().starts_with("cali"));

    assert!(a.ns.ping(&ip_b, 3), "pod a cannot ping pod b");
    assert!(b.ns.ping(&ip_a, 3), "pod b cannot ping pod a");
    assert!(a.ns.ping(&node.node_ip, 2), "pod a cannot ping the node");

    let eps = node.endpoints();
    assert_eq!(eps["endpoints"].as_array().map(Vec::len), Some(2));
    for p in [&a, &b] {
        let e = endpoint(&eps, &p.host_ifname());
        assert_eq!(e["addresses"][0], format!("{}/32", p.ip()));
        match dp {
            Dataplane::Ebpf => {
                assert_eq!(e["bpfAttached"], true);
                let c = &e["counters"];
                for k in [
                    "fromPodPackets",
                    "toPodPackets",
                    "fromPodBytes",
                    "toPodBytes",
                ] {
                    assert!(
                        c[k].as_u64().unwrap_or(0) > 0,
                        "{k} did not rise for {}: {e}",
                        p.host_ifname()
                    );
                }
                // 3 pings each way + 2 to the node: at least 5 echo requests left pod a.
            }
            Dataplane::Kernel => {
                assert_eq!(e["bpfAttached"], false);
                assert!(e["counters"].is_null());
            }
        }
    }
    if dp == Dataplane::Ebpf {
        let ea = endpoint(&eps, &a.host_ifname());
        assert!(
            ea["counters"]["fromPodPackets"].as_u64().unwrap_or(0) >= 5,
            "{ea}"
        );
    }

    // The endpoint table holds one entry per endpoint, keyed by the host ifindex.
    let maps = node
        .agent_pid()
        .map(|pid| bpf_maps_of(pid, "CALIX_ENDPOINTS"))
        .unwrap_or_default();
    if dp == Dataplane::Ebpf {
        assert_eq!(
            maps.len(),
            1,
            "the agent should hold exactly one endpoint table"
        );
        assert_eq!(bpf_map_u32_keys(maps[0]).len(), 2);
    } else {
        assert!(maps.is_empty(), "kernel mode must load no BPF");
    }

    a.del();
    b.del();
    let eps = node.endpoints();
    assert_eq!(eps["endpoints"].as_array().map(Vec::len), Some(0), "{eps}");
    if dp == Dataplane::Ebpf {
        assert!(
            bpf_map_u32_keys(maps[0]).is_empty(),
            "endpoint entries left after DEL"
        );
    }
    assert!(
        node.cali_links().is_empty(),
        "veths left: {:?}",
        node.cali_links()
    );
    assert_eq!(node.allocated(), 0, "addresses left allocated");
    assert!(!node
        .ns
        .routes()
        .iter()
        .any(|r| r["dst"].as_str().is_some_and(|d| d.starts_with("10.244."))));
}

#[test]
fn two_pods_talk_ebpf() {
    two_pods_talk(Dataplane::Ebpf);
}

#[test]
fn two_pods_talk_kernel() {
    two_pods_talk(Dataplane::Kernel);
}

/// A pod answers as soon as ADD returns (issue 20, item 9): ADD waits until both ends of the
/// veth are operational. Before, the end brought up first (the pod's) could still have the
/// kernel's noop queue on a busy machine, which dropped the pod's first ARP reply to the node
/// (`QDISC_DROP` in `__dev_queue_xmit`), and the node asked again a second later: in 14 of 80
/// ADDs under load the first ping took 1.0-1.1 s. Each of 30 new pods here answers its
/// node's first ping well within the node's ARP retransmission time (1 s); on an idle
/// machine this passed before the fix too.
#[test]
fn a_new_pod_answers_its_nodes_first_ping_at_once() {
    use calix_testbed::traffic::probe::{first_replies, Pinger};
    let node = Node::start(Dataplane::Kernel);
    for i in 0..30 {
        let p = Pod::add(&node, &format!("p{i}"));
        let t = Instant::now();
        let mut pinger = Pinger::open(&node.ns).expect("pinger");
        let to = p.ip().parse().expect("IPv4 address");
        let got = first_replies(
            &mut [(&mut pinger, to)],
            Duration::from_millis(5),
            Duration::from_secs(3),
        )
        .expect("probe");
        let took = got[0].map(|at| at - t);
        assert!(
            took.is_some_and(|d| d < Duration::from_millis(500)),
            "pod {i}: first reply after {took:?}\n{}",
            String::from_utf8_lossy(
                &node
                    .ns
                    .exec_ok(&["ip", "-s", "neigh", "show", "dev", &p.host_ifname()])
                    .stdout
            )
        );
    }
}

#[test]
fn del_is_idempotent_and_survives_missing_netns() {
    let node = Node::start(Dataplane::Ebpf);
    let mut a = Pod::add(&node, "a");
    a.del();
    a.del();
    // DEL with the netns already gone still releases the address and removes the veth.
    let mut b = Pod::add(&node, "b");
    assert_eq!(node.allocated(), 1);
    // The netns is deleted first (the kernel removes the veth with it); DEL still succeeds.
    b.ns.exec_ok(&["true"]);
    calix_testbed::run_ok(std::process::Command::new("ip").args(["netns", "del", &b.ns.name]));
    b.del();
    // containerd's second DEL: no netns at all.
    let out = node.cni(
        "DEL",
        &b.container_id,
        "",
        &b.cni_args,
        &node.conf(Value::Null),
    );
    assert!(out.success, "{out:?}");
    assert_eq!(node.allocated(), 0);
    assert!(node.cali_links().is_empty());
    assert_eq!(
        node.endpoints()["endpoints"].as_array().map(Vec::len),
        Some(0)
    );
}

#[test]
fn failed_add_leaves_nothing_behind() {
    let node = Node::start(Dataplane::Ebpf);
    let pod = Netns::new("p");
    let cid = format!("{}clash", pod.name);
    let args = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=clash";
    // Someone else already owns the host veth name calix will choose: ADD must fail, roll back,
    // and leave the other link alone.
    let name = format!("cali{}", &sha1_hex("default.clash")[..11]);
    node.ns.exec_ok(&[
        "ip", "link", "add", &name, "type", "veth", "peer", "name", "cxtpeer0",
    ]);
    let out = node.cni("ADD", &cid, &pod.path(), args, &node.conf(Value::Null));
    assert!(!out.success);
    assert_eq!(out.code(), Some(101), "{out:?}");
    assert!(
        out.json
            .as_ref()
            .is_some_and(|j| j["msg"].as_str().is_some_and(|m| m.contains(&name))),
        "{out:?}"
    );
    assert_eq!(node.allocated(), 0, "address not released on rollback");
    assert!(
        node.ns.links().contains(&name),
        "rollback deleted a link it did not create"
    );
    assert!(
        !pod.links().iter().any(|l| l == "eth0"),
        "eth0 left in the pod"
    );
    assert_eq!(
        node.endpoints()["endpoints"].as_array().map(Vec::len),
        Some(0)
    );

    // The pod's netns vanishing is another failure: code 4, nothing allocated.
    let out = node.cni(
        "ADD",
        &cid,
        "/run/netns/cxt-does-not-exist",
        args,
        &node.conf(Value::Null),
    );
    assert_eq!(out.code(), Some(4), "{out:?}");
    assert_eq!(node.allocated(), 0);
}

fn sha1_hex(s: &str) -> String {
    let out = std::process::Command::new("sha1sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            if let Some(mut i) = c.stdin.take() {
                i.write_all(s.as_bytes())?;
            }
            c.wait_with_output()
        })
        .expect("sha1sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn pool_exhausted_is_a_clear_error_and_rolls_back() {
    let node = Node::start_with_config(
        Dataplane::Kernel,
        Some("[[pools]]\ncidr = \"10.250.0.0/29\"\nblockSize = 30\n"),
    );
    // 8 addresses, less the pool's network and broadcast addresses.
    let pods: Vec<Pod> = (0..6).map(|i| Pod::add(&node, &format!("p{i}"))).collect();
    assert_eq!(node.allocated(), 6);
    let extra = Netns::new("p");
    let out = node.cni(
        "ADD",
        &format!("{}x", extra.name),
        &extra.path(),
        "",
        &node.conf(Value::Null),
    );
    assert!(!out.success);
    let msg = out
        .json
        .as_ref()
        .and_then(|j| j["msg"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(
        msg.contains("10.250.0.0/29") && msg.contains("full"),
        "{msg}"
    );
    assert_eq!(node.allocated(), 6);
    assert_eq!(node.cali_links().len(), 6);
    drop(pods);
    assert_eq!(node.allocated(), 0);
}

#[test]
fn agent_unreachable_is_code_11_quickly() {
    let node = Node::start(Dataplane::Kernel);
    node.stop_agent();
    let pod = Netns::new("p");
    let t = Instant::now();
    let out = node.cni(
        "ADD",
        &format!("{}x", pod.name),
        &pod.path(),
        "",
        &node.conf(Value::Null),
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(out.code(), Some(11), "{out:?}");
    assert!(out.json.as_ref().is_some_and(|j| j["msg"]
        .as_str()
        .is_some_and(|m| m.contains("not reachable"))));
    assert!(node.cali_links().is_empty());
}

#[test]
fn bad_input_gets_spec_errors() {
    let node = Node::start(Dataplane::Kernel);
    let pod = Netns::new("p");
    let cases: Vec<(&str, &str, String, u64)> = vec![
        ("ADD", "c1", "{not json".into(), 6),
        (
            "ADD",
            "c1",
            json!({"cniVersion": "1.0.0", "type": "calix"}).to_string(),
            7,
        ),
        (
            "ADD",
            "c1",
            node.conf(json!({"cniVersion": "9.9.9"})).to_string(),
            1,
        ),
        ("FROB", "c1", node.conf(Value::Null).to_string(), 4),
        ("ADD", "", node.conf(Value::Null).to_string(), 4),
    ];
    for (cmd, cid, stdin, code) in cases {
        let out = cni_call(&node.ns, cmd, cid, &pod.path(), "eth0", "", &stdin);
        assert!(!out.success, "{cmd} {stdin} succeeded");
        assert_eq!(out.code(), Some(code), "{cmd} {stdin}: {out:?}");
        assert!(
            !out.stdout.contains('\n') || out.json.is_some(),
            "stdout must hold only JSON"
        );
    }
    let v = cni_call(&node.ns, "VERSION", "", "", "", "", "{}");
    assert!(v.success);
    let versions = v
        .json
        .as_ref()
        .map(|j| j["supportedVersions"].clone())
        .unwrap_or_default();
    assert!(
        versions
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "1.1.0")),
        "{versions}"
    );
    assert_eq!(node.allocated(), 0);
}

#[test]
fn agent_sigterm_is_clean_and_restart_reprograms_endpoints() {
    let node = Node::start(Dataplane::Ebpf);
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    assert!(a.ns.ping(&b.ip(), 1));
    let pid = node.agent_pid().expect("agent pid");
    node.stop_agent();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "agent did not exit on SIGTERM"
    );
    assert!(!node.socket.exists(), "socket left after SIGTERM");
    assert!(
        node.agent_log().contains("stopped"),
        "no clean stop logged:\n{}",
        node.agent_log()
    );
    // With the agent gone its programs stay attached (and its maps pinned): traffic keeps
    // flowing, still by eBPF.
    let prog = node
        .filter_prog(&a.host_ifname(), "ingress")
        .expect("programs detached at SIGTERM");
    let show = node
        .ns
        .exec_ok(&["bpftool", "-j", "prog", "show", "id", &prog]);
    let info: serde_json::Value = serde_json::from_slice(&show.stdout).expect("bpftool json");
    assert_eq!(info["name"], "from_pod", "{info}");
    assert!(a.ns.ping(&b.ip(), 1));
    // A new agent reads its datastore and programs the recorded endpoints again.
    node.start_agent();
    let eps = node.endpoints();
    for p in [&a, &b] {
        let e = endpoint(&eps, &p.host_ifname());
        assert_eq!(e["bpfAttached"], true, "{e}");
    }
    assert!(a.ns.ping(&b.ip(), 2));
    let eps = node.endpoints();
    let c = &endpoint(&eps, &a.host_ifname())["counters"];
    assert!(c["fromPodPackets"].as_u64().unwrap_or(0) >= 2, "{c}");
}
