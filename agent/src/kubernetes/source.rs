//! A value the agent takes from the cluster and keeps current: read from everything under one
//! prefix of the store, then followed ([`calix_datastore::follow`]: through API server
//! restarts, 410 Gone and bookmarks). Whoever uses it is told when the value changes — not on
//! every event: a Node's status heartbeat changes its resourceVersion, not what calix reads.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use calix_core::store::KeyValue;
use tokio::sync::mpsc::UnboundedSender;

use calix_datastore::follow::Follower;
use calix_datastore::{Datastore, DatastoreError};

/// What a source's value is, from the keys under its prefix.
pub type Read<T> = Arc<dyn Fn(&BTreeMap<String, KeyValue>) -> T + Send + Sync>;

/// A value kept current, shared.
#[derive(Clone)]
pub struct Source<T>(Arc<Mutex<T>>);

impl<T: Clone + PartialEq + Send + std::fmt::Debug + 'static> Source<T> {
    /// Lists `prefix` and reads the value; the follower keeps it current once
    /// [`Source::spawn_follow`] runs it.
    pub async fn load(
        store: Arc<dyn Datastore>,
        prefix: &str,
        read: &Read<T>,
    ) -> Result<(Self, Follower), DatastoreError> {
        let follower = Follower::start(store, prefix).await?;
        let value = read(follower.known());
        Ok((Self(Arc::new(Mutex::new(value))), follower))
    }

    /// A source that never changes (the cluster does not have it).
    pub fn fixed(value: T) -> Self {
        Self(Arc::new(Mutex::new(value)))
    }

    pub fn current(&self) -> T {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Follows for as long as the agent runs; `changed` gets `what` after each change of the
    /// value.
    pub fn spawn_follow(
        &self,
        mut follower: Follower,
        read: Read<T>,
        what: &'static str,
        changed: UnboundedSender<&'static str>,
    ) {
        let value = self.0.clone();
        tokio::spawn(async move {
            loop {
                let event = follower.next().await;
                let now = read(follower.known());
                let mut held = value.lock().unwrap_or_else(|p| p.into_inner());
                if *held == now {
                    tracing::debug!(key = %event.key(), revision = event.revision(), "{what}: nothing calix reads changed");
                    continue;
                }
                tracing::info!(key = %event.key(), revision = event.revision(), value = ?now, "{what}");
                *held = now;
                drop(held);
                if changed.send(what).is_err() {
                    return;
                }
            }
        });
    }
}
