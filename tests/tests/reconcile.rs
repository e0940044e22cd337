//! The agent converges and repairs (issue 12): with `resync_interval_secs = 2`, what is
//! sabotaged on a node — a pod's host route, its proxy_arp, its tc program (a tcx link, or a
//! cls_bpf filter with `tc_attach = "tc"`), its endpoint map entry, the node's forwarding,
//! kernel mode's nftables table — is put back within 10 s,
//! counted in `calix_repairs_total{kind}`, and traffic recovers; a veth deleted by hand is reported, never re-created; an endpoint whose veth is
//! missing for a while is programmed once it is back; an idle node makes no netlink writes,
//! and nftables' ruleset generation, which spares an idle node's pass reading its tables,
//! moves with every change and not with a read.
//! Run as root, in both dataplane modes.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use calix_common::{direct_bucket, DirectEndpoint};
use calix_testbed::{bpf_maps_of, Dataplane, Node, Pod};
use serde_json::Value;

const CONFIG: &str = "resync_interval_secs = 2\n[[pools]]\ncidr = \"10.244.0.0/16\"\n";

/// The value of metric line `name` (with its labels) from /metrics; 0 when absent.
fn metric(node: &Node, name: &str) -> u64 {
    let (_, body) = node.http_get("/metrics").unwrap_or_default();
    let prefix = format!("{name} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// `calix_repairs_total{kind="<kind>"}`.
fn repairs(node: &Node, kind: &str) -> u64 {
    metric(node, &format!("calix_repairs_total{{kind=\"{kind}\"}}"))
}

/// Waits up to 10 s for `done`, polling.
fn within_10s(what: &str, node: &Node, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "not repaired within 10 s: {what}\nagent log:\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The endpoint on `host_if` in `calixctl endpoints -o json`.
fn endpoint(node: &Node, host_if: &str) -> Option<Value> {
    node.endpoints()["endpoints"]
        .as_array()?
        .iter()
        .find(|e| e["hostInterface"] == host_if)
        .cloned()
}

fn sysctl(node: &Node, path: &str) -> String {
    let out = node.ns.exec_ok(&["cat", path]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Hex bytes for `bpftool ... hex`.
fn hex(bytes: &[u8]) -> Vec<String> {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `bpftool map <op> id <map> key hex <key> [value hex <value>]`, which must succeed.
fn bpftool_map(op: &str, map: u64, key: &[u8], value: Option<&[u8]>) {
    let id = map.to_string();
    let mut args: Vec<String> = ["map", op, "id", &id, "key", "hex"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(hex(key));
    if let Some(v) = value {
        args.extend(["value".into(), "hex".into()]);
        args.extend(hex(v));
    }
    let out = Command::new("bpftool")
        .args(&args)
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `config_extra` is appended to the agent's config (e.g. `tc_attach`).
fn sabotage(dp: Dataplane, config_extra: &str) {
    let config = format!("{config_extra}\n{CONFIG}");
    let node = Node::start_with_config(dp, Some(&config));
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    let (b_if, b_ip) = (b.host_ifname(), b.ip());
    assert!(a.ns.ping(&b_ip, 1));
    assert!(node.ns.ping(&b_ip, 1));

    // The host route: the node reaches pod b through it.
    let route = format!("{b_ip}/32");
    node.ns.exec_ok(&["ip", "route", "del", &route]);
    assert!(!node.ns.ping(&b_ip, 1), "the route is really gone");
    within_10s("the host route", &node, || repairs(&node, "route") >= 1);
    let routes = node.ns.exec_ok(&["ip", "route", "show", &route]);
    assert!(
        String::from_utf8_lossy(&routes.stdout).contains(&format!("dev {b_if} proto 202")),
        "{}",
        String::from_utf8_lossy(&routes.stdout)
    );
    assert!(node.ns.ping(&b_ip, 2), "traffic from the node recovered");

    // proxy_arp.
    let knob = format!("/proc/sys/net/ipv4/conf/{b_if}/proxy_arp");
    node.ns.exec_ok(&["sh", "-c", &format!("echo 0 > {knob}")]);
    within_10s("proxy_arp", &node, || sysctl(&node, &knob) == "1");
    assert!(repairs(&node, "sysctl") >= 1);

    if dp == Dataplane::Ebpf {
        // The tc program: anti-spoofing and the fast path are gone until it is back. (With
        // tcx, once the agent has moved it from its first filter to its link.)
        if config_extra.is_empty() {
            within_10s("the program on its tcx link", &node, || {
                node.tcx_prog(&b_if, "ingress").is_some()
            });
        }
        node.detach_prog(&b_if, "ingress");
        assert_eq!(node.filter_prog(&b_if, "ingress"), None);
        within_10s("the tc program", &node, || {
            node.filter_prog(&b_if, "ingress").is_some()
        });
        assert!(repairs(&node, "tc_filter") >= 1);
        assert!(b.ns.ping(&a.ip(), 2), "traffic recovered");

        // The endpoint's entries, in the table and its direct-mapped bucket: b's packets
        // would pass unjudged without them.
        let ifindex = endpoint(&node, &b_if).expect("b listed")["hostIfindex"]
            .as_u64()
            .expect("ifindex") as u32;
        let pid = node.agent_pid().expect("pid");
        let table = bpf_maps_of(pid, "CALIX_ENDPOINTS")[0];
        let direct = bpf_maps_of(pid, "CALIX_EP_DIRECT")[0];
        bpftool_map("delete", table, &ifindex.to_le_bytes(), None);
        let free = [0u8; std::mem::size_of::<DirectEndpoint>()];
        let bucket = direct_bucket(ifindex).to_le_bytes();
        bpftool_map("update", direct, &bucket, Some(&free));
        within_10s("the endpoint map entry", &node, || {
            repairs(&node, "endpoint_map") >= 1
        });
        assert!(b.ns.ping(&a.ip(), 2), "traffic recovered");
    }

    // The node's forwarding: pods on this node reach each other through it (kernel mode) and
    // the node through the stack (both modes).
    node.ns
        .exec_ok(&["sh", "-c", "echo 0 > /proc/sys/net/ipv4/ip_forward"]);
    within_10s("ip_forward", &node, || {
        sysctl(&node, "/proc/sys/net/ipv4/ip_forward") == "1"
    });
    assert!(a.ns.ping(&b.ip(), 2), "traffic recovered");

    if dp == Dataplane::Kernel {
        // A firewall's restart: every nftables table gone, calix's anti-spoofing with them.
        node.ns.exec_ok(&["nft", "flush", "ruleset"]);
        within_10s("the anti-spoofing table", &node, || {
            repairs(&node, "nft_table") >= 1
        });
        let out = node
            .ns
            .exec_ok(&["nft", "list", "table", "inet", "calix_antispoof"]);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("fib saddr . iif oif missing"),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(a.ns.ping(&b.ip(), 2), "traffic recovered");
    }

    // Every endpoint is in its desired state now.
    for p in [&a, &b] {
        assert_eq!(
            endpoint(&node, &p.host_ifname()).expect("listed")["state"],
            "ok"
        );
    }

    // The veth deleted by hand: reported, not re-created.
    node.ns.exec_ok(&["ip", "link", "del", &b_if]);
    within_10s("the missing veth reported", &node, || {
        endpoint(&node, &b_if).is_some_and(|e| e["state"] == "interface missing")
    });
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !node.cali_links().contains(&b_if),
        "the reconciler re-created a pod's veth"
    );
    assert!(a.ns.ping(&node.node_ip, 1), "the other pod is unaffected");
    let table = node.calixctl(&["endpoints"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("interface missing"), "{text}");
    assert!(text.contains("not in their desired state"), "{text}");
}

#[test]
fn sabotage_is_repaired_in_ebpf_mode() {
    sabotage(Dataplane::Ebpf, "");
}

#[test]
fn sabotage_is_repaired_in_ebpf_mode_with_cls_bpf_filters() {
    sabotage(Dataplane::Ebpf, "tc_attach = \"tc\"");
}

#[test]
fn sabotage_is_repaired_in_kernel_mode() {
    sabotage(Dataplane::Kernel, "");
}

#[test]
fn an_endpoint_whose_veth_was_missing_is_programmed_once_it_is_back() {
    let node = Node::start_with_config(Dataplane::Ebpf, Some(CONFIG));
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    let a_if = a.host_ifname();
    // The agent restarts while a's veth is away (renamed).
    node.stop_agent();
    node.ns
        .exec_ok(&["ip", "link", "set", "dev", &a_if, "down"]);
    node.ns
        .exec_ok(&["ip", "link", "set", "dev", &a_if, "name", "cxtaway0"]);
    node.start_agent();
    within_10s("the failure reported", &node, || {
        endpoint(&node, &a_if).is_some_and(|e| e["state"] != "ok")
    });
    // Back under its name (still down): the retries program it and bring it up.
    node.ns
        .exec_ok(&["ip", "link", "set", "dev", "cxtaway0", "name", &a_if]);
    within_10s("the endpoint programmed again", &node, || {
        endpoint(&node, &a_if).is_some_and(|e| e["state"] == "ok")
    });
    assert!(node.filter_prog(&a_if, "ingress").is_some());
    assert!(repairs(&node, "link_up") >= 1);
    assert!(a.ns.ping(&b.ip(), 2), "traffic works again");
}

#[test]
fn an_idle_node_makes_no_netlink_writes_across_ten_resyncs() {
    let node = Node::start_with_config(Dataplane::Ebpf, Some(CONFIG));
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    assert!(a.ns.ping(&b.ip(), 1));
    // Let the first passes settle, then watch routes, links, addresses and tc for ten resyncs.
    std::thread::sleep(Duration::from_secs(3));
    let watch = |argv: &[&str]| {
        node.ns
            .cmd(argv)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("monitor")
    };
    let before = metric(&node, "calix_resyncs_total");
    let ip = watch(&[
        "timeout", "23", "ip", "-o", "monitor", "route", "link", "address",
    ]);
    let tc = watch(&["timeout", "23", "tc", "monitor"]);
    let nft = watch(&["timeout", "23", "nft", "monitor"]);
    let seen: String = [ip, tc, nft]
        .into_iter()
        .map(|m| {
            String::from_utf8_lossy(&m.wait_with_output().expect("monitor").stdout).into_owned()
        })
        .collect();
    assert!(seen.trim().is_empty(), "writes while idle:\n{seen}");
    let passes = metric(&node, "calix_resyncs_total") - before;
    assert!(passes >= 10, "only {passes} resyncs while watching");
    for kind in [
        "route",
        "sysctl",
        "tc_filter",
        "endpoint_map",
        "link_up",
        "nft_table",
    ] {
        assert_eq!(repairs(&node, kind), 0, "{kind}");
    }
}

/// nftables' ruleset generation (what the agent asks before it lists its tables) moves with
/// every committed change of the namespace, and not with a listing.
#[test]
fn the_nftables_generation_moves_with_changes_not_with_listings() {
    let ns = calix_testbed::Netns::new("g");
    let generation = || {
        ns.run(calix_kernel::nft::generation)
            .expect("the generation")
    };
    let g0 = generation();
    ns.exec_ok(&["nft", "list", "ruleset"]);
    ns.exec_ok(&["nft", "-s", "list", "tables"]);
    assert_eq!(generation(), g0, "a listing moved it");
    ns.exec_ok(&["nft", "add", "table", "ip", "cxt_generation"]);
    let g1 = generation();
    assert_ne!(g1, g0, "a new table did not move it");
    ns.exec_ok(&["nft", "flush", "ruleset"]);
    assert_ne!(generation(), g1, "a flush did not move it");
}

/// The ifindex of `ifname` in `node`.
fn ifindex(node: &Node, ifname: &str) -> u32 {
    let out = node
        .ns
        .exec_ok(&["cat", &format!("/sys/class/net/{ifname}/ifindex")]);
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("an ifindex")
}

/// Endpoint records are desired state only for interfaces that carry calix's mark: a record in
/// the datastore (written by whoever holds its credentials) naming the node's uplink, or a
/// `cali…` link whose owner alias names another endpoint, is never programmed — no route, no
/// setting, no program, no map entry on it — and is reported; the node's real pod is not
/// disturbed.
fn forged_records_program_nothing(dp: Dataplane) {
    use calix_core::model::EndpointRecord;
    use calix_core::store::keys;
    use calix_datastore::{Datastore, Durability, EmbeddedStore, Op};
    let node = Node::start_with_config(dp, Some(CONFIG));
    let pod = Pod::add(&node, "a");
    // The node's "uplink", and a cali link another endpoint owns (its alias says so).
    node.ns.ip_batch(
        "link add eth9 type veth peer name eth9p\nlink set eth9 up\naddr add 192.0.2.9/24 dev eth9\n\
         link add cali0forged0000 type veth peer name cxtforgedp\nlink set cali0forged0000 up\n\
         link set cali0forged0000 alias calix:someone-else/eth0\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let (uplink, impostor) = ("eth9", "cali0forged0000");
    let sysctls = |ifname: &str| {
        [
            format!("/proc/sys/net/ipv4/conf/{ifname}/proxy_arp"),
            format!("/proc/sys/net/ipv4/neigh/{ifname}/proxy_delay"),
            format!("/proc/sys/net/ipv6/conf/{ifname}/accept_ra"),
            format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6"),
            format!("/proc/sys/net/ipv4/conf/{ifname}/rp_filter"),
        ]
        .map(|p| (p.clone(), sysctl(&node, &p)))
    };
    let before = [sysctls(uplink), sysctls(impostor)];
    node.stop_agent();
    let store = EmbeddedStore::open(&node.dir.join("store.json")).expect("the node's store");
    let forged = |cid: &str, host_ifname: &str, addr: &str| EndpointRecord {
        container_id: cid.into(),
        ifname: "eth0".into(),
        host_ifname: host_ifname.into(),
        netns: String::new(),
        pod_namespace: String::new(),
        pod_name: String::new(),
        pod_uid: String::new(),
        addresses: vec![addr.into()],
        handle: format!("k8s-pod-network:{cid}"),
        mac: "02:00:00:00:00:09".into(),
        host_ifindex: ifindex(&node, host_ifname),
    };
    let records = [
        forged("forged1", uplink, "10.244.9.9/32"),
        forged("forged2", impostor, "10.244.9.10/32"),
    ];
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            for r in &records {
                let key = keys::endpoint(&node.agent().name, &r.container_id, &r.ifname);
                store
                    .txn(&[], &[Op::put_json(key, r)], Durability::Process)
                    .await
                    .expect("write the forged record");
            }
        });
    drop(store);
    node.start_agent();
    within_10s("the forged records reported", &node, || {
        [uplink, impostor].iter().all(|i| {
            endpoint(&node, i).is_some_and(|e| {
                e["state"]
                    .as_str()
                    .is_some_and(|s| s.contains("not calix's"))
            })
        })
    });
    // Two more resyncs (2 s each): still nothing on them.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!([sysctls(uplink), sysctls(impostor)], before);
    for (ifname, addr) in [(uplink, "10.244.9.9/32"), (impostor, "10.244.9.10/32")] {
        let routes = node.ns.exec_ok(&["ip", "route", "show", addr]);
        assert!(
            routes.stdout.is_empty(),
            "{addr}: {}",
            String::from_utf8_lossy(&routes.stdout)
        );
        if dp == Dataplane::Ebpf {
            for dir in ["ingress", "egress"] {
                assert_eq!(node.filter_prog(ifname, dir), None, "{ifname} {dir}");
                assert_eq!(node.tcx_prog(ifname, dir), None, "{ifname} {dir}");
            }
            let pid = node.agent_pid().expect("pid");
            let table = bpf_maps_of(pid, "CALIX_ENDPOINTS")[0];
            let keys = calix_testbed::bpf_map_u32_keys(table);
            assert!(
                !keys.contains(&ifindex(&node, ifname)),
                "{ifname} in {keys:?}"
            );
        }
    }
    let log = node.agent_log();
    assert!(
        log.lines()
            .any(|l| l.contains("not calix's") && l.contains(uplink)),
        "{log}"
    );
    // The real pod: programmed, reachable.
    assert_eq!(
        endpoint(&node, &pod.host_ifname()).expect("listed")["state"],
        "ok"
    );
    assert!(node.ns.ping(&pod.ip(), 2));
}

#[test]
fn forged_endpoint_records_program_nothing_in_ebpf_mode() {
    forged_records_program_nothing(Dataplane::Ebpf);
}

#[test]
fn forged_endpoint_records_program_nothing_in_kernel_mode() {
    forged_records_program_nothing(Dataplane::Kernel);
}
