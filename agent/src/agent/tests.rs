//! The agent's IPAM logic over a real embedded store (a temporary directory) and a stand-in
//! dataplane; the real dataplane and the gRPC path are covered by the integration tests.
use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use calix_proto::handle;

use super::*;
use crate::datastore::{Compare, EmbeddedStore, KeyValue};

struct NoDataplane;

impl Dataplane for NoDataplane {
    fn attach(&mut self, _ep: &EndpointSpec) -> Result<Attached, DataplaneError> {
        Ok(Attached {
            ifindex: 1,
            bpf: false,
        })
    }
    fn detach(&mut self, _key: &str) -> Result<(), DataplaneError> {
        Ok(())
    }
    fn verify(
        &self,
        _ep: &EndpointSpec,
        _kernel: &mut dyn calix_kernel::host::HostKernel,
    ) -> Result<Vec<crate::dataplane::Drift>, DataplaneError> {
        Ok(Vec::new())
    }
    fn stats(&self) -> Result<Option<Box<dyn DataplaneStats>>, DataplaneError> {
        Ok(None)
    }
    fn set_pools(&mut self, _pools: &[ipnet::IpNet]) -> Result<(), DataplaneError> {
        Ok(())
    }
    fn reconcile(&mut self, _known: &[String]) -> Result<(), DataplaneError> {
        Ok(())
    }
    fn release(&mut self) {}
    fn uninstall(&mut self) {}
}

/// One store shared by several agents, as etcd would be.
struct Shared(Arc<EmbeddedStore>);

#[tonic::async_trait]
impl Datastore for Shared {
    fn kind(&self) -> &'static str {
        "shared"
    }
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, DatastoreError> {
        self.0.get(key).await
    }
    async fn list_with_revision(
        &self,
        prefix: &str,
    ) -> Result<(Vec<KeyValue>, i64), DatastoreError> {
        self.0.list_with_revision(prefix).await
    }
    async fn txn(
        &self,
        c: &[Compare],
        o: &[Op],
        d: Durability,
    ) -> Result<Option<i64>, DatastoreError> {
        self.0.txn(c, o, d).await
    }
    async fn sync(&self, revision: i64) -> Result<(), DatastoreError> {
        self.0.sync(revision).await
    }
}

fn pool(cidr: &str, bs: u8) -> Pool {
    Pool {
        cidr: cidr.parse().expect("cidr"),
        block_size: bs,
        disabled: false,
    }
}

const GRACE: Duration = Duration::from_secs(30);

async fn agent_on(
    store: &Arc<EmbeddedStore>,
    node: &str,
    pools: Vec<Pool>,
    policy: Policy,
) -> Agent {
    Agent::new(
        NodeRecord {
            name: node.into(),
            ..Default::default()
        },
        pools,
        policy,
        Housekeeping {
            leak_grace: GRACE,
            empty_block_grace: GRACE,
        },
        Box::new(Shared(store.clone())),
        Box::new(NoDataplane),
    )
    .await
    .expect("agent")
}

fn store() -> (tempfile::TempDir, Arc<EmbeddedStore>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = EmbeddedStore::open(&dir.path().join("store")).expect("store");
    (dir, Arc::new(s))
}

async fn alloc4(a: &Agent, h: &str) -> Result<IpAddr, AgentError> {
    a.allocate(h, "eth0", true, false, &[], &BTreeMap::new())
        .await
        .map(|(v, _)| v[0].0)
}

fn ep(cid: &str, handle: &str) -> EndpointRecord {
    EndpointRecord {
        container_id: cid.into(),
        ifname: "eth0".into(),
        host_ifname: format!("cali{cid}"),
        netns: String::new(),
        pod_namespace: String::new(),
        pod_name: String::new(),
        addresses: Vec::new(),
        handle: handle.into(),
        mac: String::new(),
        host_ifindex: 0,
    }
}

#[tokio::test]
async fn same_handle_same_addresses_and_dual_stack_is_one_write() {
    let (_d, s) = store();
    let a = agent_on(
        &s,
        "n1",
        vec![pool("10.1.0.0/24", 28), pool("fd00::/120", 124)],
        Policy::default(),
    )
    .await;
    let (first, already) = a
        .allocate("net.c1", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect("alloc");
    assert_eq!(first.len(), 2);
    assert!(!already);
    let (again, already) = a
        .allocate("net.c1", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect("again");
    assert_eq!((again.clone(), already), (first.clone(), true));
    assert_eq!(a.lookup("net.c1", "eth0").await.expect("lookup"), first);
    // Another ifname of the same container is another attachment.
    let other = alloc4(&a, "net.c2").await.expect("c2");
    assert_ne!(other, first[0].0);
    assert_eq!(a.release("net.c1", "eth0").await.expect("release").len(), 2);
    assert!(a.release("net.c1", "eth0").await.expect("again").is_empty());
    assert!(a.lookup("net.c1", "eth0").await.expect("lookup").is_empty());
}

#[tokio::test]
async fn v6_exhausted_rolls_back_the_v4_half() {
    let (_d, s) = store();
    let a = agent_on(
        &s,
        "n1",
        vec![pool("10.1.0.0/24", 28), pool("fd00::/127", 127)],
        Policy::default(),
    )
    .await;
    for i in 0..2 {
        a.allocate(&format!("h{i}"), "eth0", false, true, &[], &BTreeMap::new())
            .await
            .expect("v6");
    }
    let err = a
        .allocate("dual", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect_err("v6 full");
    assert!(err.to_string().contains("fd00::/127"), "{err}");
    let ipam = a.ipam().await.expect("ipam");
    assert_eq!(ipam.in_use(), 2, "the v4 half must not stay allocated");
}

#[tokio::test]
async fn two_agents_on_one_store_never_share_an_address_and_borrow_when_full() {
    let (_d, s) = store();
    // 4 blocks of 16 (62 usable): both nodes fill it concurrently.
    let pools = vec![pool("10.1.0.0/26", 28)];
    let a = Arc::new(agent_on(&s, "a", pools.clone(), Policy::default()).await);
    let b = Arc::new(agent_on(&s, "b", pools.clone(), Policy::default()).await);
    let mut tasks = Vec::new();
    for i in 0..31 {
        for (n, ag) in [("a", a.clone()), ("b", b.clone())] {
            tasks.push(tokio::spawn(async move {
                alloc4(&ag, &format!("{n}{i}")).await
            }));
        }
    }
    let mut seen = HashSet::new();
    for t in tasks {
        let addr = t.await.expect("join").expect("alloc");
        assert!(seen.insert(addr), "{addr} handed out twice");
    }
    assert_eq!(seen.len(), 62);
    let ipam = a.ipam().await.expect("ipam");
    assert_eq!(ipam.blocks.len(), 4);
    assert!(ipam
        .blocks
        .values()
        .all(|b| b.affinity == "a" || b.affinity == "b"));
    let err = alloc4(&a, "one-too-many").await.expect_err("full");
    assert!(err.to_string().contains("10.1.0.0/26"), "{err}");
    let check = a.ipam_check().await.expect("check");
    assert!(
        check.findings.iter().all(|f| f.kind == "leak"),
        "{:?}",
        check.findings
    );
}

#[tokio::test]
async fn borrowing_and_strict_affinity() {
    let (_d, s) = store();
    let pools = vec![pool("10.1.0.0/27", 28)];
    let a = agent_on(&s, "a", pools.clone(), Policy::default()).await;
    let b = agent_on(&s, "b", pools.clone(), Policy::default()).await;
    let strict = agent_on(
        &s,
        "c",
        pools.clone(),
        Policy {
            strict_affinity: true,
            ..Policy::default()
        },
    )
    .await;
    alloc4(&a, "a0").await.expect("a claims block 1");
    alloc4(&b, "b0").await.expect("b claims block 2");
    // No block left: c (strict) fails, b borrows from a's block once its own is full.
    let err = alloc4(&strict, "c0").await.expect_err("strict");
    assert!(err.to_string().contains("strictAffinity"), "{err}");
    for i in 1..15 {
        alloc4(&b, &format!("b{i}")).await.expect("b's own block");
    }
    let borrowed = alloc4(&b, "b15").await.expect("borrowed");
    let ipam = b.ipam().await.expect("ipam");
    let blk = ipam.block_of(borrowed).expect("block");
    assert_eq!(blk.affinity, "a");
    let report = a.ipam_report().await.expect("report");
    let ab = report
        .blocks
        .iter()
        .find(|x| x.affinity == "a")
        .expect("a's block");
    assert_eq!(ab.borrowed, 1);
}

#[tokio::test]
async fn leak_gc_waits_for_the_grace_period_and_spares_live_endpoints() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    let live = alloc4(&a, "net.live").await.expect("live");
    let leaked = alloc4(&a, "net.leaked").await.expect("leaked");
    a.register(ep("live", "net.live")).await.expect("register");
    let t0 = Instant::now();
    let first = a.housekeep(t0).await.expect("pass 1");
    assert_eq!((first.released.len(), first.candidates), (0, 1));
    let early = a.housekeep(t0 + GRACE / 2).await.expect("pass 2");
    assert!(early.released.is_empty());
    let due = a.housekeep(t0 + GRACE).await.expect("pass 3");
    assert_eq!(due.released, vec![leaked]);
    let ipam = a.ipam().await.expect("ipam");
    assert_eq!(ipam.in_use(), 1);
    assert!(ipam.block_of(live).is_some());
    assert!(a
        .lookup("net.leaked", "eth0")
        .await
        .expect("lookup")
        .is_empty());
    // A candidate that gets its endpoint in time is spared.
    alloc4(&a, "net.late").await.expect("late");
    a.housekeep(t0 + GRACE).await.expect("seen");
    a.register(ep("late", "net.late"))
        .await
        .expect("register late");
    let spared = a.housekeep(t0 + GRACE * 3).await.expect("spared");
    assert!(spared.released.is_empty());
}

#[tokio::test]
async fn empty_blocks_are_released_after_the_grace_period() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    alloc4(&a, "h").await.expect("alloc");
    a.release("h", "eth0").await.expect("release");
    let t0 = Instant::now();
    assert!(a.housekeep(t0).await.expect("1").blocks_released.is_empty());
    let done = a.housekeep(t0 + GRACE).await.expect("2");
    assert_eq!(done.blocks_released, vec!["10.1.0.0/28".to_string()]);
    assert!(a.ipam().await.expect("ipam").blocks.is_empty());
}

#[tokio::test]
async fn late_release_cannot_free_a_reallocated_address() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/30", 30)], Policy::default()).await;
    let first = alloc4(&a, "h1").await.expect("h1");
    let seq1 = a
        .ipam()
        .await
        .expect("ipam")
        .block_of(first)
        .expect("b")
        .allocations
        .values()
        .next()
        .expect("a")
        .seq;
    a.release("h1", "eth0").await.expect("release");
    let second = alloc4(&a, "h2").await.expect("h2");
    assert_eq!(first, second);
    assert!(!a
        .release_address(first, Some(seq1), "late")
        .await
        .expect("late release"));
    assert_eq!(a.lookup("h2", "eth0").await.expect("lookup").len(), 1);
    assert!(a
        .release_address(first, None, "operator")
        .await
        .expect("release"));
    assert!(a.lookup("h2", "eth0").await.expect("lookup").is_empty());
}

#[tokio::test]
async fn shrinking_a_pool_under_live_addresses_is_refused() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    alloc4(&a, "h").await.expect("alloc");
    let err = a
        .set_pools(vec![pool("10.1.0.128/25", 28)], Policy::default())
        .await
        .expect_err("shrink");
    let msg = err.to_string();
    assert!(
        msg.contains("10.1.0.0/24") && msg.contains("10.1.0.1"),
        "{msg}"
    );
    // Growing (or disabling) is fine.
    let mut disabled = pool("10.1.0.0/24", 28);
    disabled.disabled = true;
    a.set_pools(vec![disabled, pool("10.2.0.0/24", 28)], Policy::default())
        .await
        .expect("grow");
    let next = alloc4(&a, "h2").await.expect("from the new pool");
    assert!(next.to_string().starts_with("10.2.0."), "{next}");
    drop(a);
    // At startup too.
    let err = Agent::new(
        NodeRecord {
            name: "n1".into(),
            ..Default::default()
        },
        vec![pool("10.3.0.0/24", 28)],
        Policy::default(),
        Housekeeping {
            leak_grace: GRACE,
            empty_block_grace: GRACE,
        },
        Box::new(Shared(s.clone())),
        Box::new(NoDataplane),
    )
    .await
    .err()
    .expect("refused at startup");
    assert!(err.to_string().contains("10.1.0.1"), "{err}");
}

#[tokio::test]
async fn cni_gc_releases_only_invalid_attachments() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    for (net, cid) in [("net", "c1"), ("net", "c2"), ("other", "c3")] {
        alloc4(&a, &handle::encode(net, cid)).await.expect("alloc");
    }
    a.register(ep("c2", &handle::encode("net", "c2")))
        .await
        .expect("register");
    let valid = [("c1".to_string(), "eth0".to_string())]
        .into_iter()
        .collect();
    let (released, stale) = a.gc("net", &valid).await.expect("gc");
    assert_eq!(released.len(), 1);
    assert_eq!(stale.len(), 1);
    assert_eq!(a.ipam().await.expect("ipam").in_use(), 2);
    assert_eq!(
        a.lookup(&handle::encode("other", "c3"), "eth0")
            .await
            .expect("lookup")
            .len(),
        1
    );
    assert!(a.list().await.expect("list").is_empty());
    // A network name that is not one is refused, never matched loosely.
    assert!(matches!(
        a.gc("", &valid).await,
        Err(AgentError::Invalid(_))
    ));
}

/// The container ID attribute the CNI plugin stores with every allocation.
fn cid_attr(cid: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("containerID".to_string(), cid.to_string())])
}

#[tokio::test]
async fn cni_gc_of_a_network_spares_the_networks_it_is_a_prefix_of() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    // As the plugin made them before handles were unambiguous: "<network>.<containerID>".
    let mine = a
        .allocate("k8s.c1", "eth0", true, false, &[], &cid_attr("c1"))
        .await
        .expect("k8s/c1")
        .0[0]
        .0;
    let other = a
        .allocate("k8s.x.c2", "eth0", true, false, &[], &cid_attr("c2"))
        .await
        .expect("k8s.x/c2")
        .0[0]
        .0;
    a.register(ep("c1", "k8s.c1")).await.expect("register c1");
    a.register(ep("c2", "k8s.x.c2")).await.expect("register c2");
    let (released, stale) = a.gc("k8s", &HashSet::new()).await.expect("gc");
    assert_eq!(released, vec![mine], "GC of k8s released {released:?}");
    assert_eq!(
        stale
            .iter()
            .map(|e| e.container_id.as_str())
            .collect::<Vec<_>>(),
        vec!["c1"]
    );
    assert_eq!(
        a.lookup("k8s.x.c2", "eth0").await.expect("lookup"),
        vec![(other, "10.1.0.0/24".parse().expect("pool"))]
    );
    assert_eq!(a.list().await.expect("list").len(), 1);
}

/// The sequence number of the allocation holding `addr` now.
async fn seq_of(a: &Agent, addr: IpAddr) -> u64 {
    let ipam = a.ipam().await.expect("ipam");
    let b = ipam.block_of(addr).expect("block");
    b.allocations[&b.offset_of(addr).expect("offset")].seq
}

#[tokio::test]
async fn a_reclaimed_block_never_repeats_a_sequence_number() {
    let (_d, s) = store();
    // One block: the address comes back in the same block's next incarnation.
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/28", 28)], Policy::default()).await;
    let first = alloc4(&a, "h1").await.expect("h1");
    let seq1 = seq_of(&a, first).await;
    a.release("h1", "eth0").await.expect("release");
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    let done = a.housekeep(t0 + GRACE).await.expect("pass 2");
    assert_eq!(done.blocks_released.len(), 1);
    let second = alloc4(&a, "h2").await.expect("h2");
    assert_eq!(second, first, "the lowest free address again");
    let seq2 = seq_of(&a, second).await;
    assert_ne!(
        seq2, seq1,
        "a reclaimed block repeated sequence number {seq1}"
    );
    // A late release of the first allocation (leak GC, calixctl ipam release --from-report).
    assert!(!a
        .release_address(first, Some(seq1), "late")
        .await
        .expect("late release"));
    assert_eq!(a.lookup("h2", "eth0").await.expect("lookup").len(), 1);
}

#[tokio::test]
async fn an_agent_with_an_old_view_claiming_a_released_block_never_repeats_a_sequence_number() {
    let (_d, s) = store();
    let pools = vec![pool("10.1.0.0/28", 28)];
    let a = agent_on(&s, "a", pools.clone(), Policy::default()).await;
    // b reads the blocks now (none) and not again until a write of its own conflicts.
    let b = agent_on(&s, "b", pools, Policy::default()).await;
    let first = alloc4(&a, "ha").await.expect("a claims the block");
    let seq1 = seq_of(&a, first).await;
    a.release("ha", "eth0").await.expect("release");
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    let done = a.housekeep(t0 + GRACE).await.expect("pass 2");
    assert_eq!(done.blocks_released.len(), 1);
    // b still thinks the block was never claimed, and claims it.
    let second = alloc4(&b, "hb").await.expect("b claims the block");
    assert_eq!(second, first);
    let seq2 = seq_of(&b, second).await;
    assert_ne!(seq2, seq1, "b's claim repeated sequence number {seq1}");
    assert!(!a
        .release_address(first, Some(seq1), "late release by a")
        .await
        .expect("late release"));
    assert_eq!(b.lookup("hb", "eth0").await.expect("lookup").len(), 1);
}

#[tokio::test]
async fn cni_gc_with_new_handles_spares_the_networks_it_is_a_prefix_of() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    let (h1, h2) = (handle::encode("k8s", "c1"), handle::encode("k8s.x", "c2"));
    let mine = alloc4(&a, &h1).await.expect("k8s/c1");
    alloc4(&a, &h2).await.expect("k8s.x/c2");
    a.register(ep("c1", &h1)).await.expect("register");
    a.register(ep("c2", &h2)).await.expect("register");
    let (released, stale) = a.gc("k8s", &HashSet::new()).await.expect("gc");
    assert_eq!(released, vec![mine]);
    assert_eq!(stale.len(), 1);
    assert_eq!(a.lookup(&h2, "eth0").await.expect("lookup").len(), 1);
    // And GC of k8s.x finds its own.
    let (released, _) = a.gc("k8s.x", &HashSet::new()).await.expect("gc");
    assert_eq!(released.len(), 1);
}

/// An upgrade: allocations made by the previous plugin ("<network>.<containerID>", the
/// container ID as an attribute) are found, released and collected by the new plugin's calls,
/// which name the attachment with the new handle; an allocation the old encoding cannot tell
/// apart from them (another network's) is never taken for one.
#[tokio::test]
async fn allocations_of_the_previous_plugin_are_found_released_and_collected() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    let old = |net: &str, cid: &str| {
        let a = &a;
        let (net, cid) = (net.to_string(), cid.to_string());
        async move {
            a.allocate(
                &handle::legacy(&net, &cid),
                "eth0",
                true,
                false,
                &[],
                &cid_attr(&cid),
            )
            .await
            .expect("old allocation")
            .0[0]
                .0
        }
    };
    // CHECK (lookup) and DEL (release) of network a, container b.c.
    let abc = old("a", "b.c").await;
    let new = handle::encode("a", "b.c");
    assert_eq!(
        a.lookup(&new, "eth0").await.expect("lookup"),
        vec![(abc, "10.1.0.0/24".parse().expect("pool"))]
    );
    // Network a.b, container c: the same old handle text would be "a.b.c" too — it is not
    // this allocation's, so neither its lookup nor its release sees it.
    assert!(a
        .lookup(&handle::encode("a.b", "c"), "eth0")
        .await
        .expect("lookup")
        .is_empty());
    assert!(a
        .release(&handle::encode("a.b", "c"), "eth0")
        .await
        .expect("release")
        .is_empty());
    assert_eq!(a.release(&new, "eth0").await.expect("release"), vec![abc]);
    assert!(a.lookup(&new, "eth0").await.expect("lookup").is_empty());

    // DEL through the endpoint (the plugin's path): endpoint and address in one go.
    let d1 = old("net", "d1").await;
    a.register(ep("d1", &handle::legacy("net", "d1")))
        .await
        .expect("register");
    let (existed, released) = a
        .unregister("d1", "eth0", Some(&handle::encode("net", "d1")))
        .await
        .expect("unregister");
    assert!(existed);
    assert_eq!(released, vec![d1]);

    // GC: the old allocation of a container the runtime no longer lists goes; a kept one
    // and another network's stay.
    let gone = old("net", "g1").await;
    old("net", "keep").await;
    old("net.x", "g2").await;
    a.register(ep("g1", &handle::legacy("net", "g1")))
        .await
        .expect("register");
    let valid = [("keep".to_string(), "eth0".to_string())]
        .into_iter()
        .collect();
    let (released, stale) = a.gc("net", &valid).await.expect("gc");
    assert_eq!(released, vec![gone]);
    assert_eq!(stale.len(), 1);
    assert_eq!(a.ipam().await.expect("ipam").in_use(), 2);
}
