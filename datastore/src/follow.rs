//! Following a prefix for as long as the agent runs, on any backend: list once, then watch,
//! and keep going through whatever ends a watch. A watch that ended (connection lost, the
//! backend restarted) is opened again from the last revision seen; one that reports its
//! revision compacted (etcd compaction, a Kubernetes 410 Gone) is replaced by a new listing,
//! and the difference between that listing and what was known is delivered as changes. So a
//! follower's view always converges on the store's, and each change is delivered once.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use calix_core::store::{KeyValue, WatchEvent};
use futures::StreamExt;

use super::{Datastore, DatastoreError, WatchStream};

/// First pause after a failure; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// Every key under one prefix, kept current.
pub struct Follower {
    store: Arc<dyn Datastore>,
    prefix: String,
    known: BTreeMap<String, KeyValue>,
    /// Every change up to here is in `known`.
    revision: i64,
    watch: Option<WatchStream>,
    /// Changes found by a new listing, not yet delivered.
    backlog: std::collections::VecDeque<WatchEvent>,
    pause: Duration,
}

impl Follower {
    /// Lists `prefix` (the first view, [`Follower::known`]); fails when the store cannot be
    /// listed (after its own retries).
    pub async fn start(store: Arc<dyn Datastore>, prefix: &str) -> Result<Self, DatastoreError> {
        let (kvs, revision) = store.list_with_revision(prefix).await?;
        Ok(Self {
            store,
            prefix: prefix.to_string(),
            known: kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect(),
            revision,
            watch: None,
            backlog: Default::default(),
            pause: FIRST_PAUSE,
        })
    }

    /// Every key under the prefix as of the last change delivered.
    pub fn known(&self) -> &BTreeMap<String, KeyValue> {
        &self.known
    }

    /// The revision the view is current at.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The next change, already applied to [`Follower::known`]. Never fails: while the store
    /// cannot be reached it logs and tries again, with backoff.
    pub async fn next(&mut self) -> WatchEvent {
        loop {
            if let Some(event) = self.backlog.pop_front() {
                return event;
            }
            let watch = match self.watch.as_mut() {
                Some(w) => w,
                None => match self.store.watch(&self.prefix, self.revision).await {
                    Ok(w) => self.watch.insert(w),
                    Err(e) => {
                        self.failed("cannot watch", &e).await;
                        continue;
                    }
                },
            };
            match watch.next().await {
                Some(Ok(event)) => {
                    self.pause = FIRST_PAUSE;
                    self.revision = self.revision.max(event.revision());
                    match &event {
                        WatchEvent::Put(kv) => {
                            self.known.insert(kv.key.clone(), kv.clone());
                        }
                        WatchEvent::Delete { key, .. } => {
                            self.known.remove(key);
                        }
                    }
                    return event;
                }
                Some(Err(DatastoreError::Compacted { .. })) => {
                    self.watch = None;
                    tracing::info!(prefix = %self.prefix, after = self.revision,
                        "watch history compacted: listing again");
                    if let Err(e) = self.relist().await {
                        self.failed("cannot list again", &e).await;
                    }
                }
                Some(Err(e)) => {
                    self.watch = None;
                    tracing::info!(prefix = %self.prefix, after = self.revision, error = %e,
                        "watch ended: watching again");
                }
                None => self.watch = None,
            }
        }
    }

    /// Lists again and queues the difference from what was known.
    async fn relist(&mut self) -> Result<(), DatastoreError> {
        let (kvs, revision) = self.store.list_with_revision(&self.prefix).await?;
        let listed: BTreeMap<String, KeyValue> =
            kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect();
        for key in self.known.keys() {
            if !listed.contains_key(key) {
                self.backlog.push_back(WatchEvent::Delete {
                    key: key.clone(),
                    revision,
                });
            }
        }
        for (key, kv) in &listed {
            if self.known.get(key) != Some(kv) {
                self.backlog.push_back(WatchEvent::Put(kv.clone()));
            }
        }
        self.known = listed;
        self.revision = revision;
        Ok(())
    }

    async fn failed(&mut self, what: &str, e: &DatastoreError) {
        tracing::warn!(prefix = %self.prefix, error = %e, pause = ?self.pause, "{what}; trying again");
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Durability, EmbeddedStore, Op};

    async fn put(db: &EmbeddedStore, key: &str, v: &str) -> i64 {
        db.txn(
            &[],
            &[Op::Put(key.into(), v.as_bytes().to_vec())],
            Durability::Power,
        )
        .await
        .expect("put")
        .expect("applied")
    }

    async fn next(f: &mut Follower) -> WatchEvent {
        tokio::time::timeout(Duration::from_secs(10), f.next())
            .await
            .expect("a change within 10 s")
    }

    #[tokio::test]
    async fn a_compacted_watch_is_replaced_by_a_listing_and_its_difference() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Arc::new(EmbeddedStore::open(&dir.path().join("s.json")).expect("open"));
        put(&db, "p/a", "1").await;
        put(&db, "p/b", "1").await;
        let mut f = Follower::start(db.clone(), "p/").await.expect("start");
        assert_eq!(f.known().len(), 2);
        let r = put(&db, "p/c", "1").await;
        assert_eq!(next(&mut f).await.key(), "p/c");
        assert_eq!(f.revision(), r);
        // Changes the follower has not seen, then their history compacted away.
        put(&db, "p/a", "2").await;
        db.txn(&[], &[Op::Delete("p/b".into())], Durability::Power)
            .await
            .expect("delete");
        let last = put(&db, "p/d", "1").await;
        db.compact_history(last + 1);
        // A new watch is needed: drop the open one by reopening the follower's view.
        f.watch = None;
        let mut seen = BTreeMap::new();
        while seen.len() < 3 {
            let e = next(&mut f).await;
            seen.insert(e.key().to_string(), e);
        }
        assert!(matches!(seen["p/a"], WatchEvent::Put(ref kv) if kv.value == b"2"));
        assert!(matches!(seen["p/b"], WatchEvent::Delete { .. }));
        assert!(matches!(seen["p/d"], WatchEvent::Put(_)));
        let keys: Vec<&str> = f.known().keys().map(String::as_str).collect();
        assert_eq!(keys, ["p/a", "p/c", "p/d"]);
        // And it follows on from the listing.
        put(&db, "p/e", "1").await;
        assert_eq!(next(&mut f).await.key(), "p/e");
    }
}
