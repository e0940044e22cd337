//! IPAM across nodes and crashes (issue 4): real agents in node namespaces, a real etcd in a
//! namespace of its own, driven through the agents' gRPC API.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

mod common;

use calix_proto::v1 as pb;
use calix_testbed::{Dataplane, EtcdNs, Node, Pod, Tmpfs};
use common::{allocate, allocate_many, client, findings_of, ipam_json, rt, Client};
use serde_json::Value;

/// Agent config on etcd at `url`; `extra` may bring its own `[[pools]]` (else 10.60.0.0/20).
/// Asserts that `handle` (ifname eth0) holds exactly `addr` now.
async fn assert_holds(c: &mut Client, handle: &str, addr: IpAddr) {
    let got = c
        .lookup(pb::LookupRequest {
            handle: handle.to_string(),
            ifname: "eth0".into(),
        })
        .await
        .expect("lookup")
        .into_inner();
    assert_eq!(got.addresses[0].address, format!("{addr}/32"), "{handle}");
}

fn etcd_config(url: &str, extra: &str) -> String {
    let pools = if extra.contains("[[pools]]") {
        ""
    } else {
        "[[pools]]\ncidr = \"10.60.0.0/20\"\nblockSize = 26\n"
    };
    format!(
        "[datastore]\ntype = \"etcd\"\nendpoints = [\"{url}\"]\nprefix = \"/calix-test/\"\nattempts = 20\n{extra}\n{pools}"
    )
}

/// A node on `etcd` with `extra` config, its agent started.
fn etcd_node(etcd: &EtcdNs, extra: &str) -> Node {
    let probe = Node::create(Dataplane::Kernel, None);
    let url = etcd.wire(&probe.ns);
    // The config needs the URL, which needs the namespace: rebuild the node with it.
    let node = probe.with_config(&etcd_config(&url, extra));
    node.start_agent();
    node
}

#[test]
fn three_agents_on_one_etcd_never_give_an_address_twice() {
    let etcd = EtcdNs::start();
    let nodes: Vec<Node> = (0..3).map(|_| etcd_node(&etcd, "")).collect();
    let rt = rt();
    let results = rt.block_on(async {
        let mut clients = Vec::new();
        for n in &nodes {
            clients.push(client(n).await);
        }
        let runs = clients.iter().enumerate().map(|(i, c)| {
            let c = c.clone();
            async move { allocate_many(&c, &format!("n{i}"), 300, 32).await }
        });
        futures_join(runs.collect()).await
    });
    let mut seen: HashMap<IpAddr, String> = HashMap::new();
    for r in results.iter().flatten() {
        let addr = *r.1.as_ref().unwrap_or_else(|e| panic!("{}: {e}", r.0));
        if let Some(other) = seen.insert(addr, r.0.clone()) {
            panic!("{addr} given to both {other} and {}", r.0);
        }
    }
    assert_eq!(seen.len(), 900);
    let show = ipam_json(&nodes[0], "show");
    let names: HashSet<String> = nodes.iter().map(|n| n.ns.name.clone()).collect();
    let blocks = show["blocks"].as_array().expect("blocks");
    let mut cidrs = HashSet::new();
    for b in blocks {
        assert!(
            names.contains(b["affinity"].as_str().unwrap_or_default()),
            "block without one of our nodes as affinity: {b}"
        );
        assert!(cidrs.insert(b["cidr"].to_string()), "block twice: {b}");
    }
    let used: u64 = blocks.iter().map(|b| b["used"].as_u64().unwrap_or(0)).sum();
    assert_eq!(used, 900);
    for n in show["nodes"].as_array().expect("nodes") {
        if names.contains(n["node"].as_str().unwrap_or_default()) {
            assert_eq!(n["used"], 300, "{n}");
            // Each node's record carries its address on the link to etcd.
            let addrs = n["addresses"].to_string();
            assert!(addrs.contains("10.98."), "{n}");
        }
    }
    let check = ipam_json(&nodes[1], "check");
    for kind in [
        "duplicate",
        "orphan-handle",
        "orphan-allocation",
        "orphan-block",
    ] {
        assert!(findings_of(&check, kind).is_empty(), "{kind}: {check}");
    }
    // No endpoints were registered: every allocation is (correctly) reported as a leak.
    assert_eq!(findings_of(&check, "leak").len(), 900);
}

/// Joins futures without pulling in the `futures` crate.
async fn futures_join<F: std::future::Future + Send + 'static>(fs: Vec<F>) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = fs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("join"));
    }
    out
}

#[test]
fn a_full_block_borrows_from_another_node_unless_strict() {
    let etcd = EtcdNs::start();
    // Two blocks of 16 in the pool: one per node.
    let small = "[[pools]]\ncidr = \"10.61.0.0/27\"\nblockSize = 28\n";
    let cfg = |strict: bool| format!("[ipam]\nstrictAffinity = {strict}\n{small}");
    let a = etcd_node(&etcd, &cfg(false));
    let b = etcd_node(&etcd, &cfg(false));
    let rt = rt();
    rt.block_on(async {
        let ca = client(&a).await;
        let cb = client(&b).await;
        let first_b = allocate(cb.clone(), "net.b-0".into())
            .await
            .expect("b claims a block");
        // a claims the other block and fills it (15 usable: .0 is the pool's network address).
        let own = allocate_many(&ca, "a", 15, 4).await;
        assert!(own.iter().all(|r| r.1.is_ok()), "{own:?}");
        let borrowed = allocate(ca.clone(), "net.a-borrow".into())
            .await
            .expect("borrow");
        let b_block: ipnet_lite::Net = ipnet_lite::Net::of(first_b, 28);
        assert!(
            b_block.contains(borrowed),
            "{borrowed} should come from b's block {b_block:?}"
        );
    });
    let show = ipam_json(&a, "show");
    let bblock = show["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .find(|x| x["affinity"] == b.ns.name.as_str())
        .cloned()
        .expect("b's block");
    assert_eq!(bblock["borrowed"], 1, "{show}");
    drop(a);
    // The same with strictAffinity: no borrowing, a clear error.
    let strict = etcd_node(&etcd, &cfg(true));
    rt.block_on(async {
        let c = client(&strict).await;
        let err = allocate(c, "net.s-0".into())
            .await
            .expect_err("strict: nothing free");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        assert!(
            err.message().contains("strictAffinity"),
            "{}",
            err.message()
        );
        assert!(err.message().contains("10.61.0.0/27"), "{}", err.message());
    });
}

/// Tiny IPv4 prefix helper (keeps the tests free of an ipnet dependency).
mod ipnet_lite {
    use std::net::IpAddr;

    #[derive(Debug)]
    pub struct Net(u32, u32);

    impl Net {
        pub fn of(addr: IpAddr, prefix: u32) -> Self {
            let IpAddr::V4(a) = addr else {
                panic!("IPv4 only")
            };
            let mask = u32::MAX << (32 - prefix);
            Net(u32::from(a) & mask, mask)
        }
        pub fn contains(&self, addr: IpAddr) -> bool {
            matches!(addr, IpAddr::V4(a) if u32::from(a) & self.1 == self.0)
        }
    }
}

#[test]
fn an_etcd_restart_mid_allocation_loses_nothing() {
    let etcd = EtcdNs::start();
    let node = etcd_node(&etcd, "");
    let rt = rt();
    let results = rt.block_on(async {
        let c = client(&node).await;
        let run = {
            let c = c.clone();
            tokio::spawn(async move { allocate_many(&c, "r", 300, 8).await })
        };
        // Let some succeed, then take etcd away for a second.
        let deadline = Instant::now() + Duration::from_secs(30);
        while node.agent_log().matches("allocated").count() < 50 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        etcd.kill();
        let at_kill = node.agent_log().matches("allocated").count();
        tokio::time::sleep(Duration::from_secs(1)).await;
        etcd.spawn();
        let r = run.await.expect("join");
        (r, at_kill)
    });
    let (results, at_kill) = results;
    eprintln!("etcd killed after {at_kill} of 300 allocations");
    assert!(
        at_kill < 300,
        "etcd went away only after every allocation was done"
    );
    let mut addrs = HashSet::new();
    for (h, r) in &results {
        let a = r.as_ref().unwrap_or_else(|e| {
            panic!(
                "{h} failed across the etcd restart: {e}\n{}",
                node.agent_log()
            )
        });
        assert!(addrs.insert(*a), "{a} twice");
    }
    assert_eq!(addrs.len(), 300);
    assert!(
        node.agent_log().contains("retry") || node.agent_log().contains("etcd"),
        "the agent should have had to retry:\n{}",
        node.agent_log()
    );
    // Nothing lost: the datastore holds exactly these 300, each under its handle.
    assert_eq!(node.allocated(), 300);
    rt.block_on(async {
        let mut c = client(&node).await;
        for (h, r) in &results {
            assert_holds(&mut c, h, *r.as_ref().expect("ok")).await;
        }
    });
}

/// `kill -9` of an agent during 500 allocations on `node` (started with a short leak grace).
fn kill_nine_mid_allocation(node: &Node) {
    let rt = rt();
    let results = rt.block_on(async {
        let c = client(node).await;
        let run = {
            let c = c.clone();
            tokio::spawn(async move { allocate_many(&c, "k", 500, 16).await })
        };
        // Kill once a good part has been acknowledged.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let log = node.agent_log();
            if log.matches("allocated").count() >= 150 || Instant::now() > deadline {
                break;
            }
        }
        node.kill_agent();
        run.await.expect("join")
    });
    let acked: BTreeMap<String, IpAddr> = results
        .iter()
        .filter_map(|(h, r)| r.as_ref().ok().map(|a| (h.clone(), *a)))
        .collect();
    let failed = results.len() - acked.len();
    assert!(acked.len() >= 100, "only {} acknowledged", acked.len());
    assert!(failed > 0, "the kill came too late to interrupt anything");
    let distinct: HashSet<&IpAddr> = acked.values().collect();
    assert_eq!(
        distinct.len(),
        acked.len(),
        "an address was acknowledged twice"
    );

    node.start_agent();
    let before_gc = node.allocated();
    assert!(
        before_gc >= acked.len(),
        "acknowledged allocations lost: {before_gc} < {}",
        acked.len()
    );
    let check = ipam_json(node, "check");
    for kind in ["duplicate", "orphan-handle", "orphan-allocation"] {
        assert!(findings_of(&check, kind).is_empty(), "{kind}: {check}");
    }
    // One link per endpoint stands in for the pods' veths (the node runs the kernel dataplane).
    let owners: Vec<String> = acked
        .keys()
        .map(|h| calix_kernel::pod::owner_alias(h.trim_start_matches("net."), "eth0"))
        .collect();
    let links = node.stand_in_links(&owners);
    rt.block_on(async {
        let ch = calix_proto::connect_unix(&node.socket, Duration::from_secs(10))
            .await
            .expect("connect");
        let mut ipam = pb::ipam_client::IpamClient::new(ch.clone());
        let mut eps = pb::endpoints_client::EndpointsClient::new(ch);
        for ((h, a), link) in acked.iter().zip(&links) {
            // Every acknowledged allocation is still there, unchanged...
            assert_holds(&mut ipam, h, *a).await;
            // ...and gets its endpoint, as the CNI plugin would register it.
            let cid = h.trim_start_matches("net.").to_string();
            eps.register(pb::RegisterRequest {
                endpoint: Some(pb::Endpoint {
                    container_id: cid,
                    ifname: "eth0".into(),
                    host_ifname: link.clone(),
                    handle: h.clone(),
                    addresses: vec![format!("{a}/32")],
                    ..Default::default()
                }),
            })
            .await
            .expect("register");
        }
    });
    // Leak GC (interval 1 s, grace 2 s) reclaims what was committed but never acknowledged.
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.allocated() != acked.len() {
        assert!(
            Instant::now() < deadline,
            "leak GC did not reclaim the unacknowledged allocations: {} allocated, {} acknowledged\n{}",
            node.allocated(),
            acked.len(),
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let reclaimed = before_gc - acked.len();
    // Killed between a block's commit and its handle record: rebuilt from the blocks at start.
    let repaired = node
        .agent_log()
        .matches("handle record repaired from the blocks")
        .count();
    eprintln!(
        "kill -9: {} acknowledged, {failed} failed, {before_gc} allocated after restart, {repaired} handle records repaired, {reclaimed} reclaimed by leak GC",
        acked.len()
    );
    if reclaimed > 0 {
        assert!(
            node.agent_log().contains("leak: no endpoint"),
            "{}",
            node.agent_log()
        );
    }
    let check = ipam_json(node, "check");
    assert_eq!(check["findings"], serde_json::json!([]), "{check}");
}

const FAST_GC: &str = "[ipam]\nleakCheckIntervalSecs = 1\nleakGraceSecs = 2\n";

#[test]
fn kill_nine_mid_allocation_embedded() {
    let node = Node::create(
        Dataplane::Kernel,
        Some(&format!(
            "{FAST_GC}[[pools]]\ncidr = \"10.62.0.0/20\"\nblockSize = 26\n"
        )),
    );
    node.start_agent();
    kill_nine_mid_allocation(&node);
}

#[test]
fn kill_nine_mid_allocation_etcd() {
    let etcd = EtcdNs::start();
    let node = etcd_node(&etcd, FAST_GC);
    kill_nine_mid_allocation(&node);
}

/// Issue 11, item 4: the embedded store on a disk that fills up. Allocations fail with a clear
/// error while it is full, succeed again once there is room, and after `kill -9` the store
/// opens with every acknowledged allocation in it and no address given twice.
#[test]
fn a_full_disk_loses_no_acknowledged_allocation() {
    // Declared first, so it is unmounted after the node (and its agent) are gone.
    let disk = Tmpfs::mount("disk", "2m");
    let store = disk.dir.join("store.json");
    let journal = disk.dir.join("store.json.journal");
    let node = Node::create(
        Dataplane::Kernel,
        Some("[[pools]]\ncidr = \"10.66.0.0/20\"\nblockSize = 26\n"),
    )
    .with_store_path(store);
    node.start_agent();
    let rt = rt();
    let mut acked: BTreeMap<String, IpAddr> = BTreeMap::new();
    let page = 4096;
    rt.block_on(async {
        let c = client(&node).await;
        for (h, r) in allocate_many(&c, "before", 20, 4).await {
            acked.insert(h.clone(), r.unwrap_or_else(|e| panic!("{h}: {e}")));
        }
        // The journal ends inside a page, so the next append fits partly and is cut short
        // when the disk is full (rather than refused before writing anything).
        let mut extra = 0;
        while std::fs::metadata(&journal)
            .expect("journal")
            .len()
            .is_multiple_of(page)
        {
            let h = format!("net.align-{extra}");
            let a = allocate(c.clone(), h.clone()).await.expect("allocate");
            acked.insert(h, a);
            extra += 1;
        }
        let filled = disk.fill();
        eprintln!("disk full: filler {filled} bytes");
        let full = allocate_many(&c, "full", 30, 4).await;
        let mut failed = 0;
        for (h, r) in &full {
            match r {
                Ok(a) => {
                    acked.insert(h.clone(), *a);
                }
                Err(e) => {
                    if failed == 0 {
                        eprintln!("disk full: {h}: {}", e.message());
                    }
                    failed += 1;
                    assert_eq!(e.code(), tonic::Code::Unavailable, "{h}: {e}");
                    assert!(
                        e.message().contains("No space left on device"),
                        "{h}: unclear error: {}",
                        e.message()
                    );
                }
            }
        }
        assert!(failed > 0, "no allocation failed on the full disk");
        eprintln!("disk full: {failed} of 30 allocations failed");
        // A little room again: allocations work and are acknowledged.
        disk.free(512 * 1024);
        for (h, r) in allocate_many(&c, "after", 20, 4).await {
            acked.insert(
                h.clone(),
                r.unwrap_or_else(|e| panic!("{h} after space came back: {e}")),
            );
        }
    });
    let distinct: HashSet<&IpAddr> = acked.values().collect();
    assert_eq!(
        distinct.len(),
        acked.len(),
        "an address was acknowledged twice"
    );

    node.kill_agent();
    // The store must open (start_agent panics with the agent's log if it does not).
    node.start_agent();
    assert_eq!(
        node.allocated(),
        acked.len(),
        "the datastore holds other than the acknowledged allocations"
    );
    let check = ipam_json(&node, "check");
    for kind in ["duplicate", "orphan-handle", "orphan-allocation"] {
        assert!(findings_of(&check, kind).is_empty(), "{kind}: {check}");
    }
    rt.block_on(async {
        let mut c = client(&node).await;
        for (h, a) in &acked {
            assert_holds(&mut c, h, *a).await;
        }
        // And the agent keeps working: new allocations, none of them an address in use.
        for (h, r) in allocate_many(&c, "restarted", 10, 4).await {
            let a = r.unwrap_or_else(|e| panic!("{h} after the restart: {e}"));
            assert!(!distinct.contains(&a), "{a} given again to {h}");
        }
    });
}

#[test]
fn calixctl_check_finds_leaks_and_release_from_report_frees_exactly_them() {
    let node = Node::create(
        Dataplane::Kernel,
        Some("[[pools]]\ncidr = \"10.63.0.0/24\"\nblockSize = 28\n"),
    );
    node.start_agent();
    let rt = rt();
    let link = node.stand_in_links(&[calix_kernel::pod::owner_alias("c-0", "eth0")]);
    let addrs = rt.block_on(async {
        let c = client(&node).await;
        let got = allocate_many(&c, "c", 3, 1).await;
        let ch = calix_proto::connect_unix(&node.socket, Duration::from_secs(10))
            .await
            .expect("connect");
        let mut eps = pb::endpoints_client::EndpointsClient::new(ch);
        // c-0 gets an endpoint; c-1 and c-2 are leaks.
        eps.register(pb::RegisterRequest {
            endpoint: Some(pb::Endpoint {
                container_id: "c-0".into(),
                ifname: "eth0".into(),
                host_ifname: link[0].clone(),
                handle: "net.c-0".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("register");
        got.into_iter()
            .map(|(_, r)| r.expect("alloc"))
            .collect::<Vec<_>>()
    });
    let out = node.calixctl(&["ipam", "check"]);
    assert_eq!(out.status.code(), Some(1), "check must fail on leaks");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("leak") && table.contains(&addrs[1].to_string()),
        "{table}"
    );
    let report = ipam_json(&node, "check");
    let leaks = findings_of(&report, "leak");
    let leaked: HashSet<String> = leaks
        .iter()
        .map(|f| f["address"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        leaked,
        HashSet::from([addrs[1].to_string(), addrs[2].to_string()])
    );
    let show = node.calixctl(&["ipam", "show"]);
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(
        text.contains("10.63.0.0/24") && text.contains(&node.ns.name),
        "{text}"
    );

    // Release from the report; c-2 has been released and re-allocated meanwhile, so its
    // report entry (an older sequence number) must not free the new allocation.
    let path = std::env::temp_dir().join(format!("{}-report.json", node.ns.name));
    std::fs::write(&path, report.to_string()).expect("write report");
    let realloc = rt.block_on(async {
        let mut c = client(&node).await;
        c.release(pb::ReleaseRequest {
            handle: "net.c-2".into(),
            ifname: "eth0".into(),
        })
        .await
        .expect("release");
        allocate(c, "net.c-new".into()).await.expect("realloc")
    });
    assert_eq!(realloc, addrs[2], "the lowest free address is reused");
    let out = node.calixctl(&[
        "ipam",
        "release",
        "--from-report",
        &path.display().to_string(),
        "-o",
        "json",
    ]);
    let _ = std::fs::remove_file(&path);
    let v: Value = serde_json::from_slice(&out.stdout).expect("release json");
    assert_eq!(
        v["released"],
        serde_json::json!([addrs[1].to_string()]),
        "{v}"
    );
    assert_eq!(
        v["unchanged"],
        serde_json::json!([addrs[2].to_string()]),
        "{v}"
    );
    assert_eq!(node.allocated(), 2, "c-0 and c-new stay");
    // --ip releases whatever holds the address now.
    let out = node.calixctl(&["ipam", "release", "--ip", &realloc.to_string()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("released"));
    assert_eq!(node.allocated(), 1);
    assert!(node.agent_log().contains("released from report"));
}

/// Issue 11, item 8: a block released when empty and claimed again never repeats a sequence
/// number, so a late release naming an allocation of its earlier life (here an old `ipam check`
/// report) cannot free the address handed out again since.
fn late_release_after_a_reclaim(node: &Node) {
    let rt = rt();
    let first = rt
        .block_on(async { allocate(client(node).await, "net.s-1".into()).await })
        .expect("first allocation");
    // The report names the allocation with its sequence number.
    let report = ipam_json(node, "check");
    assert_eq!(findings_of(&report, "leak").len(), 1, "{report}");
    rt.block_on(async {
        client(node)
            .await
            .release(pb::ReleaseRequest {
                handle: "net.s-1".into(),
                ifname: "eth0".into(),
            })
            .await
            .expect("release")
    });
    // The empty block goes back to the pool (grace 1 s, checked every second).
    let deadline = Instant::now() + Duration::from_secs(15);
    while ipam_json(node, "show")["blocks"]
        .as_array()
        .is_some_and(|b| !b.is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "the empty block was not released:\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let second = rt
        .block_on(async { allocate(client(node).await, "net.s-2".into()).await })
        .expect("second allocation");
    assert_eq!(second, first, "the block's lowest address again");
    let path = std::env::temp_dir().join(format!("{}-report.json", node.ns.name));
    std::fs::write(&path, report.to_string()).expect("write report");
    let out = node.calixctl(&[
        "ipam",
        "release",
        "--from-report",
        &path.display().to_string(),
        "-o",
        "json",
    ]);
    let _ = std::fs::remove_file(&path);
    let v: Value = serde_json::from_slice(&out.stdout).expect("release json");
    assert_eq!(
        v["released"],
        serde_json::json!([]),
        "the old report freed the new allocation: {v}"
    );
    assert_eq!(node.allocated(), 1);
}

const ONE_BLOCK_FAST_RELEASE: &str = "[ipam]\nleakCheckIntervalSecs = 1\nemptyBlockGraceSecs = 1\n\
     [[pools]]\ncidr = \"10.67.0.0/28\"\nblockSize = 28\n";

#[test]
fn a_late_release_cannot_free_an_address_of_a_reclaimed_block_embedded() {
    let node = Node::create(Dataplane::Kernel, Some(ONE_BLOCK_FAST_RELEASE));
    node.start_agent();
    late_release_after_a_reclaim(&node);
}

#[test]
fn a_late_release_cannot_free_an_address_of_a_reclaimed_block_etcd() {
    let etcd = EtcdNs::start();
    let node = etcd_node(&etcd, ONE_BLOCK_FAST_RELEASE);
    late_release_after_a_reclaim(&node);
}

#[test]
fn sighup_applies_pool_changes_and_refuses_unsafe_ones() {
    let first = "[[pools]]\ncidr = \"10.64.0.0/24\"\nblockSize = 28\n";
    let node = Node::create(Dataplane::Kernel, Some(first));
    node.start_agent();
    let cfg = node.dir.join("agent.toml");
    let rt = rt();
    let a = rt.block_on(async {
        allocate(client(&node).await, "net.h-0".into())
            .await
            .expect("alloc")
    });
    assert!(a.to_string().starts_with("10.64.0."));
    let hup = |text: &str| {
        std::fs::write(&cfg, text).expect("config");
        let pid = node.agent_pid().expect("agent pid");
        // SAFETY: kill(2) on the agent we started.
        unsafe { libc::kill(pid as i32, libc::SIGHUP) };
        std::thread::sleep(Duration::from_millis(500));
    };
    // Unsafe: the pool holding 10.64.0.x is gone. Refused, the old pools stay.
    hup("[[pools]]\ncidr = \"10.65.0.0/24\"\nblockSize = 28\n");
    assert!(
        node.agent_log().contains("pool change rejected")
            && node.agent_log().contains("10.64.0.0/24"),
        "{}",
        node.agent_log()
    );
    let b = rt.block_on(async {
        allocate(client(&node).await, "net.h-1".into())
            .await
            .expect("alloc")
    });
    assert!(b.to_string().starts_with("10.64.0."), "{b}");
    // Safe: disable the old pool, add a new one. New allocations come from the new one.
    hup("[[pools]]\ncidr = \"10.64.0.0/24\"\nblockSize = 28\ndisabled = true\n[[pools]]\ncidr = \"10.65.0.0/24\"\nblockSize = 28\n");
    let c = rt.block_on(async {
        allocate(client(&node).await, "net.h-2".into())
            .await
            .expect("alloc")
    });
    assert!(c.to_string().starts_with("10.65.0."), "{c}");
    // A config that does not parse is rejected as a whole.
    hup("[[pools]]\ncidr = \"not a cidr\"\n");
    assert!(
        node.agent_log().contains("config rejected"),
        "{}",
        node.agent_log()
    );
}

/// A runtime's own address request (CNI `ips`, outside Kubernetes) is checked like every
/// allocation: not in use in a block of an older block size, not inside another node's block,
/// not a pool's network or broadcast address. Two agents on one etcd; a's pool goes from
/// blockSize 26 to 28 (SIGHUP) under live blocks.
#[test]
fn a_requested_address_is_checked_like_every_allocation_across_block_sizes_and_nodes() {
    let etcd = EtcdNs::start();
    // The old size stays one the pool had (previousBlockSizes): its blocks still count.
    let pools = |bs: u8| {
        format!(
            "[[pools]]\ncidr = \"10.66.0.0/24\"\nblockSize = {bs}\npreviousBlockSizes = [{}]\n",
            if bs == 26 { "" } else { "26" }
        )
    };
    let a = Node::create(Dataplane::Kernel, None);
    let url = etcd.wire(&a.ns);
    let a = a.with_config(&etcd_config(&url, &pools(26)));
    a.start_agent();
    let b = etcd_node(&etcd, &pools(26));
    let rt = rt();
    let first = rt.block_on(async { allocate(client(&a).await, "net.a-0".into()).await });
    assert_eq!(
        first.expect("a"),
        "10.66.0.1".parse::<IpAddr>().expect("ip")
    );
    let other = rt.block_on(async { allocate(client(&b).await, "net.b-0".into()).await });
    assert_eq!(
        other.expect("b"),
        "10.66.0.64".parse::<IpAddr>().expect("ip")
    );
    std::fs::write(a.dir.join("agent.toml"), etcd_config(&url, &pools(28))).expect("config");
    let pid = a.agent_pid().expect("agent pid");
    // SAFETY: kill(2) on the agent this test started.
    unsafe { libc::kill(pid as i32, libc::SIGHUP) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while ipam_json(&a, "show")["pools"][0]["block_size"] != 28 {
        assert!(Instant::now() < deadline, "{}", a.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    let request = |handle: &str, addr: &str| {
        rt.block_on(async {
            client(&a)
                .await
                .allocate(pb::AllocateRequest {
                    handle: handle.into(),
                    ifname: "eth0".into(),
                    ipv4: true,
                    requested: vec![format!("{addr}/32")],
                    ..Default::default()
                })
                .await
        })
    };
    for (handle, addr, code, says) in [
        (
            "net.a-1",
            "10.66.0.1",
            tonic::Code::AlreadyExists,
            "10.66.0.1 is already in use".to_string(),
        ),
        (
            "net.a-2",
            "10.66.0.70",
            tonic::Code::FailedPrecondition,
            format!(
                "10.66.0.70 lies in block 10.66.0.64/26 of node {}",
                b.ns.name
            ),
        ),
        (
            "net.a-3",
            "10.66.0.0",
            tonic::Code::FailedPrecondition,
            "network address of pool 10.66.0.0/24".into(),
        ),
        (
            "net.a-4",
            "10.66.0.255",
            tonic::Code::FailedPrecondition,
            "broadcast address of pool 10.66.0.0/24".into(),
        ),
    ] {
        let e = request(handle, addr).expect_err(addr);
        assert_eq!(e.code(), code, "{addr}: {e:?}");
        assert!(e.message().contains(&says), "{addr}: {e:?}");
    }
    // A free address of a's old block takes no new block.
    let ok = request("net.a-5", "10.66.0.9").expect("10.66.0.9 in a's block");
    assert_eq!(ok.into_inner().addresses[0].address, "10.66.0.9/32");
    let check = ipam_json(&a, "check");
    assert!(findings_of(&check, "duplicate").is_empty(), "{check}");
    let show = ipam_json(&a, "show");
    let blocks: Vec<&str> = show["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .filter_map(|b| b["cidr"].as_str())
        .collect();
    assert_eq!(blocks, ["10.66.0.0/26", "10.66.0.64/26"], "{show}");
}

/// Issue 20, item 6: an agent restarted while the pool of its pods is gone (an IPPool deleted,
/// a pool shrunk or dropped from the config under live addresses) starts, keeps its pods'
/// network and addresses, allocates from the pools it has, and reports the refusal. Before,
/// its start-up check refused the pools and it exited, every restart.
#[test]
fn an_agent_restarted_without_the_pool_of_its_pods_starts_serves_them_and_reports_it() {
    let node = Node::create(
        Dataplane::Kernel,
        Some(
            "[ipam]\nleakCheckIntervalSecs = 1\nemptyBlockGraceSecs = 1\n\
             [[pools]]\ncidr = \"10.69.0.0/24\"\nblockSize = 28\n",
        ),
    );
    node.start_agent();
    let mut pod = Pod::add(&node, "p");
    let ip = pod.ip();
    assert!(ip.starts_with("10.69.0."), "{ip}");
    node.stop_agent();
    // --pool replaces the configured pools: 10.69.0.0/24 is gone.
    node.start_agent_with(&["--pool", "10.71.0.0/24"]);
    let log = node.agent_log();
    assert!(
        log.contains("pool change refused") && log.contains("10.69.0.0/28"),
        "{log}"
    );
    // Its pod keeps its network and its address.
    assert!(
        node.ns.ping(&ip, 2),
        "the pod at {ip} answers after the restart"
    );
    let check = pod.check();
    assert!(
        check.success,
        "CNI CHECK: {} {}",
        check.stdout, check.stderr
    );
    // New pods come from the pool it has.
    let mut other = Pod::add(&node, "q");
    assert!(other.ip().starts_with("10.71.0."), "{}", other.ip());
    // Reported: ipam check (exit 1) and /metrics.
    let out = node.calixctl(&["ipam", "check"]);
    assert_eq!(out.status.code(), Some(1));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("retained-block") && table.contains("10.69.0.0/28"),
        "{table}"
    );
    let (_, metrics) = node.http_get("/metrics").expect("/metrics");
    assert!(
        metrics.contains("calix_ipam_retained_blocks 1"),
        "{metrics}"
    );
    // Once the pod is gone, so is the retained block.
    pod.del();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !findings_of(&ipam_json(&node, "check"), "retained-block").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the block is still retained:\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    other.del();
}

/// Issue 20, item 6: no loop walks an edited block's address space. A block edited to
/// fd00:10::/64 (a pool of /122s), affine to this node and holding an allocation, written
/// straight into etcd: the agent's ipam show, /metrics and allocations answer at once. Before,
/// counting the block's free addresses walked 2^62 of them under the IPAM lock.
#[test]
fn an_edited_slash_64_block_never_locks_ipam() {
    let etcd = EtcdNs::start();
    let probe = Node::create(Dataplane::Kernel, None);
    let url = etcd.wire(&probe.ns);
    let node = probe.with_config(&etcd_config(
        &url,
        "[[pools]]\ncidr = \"10.72.0.0/24\"\nblockSize = 28\n\
         [[pools]]\ncidr = \"fd00:10::/48\"\nblockSize = 122\n",
    ));
    node.start_agent();
    let name = node.ns.name.clone();
    node.ns.run(move || {
        use calix_core::store::keys;
        use calix_datastore::{Datastore, Durability, EtcdConfig, EtcdStore, Op};
        let rt = rt();
        rt.block_on(async {
            let store = EtcdStore::connect(EtcdConfig {
                endpoints: vec![url],
                prefix: "/calix-test/".into(),
                timeout: Duration::from_secs(5),
                attempts: 3,
            })
            .await
            .expect("etcd");
            let cidr: ipnet::IpNet = "fd00:10::/64".parse().expect("cidr");
            let mut b = calix_core::ipam::Block::new(cidr, &name);
            b.allocations.insert(
                1,
                calix_core::ipam::Allocation {
                    handle: "edited".into(),
                    ifname: "eth0".into(),
                    node: name.clone(),
                    seq: 1,
                    attributes: Default::default(),
                },
            );
            store
                .txn(
                    &[],
                    &[Op::put_json(keys::block(&cidr), &b)],
                    Durability::Power,
                )
                .await
                .expect("edit")
                .expect("written");
        });
    });
    // In a thread of their own, bounded: before, each of these waited on the walk.
    let start = Instant::now();
    let node = std::sync::Arc::new(node);
    let (tx, rx) = std::sync::mpsc::channel();
    let n = node.clone();
    std::thread::spawn(move || {
        let v6 = rt().block_on(async {
            let ch = calix_proto::connect_unix(&n.socket, Duration::from_secs(10))
                .await
                .expect("connect");
            pb::ipam_client::IpamClient::new(ch)
                .allocate(pb::AllocateRequest {
                    handle: "net.v6".into(),
                    ifname: "eth0".into(),
                    ipv6: true,
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner().addresses[0].address.clone())
        });
        let show = ipam_json(&n, "show");
        let metrics = n.http_get("/metrics");
        let _ = tx.send((v6, show, metrics));
    });
    let (v6, show, metrics) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("IPAM did not answer within 30 s: it walks the /64");
    let took = start.elapsed();
    eprintln!("allocation, ipam show and /metrics beside the /64: {took:?}");
    // From a real /122 block of the pool, never from the edited /64.
    assert_eq!(v6.expect("IPv6 allocation"), "fd00:10::1/128");
    let blocks: Vec<&str> = show["blocks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["cidr"].as_str())
        .collect();
    assert_eq!(blocks, ["fd00:10::/122"], "{show}");
    assert!(show["free_v6"].as_u64() > Some(0), "{show}");
    let (code, metrics) = metrics.expect("/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("calix_ipam_ignored_blocks{rule=\"block_size\"} 1"),
        "{metrics}"
    );
    let check = ipam_json(&node, "check");
    assert_eq!(findings_of(&check, "ignored-block").len(), 1, "{check}");
}
