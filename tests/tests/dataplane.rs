//! The eBPF dataplane (issue 5): host-stack bypass, anti-spoofing with counted drop reasons,
//! /metrics, flows that survive the agent crashing and restarting, and churn that leaves
//! nothing behind. Run as root.
use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use calix_testbed::{bpf_map_dump, bpf_maps_of, Dataplane, Guarded, Node, Pod};
use serde_json::Value;

/// `nstat -az IpForwDatagrams` inside `node`: packets the node's IP stack forwarded.
fn forwarded(node: &Node) -> u64 {
    let out = node.ns.exec_ok(&["nstat", "-az", "-j", "IpForwDatagrams"]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("nstat json");
    v["kernel"]["IpForwDatagrams"].as_u64().unwrap_or(0)
}

/// GET /metrics from inside the node namespace (the agent listens on its loopback).
fn metrics(node: &Node) -> String {
    node.http_get("/metrics")
        .map(|(_, body)| body)
        .unwrap_or_default()
}

fn bypass(dp: Dataplane) -> (u64, bool) {
    let node = Node::start(dp);
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    assert!(a.ns.ping(&b.ip(), 1), "warm-up ping");
    let before = forwarded(&node);
    assert!(a.ns.ping(&b.ip(), 10));
    (forwarded(&node) - before, true)
}

#[test]
fn ebpf_pod_traffic_bypasses_the_host_ip_stack_and_kernel_mode_does_not() {
    let (ebpf, _) = bypass(Dataplane::Ebpf);
    let (kernel, _) = bypass(Dataplane::Kernel);
    // 10 echo requests + 10 replies: the kernel forwards all 20, eBPF none.
    assert!(kernel >= 20, "kernel mode forwarded only {kernel}");
    assert_eq!(ebpf, 0, "eBPF mode still went through IP forwarding");
}

#[test]
fn a_spoofed_source_is_dropped_and_counted_with_its_reason() {
    let node = Node::start(Dataplane::Ebpf);
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    let host_a = a.host_ifname();
    assert_eq!(node.dropped(&host_a, "spoofed_source_v4"), 0);
    // Pod a claims an address that is not its own and sends from it.
    a.ns.exec_ok(&["ip", "addr", "add", "10.244.250.250/32", "dev", "eth0"]);
    let spoofed = a.ns.exec(&[
        "ping",
        "-c",
        "3",
        "-i",
        "0.2",
        "-W",
        "1",
        "-q",
        "-I",
        "10.244.250.250",
        &b.ip(),
    ]);
    assert!(!spoofed.status.success(), "spoofed pings got answers");
    assert!(
        node.dropped(&host_a, "spoofed_source_v4") >= 3,
        "{}",
        node.drops()
    );
    // The pod's own address still works, and nothing is counted for pod b.
    assert!(a.ns.ping(&b.ip(), 2));
    assert_eq!(node.dropped(&b.host_ifname(), "spoofed_source_v4"), 0);
    // The table names the reason; /metrics exports it.
    let table = node.calixctl(&["bpf", "counters"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("spoofed_source_v4") && text.contains(&host_a),
        "{text}"
    );
    let m = metrics(&node);
    let line = format!("calix_drops_total{{interface=\"{host_a}\",reason=\"spoofed_source_v4\"}}");
    assert!(m.contains(&line), "{line} missing from /metrics:\n{m}");
    assert!(m.contains("calix_endpoint_packets_total"), "{m}");
    assert!(
        m.contains("calix_ipam_free_addresses{family=\"ipv4\"}"),
        "{m}"
    );
}

/// Parses iperf3 --json output: (bytes per interval, error if any).
fn iperf_intervals(out: &[u8]) -> (Vec<(f64, u64)>, Option<String>) {
    let v: Value = serde_json::from_slice(out).unwrap_or(Value::Null);
    let ints = v["intervals"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| {
                    (
                        i["sum"]["start"].as_f64().unwrap_or(0.0),
                        i["sum"]["bytes"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    (ints, v["error"].as_str().map(String::from))
}

fn filter_prog_id(node: &Node, iface: &str) -> String {
    node.filter_prog(iface, "ingress")
        .unwrap_or_else(|| panic!("no calix filter on {iface}"))
}

#[test]
fn a_flow_runs_across_agent_kill_and_restart_without_a_gap() {
    let node = Node::start(Dataplane::Ebpf);
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    let server =
        b.ns.cmd(&["iperf3", "-s", "-1", "-B", &b.ip()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("iperf3 server");
    let mut server = Guarded(server);
    std::thread::sleep(Duration::from_millis(300));
    let client =
        a.ns.cmd(&[
            "iperf3",
            "-c",
            &b.ip(),
            "-t",
            "6",
            "-i",
            "0.1",
            "-C",
            "cubic",
            "-b",
            "200M",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("iperf3 client");
    let prog_before = filter_prog_id(&node, &a.host_ifname());
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    // A crash...
    node.kill_agent();
    std::thread::sleep(Duration::from_millis(500));
    // ...and a restart: the new agent loads its programs again and swaps them in place.
    node.start_agent();
    let restarted_at = t0.elapsed();
    std::thread::sleep(Duration::from_millis(1000));
    // An upgrade: stop, then start with a different build of the programs.
    let upgrade = calix_testbed::upgrade_test_object();
    node.stop_agent();
    node.start_agent_with(&["--bpf-object", &upgrade.display().to_string()]);
    let out = client.wait_with_output().expect("iperf3 client");
    let _ = server.0.wait();
    let (ints, err) = iperf_intervals(&out.stdout);
    assert!(
        out.status.success() && err.is_none(),
        "iperf3 failed across the restarts ({err:?}): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ints.len() >= 50, "too few intervals: {}", ints.len());
    let empty: Vec<&(f64, u64)> = ints.iter().filter(|(_, b)| *b == 0).collect();
    assert!(
        empty.is_empty(),
        "100 ms intervals without traffic (restart at {restarted_at:?}): {empty:?}"
    );
    let prog_after = filter_prog_id(&node, &a.host_ifname());
    assert_ne!(
        prog_before, prog_after,
        "the restarted agent did not replace the program"
    );
    // The upgraded build's programs run (they count each packet a pod sends under the
    // marker reason, without dropping it): the iperf3 flow and these pings went through them.
    let before = forwarded(&node);
    assert!(a.ns.ping(&b.ip(), 3));
    assert_eq!(
        forwarded(&node) - before,
        0,
        "no longer bypassing after the upgrade"
    );
    let marked = node.dropped(&a.host_ifname(), "reason_255");
    assert!(
        marked >= 3,
        "the upgraded programs are not the ones running: {}",
        node.drops()
    );
}

/// Resident memory (kB) and open file descriptors of a process.
fn rss_and_fds(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    (rss, fds)
}

fn map_entries(pid: u32, name: &str) -> usize {
    bpf_maps_of(pid, name)
        .into_iter()
        .map(|id| {
            let out = Command::new("bpftool")
                .args(["map", "dump", "id", &id.to_string(), "-j"])
                .output()
                .expect("bpftool");
            serde_json::from_slice::<Value>(&out.stdout)
                .ok()
                .and_then(|v| v.as_array().map(Vec::len))
                .unwrap_or(0)
        })
        .sum()
}

#[test]
fn churn_of_1000_pods_leaves_nothing_behind() {
    let node = Node::start(Dataplane::Ebpf);
    let pid = node.agent_pid().expect("agent pid");
    // Warm up (first connections, allocator arenas) before the baseline.
    for i in 0..10 {
        let mut p = Pod::add(&node, &format!("w{i}"));
        p.del();
    }
    let (rss0, fds0) = rss_and_fds(pid);
    let links0 = node.ns.links().len();
    let routes0 = node.ns.routes().len();
    let t0 = Instant::now();
    for round in 0..100 {
        std::thread::scope(|s| {
            for i in 0..10 {
                let node = &node;
                s.spawn(move || {
                    let mut p = Pod::add(node, &format!("c{round}x{i}"));
                    p.del();
                });
            }
        });
    }
    eprintln!("1000 ADD/DEL cycles in {:?}", t0.elapsed());
    assert_eq!(
        node.ns.links().len(),
        links0,
        "links left: {:?}",
        node.ns.links()
    );
    assert_eq!(node.ns.routes().len(), routes0, "routes left");
    assert_eq!(node.allocated(), 0, "addresses left allocated");
    assert_eq!(
        node.endpoints()["endpoints"].as_array().map(Vec::len),
        Some(0),
        "endpoints left"
    );
    for m in ["CALIX_ENDPOINTS", "CALIX_LOCAL_V4", "CALIX_LOCAL_V6"] {
        assert_eq!(map_entries(pid, m), 0, "{m} has entries left");
    }
    // The direct-mapped buckets are free again, and every slot is back (the per-endpoint
    // arrays are indexed by it): the next endpoint gets the lowest, 0.
    let held: Vec<Vec<u8>> = bpf_maps_of(pid, "CALIX_EP_DIRECT")
        .into_iter()
        .flat_map(bpf_map_dump)
        .map(|(_, v)| v)
        .filter(|v| v[..4] != [0; 4])
        .collect();
    assert!(held.is_empty(), "buckets still held: {held:?}");
    let pins: HashSet<String> = walk(&node.pin_root());
    assert!(
        pins.iter().all(|p| !p.contains("cali")),
        "per-endpoint pins left: {pins:?}"
    );
    let (rss1, fds1) = rss_and_fds(pid);
    assert_eq!(fds1, fds0, "the agent holds {fds1} fds, {fds0} before");
    // Memory returns to where it started (allowing allocator slack).
    assert!(
        rss1 <= rss0 + 8 * 1024,
        "agent RSS grew from {rss0} kB to {rss1} kB over 1000 pods"
    );
    let next = Pod::add(&node, "after");
    assert_eq!(slot_of(&node, &next.host_ifname()), 0, "slots left taken");
}

/// The ifindex of `name` in `node`'s namespace.
fn ifindex_of(node: &Node, name: &str) -> u32 {
    let out = node
        .ns
        .exec_ok(&["cat", &format!("/sys/class/net/{name}/ifindex")]);
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("ifindex")
}

/// The slot of the endpoint on `host_if`, from the agent's endpoint table (`EndpointInfo`:
/// the slot after the addresses and flags, at byte 24).
fn slot_of(node: &Node, host_if: &str) -> u32 {
    let key = ifindex_of(node, host_if).to_le_bytes();
    let pid = node.agent_pid().expect("agent pid");
    bpf_maps_of(pid, "CALIX_ENDPOINTS")
        .into_iter()
        .flat_map(bpf_map_dump)
        .find(|(k, _)| k[..] == key)
        .map(|(_, v)| u32::from_le_bytes(v[24..28].try_into().expect("4 bytes")))
        .unwrap_or_else(|| panic!("{host_if} not in the endpoint table"))
}

/// Whether the endpoint on `host_if` is marked as having flows through the host stack
/// (`CALIX_STACK_EPS` at its slot).
fn stack_marked(node: &Node, host_if: &str) -> bool {
    let key = slot_of(node, host_if).to_le_bytes();
    let pid = node.agent_pid().expect("agent pid");
    bpf_maps_of(pid, "CALIX_STACK_EPS")
        .into_iter()
        .flat_map(bpf_map_dump)
        .any(|(k, v)| k[..] == key && v[..] != [0; 4])
}

fn walk(dir: &std::path::Path) -> HashSet<String> {
    let mut out = HashSet::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            out.insert(p.display().to_string());
            if p.is_dir() {
                out.extend(walk(&p));
            }
        }
    }
    out
}

/// The fast path looks flows up only for endpoints marked as having flows through the host
/// stack. A restarted agent marks every endpoint with a flow already in the flow table (one a
/// build from before the marks recorded), so none of those flows' replies skips the stack.
#[test]
fn a_restarted_agent_marks_endpoints_with_stack_flows() {
    let node = Node::start(Dataplane::Ebpf);
    let a = Pod::add(&node, "marks-a");
    let b = Pod::add(&node, "marks-b");
    let (a_if, b_if) = (a.host_ifname(), b.host_ifname());
    assert!(
        !stack_marked(&node, &a_if) && !stack_marked(&node, &b_if),
        "no endpoint marked before any stack flow"
    );
    // A flow of A's as an older build would have left it: in the table, A not marked.
    let ip: std::net::Ipv4Addr = a.ip().parse().expect("A's IPv4 address");
    let mut key = Vec::with_capacity(40);
    key.extend(ip.octets());
    key.extend([0u8; 12]);
    key.extend([10, 244, 9, 9]);
    key.extend([0u8; 12]);
    key.extend(8080u16.to_be_bytes());
    key.extend(40000u16.to_be_bytes());
    key.extend([6, 4, 0, 0]); // TCP, IPv4, padding
                              // <pin root>/<node>/v<layout version>/CALIX_STACK_FLOWS
    let layout_dir = std::fs::read_dir(node.pin_root().join(&node.ns.name))
        .expect("the node's pin directory")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('v'))
        })
        .expect("a layout directory");
    let flows = layout_dir.join("CALIX_STACK_FLOWS");
    assert!(
        flows.exists(),
        "the flow table is pinned at {}",
        flows.display()
    );
    let hex: Vec<String> = key.iter().map(|b| format!("{b}")).collect();
    let mut args = vec!["map".to_string(), "update".into(), "pinned".into()];
    args.push(flows.display().to_string());
    args.push("key".into());
    args.extend(hex);
    // A `StackFlow`: last seen, flags, padding (16 bytes).
    args.push("value".into());
    args.extend(std::iter::repeat_n("0".to_string(), 16));
    let st = Command::new("bpftool")
        .args(&args)
        .status()
        .expect("bpftool");
    assert!(st.success(), "bpftool map update: {st}");

    node.kill_agent();
    node.start_agent();
    assert!(
        stack_marked(&node, &a_if) && !stack_marked(&node, &b_if),
        "A marked by the restarted agent, B not"
    );
}

/// Whether a cls_bpf filter runs on `iface` in `dir` (tcx programs are not tc filters).
fn has_tc_filter(node: &Node, iface: &str, dir: &str) -> bool {
    let out = node
        .ns
        .exec_ok(&["tc", "filter", "show", "dev", iface, dir]);
    String::from_utf8_lossy(&out.stdout).contains("bpf")
}

/// The pinned tcx links of `node`'s agent.
fn tcx_pins(node: &Node) -> Vec<String> {
    let dir = node.pin_root().join(&node.ns.name).join("tcx");
    let mut pins: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    pins.sort();
    pins
}

/// Waits up to 5 s for `done`.
fn within_5s(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "not within 5 s: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A new pod's hooks get cls_bpf filters at once (ADD does not wait for a tcx link: creating
/// one waits for an RCU grace period) and are moved to tcx links in the background; an
/// upgrade from a build that attached filters only (`tc_attach = "tc"` stands in for it)
/// moves every interface the same way, and `tc` moves them back. The new attachment runs
/// before the old one goes, and pod traffic keeps its fast path throughout.
#[test]
fn interfaces_move_between_cls_bpf_filters_and_tcx_links() {
    let node = Node::create(Dataplane::Ebpf, None);
    let tc = node.dir.join("tc.toml");
    std::fs::write(&tc, "tc_attach = \"tc\"\n").expect("write the config");
    let with_tc = ["--config", tc.to_str().expect("a UTF-8 path")];
    node.start_agent_with(&with_tc);
    let a = Pod::add(&node, "a");
    let b = Pod::add(&node, "b");
    let a_if = a.host_ifname();
    assert!(has_tc_filter(&node, &a_if, "ingress") && has_tc_filter(&node, &a_if, "egress"));
    assert!(tcx_pins(&node).is_empty(), "{:?}", tcx_pins(&node));
    node.stop_agent();
    node.start_agent();
    let mut want = Vec::new();
    for p in [&a, &b] {
        for dir in ["egress", "ingress"] {
            want.push(format!("{}@{dir}", p.host_ifname()));
        }
    }
    want.sort();
    within_5s("every hook on its tcx link", || tcx_pins(&node) == want);
    within_5s("the filters gone", || {
        [&a, &b].iter().all(|p| {
            ["ingress", "egress"]
                .iter()
                .all(|d| !has_tc_filter(&node, &p.host_ifname(), d))
        })
    });
    let before = forwarded(&node);
    assert!(a.ns.ping(&b.ip(), 2));
    assert_eq!(forwarded(&node) - before, 0, "not bypassing on tcx");
    // A new pod: its hooks move too.
    let c = Pod::add(&node, "c");
    let c_if = c.host_ifname();
    within_5s("the new pod's hooks on tcx links", || {
        node.tcx_prog(&c_if, "ingress").is_some()
            && node.tcx_prog(&c_if, "egress").is_some()
            && !has_tc_filter(&node, &c_if, "ingress")
            && !has_tc_filter(&node, &c_if, "egress")
    });
    // What the benches read of a node's programs (the crossnode bench's BPF run times) lists
    // tcx hooks too: Debian's bpftool (7.1) leaves them out of `bpftool net show`.
    let seen = calix_testbed::bpf::attached(&node.ns).expect("the node's programs");
    for (hook, prog) in [("ingress", "from_pod"), ("egress", "to_pod")] {
        assert!(
            seen.iter()
                .any(|p| p.dev == c_if && p.hook == hook && p.name == prog),
            "{prog} at {c_if}/{hook} not among {seen:?}"
        );
    }
    assert!(c.ns.ping(&a.ip(), 2));
    node.stop_agent();
    node.start_agent_with(&with_tc);
    assert!(tcx_pins(&node).is_empty(), "{:?}", tcx_pins(&node));
    assert!(has_tc_filter(&node, &a_if, "ingress"));
    assert!(a.ns.ping(&b.ip(), 2));
}
