//! Pod identity (issue 11): a pod's state belongs to its (container ID, ifname), not to its
//! host interface name. A pod recreated under the same name while its old sandbox still exists
//! gets the same `cali…` name; the new sandbox must come up, and the old sandbox's late DEL
//! (with or without an agent restart in between) must leave the new one alone: its veth, its
//! programs, its endpoint-map entry with its own addresses, its traffic. And one pod may have
//! more than one calix attachment. Run as root.
use calix_testbed::{unique, Dataplane, Node, Pod};
use serde_json::Value;

/// Endpoints whose host interface is `host_if`.
fn endpoints_on(node: &Node, host_if: &str) -> Vec<Value> {
    node.endpoints()["endpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["hostInterface"] == host_if)
        .collect()
}

/// `b` (the new sandbox on `host_if`) is fully programmed and reachable from `peer`, and its
/// programs enforce its own addresses: sending from `foreign` (the old sandbox's address) is
/// dropped and counted.
fn assert_new_sandbox_owns(node: &Node, b: &Pod, host_if: &str, peer: &Pod, foreign: &str) {
    assert!(
        node.cali_links().contains(&host_if.to_string()),
        "{host_if} is gone: {:?}",
        node.cali_links()
    );
    for dir in ["ingress", "egress"] {
        assert!(
            node.filter_prog(host_if, dir).is_some(),
            "no calix {dir} program on {host_if} any more\nagent log:\n{}",
            node.agent_log()
        );
    }
    let eps = endpoints_on(node, host_if);
    assert_eq!(eps.len(), 1, "endpoints on {host_if}: {eps:?}");
    assert_eq!(eps[0]["containerID"], b.container_id.as_str(), "{eps:?}");
    assert_eq!(eps[0]["bpfAttached"], true, "{eps:?}");
    assert!(eps[0]["addresses"].to_string().contains(&b.ip()), "{eps:?}");
    assert!(peer.ns.ping(&b.ip(), 3), "the new sandbox lost its traffic");
    assert!(b.ns.ping(&peer.ip(), 2), "the new sandbox cannot send");
    // Anti-spoofing still holds the new sandbox to its own addresses.
    let before = node.dropped(host_if, "spoofed_source_v4");
    b.ns.exec_ok(&[
        "ip",
        "addr",
        "replace",
        &format!("{foreign}/32"),
        "dev",
        "eth0",
    ]);
    let spoofed = b.ns.exec(&[
        "ping",
        "-c",
        "3",
        "-i",
        "0.2",
        "-W",
        "1",
        "-q",
        "-I",
        foreign,
        &peer.ip(),
    ]);
    assert!(!spoofed.status.success(), "spoofed pings got answers");
    assert!(
        node.dropped(host_if, "spoofed_source_v4") >= before + 3,
        "spoofing from the old sandbox's address was not dropped: {}",
        node.drops()
    );
}

fn recreated_pod(restart_agent: bool) {
    let node = Node::start(Dataplane::Ebpf);
    let peer = Pod::add(&node, "peer");
    let name = unique("web");
    let mut a = Pod::try_add_as(&node, &name, "eth0", Value::Null);
    assert!(a.result.success, "ADD A: {}", a.result.stdout);
    let host_if = a.host_ifname();
    let a_ip = a.ip();
    // The same pod recreated while the old sandbox still exists.
    let b = Pod::try_add_as(&node, &name, "eth0", Value::Null);
    assert!(
        b.result.success,
        "ADD B of the recreated pod failed: {} {}\nagent log:\n{}",
        b.result.stdout,
        b.result.stderr,
        node.agent_log()
    );
    assert_eq!(
        b.host_ifname(),
        host_if,
        "same pod, same host interface name"
    );
    assert_ne!(
        b.ip(),
        a_ip,
        "the old sandbox's address is not released by B's ADD"
    );
    assert_eq!(
        node.allocated(),
        3,
        "peer, A and B each hold one address until A's DEL"
    );
    if restart_agent {
        node.kill_agent();
        node.start_agent();
    }
    // The old sandbox's late DEL.
    a.del();
    assert_new_sandbox_owns(&node, &b, &host_if, &peer, &a_ip);
    assert_eq!(node.allocated(), 2, "A's DEL released A's address");
    // And a restart after the DEL rebuilds the same state.
    node.kill_agent();
    node.start_agent();
    assert_new_sandbox_owns(&node, &b, &host_if, &peer, &a_ip);
}

#[test]
fn a_recreated_pod_keeps_its_programs_and_traffic_after_the_old_sandboxs_del() {
    recreated_pod(false);
}

#[test]
fn a_recreated_pod_keeps_its_programs_and_traffic_across_an_agent_restart() {
    recreated_pod(true);
}

/// Rules in `pod`'s namespace that select by source `addr`.
fn source_rules(pod: &Pod, addr: &str) -> usize {
    let out = pod.ns.exec_ok(&["ip", "-j", "rule", "show"]);
    let rules: Value = serde_json::from_slice(&out.stdout).expect("ip -j rule");
    rules
        .as_array()
        .map(|r| r.iter().filter(|x| x["src"] == addr).count())
        .unwrap_or(0)
}

#[test]
fn a_pod_may_have_two_calix_attachments() {
    let node = Node::start(Dataplane::Ebpf);
    let peer = Pod::add(&node, "peer");
    let first = Pod::add(&node, "multi");
    let mut second = first.try_attach("net1", Value::Null);
    assert!(
        second.result.success,
        "ADD of a second attachment failed: {} {}\nagent log:\n{}",
        second.result.stdout,
        second.result.stderr,
        node.agent_log()
    );
    let (if1, if2) = (first.host_ifname(), second.host_ifname());
    assert_ne!(if1, if2, "each attachment has its own host veth");
    assert_ne!(first.ip(), second.ip());
    for host_if in [&if1, &if2] {
        let eps = endpoints_on(&node, host_if);
        assert_eq!(eps.len(), 1, "{eps:?}");
        assert_eq!(eps[0]["bpfAttached"], true, "{eps:?}");
    }
    // Both addresses answer; what the pod sends from its second address leaves through the
    // second interface (a source rule), so anti-spoofing on either veth drops nothing.
    assert!(peer.ns.ping(&first.ip(), 2), "first attachment unreachable");
    assert!(
        peer.ns.ping(&second.ip(), 2),
        "second attachment unreachable"
    );
    let from_second = first.ns.exec(&[
        "ping",
        "-c",
        "2",
        "-i",
        "0.2",
        "-W",
        "2",
        "-q",
        "-I",
        &second.ip(),
        &peer.ip(),
    ]);
    assert!(
        from_second.status.success(),
        "sending from the second address"
    );
    assert!(
        first.ns.ping(&peer.ip(), 2),
        "sending from the first address"
    );
    for host_if in [&if1, &if2] {
        assert_eq!(
            node.dropped(host_if, "spoofed_source_v4"),
            0,
            "{}",
            node.drops()
        );
    }
    assert_eq!(source_rules(&first, &second.ip()), 1);
    assert_eq!(
        source_rules(&first, &first.ip()),
        0,
        "the first one routes by main"
    );
    let check = second.check();
    assert!(check.success, "CHECK of the second: {}", check.stdout);
    let check = first.check();
    assert!(check.success, "CHECK of the first: {}", check.stdout);
    // DEL of the second attachment takes its veth, endpoint, address and rule; the first keeps
    // working.
    second.del();
    assert!(!node.cali_links().contains(&if2), "{:?}", node.cali_links());
    assert!(endpoints_on(&node, &if2).is_empty());
    assert_eq!(
        source_rules(&first, &second.ip()),
        0,
        "the source rule outlived DEL"
    );
    assert_eq!(endpoints_on(&node, &if1).len(), 1);
    assert!(
        peer.ns.ping(&first.ip(), 2),
        "the first attachment lost its traffic"
    );
    assert_eq!(node.allocated(), 2, "peer and the first attachment");
}
