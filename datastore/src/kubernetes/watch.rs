//! Watches: one Kubernetes watch of one kind (narrowed by label where the prefix allows),
//! filtered to the prefix, from `resourceVersion = after`.
//!
//! - The watch asks for bookmarks and for the server to end it after [`WATCH_SECS`]: when the
//!   server ends it then (the normal end of a Kubernetes watch, not a failure), the store
//!   continues it from the newest resourceVersion it saw (an event of any key of the kind, or a
//!   bookmark), so a quiet prefix keeps a recent place in the server's watch cache.
//! - 410 Gone (the version is older than the server keeps), on opening or later, ends the
//!   stream with [`DatastoreError::Compacted`]: list again. Its `compacted` is the oldest
//!   version the server named in its message (`too old resource version: A (B)`), else
//!   `after + 1`.
//! - A watch the server ends before its time (kube reports a connection cut mid-response as
//!   an end, like a clean one), a broken connection, an error event, or nothing at all for
//!   [`WATCH_SECS`] + [`SILENCE_GRACE`] ends it with [`DatastoreError::WatchEnded`]: watch
//!   again from the last revision received. (An API server with its watch cache on, the
//!   default, answers that with 410 when the version is older than its cache, as after its
//!   own restart: `datastore::follow` lists again then.)
//! - `after` ≤ 0 (from the beginning) lists first and delivers every object as a put, in
//!   revision order, then watches from the listing.
use std::collections::VecDeque;
use std::time::Duration;

use calix_core::store::KeyValue;
use calix_core::store::WatchEvent;
use futures::StreamExt;
use kube::api::{Api, DynamicObject, WatchEvent as KubeEvent, WatchParams};

use super::kinds::{kinds_under, Kind};
use super::objects::{key_value, object_revision};
use super::retry::{transient, FIRST_BACKOFF, MAX_BACKOFF};
use super::{KubeStore, BACKEND};
use crate::{Datastore, DatastoreError, WatchStream};

/// How long the server keeps one watch request open (kube accepts less than 295 s).
pub const WATCH_SECS: u32 = 240;
/// Silence beyond [`WATCH_SECS`] after which the connection counts as dead.
const SILENCE_GRACE: Duration = Duration::from_secs(30);

type Events = futures::stream::BoxStream<'static, Result<KubeEvent<DynamicObject>, kube::Error>>;

pub(super) async fn open(
    store: &KubeStore,
    prefix: &str,
    after: i64,
) -> Result<WatchStream, DatastoreError> {
    let kinds = kinds_under(prefix);
    let kind =
        match kinds.as_slice() {
            [] => return Ok(futures::stream::pending().boxed()),
            [kind] => *kind,
            _ => return Err(DatastoreError::Unwatchable {
                backend: BACKEND,
                prefix: prefix.into(),
                why: "it spans several kinds of object, and Kubernetes watches one kind at a time",
            }),
        };
    let mut watch = KubeWatch {
        api: store.api(kind),
        kind,
        prefix: prefix.to_string(),
        params: WatchParams {
            label_selector: kind.selector(prefix),
            field_selector: kind.field_selector(prefix),
            timeout: Some(store.watch_secs),
            bookmarks: true,
            ..WatchParams::default()
        },
        last: after,
        resume: after,
        pending: VecDeque::new(),
        events: None,
        opened: std::time::Instant::now(),
        request_secs: store.watch_secs,
        silence: Duration::from_secs(u64::from(store.watch_secs)) + SILENCE_GRACE,
        end: None,
        done: false,
    };
    if after <= 0 {
        let (kvs, revision) = store.list_with_revision(prefix).await?;
        let mut kvs: Vec<KeyValue> = kvs;
        kvs.sort_by_key(|kv| kv.revision);
        watch.pending.extend(kvs.into_iter().map(WatchEvent::Put));
        watch.resume = revision;
    }
    // Opening retries like any request; a refusal (410 included) is the stream's first item.
    let mut backoff = FIRST_BACKOFF;
    for attempt in 1..=store.attempts {
        match tokio::time::timeout(store.timeout, watch.connect()).await {
            Ok(Ok(events)) => {
                watch.events = Some(events);
                watch.opened = std::time::Instant::now();
                break;
            }
            Ok(Err(e)) if !transient(&e) => {
                watch.end = Some(watch.failure(&e));
                break;
            }
            Ok(Err(e)) if attempt == store.attempts => {
                return Err(DatastoreError::Unavailable {
                    backend: BACKEND,
                    attempts: attempt,
                    detail: format!("watch of {prefix:?}: {e}"),
                })
            }
            Err(_) if attempt == store.attempts => {
                return Err(DatastoreError::Unavailable {
                    backend: BACKEND,
                    attempts: attempt,
                    detail: format!("watch of {prefix:?}: no answer within {:?}", store.timeout),
                })
            }
            _ => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
    Ok(futures::stream::unfold(watch, KubeWatch::next).boxed())
}

/// One watch, between items.
struct KubeWatch {
    api: Api<DynamicObject>,
    kind: &'static Kind,
    prefix: String,
    params: WatchParams,
    /// The revision of the last event delivered (or the watch's `after`).
    last: i64,
    /// Where a continued watch starts: the newest version seen, whatever the key.
    resume: i64,
    pending: VecDeque<WatchEvent>,
    events: Option<Events>,
    /// When the current watch request was opened.
    opened: std::time::Instant,
    /// How long the server keeps a request open.
    request_secs: u32,
    /// Silence after which the connection counts as dead.
    silence: Duration,
    /// What ends the watch, delivered once `pending` is empty.
    end: Option<DatastoreError>,
    done: bool,
}

impl KubeWatch {
    fn connect(&self) -> impl std::future::Future<Output = Result<Events, kube::Error>> + Send {
        let (api, params, from) = (self.api.clone(), self.params.clone(), self.resume);
        async move { Ok(api.watch(&params, &from.to_string()).await?.boxed()) }
    }

    /// What a failed request or error event ends the watch with.
    fn failure(&self, e: &kube::Error) -> DatastoreError {
        match e {
            kube::Error::Api(s) if s.code == 410 => self.gone(&s.message),
            other => ended(&other.to_string()),
        }
    }

    fn gone(&self, message: &str) -> DatastoreError {
        DatastoreError::Compacted {
            after: self.last,
            compacted: oldest_kept(message).unwrap_or(self.last + 1),
        }
    }

    /// Takes one event of the server's.
    fn take(&mut self, event: KubeEvent<DynamicObject>) {
        let (obj, deleted) = match event {
            KubeEvent::Added(o) | KubeEvent::Modified(o) => (o, false),
            KubeEvent::Deleted(o) => (o, true),
            KubeEvent::Bookmark(b) => {
                if let Ok(rv) = b.metadata.resource_version.parse::<i64>() {
                    self.resume = self.resume.max(rv);
                }
                return;
            }
            KubeEvent::Error(s) if s.code == 410 => {
                self.end = Some(self.gone(&s.message));
                return;
            }
            KubeEvent::Error(s) => {
                self.end = Some(ended(&format!(
                    "error event {}: {} {}",
                    s.code, s.reason, s.message
                )));
                return;
            }
        };
        let revision = match object_revision(self.kind, &obj) {
            Ok(r) => r,
            Err(e) => {
                self.end = Some(ended(&e.to_string()));
                return;
            }
        };
        self.resume = self.resume.max(revision);
        let Some(key) = self.kind.key_of(&obj) else {
            return;
        };
        if !key.starts_with(&self.prefix) {
            return;
        }
        let event = if deleted {
            WatchEvent::Delete { key, revision }
        } else {
            match key_value(self.kind, key, &obj) {
                Ok(kv) => WatchEvent::Put(kv),
                Err(e) => {
                    self.end = Some(ended(&e.to_string()));
                    return;
                }
            }
        };
        self.pending.push_back(event);
    }

    async fn next(mut self) -> Option<(Result<WatchEvent, DatastoreError>, Self)> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                self.last = event.revision();
                return Some((Ok(event), self));
            }
            if self.done {
                return None;
            }
            if let Some(end) = self.end.take() {
                self.done = true;
                self.events = None;
                return Some((Err(end), self));
            }
            let Some(events) = self.events.as_mut() else {
                self.end = Some(ended("the watch was not opened"));
                continue;
            };
            let silence = self.silence;
            match tokio::time::timeout(silence, events.next()).await {
                Ok(Some(Ok(event))) => self.take(event),
                Ok(Some(Err(e))) => self.end = Some(self.failure(&e)),
                // The server ended the request at its timeout: continue from where we are.
                // Earlier, it went away (restart, shutdown, connection lost: kube reports a
                // connection cut mid-response as an end too).
                Ok(None)
                    if self.opened.elapsed() + Duration::from_secs(1)
                        >= Duration::from_secs(u64::from(self.request_secs)) =>
                {
                    match self.connect().await {
                        Ok(events) => {
                            self.events = Some(events);
                            self.opened = std::time::Instant::now();
                        }
                        Err(e) => self.end = Some(self.failure(&e)),
                    }
                }
                Ok(None) => {
                    self.end = Some(ended(&format!(
                        "the API server closed the watch after {:?}, before its {} s",
                        self.opened.elapsed(),
                        self.request_secs
                    )))
                }
                Err(_) => {
                    self.end = Some(ended(&format!(
                        "nothing from the API server for {silence:?}"
                    )))
                }
            }
        }
    }
}

fn ended(detail: &str) -> DatastoreError {
    DatastoreError::WatchEnded {
        backend: BACKEND,
        detail: detail.to_string(),
    }
}

/// The oldest version a watch cache keeps, from its 410 message
/// `too old resource version: <asked> (<oldest kept>)`.
fn oldest_kept(message: &str) -> Option<i64> {
    let (_, tail) = message.rsplit_once('(')?;
    let (n, _) = tail.split_once(')')?;
    n.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::oldest_kept;

    #[test]
    fn the_oldest_kept_version_comes_from_the_410_message() {
        assert_eq!(oldest_kept("too old resource version: 12 (345)"), Some(345));
        assert_eq!(
            oldest_kept("The resourceVersion for the provided watch is too old."),
            None
        );
    }
}
