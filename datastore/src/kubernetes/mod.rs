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
mod objects;
mod retry;
#[cfg(test)]
mod tests;
pub mod views;
mod watch;

use std::time::Duration;

use calix_core::store::KeyValue;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, PostParams, Preconditions, VersionMatch,
};
use serde_json::Value;

use self::kinds::{kind_of, kinds_under, Kind};
use self::objects::{
    check_key, key_value, list_revision, object_revision, one_object, records_of, spec_of, written,
};
use self::retry::{crd_missing, unexpected_conflict, Answer};
use crate::{Compare, Datastore, DatastoreError, Durability, Op, WatchStream};
pub use client::{connect, KubeConfig};

const BACKEND: &str = "kubernetes";
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

    /// The records of every object of `kind` under `prefix` (narrowed by label or field to it
    /// where it can be) at one resourceVersion: `exact` when given, else the newest. Returns
    /// them and the listing's revision. Each page becomes records as it arrives: a cluster's
    /// full objects (10,000 Pods) are never held all at once, only their records (a view's
    /// few fields).
    async fn list_kind(
        &self,
        kind: &Kind,
        prefix: &str,
        exact: Option<i64>,
        labels: Option<&str>,
    ) -> Result<(Vec<KeyValue>, i64), DatastoreError> {
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
            let mut records = Vec::new();
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
                records_of(kind, prefix, page.items, &mut records)?;
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
            return Ok((records, revision));
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
            let (records, revision) = self.list_kind(kind, prefix, at, None).await?;
            at.get_or_insert(revision);
            out.extend(records);
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
        let (mut out, _) = self.list_kind(kind, prefix, None, Some(&selector)).await?;
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
