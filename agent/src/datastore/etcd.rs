//! The etcd v3 backend: every calix key lives under one prefix in a shared etcd cluster, and
//! every write is one etcd transaction, so several nodes' agents can allocate from the same pools.
use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, ConnectOptions, Error as EtcdError, GetOptions,
    KvClient, Txn, TxnOp,
};
use tokio::sync::Mutex;

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
    client: Mutex<(u64, Option<Client>)>,
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
    fn key_value(&self, kv: &etcd_client::KeyValue) -> KeyValue {
        let key = String::from_utf8_lossy(kv.key());
        let key = key.strip_prefix(self.cfg.prefix.as_str()).unwrap_or(&key);
        KeyValue {
            key: key.to_owned(),
            value: kv.value().to_vec(),
            revision: kv.mod_revision(),
        }
    }

    /// The current client, building a new one if the last was dropped after a failure.
    async fn client(&self) -> Result<(u64, KvClient), EtcdError> {
        let mut slot = self.client.lock().await;
        let kv = match &slot.1 {
            Some(client) => client.kv_client(),
            None => {
                let client = build_client(&self.cfg).await?;
                let kv = client.kv_client();
                *slot = (slot.0 + 1, Some(client));
                kv
            }
        };
        Ok((slot.0, kv.max_decoding_message_size(MAX_RESPONSE_BYTES)))
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

async fn build_client(cfg: &EtcdConfig) -> Result<Client, EtcdError> {
    let options = ConnectOptions::new()
        .with_timeout(cfg.timeout)
        .with_connect_timeout(cfg.timeout);
    Client::connect(&cfg.endpoints, Some(options)).await
}

/// Whether a failure may go away by itself (transport, timeouts, leader elections, overload).
fn retryable(e: &EtcdError) -> bool {
    use tonic::Code;
    match e {
        EtcdError::TransportError(_) | EtcdError::IoError(_) => true,
        EtcdError::GRpcStatus(status) => matches!(
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
                let full = full.clone();
                async move { kv.get(full, None).await }
            })
            .await?;
        Ok(resp.kvs().first().map(|kv| self.key_value(kv)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, DatastoreError> {
        let full = self.full_key(prefix);
        let resp = self
            .retry("list", |mut kv| {
                let full = full.clone();
                async move { kv.get(full, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        // etcd returns a range in key order.
        Ok(resp.kvs().iter().map(|kv| self.key_value(kv)).collect())
    }

    async fn txn(
        &self,
        compares: &[Compare],
        ops: &[Op],
        _durability: Durability,
    ) -> Result<Option<i64>, DatastoreError> {
        let when: Vec<EtcdCompare> = compares
            .iter()
            .map(|c| match c {
                Compare::Absent(k) => {
                    EtcdCompare::create_revision(self.full_key(k), CompareOp::Equal, 0)
                }
                Compare::Revision(k, r) => {
                    EtcdCompare::mod_revision(self.full_key(k), CompareOp::Equal, *r)
                }
            })
            .collect();
        let then: Vec<TxnOp> = ops
            .iter()
            .map(|op| match op {
                Op::Put(k, v) => TxnOp::put(self.full_key(k), v.clone(), None),
                Op::Delete(k) => TxnOp::delete(self.full_key(k), None),
            })
            .collect();
        let txn = Txn::new().when(when).and_then(then);
        let resp = self
            .retry("txn", |mut kv| {
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Ok(None);
        }
        let revision = resp.header().map(|h| h.revision());
        revision
            .map(Some)
            .ok_or_else(|| DatastoreError::Unavailable {
                backend: "etcd",
                attempts: 1,
                detail: "etcd answered a txn without a header".into(),
            })
    }
}
