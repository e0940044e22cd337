//! Following a prefix for as long as the agent runs, on any backend: list once, then watch,
//! and keep going through whatever ends a watch. A watch that ended (connection lost, the
//! backend restarted) is opened again from the last revision seen; one that reports its
//! revision compacted (etcd compaction, a Kubernetes 410 Gone) is replaced by a new listing,
//! and the difference between that listing and what was known is delivered as changes. So a
//! follower's view always converges on the store's, and each change is delivered once.
//!
//! A follower whose reader wants only the changes (after the first listing, taken once:
//! [`Follower::take_listing`]) keeps a digest of each key instead of its value: 10,000
//! Services and their EndpointSlices are ~10 MiB of views the agent need not hold twice.
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use calix_core::store::{KeyValue, WatchEvent};
use futures::StreamExt;

use super::{Datastore, DatastoreError, WatchStream};

/// First pause after a failure; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// What tells a key's change from what was delivered: its revisions and a hash of its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Digest {
    revision: i64,
    created: i64,
    value: u64,
}

impl Digest {
    fn of(kv: &KeyValue) -> Self {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        kv.value.hash(&mut h);
        Self {
            revision: kv.revision,
            created: kv.created,
            value: h.finish(),
        }
    }
}

/// No values: what [`Follower::known`] shows once the listing is taken.
static NONE_KEPT: BTreeMap<String, KeyValue> = BTreeMap::new();

/// Every key under one prefix, kept current.
pub struct Follower {
    store: Arc<dyn Datastore>,
    prefix: String,
    known: BTreeMap<String, KeyValue>,
    /// Once the listing is taken ([`Follower::take_listing`]): each key's digest instead.
    digests: Option<BTreeMap<String, Digest>>,
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
            digests: None,
            revision,
            watch: None,
            backlog: Default::default(),
            pause: FIRST_PAUSE,
        })
    }

    /// Every key under the prefix as of the last change delivered.
    /// Empty once the listing is taken ([`Follower::take_listing`]).
    pub fn known(&self) -> &BTreeMap<String, KeyValue> {
        match self.digests {
            Some(_) => &NONE_KEPT,
            None => &self.known,
        }
    }

    /// The first listing (or, later, what is known now), for a reader that follows the
    /// changes from here: from now on only each key's digest is kept.
    pub fn take_listing(&mut self) -> Vec<KeyValue> {
        let known = std::mem::take(&mut self.known);
        let digests = self.digests.get_or_insert_with(BTreeMap::new);
        digests.extend(known.values().map(|kv| (kv.key.clone(), Digest::of(kv))));
        known.into_values().collect()
    }

    /// How many keys the prefix holds.
    pub fn len(&self) -> usize {
        self.digests
            .as_ref()
            .map_or(self.known.len(), BTreeMap::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its keys, in order.
    pub fn keys(&self) -> Vec<&str> {
        match &self.digests {
            Some(d) => d.keys().map(String::as_str).collect(),
            None => self.known.keys().map(String::as_str).collect(),
        }
    }

    fn remember(&mut self, kv: &KeyValue) {
        match &mut self.digests {
            Some(d) => {
                d.insert(kv.key.clone(), Digest::of(kv));
            }
            None => {
                self.known.insert(kv.key.clone(), kv.clone());
            }
        }
    }

    fn forget(&mut self, key: &str) {
        match &mut self.digests {
            Some(d) => {
                d.remove(key);
            }
            None => {
                self.known.remove(key);
            }
        }
    }

    /// Whether `kv` is what was last delivered for its key.
    fn holds(&self, kv: &KeyValue) -> bool {
        match &self.digests {
            Some(d) => d.get(&kv.key) == Some(&Digest::of(kv)),
            None => self.known.get(&kv.key) == Some(kv),
        }
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
                        WatchEvent::Put(kv) => self.remember(kv),
                        WatchEvent::Delete { key, .. } => self.forget(key),
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
        let gone: Vec<String> = self
            .keys()
            .into_iter()
            .filter(|k| !listed.contains_key(*k))
            .map(String::from)
            .collect();
        for key in gone {
            self.forget(&key);
            self.backlog.push_back(WatchEvent::Delete { key, revision });
        }
        for kv in listed.into_values() {
            if !self.holds(&kv) {
                self.remember(&kv);
                self.backlog.push_back(WatchEvent::Put(kv));
            }
        }
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
        compacted_then_relisted(false).await;
    }

    #[tokio::test]
    async fn with_digests_only_a_relisting_tells_the_same_difference() {
        compacted_then_relisted(true).await;
    }

    /// With `digests`, the listing is taken first: the follower keeps only digests.
    async fn compacted_then_relisted(digests: bool) {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Arc::new(EmbeddedStore::open(&dir.path().join("s.json")).expect("open"));
        put(&db, "p/a", "1").await;
        put(&db, "p/b", "1").await;
        let mut f = Follower::start(db.clone(), "p/").await.expect("start");
        assert_eq!(f.known().len(), 2);
        if digests {
            let listed: Vec<String> = f.take_listing().into_iter().map(|kv| kv.key).collect();
            assert_eq!(listed, ["p/a", "p/b"]);
            assert!(f.known().is_empty(), "no values kept");
            assert_eq!(f.len(), 2);
        }
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
        assert_eq!(f.keys(), ["p/a", "p/c", "p/d"]);
        assert_eq!(f.known().len(), if digests { 0 } else { 3 });
        // And it follows on from the listing.
        put(&db, "p/e", "1").await;
        assert_eq!(next(&mut f).await.key(), "p/e");
    }
}
