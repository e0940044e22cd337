//! ServiceAccounts, their roles, and their tokens from the TokenRequest API (bound to nothing,
//! to a Pod or to a Node); who a token is.
use std::path::Path;

use super::{BoundTo, KubeApi};
use crate::{Error, Result};

impl KubeApi {
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
}
