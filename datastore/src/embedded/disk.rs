//! The embedded store's files: the snapshot and the journal's line format, the journal's
//! replay at open, and the compaction that folds the journal into a new snapshot.
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::{EmbeddedStore, Inner};
use crate::history::{self, History};
use crate::DatastoreError;

/// The keys: key → (revision of its last write, revision that created it, value).
pub(super) type Keys = BTreeMap<String, (i64, i64, Vec<u8>)>;

/// After consecutive failed compactions, wait `COMPACT_AFTER << min(failures, this)` more
/// transactions before the next try.
const COMPACT_BACKOFF_MAX_SHIFT: u32 = 3;

#[derive(Serialize, Deserialize, Default)]
pub(super) struct Snapshot {
    pub(super) revision: i64,
    /// key → (revision, value as JSON text)
    pub(super) keys: BTreeMap<String, (i64, String)>,
    /// key → revision of the write that created it. Absent in snapshots of earlier versions:
    /// a key missing here counts as created at its last revision.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) created: BTreeMap<String, i64>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct JournalEntry {
    pub(super) rev: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) put: Vec<(String, String)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) del: Vec<String>,
}

pub(super) fn io<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> DatastoreError + 'a {
    move |source| DatastoreError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

pub(super) fn corrupt(path: &Path, detail: impl std::fmt::Display) -> DatastoreError {
    DatastoreError::Corrupt {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// `path` with `suffix` appended to its file name (`store.json` → `store.json.journal`).
pub(super) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// Makes a rename or a newly created file in `dir` durable.
pub(super) fn sync_dir(dir: &Path) -> Result<(), DatastoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir, "fsync directory"))
}

impl EmbeddedStore {
    /// Writes the whole state as the snapshot and empties the journal. On failure nothing the
    /// store relies on has changed: the journal still holds every line.
    pub(super) fn compact(&self, inner: &mut Inner) -> Result<(), DatastoreError> {
        inner.compact_attempts += 1;
        let snap = Snapshot {
            revision: inner.revision,
            keys: inner
                .keys
                .iter()
                .map(|(k, (r, _, v))| (k.clone(), (*r, String::from_utf8_lossy(v).into_owned())))
                .collect(),
            created: inner
                .keys
                .iter()
                .map(|(k, (_, c, _))| (k.clone(), *c))
                .collect(),
        };
        let bytes = serde_json::to_vec(&snap).map_err(|e| corrupt(&self.snapshot_path, e))?;
        let tmp = with_suffix(&self.snapshot_path, ".tmp");
        let written = (|| {
            let mut f = File::create(&tmp).map_err(io(&tmp, "create"))?;
            f.write_all(&bytes).map_err(io(&tmp, "write"))?;
            f.sync_all().map_err(io(&tmp, "fsync"))?;
            fs::rename(&tmp, &self.snapshot_path).map_err(io(&self.snapshot_path, "rename"))
        })();
        if let Err(e) = written {
            // A half-written temporary only takes space (on a disk that may be full).
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        // Until the directory is synced the old snapshot may come back after a power loss:
        // the journal must keep its lines until then.
        if let Some(dir) = self.snapshot_path.parent() {
            sync_dir(dir)?;
        }
        inner
            .journal
            .set_len(0)
            .map_err(io(&self.journal_path, "truncate"))?;
        inner.journal_len = 0;
        inner.journal_entries = 0;
        // Not fatal: every line it held is in the snapshot, and the next fdatasync of the
        // journal (whose failure does poison the store) makes its new length durable.
        if let Err(e) = inner.journal.sync_all() {
            tracing::warn!(error = %e, "embedded datastore: fsync of the emptied journal failed");
        }
        // The snapshot (fsync'd) holds everything up to here.
        self.synced.fetch_max(inner.revision, Ordering::AcqRel);
        tracing::info!(
            keys = inner.keys.len(),
            revision = inner.revision,
            "embedded datastore compacted"
        );
        Ok(())
    }

    /// Compacts when the journal is due; a failure is logged and the next try put off.
    pub(super) fn maybe_compact(&self, inner: &mut Inner) {
        if inner.journal_entries < inner.compact_retry_at.unwrap_or(self.compact_after) {
            return;
        }
        match self.compact(inner) {
            Ok(()) => {
                inner.compact_failures = 0;
                inner.compact_retry_at = None;
            }
            Err(e) => {
                inner.compact_failures = inner.compact_failures.saturating_add(1);
                let wait =
                    self.compact_after << inner.compact_failures.min(COMPACT_BACKOFF_MAX_SHIFT);
                inner.compact_retry_at = Some(inner.journal_entries.saturating_add(wait));
                tracing::warn!(error = %e, failures = inner.compact_failures,
                    retry_after_transactions = wait,
                    "embedded datastore compaction failed (nothing lost: the journal keeps every line)");
            }
        }
    }
}

/// Applies the journal's lines newer than the snapshot, recording them in `history`; cuts off a
/// torn last line. Returns the length of the journal's whole lines.
pub(super) fn replay(
    path: &Path,
    inner: &mut Inner,
    history: &mut History,
) -> Result<u64, DatastoreError> {
    let mut reader = BufReader::new(File::open(path).map_err(io(path, "read"))?);
    let mut good_len: u64 = 0;
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(io(path, "read"))?;
        if n == 0 {
            break;
        }
        let complete = line.last() == Some(&b'\n');
        let entry: JournalEntry = match serde_json::from_slice(&line) {
            Ok(e) if complete => e,
            Ok(_) | Err(_) => {
                // Only the last line may be torn: anything after it means real corruption.
                let mut rest = Vec::new();
                std::io::Read::read_to_end(&mut reader, &mut rest).map_err(io(path, "read"))?;
                if !rest.is_empty() {
                    return Err(corrupt(
                        path,
                        format!("unreadable journal line at byte {good_len}"),
                    ));
                }
                tracing::warn!(
                    at = good_len,
                    "embedded datastore: cutting off a torn last journal line (a write that was never acknowledged)"
                );
                inner
                    .journal
                    .set_len(good_len)
                    .map_err(io(path, "truncate"))?;
                break;
            }
        };
        good_len += n as u64;
        inner.journal_entries += 1;
        if entry.rev <= inner.revision {
            continue;
        }
        inner.revision = entry.rev;
        history.push(entry.rev, apply(&mut inner.keys, entry));
    }
    Ok(good_len)
}

/// Applies a journal entry to the keys (puts, then deletes); returns the changes it made, for
/// watches: each put (with the key's creation revision), and each delete of a key that
/// existed.
pub(super) fn apply(keys: &mut Keys, entry: JournalEntry) -> Vec<history::Change> {
    let mut changes = Vec::with_capacity(entry.put.len() + entry.del.len());
    for (k, v) in entry.put {
        let v = v.into_bytes();
        let created = keys.get(&k).map_or(entry.rev, |(_, c, _)| *c);
        keys.insert(k.clone(), (entry.rev, created, v.clone()));
        changes.push((k, Some((v, created))));
    }
    for k in entry.del {
        if keys.remove(&k).is_some() {
            changes.push((k, None));
        }
    }
    changes
}
