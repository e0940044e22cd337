//! The `kubernetes` backend: calix's keys as custom resources of group `calix.dev` (one object
//! per key, [`kinds`]), every write a compare-and-swap on the object's `resourceVersion`.
//!
//! - A key's revision is its object's `resourceVersion`, read as a number. Every API server to
//!   date uses etcd's revision there, one counter for the whole cluster, which is what makes
//!   revisions of different objects comparable (as the `Datastore` trait needs). A
//!   resourceVersion that is not a number is an error, never a guess.
//! - `Compare::Absent` + put is a create (`AlreadyExists`: the compare failed);
//!   `Compare::Revision` + put is a replace carrying that resourceVersion (`Conflict` or
//!   `NotFound`: failed); a delete under `Compare::Revision` carries it as a precondition. A put
//!   without a compare reads the object and creates or replaces it, retrying lost races. One
//!   object per transaction: more is [`DatastoreError::TooManyObjects`].
//! - The API server may not change what calix wrote: writes ask for strict field validation
//!   (a field the installed CRD does not know is refused, not pruned: CRDs older than the
//!   agent fail the write loudly instead of losing data), and every write compares the `spec`
//!   it gets back with the record sent.
//! - Transient failures (connection refused or reset, timeouts, 429, 5xx, and a 403 while the
//!   API server's `/readyz` is not `ok`: just restarted, its authorizer not loaded yet) are
//!   retried, up to `attempts` tries each bounded by `timeout`, with a backoff of 50 ms
//!   doubling up to 2 s. A retried write whose first try did land sees its own write as a lost
//!   compare (`Ok(None)`), as with etcd: callers re-read.
//! - Listings page through the API (500 objects a page) and are one snapshot (the first page's
//!   resourceVersion; a listing over several kinds reads the others at exactly that version).
//! - A watch covers one kind ([`watch`]). Prefixes that span several kinds can be listed but
//!   not watched.
pub mod client;
pub mod crds;
pub mod kinds;
pub mod names;
pub mod views;
mod watch;

use std::future::Future;
use std::time::Duration;

use calix_core::store::KeyValue;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, PostParams, Preconditions, VersionMatch,
};
use kube::core::Status;
use serde_json::Value;

use self::kinds::{kind_of, kinds_under, Kind};
use super::{Compare, Datastore, DatastoreError, Durability, Op, WatchStream};
pub use client::{connect, KubeConfig};

const BACKEND: &str = "kubernetes";
/// First pause between attempts; it doubles after each failed attempt, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Objects per page of a listing.
const PAGE: u32 = 500;

/// The Kubernetes [`Datastore`].
#[derive(Clone)]
pub struct KubeStore {
    client: kube::Client,
    timeout: Duration,
    attempts: u32,
    /// How long the server keeps one watch request open ([`watch::WATCH_SECS`]).
    watch_secs: u32,
}

/// What one try of a request came to, before the store decides (a lost compare is an
/// answer, not a failure).
enum Answer<T> {
    Done(T),
    /// 404 Not Found.
    Missing(Box<Status>),
    /// 409: AlreadyExists or Conflict.
    Lost,
}

impl KubeStore {
    /// The store over `client` (see [`connect`]).
    pub fn new(client: kube::Client, timeout: Duration, attempts: u32) -> Self {
        Self {
            client,
            timeout,
            attempts: attempts.max(1),
            watch_secs: watch::WATCH_SECS,
        }
    }

    /// The same store with watch requests the server ends after `secs` (continued by the
    /// store; tests use a few seconds to see that happen).
    pub fn with_watch_secs(mut self, secs: u32) -> Self {
        self.watch_secs = secs.clamp(1, watch::WATCH_SECS);
        self
    }

    /// Builds the client from `cfg` (without contacting the API server) and the store on it.
    pub async fn connect(cfg: &KubeConfig) -> Result<Self, DatastoreError> {
        Ok(Self::new(connect(cfg).await?, cfg.timeout, cfg.attempts))
    }

    /// The client, for the agent's other readers of the API.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    fn api(&self, kind: &Kind) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &kind.api_resource())
    }

    /// Runs `call` with retries on transient failures, a timeout per try.
    async fn retry<T, F, Fut>(&self, what: &str, call: F) -> Result<Answer<T>, DatastoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let mut backoff = FIRST_BACKOFF;
        let mut detail = String::new();
        for attempt in 1..=self.attempts {
            match tokio::time::timeout(self.timeout, call()).await {
                Ok(Ok(v)) => return Ok(Answer::Done(v)),
                Ok(Err(kube::Error::Api(s))) if s.code == 404 => return Ok(Answer::Missing(s)),
                Ok(Err(kube::Error::Api(s))) if s.code == 409 => return Ok(Answer::Lost),
                // A server just (re)started answers before its authorizer has loaded the RBAC
                // objects, refusing every ServiceAccount meanwhile: retried while it says it
                // is not ready; from a ready one, a 403 is the answer.
                Ok(Err(e @ kube::Error::Api(_))) if forbidden(&e) => {
                    if self.ready().await {
                        return Err(rejected(what, &e));
                    }
                    detail = format!("{what}: {e} (the API server is not ready yet)");
                }
                Ok(Err(e)) if !transient(&e) => return Err(rejected(what, &e)),
                Ok(Err(e)) => detail = format!("{what}: {e}"),
                Err(_) => detail = format!("{what}: no answer within {:?}", self.timeout),
            }
            if attempt < self.attempts {
                tracing::warn!(
                    attempt,
                    attempts = self.attempts,
                    ?backoff,
                    "kubernetes {detail}; retrying"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
        Err(DatastoreError::Unavailable {
            backend: BACKEND,
            attempts: self.attempts,
            detail,
        })
    }

    /// Whether the API server says it is ready (`/readyz` answers `ok`).
    async fn ready(&self) -> bool {
        let Ok(req) = http::Request::get("/readyz").body(Vec::new()) else {
            return false;
        };
        matches!(
            tokio::time::timeout(self.timeout, self.client.request_text(req)).await,
            Ok(Ok(body)) if body.trim() == "ok"
        )
    }

    /// The object at `key`, and its kind.
    async fn read(
        &self,
        key: &str,
    ) -> Result<Option<(&'static Kind, DynamicObject)>, DatastoreError> {
        let Some(kind) = kind_of(key) else {
            return Ok(None);
        };
        check_key(key)?;
        if let Some(view) = kind.view {
            return self.read_view(kind, view, key).await;
        }
        let api = self.api(kind);
        let name = kind.name_of(key);
        match self.retry(&format!("get {key}"), || api.get(&name)).await? {
            Answer::Done(obj) => {
                // The name is the key's; a different key in the annotation is another
                // key's object under a colliding name (or a forgery): never this key's.
                if kind.key_of(&obj).as_deref() != Some(key) {
                    return Err(DatastoreError::BadValue {
                        key: key.into(),
                        detail: format!(
                            "object {} {name} holds another key ({:?})",
                            kind.kind,
                            obj.metadata
                                .annotations
                                .as_ref()
                                .and_then(|a| a.get(kinds::KEY_ANNOTATION))
                        ),
                    });
                }
                Ok(Some((kind, obj)))
            }
            Answer::Missing(_) | Answer::Lost => Ok(None),
        }
    }

    /// The Kubernetes object at read-only `key`: where the key says, if it is still that key's.
    async fn read_view(
        &self,
        kind: &'static Kind,
        view: &views::ViewOf,
        key: &str,
    ) -> Result<Option<(&'static Kind, DynamicObject)>, DatastoreError> {
        let Some((namespace, name)) = (view.locate)(&key[kind.prefix.len()..]) else {
            return Ok(None);
        };
        let api: Api<DynamicObject> = match &namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &kind.api_resource()),
            None => self.api(kind),
        };
        match self.retry(&format!("get {key}"), || api.get(&name)).await? {
            Answer::Done(obj) if kind.key_of(&obj).as_deref() == Some(key) => Ok(Some((kind, obj))),
            _ => Ok(None),
        }
    }

    /// The store's current revision: a listing of one object of any kind.
    async fn current_revision(&self) -> Result<i64, DatastoreError> {
        let kind = &kinds::KINDS[0];
        let api = self.api(kind);
        let lp = ListParams::default().limit(1);
        match self
            .retry("list for the revision", || api.list(&lp))
            .await?
        {
            Answer::Done(list) => list_revision(&list.metadata, kind),
            Answer::Missing(s) => Err(crd_missing(kind, &s)),
            Answer::Lost => Err(unexpected_conflict("list")),
        }
    }

    /// Every object of `kind` (narrowed by label or field to `prefix` where it can be) at one
    /// resourceVersion: `exact` when given, else the newest. Returns them and the listing's
    /// revision.
    async fn list_kind(
        &self,
        kind: &Kind,
        prefix: &str,
        exact: Option<i64>,
        labels: Option<&str>,
    ) -> Result<(Vec<DynamicObject>, i64), DatastoreError> {
        let api = self.api(kind);
        // A continue token that expired (410) restarts the listing; bounded.
        'listing: for _ in 0..self.attempts {
            let mut lp = ListParams::default().limit(PAGE);
            if let Some(s) = labels.map(str::to_string).or_else(|| kind.selector(prefix)) {
                lp = lp.labels(&s);
            }
            if let Some(s) = kind.field_selector(prefix) {
                lp = lp.fields(&s);
            }
            if let Some(rv) = exact {
                lp = lp.at(&rv.to_string()).matching(VersionMatch::Exact);
            }
            let mut objects = Vec::new();
            let mut revision = None;
            loop {
                let page = match self
                    .retry(&format!("list {}", kind.plural), || api.list(&lp))
                    .await
                {
                    Ok(Answer::Done(page)) => page,
                    Ok(Answer::Missing(s)) => return Err(crd_missing(kind, &s)),
                    Ok(Answer::Lost) => return Err(unexpected_conflict("list")),
                    Err(DatastoreError::Rejected { code: 410, .. })
                        if lp.continue_token.is_some() =>
                    {
                        continue 'listing
                    }
                    Err(e) => return Err(e),
                };
                if revision.is_none() {
                    revision = Some(list_revision(&page.metadata, kind)?);
                }
                objects.extend(page.items);
                match page.metadata.continue_.filter(|c| !c.is_empty()) {
                    Some(token) => {
                        // The token carries the snapshot; a version with it is refused.
                        lp.resource_version = None;
                        lp.version_match = None;
                        lp.continue_token = Some(token);
                    }
                    None => break,
                }
            }
            let revision = revision.unwrap_or_default();
            return Ok((objects, revision));
        }
        Err(DatastoreError::Unavailable {
            backend: BACKEND,
            attempts: self.attempts,
            detail: format!(
                "list {}: the listing kept expiring between pages",
                kind.plural
            ),
        })
    }

    /// A create (`name` `None`) or a replace, with `fieldValidation=Strict`: a field the CRD
    /// does not know is refused, not pruned.
    async fn write(
        &self,
        kind: &Kind,
        name: Option<&str>,
        obj: &DynamicObject,
    ) -> Result<DynamicObject, kube::Error> {
        let request = kube::core::Request::new(format!(
            "/apis/{}/{}/{}",
            kinds::GROUP,
            kinds::VERSION,
            kind.plural
        ));
        let body = serde_json::to_vec(obj).map_err(kube::Error::SerdeError)?;
        let pp = PostParams::default();
        let mut req = match name {
            None => request.create(&pp, body),
            Some(name) => request.replace(name, &pp, body),
        }
        .map_err(kube::Error::BuildRequest)?;
        let uri = req.uri().to_string();
        let sep = if uri.ends_with('?') { "" } else { "&" };
        *req.uri_mut() = format!("{uri}{sep}fieldValidation=Strict")
            .parse()
            .map_err(|e: http::uri::InvalidUri| kube::Error::HttpError(e.into()))?;
        self.client.request::<DynamicObject>(req).await
    }

    /// Creates `key` (absent before): `Some(revision)`, or `None` if it exists.
    async fn create(
        &self,
        kind: &Kind,
        key: &str,
        spec: &Value,
    ) -> Result<Option<i64>, DatastoreError> {
        let obj = kind.object(key, spec.clone(), None);
        match self
            .retry(&format!("create {key}"), || self.write(kind, None, &obj))
            .await?
        {
            Answer::Done(created) => written(kind, key, spec, &created).map(Some),
            Answer::Lost => Ok(None),
            Answer::Missing(s) => Err(crd_missing(kind, &s)),
        }
    }

    /// Replaces `key` if it is still at `revision`: `Some(revision)` of the write, or `None`.
    async fn replace(
        &self,
        kind: &Kind,
        key: &str,
        spec: &Value,
        revision: i64,
    ) -> Result<Option<i64>, DatastoreError> {
        let obj = kind.object(key, spec.clone(), Some(revision));
        let name = kind.name_of(key);
        match self
            .retry(&format!("replace {key}"), || {
                self.write(kind, Some(&name), &obj)
            })
            .await?
        {
            Answer::Done(replaced) => written(kind, key, spec, &replaced).map(Some),
            Answer::Lost | Answer::Missing(_) => Ok(None),
        }
    }

    /// Deletes `key` (at `revision` when given): `Some(revision of the delete)`, `None` when
    /// the precondition failed, `Ok(Err(()))` when it was not there.
    async fn delete(
        &self,
        kind: &Kind,
        key: &str,
        revision: Option<i64>,
    ) -> Result<Result<Option<i64>, ()>, DatastoreError> {
        let api = self.api(kind);
        let name = kind.name_of(key);
        let dp = DeleteParams {
            preconditions: revision.map(|r| Preconditions {
                resource_version: Some(r.to_string()),
                uid: None,
            }),
            ..DeleteParams::default()
        };
        match self
            .retry(&format!("delete {key}"), || api.delete(&name, &dp))
            .await?
        {
            Answer::Done(either) => match either {
                either::Either::Left(obj) => Ok(Ok(Some(object_revision(kind, &obj)?))),
                // A Status instead of the object: no revision in it, so read the store's.
                either::Either::Right(_) => Ok(Ok(Some(self.current_revision().await?))),
            },
            Answer::Lost => Ok(Ok(None)),
            Answer::Missing(_) => Ok(Err(())),
        }
    }
}

#[tonic::async_trait]
impl Datastore for KubeStore {
    fn kind(&self) -> &'static str {
        BACKEND
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, DatastoreError> {
        match self.read(key).await? {
            Some((kind, obj)) => Ok(Some(key_value(kind, key.to_string(), &obj)?)),
            None => Ok(None),
        }
    }

    async fn list_with_revision(
        &self,
        prefix: &str,
    ) -> Result<(Vec<KeyValue>, i64), DatastoreError> {
        let kinds = kinds_under(prefix);
        if kinds.is_empty() {
            return Ok((Vec::new(), self.current_revision().await?));
        }
        let mut out = Vec::new();
        let mut at = None;
        for kind in kinds {
            let (objects, revision) = self.list_kind(kind, prefix, at, None).await?;
            at.get_or_insert(revision);
            for obj in objects {
                match kind.key_of(&obj) {
                    Some(key) if key.starts_with(prefix) => out.push(key_value(kind, key, &obj)?),
                    Some(_) => {}
                    None => tracing::warn!(kind = kind.kind, name = ?obj.metadata.name,
                        "ignoring an object that is not a calix record (its name and key annotation disagree)"),
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok((out, at.unwrap_or_default()))
    }

    async fn list_of_node(
        &self,
        prefix: &str,
        node: &str,
    ) -> Result<Vec<KeyValue>, DatastoreError> {
        let kinds = kinds_under(prefix);
        let [kind] = kinds.as_slice() else {
            return Ok(super::keep_node(self.list(prefix).await?, node));
        };
        if kind.node_field != Some("node") {
            return Ok(super::keep_node(self.list(prefix).await?, node));
        }
        let selector = format!("{}={}", kinds::NODE_LABEL, names::label_value(node));
        let (objects, _) = self.list_kind(kind, prefix, None, Some(&selector)).await?;
        let mut out = Vec::new();
        for obj in objects {
            if let Some(key) = kind.key_of(&obj).filter(|k| k.starts_with(prefix)) {
                out.push(key_value(kind, key, &obj)?);
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        // The label is the writer's word; the record's own node decides.
        Ok(super::keep_node(out, node))
    }

    async fn txn(
        &self,
        compares: &[Compare],
        ops: &[Op],
        _durability: Durability,
    ) -> Result<Option<i64>, DatastoreError> {
        let (op, compare) = one_object(compares, ops)?;
        let key = match op {
            Op::Put(k, _) | Op::Delete(k) => k.as_str(),
        };
        check_key(key)?;
        let kind = kind_of(key).ok_or_else(|| DatastoreError::OutsideKeySpace {
            backend: BACKEND,
            key: key.into(),
        })?;
        if kind.view.is_some() {
            return Err(DatastoreError::ReadOnly {
                backend: BACKEND,
                key: key.into(),
            });
        }
        match (op, compare) {
            (Op::Put(_, value), compare) => {
                let spec = spec_of(key, value)?;
                match compare {
                    Some(Compare::Absent(_)) => self.create(kind, key, &spec).await,
                    Some(Compare::Revision(_, r)) => self.replace(kind, key, &spec, *r).await,
                    None => self.put(kind, key, &spec).await,
                }
            }
            (Op::Delete(_), Some(Compare::Revision(_, r))) => {
                Ok(self.delete(kind, key, Some(*r)).await?.unwrap_or(None))
            }
            (Op::Delete(_), Some(Compare::Absent(_))) => match self.read(key).await? {
                Some(_) => Ok(None),
                None => Ok(Some(self.current_revision().await?)),
            },
            (Op::Delete(_), None) => match self.delete(kind, key, None).await? {
                Ok(rev) => Ok(rev),
                // Not there: nothing to do, as etcd's delete of a missing key.
                Err(()) => Ok(Some(self.current_revision().await?)),
            },
        }
    }

    async fn watch(&self, prefix: &str, after: i64) -> Result<WatchStream, DatastoreError> {
        watch::open(self, prefix, after).await
    }
}

impl KubeStore {
    /// An unconditional put: create, or replace at the revision just read; lost races retried.
    async fn put(
        &self,
        kind: &Kind,
        key: &str,
        spec: &Value,
    ) -> Result<Option<i64>, DatastoreError> {
        for _ in 0..self.attempts.max(8) {
            let written = match self.read(key).await? {
                None => self.create(kind, key, spec).await?,
                Some((_, obj)) => {
                    let rev = object_revision(kind, &obj)?;
                    self.replace(kind, key, spec, rev).await?
                }
            };
            if written.is_some() {
                return Ok(written);
            }
        }
        Err(DatastoreError::Contended {
            attempts: self.attempts.max(8),
            what: format!("put {key}"),
        })
    }
}

/// The single (op, compare) of a transaction, on one key.
fn one_object<'a>(
    compares: &'a [Compare],
    ops: &'a [Op],
) -> Result<(&'a Op, Option<&'a Compare>), DatastoreError> {
    let key_of_op = |op: &'a Op| match op {
        Op::Put(k, _) | Op::Delete(k) => k.as_str(),
    };
    let key_of_compare = |c: &'a Compare| match c {
        Compare::Absent(k) | Compare::Revision(k, _) => k.as_str(),
    };
    let mut keys: Vec<&str> = ops
        .iter()
        .map(key_of_op)
        .chain(compares.iter().map(key_of_compare))
        .collect();
    keys.dedup();
    match (ops, compares) {
        ([op], []) => Ok((op, None)),
        ([op], [c]) if key_of_op(op) == key_of_compare(c) => Ok((op, Some(c))),
        _ => Err(DatastoreError::TooManyObjects {
            backend: BACKEND,
            keys: keys.into_iter().map(String::from).collect(),
        }),
    }
}

fn check_key(key: &str) -> Result<(), DatastoreError> {
    if key.len() > kinds::MAX_KEY {
        return Err(DatastoreError::BadValue {
            key: key.chars().take(64).collect::<String>() + "…",
            detail: format!("keys are at most {} bytes", kinds::MAX_KEY),
        });
    }
    Ok(())
}

/// The record in `value` as an object's spec (a JSON object).
fn spec_of(key: &str, value: &[u8]) -> Result<Value, DatastoreError> {
    match serde_json::from_slice::<Value>(value) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(DatastoreError::BadValue {
            key: key.into(),
            detail: "the kubernetes datastore stores JSON objects (an object's spec)".into(),
        }),
        Err(e) => Err(DatastoreError::BadValue {
            key: key.into(),
            detail: format!("not JSON: {e}"),
        }),
    }
}

/// A stored object as a [`KeyValue`]. An object without a `spec` object (the CRDs' schemas
/// require one, but a CRD can be replaced) still is one, its value that spec (`null` when
/// missing): it is the reader's to refuse, and one such object never fails a listing.
fn key_value(kind: &Kind, key: String, obj: &DynamicObject) -> Result<KeyValue, DatastoreError> {
    let revision = object_revision(kind, obj)?;
    let spec = kind.value_of(obj);
    Ok(KeyValue {
        value: serde_json::to_vec(&spec).unwrap_or_default(),
        key,
        revision,
        created: created_of(obj),
    })
}

/// The object's `creationTimestamp` in seconds (set by the API server at creation, kept by
/// every update); 0 when it has none.
pub(crate) fn created_of(obj: &DynamicObject) -> i64 {
    obj.metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_second())
}

/// The revision of a write: the object's new resourceVersion, once its spec is checked to be
/// what was sent.
fn written(
    kind: &Kind,
    key: &str,
    sent: &Value,
    obj: &DynamicObject,
) -> Result<i64, DatastoreError> {
    let revision = object_revision(kind, obj)?;
    if obj.data.get("spec") != Some(sent) {
        return Err(DatastoreError::BadValue {
            key: key.into(),
            detail: format!(
                "the API server stored another {} than calix wrote (fields dropped or changed: \
                 are the installed CRDs older than this agent? apply charts/calix/crds); \
                 sent {sent}, stored {}",
                kind.kind,
                obj.data.get("spec").cloned().unwrap_or(Value::Null)
            ),
        });
    }
    Ok(revision)
}

fn object_revision(kind: &Kind, obj: &DynamicObject) -> Result<i64, DatastoreError> {
    parse_revision(obj.metadata.resource_version.as_deref(), kind)
}

fn list_revision(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta,
    kind: &Kind,
) -> Result<i64, DatastoreError> {
    parse_revision(meta.resource_version.as_deref(), kind)
}

/// A resourceVersion as a revision (see the module doc).
pub(crate) fn parse_revision(rv: Option<&str>, kind: &Kind) -> Result<i64, DatastoreError> {
    rv.and_then(|r| r.parse::<i64>().ok())
        .filter(|r| *r > 0)
        .ok_or_else(|| DatastoreError::BadValue {
            key: kind.plural.into(),
            detail: format!(
                "resourceVersion {rv:?} is not a positive number: this API server's storage is \
                 not one calix can compare revisions on"
            ),
        })
}

/// A 403 Forbidden.
fn forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403)
}

/// Whether a failure may go away by itself.
fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => matches!(s.code, 429 | 500 | 502 | 503 | 504),
        kube::Error::HyperError(_)
        | kube::Error::Service(_)
        | kube::Error::ReadEvents(_)
        | kube::Error::SerdeError(_) => true,
        _ => false,
    }
}

fn rejected(what: &str, e: &kube::Error) -> DatastoreError {
    match e {
        kube::Error::Api(s) => DatastoreError::Rejected {
            backend: BACKEND,
            what: what.into(),
            code: s.code,
            detail: format!("{}: {}", s.reason, s.message),
        },
        other => DatastoreError::Rejected {
            backend: BACKEND,
            what: what.into(),
            code: 0,
            detail: other.to_string(),
        },
    }
}

fn crd_missing(kind: &Kind, s: &Status) -> DatastoreError {
    DatastoreError::Rejected {
        backend: BACKEND,
        what: format!("{}.{}", kind.plural, kinds::GROUP),
        code: s.code,
        detail: format!(
            "{}: the CustomResourceDefinition is not installed (apply charts/calix/crds)",
            s.message
        ),
    }
}

fn unexpected_conflict(what: &str) -> DatastoreError {
    DatastoreError::Rejected {
        backend: BACKEND,
        what: what.into(),
        code: 409,
        detail: "conflict on a read".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A store over a scripted API server: each request's path is recorded and answered by
    /// `answer` (status, body).
    fn scripted(
        answer: impl Fn(&str, usize) -> (u16, String) + Send + Sync + 'static,
    ) -> (KubeStore, Arc<Mutex<Vec<String>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let answer = Arc::new(answer);
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let path = req.uri().path().to_string();
            let n = {
                let mut log = log.lock().expect("lock");
                log.push(path.clone());
                log.iter().filter(|p| **p == path).count()
            };
            let (status, body) = answer(&path, n);
            async move {
                http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(body.into_bytes()))
            }
        });
        let client = kube::Client::new(service, "default");
        (KubeStore::new(client, Duration::from_secs(2), 5), seen)
    }

    fn forbidden() -> (u16, String) {
        (
            403,
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Forbidden", "code": 403,
                "message": "calixnodes.calix.dev \"n1\" is forbidden: User \"system:serviceaccount:kube-system:calix\" cannot get resource \"calixnodes\""})
            .to_string(),
        )
    }

    fn node_object() -> String {
        serde_json::json!({"apiVersion": "calix.dev/v1", "kind": "CalixNode",
            "metadata": {"name": "n1", "resourceVersion": "7",
                "annotations": {"calix.dev/key": "nodes/n1"}},
            "spec": {"name": "n1"}})
        .to_string()
    }

    /// An API server just (re)started serves requests before its authorizer has loaded the
    /// RBAC objects, refusing every ServiceAccount meanwhile (seen in kubernetes.rs's API server
    /// restart, once agents no longer ran as system:masters): a 403 while /readyz is not ok is
    /// retried; from a ready server it is the answer, at once.
    #[tokio::test]
    async fn a_403_is_retried_only_while_the_api_server_is_not_ready() {
        let (store, seen) = scripted(|path, n| match path {
            "/readyz" => (500, "[-]informer-sync failed".into()),
            _ if n == 1 => forbidden(),
            _ => (200, node_object()),
        });
        let got = store
            .get("nodes/n1")
            .await
            .expect("the node record, once ready");
        assert_eq!(got.expect("present").revision, 7);
        assert!(seen.lock().expect("lock").contains(&"/readyz".to_string()));
        let (store, seen) = scripted(|path, _| match path {
            "/readyz" => (200, "ok".into()),
            _ => forbidden(),
        });
        let e = store.get("nodes/n1").await.expect_err("refused");
        assert!(
            matches!(&e, DatastoreError::Rejected { code: 403, .. }),
            "{e}"
        );
        let gets = seen
            .lock()
            .expect("lock")
            .iter()
            .filter(|p| p.ends_with("/n1"))
            .count();
        assert_eq!(gets, 1, "a refusal from a ready server is not retried");
    }
}
