//! The datastore's plain types, what the pure code reads: a stored key with its revision
//! ([`KeyValue`]), a change a watch delivers ([`WatchEvent`]), and the key layout ([`keys`]).
//! The store itself (the `Datastore` trait and its backends) lives in the agent.
pub mod keys;

use serde::Deserialize;

/// One stored key with the revision of its last change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// Revision at which this key was last written (etcd's `mod_revision`); never 0.
    pub revision: i64,
    /// When the key was created, as the backend itself stamps it (no client sets it, and
    /// later writes leave it): etcd's `create_revision`, the embedded store's revision of the
    /// creating write, Kubernetes' `creationTimestamp` in seconds (two objects created in
    /// one second tie). Only comparable between keys of one store; 0 when unknown.
    pub created: i64,
}

/// A stored value that is not what calix wrote (the agent's `DatastoreError::BadValue`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("datastore value at {key} is not what calix wrote: {detail}")]
pub struct BadValue {
    pub key: String,
    pub detail: String,
}

impl KeyValue {
    /// Decodes the JSON value.
    pub fn decode<T: for<'de> Deserialize<'de>>(&self) -> Result<T, BadValue> {
        serde_json::from_slice(&self.value).map_err(|e| BadValue {
            key: self.key.clone(),
            detail: e.to_string(),
        })
    }
}

/// One change seen by a watch of the datastore. Backend-neutral: etcd's events, the embedded
/// store's commits and Kubernetes watch events all map to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// The key was created or changed; its `revision` is that of the change.
    Put(KeyValue),
    /// The key was deleted at `revision`.
    Delete { key: String, revision: i64 },
}

impl WatchEvent {
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }

    pub fn revision(&self) -> i64 {
        match self {
            WatchEvent::Put(kv) => kv.revision,
            WatchEvent::Delete { revision, .. } => *revision,
        }
    }
}
