//! `KubeStore` against a real kube-apiserver (v1.36.2, `../shared/k8s`) on a real etcd, one
//! API server per test on 127.0.0.1 (calix's CRDs applied from charts/calix/crds): the
//! datastore conformance suite (tests/conformance), then what is the Kubernetes backend's own
//! (every kind with real records and hostile names, listings across kinds, the watch cache's
//! 410, watches the server rotates, the follower across an API server restart, refusals).
//!
//! The suite runs with the API server's watch cache off, so that every watch is served by etcd
//! as on the other backends (etcd's compaction then shows as 410 Gone); the tests after it run
//! with the cache on, as clusters do.
#[macro_use]
mod conformance;

use std::sync::Arc;
use std::time::Duration;

use calix_core::ipam::{Allocation, Block, HandleRecord, Held};
use calix_core::model::{EndpointRecord, NodeRecord};
use calix_core::store::WatchEvent;
use calix_datastore::follow::Follower;
use calix_datastore::{Compare, Datastore, DatastoreError, Durability, KubeConfig, KubeStore, Op};
use calix_proto::etcd::etcdserverpb::{kv_client::KvClient, CompactionRequest};
use calix_testbed::KubeApi;
use futures::StreamExt;

const P: Durability = Durability::Power;

async fn store(api: &KubeApi) -> KubeStore {
    KubeStore::connect(&KubeConfig {
        kubeconfig: Some(api.kubeconfig()),
        timeout: Duration::from_secs(5),
        attempts: 30,
    })
    .await
    .expect("connect")
}

/// An API server of its own, its watch cache off; the suite's keys are node records
/// (`nodes/<key>`, the value the record's `agent_version`).
struct Kube {
    api: KubeApi,
}

impl Kube {
    fn start() -> Self {
        Self {
            api: KubeApi::on_loopback(false),
        }
    }
}

#[tonic::async_trait]
impl conformance::Backend for Kube {
    type Store = KubeStore;

    async fn open(&self) -> KubeStore {
        store(&self.api).await
    }

    async fn compact(&self, _store: &KubeStore, revision: i64) {
        let channel = tonic::transport::Endpoint::from_shared(self.api.etcd_url())
            .expect("url")
            .connect()
            .await
            .expect("connect to the API server's etcd");
        KvClient::new(channel)
            .compact(CompactionRequest {
                revision,
                physical: true,
            })
            .await
            .expect("compact");
    }

    async fn restart(&self, store: KubeStore) -> KubeStore {
        // On this thread: the API server dies with the thread that starts it.
        self.api.restart_apiserver();
        store
    }

    fn key(&self, key: &str) -> String {
        format!("nodes/{key}")
    }

    fn suite_key(&self, stored: &str) -> String {
        stored
            .strip_prefix("nodes/")
            .unwrap_or_else(|| panic!("{stored} is not a suite key"))
            .to_string()
    }

    fn value(&self, value: &str) -> Vec<u8> {
        serde_json::to_vec(&NodeRecord {
            name: "conformance".into(),
            agent_version: value.into(),
            ..NodeRecord::default()
        })
        .expect("json")
    }

    fn suite_value(&self, stored: &[u8]) -> String {
        serde_json::from_slice::<NodeRecord>(stored)
            .expect("a node record")
            .agent_version
    }
}

datastore_conformance!(Kube::start());

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("json")
}

async fn create(db: &KubeStore, key: &str, value: Vec<u8>) -> i64 {
    db.txn(
        &[Compare::Absent(key.into())],
        &[Op::Put(key.into(), value)],
        P,
    )
    .await
    .unwrap_or_else(|e| panic!("create {key}: {e}"))
    .unwrap_or_else(|| panic!("{key} existed"))
}

fn block(cidr: &str, node: &str, handle: &str) -> Block {
    let mut b = Block::new(cidr.parse().expect("cidr"), node);
    b.allocations.insert(
        3,
        Allocation {
            handle: handle.into(),
            ifname: "eth0".into(),
            node: node.into(),
            seq: 1,
            attributes: [("pod".to_string(), "ns/p".to_string())].into(),
        },
    );
    b.next_seq = 2;
    b
}

fn endpoint(cid: &str) -> EndpointRecord {
    EndpointRecord {
        container_id: cid.into(),
        ifname: "eth0".into(),
        host_ifname: "cali0123456789a".into(),
        netns: "/run/netns/x".into(),
        pod_namespace: "default".into(),
        pod_name: "p".into(),
        pod_uid: "0d4a3b36-5d1f-4c39-9d2e-6f7b7c2a1f10".into(),
        addresses: vec!["10.0.0.3/32".into()],
        handle: format!("k8s-pod-network:{cid}"),
        mac: "ee:ee:ee:ee:ee:ee".into(),
        host_ifindex: 7,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_holds_real_records_under_hostile_names() {
    let api = KubeApi::on_loopback(true);
    let db = store(&api).await;
    let handle = "k8s-pod-network:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let blocks = [
        (
            "ipam/blocks/10.244.0.64-26",
            block("10.244.0.64/26", "node-a", handle),
        ),
        (
            "ipam/blocks/fd00--40-122",
            block("fd00::40/122", "Node A/Ünïcode", handle),
        ),
    ];
    for (key, b) in &blocks {
        create(&db, key, json(b)).await;
        let kv = db.get(key).await.expect("get").expect("block");
        let back: Block = kv.decode().expect("a block");
        assert_eq!(back.allocations, b.allocations, "{key}");
        assert_eq!(
            (back.cidr, &back.affinity, back.next_seq),
            (b.cidr, &b.affinity, b.next_seq)
        );
    }
    // Handles: `<network>:<containerID>/<ifname>`, and worse.
    let held = HandleRecord {
        node: "node-a".into(),
        addresses: vec![Held {
            addr: "10.244.0.67".parse().expect("ip"),
            pool: "10.244.0.0/16".parse().expect("cidr"),
            seq: 1,
        }],
    };
    let handle_keys = [
        format!("ipam/handles/{handle}/eth0"),
        format!("ipam/handles/{handle}/eth1"),
        "ipam/handles/UPPER:case/eth0".to_string(),
        "ipam/handles/upper:case/eth0".to_string(),
        "ipam/handles/a.b:c/net1".to_string(),
        format!("ipam/handles/{}:x/eth0", "n".repeat(400)),
        "ipam/handles/x--aaaaaaaaaaaaaaaa:x/eth0".to_string(),
    ];
    for k in &handle_keys {
        create(&db, k, json(&held)).await;
    }
    let (handles, _) = db.list_with_revision("ipam/handles/").await.expect("list");
    let mut want: Vec<&str> = handle_keys.iter().map(String::as_str).collect();
    want.sort();
    assert_eq!(
        handles.iter().map(|kv| kv.key.as_str()).collect::<Vec<_>>(),
        want
    );
    for kv in &handles {
        assert_eq!(kv.decode::<HandleRecord>().expect("handle"), held);
    }
    // Endpoints by node: n1's listing holds neither n10's nor N1's.
    for node in ["n1", "n10", "N1", "node with spaces"] {
        for cid in ["c1", "c2"] {
            create(
                &db,
                &format!("endpoints/{node}/{cid}/eth0"),
                json(&endpoint(cid)),
            )
            .await;
        }
    }
    let (n1, _) = db.list_with_revision("endpoints/n1/").await.expect("list");
    assert_eq!(
        n1.iter().map(|kv| kv.key.as_str()).collect::<Vec<_>>(),
        ["endpoints/n1/c1/eth0", "endpoints/n1/c2/eth0"]
    );
    assert_eq!(
        n1[0].decode::<EndpointRecord>().expect("endpoint"),
        endpoint("c1")
    );
    let (odd, _) = db
        .list_with_revision("endpoints/node with spaces/")
        .await
        .expect("list");
    assert_eq!(odd.len(), 2);
    let (all, _) = db.list_with_revision("endpoints/").await.expect("list");
    assert_eq!(all.len(), 8);
    // A listing across kinds is one snapshot, in key order.
    let (ipam, _) = db.list_with_revision("ipam/").await.expect("list");
    assert_eq!(ipam.len(), blocks.len() + handle_keys.len());
    assert!(ipam.windows(2).all(|w| w[0].key < w[1].key));
    // ... but a watch is one kind.
    match db.watch("ipam/", 0).await {
        Err(DatastoreError::Unwatchable { .. }) => {}
        other => panic!("a watch across kinds: {:?}", other.map(|_| "a stream")),
    }
    // The objects as kubectl shows them: readable names, the node label.
    let objects = api.with_client(|c| async move {
        let ar = kube::api::ApiResource {
            group: "calix.dev".into(),
            version: "v1".into(),
            api_version: "calix.dev/v1".into(),
            kind: "IPAMBlock".into(),
            plural: "ipamblocks".into(),
        };
        let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(c, &ar);
        api.list(&Default::default())
            .await
            .expect("list ipamblocks")
            .items
    });
    let names: Vec<String> = objects
        .iter()
        .filter_map(|o| o.metadata.name.clone())
        .collect();
    assert_eq!(names, ["10.244.0.64-26", "fd00--40-122"]);
    assert_eq!(
        objects[0]
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("calix.dev/node"))
            .map(String::as_str),
        Some("node-a")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_writes_are_refused_and_change_nothing() {
    let api = KubeApi::on_loopback(true);
    let db = store(&api).await;
    let node = json(&NodeRecord {
        name: "a".into(),
        ..NodeRecord::default()
    });
    // Not a JSON object; not calix's key space; two objects at once.
    for (key, value) in [
        ("nodes/a", b"1".to_vec()),
        ("nodes/a", b"not json".to_vec()),
    ] {
        match db.txn(&[], &[Op::Put(key.into(), value)], P).await {
            Err(DatastoreError::BadValue { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    match db
        .txn(&[], &[Op::Put("other/a".into(), node.clone())], P)
        .await
    {
        Err(DatastoreError::OutsideKeySpace { .. }) => {}
        other => panic!("{other:?}"),
    }
    match db
        .txn(
            &[Compare::Absent("nodes/b".into())],
            &[Op::Put("nodes/a".into(), node.clone())],
            P,
        )
        .await
    {
        Err(DatastoreError::TooManyObjects { .. }) => {}
        other => panic!("{other:?}"),
    }
    // A value the CRD's schema refuses (a block whose next_seq is text).
    match db
        .txn(
            &[],
            &[Op::Put(
                "ipam/blocks/10.0.0.0-26".into(),
                br#"{"cidr":"10.0.0.0/26","affinity":"a","allocations":{},"next_seq":"many"}"#
                    .to_vec(),
            )],
            P,
        )
        .await
    {
        Err(DatastoreError::Rejected { code: 422, .. }) => {}
        other => panic!("{other:?}"),
    }
    // A field the CRD does not know (a newer agent on older CRDs): refused, not pruned.
    match db
        .txn(
            &[],
            &[Op::Put(
                "nodes/c".into(),
                br#"{"name":"c","addresses":[],"labels":{},"agent_version":"","new_field":1}"#
                    .to_vec(),
            )],
            P,
        )
        .await
    {
        Err(DatastoreError::Rejected { detail, .. }) => {
            assert!(detail.contains("new_field"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(db.list("nodes/a").await.expect("list"), vec![]);
    assert_eq!(db.get("ipam/blocks/10.0.0.0-26").await.expect("get"), None);
    // Keys with no object (the previous version's retired blocks) read as absent.
    assert_eq!(db.list("ipam/retired/").await.expect("list"), vec![]);
    // An object whose key annotation names another key (made by hand, or a name collision):
    // never read as that key's.
    create(&db, "nodes/x", node.clone()).await;
    api.with_client(|c| async move {
        let ar = kube::api::ApiResource {
            group: "calix.dev".into(),
            version: "v1".into(),
            api_version: "calix.dev/v1".into(),
            kind: "CalixNode".into(),
            plural: "calixnodes".into(),
        };
        let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(c, &ar);
        let patch = serde_json::json!({"metadata": {"annotations": {"calix.dev/key": "nodes/y"}}});
        api.patch(
            "x",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .expect("forge");
    });
    match db.get("nodes/x").await {
        Err(DatastoreError::BadValue { .. }) => {}
        other => panic!("a forged object read as nodes/x: {other:?}"),
    }
    assert_eq!(db.get("nodes/y").await.expect("get"), None);
    assert_eq!(db.list("nodes/").await.expect("list"), vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_caches_410_is_compacted_and_a_rotated_watch_loses_nothing() {
    let api = KubeApi::on_loopback(true);
    let db = store(&api).await.with_watch_secs(2);
    let node = |v: &str| {
        json(&NodeRecord {
            name: v.into(),
            ..NodeRecord::default()
        })
    };
    let r1 = create(&db, "nodes/a", node("a")).await;
    // Older than the cache holds (it starts when the CRD is established, after revision 1).
    let mut w = db.watch("nodes/", 1).await.expect("watch");
    match tokio::time::timeout(Duration::from_secs(15), w.next()).await {
        Ok(Some(Err(DatastoreError::Compacted { after, compacted }))) => {
            assert_eq!(after, 1);
            assert!(
                compacted > 1 && compacted <= r1,
                "compacted {compacted}, r1 {r1}"
            );
        }
        other => panic!("expected Compacted, got {other:?}"),
    }
    // The server ends each watch request after 2 s; the stream goes on across them.
    let mut w = db.watch("nodes/", r1).await.expect("watch");
    let mut expect = Vec::new();
    for i in 0..4 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // Changes of other keys of the kind (filtered out) move the place it resumes from.
        create(&db, &format!("nodes/other{i}"), node("o")).await;
        let key = format!("nodes/a{i}");
        expect.push((key.clone(), create(&db, &key, node("x")).await));
    }
    let mut w2 = db.watch("nodes/a", r1).await.expect("watch");
    for (key, rev) in &expect {
        match tokio::time::timeout(Duration::from_secs(15), w2.next()).await {
            Ok(Some(Ok(WatchEvent::Put(kv)))) => assert_eq!((&kv.key, kv.revision), (key, *rev)),
            other => panic!("expected {key}, got {other:?}"),
        }
    }
    // From revision 0: what exists now, in revision order, then what follows.
    let mut w0 = db.watch("nodes/a", 0).await.expect("watch");
    let mut want = vec![("nodes/a".to_string(), r1)];
    want.extend(expect.iter().cloned());
    let late = create(&db, "nodes/a9", node("x")).await;
    want.push(("nodes/a9".to_string(), late));
    for (key, rev) in &want {
        match tokio::time::timeout(Duration::from_secs(15), w0.next()).await {
            Ok(Some(Ok(WatchEvent::Put(kv)))) => assert_eq!((&kv.key, kv.revision), (key, *rev)),
            other => panic!("expected {key}, got {other:?}"),
        }
    }
    let mut got = Vec::new();
    while got.len() < 9 {
        match tokio::time::timeout(Duration::from_secs(15), w.next()).await {
            Ok(Some(Ok(e))) => got.push(e.key().to_string()),
            other => panic!("after {got:?}: {other:?}"),
        }
    }
    assert_eq!(got.len(), 9, "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_survives_an_api_server_restart_and_a_410() {
    let api = KubeApi::on_loopback(true);
    let db = Arc::new(store(&api).await);
    let ep = |cid: &str| json(&endpoint(cid));
    create(&db, "endpoints/n1/a/eth0", ep("a")).await;
    create(&db, "endpoints/n1/b/eth0", ep("b")).await;
    create(&db, "endpoints/n2/z/eth0", ep("z")).await;
    let mut f = Follower::start(db.clone(), "endpoints/n1/")
        .await
        .expect("start");
    assert_eq!(f.known().len(), 2);
    create(&db, "endpoints/n1/c/eth0", ep("c")).await;
    assert_eq!(next(&mut f).await.key(), "endpoints/n1/c/eth0");
    // The API server goes away; when it is back its cache starts after the follower's
    // revision (410): the follower lists again and delivers the difference.
    api.kill_apiserver();
    api.start_apiserver().expect("start the API server");
    db.txn(&[], &[Op::Delete("endpoints/n1/a/eth0".into())], P)
        .await
        .expect("delete")
        .expect("applied");
    create(&db, "endpoints/n1/d/eth0", ep("d")).await;
    create(&db, "endpoints/n2/y/eth0", ep("y")).await;
    let mut seen = std::collections::BTreeMap::new();
    while seen.len() < 2 {
        let e = next(&mut f).await;
        seen.insert(e.key().to_string(), matches!(e, WatchEvent::Put(_)));
    }
    assert_eq!(seen.get("endpoints/n1/a/eth0"), Some(&false), "{seen:?}");
    assert_eq!(seen.get("endpoints/n1/d/eth0"), Some(&true), "{seen:?}");
    let keys: Vec<&str> = f.known().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "endpoints/n1/b/eth0",
            "endpoints/n1/c/eth0",
            "endpoints/n1/d/eth0"
        ]
    );
    // And it follows on.
    create(&db, "endpoints/n1/e/eth0", ep("e")).await;
    assert_eq!(next(&mut f).await.key(), "endpoints/n1/e/eth0");
}

async fn next(f: &mut Follower) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(60), f.next())
        .await
        .expect("a change within 60 s")
}

/// Issue 20, item 8: a node lists its own handles alone: the API server selects them by the
/// `calix.dev/node` label, and a label that disagrees with the record's node (a hand edit) does
/// not make another node's record this node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lists_only_its_own_handles() {
    let api = KubeApi::on_loopback(true);
    let db = store(&api).await;
    let handle = |node: &str| HandleRecord {
        node: node.into(),
        addresses: vec![Held {
            addr: "10.0.0.3".parse().expect("ip"),
            pool: "10.0.0.0/16".parse().expect("cidr"),
            seq: 1,
        }],
    };
    let long = "n".repeat(70); // a label value too long: the hashed form
    for (key, node) in [
        ("ipam/handles/net:a1/eth0", "n1"),
        ("ipam/handles/net:a2/eth0", "n1"),
        ("ipam/handles/net:b1/eth0", "n2"),
        ("ipam/handles/net:b2/eth0", "n2"),
        ("ipam/handles/net:l1/eth0", long.as_str()),
    ] {
        create(&db, key, json(&handle(node))).await;
    }
    let keys = |kvs: Vec<calix_core::store::KeyValue>| -> Vec<String> {
        kvs.into_iter().map(|kv| kv.key).collect()
    };
    let mine = db
        .list_of_node("ipam/handles/", "n1")
        .await
        .expect("list n1's");
    assert_eq!(
        keys(mine),
        ["ipam/handles/net:a1/eth0", "ipam/handles/net:a2/eth0"]
    );
    assert_eq!(
        keys(db.list_of_node("ipam/handles/", &long).await.expect("list")),
        ["ipam/handles/net:l1/eth0"]
    );
    // n2's record relabelled n1 by hand: selected by the server, dropped by its node.
    let name = db.list("ipam/handles/net:b1/").await.expect("list").len();
    assert_eq!(name, 1);
    api.with_client(|c| async move {
        let ar = kube::api::ApiResource {
            group: "calix.dev".into(),
            version: "v1".into(),
            api_version: "calix.dev/v1".into(),
            kind: "IPAMHandle".into(),
            plural: "ipamhandles".into(),
        };
        let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(c, &ar);
        let list = api.list(&Default::default()).await.expect("list handles");
        let b1 = list
            .items
            .iter()
            .find(|o| {
                o.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("calix.dev/key"))
                    == Some(&"ipam/handles/net:b1/eth0".to_string())
            })
            .and_then(|o| o.metadata.name.clone())
            .expect("b1's object");
        let patch = serde_json::json!({"metadata": {"labels": {"calix.dev/node": "n1"}}});
        api.patch(
            &b1,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .expect("relabel");
    });
    assert_eq!(
        keys(db.list_of_node("ipam/handles/", "n1").await.expect("list")),
        ["ipam/handles/net:a1/eth0", "ipam/handles/net:a2/eth0"]
    );
    assert_eq!(
        keys(db.list_of_node("ipam/handles/", "n2").await.expect("list")),
        ["ipam/handles/net:b2/eth0"],
        "the relabelled record is out of n2's selection (the label decides the listing)"
    );
}
