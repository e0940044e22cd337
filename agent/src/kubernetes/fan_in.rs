//! Several followers read into one stream of changes: each follower's first listing (as puts),
//! then a marker that its listing is in, then every change it sees, for as long as the agent
//! runs. Each follower has a task of its own (a follower re-watches and re-lists on its own);
//! the order of one follower's changes is kept.
use std::sync::Arc;

use calix_core::store::{KeyValue, WatchEvent};
use calix_datastore::follow::Follower;
use calix_datastore::{Datastore, DatastoreError};
use tokio::sync::mpsc;

/// Starts every follower of `prefixes` (their first listings, all at once).
pub async fn start(
    store: Arc<dyn Datastore>,
    prefixes: impl IntoIterator<Item = &str>,
) -> Result<Vec<Follower>, DatastoreError> {
    futures::future::try_join_all(
        prefixes
            .into_iter()
            .map(|prefix| Follower::start(store.clone(), prefix)),
    )
    .await
}

/// The followers' changes as `read` makes them (`None` from `read`: nothing to say), and
/// `None` once per follower when its first listing is in.
pub fn fan_in<T: Send + 'static>(
    followers: Vec<Follower>,
    read: impl Fn(&WatchEvent) -> Option<T> + Clone + Send + 'static,
) -> mpsc::Receiver<Option<T>> {
    let (tx, rx) = mpsc::channel::<Option<T>>(1024);
    for mut follower in followers {
        let (tx, read) = (tx.clone(), read.clone());
        tokio::spawn(async move {
            // From here on the follower keeps digests, not the objects: the reader has them.
            let listed: Vec<KeyValue> = follower.take_listing();
            for kv in listed {
                if let Some(t) = read(&WatchEvent::Put(kv)) {
                    if tx.send(Some(t)).await.is_err() {
                        return;
                    }
                }
            }
            if tx.send(None).await.is_err() {
                return;
            }
            loop {
                let event = follower.next().await;
                if let Some(t) = read(&event) {
                    if tx.send(Some(t)).await.is_err() {
                        return;
                    }
                }
            }
        });
    }
    rx
}
