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
//! Watches read a window of the last transactions ([`super::history`]), filled from the journal
//! at open (the lines after the snapshot) and by every commit: a watch from a revision before
//! the window reports [`DatastoreError::Compacted`], and every watch ends with
//! [`DatastoreError::WatchEnded`] when the store is dropped.
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use calix_core::store::KeyValue;
use serde::{Deserialize, Serialize};

use super::history::{self, History};
use super::{Compare, Datastore, DatastoreError, Durability, Op, WatchStream};

/// The keys: key → (revision of its last write, revision that created it, value).
type Keys = BTreeMap<String, (i64, i64, Vec<u8>)>;

/// Fold the journal into the snapshot after this many transactions.
const COMPACT_AFTER: u64 = 20_000;
/// After consecutive failed compactions, wait `COMPACT_AFTER << min(failures, this)` more
/// transactions before the next try.
const COMPACT_BACKOFF_MAX_SHIFT: u32 = 3;

#[derive(Serialize, Deserialize, Default)]
struct Snapshot {
    revision: i64,
    /// key → (revision, value as JSON text)
    keys: BTreeMap<String, (i64, String)>,
    /// key → revision of the write that created it. Absent in snapshots of earlier versions:
    /// a key missing here counts as created at its last revision.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    created: BTreeMap<String, i64>,
}

#[derive(Serialize, Deserialize)]
struct JournalEntry {
    rev: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    put: Vec<(String, String)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    del: Vec<String>,
}

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

fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> DatastoreError + 'a {
    move |source| DatastoreError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

fn corrupt(path: &Path, detail: impl std::fmt::Display) -> DatastoreError {
    DatastoreError::Corrupt {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// `path` with `suffix` appended to its file name (`store.json` → `store.json.journal`).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// Makes a rename or a newly created file in `dir` durable.
fn sync_dir(dir: &Path) -> Result<(), DatastoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir, "fsync directory"))
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

    /// Writes the whole state as the snapshot and empties the journal. On failure nothing the
    /// store relies on has changed: the journal still holds every line.
    fn compact(&self, inner: &mut Inner) -> Result<(), DatastoreError> {
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
    fn maybe_compact(&self, inner: &mut Inner) {
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

/// Runs a blocking call (a disk flush) without holding up the runtime's other tasks: on the
/// multi-threaded runtime the worker hands them over first.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Applies the journal's lines newer than the snapshot, recording them in `history`; cuts off a
/// torn last line. Returns the length of the journal's whole lines.
fn replay(path: &Path, inner: &mut Inner, history: &mut History) -> Result<u64, DatastoreError> {
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
fn apply(keys: &mut Keys, entry: JournalEntry) -> Vec<history::Change> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &str, v: &str) -> Op {
        Op::Put(k.into(), v.as_bytes().to_vec())
    }

    #[tokio::test]
    async fn cas_list_and_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/store");
        {
            let s = EmbeddedStore::open(&path).expect("open");
            assert_eq!(s.get("a").await.expect("get"), None);
            let r1 = s
                .txn(
                    &[Compare::Absent("a".into())],
                    &[put("a", "1"), put("b/x", "2")],
                    Durability::Power,
                )
                .await
                .expect("txn")
                .expect("applied");
            // Absent no longer holds.
            assert_eq!(
                s.txn(
                    &[Compare::Absent("a".into())],
                    &[put("a", "9")],
                    Durability::Power
                )
                .await
                .expect("txn"),
                None
            );
            // Wrong revision loses, right one wins.
            assert_eq!(
                s.txn(
                    &[Compare::Revision("a".into(), r1 + 5)],
                    &[put("a", "9")],
                    Durability::Process
                )
                .await
                .expect("txn"),
                None
            );
            s.txn(
                &[Compare::Revision("a".into(), r1)],
                &[put("a", "3"), put("b/y", "4"), Op::Delete("b/x".into())],
                Durability::Process,
            )
            .await
            .expect("txn")
            .expect("applied");
            // A second process cannot open it while this one has it.
            assert!(EmbeddedStore::open(&path).is_err());
        }
        let s = EmbeddedStore::open(&path).expect("reopen");
        assert_eq!(s.get("a").await.expect("get").expect("a").value, b"3");
        let b: Vec<String> = s
            .list("b/")
            .await
            .expect("list")
            .into_iter()
            .map(|kv| kv.key)
            .collect();
        assert_eq!(b, vec!["b/y".to_string()]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn group_commit_acknowledges_only_flushed_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        let s = std::sync::Arc::new(EmbeddedStore::open(&path).expect("open"));
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move {
                    let rev = s
                        .txn(&[], &[put(&format!("k{i:02}"), "1")], Durability::Power)
                        .await
                        .expect("txn")
                        .expect("applied");
                    // Acknowledged: flushed up to its revision.
                    assert!(s.synced.load(Ordering::Acquire) >= rev);
                    rev
                })
            })
            .collect();
        let mut revs = Vec::new();
        for t in tasks {
            revs.push(t.await.expect("task"));
        }
        revs.sort_unstable();
        revs.dedup();
        assert_eq!(revs.len(), 32);
        // Appended now, flushed on request (what allocations do outside their lock).
        let rev = s
            .txn(&[], &[put("late", "2")], Durability::Process)
            .await
            .expect("txn")
            .expect("applied");
        s.sync(rev).await.expect("sync");
        assert!(s.synced.load(Ordering::Acquire) >= rev);
        drop(s);
        let s = EmbeddedStore::open(&path).expect("reopen");
        assert_eq!(s.list("k").await.expect("list").len(), 32);
        assert!(s.get("late").await.expect("get").is_some());
    }

    #[tokio::test]
    async fn torn_last_line_is_cut_and_compaction_keeps_everything() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        {
            let s = EmbeddedStore::open(&path).expect("open");
            s.txn(&[], &[put("k1", "\"v1\"")], Durability::Power)
                .await
                .expect("txn");
        }
        // A crash mid-append.
        let jp = dir.path().join("store.journal");
        let mut f = OpenOptions::new().append(true).open(&jp).expect("journal");
        f.write_all(b"{\"rev\":2,\"put\":[[\"k2\"").expect("write");
        drop(f);
        let s = EmbeddedStore::open(&path).expect("reopen after torn write");
        assert!(s.get("k2").await.expect("get").is_none());
        let rev = s
            .txn(&[], &[put("k2", "2")], Durability::Power)
            .await
            .expect("txn")
            .expect("applied");
        assert_eq!(rev, 2);
        {
            let mut inner = s.lock();
            s.compact(&mut inner).expect("compact");
        }
        s.txn(&[], &[put("k3", "3")], Durability::Power)
            .await
            .expect("txn");
        drop(s);
        let s = EmbeddedStore::open(&path).expect("reopen after compaction");
        let keys: Vec<(String, i64)> = s
            .list("k")
            .await
            .expect("list")
            .into_iter()
            .map(|kv| (kv.key, kv.revision))
            .collect();
        assert_eq!(
            keys,
            vec![("k1".into(), 1), ("k2".into(), 2), ("k3".into(), 3)]
        );
        // Creation stamps survive the snapshot: k2, created at 2 and rewritten at 4 after the
        // compaction, then folded into a second snapshot.
        s.txn(&[], &[put("k2", "again")], Durability::Power)
            .await
            .expect("txn");
        {
            let mut inner = s.lock();
            s.compact(&mut inner).expect("compact");
        }
        drop(s);
        let s = EmbeddedStore::open(&path).expect("reopen after the second compaction");
        let k2 = s.get("k2").await.expect("get").expect("k2");
        assert_eq!((k2.revision, k2.created), (4, 2));
    }

    /// Runs test `name` of this module again in a child process (this test binary, that test
    /// only) with `cwd` as its working directory, for tests that change process-wide state
    /// (the working directory, a resource limit). Returns true in the child, where the body
    /// runs; in the parent it checks that the child's test ran and passed, and returns false.
    fn in_child(name: &str, cwd: &Path) -> bool {
        const CHILD: &str = "CALIX_EMBEDDED_TEST_CHILD";
        if std::env::var_os(CHILD).is_some() {
            return true;
        }
        // The test's path in the binary: this module's, without the crate's name.
        let module = module_path!().split_once("::").map_or("", |(_, m)| m);
        let full = format!("{module}::{name}");
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([full.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .current_dir(cwd)
            .output()
            .expect("run the child test");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "child test {full} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        false
    }

    /// Limits the size of files this process writes (RLIMIT_FSIZE; `None`: no limit). A write
    /// across the limit is cut short, as on a full disk, and the next one fails (EFBIG).
    fn limit_file_size(bytes: Option<u64>) {
        // SAFETY: plain syscalls on a stack value; SIG_IGN for SIGXFSZ turns the signal a write
        // beyond the limit raises into an EFBIG error.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim), 0);
            lim.rlim_cur = bytes.unwrap_or(lim.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
        }
    }

    #[tokio::test]
    async fn a_short_append_is_cut_back_and_the_next_write_survives() {
        let dir = tempfile::tempdir().expect("tempdir");
        if !in_child(
            "a_short_append_is_cut_back_and_the_next_write_survives",
            dir.path(),
        ) {
            return;
        }
        let here = std::env::current_dir().expect("cwd");
        let path = here.join("store");
        let journal = here.join("store.journal");
        let s = EmbeddedStore::open(&path).expect("open");
        s.txn(&[], &[put("k1", "1")], Durability::Power)
            .await
            .expect("txn")
            .expect("applied");
        let len = fs::metadata(&journal).expect("journal").len();
        // Room for a few bytes of the next line only: the disk fills up mid-append.
        limit_file_size(Some(len + 10));
        let err = s
            .txn(&[], &[put("k2", &"x".repeat(300))], Durability::Power)
            .await
            .expect_err("the append cannot fit");
        assert!(err.to_string().contains("append"), "{err}");
        assert!(s.get("k2").await.expect("get").is_none());
        // Space again: this write is acknowledged, so it must survive a restart.
        limit_file_size(None);
        s.txn(&[], &[put("k3", "3")], Durability::Power)
            .await
            .expect("txn")
            .expect("applied");
        drop(s);
        let s = EmbeddedStore::open(&path).expect("reopen");
        assert!(
            s.get("k3").await.expect("get").is_some(),
            "the acknowledged write k3 was lost: it landed behind the fragment of the failed append"
        );
        assert!(s.get("k1").await.expect("get").is_some());
        assert!(s.get("k2").await.expect("get").is_none());
    }

    /// Makes every later `ftruncate` of this thread (and of threads it starts) fail with EIO:
    /// a seccomp filter, which needs no privileges once `no_new_privs` is set.
    fn fail_ftruncate() {
        let stmt = |code: u32, k: u32| libc::sock_filter {
            code: code as u16,
            jt: 0,
            jf: 0,
            k,
        };
        let filter = [
            // The syscall number: offset 0 of struct seccomp_data.
            stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
            libc::sock_filter {
                code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
                jt: 0,
                jf: 1,
                k: libc::SYS_ftruncate as u32,
            },
            stmt(
                libc::BPF_RET | libc::BPF_K,
                libc::SECCOMP_RET_ERRNO | (libc::EIO as u32 & libc::SECCOMP_RET_DATA),
            ),
            stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
        ];
        let prog = libc::sock_fprog {
            len: filter.len() as u16,
            filter: filter.as_ptr().cast_mut(),
        };
        // SAFETY: prctl with a filter program that outlives the call (the kernel copies it).
        unsafe {
            assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
            assert_eq!(
                libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &prog as *const libc::sock_fprog,
                ),
                0,
                "seccomp: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    #[tokio::test]
    async fn a_failed_append_that_cannot_be_cut_back_poisons_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let name = "a_failed_append_that_cannot_be_cut_back_poisons_the_store";
        if !in_child(name, dir.path()) {
            // The child left a journal ending in a fragment, nothing acknowledged behind it:
            // it opens, with the fragment cut off as a torn line.
            let s = EmbeddedStore::open(&dir.path().join("store")).expect("reopen");
            assert!(s.get("k1").await.expect("get").is_some());
            assert!(s.get("k2").await.expect("get").is_none());
            assert!(s.get("k3").await.expect("get").is_none());
            return;
        }
        let here = std::env::current_dir().expect("cwd");
        let s = EmbeddedStore::open(&here.join("store")).expect("open");
        s.txn(&[], &[put("k1", "1")], Durability::Power)
            .await
            .expect("txn")
            .expect("applied");
        let len = fs::metadata(here.join("store.journal"))
            .expect("journal")
            .len();
        limit_file_size(Some(len + 10));
        fail_ftruncate();
        let err = s
            .txn(&[], &[put("k2", &"x".repeat(300))], Durability::Power)
            .await
            .expect_err("the append cannot fit");
        assert!(err.to_string().contains("append"), "{err}");
        limit_file_size(None);
        // The journal ends in a fragment: nothing more may be acknowledged.
        let err = s
            .txn(&[], &[put("k3", "3")], Durability::Power)
            .await
            .expect_err("poisoned");
        assert!(
            matches!(err, DatastoreError::Poisoned { .. })
                && err.to_string().contains("could not be cut back"),
            "{err}"
        );
        assert!(s.sync(1).await.is_err(), "sync must fail too");
    }

    #[tokio::test]
    async fn a_failing_compaction_backs_off_and_loses_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        if !in_child(
            "a_failing_compaction_backs_off_and_loses_nothing",
            dir.path(),
        ) {
            return;
        }
        let here = std::env::current_dir().expect("cwd");
        let path = here.join("store");
        let mut s = EmbeddedStore::open(&path).expect("open");
        s.compact_after = 10;
        // A large state, folded into the snapshot: a snapshot is now larger than the limit
        // below, the journal's small lines are not.
        s.txn(
            &[],
            &[put("big", &"b".repeat(64 * 1024))],
            Durability::Power,
        )
        .await
        .expect("txn");
        {
            let mut inner = s.lock();
            s.compact(&mut inner).expect("compact");
        }
        let attempts0 = s.lock().compact_attempts;
        limit_file_size(Some(32 * 1024));
        for i in 0..100 {
            s.txn(&[], &[put(&format!("n{i:03}"), "1")], Durability::Power)
                .await
                .unwrap_or_else(|e| panic!("txn {i}: {e}"))
                .expect("applied");
        }
        let attempts = s.lock().compact_attempts - attempts0;
        eprintln!("{attempts} compactions tried in 100 transactions");
        assert!(attempts >= 1, "the compaction was never tried");
        assert!(
            attempts <= 4,
            "{attempts} compactions tried in 100 transactions: a failed compaction must back off"
        );
        let leftovers: Vec<_> = fs::read_dir(&here)
            .expect("dir")
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "failed compaction left {leftovers:?}");
        limit_file_size(None);
        drop(s);
        let s = EmbeddedStore::open(&path).expect("reopen");
        assert_eq!(s.list("n").await.expect("list").len(), 100);
        assert_eq!(
            s.get("big").await.expect("get").expect("big").value.len(),
            64 * 1024
        );
    }

    #[tokio::test]
    async fn a_relative_path_works_from_any_working_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        if !in_child(
            "a_relative_path_works_from_any_working_directory",
            dir.path(),
        ) {
            return;
        }
        // `--datastore-path store.json`: the parent directory is "".
        let rel = Path::new("store.json");
        let s = EmbeddedStore::open(rel).expect("open a relative path");
        s.txn(&[], &[put("a", "1")], Durability::Power)
            .await
            .expect("txn");
        {
            let mut inner = s.lock();
            s.compact(&mut inner)
                .expect("compact a store opened by a relative path");
        }
        s.txn(&[], &[put("b", "2")], Durability::Power)
            .await
            .expect("txn");
        drop(s);
        let s = EmbeddedStore::open(rel).expect("reopen");
        assert_eq!(s.list("").await.expect("list").len(), 2);
    }

    #[tokio::test]
    async fn garbage_in_the_middle_is_corruption() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        fs::write(
            dir.path().join("store.journal"),
            b"{not json\n{\"rev\":1,\"put\":[[\"a\",\"1\"]]}\n",
        )
        .expect("write");
        let err = EmbeddedStore::open(&path).err().expect("corrupt");
        assert!(err.to_string().contains("corrupt"), "{err}");
    }
}
