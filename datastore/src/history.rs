//! The embedded store's recent changes, which its watches read: a window of the last committed
//! transactions (by count and by bytes), shared between the store, which appends to it under its
//! own lock, and every watch stream, which reads it when the store signals a new revision.
//!
//! A watch never buffers on its own: it keeps the revision it has delivered up to and reads what
//! follows from the window, so a slow watcher costs no memory. One that falls behind the window
//! gets [`DatastoreError::Compacted`], as from etcd. When the store is dropped, every watch
//! delivers what was committed and ends with [`DatastoreError::WatchEnded`].
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use calix_core::store::{KeyValue, WatchEvent};
use futures::StreamExt;
use tokio::sync::watch;

use super::{DatastoreError, WatchStream};

/// Most transactions kept for watches.
const MAX_TXNS: usize = 10_000;
/// Most bytes of keys and values kept for watches (blocks are a few KiB each).
const MAX_BYTES: usize = 16 << 20;

/// One change of a transaction: the key with its new value and creation revision, or `None`
/// for a delete.
pub(super) type Change = (String, Option<(Vec<u8>, i64)>);

/// One committed transaction: each key with its new value, or `None` for a delete.
struct Committed {
    revision: i64,
    changes: Vec<Change>,
    bytes: usize,
}

/// The window of recent transactions.
pub(super) struct History {
    /// Every change with a revision above this one is in `txns`.
    floor: i64,
    /// In revision order.
    txns: VecDeque<Committed>,
    bytes: usize,
    max_txns: usize,
    max_bytes: usize,
}

impl History {
    /// An empty window: the changes up to `revision` are not kept.
    pub(super) fn new(revision: i64) -> Self {
        Self {
            floor: revision,
            txns: VecDeque::new(),
            bytes: 0,
            max_txns: MAX_TXNS,
            max_bytes: MAX_BYTES,
        }
    }

    /// Records transaction `revision` (newer than every one recorded), dropping the oldest
    /// beyond the window.
    pub(super) fn push(&mut self, revision: i64, changes: Vec<Change>) {
        let bytes = changes
            .iter()
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, |(v, _)| v.len()))
            .sum();
        self.txns.push_back(Committed {
            revision,
            changes,
            bytes,
        });
        self.bytes += bytes;
        while self.txns.len() > self.max_txns || self.bytes > self.max_bytes {
            let Some(old) = self.txns.pop_front() else {
                break;
            };
            self.bytes -= old.bytes;
            self.floor = old.revision;
        }
    }

    /// Forgets every change before `revision` (what etcd's Compact does).
    pub(super) fn compact(&mut self, revision: i64) {
        while self.txns.front().is_some_and(|t| t.revision < revision) {
            if let Some(old) = self.txns.pop_front() {
                self.bytes -= old.bytes;
            }
        }
        self.floor = self.floor.max(revision - 1);
    }

    /// Appends to `out` every change under `prefix` after `*last`, and moves `*last` to the
    /// newest revision in the window.
    fn read(
        &self,
        prefix: &str,
        last: &mut i64,
        out: &mut VecDeque<WatchEvent>,
    ) -> Result<(), DatastoreError> {
        if *last < self.floor {
            return Err(DatastoreError::Compacted {
                after: *last,
                compacted: self.floor + 1,
            });
        }
        let start = self.txns.partition_point(|t| t.revision <= *last);
        for txn in self.txns.range(start..) {
            for (key, value) in txn.changes.iter().filter(|(k, _)| k.starts_with(prefix)) {
                out.push_back(match value {
                    Some((value, created)) => WatchEvent::Put(KeyValue {
                        key: key.clone(),
                        value: value.clone(),
                        revision: txn.revision,
                        created: *created,
                    }),
                    None => WatchEvent::Delete {
                        key: key.clone(),
                        revision: txn.revision,
                    },
                });
            }
            *last = txn.revision;
        }
        Ok(())
    }
}

/// A watch's state between items.
struct Watcher {
    history: Arc<Mutex<History>>,
    /// The store's newest revision; closed when the store is dropped.
    revision: watch::Receiver<i64>,
    prefix: String,
    /// Every change up to this revision has been read from the window.
    last: i64,
    pending: VecDeque<WatchEvent>,
    /// The store is gone: deliver what is pending, then end.
    closed: bool,
    done: bool,
}

impl Watcher {
    fn read(&mut self) -> Result<(), DatastoreError> {
        let history = self.history.lock().unwrap_or_else(|p| p.into_inner());
        history.read(&self.prefix, &mut self.last, &mut self.pending)
    }

    async fn next(mut self) -> Option<(Result<WatchEvent, DatastoreError>, Self)> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some((Ok(event), self));
            }
            if self.done {
                return None;
            }
            if self.closed {
                self.done = true;
                let ended = DatastoreError::WatchEnded {
                    backend: "embedded",
                    detail: "the store was closed".into(),
                };
                return Some((Err(ended), self));
            }
            // Mark the current revision seen before reading, so a commit after the read wakes
            // the wait below.
            self.revision.borrow_and_update();
            if let Err(e) = self.read() {
                self.done = true;
                return Some((Err(e), self));
            }
            if self.pending.is_empty() && self.revision.changed().await.is_err() {
                // Everything committed before the store went is in the window: one last read.
                self.closed = true;
                if let Err(e) = self.read() {
                    self.done = true;
                    return Some((Err(e), self));
                }
            }
        }
    }
}

/// A watch of `prefix` after revision `after` over `history`, woken by `revision`.
pub(super) fn stream(
    history: Arc<Mutex<History>>,
    revision: watch::Receiver<i64>,
    prefix: &str,
    after: i64,
) -> WatchStream {
    let watcher = Watcher {
        history,
        revision,
        prefix: prefix.to_string(),
        last: after.max(0),
        pending: VecDeque::new(),
        closed: false,
        done: false,
    };
    futures::stream::unfold(watcher, Watcher::next).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &str) -> Change {
        (k.to_string(), Some((b"v".to_vec(), 1)))
    }

    #[test]
    fn the_window_drops_the_oldest_and_reports_them_compacted() {
        let mut h = History::new(0);
        h.max_txns = 3;
        for rev in 1..=5 {
            h.push(rev, vec![put("a")]);
        }
        let mut out = VecDeque::new();
        let mut last = 1;
        assert!(matches!(
            h.read("", &mut last, &mut out),
            Err(DatastoreError::Compacted {
                after: 1,
                compacted: 3
            })
        ));
        let mut last = 2;
        h.read("", &mut last, &mut out).expect("in the window");
        assert_eq!(last, 5);
        assert_eq!(
            out.iter().map(WatchEvent::revision).collect::<Vec<_>>(),
            [3, 4, 5]
        );
    }

    #[test]
    fn the_window_is_bounded_in_bytes() {
        let mut h = History::new(0);
        h.max_bytes = 100;
        for rev in 1..=10 {
            h.push(rev, vec![("k".into(), Some((vec![0; 40], rev)))]);
        }
        assert!(h.bytes <= 100, "{}", h.bytes);
        assert_eq!(h.floor, 8);
    }
}
