//! Objects through the API: applied (server-side), their status patched, read, listed and
//! deleted; calix's CRDs applied and established.
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};

use super::KubeApi;
use crate::{Error, Result};

impl KubeApi {
    /// Applies `object` (server-side apply, forced), e.g. an `IPPool`, a `Pod`: `apiVersion`,
    /// `kind`, `metadata.name` (`metadata.namespace` for a namespaced kind) and the rest.
    /// Returns the object as the server has it.
    pub fn apply(&self, object: serde_json::Value) -> Result<serde_json::Value> {
        let (ar, ns, name) = resource_of(&object)?;
        self.with_client(move |c| async move {
            let api = dynamic_api(c, &ar, ns.as_deref());
            let pp = PatchParams::apply("calix-testbed").force();
            api.patch(&name, &pp, &Patch::Apply(&object))
                .await
                .map(|o| serde_json::to_value(o).unwrap_or_default())
                .map_err(|e| Error::Kube {
                    what: format!("apply {} {name}", ar.kind),
                    detail: e.to_string(),
                })
        })
    }

    /// Applies each of `objects` (as [`KubeApi::apply`]) and merges its status (the second of
    /// each pair, unless null) into it, `concurrency` objects at a time: thousands of objects
    /// in seconds (a bench's cluster).
    pub fn apply_many(
        &self,
        objects: Vec<(serde_json::Value, serde_json::Value)>,
        concurrency: usize,
    ) -> Result<()> {
        let work = objects
            .into_iter()
            .map(|(o, s)| Ok((resource_of(&o)?, o, s)))
            .collect::<Result<Vec<_>>>()?;
        self.with_client(move |c| async move {
            let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
            let mut tasks = tokio::task::JoinSet::new();
            for ((ar, ns, name), object, status) in work {
                let (c, permits) = (c.clone(), permits.clone());
                tasks.spawn(async move {
                    let _permit = permits.acquire_owned().await;
                    let api = dynamic_api(c, &ar, ns.as_deref());
                    let failed = |e: kube::Error| Error::Kube {
                        what: format!("apply {} {name}", ar.kind),
                        detail: e.to_string(),
                    };
                    let pp = PatchParams::apply("calix-testbed").force();
                    api.patch(&name, &pp, &Patch::Apply(&object))
                        .await
                        .map_err(failed)?;
                    if !status.is_null() {
                        let patch = serde_json::json!({ "status": status });
                        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await
                            .map_err(failed)?;
                    }
                    Ok(())
                });
            }
            while let Some(done) = tasks.join_next().await {
                done.map_err(|e| Error::Kube {
                    what: "an apply of apply_many".into(),
                    detail: e.to_string(),
                })??;
            }
            Ok(())
        })
    }

    /// Applies each of `objects` in turn (as [`KubeApi::apply`]) on one client, its
    /// connection made first (a read of the first object's kind): returns the wall-clock time
    /// just before each write, for a bench timing what follows a write.
    pub fn apply_timed(
        &self,
        objects: Vec<serde_json::Value>,
    ) -> Result<Vec<std::time::SystemTime>> {
        let work = objects
            .into_iter()
            .map(|o| Ok((resource_of(&o)?, o)))
            .collect::<Result<Vec<_>>>()?;
        self.with_client(move |c| async move {
            let pp = PatchParams::apply("calix-testbed").force();
            let mut at = Vec::new();
            for (i, ((ar, ns, name), object)) in work.into_iter().enumerate() {
                let api = dynamic_api(c.clone(), &ar, ns.as_deref());
                let failed = |e: kube::Error| Error::Kube {
                    what: format!("apply {} {name}", ar.kind),
                    detail: e.to_string(),
                };
                if i == 0 {
                    // The connection (TLS) is made here, not in what is timed.
                    api.get_opt(&name).await.map_err(failed)?;
                }
                at.push(std::time::SystemTime::now());
                api.patch(&name, &pp, &Patch::Apply(&object))
                    .await
                    .map_err(failed)?;
            }
            Ok(at)
        })
    }

    /// Applies `object(0)`, `object(1)`, … (as [`KubeApi::apply`]) on one client, one every
    /// `every` (later ones catch up when a write took longer), until `stop` is set: churn for
    /// a bench. How many were written.
    pub fn apply_paced(
        &self,
        object: impl Fn(usize) -> serde_json::Value + Send + 'static,
        every: std::time::Duration,
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<usize> {
        self.with_client(move |c| async move {
            let pp = PatchParams::apply("calix-testbed").force();
            let start = tokio::time::Instant::now();
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let o = object(k);
                let (ar, ns, name) = resource_of(&o)?;
                let api = dynamic_api(c.clone(), &ar, ns.as_deref());
                api.patch(&name, &pp, &Patch::Apply(&o))
                    .await
                    .map_err(|e| Error::Kube {
                        what: format!("apply {} {name}", ar.kind),
                        detail: e.to_string(),
                    })?;
                k += 1;
                tokio::time::sleep_until(start + every * k as u32).await;
            }
            Ok(k)
        })
    }

    /// Merges `patch` (e.g. `{"metadata": {"labels": …}}`) into `object` (`apiVersion`,
    /// `kind`, `metadata`), whoever manages its fields.
    pub fn merge_patch(&self, object: serde_json::Value, patch: serde_json::Value) -> Result<()> {
        let (ar, ns, name) = resource_of(&object)?;
        self.with_client(move |c| async move {
            let api = dynamic_api(c, &ar, ns.as_deref());
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .map_err(|e| Error::Kube {
                    what: format!("patch {} {name}", ar.kind),
                    detail: e.to_string(),
                })
        })
    }

    /// Merges `status` into the status of `object` (`apiVersion`, `kind`, `metadata`), e.g. a
    /// Node's addresses.
    pub fn patch_status(&self, object: serde_json::Value, status: serde_json::Value) -> Result<()> {
        let (ar, ns, name) = resource_of(&object)?;
        self.with_client(move |c| async move {
            let api = dynamic_api(c, &ar, ns.as_deref());
            let patch = serde_json::json!({ "status": status });
            api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .map_err(|e| Error::Kube {
                    what: format!("status of {} {name}", ar.kind),
                    detail: e.to_string(),
                })
        })
    }

    /// Deletes `kind` `namespace/name` at once (no grace period: no kubelet would confirm it).
    pub fn delete_now(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<()> {
        let dp = kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        self.delete_with(api_version, kind, Some(namespace), name, dp)
    }

    /// The cluster-scoped objects `kind` of `api_version` (every namespace for a namespaced
    /// kind) matching `labels` (a label selector; "" for all), as JSON.
    pub fn list(
        &self,
        api_version: &str,
        kind: &str,
        labels: &str,
    ) -> Result<Vec<serde_json::Value>> {
        let (ar, _, _) = named(api_version, kind, None, "-")?;
        let labels = labels.to_string();
        self.with_client(move |c| async move {
            let api: Api<kube::api::DynamicObject> = Api::all_with(c, &ar);
            let lp = kube::api::ListParams::default().labels(&labels);
            let list = api.list(&lp).await.map_err(|e| Error::Kube {
                what: format!("list {}", ar.plural),
                detail: e.to_string(),
            })?;
            Ok(list
                .items
                .iter()
                .map(|o| serde_json::to_value(o).unwrap_or_default())
                .collect())
        })
    }

    /// Deletes the cluster-scoped object `kind` `name` of `api_version` (gone already: fine).
    pub fn delete(&self, api_version: &str, kind: &str, name: &str) -> Result<()> {
        self.delete_with(api_version, kind, None, name, Default::default())
    }

    /// Deletes `kind` `name` (in `namespace` when given) with `dp`; gone already: fine.
    fn delete_with(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        dp: kube::api::DeleteParams,
    ) -> Result<()> {
        // An empty name would be the collection's path: a delete of every object of the kind.
        if name.is_empty() {
            return Err(Error::Missing {
                field: format!("the name of the {kind} to delete"),
                value: String::new(),
            });
        }
        let (ar, ns, name) = named(api_version, kind, namespace, name)?;
        self.with_client(move |c| async move {
            let api = dynamic_api(c, &ar, ns.as_deref());
            match api.delete(&name, &dp).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(Error::Kube {
                    what: format!("delete {} {name}", ar.kind),
                    detail: e.to_string(),
                }),
            }
        })
    }

    /// `kind` `name` (in `namespace` when given), `None` when there is none.
    pub fn get(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<serde_json::Value>> {
        let (ar, ns, name) = named(api_version, kind, namespace, name)?;
        self.with_client(move |c| async move {
            let api = dynamic_api(c, &ar, ns.as_deref());
            api.get_opt(&name)
                .await
                .map(|o| o.map(|o| serde_json::to_value(o).unwrap_or_default()))
                .map_err(|e| Error::Kube {
                    what: format!("get {} {name}", ar.kind),
                    detail: e.to_string(),
                })
        })
    }

    /// Deletes `kind` `namespace/name` the ordinary way (its grace period; for a Pod the
    /// kubelet confirms it). Gone already: fine.
    pub fn delete_in(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<()> {
        self.delete_with(api_version, kind, Some(namespace), name, Default::default())
    }

    /// Applies (server-side) every CRD in `dir` and waits until each is established.
    pub fn apply_crds(&self, dir: &Path) -> Result<()> {
        let mut crds = Vec::new();
        let entries =
            std::fs::read_dir(dir).map_err(Error::io(format!("read {}", dir.display())))?;
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&path)
                .map_err(Error::io(format!("read {}", path.display())))?;
            let crd: CustomResourceDefinition =
                serde_saphyr::from_str(&text).map_err(|e| Error::Unexpected {
                    what: path.display().to_string(),
                    found: e.to_string(),
                    expected: "a CustomResourceDefinition".into(),
                })?;
            crds.push(crd);
        }
        self.with_client(move |c| async move {
            let api: Api<CustomResourceDefinition> = Api::all(c);
            let pp = PatchParams::apply("calix-testbed").force();
            for crd in &crds {
                let name = crd.metadata.name.clone().unwrap_or_default();
                api.patch(&name, &pp, &Patch::Apply(crd))
                    .await
                    .map_err(|e| Error::Kube {
                        what: format!("apply CRD {name}"),
                        detail: e.to_string(),
                    })?;
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            for crd in &crds {
                let name = crd.metadata.name.clone().unwrap_or_default();
                loop {
                    let established = api.get(&name).await.ok().is_some_and(|c| {
                        c.status
                            .and_then(|s| s.conditions)
                            .unwrap_or_default()
                            .iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    });
                    if established {
                        break;
                    }
                    if Instant::now() > deadline {
                        return Err(Error::Kube {
                            what: format!("CRD {name}"),
                            detail: "not established within 30 s".into(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            Ok(())
        })
    }
}

/// The API of `ar`'s objects in `namespace` (all of them when `None`).
fn dynamic_api(
    c: kube::Client,
    ar: &kube::api::ApiResource,
    namespace: Option<&str>,
) -> Api<kube::api::DynamicObject> {
    match namespace {
        Some(ns) => Api::namespaced_with(c, ns, ar),
        None => Api::all_with(c, ar),
    }
}

/// The resource (plural guessed from the kind, as kube does), namespace and name of an object.
/// [`resource_of`] an object known by its kind and name only.
fn named(
    api_version: &str,
    kind: &str,
    namespace: Option<&str>,
    name: &str,
) -> Result<(kube::api::ApiResource, Option<String>, String)> {
    resource_of(&serde_json::json!({
        "apiVersion": api_version, "kind": kind,
        "metadata": {"name": name, "namespace": namespace}
    }))
}

fn resource_of(
    object: &serde_json::Value,
) -> Result<(kube::api::ApiResource, Option<String>, String)> {
    let field = |path: &[&str]| {
        path.iter()
            .fold(object, |v, k| &v[*k])
            .as_str()
            .map(String::from)
            .ok_or_else(|| Error::Missing {
                field: path.join("."),
                value: object.to_string(),
            })
    };
    let api_version = field(&["apiVersion"])?;
    let kind = field(&["kind"])?;
    let name = field(&["metadata", "name"])?;
    let (group, version) = api_version
        .rsplit_once('/')
        .unwrap_or(("", api_version.as_str()));
    let gvk = kube::api::GroupVersionKind::gvk(group, version, &kind);
    let namespace = object["metadata"]["namespace"].as_str().map(String::from);
    Ok((kube::api::ApiResource::from_gvk(&gvk), namespace, name))
}
