//! The embedded datastore: the keys live in memory, every transaction is appended to a journal
//! file (one JSON line, fsync'd for [`Durability::Power`]), and the journal is folded into a
//! snapshot file now and then. A write costs one append, whatever the store's size.
//!
//! Crash safety: a transaction is one line, written with one `write`; a torn last line (a crash
//! mid-write) was never acknowledged and is cut off on open. An append that fails (a full disk:
//! part of the line may be written) is cut back to the journal's length before it, so the next
//! line never lands behind a fragment; if even that fails, the store is poisoned. Flushes are
//! group commits: a [`Durability::Power`] write (or [`Datastore::sync`]) waits for one
//! `fdatasync` that started after its line was appended, so concurrent writers share a flush;
//! none is acknowledged before its flush. A failed flush poisons the store too (every later
//! write fails, [`DatastoreError::Poisoned`]): after a failed `fdatasync` the kernel may have
//! dropped the dirty pages, so only a restart (replaying what is really on disk) is safe.
//!
//! The snapshot is replaced by write-temporary, fsync, rename, fsync-directory, and only then is
//! the journal truncated; a crash in between replays journal lines the snapshot already has,
//! which are skipped by revision. A compaction that fails changes nothing the store relies on
//! (the journal still has every line) and is retried only after the journal has grown further.
//! One process at a time: the journal is `flock`ed. Paths are made absolute at open, so a
//! relative `--datastore-path` means the same files for the agent's whole life.
//!
//! Watches read a window of the last transactions ([`crate::history`]), filled from the journal
//! at open (the lines after the snapshot) and by every commit: a watch from a revision before
//! the window reports [`DatastoreError::Compacted`], and every watch ends with
//! [`DatastoreError::WatchEnded`] when the store is dropped.
mod disk;
#[cfg(test)]
mod tests;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use calix_core::store::KeyValue;

use self::disk::{apply, corrupt, io, replay, sync_dir, with_suffix, JournalEntry, Keys, Snapshot};
use crate::history::{self, History};
use crate::{Compare, Datastore, DatastoreError, Durability, Op, WatchStream};

/// Fold the journal into the snapshot after this many transactions.
const COMPACT_AFTER: u64 = 20_000;

struct Inner {
    revision: i64,
    keys: Keys,
    journal: File,
    /// The journal's length: every byte of it a whole line.
    journal_len: u64,
    journal_entries: u64,
    /// After a failed compaction: retry once `journal_entries` reaches this (else the
    /// store's `compact_after`).
    compact_retry_at: Option<u64>,
    /// Compactions failed in a row (the backoff).
    compact_failures: u32,
    /// Compactions tried (tests).
    compact_attempts: u64,
}

pub struct EmbeddedStore {
    snapshot_path: PathBuf,
    journal_path: PathBuf,
    inner: Mutex<Inner>,
    /// Group commit: a second fd on the journal, flushed outside `inner` so appends go on
    /// during a flush; held (async) by the one flushing.
    flush: tokio::sync::Mutex<File>,
    /// Every revision up to this one is on disk.
    synced: AtomicI64,
    /// Why the store takes no more writes, once it does not: see the module docs.
    poisoned: OnceLock<&'static str>,
    /// Fold the journal into the snapshot after this many transactions.
    compact_after: u64,
    /// The last transactions, for watches; appended to under `inner`.
    history: Arc<Mutex<History>>,
    /// The newest revision, sent after each commit: wakes the watches.
    revision_tx: tokio::sync::watch::Sender<i64>,
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store whose snapshot is `path`; the journal is
    /// `<path>.journal`. A relative `path` is taken from the current directory, once. Fails if
    /// another process has it open.
    pub fn open(path: &Path) -> Result<Self, DatastoreError> {
        // Absolute from here on: `store.json` has the parent "", which no directory call takes,
        // and a later change of directory must not move the store.
        let snapshot_path = std::path::absolute(path).map_err(io(path, "resolve"))?;
        let dir = snapshot_path
            .parent()
            .ok_or_else(|| corrupt(&snapshot_path, "the path names no file"))?
            .to_path_buf();
        fs::create_dir_all(&dir).map_err(io(&dir, "create directory"))?;
        let journal_path = with_suffix(&snapshot_path, ".journal");

        let snapshot: Snapshot = match fs::read(&snapshot_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| corrupt(&snapshot_path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Snapshot::default(),
            Err(e) => return Err(io(&snapshot_path, "read")(e)),
        };
        let journal = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&journal_path)
            .map_err(io(&journal_path, "open"))?;
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        if unsafe { libc::flock(journal.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(
                io(&journal_path, "lock (is another calix-agent using it?)")(
                    std::io::Error::last_os_error(),
                ),
            );
        }
        let created = snapshot.created;
        let mut inner = Inner {
            revision: snapshot.revision,
            keys: snapshot
                .keys
                .into_iter()
                .map(|(k, (r, v))| {
                    let c = created.get(&k).copied().unwrap_or(r);
                    (k, (r, c, v.into_bytes()))
                })
                .collect(),
            journal,
            journal_len: 0,
            journal_entries: 0,
            compact_retry_at: None,
            compact_failures: 0,
            compact_attempts: 0,
        };
        let mut history = History::new(inner.revision);
        inner.journal_len = replay(&journal_path, &mut inner, &mut history)?;
        let flush = inner
            .journal
            .try_clone()
            .map_err(io(&journal_path, "duplicate fd"))?;
        // What replay read back may sit in the page cache only (a crash of the process, not of
        // the machine): flush it before anything is built on it. The directory too: the
        // journal may have just been created.
        flush.sync_data().map_err(io(&journal_path, "fsync"))?;
        sync_dir(&dir)?;
        let synced = AtomicI64::new(inner.revision);
        let (revision_tx, _) = tokio::sync::watch::channel(inner.revision);
        tracing::debug!(
            keys = inner.keys.len(),
            revision = inner.revision,
            journal_entries = inner.journal_entries,
            "embedded datastore opened"
        );
        Ok(Self {
            snapshot_path,
            journal_path,
            inner: Mutex::new(inner),
            flush: tokio::sync::Mutex::new(flush),
            synced,
            poisoned: OnceLock::new(),
            compact_after: COMPACT_AFTER,
            history: Arc::new(Mutex::new(history)),
            revision_tx,
        })
    }

    /// Forgets the changes before `revision` for watches (what etcd's Compact does): a watch
    /// from an older revision then reports [`DatastoreError::Compacted`]. The keys are kept.
    pub fn compact_history(&self, revision: i64) {
        self.history
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .compact(revision);
    }

    fn check_poisoned(&self) -> Result<(), DatastoreError> {
        match self.poisoned.get() {
            Some(reason) => Err(DatastoreError::Poisoned {
                path: self.journal_path.clone(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Refuses every later write, logging why once.
    fn poison(&self, reason: &'static str) {
        if self.poisoned.set(reason).is_ok() {
            tracing::error!(path = %self.journal_path.display(), %reason,
                "embedded datastore: refusing every further write; restart the agent");
        }
    }

    /// Group commit: returns once every line up to `rev` is on disk. Whoever holds `flush`
    /// flushes everything appended so far, so the writers that queued behind it usually find
    /// their line already covered and return without a flush of their own.
    async fn sync_to(&self, rev: i64) -> Result<(), DatastoreError> {
        if self.synced.load(Ordering::Acquire) >= rev {
            return self.check_poisoned();
        }
        let file = self.flush.lock().await;
        self.check_poisoned()?;
        if self.synced.load(Ordering::Acquire) >= rev {
            return Ok(());
        }
        // Every line up to `target` was written (under `inner`) before this read.
        let target = self.lock().revision;
        match blocking(|| file.sync_data()) {
            Ok(()) => {
                self.synced.fetch_max(target, Ordering::AcqRel);
                Ok(())
            }
            Err(e) => {
                self.poison(
                    "an fsync of the journal failed (the kernel may have dropped written lines)",
                );
                Err(io(&self.journal_path, "fsync")(e))
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs a blocking call (a disk flush) without holding up the runtime's other tasks: on the
/// multi-threaded runtime the worker hands them over first.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[tonic::async_trait]
impl Datastore for EmbeddedStore {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, DatastoreError> {
        Ok(self.lock().keys.get(key).map(|(r, c, v)| KeyValue {
            key: key.to_string(),
            value: v.clone(),
            revision: *r,
            created: *c,
        }))
    }

    async fn list_with_revision(
        &self,
        prefix: &str,
    ) -> Result<(Vec<KeyValue>, i64), DatastoreError> {
        let inner = self.lock();
        let kvs = inner
            .keys
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (r, c, v))| KeyValue {
                key: k.clone(),
                value: v.clone(),
                revision: *r,
                created: *c,
            })
            .collect();
        Ok((kvs, inner.revision))
    }

    async fn txn(
        &self,
        compares: &[Compare],
        ops: &[Op],
        durability: Durability,
    ) -> Result<Option<i64>, DatastoreError> {
        self.check_poisoned()?;
        let Some(rev) = self.append(compares, ops)? else {
            return Ok(None);
        };
        if durability == Durability::Power {
            self.sync_to(rev).await?;
        }
        Ok(Some(rev))
    }

    async fn sync(&self, revision: i64) -> Result<(), DatastoreError> {
        self.sync_to(revision).await
    }

    async fn watch(&self, prefix: &str, after: i64) -> Result<WatchStream, DatastoreError> {
        Ok(history::stream(
            self.history.clone(),
            self.revision_tx.subscribe(),
            prefix,
            after,
        ))
    }
}

impl EmbeddedStore {
    /// The synchronous part of a transaction: compares, one journal append, the in-memory
    /// apply. `None` when a compare failed.
    fn append(&self, compares: &[Compare], ops: &[Op]) -> Result<Option<i64>, DatastoreError> {
        let mut inner = self.lock();
        let holds = compares.iter().all(|c| match c {
            Compare::Absent(k) => !inner.keys.contains_key(k),
            Compare::Revision(k, r) => inner.keys.get(k).is_some_and(|(kr, _, _)| kr == r),
        });
        if !holds {
            return Ok(None);
        }
        let rev = inner.revision + 1;
        let mut entry = JournalEntry {
            rev,
            put: Vec::new(),
            del: Vec::new(),
        };
        for op in ops {
            match op {
                Op::Put(k, v) => entry
                    .put
                    .push((k.clone(), String::from_utf8_lossy(v).into_owned())),
                Op::Delete(k) => entry.del.push(k.clone()),
            }
        }
        let mut line = serde_json::to_vec(&entry).map_err(|e| corrupt(&self.journal_path, e))?;
        line.push(b'\n');
        // One write per transaction (O_APPEND): a crash leaves it whole or torn, never mixed.
        if let Err(e) = inner.journal.write_all(&line) {
            // Part of the line may be on disk (ENOSPC after a short write): cut it off, or the
            // next line would land behind the fragment and be lost as torn on the next open.
            let len = inner.journal_len;
            if let Err(te) = inner.journal.set_len(len) {
                tracing::error!(error = %te, path = %self.journal_path.display(), len,
                    "embedded datastore: cannot cut a failed append back");
                self.poison(
                    "a failed append could not be cut back (the journal ends in a fragment)",
                );
            }
            return Err(io(&self.journal_path, "append")(e));
        }
        inner.journal_len += line.len() as u64;
        inner.revision = rev;
        inner.journal_entries += 1;
        let changes = apply(&mut inner.keys, entry);
        self.history
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(rev, changes);
        // The transaction is in the journal whatever the compaction does.
        self.maybe_compact(&mut inner);
        drop(inner);
        // Only a wake-up: the watches read the window, not this value.
        self.revision_tx.send_modify(|r| *r = (*r).max(rev));
        Ok(Some(rev))
    }
}
