//! The embedded datastore: one JSON file, written crash-safely (write a temporary file, fsync,
//! rename over the old one, fsync the directory). A crash at any point leaves either the old or
//! the new state, never a torn file.
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Datastore, DatastoreError, Durability, EndpointRecord, StoreState};
use crate::ipam::IpamState;

/// [`StoreState`]'s serialised form, borrowed.
#[derive(Serialize)]
struct StoreStateRef<'a> {
    revision: u64,
    ipam: &'a IpamState,
    endpoints: &'a BTreeMap<String, EndpointRecord>,
}

pub struct EmbeddedStore {
    path: PathBuf,
    /// Serialises commits from this process and remembers the revision last read or written:
    /// the file has one writer (this agent), so a commit need not re-read it.
    lock: Mutex<Option<u64>>,
}

impl EmbeddedStore {
    /// Opens (creating the directory if needed) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, DatastoreError> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|source| DatastoreError::Io {
                path: dir.to_path_buf(),
                op: "create directory",
                source,
            })?;
        }
        Ok(Self {
            path: path.to_path_buf(),
            lock: Mutex::new(None),
        })
    }

    fn io(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> DatastoreError + '_ {
        move |source| DatastoreError::Io {
            path: self.path.clone(),
            op,
            source,
        }
    }

    fn read(&self) -> Result<StoreState, DatastoreError> {
        match fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| DatastoreError::Corrupt {
                path: self.path.clone(),
                source,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StoreState::default()),
            Err(e) => Err(self.io("read")(e)),
        }
    }
}

impl Datastore for EmbeddedStore {
    fn load(&self) -> Result<StoreState, DatastoreError> {
        let mut known = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let state = self.read()?;
        *known = Some(state.revision);
        Ok(state)
    }

    fn commit(&self, state: &StoreState, durability: Durability) -> Result<u64, DatastoreError> {
        let mut known = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let current = match *known {
            Some(r) => r,
            None => self.read()?.revision,
        };
        if current != state.revision {
            return Err(DatastoreError::Conflict {
                expected: state.revision,
                found: current,
            });
        }
        let t0 = std::time::Instant::now();
        let revision = current + 1;
        // Serialise the caller's state with the new revision, without copying it.
        let bytes = serde_json::to_vec(&StoreStateRef {
            revision,
            ipam: &state.ipam,
            endpoints: &state.endpoints,
        })
        .map_err(|source| DatastoreError::Corrupt {
            path: self.path.clone(),
            source,
        })?;
        let tmp = self.path.with_extension("json.tmp");
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(self.io("create temporary file"))?;
            f.write_all(&bytes).map_err(self.io("write"))?;
            if durability == Durability::Power {
                f.sync_all().map_err(self.io("fsync"))?;
            }
        }
        // Rename over the old file: readers see the old or the new state, never a torn one.
        fs::rename(&tmp, &self.path).map_err(self.io("rename"))?;
        if let Some(dir) = self
            .path
            .parent()
            .filter(|_| durability == Durability::Power)
        {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(self.io("fsync directory"))?;
        }
        *known = Some(revision);
        tracing::debug!(
            bytes = bytes.len(),
            ?durability,
            us = t0.elapsed().as_micros() as u64,
            "datastore commit"
        );
        Ok(revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datastore::EndpointRecord;

    #[test]
    fn roundtrip_and_revision_cas() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EmbeddedStore::open(&dir.path().join("sub/store.json")).expect("open");
        let mut s = store.load().expect("empty load");
        assert_eq!(s, StoreState::default());
        s.endpoints.insert(
            "c/eth0".into(),
            EndpointRecord {
                container_id: "c".into(),
                ifname: "eth0".into(),
                host_ifname: "cali0123456789a".into(),
                netns: "/run/netns/x".into(),
                pod_namespace: "default".into(),
                pod_name: "p".into(),
                addresses: vec!["10.0.0.1/32".into()],
                handle: "net.c".into(),
            },
        );
        assert_eq!(store.commit(&s, Durability::Power).expect("commit"), 1);
        let loaded = store.load().expect("load");
        assert_eq!(loaded.revision, 1);
        assert_eq!(loaded.endpoints, s.endpoints);
        // A second writer holding the old revision loses.
        assert!(matches!(
            store.commit(&s, Durability::Process),
            Err(DatastoreError::Conflict {
                expected: 0,
                found: 1
            })
        ));
        assert!(!dir.path().join("sub/store.json.tmp").exists());
    }

    #[test]
    fn corrupt_file_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store.json");
        fs::write(&path, b"{not json").expect("write");
        let store = EmbeddedStore::open(&path).expect("open");
        let err = store.load().expect_err("corrupt");
        assert!(err.to_string().contains("corrupt"), "{err}");
    }
}
