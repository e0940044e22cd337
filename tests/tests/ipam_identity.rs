//! IPAM identity (issue 11, item 8): which attachment an allocation belongs to. Handles are
//! unambiguous, CNI GC of one network never touches another, and allocations the previous
//! plugin made (the old handle encoding) are still checked, released and collected after an
//! upgrade. Real namespaces, the real `calix` binary, a real agent. Run as root.
use calix_testbed::{unique, Dataplane, Netns, Node, Pod};
use serde_json::json;

/// Network `t` + container `<u>.x` and network `t.<u>` + container `x` are two attachments.
#[test]
fn networks_and_container_ids_with_dots_never_share_an_address() {
    let node = Node::start(Dataplane::under_test());
    let u = unique("");
    let (ns1, ns2) = (Netns::new("p"), Netns::new("p"));
    let add = |ns: &Netns, network: &str, cid: &str| {
        let out = node.cni(
            "ADD",
            cid,
            &ns.path(),
            "",
            &node.conf(json!({ "name": network })),
        );
        assert!(
            out.success,
            "ADD {network}/{cid}: {} {}\n{}",
            out.stdout,
            out.stderr,
            node.agent_log()
        );
        out.ip()
    };
    let ip1 = add(&ns1, "t", &format!("{u}.x"));
    let ip2 = add(&ns2, &format!("t.{u}"), "x");
    assert_ne!(ip1, ip2, "two pods of two networks were given one address");
    assert_eq!(node.allocated(), 2);
}

#[test]
fn gc_of_a_network_never_touches_a_network_it_is_a_prefix_of() {
    let node = Node::start(Dataplane::under_test());
    let mine = Pod::add(&node, "mine");
    let gone = Pod::add(&node, "gone");
    // "calix-test.x" starts with "calix-test." — and is another network.
    let other = Pod::add_with(&node, "other", json!({"name": "calix-test.x"}));
    assert_eq!(node.allocated(), 3);
    let out = mine.call(
        "GC",
        json!({"cniVersion": "1.1.0", "cni.dev/valid-attachments": [
            {"containerID": mine.container_id, "ifname": "eth0"},
        ]}),
    );
    assert!(out.success, "{out:?}");
    assert_eq!(
        node.allocated(),
        2,
        "GC of calix-test released other than {}'s address:\n{}",
        gone.container_id,
        node.agent_log()
    );
    let links = node.cali_links();
    assert!(
        links.contains(&other.host_ifname()),
        "GC deleted the other network's veth"
    );
    assert!(!links.contains(&gone.host_ifname()));
    let eps = node.endpoints();
    assert_eq!(eps["endpoints"].as_array().map(Vec::len), Some(2), "{eps}");
    assert!(
        mine.ns.ping(&other.ip(), 1),
        "GC broke the other network's pod"
    );
}

/// After an upgrade: pods the previous plugin added (their allocation under
/// "<network>.<containerID>", their endpoint naming that handle) pass CHECK, and DEL and GC
/// release their addresses.
#[test]
fn pods_of_the_previous_plugin_pass_check_and_are_released_by_del_and_gc() {
    use calix_proto::handle;
    use calix_proto::v1 as pb;

    let node = Node::start(Dataplane::under_test());
    let network = node.conf(serde_json::Value::Null)["name"]
        .as_str()
        .expect("network name")
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // Rewrites a pod's allocation and endpoint as the previous plugin made them.
    let make_old = |pod: &Pod| {
        let cid = pod.container_id.clone();
        let ip = pod.ip();
        let pod_mac = pod.result.json.as_ref().expect("result")["interfaces"][1]["mac"]
            .as_str()
            .expect("pod mac")
            .to_string();
        let old = handle::legacy(&network, &cid);
        rt.block_on(async {
            let ch = calix_proto::connect_unix(&node.socket, std::time::Duration::from_secs(10))
                .await
                .expect("connect");
            let mut ipam = pb::ipam_client::IpamClient::new(ch.clone());
            let mut eps = pb::endpoints_client::EndpointsClient::new(ch);
            let released = ipam
                .release(pb::ReleaseRequest {
                    handle: handle::encode(&network, &cid),
                    ifname: "eth0".into(),
                })
                .await
                .expect("release")
                .into_inner();
            assert_eq!(released.released, 1);
            ipam.allocate(pb::AllocateRequest {
                handle: old.clone(),
                ifname: "eth0".into(),
                ipv4: true,
                requested: vec![ip.clone()],
                attributes: [(handle::CONTAINER_ID_ATTRIBUTE.to_string(), cid.clone())]
                    .into_iter()
                    .collect(),
                ..Default::default()
            })
            .await
            .expect("allocate as the previous plugin");
            eps.register(pb::RegisterRequest {
                endpoint: Some(pb::Endpoint {
                    container_id: cid.clone(),
                    ifname: "eth0".into(),
                    host_ifname: pod.host_ifname(),
                    netns: pod.ns.path(),
                    addresses: vec![format!("{ip}/32")],
                    handle: old,
                    mac: pod_mac,
                    ..Default::default()
                }),
            })
            .await
            .expect("register as the previous plugin");
        });
    };
    let mut del = Pod::add(&node, "del");
    let gc = Pod::add(&node, "gc");
    make_old(&del);
    make_old(&gc);
    let check = del.check();
    assert!(check.success, "CHECK of an old pod: {check:?}");
    del.del();
    assert_eq!(node.allocated(), 1, "DEL left the old pod's address");
    let out = gc.call(
        "GC",
        json!({"cniVersion": "1.1.0", "cni.dev/valid-attachments": []}),
    );
    assert!(out.success, "{out:?}");
    assert_eq!(node.allocated(), 0, "GC left the old pod's address");
    assert!(!node.cali_links().contains(&gc.host_ifname()));
}
