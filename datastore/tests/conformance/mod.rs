//! The datastore conformance suite: what every [`Datastore`] backend must do, as test functions
//! generic over a [`Backend`]. A backend runs the whole suite from a test file of its own:
//!
//! ```ignore
//! #[macro_use]
//! mod conformance;
//! struct MyBackend { /* ... */ }
//! #[tonic::async_trait]
//! impl conformance::Backend for MyBackend { /* open, compact, restart */ }
//! datastore_conformance!(MyBackend::start());
//! ```
//!
//! Each case becomes a test of its own, on a backend of its own (`$backend` is evaluated per
//! test). The suite asks only for what a Kubernetes backend can give: every transaction compares
//! and writes one key. Waits are bounded ([`WAIT`]): a watch that stops delivering fails the test
//! instead of hanging it.
#![allow(dead_code)] // Each backend's test file uses the suite through the macro.

use std::time::Duration;

use calix_core::store::KeyValue;
use calix_core::store::WatchEvent;
use calix_datastore::{Compare, Datastore, DatastoreError, Durability, Op, WatchStream};
use futures::StreamExt;

/// The longest a case waits for one watch item.
pub const WAIT: Duration = Duration::from_secs(15);

/// A backend under test.
#[tonic::async_trait]
pub trait Backend: Send + Sync + 'static {
    type Store: Datastore + 'static;
    /// The backend's store, empty. Called once per case.
    async fn open(&self) -> Self::Store;
    /// Forgets the changes before `revision`, as etcd's Compact does: a watch from an older
    /// revision must then report [`DatastoreError::Compacted`].
    async fn compact(&self, store: &Self::Store, revision: i64);
    /// Restarts the backend under `store` (its server process, or its files reopened) and
    /// returns a store on the restarted backend, with the same data.
    async fn restart(&self, store: Self::Store) -> Self::Store;
    /// The key the suite's `key` is stored under (default: itself). A backend that stores
    /// only calix's key space (kubernetes) maps the suite's keys into it, keeping their order
    /// and every prefix relation between them (`""` included).
    fn key(&self, key: &str) -> String {
        key.to_string()
    }
    /// The suite's key of a stored key.
    fn suite_key(&self, stored: &str) -> String {
        stored.to_string()
    }
    /// The bytes stored for the suite's `value` (default: its text).
    fn value(&self, value: &str) -> Vec<u8> {
        value.as_bytes().to_vec()
    }
    /// The suite's value of stored bytes.
    fn suite_value(&self, stored: &[u8]) -> String {
        String::from_utf8(stored.to_vec()).expect("the suite's values are text")
    }
}

/// Runs every case of the suite as a test of its own, each on `$backend` (an expression
/// evaluated per test, giving a [`Backend`]).
macro_rules! datastore_conformance {
    ($backend:expr) => {
        datastore_conformance!(@cases $backend;
            get_put_delete,
            list_by_prefix_in_key_order,
            absent_compare,
            revision_compare,
            revisions_increase,
            a_failed_compare_writes_nothing,
            compare_and_swap_on_one_key_loses_no_update,
            watch_delivers_every_change_in_order,
            watch_from_a_past_revision_replays_what_followed,
            watch_sees_deletes,
            watch_from_a_compacted_revision_says_so,
            watch_ends_when_the_backend_restarts_and_resumes_from_the_last_revision,
            creation_is_stamped_by_the_store_and_kept_by_later_writes
        );
    };
    (@cases $backend:expr; $($case:ident),+) => {
        mod datastore_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let backend = $backend;
                    super::conformance::$case(&backend).await;
                }
            )+
        }
    };
}

const P: Durability = Durability::Power;

fn put<B: Backend>(b: &B, key: &str, value: &str) -> Op {
    Op::Put(b.key(key), b.value(value))
}

fn absent<B: Backend>(b: &B, key: &str) -> Compare {
    Compare::Absent(b.key(key))
}

fn at<B: Backend>(b: &B, key: &str, revision: i64) -> Compare {
    Compare::Revision(b.key(key), revision)
}

/// Puts `key` unconditionally; the revision of the write.
async fn set<B: Backend>(b: &B, db: &impl Datastore, key: &str, value: &str) -> i64 {
    db.txn(&[], &[put(b, key, value)], P)
        .await
        .unwrap_or_else(|e| panic!("put {key}: {e}"))
        .unwrap_or_else(|| panic!("put {key} without a compare was not applied"))
}

async fn delete<B: Backend>(b: &B, db: &impl Datastore, key: &str) -> i64 {
    db.txn(&[], &[Op::Delete(b.key(key))], P)
        .await
        .unwrap_or_else(|e| panic!("delete {key}: {e}"))
        .unwrap_or_else(|| panic!("delete {key} without a compare was not applied"))
}

/// A stored pair as the suite's (key, value, revision).
fn seen_kv<B: Backend>(b: &B, kv: &KeyValue) -> (String, String, i64) {
    (b.suite_key(&kv.key), b.suite_value(&kv.value), kv.revision)
}

async fn get<B: Backend>(b: &B, db: &impl Datastore, key: &str) -> Option<(String, String, i64)> {
    db.get(&b.key(key))
        .await
        .unwrap_or_else(|e| panic!("get {key}: {e}"))
        .map(|kv| seen_kv(b, &kv))
}

async fn list<B: Backend>(
    b: &B,
    db: &impl Datastore,
    prefix: &str,
) -> (Vec<(String, String, i64)>, i64) {
    let (kvs, revision) = db
        .list_with_revision(&b.key(prefix))
        .await
        .unwrap_or_else(|e| panic!("list {prefix}: {e}"));
    (kvs.iter().map(|kv| seen_kv(b, kv)).collect(), revision)
}

async fn watch<B: Backend>(b: &B, db: &impl Datastore, prefix: &str, after: i64) -> WatchStream {
    db.watch(&b.key(prefix), after)
        .await
        .unwrap_or_else(|e| panic!("watch {prefix}: {e}"))
}

/// A change as the suite writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Put(String, String, i64),
    Delete(String, i64),
}

/// The next watch item, within [`WAIT`].
async fn item(w: &mut WatchStream) -> Option<Result<WatchEvent, DatastoreError>> {
    tokio::time::timeout(WAIT, w.next())
        .await
        .unwrap_or_else(|_| panic!("no watch item within {WAIT:?}"))
}

/// The next watch event, which must be one.
async fn event<B: Backend>(b: &B, w: &mut WatchStream) -> Seen {
    match item(w).await {
        Some(Ok(WatchEvent::Put(kv))) => {
            let (k, v, r) = seen_kv(b, &kv);
            Seen::Put(k, v, r)
        }
        Some(Ok(WatchEvent::Delete { key, revision })) => Seen::Delete(b.suite_key(&key), revision),
        other => panic!("expected a watch event, got {other:?}"),
    }
}

fn put_event(key: &str, value: &str, revision: i64) -> Seen {
    Seen::Put(key.into(), value.into(), revision)
}

fn delete_event(key: &str, revision: i64) -> Seen {
    Seen::Delete(key.into(), revision)
}

pub async fn get_put_delete<B: Backend>(b: &B) {
    let db = b.open().await;
    assert_eq!(get(b, &db, "a").await, None);
    let r1 = set(b, &db, "a", "1").await;
    assert_eq!(get(b, &db, "a").await, Some(("a".into(), "1".into(), r1)));
    let r2 = set(b, &db, "a", "2").await;
    assert!(r2 > r1);
    assert_eq!(get(b, &db, "a").await.expect("a").1, "2");
    delete(b, &db, "a").await;
    assert_eq!(get(b, &db, "a").await, None);
}

pub async fn list_by_prefix_in_key_order<B: Backend>(b: &B) {
    let db = b.open().await;
    for (k, v) in [
        ("pool/b", "b"),
        ("pool/a", "a"),
        ("pool/c/x", "cx"),
        ("poolx", "no"),
        ("aaa", "no"),
    ] {
        set(b, &db, k, v).await;
    }
    let (listed, revision) = list(b, &db, "pool/").await;
    let keys: Vec<&str> = listed.iter().map(|kv| kv.0.as_str()).collect();
    assert_eq!(keys, ["pool/a", "pool/b", "pool/c/x"]);
    assert_eq!(listed[2].1, "cx");
    assert!(
        listed.iter().all(|kv| kv.2 <= revision),
        "{listed:?} at {revision}"
    );
    let newest = get(b, &db, "aaa").await.expect("aaa").2;
    assert!(
        revision >= newest,
        "a listing's revision {revision} is older than a write {newest} before it"
    );
    assert_eq!(list(b, &db, "").await.0.len(), 5);
    assert_eq!(list(b, &db, "nothing/").await.0, vec![]);
}

pub async fn absent_compare<B: Backend>(b: &B) {
    let db = b.open().await;
    let absent = [absent(b, "k")];
    assert!(db
        .txn(&absent, &[put(b, "k", "1")], P)
        .await
        .expect("txn")
        .is_some());
    assert_eq!(
        db.txn(&absent, &[put(b, "k", "2")], P).await.expect("txn"),
        None
    );
    assert_eq!(get(b, &db, "k").await.expect("k").1, "1");
    delete(b, &db, "k").await;
    // Once deleted, absent again.
    assert!(db
        .txn(&absent, &[put(b, "k", "3")], Durability::Process)
        .await
        .expect("txn")
        .is_some());
}

pub async fn revision_compare<B: Backend>(b: &B) {
    let db = b.open().await;
    let r1 = set(b, &db, "k", "1").await;
    let wrong = [at(b, "k", r1 + 100)];
    assert_eq!(
        db.txn(&wrong, &[put(b, "k", "x")], P).await.expect("txn"),
        None
    );
    let right = [at(b, "k", r1)];
    let r2 = db
        .txn(&right, &[put(b, "k", "2")], P)
        .await
        .expect("txn")
        .expect("the right revision applies");
    assert!(r2 > r1);
    // The old revision no longer matches; a missing key matches no revision.
    assert_eq!(
        db.txn(&right, &[put(b, "k", "x")], P).await.expect("txn"),
        None
    );
    let missing = [at(b, "nope", r1)];
    assert_eq!(
        db.txn(&missing, &[put(b, "nope", "x")], P)
            .await
            .expect("txn"),
        None
    );
    assert_eq!(get(b, &db, "nope").await, None);
    // A delete under a revision compare.
    let now = [at(b, "k", r2)];
    assert!(db
        .txn(&now, &[Op::Delete(b.key("k"))], P)
        .await
        .expect("txn")
        .is_some());
    assert_eq!(get(b, &db, "k").await, None);
}

pub async fn revisions_increase<B: Backend>(b: &B) {
    let db = b.open().await;
    let mut last = 0;
    for i in 0..20 {
        let key = format!("k{}", i % 3);
        let rev = set(b, &db, &key, &i.to_string()).await;
        assert!(rev > last, "revision {rev} after {last}");
        assert_eq!(get(b, &db, &key).await.expect("key").2, rev);
        last = rev;
    }
    let (_, listed) = list(b, &db, "").await;
    assert!(listed >= last);
}

pub async fn a_failed_compare_writes_nothing<B: Backend>(b: &B) {
    let db = b.open().await;
    let r1 = set(b, &db, "k", "1").await;
    let (_, from) = list(b, &db, "").await;
    let mut w = watch(b, &db, "", from).await;
    for compare in [at(b, "k", r1 + 1), absent(b, "k")] {
        assert_eq!(
            db.txn(&[compare], &[put(b, "k", "x")], P)
                .await
                .expect("txn"),
            None
        );
    }
    let kv = get(b, &db, "k").await.expect("k");
    assert_eq!((kv.1.as_str(), kv.2), ("1", r1));
    // No event for the failed writes: the next one is the next write.
    let r2 = set(b, &db, "after", "y").await;
    assert_eq!(event(b, &mut w).await, put_event("after", "y", r2));
}

/// Compare-and-swap on one key is atomic: concurrent writers incrementing one counter, each
/// retrying on a lost compare, lose no increment, and no two writes share a revision.
pub async fn compare_and_swap_on_one_key_loses_no_update<B: Backend>(b: &B) {
    const TASKS: usize = 4;
    const EACH: usize = 25;
    let db = b.open().await;
    set(b, &db, "counter", "0").await;
    // Concurrent writers (their requests in flight together), each retrying a lost compare.
    let writer = || async {
        let mut revisions = Vec::new();
        while revisions.len() < EACH {
            let (_, value, revision) = get(b, &db, "counter").await.expect("counter");
            let n: usize = value.parse().expect("number");
            let swap = [at(b, "counter", revision)];
            if let Some(rev) = db
                .txn(&swap, &[put(b, "counter", &(n + 1).to_string())], P)
                .await
                .expect("txn")
            {
                revisions.push(rev);
            }
        }
        revisions
    };
    let mut revisions: Vec<i64> = futures::future::join_all((0..TASKS).map(|_| writer()))
        .await
        .into_iter()
        .flatten()
        .collect();
    let kv = get(b, &db, "counter").await.expect("counter");
    assert_eq!(kv.1, (TASKS * EACH).to_string());
    revisions.sort_unstable();
    revisions.dedup();
    assert_eq!(
        revisions.len(),
        TASKS * EACH,
        "two writes shared a revision"
    );
}

pub async fn watch_delivers_every_change_in_order<B: Backend>(b: &B) {
    let db = b.open().await;
    set(b, &db, "w/before", "0").await;
    let (listed, from) = list(b, &db, "w/").await;
    assert_eq!(listed.len(), 1);
    let mut w = watch(b, &db, "w/", from).await;
    let r1 = set(b, &db, "w/a", "1").await;
    set(b, &db, "x/other", "no").await;
    set(b, &db, "wx", "no").await;
    let r2 = set(b, &db, "w/b", "2").await;
    let r3 = db
        .txn(&[at(b, "w/a", r1)], &[put(b, "w/a", "3")], P)
        .await
        .expect("txn")
        .expect("applied");
    let r4 = delete(b, &db, "w/b").await;
    assert_eq!(event(b, &mut w).await, put_event("w/a", "1", r1));
    assert_eq!(event(b, &mut w).await, put_event("w/b", "2", r2));
    assert_eq!(event(b, &mut w).await, put_event("w/a", "3", r3));
    assert_eq!(event(b, &mut w).await, delete_event("w/b", r4));
    // Many, back to back: every one, in order, with the revision a read gives.
    let mut revs = Vec::new();
    for i in 0..200 {
        revs.push(set(b, &db, &format!("w/n/{:03}", i % 7), &i.to_string()).await);
    }
    for (i, rev) in revs.iter().enumerate() {
        let e = event(b, &mut w).await;
        assert_eq!(
            e,
            put_event(&format!("w/n/{:03}", i % 7), &i.to_string(), *rev)
        );
    }
    let last = get(b, &db, "w/n/003").await.expect("key");
    assert!(revs.contains(&last.2));
}

pub async fn watch_from_a_past_revision_replays_what_followed<B: Backend>(b: &B) {
    let db = b.open().await;
    let r1 = set(b, &db, "w/a", "1").await;
    let r2 = set(b, &db, "w/b", "2").await;
    let r3 = set(b, &db, "w/c", "3").await;
    let mut w = watch(b, &db, "w/", r1).await;
    assert_eq!(event(b, &mut w).await, put_event("w/b", "2", r2));
    assert_eq!(event(b, &mut w).await, put_event("w/c", "3", r3));
    let r4 = set(b, &db, "w/d", "4").await;
    assert_eq!(event(b, &mut w).await, put_event("w/d", "4", r4));
    // From the newest revision: only what comes next.
    let mut w = watch(b, &db, "w/", r4).await;
    let r5 = set(b, &db, "w/e", "5").await;
    assert_eq!(event(b, &mut w).await, put_event("w/e", "5", r5));
}

pub async fn watch_sees_deletes<B: Backend>(b: &B) {
    let db = b.open().await;
    let (_, from) = list(b, &db, "w/").await;
    let r1 = set(b, &db, "w/k", "1").await;
    let r2 = delete(b, &db, "w/k").await;
    let mut w = watch(b, &db, "w/", from).await;
    assert_eq!(event(b, &mut w).await, put_event("w/k", "1", r1));
    assert_eq!(event(b, &mut w).await, delete_event("w/k", r2));
    // Created again after its delete; a delete of a key that is not there changes nothing.
    let r3 = set(b, &db, "w/k", "2").await;
    assert_eq!(event(b, &mut w).await, put_event("w/k", "2", r3));
    db.txn(&[], &[Op::Delete(b.key("w/missing"))], P)
        .await
        .expect("delete");
    let r4 = set(b, &db, "w/z", "z").await;
    assert_eq!(event(b, &mut w).await, put_event("w/z", "z", r4));
    // From after the delete: the delete is not seen again.
    let mut w = watch(b, &db, "w/", r2).await;
    assert_eq!(event(b, &mut w).await, put_event("w/k", "2", r3));
}

pub async fn watch_from_a_compacted_revision_says_so<B: Backend>(b: &B) {
    let db = b.open().await;
    let mut revs = Vec::new();
    for i in 0..5 {
        revs.push(set(b, &db, &format!("w/k{i}"), &i.to_string()).await);
    }
    b.compact(&db, revs[3]).await;
    let mut w = watch(b, &db, "w/", revs[0]).await;
    match item(&mut w).await {
        Some(Err(DatastoreError::Compacted { after, compacted })) => {
            assert_eq!(after, revs[0]);
            assert!(
                compacted > revs[0] && compacted <= revs[3],
                "compacted {compacted}, revisions {revs:?}"
            );
        }
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert!(item(&mut w).await.is_none(), "a compacted watch must end");
    // From the compaction on, the watch works.
    let mut w = watch(b, &db, "w/", revs[3] - 1).await;
    assert_eq!(event(b, &mut w).await, put_event("w/k3", "3", revs[3]));
    assert_eq!(event(b, &mut w).await, put_event("w/k4", "4", revs[4]));
}

/// A watch never stops quietly: when its backend restarts it ends with `WatchEnded`, and a new
/// watch from the last revision received misses nothing and repeats nothing.
pub async fn watch_ends_when_the_backend_restarts_and_resumes_from_the_last_revision<B: Backend>(
    b: &B,
) {
    let db = b.open().await;
    let (_, from) = list(b, &db, "w/").await;
    let mut w = watch(b, &db, "w/", from).await;
    let r1 = set(b, &db, "w/a", "1").await;
    assert_eq!(event(b, &mut w).await, put_event("w/a", "1", r1));
    let db = b.restart(db).await;
    match item(&mut w).await {
        Some(Err(DatastoreError::WatchEnded { .. })) => {}
        other => panic!("expected WatchEnded after the restart, got {other:?}"),
    }
    assert!(item(&mut w).await.is_none(), "an ended watch must end");
    let r2 = set(b, &db, "w/b", "2").await;
    let mut w = watch(b, &db, "w/", r1).await;
    assert_eq!(event(b, &mut w).await, put_event("w/b", "2", r2));
    let r3 = set(b, &db, "w/c", "3").await;
    assert_eq!(event(b, &mut w).await, put_event("w/c", "3", r3));
}

/// `KeyValue::created` is the store's own stamp of a key's creation: set (not 0), kept by later
/// writes and by a restart, the same in a listing, a get and a watch event, never older for a
/// key created later, and new again once the key is deleted and created anew. (IPAM orders
/// overlapping blocks by it: a client must not be able to make its object look older.)
pub async fn creation_is_stamped_by_the_store_and_kept_by_later_writes<B: Backend>(b: &B) {
    let db = b.open().await;
    let first = |kvs: Vec<KeyValue>, key: &str| {
        kvs.into_iter()
            .find(|kv| b.suite_key(&kv.key) == key)
            .unwrap_or_else(|| panic!("{key} listed"))
    };
    set(b, &db, "c/a", "1").await;
    let (_, from) = list(b, &db, "c/").await;
    let a = first(db.list(&b.key("c/")).await.expect("list"), "c/a");
    assert!(a.created > 0, "no creation stamp: {a:?}");
    let mut w = watch(b, &db, "c/", from).await;
    set(b, &db, "c/a", "2").await;
    let changed = db.get(&b.key("c/a")).await.expect("get").expect("c/a");
    assert_eq!(
        changed.created, a.created,
        "a later write changed the creation stamp"
    );
    assert!(changed.revision > a.revision);
    match item(&mut w).await {
        Some(Ok(WatchEvent::Put(kv))) => assert_eq!(kv.created, a.created, "watch: {kv:?}"),
        other => panic!("expected a put, got {other:?}"),
    }
    set(b, &db, "c/b", "1").await;
    let b_kv = first(db.list(&b.key("c/")).await.expect("list"), "c/b");
    assert!(
        b_kv.created >= a.created,
        "created later, stamped older: {b_kv:?} {a:?}"
    );
    let db = b.restart(db).await;
    let again = first(db.list(&b.key("c/")).await.expect("list"), "c/a");
    assert_eq!(
        again.created, a.created,
        "the restart changed the creation stamp"
    );
    delete(b, &db, "c/a").await;
    set(b, &db, "c/a", "3").await;
    let recreated = db.get(&b.key("c/a")).await.expect("get").expect("c/a");
    assert!(
        recreated.created >= b_kv.created,
        "re-created, stamped as before: {recreated:?}"
    );
}
