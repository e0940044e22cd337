//! The datastore conformance suite (tests/conformance) against the embedded store, in a
//! temporary directory: no root, no server.
#[macro_use]
mod conformance;

use std::path::PathBuf;

use calix_datastore::EmbeddedStore;

/// An embedded store in a directory of its own; a restart drops it and opens the same files.
struct Embedded {
    dir: tempfile::TempDir,
}

impl Embedded {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("store.json")
    }
}

#[tonic::async_trait]
impl conformance::Backend for Embedded {
    type Store = EmbeddedStore;

    async fn open(&self) -> EmbeddedStore {
        EmbeddedStore::open(&self.path()).expect("open")
    }

    async fn compact(&self, store: &EmbeddedStore, revision: i64) {
        store.compact_history(revision);
    }

    async fn restart(&self, store: EmbeddedStore) -> EmbeddedStore {
        drop(store);
        EmbeddedStore::open(&self.path()).expect("reopen")
    }
}

datastore_conformance!(Embedded::new());
