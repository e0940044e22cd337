//! The etcd v3 backend: every calix key lives under one prefix in a shared etcd cluster, and
//! every write is one etcd transaction, so several nodes' agents can allocate from the same pools.
use std::future::Future;
use std::time::Duration;

use calix_proto::etcd::etcdserverpb::{
    compare, kv_client::KvClient as RawKvClient, request_op, Compare as EtcdCompare,
    DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, TxnRequest,
};
use calix_proto::etcd::mvccpb;
use tokio::sync::Mutex;
use tonic::transport::{Channel, Endpoint};

use super::{Compare, Datastore, DatastoreError, Durability, KeyValue, Op};

/// First pause between attempts; it doubles after each failed attempt, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Largest response accepted (tonic's default is 4 MiB, too small for a big `list`).
const MAX_RESPONSE_BYTES: usize = 64 << 20;

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
        let mut backoff = FIRST_BACKOFF;
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
                tracing::warn!(attempt, attempts, ?backoff, "etcd {detail}; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
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
    let mut endpoints = Vec::with_capacity(cfg.endpoints.len());
    for url in &cfg.endpoints {
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|source| EtcdError::Endpoint {
                endpoint: url.clone(),
                source,
            })?
            .connect_timeout(cfg.timeout)
            .timeout(cfg.timeout);
        endpoints.push(endpoint);
    }
    let channel = match endpoints.len() {
        0 => return Err(EtcdError::NoEndpoints),
        1 => endpoints.remove(0).connect_lazy(),
        _ => Channel::balance_list(endpoints.into_iter()),
    };
    Ok(RawKvClient::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES))
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
