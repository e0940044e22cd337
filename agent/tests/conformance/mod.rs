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

use std::sync::Arc;
use std::time::Duration;

use calix_agent::datastore::{
    Compare, Datastore, DatastoreError, Durability, KeyValue, Op, WatchEvent, WatchStream,
};
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
            watch_ends_when_the_backend_restarts_and_resumes_from_the_last_revision
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

fn put(key: &str, value: &str) -> Op {
    Op::Put(key.into(), value.as_bytes().to_vec())
}

/// Puts `key` unconditionally; the revision of the write.
async fn set(db: &impl Datastore, key: &str, value: &str) -> i64 {
    db.txn(&[], &[put(key, value)], P)
        .await
        .unwrap_or_else(|e| panic!("put {key}: {e}"))
        .unwrap_or_else(|| panic!("put {key} without a compare was not applied"))
}

async fn delete(db: &impl Datastore, key: &str) -> i64 {
    db.txn(&[], &[Op::Delete(key.into())], P)
        .await
        .unwrap_or_else(|e| panic!("delete {key}: {e}"))
        .unwrap_or_else(|| panic!("delete {key} without a compare was not applied"))
}

/// The next watch item, within [`WAIT`].
async fn item(w: &mut WatchStream) -> Option<Result<WatchEvent, DatastoreError>> {
    tokio::time::timeout(WAIT, w.next())
        .await
        .unwrap_or_else(|_| panic!("no watch item within {WAIT:?}"))
}

/// The next watch event, which must be one.
async fn event(w: &mut WatchStream) -> WatchEvent {
    match item(w).await {
        Some(Ok(e)) => e,
        other => panic!("expected a watch event, got {other:?}"),
    }
}

fn put_event(key: &str, value: &str, revision: i64) -> WatchEvent {
    WatchEvent::Put(KeyValue {
        key: key.into(),
        value: value.as_bytes().to_vec(),
        revision,
    })
}

fn delete_event(key: &str, revision: i64) -> WatchEvent {
    WatchEvent::Delete {
        key: key.into(),
        revision,
    }
}

pub async fn get_put_delete<B: Backend>(b: &B) {
    let db = b.open().await;
    assert_eq!(db.get("a").await.expect("get"), None);
    let r1 = set(&db, "a", "1").await;
    let kv = db.get("a").await.expect("get").expect("a exists");
    assert_eq!(
        (kv.key.as_str(), kv.value.as_slice(), kv.revision),
        ("a", &b"1"[..], r1)
    );
    let r2 = set(&db, "a", "2").await;
    assert!(r2 > r1);
    assert_eq!(db.get("a").await.expect("get").expect("a").value, b"2");
    delete(&db, "a").await;
    assert_eq!(db.get("a").await.expect("get"), None);
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
        set(&db, k, v).await;
    }
    let (listed, revision) = db.list_with_revision("pool/").await.expect("list");
    let keys: Vec<&str> = listed.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["pool/a", "pool/b", "pool/c/x"]);
    assert_eq!(listed[2].value, b"cx");
    assert!(
        listed.iter().all(|kv| kv.revision <= revision),
        "{listed:?} at {revision}"
    );
    let newest = db.get("aaa").await.expect("get").expect("aaa").revision;
    assert!(
        revision >= newest,
        "a listing's revision {revision} is older than a write {newest} before it"
    );
    assert_eq!(db.list("").await.expect("list").len(), 5);
    assert_eq!(db.list("nothing/").await.expect("list"), vec![]);
}

pub async fn absent_compare<B: Backend>(b: &B) {
    let db = b.open().await;
    let absent = [Compare::Absent("k".into())];
    assert!(db
        .txn(&absent, &[put("k", "1")], P)
        .await
        .expect("txn")
        .is_some());
    assert_eq!(
        db.txn(&absent, &[put("k", "2")], P).await.expect("txn"),
        None
    );
    assert_eq!(db.get("k").await.expect("get").expect("k").value, b"1");
    delete(&db, "k").await;
    // Once deleted, absent again.
    assert!(db
        .txn(&absent, &[put("k", "3")], Durability::Process)
        .await
        .expect("txn")
        .is_some());
}

pub async fn revision_compare<B: Backend>(b: &B) {
    let db = b.open().await;
    let r1 = set(&db, "k", "1").await;
    let wrong = [Compare::Revision("k".into(), r1 + 100)];
    assert_eq!(
        db.txn(&wrong, &[put("k", "x")], P).await.expect("txn"),
        None
    );
    let right = [Compare::Revision("k".into(), r1)];
    let r2 = db
        .txn(&right, &[put("k", "2")], P)
        .await
        .expect("txn")
        .expect("the right revision applies");
    assert!(r2 > r1);
    // The old revision no longer matches; a missing key matches no revision.
    assert_eq!(
        db.txn(&right, &[put("k", "x")], P).await.expect("txn"),
        None
    );
    let missing = [Compare::Revision("nope".into(), r1)];
    assert_eq!(
        db.txn(&missing, &[put("nope", "x")], P).await.expect("txn"),
        None
    );
    assert_eq!(db.get("nope").await.expect("get"), None);
    // A delete under a revision compare.
    let now = [Compare::Revision("k".into(), r2)];
    assert!(db
        .txn(&now, &[Op::Delete("k".into())], P)
        .await
        .expect("txn")
        .is_some());
    assert_eq!(db.get("k").await.expect("get"), None);
}

pub async fn revisions_increase<B: Backend>(b: &B) {
    let db = b.open().await;
    let mut last = 0;
    for i in 0..20 {
        let key = format!("k{}", i % 3);
        let rev = set(&db, &key, &i.to_string()).await;
        assert!(rev > last, "revision {rev} after {last}");
        assert_eq!(db.get(&key).await.expect("get").expect("key").revision, rev);
        last = rev;
    }
    let (_, listed) = db.list_with_revision("").await.expect("list");
    assert!(listed >= last);
}

pub async fn a_failed_compare_writes_nothing<B: Backend>(b: &B) {
    let db = b.open().await;
    let r1 = set(&db, "k", "1").await;
    let (_, from) = db.list_with_revision("").await.expect("list");
    let mut w = db.watch("", from).await.expect("watch");
    for compare in [
        Compare::Revision("k".into(), r1 + 1),
        Compare::Absent("k".into()),
    ] {
        assert_eq!(
            db.txn(&[compare], &[put("k", "x")], P).await.expect("txn"),
            None
        );
    }
    let kv = db.get("k").await.expect("get").expect("k");
    assert_eq!((kv.value.as_slice(), kv.revision), (&b"1"[..], r1));
    // No event for the failed writes: the next one is the next write.
    let r2 = set(&db, "after", "y").await;
    assert_eq!(event(&mut w).await, put_event("after", "y", r2));
}

/// Compare-and-swap on one key is atomic: concurrent writers incrementing one counter, each
/// retrying on a lost compare, lose no increment, and no two writes share a revision.
pub async fn compare_and_swap_on_one_key_loses_no_update<B: Backend>(b: &B) {
    const TASKS: usize = 4;
    const EACH: usize = 25;
    let db = Arc::new(b.open().await);
    set(&*db, "counter", "0").await;
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let db = db.clone();
            tokio::spawn(async move {
                let mut revisions = Vec::new();
                while revisions.len() < EACH {
                    let kv = db.get("counter").await.expect("get").expect("counter");
                    let n: usize = std::str::from_utf8(&kv.value)
                        .expect("utf-8")
                        .parse()
                        .expect("number");
                    let swap = [Compare::Revision("counter".into(), kv.revision)];
                    if let Some(rev) = db
                        .txn(&swap, &[put("counter", &(n + 1).to_string())], P)
                        .await
                        .expect("txn")
                    {
                        revisions.push(rev);
                    }
                }
                revisions
            })
        })
        .collect();
    let mut revisions = Vec::new();
    for t in tasks {
        revisions.extend(t.await.expect("task"));
    }
    let kv = db.get("counter").await.expect("get").expect("counter");
    assert_eq!(kv.value, (TASKS * EACH).to_string().as_bytes());
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
    set(&db, "w/before", "0").await;
    let (listed, from) = db.list_with_revision("w/").await.expect("list");
    assert_eq!(listed.len(), 1);
    let mut w = db.watch("w/", from).await.expect("watch");
    let r1 = set(&db, "w/a", "1").await;
    set(&db, "x/other", "no").await;
    set(&db, "wx", "no").await;
    let r2 = set(&db, "w/b", "2").await;
    let r3 = db
        .txn(
            &[Compare::Revision("w/a".into(), r1)],
            &[put("w/a", "3")],
            P,
        )
        .await
        .expect("txn")
        .expect("applied");
    let r4 = delete(&db, "w/b").await;
    assert_eq!(event(&mut w).await, put_event("w/a", "1", r1));
    assert_eq!(event(&mut w).await, put_event("w/b", "2", r2));
    assert_eq!(event(&mut w).await, put_event("w/a", "3", r3));
    assert_eq!(event(&mut w).await, delete_event("w/b", r4));
    // Many, back to back: every one, in order, with the revision a read gives.
    let mut revs = Vec::new();
    for i in 0..200 {
        revs.push(set(&db, &format!("w/n/{:03}", i % 7), &i.to_string()).await);
    }
    for (i, rev) in revs.iter().enumerate() {
        let e = event(&mut w).await;
        assert_eq!(
            e,
            put_event(&format!("w/n/{:03}", i % 7), &i.to_string(), *rev)
        );
    }
    let last = db.get("w/n/003").await.expect("get").expect("key");
    assert!(revs.contains(&last.revision));
}

pub async fn watch_from_a_past_revision_replays_what_followed<B: Backend>(b: &B) {
    let db = b.open().await;
    let r1 = set(&db, "w/a", "1").await;
    let r2 = set(&db, "w/b", "2").await;
    let r3 = set(&db, "w/c", "3").await;
    let mut w = db.watch("w/", r1).await.expect("watch");
    assert_eq!(event(&mut w).await, put_event("w/b", "2", r2));
    assert_eq!(event(&mut w).await, put_event("w/c", "3", r3));
    let r4 = set(&db, "w/d", "4").await;
    assert_eq!(event(&mut w).await, put_event("w/d", "4", r4));
    // From the newest revision: only what comes next.
    let mut w = db.watch("w/", r4).await.expect("watch");
    let r5 = set(&db, "w/e", "5").await;
    assert_eq!(event(&mut w).await, put_event("w/e", "5", r5));
}

pub async fn watch_sees_deletes<B: Backend>(b: &B) {
    let db = b.open().await;
    let (_, from) = db.list_with_revision("w/").await.expect("list");
    let r1 = set(&db, "w/k", "1").await;
    let r2 = delete(&db, "w/k").await;
    let mut w = db.watch("w/", from).await.expect("watch");
    assert_eq!(event(&mut w).await, put_event("w/k", "1", r1));
    assert_eq!(event(&mut w).await, delete_event("w/k", r2));
    // Created again after its delete; a delete of a key that is not there changes nothing.
    let r3 = set(&db, "w/k", "2").await;
    assert_eq!(event(&mut w).await, put_event("w/k", "2", r3));
    db.txn(&[], &[Op::Delete("w/missing".into())], P)
        .await
        .expect("delete");
    let r4 = set(&db, "w/z", "z").await;
    assert_eq!(event(&mut w).await, put_event("w/z", "z", r4));
    // From after the delete: the delete is not seen again.
    let mut w = db.watch("w/", r2).await.expect("watch");
    assert_eq!(event(&mut w).await, put_event("w/k", "2", r3));
}

pub async fn watch_from_a_compacted_revision_says_so<B: Backend>(b: &B) {
    let db = b.open().await;
    let mut revs = Vec::new();
    for i in 0..5 {
        revs.push(set(&db, &format!("w/k{i}"), &i.to_string()).await);
    }
    b.compact(&db, revs[3]).await;
    let mut w = db.watch("w/", revs[0]).await.expect("watch");
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
    let mut w = db.watch("w/", revs[3] - 1).await.expect("watch");
    assert_eq!(event(&mut w).await, put_event("w/k3", "3", revs[3]));
    assert_eq!(event(&mut w).await, put_event("w/k4", "4", revs[4]));
}

/// A watch never stops quietly: when its backend restarts it ends with `WatchEnded`, and a new
/// watch from the last revision received misses nothing and repeats nothing.
pub async fn watch_ends_when_the_backend_restarts_and_resumes_from_the_last_revision<B: Backend>(
    b: &B,
) {
    let db = b.open().await;
    let (_, from) = db.list_with_revision("w/").await.expect("list");
    let mut w = db.watch("w/", from).await.expect("watch");
    let r1 = set(&db, "w/a", "1").await;
    assert_eq!(event(&mut w).await, put_event("w/a", "1", r1));
    let db = b.restart(db).await;
    match item(&mut w).await {
        Some(Err(DatastoreError::WatchEnded { .. })) => {}
        other => panic!("expected WatchEnded after the restart, got {other:?}"),
    }
    assert!(item(&mut w).await.is_none(), "an ended watch must end");
    let r2 = set(&db, "w/b", "2").await;
    let mut w = db.watch("w/", r1).await.expect("watch again");
    assert_eq!(event(&mut w).await, put_event("w/b", "2", r2));
    let r3 = set(&db, "w/c", "3").await;
    assert_eq!(event(&mut w).await, put_event("w/c", "3", r3));
}
