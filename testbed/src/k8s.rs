//! A real Kubernetes API server (upstream kube-apiserver v1.36.2 from `../shared/k8s/bin`,
//! decompressed on demand into `target/k8s/` after checking its SHA-256) on a real etcd
//! (Debian's), with calix's CRDs (`charts/calix/crds/`) applied.
//!
//! Two places: [`KubeApi::on_loopback`] runs both in the caller's namespace on 127.0.0.1 and
//! free ports (for a client in the test process); [`KubeApi::in_namespace`] runs them in a
//! namespace of their own (named [`crate::unique`]`("k")`, the API server on 6443 of every
//! address there), and [`KubeApi::wire`] connects a node namespace to it by a veth pair
//! (10.97.<i>.1 ↔ 10.97.<i>.2/30) and writes that node a kubeconfig.
//!
//! Authentication is a static token file (an admin in `system:masters`) and ServiceAccount
//! tokens from the TokenRequest API, bound to no object or to a node ([`KubeApi::node_token`]:
//! a pod on the node, as a DaemonSet pod's, or the Node; the agents' own, with the chart's
//! ClusterRole and node authority, in [`crate::authority`]); authorization stays `Node,RBAC`. The API server makes its own serving certificate (`--cert-dir`, for the names
//! `kubernetes*` and 127.0.0.1): kubeconfigs trust its CA and verify the name `kubernetes`
//! whatever address they dial. Everything is killed and removed on drop, even when a test
//! fails; each daemon also dies with the thread that started it.
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};

use crate::netns::{veth, Netns};
use crate::process::{checked, command_in, spawn_logged};
use crate::{unique, Error, Result};

/// The token of the test bed's cluster admin (group `system:masters`).
pub const ADMIN_TOKEN: &str = "calix-testbed-admin";
/// The API server's port in a namespace of its own.
const NS_API_PORT: u16 = 6443;
/// The address the API server advertises in a namespace of its own (on its loopback).
const NS_ADVERTISE: &str = "10.97.0.1";
/// The name every kubeconfig verifies the serving certificate against.
const TLS_NAME: &str = "kubernetes";

/// An API server and its etcd. See the module doc.
pub struct KubeApi {
    /// The namespace both run in; `None`: the caller's, on 127.0.0.1.
    pub ns: Option<Netns>,
    pub dir: PathBuf,
    api_port: u16,
    etcd_port: u16,
    peer_port: u16,
    watch_cache: bool,
    etcd: Mutex<Option<Child>>,
    apiserver: Mutex<Option<Child>>,
    /// kube-controller-manager and kube-scheduler, once [`KubeApi::start_controllers`] ran.
    controllers: Mutex<Vec<Child>>,
    links: AtomicU32,
    /// Whether the agents' ServiceAccount and the chart's node authority are installed
    /// ([`KubeApi::calix_agent`]).
    pub(crate) agent_account: Mutex<bool>,
}

/// What a node's token is bound to ([`KubeApi::node_token`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundTo {
    /// A Pod on the node, as a DaemonSet pod's projected token is.
    Pod,
    /// The Node object.
    Node,
}

impl KubeApi {
    /// On 127.0.0.1 of the caller's namespace; panics on failure. `watch_cache: false` serves
    /// every watch from etcd (its compaction then shows as 410 Gone).
    pub fn on_loopback(watch_cache: bool) -> Self {
        crate::require_root();
        Self::launch(None, unique("k"), watch_cache).unwrap_or_else(|e| panic!("{e}"))
    }

    /// One API server in a namespace of its own for the whole test binary: started by the
    /// first caller, on a thread that lives until the process exits (its daemons die with the
    /// thread that started them), stopped and removed when the process exits. Tests sharing it
    /// keep to objects of their own (unique names, pools of their own) and never restart it.
    pub fn shared() -> std::sync::Arc<Self> {
        static SHARED: Mutex<Option<std::sync::Arc<KubeApi>>> = Mutex::new(None);
        extern "C" fn stop_shared() {
            let api = SHARED.lock().unwrap_or_else(|p| p.into_inner()).take();
            drop(api);
        }
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(api) = shared.as_ref() {
            return api.clone();
        }
        crate::require_root();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let name = unique("k");
            let launched =
                Netns::create(name.clone()).and_then(|ns| Self::launch(Some(ns), name, true));
            let _ = tx.send(launched);
            loop {
                std::thread::park();
            }
        });
        let api = std::sync::Arc::new(
            rx.recv()
                .expect("the API server's thread")
                .unwrap_or_else(|e| panic!("{e}")),
        );
        // SAFETY: atexit takes a plain function; it runs once, after the tests, at exit.
        unsafe { libc::atexit(stop_shared) };
        *shared = Some(api.clone());
        api
    }

    /// In a namespace of its own; panics on failure.
    pub fn in_namespace() -> Self {
        crate::require_root();
        let name = unique("k");
        let ns = Netns::create(name.clone()).unwrap_or_else(|e| panic!("{e}"));
        Self::launch(Some(ns), name, true).unwrap_or_else(|e| panic!("{e}"))
    }

    /// etcd and the API server (in `ns` when given), up, with calix's CRDs established; files
    /// in `$TMPDIR/<name>`.
    pub fn launch(ns: Option<Netns>, name: String, watch_cache: bool) -> Result<Self> {
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("create {}", dir.display())))?;
        let (api_port, etcd_port, peer_port) = match &ns {
            Some(ns) => {
                ns.ip(&format!("addr add {NS_ADVERTISE}/32 dev lo"))?;
                (NS_API_PORT, 2379, 2380)
            }
            None => (free_port()?, free_port()?, free_port()?),
        };
        let api = Self {
            ns,
            dir,
            api_port,
            etcd_port,
            peer_port,
            watch_cache,
            etcd: Mutex::new(None),
            apiserver: Mutex::new(None),
            controllers: Mutex::new(Vec::new()),
            links: AtomicU32::new(0),
            agent_account: Mutex::new(false),
        };
        api.write_credentials()?;
        api.start_etcd()?;
        api.start_apiserver()?;
        let crds = crds_dir();
        api.apply_crds(&crds)?;
        Ok(api)
    }

    /// The admin kubeconfig for a client where the API server listens (the test process on
    /// loopback, or a thread inside [`KubeApi::ns`]).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// etcd's client URL (loopback only: inside a namespace it is that namespace's).
    pub fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.etcd_port)
    }

    /// Connects `node` to the API server's namespace by a veth pair and returns a kubeconfig
    /// for clients in `node` (the admin's credentials). Needs [`KubeApi::in_namespace`].
    pub fn wire(&self, node: &Netns) -> Result<PathBuf> {
        self.wire_as(node, ADMIN_TOKEN)
    }

    /// As [`KubeApi::wire`], the kubeconfig authenticating with `token` (e.g. a
    /// ServiceAccount's, [`KubeApi::service_account_token`]).
    pub fn wire_as(&self, node: &Netns, token: &str) -> Result<PathBuf> {
        let Some(ns) = &self.ns else {
            return Err(Error::Unexpected {
                what: "KubeApi::wire".into(),
                found: "an API server on the caller's loopback".into(),
                expected: "one in a namespace of its own (KubeApi::in_namespace)".into(),
            });
        };
        let i = self.links.fetch_add(1, Ordering::Relaxed) + 1;
        let host = format!("k{i}");
        veth(ns, &host, node, "kube0")?;
        ns.ip(&format!("addr add 10.97.{i}.1/30 dev {host}"))?;
        ns.ip(&format!("link set {host} up"))?;
        node.ip(&format!("addr add 10.97.{i}.2/30 dev kube0"))?;
        node.ip("link set kube0 up")?;
        // The address the API server advertises (the `kubernetes` Service's endpoint, see
        // [`KubeApi::serve_in_cluster`]) through this link, pods' traffic masqueraded as the
        // node's: the API server's namespace has no routes to the pools.
        node.ip(&format!(
            "route add {NS_ADVERTISE}/32 via 10.97.{i}.1 dev kube0"
        ))?;
        checked(&mut node.cmd(&[
            "iptables",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "kube0",
            "-j",
            "MASQUERADE",
        ]))?;
        let path = self.dir.join(format!("node{i}.kubeconfig"));
        self.write_kubeconfig(&path, &format!("10.97.{i}.1"), token)?;
        Ok(path)
    }

    /// Writes to `path` the kubeconfig `wired` (one [`KubeApi::wire`] wrote, the admin's)
    /// authenticating with `token` instead: a second identity on a node already wired (its
    /// kubelet as the admin, its agent as the agents' ServiceAccount).
    pub fn kubeconfig_as(&self, wired: &Path, token: &str, path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(wired)
            .map_err(Error::io(format!("read {}", wired.display())))?;
        let admin = format!("token: {ADMIN_TOKEN}\n");
        if !text.contains(&admin) {
            return Err(Error::Unexpected {
                what: wired.display().to_string(),
                found: "another token".into(),
                expected: "the admin's kubeconfig (KubeApi::wire)".into(),
            });
        }
        std::fs::write(path, text.replace(&admin, &format!("token: {token}\n")))
            .map_err(Error::io(format!("write {}", path.display())))
    }

    /// Runs `f` with an admin client on a thread where the API server is reachable (inside its
    /// namespace, or here), on a runtime of its own.
    pub fn with_client<T, F, Fut>(&self, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(kube::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        self.with_kubeconfig(self.kubeconfig(), f)
    }

    /// [`KubeApi::with_client`] with a client that authenticates with `token`.
    pub fn with_token<T, F, Fut>(&self, token: &str, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(kube::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let path = self.dir.join(format!("{}.kubeconfig", unique("t")));
        self.write_kubeconfig(&path, "127.0.0.1", token)
            .unwrap_or_else(|e| panic!("{e}"));
        self.with_kubeconfig(path, f)
    }

    fn with_kubeconfig<T, F, Fut>(&self, kubeconfig: PathBuf, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(kube::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let run = move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let client = client(&kubeconfig).await.unwrap_or_else(|e| panic!("{e}"));
                f(client).await
            })
        };
        match &self.ns {
            Some(ns) => ns.run(run),
            None => std::thread::spawn(run)
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p)),
        }
    }

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

    /// A ServiceAccount `namespace/name` bound (ClusterRoleBinding `name`) to the ClusterRole
    /// in the YAML file `cluster_role` (applied), and a token for it from the TokenRequest
    /// API bound to no object: it names no node (a ServiceAccount's Secret-style token; the
    /// chart's node-authority policy refuses every write made with it).
    pub fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
        cluster_role: &Path,
    ) -> Result<String> {
        self.service_account_with_role(namespace, name, cluster_role)?;
        self.token(namespace, name, None)
    }

    /// ServiceAccount `namespace/name` (created if absent).
    pub fn service_account(&self, namespace: &str, name: &str) -> Result<()> {
        self.apply(serde_json::json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": namespace}
        }))
        .map(drop)
    }

    /// The ServiceAccount `namespace/name` bound (ClusterRoleBinding `name`) to the ClusterRole
    /// in the YAML (or JSON) file `cluster_role`, all applied.
    pub fn service_account_with_role(
        &self,
        namespace: &str,
        name: &str,
        cluster_role: &Path,
    ) -> Result<()> {
        let text = std::fs::read_to_string(cluster_role)
            .map_err(Error::io(format!("read {}", cluster_role.display())))?;
        let role: serde_json::Value =
            serde_saphyr::from_str(&text).map_err(|e| Error::Unexpected {
                what: cluster_role.display().to_string(),
                found: e.to_string(),
                expected: "a ClusterRole".into(),
            })?;
        let role_name = role["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        self.apply(role)?;
        self.service_account(namespace, name)?;
        self.apply(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
        }))
        .map(drop)
    }

    /// Grants ServiceAccount `namespace/service_account` `rules` (RBAC rules as JSON): a
    /// ClusterRole and ClusterRoleBinding named `name`, or with `in_namespace` a Role and
    /// RoleBinding there.
    pub fn grant(
        &self,
        name: &str,
        in_namespace: Option<&str>,
        namespace: &str,
        service_account: &str,
        rules: Vec<serde_json::Value>,
    ) -> Result<()> {
        let (role, binding) = match in_namespace {
            Some(_) => ("Role", "RoleBinding"),
            None => ("ClusterRole", "ClusterRoleBinding"),
        };
        let meta = serde_json::json!({"name": name, "namespace": in_namespace});
        self.apply(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": role,
            "metadata": meta, "rules": rules,
        }))?;
        self.apply(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": binding,
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role, "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]
        }))
        .map(drop)
    }

    /// A token of ServiceAccount `namespace/name` (made with [`KubeApi::service_account`])
    /// for node `node`, as a node's agent has one: `bound` to a Pod of that ServiceAccount on
    /// the node (what the kubelet asks for a DaemonSet pod's projected token: the Pod
    /// `<name>-<node>` in `namespace`, [`KubeApi::pod_bound_token`]) or to the Node itself
    /// (made here when missing). Either way the API server puts the node's name in the user's
    /// `extra["authentication.kubernetes.io/node-name"]` (a pod's token even when its node has
    /// no Node object: v1.36.2 names the pod's `spec.nodeName`), and the token stops working
    /// when its Pod or Node is gone (a pod-bound one outlives its Node).
    pub fn node_token(
        &self,
        namespace: &str,
        name: &str,
        node: &str,
        bound: BoundTo,
    ) -> Result<String> {
        match bound {
            BoundTo::Node => {
                let node_obj = match self.get("v1", "Node", None, node)? {
                    Some(n) => n,
                    None => self.apply(serde_json::json!({
                        "apiVersion": "v1", "kind": "Node", "metadata": {"name": node}
                    }))?,
                };
                let reference = serde_json::json!({
                    "kind": "Node", "apiVersion": "v1", "name": node,
                    "uid": node_obj["metadata"]["uid"],
                });
                self.token(namespace, name, Some(reference))
            }
            BoundTo::Pod => self.pod_bound_token(namespace, name, &format!("{name}-{node}"), node),
        }
    }

    /// What the kubelet gives an agent's pod: a Pod `namespace/pod` of ServiceAccount
    /// `service_account` bound to node `node` (made here when absent: a stand-in, no container
    /// runs unless a kubelet serves the node), and a token bound to that Pod, which the API
    /// server binds to its node (the user's `authentication.kubernetes.io/node-name`). Valid
    /// while the Pod exists.
    pub fn pod_bound_token(
        &self,
        namespace: &str,
        service_account: &str,
        pod: &str,
        node: &str,
    ) -> Result<String> {
        let p = match self.get("v1", "Pod", Some(namespace), pod)? {
            Some(p) => p,
            None => self.apply(serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": namespace,
                    "labels": {"app.kubernetes.io/name": "calix-testbed-agent"}},
                "spec": {
                    "nodeName": node,
                    "serviceAccountName": service_account,
                    "automountServiceAccountToken": false,
                    "containers": [{"name": "agent", "image": "calix-testbed-agent"}],
                },
            }))?,
        };
        let reference = serde_json::json!({
            "kind": "Pod", "apiVersion": "v1", "name": pod, "uid": p["metadata"]["uid"],
        });
        self.token(namespace, service_account, Some(reference))
    }

    /// A token of ServiceAccount `namespace/name` from the TokenRequest API, bound to
    /// `bound` (a `boundObjectRef`: a Pod or a Node) when given; valid two hours.
    pub fn token(
        &self,
        namespace: &str,
        name: &str,
        bound: Option<serde_json::Value>,
    ) -> Result<String> {
        let path = format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token");
        self.with_client(move |c| async move {
            let mut spec = serde_json::json!({"expirationSeconds": 7200});
            if let Some(b) = bound {
                spec["boundObjectRef"] = b;
            }
            let body = serde_json::json!({
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec,
            });
            let req = http::Request::post(&path)
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body).unwrap_or_default())
                .map_err(|e| Error::Kube {
                    what: "token request".into(),
                    detail: e.to_string(),
                })?;
            let answer: serde_json::Value = c.request(req).await.map_err(|e| Error::Kube {
                what: format!("token for {path}"),
                detail: e.to_string(),
            })?;
            answer["status"]["token"]
                .as_str()
                .map(String::from)
                .ok_or_else(|| Error::Missing {
                    field: "status.token".into(),
                    value: answer.to_string(),
                })
        })
    }

    /// Who the API server says `token` is (a SelfSubjectReview): `status.userInfo`
    /// (`username`, `uid`, `groups`, `extra`).
    pub fn whoami(&self, token: &str) -> Result<serde_json::Value> {
        self.with_token(token, |c| async move {
            let body = serde_json::json!({
                "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview",
            });
            let req = http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body).unwrap_or_default())
                .map_err(|e| Error::Kube {
                    what: "self subject review".into(),
                    detail: e.to_string(),
                })?;
            let answer: serde_json::Value = c.request(req).await.map_err(|e| Error::Kube {
                what: "self subject review".into(),
                detail: e.to_string(),
            })?;
            Ok(answer["status"]["userInfo"].clone())
        })
    }

    /// A kubeconfig authenticating with `token` for a client where the API server listens
    /// (inside [`KubeApi::ns`], or here on loopback).
    pub fn kubeconfig_for(&self, token: &str) -> Result<PathBuf> {
        let path = self.dir.join(format!("{}.kubeconfig", unique("t")));
        self.write_kubeconfig(&path, "127.0.0.1", token)?;
        Ok(path)
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

    /// Stops the API server (SIGKILL: a crash); etcd keeps running.
    pub fn kill_apiserver(&self) {
        kill(&self.apiserver);
    }

    /// (Re)starts the API server and waits until it is ready.
    pub fn start_apiserver(&self) -> Result<()> {
        let log = self.dir.join("apiserver.log");
        let mut cmd = command_in(self.ns_path().as_deref(), kube_apiserver()?, None, true)?;
        let (bind, advertise) = match self.ns {
            Some(_) => ("0.0.0.0", NS_ADVERTISE),
            None => ("127.0.0.1", "127.0.0.1"),
        };
        let d = |f: &str| self.dir.join(f).display().to_string();
        cmd.arg(format!("--etcd-servers={}", self.etcd_url()))
            .arg(format!("--bind-address={bind}"))
            .arg(format!("--advertise-address={advertise}"))
            .arg(format!("--secure-port={}", self.api_port))
            .arg(format!("--cert-dir={}", d("certs")))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", d("sa.pub")))
            .arg(format!(
                "--service-account-signing-key-file={}",
                d("sa.key")
            ))
            .arg(format!("--token-auth-file={}", d("tokens.csv")))
            .arg("--authorization-mode=Node,RBAC")
            // What kubeadm and every CNI's DaemonSet need: privileged containers.
            .arg("--allow-privileged=true")
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            // No `kubernetes` Service endpoints (its address may be loopback here).
            .arg("--endpoint-reconciler-type=none")
            .arg(format!("--watch-cache={}", self.watch_cache));
        // Appended to across restarts.
        let prior = std::fs::read_to_string(&log).unwrap_or_default();
        let child = spawn_logged(&mut cmd, &log)?;
        let _ = std::fs::write(self.dir.join("apiserver.previous.log"), prior);
        *lock(&self.apiserver) = Some(child);
        self.wait_ready(&log)?;
        self.write_kubeconfig(&self.kubeconfig(), "127.0.0.1", ADMIN_TOKEN)
    }

    /// Starts kube-controller-manager (ServiceAccounts and their tokens, EndpointSlices,
    /// ReplicaSets, DaemonSets, the node lifecycle that lifts the not-ready taint; no node
    /// CIDRs) and kube-scheduler beside the API server, both with the admin's kubeconfig and
    /// no leader election, serving only on 127.0.0.1 of the API server's namespace. Returns
    /// once the controller-manager made the `default` ServiceAccount of `default`.
    pub fn start_controllers(&self) -> Result<()> {
        let kubeconfig = self.kubeconfig();
        let kc = kubeconfig.display().to_string();
        let d = |f: &str| self.dir.join(f).display().to_string();
        let mut kcm = command_in(
            self.ns_path().as_deref(),
            k8s_binary("kube-controller-manager")?,
            None,
            true,
        )?;
        kcm.arg(format!("--kubeconfig={kc}"))
            .arg(format!("--authentication-kubeconfig={kc}"))
            .arg(format!("--authorization-kubeconfig={kc}"))
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--cert-dir={}", d("kcm-certs")))
            .arg(format!(
                "--service-account-private-key-file={}",
                d("sa.key")
            ))
            .arg(format!("--root-ca-file={}", d("ca.crt")))
            .arg("--use-service-account-credentials=false")
            .arg("--allocate-node-cidrs=false")
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            .arg("--node-monitor-grace-period=20s")
            .arg("--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route");
        let mut sched = command_in(
            self.ns_path().as_deref(),
            k8s_binary("kube-scheduler")?,
            None,
            true,
        )?;
        sched
            .arg(format!("--kubeconfig={kc}"))
            .arg(format!("--authentication-kubeconfig={kc}"))
            .arg(format!("--authorization-kubeconfig={kc}"))
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1");
        {
            let mut children = self.controllers.lock().unwrap_or_else(|p| p.into_inner());
            children.push(spawn_logged(
                &mut kcm,
                &self.dir.join("controller-manager.log"),
            )?);
            children.push(spawn_logged(&mut sched, &self.dir.join("scheduler.log"))?);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let made = self.with_client(|c| async move {
                let api: Api<k8s_openapi::api::core::v1::ServiceAccount> =
                    Api::namespaced(c, "default");
                api.get_opt("default").await.ok().flatten().is_some()
            });
            if made {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "kube-controller-manager (the default ServiceAccount)".into(),
                    exited: None,
                    log: std::fs::read_to_string(self.dir.join("controller-manager.log"))
                        .unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// The `kubernetes` Service's endpoint (the API server runs with
    /// `--endpoint-reconciler-type=none`): an EndpointSlice to the advertised address, so that
    /// in-cluster clients (a DaemonSet's agent, through kube-proxy) reach the API server from
    /// nodes [`KubeApi::wire`]d to it. Needs [`KubeApi::in_namespace`].
    pub fn serve_in_cluster(&self) -> Result<()> {
        self.apply(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "namespace": "default", "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "calix-testbed",
            }},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [NS_ADVERTISE], "conditions": {"ready": true}}],
            "ports": [{"name": "https", "port": NS_API_PORT, "protocol": "TCP"}],
        }))
        .map(|_| ())
    }

    /// Restarts the API server (SIGKILL, then start); etcd and its data stay.
    pub fn restart_apiserver(&self) {
        self.kill_apiserver();
        self.start_apiserver().unwrap_or_else(|e| panic!("{e}"));
    }

    pub fn apiserver_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("apiserver.log")).unwrap_or_default()
    }

    fn ns_path(&self) -> Option<PathBuf> {
        self.ns.as_ref().map(|n| PathBuf::from(n.path()))
    }

    /// The service-account key pair and the token file.
    fn write_credentials(&self) -> Result<()> {
        let key = self.dir.join("sa.key");
        checked(
            std::process::Command::new("openssl")
                .args([
                    "ecparam",
                    "-name",
                    "prime256v1",
                    "-genkey",
                    "-noout",
                    "-out",
                ])
                .arg(&key),
        )?;
        checked(
            std::process::Command::new("openssl")
                .args(["ec", "-pubout", "-in"])
                .arg(&key)
                .arg("-out")
                .arg(self.dir.join("sa.pub")),
        )?;
        let tokens = self.dir.join("tokens.csv");
        std::fs::write(
            &tokens,
            format!("{ADMIN_TOKEN},calix-testbed-admin,calix-testbed-admin,\"system:masters\"\n"),
        )
        .map_err(Error::io(format!("write {}", tokens.display())))
    }

    fn start_etcd(&self) -> Result<()> {
        let log = self.dir.join("etcd.log");
        let client = self.etcd_url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = command_in(self.ns_path().as_deref(), "etcd", None, true)?;
        cmd.arg("--name=default")
            .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=default={peer}"));
        let child = spawn_logged(&mut cmd, &log)?;
        *lock(&self.etcd) = Some(child);
        Ok(())
    }

    /// Until `/readyz` says `ok` (etcd answering, the API server's own bootstrap done).
    fn wait_ready(&self, log: &Path) -> Result<()> {
        // The serving certificate appears once the server started: its CA goes in the
        // kubeconfigs.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = self.extract_ca().is_ok()
                && self
                    .write_kubeconfig(&self.kubeconfig(), "127.0.0.1", ADMIN_TOKEN)
                    .is_ok()
                && self.with_client(|c| async move {
                    let req = http::Request::get("/readyz")
                        .body(Vec::new())
                        .expect("request");
                    matches!(
                        tokio::time::timeout(Duration::from_secs(2), c.request_text(req)).await,
                        Ok(Ok(body)) if body.trim() == "ok"
                    )
                });
            if ready {
                return Ok(());
            }
            let exited = lock(&self.apiserver)
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "kube-apiserver".into(),
                    exited,
                    log: std::fs::read_to_string(log).unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The CA of the API server's self-made certificate (the second certificate of its
    /// `apiserver.crt`), as `ca.crt`.
    fn extract_ca(&self) -> Result<()> {
        let bundle = self.dir.join("certs").join("apiserver.crt");
        let text = std::fs::read_to_string(&bundle)
            .map_err(Error::io(format!("read {}", bundle.display())))?;
        const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
        let ca = text
            .match_indices(BEGIN)
            .nth(1)
            .map(|(i, _)| &text[i..])
            .ok_or_else(|| Error::Missing {
                field: "the CA certificate".into(),
                value: bundle.display().to_string(),
            })?;
        let path = self.dir.join("ca.crt");
        std::fs::write(&path, ca).map_err(Error::io(format!("write {}", path.display())))
    }

    fn write_kubeconfig(&self, path: &Path, host: &str, token: &str) -> Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: calix-test\n  cluster:\n    server: https://{host}:{port}\n    certificate-authority: {ca}\n    tls-server-name: {TLS_NAME}\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: calix-test\n  context:\n    cluster: calix-test\n    user: admin\ncurrent-context: calix-test\n",
            port = self.api_port,
            ca = self.dir.join("ca.crt").display(),
        );
        std::fs::write(path, text).map_err(Error::io(format!("write {}", path.display())))
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

impl Drop for KubeApi {
    fn drop(&mut self) {
        for mut c in
            std::mem::take(&mut *self.controllers.lock().unwrap_or_else(|p| p.into_inner()))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
        kill(&self.apiserver);
        kill(&self.etcd);
        if std::thread::panicking() {
            let log = self.apiserver_log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!(
                "--- last lines of kube-apiserver's log ({}) ---",
                self.dir.display()
            );
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A client from a kubeconfig file.
pub async fn client(kubeconfig: &Path) -> Result<kube::Client> {
    let err = |e: String| Error::Kube {
        what: format!("kubeconfig {}", kubeconfig.display()),
        detail: e,
    };
    let file = kube::config::Kubeconfig::read_from(kubeconfig).map_err(|e| err(e.to_string()))?;
    let cfg = kube::Config::from_custom_kubeconfig(file, &Default::default())
        .await
        .map_err(|e| err(e.to_string()))?;
    kube::Client::try_from(cfg).map_err(|e| err(e.to_string()))
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

fn lock(m: &Mutex<Option<Child>>) -> std::sync::MutexGuard<'_, Option<Child>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn kill(m: &Mutex<Option<Child>>) {
    if let Some(mut c) = lock(m).take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(Error::io("bind 127.0.0.1:0"))?;
    Ok(l.local_addr().map_err(Error::io("local addr"))?.port())
}

/// The workspace's root (this crate is `<root>/testbed`).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testbed/ has a parent")
        .to_path_buf()
}

/// Where calix's CRDs are: `charts/calix/crds/`.
pub fn crds_dir() -> PathBuf {
    workspace_root().join("charts/calix/crds")
}

/// The shared Kubernetes binaries: `$CALIX_K8S_BIN_DIR`, else `<root>/../shared/k8s/bin`.
fn shared_bin_dir() -> PathBuf {
    std::env::var_os("CALIX_K8S_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/k8s/bin"))
}

/// `target/k8s/kube-apiserver`, decompressed from the shared `.xz` when missing or not from
/// the `.xz` whose checksum `SHA256SUMS` lists (checked first).
pub fn kube_apiserver() -> Result<PathBuf> {
    k8s_binary("kube-apiserver")
}

/// A shared Kubernetes binary (`kube-apiserver`, `kubelet`...), decompressed into
/// `target/k8s/` once its `.xz` matches `SHA256SUMS`.
pub fn k8s_binary(name: &str) -> Result<PathBuf> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let shared = shared_bin_dir();
    let xz = shared.join(format!("{name}.xz"));
    let sums = shared.join("SHA256SUMS");
    let sums_text = std::fs::read_to_string(&sums).map_err(Error::io(format!(
        "read {} (the shared Kubernetes binaries)",
        sums.display()
    )))?;
    let want = sums_text
        .lines()
        .filter_map(|l| l.split_once("  "))
        .find(|(_, f)| f.trim() == format!("{name}.xz"))
        .map(|(sum, _)| sum.trim().to_string())
        .ok_or_else(|| Error::Missing {
            field: format!("{name}.xz"),
            value: sums.display().to_string(),
        })?;
    let cache = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("k8s");
    let bin = cache.join(name);
    let stamp = cache.join(format!("{name}.sha256"));
    if bin.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        return Ok(bin);
    }
    let data = std::fs::read(&xz).map_err(Error::io(format!("read {}", xz.display())))?;
    use sha2::Digest;
    let got: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if got != want {
        return Err(Error::Unexpected {
            what: xz.display().to_string(),
            found: format!("SHA-256 {got}"),
            expected: format!("{want} (SHA256SUMS)"),
        });
    }
    std::fs::create_dir_all(&cache).map_err(Error::io(format!("create {}", cache.display())))?;
    let tmp = cache.join(format!(".{name}.{}", std::process::id()));
    let out =
        std::fs::File::create(&tmp).map_err(Error::io(format!("create {}", tmp.display())))?;
    let status = std::process::Command::new("xz")
        .arg("-dc")
        .arg(&xz)
        .stdout(out)
        .status()
        .map_err(|source| Error::Spawn {
            cmd: "xz -dc (apt-get install xz-utils; cargo xtask setup does)".into(),
            source,
        })?;
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Unexpected {
            what: format!("xz -dc {}", xz.display()),
            found: status.to_string(),
            expected: "success".into(),
        });
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(Error::io(format!("chmod {}", tmp.display())))?;
    std::fs::rename(&tmp, &bin).map_err(Error::io(format!("rename to {}", bin.display())))?;
    std::fs::write(&stamp, &want).map_err(Error::io(format!("write {}", stamp.display())))?;
    Ok(bin)
}
