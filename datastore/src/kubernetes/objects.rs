//! calix's records as the API's objects and back: one object per transaction, a record as
//! an object's `spec`, an object as a [`KeyValue`], resourceVersions as revisions.
use calix_core::store::KeyValue;
use kube::api::DynamicObject;
use serde_json::Value;

use super::kinds::{self, Kind};
use super::BACKEND;
use crate::{Compare, DatastoreError, Op};

/// The single (op, compare) of a transaction, on one key.
pub(super) fn one_object<'a>(
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

pub(super) fn check_key(key: &str) -> Result<(), DatastoreError> {
    if key.len() > kinds::MAX_KEY {
        return Err(DatastoreError::BadValue {
            key: key.chars().take(64).collect::<String>() + "…",
            detail: format!("keys are at most {} bytes", kinds::MAX_KEY),
        });
    }
    Ok(())
}

/// The record in `value` as an object's spec (a JSON object).
pub(super) fn spec_of(key: &str, value: &[u8]) -> Result<Value, DatastoreError> {
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
pub(super) fn key_value(
    kind: &Kind,
    key: String,
    obj: &DynamicObject,
) -> Result<KeyValue, DatastoreError> {
    let revision = object_revision(kind, obj)?;
    let spec = kind.value_of(obj);
    Ok(KeyValue {
        value: serde_json::to_vec(&spec).unwrap_or_default(),
        key,
        revision,
        created: created_of(obj),
    })
}

/// Appends to `out` the records of the listed `objects` of `kind` whose keys are under
/// `prefix`. An object whose name and key annotation disagree is no calix record: left out,
/// with a warning.
pub(super) fn records_of(
    kind: &Kind,
    prefix: &str,
    objects: Vec<DynamicObject>,
    out: &mut Vec<KeyValue>,
) -> Result<(), DatastoreError> {
    for obj in objects {
        match kind.key_of(&obj) {
            Some(key) if key.starts_with(prefix) => out.push(key_value(kind, key, &obj)?),
            Some(_) => {}
            None => tracing::warn!(kind = kind.kind, name = ?obj.metadata.name,
                "ignoring an object that is not a calix record (its name and key annotation disagree)"),
        }
    }
    Ok(())
}

/// The object's `creationTimestamp` in seconds (set by the API server at creation, kept by
/// every update); 0 when it has none.
pub(super) fn created_of(obj: &DynamicObject) -> i64 {
    obj.metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_second())
}

/// The revision of a write: the object's new resourceVersion, once its spec is checked to be
/// what was sent.
pub(super) fn written(
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

pub(super) fn object_revision(kind: &Kind, obj: &DynamicObject) -> Result<i64, DatastoreError> {
    parse_revision(obj.metadata.resource_version.as_deref(), kind)
}

pub(super) fn list_revision(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta,
    kind: &Kind,
) -> Result<i64, DatastoreError> {
    parse_revision(meta.resource_version.as_deref(), kind)
}

/// A resourceVersion as a revision (see the module doc).
pub(super) fn parse_revision(rv: Option<&str>, kind: &Kind) -> Result<i64, DatastoreError> {
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
