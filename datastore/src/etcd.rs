//! The etcd v3 backend: every calix key lives under one prefix in a shared etcd cluster, and
//! every write is one etcd transaction, so several nodes' agents can allocate from the same pools.
//! Watches use etcd's Watch service, one connection per watch.
use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use calix_core::store::{KeyValue, WatchEvent};
use calix_proto::etcd::etcdserverpb::{
    compare, kv_client::KvClient as RawKvClient, request_op, watch_client::WatchClient,
    watch_request, Compare as EtcdCompare, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp,
    TxnRequest, WatchCreateRequest, WatchRequest, WatchResponse,
};
use calix_proto::etcd::mvccpb;
use futures::StreamExt;
use tokio::sync::Mutex;
use tonic::transport::{Channel, Endpoint};

use super::{Compare, Datastore, DatastoreError, Durability, Op, WatchStream};

/// First pause between attempts; it doubles after each failed attempt, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Largest response accepted (tonic's default is 4 MiB, too small for a big `list`).
const MAX_RESPONSE_BYTES: usize = 64 << 20;
/// A watch's connection is pinged (HTTP/2 PING) after this long without traffic, and closed
/// when the ping is not answered within the request timeout: a watch on an etcd that stopped
/// answering (hung, or the network gone without a reset) ends instead of waiting forever. etcd
/// refuses pings more often than every 5 s (`--grpc-keepalive-min-time`).
const WATCH_KEEPALIVE: Duration = Duration::from_secs(10);
/// etcd cancels a watch carrying this metadata when its member loses the cluster's leader
/// (clientv3's `WithRequireLeader`), instead of keeping a partitioned member's stale view.
const REQUIRE_LEADER: (&str, &str) = ("hasleader", "true");

/// How to reach etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://10.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Prefix of every calix key, e.g. `/calix/`.
    pub prefix: String,
    /// Per-request timeout (and connect timeout).
    pub timeout: std::time::Duration,
    /// Attempts per operation when etcd is unreachable, with exponential backoff between them.
    pub attempts: u32,
}

/// The etcd v3 [`Datastore`].
///
/// Keys are stored as `prefix + key` and returned without the prefix; a [`KeyValue`]'s revision
/// is etcd's `mod_revision`. Reads are linearizable. [`Durability`] is ignored: etcd commits
/// every write to a quorum's disks.
///
/// Failures of the transport or of the cluster (etcd down or restarting, no leader, leader
/// changed, a request timing out) are retried inside the store: up to `attempts` tries, each
/// bounded by `timeout`, with a backoff of 50 ms doubling up to 2 s between them; after a failed
/// try the gRPC client is dropped and rebuilt, so a broken connection never sticks. When every
/// try failed the error is [`DatastoreError::Unavailable`]. A request etcd refuses outright
/// (e.g. a transaction with too many operations) is not retried and is reported as
/// `Unavailable` with the number of tries made.
///
/// Retrying a transaction is not idempotent: if etcd applied it but the answer was lost, the
/// retry sees its own write and its compare fails, so [`Datastore::txn`] returns `Ok(None)` for
/// a write that did happen. Callers already treat `None` as "someone else wrote first": they
/// re-read and find their own value, which they must accept as theirs (or release).
///
/// A watch is etcd's Watch service on a connection of its own (no per-request timeout, HTTP/2
/// keepalive pings, [`REQUIRE_LEADER`]), created with `start_revision = after + 1`. Creating
/// it retries like any operation; once created, it is never resumed by the store: when the
/// connection breaks, etcd restarts, or etcd cancels the watch, the stream ends with
/// [`DatastoreError::WatchEnded`], and the caller watches again from the last revision it got
/// (etcd keeps history until it is compacted, restarts included). etcd reporting the start
/// revision compacted ends it with [`DatastoreError::Compacted`].
pub struct EtcdStore {
    cfg: EtcdConfig,
    /// The current client and its generation; `None` after a failure until the next try.
    client: Mutex<(u64, Option<KvClient>)>,
}

/// etcd's KV service over a (lazily connecting) channel to every endpoint.
type KvClient = RawKvClient<Channel>;

/// What a try can fail with: an endpoint URL tonic refuses, or the call's status (transport
/// failures arrive as `Unavailable`).
#[derive(Debug, thiserror::Error)]
enum EtcdError {
    #[error("bad endpoint {endpoint:?}: {source}")]
    Endpoint {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("no etcd endpoints configured")]
    NoEndpoints,
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// etcd answered, and said no.
    #[error("{0}")]
    Refused(String),
}

impl EtcdStore {
    /// Builds the client without contacting etcd: this never waits for the cluster, so an agent
    /// may start before etcd does, and each operation connects (and reconnects) as needed.
    /// Fails only on a configuration no try could ever reach (no endpoints, a bad URL), as
    /// `Unavailable` with 0 attempts.
    pub async fn connect(cfg: EtcdConfig) -> Result<Self, DatastoreError> {
        let client = build_client(&cfg)
            .await
            .map_err(|e| DatastoreError::Unavailable {
                backend: "etcd",
                attempts: 0,
                detail: format!("bad etcd configuration {:?}: {e}", cfg.endpoints),
            })?;
        Ok(Self {
            cfg,
            client: Mutex::new((0, Some(client))),
        })
    }

    fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.cfg.prefix)
    }

    /// Converts an etcd pair, stripping the prefix (calix writes only UTF-8 keys).
    fn key_value(&self, kv: mvccpb::KeyValue) -> KeyValue {
        let key = String::from_utf8_lossy(&kv.key);
        let key = key.strip_prefix(self.cfg.prefix.as_str()).unwrap_or(&key);
        KeyValue {
            key: key.to_owned(),
            value: kv.value,
            revision: kv.mod_revision,
            created: kv.create_revision,
        }
    }

    /// The current client, building a new one if the last was dropped after a failure.
    async fn client(&self) -> Result<(u64, KvClient), EtcdError> {
        let mut slot = self.client.lock().await;
        let kv = match &slot.1 {
            Some(client) => client.clone(),
            None => {
                let client = build_client(&self.cfg).await?;
                *slot = (slot.0 + 1, Some(client.clone()));
                client
            }
        };
        Ok((slot.0, kv))
    }

    /// Drops the client of generation `generation` (unless a newer one replaced it already).
    async fn discard_client(&self, generation: u64) {
        let mut slot = self.client.lock().await;
        if slot.0 == generation {
            slot.1 = None;
        }
    }

    /// Runs `call` with retries, a timeout per try, and a fresh client after each failed try.
    async fn retry<T, F, Fut>(&self, what: &str, call: F) -> Result<T, DatastoreError>
    where
        F: Fn(KvClient) -> Fut,
        Fut: Future<Output = Result<T, EtcdError>>,
    {
        let attempts = self.cfg.attempts.max(1);
        let mut backoff = Backoff::default();
        let mut detail = String::new();
        for attempt in 1..=attempts {
            let mut generation = None;
            let outcome = match self.client().await {
                Ok((gen, kv)) => {
                    generation = Some(gen);
                    tokio::time::timeout(self.cfg.timeout, call(kv)).await
                }
                Err(e) => Ok(Err(e)),
            };
            match outcome {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(e)) if !retryable(&e) => {
                    return Err(DatastoreError::Unavailable {
                        backend: "etcd",
                        attempts: attempt,
                        detail: format!("etcd refused {what}: {e}"),
                    });
                }
                Ok(Err(e)) => detail = format!("{what}: {e}"),
                Err(_) => detail = format!("{what}: no answer within {:?}", self.cfg.timeout),
            }
            if let Some(generation) = generation {
                self.discard_client(generation).await;
            }
            if attempt < attempts {
                backoff.pause(attempt, attempts, &detail).await;
            }
        }
        Err(DatastoreError::Unavailable {
            backend: "etcd",
            attempts,
            detail,
        })
    }
}

/// A KV client over a channel that connects when first used (and reconnects after a failure),
/// balanced over every endpoint.
async fn build_client(cfg: &EtcdConfig) -> Result<KvClient, EtcdError> {
    let channel = build_channel(cfg, |e| e.timeout(cfg.timeout))?;
    Ok(RawKvClient::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES))
}

/// A channel to every endpoint (balanced), connecting when first used, each endpoint set up by
/// `tune` beyond the connect timeout.
fn build_channel(
    cfg: &EtcdConfig,
    tune: impl Fn(Endpoint) -> Endpoint,
) -> Result<Channel, EtcdError> {
    let mut endpoints = Vec::with_capacity(cfg.endpoints.len());
    for url in &cfg.endpoints {
        let endpoint =
            Endpoint::from_shared(url.clone()).map_err(|source| EtcdError::Endpoint {
                endpoint: url.clone(),
                source,
            })?;
        endpoints.push(tune(endpoint.connect_timeout(cfg.timeout)));
    }
    Ok(match endpoints.len() {
        0 => return Err(EtcdError::NoEndpoints),
        1 => endpoints.remove(0).connect_lazy(),
        _ => Channel::balance_list(endpoints.into_iter()),
    })
}

/// Starts one watch on a connection of its own: sends the create request and waits for etcd's
/// answer to it.
async fn open_watch(
    cfg: &EtcdConfig,
    create: WatchCreateRequest,
    after: i64,
) -> Result<WatchStream, EtcdError> {
    // No per-request timeout (a watch lasts); keepalive pings notice a peer gone silent.
    let channel = build_channel(cfg, |e| {
        e.http2_keep_alive_interval(WATCH_KEEPALIVE)
            .keep_alive_timeout(cfg.timeout.max(Duration::from_secs(1)))
            .keep_alive_while_idle(false)
    })?;
    let mut client = WatchClient::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES);
    let create = WatchRequest {
        request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
    };
    // One request, then the sending side stays open for as long as the watch lives.
    let requests =
        futures::stream::once(futures::future::ready(create)).chain(futures::stream::pending());
    let mut request = tonic::Request::new(requests);
    request.metadata_mut().insert(
        REQUIRE_LEADER.0,
        tonic::metadata::MetadataValue::from_static(REQUIRE_LEADER.1),
    );
    let mut inbound = client.watch(request).await?.into_inner();
    let first = inbound.message().await?.ok_or_else(|| {
        EtcdError::Status(tonic::Status::unavailable(
            "etcd closed the watch stream before creating the watch",
        ))
    })?;
    if !first.created && first.compact_revision == 0 {
        return Err(EtcdError::Status(tonic::Status::unknown(format!(
            "etcd answered a watch creation with {first:?}"
        ))));
    }
    if first.canceled && first.compact_revision == 0 {
        return Err(EtcdError::Refused(format!(
            "etcd refused the watch: {}",
            first.cancel_reason
        )));
    }
    let mut watch = EtcdWatch {
        inbound,
        prefix: cfg.prefix.clone(),
        last: after,
        pending: VecDeque::new(),
        end: None,
        done: false,
    };
    watch.take(first);
    Ok(futures::stream::unfold(watch, EtcdWatch::next).boxed())
}

/// A created etcd watch, between items.
struct EtcdWatch {
    inbound: tonic::Streaming<WatchResponse>,
    /// The store's key prefix, stripped from every event's key.
    prefix: String,
    /// The revision of the last event delivered (or the watch's `after`).
    last: i64,
    pending: VecDeque<WatchEvent>,
    /// What ends the watch, delivered once `pending` is empty.
    end: Option<DatastoreError>,
    /// The end was delivered.
    done: bool,
}

impl EtcdWatch {
    /// Queues a response's events, and what ends the watch if the response ends it.
    fn take(&mut self, resp: WatchResponse) {
        if resp.compact_revision != 0 {
            self.end = Some(DatastoreError::Compacted {
                after: self.last,
                compacted: resp.compact_revision,
            });
            return;
        }
        for event in resp.events {
            let Some(kv) = event.kv else {
                self.end = Some(ended("etcd sent an event without its key"));
                return;
            };
            let key = String::from_utf8_lossy(&kv.key);
            let key = key
                .strip_prefix(self.prefix.as_str())
                .unwrap_or(&key)
                .to_owned();
            let revision = kv.mod_revision;
            self.pending
                .push_back(match mvccpb::event::EventType::try_from(event.r#type) {
                    Ok(mvccpb::event::EventType::Put) => WatchEvent::Put(KeyValue {
                        key,
                        value: kv.value,
                        revision,
                        created: kv.create_revision,
                    }),
                    Ok(mvccpb::event::EventType::Delete) => WatchEvent::Delete { key, revision },
                    Err(_) => {
                        self.end = Some(ended(&format!(
                            "etcd sent an event of type {}",
                            event.r#type
                        )));
                        return;
                    }
                });
        }
        if resp.canceled {
            self.end = Some(ended(&format!(
                "etcd cancelled the watch: {}",
                resp.cancel_reason
            )));
        }
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
                return Some((Err(end), self));
            }
            match self.inbound.message().await {
                Ok(Some(resp)) => self.take(resp),
                Ok(None) => self.end = Some(ended("etcd closed the watch stream")),
                Err(status) => {
                    self.end = Some(ended(&format!("{}: {}", status.code(), status.message())))
                }
            }
        }
    }
}

fn ended(detail: &str) -> DatastoreError {
    DatastoreError::WatchEnded {
        backend: "etcd",
        detail: detail.to_string(),
    }
}

/// The end of the range of every key starting with `prefix` (etcd's `WithPrefix`): the prefix
/// with its last byte below 0xff incremented, the bytes after it dropped; `\0` (every key)
/// when there is no such byte.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Whether a failure may go away by itself (transport, timeouts, leader elections, overload).
fn retryable(e: &EtcdError) -> bool {
    use tonic::Code;
    match e {
        EtcdError::Status(status) => matches!(
            status.code(),
            Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Unknown
                | Code::Aborted
                | Code::Cancelled
                | Code::ResourceExhausted
                | Code::Internal
        ),
        _ => false,
    }
}

#[tonic::async_trait]
impl Datastore for EtcdStore {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, DatastoreError> {
        let full = self.full_key(key);
        let resp = self
            .retry("get", |mut kv| {
                let request = RangeRequest {
                    key: full.clone().into_bytes(),
                    ..RangeRequest::default()
                };
                async move { Ok(kv.range(request).await?.into_inner()) }
            })
            .await?;
        Ok(resp.kvs.into_iter().next().map(|kv| self.key_value(kv)))
    }

    async fn list_with_revision(
        &self,
        prefix: &str,
    ) -> Result<(Vec<KeyValue>, i64), DatastoreError> {
        let full = self.full_key(prefix);
        let resp = self
            .retry("list", |mut kv| {
                let request = RangeRequest {
                    key: full.clone().into_bytes(),
                    range_end: prefix_end(full.as_bytes()),
                    ..RangeRequest::default()
                };
                async move { Ok(kv.range(request).await?.into_inner()) }
            })
            .await?;
        let revision = resp.header.as_ref().map(|h| h.revision).ok_or_else(|| {
            DatastoreError::Unavailable {
                backend: "etcd",
                attempts: 1,
                detail: "etcd answered a range without a header".into(),
            }
        })?;
        // etcd returns a range in key order.
        let kvs = resp.kvs.into_iter().map(|kv| self.key_value(kv)).collect();
        Ok((kvs, revision))
    }

    async fn txn(
        &self,
        compares: &[Compare],
        ops: &[Op],
        _durability: Durability,
    ) -> Result<Option<i64>, DatastoreError> {
        let compare = compares
            .iter()
            .map(|c| {
                let (key, target, value) = match c {
                    // Never created (or deleted since): create_revision 0.
                    Compare::Absent(k) => (
                        k,
                        compare::CompareTarget::Create,
                        compare::TargetUnion::CreateRevision(0),
                    ),
                    Compare::Revision(k, r) => (
                        k,
                        compare::CompareTarget::Mod,
                        compare::TargetUnion::ModRevision(*r),
                    ),
                };
                EtcdCompare {
                    result: compare::CompareResult::Equal as i32,
                    target: target as i32,
                    key: self.full_key(key).into_bytes(),
                    target_union: Some(value),
                    range_end: Vec::new(),
                }
            })
            .collect();
        let success = ops
            .iter()
            .map(|op| RequestOp {
                request: Some(match op {
                    Op::Put(k, v) => request_op::Request::RequestPut(PutRequest {
                        key: self.full_key(k).into_bytes(),
                        value: v.clone(),
                        ..PutRequest::default()
                    }),
                    Op::Delete(k) => request_op::Request::RequestDeleteRange(DeleteRangeRequest {
                        key: self.full_key(k).into_bytes(),
                        ..DeleteRangeRequest::default()
                    }),
                }),
            })
            .collect();
        let txn = TxnRequest {
            compare,
            success,
            failure: Vec::new(),
        };
        let resp = self
            .retry("txn", |mut kv| {
                let txn = txn.clone();
                async move { Ok(kv.txn(txn).await?.into_inner()) }
            })
            .await?;
        if !resp.succeeded {
            return Ok(None);
        }
        let revision = resp.header.map(|h| h.revision);
        revision
            .map(Some)
            .ok_or_else(|| DatastoreError::Unavailable {
                backend: "etcd",
                attempts: 1,
                detail: "etcd answered a txn without a header".into(),
            })
    }

    async fn watch(&self, prefix: &str, after: i64) -> Result<WatchStream, DatastoreError> {
        let full = self.full_key(prefix);
        let create = WatchCreateRequest {
            range_end: prefix_end(full.as_bytes()),
            key: full.into_bytes(),
            start_revision: after.max(0) + 1,
            ..WatchCreateRequest::default()
        };
        let attempts = self.cfg.attempts.max(1);
        let mut backoff = Backoff::default();
        let mut detail = String::new();
        for attempt in 1..=attempts {
            let opened = tokio::time::timeout(
                self.cfg.timeout,
                open_watch(&self.cfg, create.clone(), after),
            )
            .await;
            match opened {
                Ok(Ok(stream)) => return Ok(stream),
                Ok(Err(e)) if !retryable(&e) => {
                    return Err(DatastoreError::Unavailable {
                        backend: "etcd",
                        attempts: attempt,
                        detail: format!("watch of {prefix:?}: {e}"),
                    })
                }
                Ok(Err(e)) => detail = format!("watch of {prefix:?}: {e}"),
                Err(_) => {
                    detail = format!(
                        "watch of {prefix:?}: no answer within {:?}",
                        self.cfg.timeout
                    )
                }
            }
            if attempt < attempts {
                backoff.pause(attempt, attempts, &detail).await;
            }
        }
        Err(DatastoreError::Unavailable {
            backend: "etcd",
            attempts,
            detail,
        })
    }
}

/// The pause between two tries: 50 ms, doubling up to 2 s.
struct Backoff(Duration);

impl Default for Backoff {
    fn default() -> Self {
        Self(FIRST_BACKOFF)
    }
}

impl Backoff {
    async fn pause(&mut self, attempt: u32, attempts: u32, detail: &str) {
        let backoff = self.0;
        tracing::warn!(attempt, attempts, ?backoff, "etcd {detail}; retrying");
        tokio::time::sleep(backoff).await;
        self.0 = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_ranges() {
        assert_eq!(prefix_end(b"/calix/"), b"/calix0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }
}
