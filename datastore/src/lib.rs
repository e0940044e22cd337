//! Where the agent's durable state lives: a small key-value interface with per-key revisions
//! and compare-and-swap transactions, so IPAM and the endpoint registry don't care which
//! backend holds them. `embedded` (a crash-safe local journal) is the single-node default;
//! `etcd` (etcd v3) is shared by several nodes; `kubernetes` keeps them as custom resources in
//! the cluster's API ([`kubernetes`]).
//!
//! Keys are `/`-separated text (see `calix_core::store::keys`); values are JSON. Every write is
//! a [`Datastore::txn`]: it applies only if each [`Compare`] still holds, which is how two
//! agents (or two requests) can never both take the same address. calix's own writes compare
//! and write ONE key per transaction: a Kubernetes backend can only compare-and-swap one
//! object at a time, so that is the contract every backend must meet (embedded and etcd
//! accept more).
//!
//! [`Datastore::watch`] streams every change under a prefix after a revision, so a reader can
//! list once ([`Datastore::list_with_revision`]) and then follow
//! (`calix_core::store::WatchEvent`).
pub mod embedded;
pub mod etcd;
pub mod follow;
mod history;
pub mod kubernetes;

use calix_core::store::{KeyValue, WatchEvent};
use serde::{Deserialize, Serialize};

pub use embedded::EmbeddedStore;
pub use etcd::{EtcdConfig, EtcdStore};
pub use kubernetes::{KubeConfig, KubeStore};

/// An opened backend, and the Kubernetes client when it is the `kubernetes` one (for the
/// agent's other readers of the API).
pub struct Opened {
    pub store: std::sync::Arc<dyn Datastore>,
    pub kube: Option<kube::Client>,
}

/// Which backend holds the agent's records, and how to reach it (the config's `[datastore]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// A local file (its journal is `<path>.journal`): a single node.
    Embedded { path: std::path::PathBuf },
    /// etcd v3, shared by several nodes.
    Etcd(EtcdConfig),
    /// Custom resources in the cluster's API.
    Kubernetes(KubeConfig),
}

/// Opens `backend`.
pub async fn open(backend: &Backend) -> Result<Opened, DatastoreError> {
    Ok(match backend {
        Backend::Etcd(cfg) => Opened {
            store: std::sync::Arc::new(EtcdStore::connect(cfg.clone()).await?),
            kube: None,
        },
        Backend::Kubernetes(cfg) => {
            let store = KubeStore::connect(cfg).await?;
            Opened {
                kube: Some(store.client()),
                store: std::sync::Arc::new(store),
            }
        }
        Backend::Embedded { path } => Opened {
            store: std::sync::Arc::new(EmbeddedStore::open(path)?),
            kube: None,
        },
    })
}

#[derive(Debug, thiserror::Error)]
pub enum DatastoreError {
    #[error("datastore file {path}: {op} failed")]
    Io {
        path: std::path::PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "datastore file {path} takes no more writes: {reason}; restart calix-agent (it replays what is really on disk)"
    )]
    Poisoned {
        path: std::path::PathBuf,
        reason: &'static str,
    },
    #[error("datastore file {path} is corrupt ({detail}); move it away to start empty")]
    Corrupt {
        path: std::path::PathBuf,
        detail: String,
    },
    #[error("datastore value at {key} is not what calix wrote: {detail}")]
    BadValue { key: String, detail: String },
    #[error("datastore {backend} is unavailable after {attempts} attempts: {detail}")]
    Unavailable {
        backend: &'static str,
        attempts: u32,
        detail: String,
    },
    #[error("datastore write kept conflicting with other writers ({attempts} attempts): {what}")]
    Contended { attempts: u32, what: String },
    /// A watch asked for changes the backend no longer keeps: list again, then watch from the
    /// listing's revision.
    #[error(
        "datastore watch after revision {after}: changes before revision {compacted} are compacted away; list again and watch from the listing's revision"
    )]
    Compacted { after: i64, compacted: i64 },
    /// A watch stream ended (connection lost, backend restarted or closed, the server cancelled
    /// it). No event was lost: watch again from the last revision seen.
    #[error("datastore {backend} watch ended: {detail}; watch again from the last revision seen")]
    WatchEnded {
        backend: &'static str,
        detail: String,
    },
    /// The backend answered and refused: not something a retry fixes (a missing CRD, RBAC, a
    /// value the API server's schema rejects). `code` is the HTTP status (0: none).
    #[error("datastore {backend} refused {what} ({code}): {detail}")]
    Rejected {
        backend: &'static str,
        what: String,
        code: u16,
        detail: String,
    },
    /// A key the backend has no place for (the kubernetes backend stores calix's key space
    /// only: `datastore::keys` and `pools/`).
    #[error("datastore {backend} has no place for key {key:?}")]
    OutsideKeySpace { backend: &'static str, key: String },
    /// A write to a key the backend only reads (kubernetes: Kubernetes' own objects, `k8s/`).
    #[error("datastore {backend} only reads {key:?}: it is Kubernetes' own object")]
    ReadOnly { backend: &'static str, key: String },
    /// A watch over a prefix the backend cannot watch as one ordered stream (kubernetes: a
    /// prefix spanning several kinds of object).
    #[error("datastore {backend} cannot watch {prefix:?}: {why}")]
    Unwatchable {
        backend: &'static str,
        prefix: String,
        why: &'static str,
    },
    /// A transaction over more than one key, on a backend that commits one object at a time.
    #[error("datastore {backend} commits one object per transaction; this one touches {keys:?}")]
    TooManyObjects {
        backend: &'static str,
        keys: Vec<String>,
    },
}

/// The records of `kvs` whose value's `node` field is `node` (a value that does not decode
/// belongs to nobody).
pub fn keep_node(kvs: Vec<KeyValue>, node: &str) -> Vec<KeyValue> {
    #[derive(Deserialize)]
    struct Owner {
        #[serde(default)]
        node: String,
    }
    kvs.into_iter()
        .filter(|kv| kv.decode::<Owner>().is_ok_and(|o| o.node == node))
        .collect()
}

impl From<calix_core::store::BadValue> for DatastoreError {
    fn from(e: calix_core::store::BadValue) -> Self {
        DatastoreError::BadValue {
            key: e.key,
            detail: e.detail,
        }
    }
}

/// A condition a transaction checks before it writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key exists and was last written at this revision.
    Revision(String, i64),
}

/// A write in a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put(String, Vec<u8>),
    Delete(String),
}

impl Op {
    /// A put of `value` as JSON.
    pub fn put_json<T: Serialize>(key: impl Into<String>, value: &T) -> Self {
        // Serialising our own plain structs to JSON cannot fail (no maps with non-string keys).
        Op::Put(
            key.into(),
            serde_json::to_vec(value).unwrap_or_else(|_| b"null".to_vec()),
        )
    }
}

/// The changes a [`Datastore::watch`] delivers, in revision order. It never ends quietly: its
/// last item is an error ([`DatastoreError::Compacted`] or [`DatastoreError::WatchEnded`]),
/// after which it yields nothing more. Dropping it cancels the watch.
pub type WatchStream = futures::stream::BoxStream<'static, Result<WatchEvent, DatastoreError>>;

/// How durable a commit must be before it is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Survives power loss (fsync). Every new allocation: an address handed out must never be
    /// handed out twice.
    Power,
    /// Survives the agent crashing (the kernel has the write), not power loss. Enough for
    /// endpoint records (no pod network outlives a reboot) and for releases (losing one only
    /// leaves an address allocated, which leak GC reclaims). etcd always gives `Power`.
    Process,
}

/// A datastore backend.
#[tonic::async_trait]
pub trait Datastore: Send + Sync {
    /// "embedded" or "etcd", for logs and errors.
    fn kind(&self) -> &'static str;
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, DatastoreError>;
    /// Every key starting with `prefix`, in key order, and the store's revision the listing
    /// reflects (etcd: the response header's; every write up to it is in the listing).
    async fn list_with_revision(
        &self,
        prefix: &str,
    ) -> Result<(Vec<KeyValue>, i64), DatastoreError>;
    /// Every key starting with `prefix`, in key order.
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, DatastoreError> {
        Ok(self.list_with_revision(prefix).await?.0)
    }
    /// The records under `prefix` that belong to `node` (their value's `node` field), in key
    /// order: what a node lists of its own (its handles) without reading every node's. The
    /// kubernetes backend asks the API server for those alone (by the `calix.dev/node`
    /// label); etcd and the embedded store, whose keys do not carry the node, list `prefix`
    /// and keep `node`'s.
    async fn list_of_node(
        &self,
        prefix: &str,
        node: &str,
    ) -> Result<Vec<KeyValue>, DatastoreError> {
        Ok(keep_node(self.list(prefix).await?, node))
    }
    /// Applies `ops` atomically if every compare holds: `Some(revision)` of the write, or `None`
    /// when a compare failed (nothing was written). Errors are the backend failing, after the
    /// backend's own bounded retries.
    async fn txn(
        &self,
        compares: &[Compare],
        ops: &[Op],
        durability: Durability,
    ) -> Result<Option<i64>, DatastoreError>;
    /// Every change to a key starting with `prefix` made after revision `after`, in revision
    /// order (the events of one transaction share its revision), then every later change as it
    /// is committed. `after` is typically the revision of a [`Self::list_with_revision`] of the
    /// same prefix: list, then watch from there, and nothing is missed or seen twice.
    ///
    /// When the backend no longer keeps the changes after `after` (compacted history), the
    /// stream's first item is [`DatastoreError::Compacted`]: list again. When the connection to
    /// the backend breaks (or the backend restarts or closes), the stream ends with
    /// [`DatastoreError::WatchEnded`]: call `watch` again from the last revision received (a
    /// resumed watch may then report `Compacted`). The store never resumes a watch by itself.
    /// `watch` itself fails only when the backend cannot be reached to start it (after its own
    /// bounded retries).
    async fn watch(&self, prefix: &str, after: i64) -> Result<WatchStream, DatastoreError>;
    /// Returns once every write up to `revision` survives power loss. A caller that committed
    /// with [`Durability::Process`] calls this before acknowledging what it wrote, after letting
    /// go of its own locks, so that concurrent writers share one disk flush (group commit).
    /// Backends whose every write is durable (etcd) have nothing to do.
    async fn sync(&self, _revision: i64) -> Result<(), DatastoreError> {
        Ok(())
    }
}
