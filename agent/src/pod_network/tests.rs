//! The node's IPAM and endpoint logic over a real embedded store (a temporary directory), a
//! stand-in dataplane and an in-memory kernel; the real dataplane and the gRPC path are
//! covered by the integration tests.
use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use calix_core::ipam::HandleRecord;
use calix_core::model::NodeRecord;
use calix_core::store::keys;
use calix_core::store::KeyValue;
use calix_proto::handle;

use super::*;
use crate::endpoints::EndpointRegistry;
use crate::ipam::service::{CheckReport, Finding, Housekeeping};
use crate::notice::Recorded;
use crate::reconcile::driver::{Driver, Timing};
use calix_dataplane::{Attached, Dataplane, DataplaneError, EndpointSpec};
use calix_datastore::{Compare, Datastore, DatastoreError, Durability, EmbeddedStore, Op};
use calix_kernel::host::FakeHost;

struct NoDataplane;

impl Dataplane for NoDataplane {
    fn attach(&mut self, _ep: &EndpointSpec) -> Result<Attached, DataplaneError> {
        Ok(Attached {
            ifindex: 1,
            bpf: false,
        })
    }
}

/// One store shared by several agents, as etcd would be, that commits one object per
/// transaction, as the Kubernetes API does (a transaction over two keys is an error), and can be
/// told to fail writes: to play a crash between two writes, or a write that never lands.
struct TestStore {
    store: EmbeddedStore,
    /// Writes touching a key under one of these prefixes fail.
    fail_prefixes: std::sync::Mutex<Vec<String>>,
    /// When set, this many more writes succeed; every one after fails (the agent "died").
    writes_left: std::sync::Mutex<Option<usize>>,
    /// The next this many writes under the prefix land but are reported as a lost compare: a
    /// retried request whose first try landed (the kubernetes store across an API server
    /// restart; etcd when a response is lost).
    land_then_lose: std::sync::Mutex<Option<(String, usize)>>,
    /// Every prefix listed in full (not by node), in order.
    listed: std::sync::Mutex<Vec<String>>,
}

impl TestStore {
    /// Writes to keys under `prefix` fail from now on.
    fn fail(&self, prefix: &str) {
        self.fail_prefixes.lock().expect("lock").push(prefix.into());
    }
    /// `n` more writes succeed, then every write fails.
    fn crash_after_writes(&self, n: usize) {
        *self.writes_left.lock().expect("lock") = Some(n);
    }
    /// The next `n` writes under `prefix` land but report a lost compare.
    fn land_then_lose(&self, prefix: &str, n: usize) {
        *self.land_then_lose.lock().expect("lock") = Some((prefix.into(), n));
    }
    /// Every write succeeds again.
    fn heal(&self) {
        self.fail_prefixes.lock().expect("lock").clear();
        *self.writes_left.lock().expect("lock") = None;
    }
    async fn get(&self, key: &str) -> Option<KeyValue> {
        self.store.get(key).await.expect("get")
    }
}

struct Shared(Arc<TestStore>);

/// Every key a transaction compares or writes, once each.
fn txn_keys(c: &[Compare], o: &[Op]) -> Vec<String> {
    let mut keys: Vec<String> = c
        .iter()
        .map(|c| match c {
            Compare::Absent(k) | Compare::Revision(k, _) => k.clone(),
        })
        .chain(o.iter().map(|o| match o {
            Op::Put(k, _) | Op::Delete(k) => k.clone(),
        }))
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

#[tonic::async_trait]
impl Datastore for Shared {
    fn kind(&self) -> &'static str {
        "shared"
    }
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, DatastoreError> {
        self.0.store.get(key).await
    }
    async fn list_with_revision(
        &self,
        prefix: &str,
    ) -> Result<(Vec<KeyValue>, i64), DatastoreError> {
        self.0.listed.lock().expect("lock").push(prefix.into());
        self.0.store.list_with_revision(prefix).await
    }
    async fn list_of_node(
        &self,
        prefix: &str,
        node: &str,
    ) -> Result<Vec<KeyValue>, DatastoreError> {
        self.0.store.list_of_node(prefix, node).await
    }
    async fn txn(
        &self,
        c: &[Compare],
        o: &[Op],
        d: Durability,
    ) -> Result<Option<i64>, DatastoreError> {
        let keys = txn_keys(c, o);
        let injected = |detail: String| DatastoreError::Unavailable {
            backend: "test",
            attempts: 1,
            detail,
        };
        if keys.len() > 1 {
            return Err(DatastoreError::TooManyObjects {
                backend: "test",
                keys,
            });
        }
        if let Some(k) = keys.iter().find(|k| {
            let failing = self.0.fail_prefixes.lock().expect("lock");
            failing.iter().any(|p| k.starts_with(p.as_str()))
        }) {
            return Err(injected(format!("write of {k} failed (injected)")));
        }
        {
            let mut left = self.0.writes_left.lock().expect("lock");
            match left.as_mut() {
                Some(0) => return Err(injected(format!("write of {keys:?} after the crash"))),
                Some(n) => *n -= 1,
                None => {}
            }
        }
        let lose = {
            let mut l = self.0.land_then_lose.lock().expect("lock");
            match l.as_mut() {
                Some((p, n)) if *n > 0 && keys.iter().any(|k| k.starts_with(p.as_str())) => {
                    *n -= 1;
                    true
                }
                _ => false,
            }
        };
        let done = self.0.store.txn(c, o, d).await?;
        Ok(if lose { None } else { done })
    }
    async fn sync(&self, revision: i64) -> Result<(), DatastoreError> {
        self.0.store.sync(revision).await
    }
    async fn watch(
        &self,
        prefix: &str,
        after: i64,
    ) -> Result<calix_datastore::WatchStream, DatastoreError> {
        self.0.store.watch(prefix, after).await
    }
}

fn pool(cidr: &str, bs: u8) -> Pool {
    Pool {
        cidr: cidr.parse().expect("cidr"),
        block_size: bs,
        disabled: false,
        restricted: false,
        previous_block_sizes: Vec::new(),
    }
}

const GRACE: Duration = Duration::from_secs(30);

fn housekeeping() -> Housekeeping {
    Housekeeping {
        leak_grace: GRACE,
        empty_block_grace: GRACE,
    }
}

async fn agent_on(store: &Arc<TestStore>, node: &str, pools: Vec<Pool>, policy: Policy) -> Node {
    let shared: Arc<dyn Datastore> = Arc::new(Shared(store.clone()));
    let ipam = IpamService::new(
        NodeRecord {
            name: node.into(),
            ..Default::default()
        },
        pools,
        policy,
        housekeeping(),
        shared.clone(),
    )
    .await
    .expect("ipam");
    let driver = Driver::spawn(
        || Ok(FakeHost::default()),
        Box::new(NoDataplane),
        Default::default(),
        Timing {
            resync: Duration::from_secs(3600),
            backoff: crate::reconcile::Backoff::default(),
        },
    )
    .expect("driver");
    let endpoints = EndpointRegistry::load(node, shared, driver, None)
        .await
        .expect("registry");
    Node::new(ipam, endpoints)
}

fn store() -> (tempfile::TempDir, Arc<TestStore>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = EmbeddedStore::open(&dir.path().join("store")).expect("store");
    let s = TestStore {
        store,
        fail_prefixes: Default::default(),
        writes_left: Default::default(),
        land_then_lose: Default::default(),
        listed: Default::default(),
    };
    (dir, Arc::new(s))
}

async fn alloc4(a: &Node, h: &str) -> Result<IpAddr, AgentError> {
    a.ipam
        .allocate(h, "eth0", true, false, &[], &BTreeMap::new())
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
        pod_uid: String::new(),
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
        .ipam
        .allocate("net.c1", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect("alloc");
    assert_eq!(first.len(), 2);
    assert!(!already);
    let (again, already) = a
        .ipam
        .allocate("net.c1", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect("again");
    assert_eq!((again.clone(), already), (first.clone(), true));
    assert_eq!(
        a.ipam.lookup("net.c1", "eth0").await.expect("lookup"),
        first
    );
    // Another ifname of the same container is another attachment.
    let other = alloc4(&a, "net.c2").await.expect("c2");
    assert_ne!(other, first[0].0);
    assert_eq!(
        a.ipam
            .release("net.c1", "eth0")
            .await
            .expect("release")
            .len(),
        2
    );
    assert!(a
        .ipam
        .release("net.c1", "eth0")
        .await
        .expect("again")
        .is_empty());
    assert!(a
        .ipam
        .lookup("net.c1", "eth0")
        .await
        .expect("lookup")
        .is_empty());
}

#[tokio::test]
async fn v6_exhausted_rolls_back_the_v4_half() {
    let (_d, s) = store();
    let a = agent_on(
        &s,
        "n1",
        vec![pool("10.1.0.0/24", 28), pool("fd00::/126", 126)],
        Policy::default(),
    )
    .await;
    // fd00:: is reserved: three addresses.
    for i in 0..3 {
        a.ipam
            .allocate(&format!("h{i}"), "eth0", false, true, &[], &BTreeMap::new())
            .await
            .expect("v6");
    }
    let err = a
        .ipam
        .allocate("dual", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect_err("v6 full");
    assert!(err.to_string().contains("fd00::/126"), "{err}");
    let ipam = a.ipam.ipam().await.expect("ipam");
    assert_eq!(ipam.in_use(), 3, "the v4 half must not stay allocated");
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
    let ipam = a.ipam.ipam().await.expect("ipam");
    assert_eq!(ipam.blocks.len(), 4);
    assert!(ipam
        .blocks
        .values()
        .all(|b| b.affinity == "a" || b.affinity == "b"));
    let err = alloc4(&a, "one-too-many").await.expect_err("full");
    assert!(err.to_string().contains("10.1.0.0/26"), "{err}");
    let check = a.ipam.ipam_check().await.expect("check");
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
    let ipam = b.ipam.ipam().await.expect("ipam");
    let blk = ipam.block_of(borrowed).expect("block");
    assert_eq!(blk.affinity, "a");
    let report = a.ipam.ipam_report().await.expect("report");
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
    a.endpoints
        .register(ep("live", "net.live"))
        .await
        .expect("register");
    let t0 = Instant::now();
    let first = a.housekeep(t0).await.expect("pass 1");
    assert_eq!((first.released.len(), first.candidates), (0, 1));
    let early = a.housekeep(t0 + GRACE / 2).await.expect("pass 2");
    assert!(early.released.is_empty());
    let due = a.housekeep(t0 + GRACE).await.expect("pass 3");
    assert_eq!(due.released, vec![leaked]);
    let ipam = a.ipam.ipam().await.expect("ipam");
    assert_eq!(ipam.in_use(), 1);
    assert!(ipam.block_of(live).is_some());
    assert!(a
        .ipam
        .lookup("net.leaked", "eth0")
        .await
        .expect("lookup")
        .is_empty());
    // A candidate that gets its endpoint in time is spared.
    alloc4(&a, "net.late").await.expect("late");
    a.housekeep(t0 + GRACE).await.expect("seen");
    a.endpoints
        .register(ep("late", "net.late"))
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
    a.ipam.release("h", "eth0").await.expect("release");
    let t0 = Instant::now();
    assert!(a.housekeep(t0).await.expect("1").blocks_released.is_empty());
    let done = a.housekeep(t0 + GRACE).await.expect("2");
    assert_eq!(done.blocks_released, vec!["10.1.0.0/28".to_string()]);
    assert!(a.ipam.ipam().await.expect("ipam").blocks.is_empty());
}

#[tokio::test]
async fn late_release_cannot_free_a_reallocated_address() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/30", 30)], Policy::default()).await;
    let first = alloc4(&a, "h1").await.expect("h1");
    let seq1 = a
        .ipam
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
    a.ipam.release("h1", "eth0").await.expect("release");
    let second = alloc4(&a, "h2").await.expect("h2");
    assert_eq!(first, second);
    assert!(!a
        .ipam
        .release_address(first, Some(seq1), "late")
        .await
        .expect("late release"));
    assert_eq!(a.ipam.lookup("h2", "eth0").await.expect("lookup").len(), 1);
    assert!(a
        .ipam
        .release_address(first, None, "operator")
        .await
        .expect("release"));
    assert!(a
        .ipam
        .lookup("h2", "eth0")
        .await
        .expect("lookup")
        .is_empty());
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
}

/// Issue 20, item 6: an agent that restarts while its pool is gone (deleted or shrunk under
/// live addresses) starts, keeps what it holds, allocates from the pools it has, and reports
/// the refusal. Before, the startup check refused and the agent exited, in a loop.
#[tokio::test]
async fn a_restart_under_a_deleted_pool_starts_keeps_its_addresses_and_reports() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    let held = alloc4(&a, "h").await.expect("alloc");
    drop(a);
    let a = agent_on(&s, "n1", vec![pool("10.3.0.0/24", 28)], Policy::default()).await;
    let seen = Arc::new(Recorded::default());
    a.notices.set(seen.clone());
    let block: ipnet::IpNet = "10.1.0.0/28".parse().expect("cidr");
    assert_eq!(
        a.ipam.retained().iter().map(|p| p.cidr).collect::<Vec<_>>(),
        [block]
    );
    // What it holds is still its own: found by handle, the same ADD gets it back.
    let got = a.ipam.lookup("h", "eth0").await.expect("lookup");
    assert_eq!(got.iter().map(|(a, _)| *a).collect::<Vec<_>>(), [held]);
    let again = alloc4(&a, "h").await.expect("idempotent ADD");
    assert_eq!(again, held);
    // New addresses come from the configured pool only.
    let new = alloc4(&a, "h2").await.expect("from the new pool");
    assert!(new.to_string().starts_with("10.3.0."), "{new}");
    // Reported: a notice (Event), a check row, the metric.
    a.notice_ignored_blocks().await;
    let notices = seen.0.lock().expect("lock").clone();
    assert!(
        notices
            .iter()
            .any(|n| n.reason == "IPPoolRefused" && n.message.contains("10.1.0.0/28")),
        "{notices:?}"
    );
    let check = a.ipam.ipam_check().await.expect("check");
    assert!(
        check
            .findings
            .iter()
            .any(|f| f.kind == "retained-block" && f.block == "10.1.0.0/28"),
        "{:?}",
        check.findings
    );
    assert!(
        crate::ipam::service::report::retained_metrics(a.ipam.retained().len())
            .contains("calix_ipam_retained_blocks 1")
    );
    // Released: the retention ends, and the empty block goes.
    assert_eq!(a.ipam.release("h", "eth0").await.expect("release"), [held]);
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    assert!(a.ipam.retained().is_empty());
    a.housekeep(t0 + GRACE).await.expect("pass 2");
    assert!(
        s.get(&keys::block(&block)).await.is_none(),
        "the empty block outside every pool is deleted"
    );
}

#[tokio::test]
async fn cni_gc_releases_only_invalid_attachments() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    for (net, cid) in [("net", "c1"), ("net", "c2"), ("other", "c3")] {
        alloc4(&a, &handle::encode(net, cid)).await.expect("alloc");
    }
    a.endpoints
        .register(ep("c2", &handle::encode("net", "c2")))
        .await
        .expect("register");
    let valid = [("c1".to_string(), "eth0".to_string())]
        .into_iter()
        .collect();
    let (released, stale) = a.gc("net", &valid).await.expect("gc");
    assert_eq!(released.len(), 1);
    assert_eq!(stale.len(), 1);
    assert_eq!(a.ipam.ipam().await.expect("ipam").in_use(), 2);
    assert_eq!(
        a.ipam
            .lookup(&handle::encode("other", "c3"), "eth0")
            .await
            .expect("lookup")
            .len(),
        1
    );
    assert!(a.endpoints.list().await.expect("list").is_empty());
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
        .ipam
        .allocate("k8s.c1", "eth0", true, false, &[], &cid_attr("c1"))
        .await
        .expect("k8s/c1")
        .0[0]
        .0;
    let other = a
        .ipam
        .allocate("k8s.x.c2", "eth0", true, false, &[], &cid_attr("c2"))
        .await
        .expect("k8s.x/c2")
        .0[0]
        .0;
    a.endpoints
        .register(ep("c1", "k8s.c1"))
        .await
        .expect("register c1");
    a.endpoints
        .register(ep("c2", "k8s.x.c2"))
        .await
        .expect("register c2");
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
        a.ipam.lookup("k8s.x.c2", "eth0").await.expect("lookup"),
        vec![(other, "10.1.0.0/24".parse().expect("pool"))]
    );
    assert_eq!(a.endpoints.list().await.expect("list").len(), 1);
}

/// The sequence number of the allocation holding `addr` now.
async fn seq_of(a: &Node, addr: IpAddr) -> u64 {
    let ipam = a.ipam.ipam().await.expect("ipam");
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
    a.ipam.release("h1", "eth0").await.expect("release");
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
        .ipam
        .release_address(first, Some(seq1), "late")
        .await
        .expect("late release"));
    assert_eq!(a.ipam.lookup("h2", "eth0").await.expect("lookup").len(), 1);
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
    a.ipam.release("ha", "eth0").await.expect("release");
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
        .ipam
        .release_address(first, Some(seq1), "late release by a")
        .await
        .expect("late release"));
    assert_eq!(b.ipam.lookup("hb", "eth0").await.expect("lookup").len(), 1);
}

#[tokio::test]
async fn cni_gc_with_new_handles_spares_the_networks_it_is_a_prefix_of() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    let (h1, h2) = (handle::encode("k8s", "c1"), handle::encode("k8s.x", "c2"));
    let mine = alloc4(&a, &h1).await.expect("k8s/c1");
    alloc4(&a, &h2).await.expect("k8s.x/c2");
    a.endpoints.register(ep("c1", &h1)).await.expect("register");
    a.endpoints.register(ep("c2", &h2)).await.expect("register");
    let (released, stale) = a.gc("k8s", &HashSet::new()).await.expect("gc");
    assert_eq!(released, vec![mine]);
    assert_eq!(stale.len(), 1);
    assert_eq!(a.ipam.lookup(&h2, "eth0").await.expect("lookup").len(), 1);
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
            a.ipam
                .allocate(
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
        a.ipam.lookup(&new, "eth0").await.expect("lookup"),
        vec![(abc, "10.1.0.0/24".parse().expect("pool"))]
    );
    // Network a.b, container c: the same old handle text would be "a.b.c" too — it is not
    // this allocation's, so neither its lookup nor its release sees it.
    assert!(a
        .ipam
        .lookup(&handle::encode("a.b", "c"), "eth0")
        .await
        .expect("lookup")
        .is_empty());
    assert!(a
        .ipam
        .release(&handle::encode("a.b", "c"), "eth0")
        .await
        .expect("release")
        .is_empty());
    assert_eq!(
        a.ipam.release(&new, "eth0").await.expect("release"),
        vec![abc]
    );
    assert!(a
        .ipam
        .lookup(&new, "eth0")
        .await
        .expect("lookup")
        .is_empty());

    // DEL through the endpoint (the plugin's path): endpoint and address in one go.
    let d1 = old("net", "d1").await;
    a.endpoints
        .register(ep("d1", &handle::legacy("net", "d1")))
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
    a.endpoints
        .register(ep("g1", &handle::legacy("net", "g1")))
        .await
        .expect("register");
    let valid = [("keep".to_string(), "eth0".to_string())]
        .into_iter()
        .collect();
    let (released, stale) = a.gc("net", &valid).await.expect("gc");
    assert_eq!(released, vec![gone]);
    assert_eq!(stale.len(), 1);
    assert_eq!(a.ipam.ipam().await.expect("ipam").in_use(), 2);
}

fn dual_pools() -> Vec<Pool> {
    vec![pool("10.1.0.0/24", 28), pool("fd00::/120", 124)]
}

async fn handle_record(s: &TestStore, handle: &str) -> Option<HandleRecord> {
    s.get(&keys::handle(handle, "eth0"))
        .await
        .map(|kv| kv.decode().expect("handle record"))
}

fn orphans(check: &CheckReport) -> Vec<&Finding> {
    check
        .findings
        .iter()
        .filter(|f| f.kind.starts_with("orphan"))
        .collect()
}

/// The block is the commit point: a handle record that never got written (a crash right after
/// the block's commit, or the write failing) loses nothing. The allocation is found by handle,
/// the same handle gets the same addresses, and the record is rebuilt from the blocks at start.
#[tokio::test]
async fn an_allocation_whose_handle_record_was_never_written_is_found_and_repaired() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    let h = handle::encode("net", "c1");
    s.fail(keys::HANDLES);
    let (got, already) = a
        .ipam
        .allocate(&h, "eth0", true, true, &[], &cid_attr("c1"))
        .await
        .expect("a failed handle write must not fail a committed allocation");
    assert!(!already);
    assert_eq!(got.len(), 2);
    assert!(handle_record(&s, &h).await.is_none());
    assert_eq!(a.ipam.lookup(&h, "eth0").await.expect("lookup"), got);
    let (again, already) = a
        .ipam
        .allocate(&h, "eth0", true, true, &[], &cid_attr("c1"))
        .await
        .expect("again");
    assert_eq!((again, already), (got.clone(), true));
    // The agent dies; the next one rebuilds the record from the blocks.
    drop(a);
    s.heal();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    let rec = handle_record(&s, &h).await.expect("repaired at start");
    let mut held: Vec<(IpAddr, ipnet::IpNet)> =
        rec.addresses.iter().map(|x| (x.addr, x.pool)).collect();
    held.sort();
    let mut want = got.clone();
    want.sort();
    assert_eq!(held, want);
    let check = a.ipam.ipam_check().await.expect("check");
    assert!(orphans(&check).is_empty(), "{:?}", check.findings);
    assert_eq!(a.ipam.release(&h, "eth0").await.expect("release").len(), 2);
    assert!(handle_record(&s, &h).await.is_none());
}

/// A handle record left behind by a release (the blocks were written, the record's delete was
/// not) names addresses the handle no longer holds: reads ignore it, even once the address
/// belongs to someone else, and housekeeping deletes it.
#[tokio::test]
async fn a_stale_handle_record_is_ignored_and_repaired() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    let h1 = handle::encode("net", "c1");
    let first = alloc4(&a, &h1).await.expect("h1");
    s.fail(keys::HANDLES);
    assert_eq!(
        a.ipam
            .release(&h1, "eth0")
            .await
            .expect("the block release is the commit point"),
        vec![first]
    );
    assert!(handle_record(&s, &h1).await.is_some(), "the record stayed");
    assert!(a.ipam.lookup(&h1, "eth0").await.expect("lookup").is_empty());
    s.heal();
    // The address goes to another handle; h1's stale record still names it.
    let h2 = handle::encode("net", "c2");
    assert_eq!(alloc4(&a, &h2).await.expect("h2"), first);
    assert!(a.ipam.lookup(&h1, "eth0").await.expect("lookup").is_empty());
    let (again, already) = a
        .ipam
        .allocate(&h1, "eth0", true, false, &[], &BTreeMap::new())
        .await
        .expect("h1 again");
    assert!(!already);
    assert_ne!(again[0].0, first, "{first} handed out twice");
    a.ipam.release(&h1, "eth0").await.expect("release");
    // Once more with the record left behind, then housekeeping.
    alloc4(&a, &h1).await.expect("h1");
    s.fail(keys::HANDLES);
    a.ipam.release(&h1, "eth0").await.expect("release");
    s.heal();
    assert!(handle_record(&s, &h1).await.is_some());
    a.housekeep(Instant::now()).await.expect("housekeep");
    assert!(handle_record(&s, &h1).await.is_none(), "stale record kept");
    let check = a.ipam.ipam_check().await.expect("check");
    assert!(orphans(&check).is_empty(), "{:?}", check.findings);
}

/// A dual-stack allocation is two commits. An agent that dies between them leaves one family
/// allocated, without a handle record or an endpoint: found by handle after the restart, and
/// reclaimed by leak GC.
#[tokio::test]
async fn a_crash_between_the_halves_of_a_dual_stack_allocation_leaves_what_leak_gc_reclaims() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    let h = handle::encode("net", "c1");
    s.crash_after_writes(1);
    a.ipam
        .allocate(&h, "eth0", true, true, &[], &cid_attr("c1"))
        .await
        .expect_err("the agent died after the first half");
    drop(a);
    s.heal();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    let held = a.ipam.lookup(&h, "eth0").await.expect("lookup");
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(a.ipam.ipam().await.expect("ipam").in_use(), 1);
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    let done = a.housekeep(t0 + GRACE).await.expect("pass 2");
    assert_eq!(done.released, vec![held[0].0]);
    assert_eq!(a.ipam.ipam().await.expect("ipam").in_use(), 0);
    assert!(handle_record(&s, &h).await.is_none());
    let check = a.ipam.ipam_check().await.expect("check");
    assert!(check.findings.is_empty(), "{:?}", check.findings);
}

/// The same window, closed by the plugin's DEL instead: it releases the half that landed.
#[tokio::test]
async fn a_del_after_a_crash_between_the_halves_releases_the_half_that_landed() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    let h = handle::encode("net", "c1");
    s.crash_after_writes(1);
    a.ipam
        .allocate(&h, "eth0", true, true, &[], &cid_attr("c1"))
        .await
        .expect_err("the agent died after the first half");
    drop(a);
    s.heal();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    let (existed, released) = a
        .unregister("c1", "eth0", Some(&h))
        .await
        .expect("unregister");
    assert!(!existed);
    assert_eq!(released.len(), 1);
    assert_eq!(a.ipam.ipam().await.expect("ipam").in_use(), 0);
}

/// A failure of the second half's commit rolls the first back.
#[tokio::test]
async fn a_failed_second_half_is_rolled_back() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    // Claim both blocks first, so each half is a write to an existing block.
    a.ipam
        .allocate("warm", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect("warm");
    let v6_block = keys::block(&"fd00::/124".parse().expect("cidr"));
    s.fail(&v6_block);
    a.ipam
        .allocate("dual", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect_err("the IPv6 half cannot be written");
    s.heal();
    assert_eq!(
        a.ipam.ipam().await.expect("ipam").in_use(),
        2,
        "the IPv4 half stayed"
    );
    assert!(a
        .ipam
        .lookup("dual", "eth0")
        .await
        .expect("lookup")
        .is_empty());
}

/// Unregister with release is two writes: the endpoint record first, then the addresses. An
/// agent that dies between them leaves an allocation without an endpoint, which leak GC
/// reclaims; never an endpoint record whose address is free for the next pod.
#[tokio::test]
async fn a_crash_inside_unregister_leaves_an_allocation_leak_gc_reclaims() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    let h = handle::encode("net", "c1");
    let addr = alloc4(&a, &h).await.expect("alloc");
    a.endpoints.register(ep("c1", &h)).await.expect("register");
    s.crash_after_writes(1);
    a.unregister("c1", "eth0", Some(&h))
        .await
        .expect_err("died after the first write");
    drop(a);
    s.heal();
    assert!(
        s.get(&keys::endpoint("n1", "c1", "eth0")).await.is_none(),
        "the endpoint record must go first"
    );
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    let done = a.housekeep(t0 + GRACE).await.expect("pass 2");
    assert_eq!(done.released, vec![addr]);
}

/// A new sandbox on the same host interface retires the older one's record: two writes.
#[tokio::test]
async fn a_new_sandbox_retires_the_older_ones_record() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    let mut old = ep("c1", "net:c1");
    old.host_ifname = "calipod".into();
    let mut new = ep("c2", "net:c2");
    new.host_ifname = "calipod".into();
    a.endpoints.register(old).await.expect("old sandbox");
    a.endpoints.register(new).await.expect("new sandbox");
    assert!(s.get(&keys::endpoint("n1", "c1", "eth0")).await.is_none());
    assert!(s.get(&keys::endpoint("n1", "c2", "eth0")).await.is_some());
    assert_eq!(a.endpoints.list().await.expect("list").len(), 1);
}

/// A block released by an agent of the previous version left an `ipam/retired/` record (and no
/// block). A claim starts above its sequence number; housekeeping folds the record into the
/// block object, which from then on carries the sequence across releases.
#[tokio::test]
async fn a_retired_record_of_the_previous_version_is_honoured_and_folded_into_the_block() {
    let (_d, s) = store();
    let cidr: ipnet::IpNet = "10.1.0.0/28".parse().expect("cidr");
    s.store
        .txn(
            &[],
            &[Op::put_json(
                keys::retired(&cidr),
                &calix_core::ipam::Retired {
                    cidr,
                    next_seq: 1_000_000,
                    revision: 0,
                },
            )],
            Durability::Power,
        )
        .await
        .expect("txn")
        .expect("applied");
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/28", 28)], Policy::default()).await;
    let addr = alloc4(&a, "h1").await.expect("claim");
    assert!(seq_of(&a, addr).await >= 1_000_000);
    a.ipam.release("h1", "eth0").await.expect("release");
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    a.housekeep(t0 + GRACE).await.expect("pass 2");
    assert!(
        s.get(&keys::retired(&cidr)).await.is_none(),
        "the retired record was not folded into the block"
    );
    let again = alloc4(&a, "h2").await.expect("reclaim");
    assert!(seq_of(&a, again).await > 1_000_000);
}

/// A pool's blockSize changes: blocks of the old layout, empty or released, are deleted rather
/// than kept, so the new layout's blocks can be claimed where they were; their sequence
/// numbers still never repeat.
#[tokio::test]
async fn blocks_of_an_old_layout_are_deleted_so_the_new_layout_can_be_claimed() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    // Two /28 blocks: one released under the old layout, one still claimed and empty.
    let first = alloc4(&a, "h1").await.expect("h1");
    let seq1 = seq_of(&a, first).await;
    a.ipam
        .allocate(
            "h2",
            "eth0",
            true,
            false,
            &["10.1.0.17".parse().expect("ip")],
            &BTreeMap::new(),
        )
        .await
        .expect("h2 in the second block");
    a.ipam.release("h1", "eth0").await.expect("release");
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    let done = a.housekeep(t0 + GRACE).await.expect("pass 2");
    assert_eq!(done.blocks_released, vec!["10.1.0.0/28".to_string()]);
    // (Leak GC released h2 meanwhile: it has no endpoint.)
    assert!(a
        .ipam
        .lookup("h2", "eth0")
        .await
        .expect("lookup")
        .is_empty());
    a.set_pools(vec![pool("10.1.0.0/24", 26)], Policy::default())
        .await
        .expect("new layout");
    let t1 = t0 + GRACE * 2;
    let done = a.housekeep(t1).await.expect("pass 3");
    assert_eq!(done.blocks_released, vec!["10.1.0.16/28".to_string()]);
    let ipam = a.ipam.ipam().await.expect("ipam");
    assert!(
        ipam.blocks.is_empty() && ipam.retired.is_empty(),
        "old layout left behind: {:?} {:?}",
        ipam.blocks.keys().collect::<Vec<_>>(),
        ipam.retired.keys().collect::<Vec<_>>()
    );
    let again = alloc4(&a, "h3").await.expect("h3");
    assert_eq!(again, first, "the new layout's first block is claimed");
    assert!(a
        .ipam
        .ipam()
        .await
        .expect("ipam")
        .blocks
        .contains_key("10.1.0.0/26"));
    assert!(seq_of(&a, again).await > seq1);
}

/// This node's affinity records, as (node, block) from the store.
async fn affinities(s: &TestStore, node: &str) -> Vec<String> {
    s.store
        .list(&keys::affinities_of(node))
        .await
        .expect("list")
        .iter()
        .map(|kv| {
            let r: calix_core::ipam::AffinityRecord = kv.decode().expect("affinity record");
            assert_eq!(r.node, node);
            r.cidr.to_string()
        })
        .collect()
}

/// One affinity record per block affine to a node (Calico's BlockAffinity): written right
/// after the claim, gone with the release, listed by node without reading the blocks; one that
/// failed to land (or a stray one) is repaired from the blocks, and `ipam check` names both.
#[tokio::test]
async fn affinity_records_follow_the_blocks_and_are_repaired_from_them() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    let b = agent_on(&s, "n2", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    for i in 0..17 {
        alloc4(&a, &format!("h{i}")).await.expect("alloc");
    }
    alloc4(&b, "g").await.expect("alloc");
    assert_eq!(affinities(&s, "n1").await, ["10.1.0.0/28", "10.1.0.16/28"]);
    assert_eq!(affinities(&s, "n2").await, ["10.1.0.32/28"]);
    // A claim whose record write fails: the allocation stands, check finds the gap,
    // housekeeping fills it.
    s.fail(keys::AFFINITIES);
    for i in 17..33 {
        alloc4(&a, &format!("h{i}")).await.expect("alloc");
    }
    s.heal();
    assert_eq!(affinities(&s, "n1").await.len(), 2);
    let check = a.ipam.ipam_check().await.expect("check");
    let missing: Vec<&str> = check
        .findings
        .iter()
        .filter(|f| f.kind == "missing-affinity")
        .map(|f| f.block.as_str())
        .collect();
    assert_eq!(missing, ["10.1.0.48/28"], "{:?}", check.findings);
    // A stray record (a block n1 does not hold).
    let stray = keys::affinity("n1", &"10.1.0.128/28".parse().expect("cidr"));
    s.store
        .txn(
            &[],
            &[Op::put_json(
                stray.clone(),
                &calix_core::ipam::AffinityRecord {
                    node: "n1".into(),
                    cidr: "10.1.0.128/28".parse().expect("cidr"),
                },
            )],
            Durability::Process,
        )
        .await
        .expect("put");
    let check = a.ipam.ipam_check().await.expect("check");
    assert!(
        check.findings.iter().any(|f| f.kind == "orphan-affinity"),
        "{:?}",
        check.findings
    );
    let swept = a.housekeep(Instant::now()).await.expect("housekeep");
    assert_eq!(swept.affinities_repaired, 2, "{swept:?}");
    assert_eq!(
        affinities(&s, "n1").await,
        ["10.1.0.0/28", "10.1.0.16/28", "10.1.0.48/28"]
    );
    let check = a.ipam.ipam_check().await.expect("check");
    assert!(
        !check.findings.iter().any(|f| f.kind.ends_with("affinity")),
        "{:?}",
        check.findings
    );
    // Released blocks take their records with them.
    for i in 0..33 {
        a.ipam
            .release(&format!("h{i}"), "eth0")
            .await
            .expect("release");
    }
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("1");
    let done = a.housekeep(t0 + GRACE).await.expect("2");
    assert_eq!(done.blocks_released.len(), 3, "{done:?}");
    assert!(affinities(&s, "n1").await.is_empty());
    assert_eq!(affinities(&s, "n2").await, ["10.1.0.32/28"]);
}

/// A block write that lands but is reported as a lost compare (a retried request whose first
/// try landed: the kubernetes store when the API server restarts mid-write) is the handle's
/// allocation: the agent finds it on the fresh listing and answers with it. Before, it decided
/// again and allocated a second address to the same handle, answering with that one.
#[tokio::test]
async fn a_block_write_that_landed_but_reported_a_lost_race_is_the_allocation() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    alloc4(&a, "warm").await.expect("the block is claimed");
    s.land_then_lose(keys::BLOCKS, 1);
    let (got, _) = a
        .ipam
        .allocate("h", "eth0", true, true, &[], &BTreeMap::new())
        .await
        .expect("allocate");
    let held = a.ipam.lookup("h", "eth0").await.expect("lookup");
    let mut want = got.clone();
    want.sort();
    let mut held_sorted = held.clone();
    held_sorted.sort();
    assert_eq!(
        held_sorted, want,
        "the handle holds what it was answered, and only that"
    );
    let check = a.ipam.ipam_check().await.expect("check");
    assert!(orphans(&check).is_empty(), "{:?}", check.findings);
}

/// Issue 20, item 8: repairing handle records reads this node's handles, never every handle
/// of the cluster (with the kubernetes datastore the API server selects them by label).
#[tokio::test]
async fn handle_repair_lists_only_this_nodes_handles() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    let b = agent_on(&s, "n2", dual_pools(), Policy::default()).await;
    let (ha, hb) = (handle::encode("net", "ca"), handle::encode("net", "cb"));
    // Records that fail to land: the next start and housekeeping repair them.
    s.fail(keys::HANDLES);
    a.ipam
        .allocate(&ha, "eth0", true, false, &[], &cid_attr("ca"))
        .await
        .expect("a");
    b.ipam
        .allocate(&hb, "eth0", true, false, &[], &cid_attr("cb"))
        .await
        .expect("b");
    s.heal();
    s.listed.lock().expect("lock").clear();
    drop(a);
    let a = agent_on(&s, "n1", dual_pools(), Policy::default()).await;
    assert!(handle_record(&s, &ha).await.is_some(), "repaired at start");
    assert!(
        handle_record(&s, &hb).await.is_none(),
        "n2's is n2's to repair"
    );
    let full: Vec<String> = s.listed.lock().expect("lock").clone();
    assert!(
        !full.iter().any(|p| keys::HANDLES.starts_with(p.as_str())),
        "listed every handle of the cluster: {full:?}"
    );
    drop((a, b));
}

/// An agent writes only what is its node's (the kubernetes datastore's node authority refuses
/// the rest; etcd would let it through): another node's address is not released through this
/// node's agent (calixctl on its socket names the owner and the way to do it), and a release
/// by handle frees only this node's own allocations of it.
#[tokio::test]
async fn an_agent_releases_only_its_own_nodes_addresses() {
    let (_d, s) = store();
    let pools = vec![pool("10.1.0.0/24", 26)];
    let a = agent_on(&s, "a", pools.clone(), Policy::default()).await;
    let b = agent_on(&s, "b", pools, Policy::default()).await;
    let h = handle::encode("net", "cb");
    let theirs = alloc4(&b, &h).await.expect("b allocates");
    let e = a
        .ipam
        .release_address(theirs, None, "calixctl ipam release --ip, on node a")
        .await
        .expect_err("b's address, released through a");
    assert!(
        matches!(&e, AgentError::ForeignAllocation { node, addr } if node == "b" && *addr == theirs),
        "{e}"
    );
    assert!(e.to_string().contains("calixctl --kubeconfig"), "{e}");
    assert_eq!(
        a.ipam.release(&h, "eth0").await.expect("release on a"),
        Vec::<IpAddr>::new(),
        "a released b's allocation of the handle"
    );
    assert_eq!(
        b.ipam.lookup(&h, "eth0").await.expect("lookup")[0].0,
        theirs
    );
    assert_eq!(
        handle_record(&s, &h).await.expect("b's handle record").node,
        "b"
    );
    // A late release naming another allocation's sequence number is no release at all.
    assert!(!a
        .ipam
        .release_address(theirs, Some(u64::MAX), "late")
        .await
        .expect("a late release"));
    assert_eq!(
        b.ipam.release(&h, "eth0").await.expect("release on b"),
        vec![theirs]
    );
}

/// A handle record that names another node (stale, or forged) at a key this node's allocation
/// uses is that node's to fix (or an operator's): the repair leaves it, writing nothing.
#[tokio::test]
async fn the_repair_leaves_a_handle_record_of_another_node() {
    let (_d, s) = store();
    let a = agent_on(&s, "a", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    let h = handle::encode("net", "ca");
    alloc4(&a, &h).await.expect("a allocates");
    let key = keys::handle(&h, "eth0");
    let other = HandleRecord {
        node: "b".into(),
        addresses: Vec::new(),
    };
    s.store
        .txn(
            &[],
            &[Op::put_json(key.clone(), &other)],
            Durability::Process,
        )
        .await
        .expect("another node's record");
    let before = s.get(&key).await.expect("the record").revision;
    drop(a);
    // The next agent repairs the handle records at start.
    let _a = agent_on(&s, "a", vec![pool("10.1.0.0/24", 26)], Policy::default()).await;
    let after = s.get(&key).await.expect("the record");
    assert_eq!(
        after.revision, before,
        "another node's handle record was rewritten"
    );
    assert_eq!(after.decode::<HandleRecord>().expect("record").node, "b");
}

/// Writes `value` at `key` as a stolen agent token (or a hand edit) would: no compare, any
/// bytes.
async fn forge(s: &TestStore, key: &str, value: &[u8]) {
    s.store
        .txn(
            &[],
            &[Op::Put(key.to_string(), value.to_vec())],
            Durability::Process,
        )
        .await
        .expect("forge")
        .expect("written");
}

/// A block object as JSON: `cidr` affine to `node`, one allocation by `node` per offset.
fn forged_block(cidr: &str, node: &str, offsets: &[u32]) -> Vec<u8> {
    let allocations: serde_json::Map<String, serde_json::Value> = offsets
        .iter()
        .map(|o| {
            (
                o.to_string(),
                serde_json::json!({"handle": format!("forged-{o}"), "ifname": "eth0",
                    "node": node, "seq": 1}),
            )
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "cidr": cidr, "affinity": node, "allocations": allocations, "next_seq": 2
    }))
    .expect("json")
}

fn block_key(cidr: &str) -> String {
    keys::block(&cidr.parse().expect("cidr"))
}

fn ignored_rows(check: &CheckReport) -> Vec<(String, String)> {
    check
        .findings
        .iter()
        .filter(|f| f.kind == "ignored-block")
        .map(|f| (f.block.clone(), f.rule.clone()))
        .collect()
}

/// Issue 20, item 6: a block object that does not decode used to fail every listing of the
/// blocks, so every allocation on every node. Now it is skipped and reported.
#[tokio::test]
async fn a_block_that_does_not_decode_fails_no_allocation_and_is_reported() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    forge(&s, "ipam/blocks/10.1.0.64-28", b"{\"cidr\": 7").await;
    forge(&s, "ipam/blocks/10.1.0.80-28", b"not json at all").await;
    let got = alloc4(&a, "h1")
        .await
        .expect("allocation beside bad blocks");
    assert!(got.to_string().starts_with("10.1.0."), "{got}");
    // ...and an agent starting on such a store starts.
    let b = agent_on(&s, "n2", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    alloc4(&b, "h2").await.expect("n2 allocates");
    let check = b.ipam.ipam_check().await.expect("check");
    let rows = ignored_rows(&check);
    assert!(
        rows.contains(&("ipam/blocks/10.1.0.64-28".into(), "undecodable".into()))
            && rows.contains(&("ipam/blocks/10.1.0.80-28".into(), "undecodable".into())),
        "{:?}",
        check.findings
    );
    assert_eq!(b.ipam.ignored().await.len(), 2);
}

/// Issue 20, item 1a: forged blocks affine to a rogue node — a /32 over a victim's address, a
/// default route's 0.0.0.0/0 — do not count. Before, 0.0.0.0/0 overlapped every block a claim
/// could make, so no node could claim a block any more.
#[tokio::test]
async fn forged_blocks_do_not_count_and_do_not_stop_claims() {
    let (_d, s) = store();
    let pools = vec![pool("10.1.0.0/24", 28)];
    let victim = agent_on(&s, "victim", pools.clone(), Policy::default()).await;
    let first = alloc4(&victim, "v1").await.expect("victim's first");
    forge(
        &s,
        &block_key("0.0.0.0/0"),
        &forged_block("0.0.0.0/0", "rogue", &[1]),
    )
    .await;
    let slash32 = format!("{first}/32");
    forge(
        &s,
        &block_key(&slash32),
        &forged_block(&slash32, "rogue", &[0]),
    )
    .await;
    // A victim's block key holding another CIDR.
    forge(
        &s,
        &block_key("10.1.0.128/28"),
        &forged_block("10.1.0.0/25", "rogue", &[]),
    )
    .await;
    let other = agent_on(&s, "other", pools.clone(), Policy::default()).await;
    let got = alloc4(&other, "o1")
        .await
        .expect("another node still claims a block");
    assert_ne!(got, first);
    let mine = alloc4(&victim, "v2").await.expect("the victim goes on");
    assert_ne!(mine, first);
    let ipam = other.ipam.ipam().await.expect("view");
    let blocks: Vec<&String> = ipam.blocks.keys().collect();
    assert_eq!(
        blocks.len(),
        2,
        "only the two real blocks count: {blocks:?}"
    );
    let check = other.ipam.ipam_check().await.expect("check");
    let rows = ignored_rows(&check);
    for want in [
        ("0.0.0.0/0".to_string(), "outside_pools".to_string()),
        (slash32.clone(), "block_size".into()),
        ("10.1.0.0/25".into(), "key_mismatch".into()),
    ] {
        assert!(rows.contains(&want), "{want:?} not in {rows:?}");
    }
    // ipam show lists neither as a block.
    let show = other.ipam.ipam_report().await.expect("show");
    assert!(
        show.blocks.iter().all(|b| b.affinity != "rogue"),
        "{:?}",
        show.blocks
    );
}

/// Issue 20, item 6: no loop walks an edited block's address space. A "block" edited to
/// fd00::/64 inside a pool of /122s, affine to this node: before, counting its free addresses
/// (STATUS, /metrics, ipam show) walked 2^62 of them under the IPAM lock, and every allocation
/// behind it waited.
#[test]
fn an_edited_slash_64_block_locks_nothing() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (_d, s) = store();
            let pools = vec![pool("10.1.0.0/24", 28), pool("fd00::/48", 122)];
            let a = agent_on(&s, "n1", pools, Policy::default()).await;
            forge(
                &s,
                &block_key("fd00::/64"),
                &forged_block("fd00::/64", "n1", &[1]),
            )
            .await;
            let v6 = a
                .ipam
                .allocate("h", "eth0", false, true, &[], &BTreeMap::new())
                .await
                .map(|(v, _)| v[0].0);
            let free = a.ipam.free().await;
            let report = a.ipam.ipam_report().await.map(|r| r.free_v6);
            let _ = tx.send((
                v6.map_err(|e| e.to_string()),
                free,
                report.map_err(|e| e.to_string()),
            ));
        });
    });
    let (v6, free, report) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("IPAM did not answer within 20 s: it walks the /64");
    let v6 = v6.expect("v6 allocation");
    let fd00_122: ipnet::IpNet = "fd00::/122".parse().expect("cidr");
    assert!(fd00_122.contains(&v6), "{v6}: from a real /122 block");
    assert!(free.1 > 0, "{free:?}");
    assert_eq!(report.expect("report"), free.1);
}

/// The IPAM writes never create a block that would not count: here a specific address whose
/// /28 sits inside another node's /26 (a size the pool had before).
#[tokio::test]
async fn no_write_creates_a_block_overlapping_one_that_counts() {
    let (_d, s) = store();
    let mut p = pool("10.1.0.0/24", 28);
    p.previous_block_sizes = vec![26];
    let other = agent_on(&s, "n2", vec![p.clone()], Policy::default()).await;
    forge(
        &s,
        &block_key("10.1.0.0/26"),
        &forged_block("10.1.0.0/26", "n2", &[5]),
    )
    .await;
    drop(other);
    let a = agent_on(&s, "n1", vec![p], Policy::default()).await;
    let inside: IpAddr = "10.1.0.20".parse().expect("ip");
    let r = a
        .ipam
        .allocate("h", "eth0", true, false, &[inside], &BTreeMap::new())
        .await;
    assert!(
        r.is_err(),
        "allocated {r:?} in a block overlapping n2's /26"
    );
    assert!(
        s.get(&block_key("10.1.0.16/28")).await.is_none(),
        "an overlapping /28 was stored"
    );
    // Automatic allocation claims beside it.
    let got = alloc4(&a, "h2").await.expect("alloc");
    assert!(
        !"10.1.0.0/26"
            .parse::<ipnet::IpNet>()
            .expect("cidr")
            .contains(&got),
        "{got}"
    );
}

/// Every ignored block is a Warning notice on the node (an Event in Kubernetes), once, and a
/// `calix_ipam_ignored_blocks{rule}` gauge.
#[tokio::test]
async fn an_ignored_block_is_noticed_once_and_counted() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.1.0.0/24", 28)], Policy::default()).await;
    let seen = Arc::new(Recorded::default());
    a.notices.set(seen.clone());
    forge(
        &s,
        &block_key("0.0.0.0/0"),
        &forged_block("0.0.0.0/0", "rogue", &[]),
    )
    .await;
    alloc4(&a, "h").await.expect("alloc");
    let t0 = Instant::now();
    a.housekeep(t0).await.expect("pass 1");
    a.housekeep(t0 + Duration::from_secs(1))
        .await
        .expect("pass 2");
    let notices = seen.0.lock().expect("lock").clone();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert_eq!(notices[0].reason, "IPAMBlockIgnored");
    assert!(
        notices[0].message.contains("0.0.0.0-0") && notices[0].message.contains("outside_pools"),
        "{}",
        notices[0].message
    );
    let metrics = crate::ipam::service::report::ignored_metrics(&a.ipam.ignored().await);
    assert!(
        metrics.contains("calix_ipam_ignored_blocks{rule=\"outside_pools\"} 1")
            && metrics.contains("calix_ipam_ignored_blocks{rule=\"overlap\"} 0"),
        "{metrics}"
    );
}

/// The overlap attack on IPAM: a rogue writes a block of a size the pool really had before
/// (/24) over the victim's /26, holding fake allocations. The older block wins: the victim's
/// block still counts and it goes on allocating in it; the rogue's is ignored (`overlap`) and
/// kept clear of by claims.
#[tokio::test]
async fn an_older_size_block_over_a_victims_block_loses() {
    let (_d, s) = store();
    let mut p = pool("10.1.0.0/16", 26);
    p.previous_block_sizes = vec![24];
    let victim = agent_on(&s, "victim", vec![p.clone()], Policy::default()).await;
    let first = alloc4(&victim, "v1").await.expect("victim's first");
    forge(
        &s,
        &block_key("10.1.0.0/24"),
        &forged_block("10.1.0.0/24", "rogue", &[1, 2, 3, 100]),
    )
    .await;
    let second = alloc4(&victim, "v2").await.expect("victim's second");
    let ipam = victim.ipam.ipam().await.expect("view");
    assert_eq!(
        ipam.blocks.keys().collect::<Vec<_>>(),
        ["10.1.0.0/26"],
        "{first} {second}"
    );
    let other = agent_on(&s, "other", vec![p], Policy::default()).await;
    let theirs = alloc4(&other, "o1").await.expect("another node claims");
    let rogue_block: ipnet::IpNet = "10.1.0.0/24".parse().expect("cidr");
    assert!(
        !rogue_block.contains(&theirs),
        "{theirs}: claimed inside the rogue's /24"
    );
    let check = other.ipam.ipam_check().await.expect("check");
    assert!(
        ignored_rows(&check).contains(&("10.1.0.0/24".into(), "overlap".into())),
        "{:?}",
        check.findings
    );
}

/// A pod directory that knows one pod, `tenant/web`, with a fixed address and one pool; it
/// records what it was asked.
#[derive(Default)]
struct FakePods {
    asked: std::sync::Mutex<Vec<Asked>>,
}

/// One question to [`FakePods::ipam`]: namespace, name, the node's pools, the families.
type Asked = (String, String, Vec<ipnet::IpNet>, (bool, bool));

#[tonic::async_trait]
impl PodDirectory for FakePods {
    fn pod(&self, namespace: &str, name: &str) -> Option<PodInfo> {
        (namespace == "tenant" && name == "web").then(|| PodInfo {
            uid: "u1".into(),
            phase: "Running".into(),
            ..PodInfo::default()
        })
    }

    async fn ipam(
        &self,
        namespace: &str,
        name: &str,
        node_pools: &[Pool],
        families: (bool, bool),
    ) -> Result<PodIpam, AgentError> {
        self.asked.lock().expect("lock").push((
            namespace.into(),
            name.into(),
            node_pools.iter().map(|p| p.cidr).collect(),
            families,
        ));
        Ok(PodIpam {
            pools: calix_core::ipam::PoolChoice {
                v4: Some(vec!["10.9.0.0/16".parse().expect("cidr")]),
                v6: Some(Vec::new()),
            },
            addresses: vec!["10.9.0.7".parse().expect("ip")],
        })
    }
}

/// The node asks its pod directory about the pod an allocation names, with its own pools;
/// an allocation that names no pod, or a node without a directory, has the default pools.
#[tokio::test]
async fn the_pod_directory_is_asked_for_the_pod_an_allocation_names() {
    let (_d, s) = store();
    let a = agent_on(&s, "n1", vec![pool("10.9.0.0/16", 26)], Policy::default()).await;
    let attrs = |ns: &str, pod: &str| -> BTreeMap<String, String> {
        [("namespace", ns), ("pod", pod)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    // No directory (another datastore than kubernetes): nothing to ask.
    assert_eq!(
        a.pod_ipam(&attrs("tenant", "web"), (true, false))
            .await
            .expect("no directory"),
        None
    );
    assert_eq!(a.pod("tenant", "web"), None);
    let pods = Arc::new(FakePods::default());
    assert!(a.pods.set(pods.clone()).is_ok());
    let asked = a
        .pod_ipam(&attrs("tenant", "web"), (true, false))
        .await
        .expect("asked")
        .expect("a pod");
    assert_eq!(asked.addresses, ["10.9.0.7".parse::<IpAddr>().expect("ip")]);
    assert_eq!(
        *pods.asked.lock().expect("lock"),
        [(
            "tenant".to_string(),
            "web".to_string(),
            vec!["10.9.0.0/16".parse().expect("cidr")],
            (true, false)
        )]
    );
    // An allocation that names no pod (another runtime) is not asked about.
    for (ns, pod) in [("", "web"), ("tenant", "")] {
        assert_eq!(
            a.pod_ipam(&attrs(ns, pod), (true, false))
                .await
                .expect("no pod"),
            None
        );
    }
    assert_eq!(pods.asked.lock().expect("lock").len(), 1);
    assert_eq!(a.pod("tenant", "web").map(|p| p.uid).as_deref(), Some("u1"));
    assert_eq!(a.pod("tenant", "db"), None);
}
