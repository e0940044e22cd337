//! The agents' ServiceAccount as the chart makes it, in a test API server: the chart's
//! ClusterRole (`charts/calix/files/rbac/`) and its node authority (`charts/calix/files/
//! authority/`: one ValidatingAdmissionPolicy and binding per kind of calix record, keyed on the
//! node a ServiceAccount token is bound to), built here exactly as `templates/clusterrole.yaml`
//! and `templates/authority.yaml` render them (tests/tests/chart.rs compares the two), and
//! tokens bound to a node for it ([`KubeApi::agent_token`]).
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::k8s::BoundTo;
use crate::{Error, KubeApi, Result};

/// The namespace and name of the agents' ServiceAccount in the test bed.
pub const AGENT_NAMESPACE: &str = "kube-system";
pub const AGENT_SERVICE_ACCOUNT: &str = "calix-agent";

/// The chart's directory, `charts/calix`.
fn chart_dir() -> PathBuf {
    crate::k8s::crds_dir()
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn read_yaml(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).map_err(Error::io(format!("read {}", path.display())))?;
    serde_saphyr::from_str(&text).map_err(|e| Error::Unexpected {
        what: path.display().to_string(),
        found: e.to_string(),
        expected: "YAML".into(),
    })
}

/// The chart's ClusterRole for the agents with the kubernetes datastore, named `name`: the
/// rules of `files/rbac/agent.yaml` and `files/rbac/kubernetes-datastore.yaml`.
pub fn cluster_role(name: &str) -> Result<Value> {
    let rbac = chart_dir().join("files/rbac");
    let mut rules: Vec<Value> = Vec::new();
    for file in ["agent.yaml", "kubernetes-datastore.yaml"] {
        match read_yaml(&rbac.join(file))? {
            Value::Array(part) => rules.extend(part),
            other => {
                return Err(Error::Unexpected {
                    what: file.into(),
                    found: other.to_string(),
                    expected: "a list of rules".into(),
                })
            }
        }
    }
    Ok(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name}, "rules": rules,
    }))
}

/// The node authority's objects as `templates/authority.yaml` renders them for the release
/// whose objects are named `fullname`, its agents' ServiceAccount `sa_namespace/sa_name` and
/// the bindings' `validation_actions`: for each file of `files/authority/` but `common.yaml`
/// (in name order, as Helm's `Files.Glob` goes), a ValidatingAdmissionPolicy
/// `<fullname>-<file>` and its binding. Only `apiVersion`, `kind`, `metadata.name` and `spec`
/// (the chart adds its labels).
pub fn node_authority(
    fullname: &str,
    sa_namespace: &str,
    sa_name: &str,
    validation_actions: &[&str],
) -> Result<Vec<Value>> {
    let dir = chart_dir().join("files/authority");
    let common = read_yaml(&dir.join("common.yaml"))?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(Error::io(format!("read {}", dir.display())))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"))
        .filter(|p| p.file_name().and_then(|n| n.to_str()) != Some("common.yaml"))
        .collect();
    files.sort();
    let user = format!("system:serviceaccount:{sa_namespace}:{sa_name}");
    let list = |v: &Value, k: &str| v[k].as_array().cloned().unwrap_or_default();
    let mut out = Vec::new();
    for path in files {
        let rules = read_yaml(&path)?;
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let name = format!("{fullname}-{stem}");
        let variables = [list(&common, "variables"), list(&rules, "variables")].concat();
        let validations = [list(&common, "validations"), list(&rules, "validations")].concat();
        let mut spec = json!({
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["calix.dev"],
                "apiVersions": ["v1"],
                "operations": rules["operations"],
                "resources": [rules["resource"]],
            }]},
            "matchConditions": [{
                "name": "the-agents-service-account",
                "expression": format!("request.userInfo.username == {}", Value::from(user.clone())),
            }],
            "variables": variables,
            "validations": validations,
        });
        if !rules["paramKind"].is_null() {
            spec["paramKind"] = rules["paramKind"].clone();
        }
        out.push(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": spec,
        }));
        let mut binding = json!({"policyName": name, "validationActions": validation_actions});
        if !rules["paramRef"].is_null() {
            binding["paramRef"] = rules["paramRef"].clone();
        }
        out.push(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": binding,
        }));
    }
    Ok(out)
}

/// A schema-valid record of each kind the node authority guards, named `name` (a dry-run probe).
fn probe_objects(name: &str) -> Vec<Value> {
    let object = |kind: &str, spec: Value| {
        json!({
            "apiVersion": "calix.dev/v1", "kind": kind,
            "metadata": {"name": name, "annotations": {"calix.dev/key": format!("nodes/{name}")}},
            "spec": spec,
        })
    };
    vec![
        object("CalixNode", json!({"name": name})),
        object(
            "IPAMBlock",
            json!({"cidr": "10.255.255.0/26", "affinity": name, "allocations": {}, "next_seq": 1}),
        ),
        object("IPAMHandle", json!({"node": name, "addresses": []})),
        object(
            "BlockAffinity",
            json!({"node": name, "cidr": "10.255.255.0/26"}),
        ),
        object(
            "CalixEndpoint",
            json!({"container_id": "c", "ifname": "eth0", "host_ifname": "cali0", "netns": "",
                "pod_namespace": "", "pod_name": "", "addresses": [], "handle": "h"}),
        ),
    ]
}

impl KubeApi {
    /// The agents' ServiceAccount `kube-system/calix-agent` as the chart makes it: bound to the
    /// chart's ClusterRole alone and guarded by the chart's node authority (Deny), which this
    /// waits for until the API server enforces it on every kind (a dry-run write with a token
    /// bound to no node is refused by rule node-identity). Once per API server.
    pub fn calix_agent(&self) -> Result<()> {
        let mut done = self.agent_account.lock().unwrap_or_else(|p| p.into_inner());
        if *done {
            return Ok(());
        }
        let role = self.dir.join("calix-agent-clusterrole.json");
        std::fs::write(&role, cluster_role(AGENT_SERVICE_ACCOUNT)?.to_string())
            .map_err(Error::io(format!("write {}", role.display())))?;
        self.service_account_with_role(AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT, &role)?;
        for object in node_authority(
            AGENT_SERVICE_ACCOUNT,
            AGENT_NAMESPACE,
            AGENT_SERVICE_ACCOUNT,
            &["Deny"],
        )? {
            self.apply(object)?;
        }
        self.wait_enforced()?;
        *done = true;
        Ok(())
    }

    /// A token of the agents' ServiceAccount ([`KubeApi::calix_agent`]) for node `node`, bound
    /// to a Pod on it as a DaemonSet pod's is ([`KubeApi::node_token`]).
    pub fn agent_token(&self, node: &str) -> Result<String> {
        self.agent_token_bound(node, BoundTo::Pod)
    }

    /// [`KubeApi::agent_token`] bound to `bound`: [`BoundTo::Node`] where a kubelet serves the
    /// node (it would try to run a pod made for the binding).
    pub fn agent_token_bound(&self, node: &str, bound: BoundTo) -> Result<String> {
        self.calix_agent()?;
        self.node_token(AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT, node, bound)
    }

    /// Until a dry-run create of every kind, with a token of the agents' ServiceAccount bound
    /// to no node, is refused by rule node-identity (the API server loads policies a moment
    /// after they are written).
    fn wait_enforced(&self) -> Result<()> {
        let role = self.dir.join("calix-agent-clusterrole.json");
        let unbound = self.service_account_token(AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT, &role)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answers = self.with_token(&unbound, |c| async move {
                let mut answers = Vec::new();
                for o in probe_objects("calix-testbed-probe") {
                    let kind = o["kind"].as_str().unwrap_or_default().to_string();
                    let gvk = kube::api::GroupVersionKind::gvk("calix.dev", "v1", &kind);
                    let api: kube::Api<kube::api::DynamicObject> =
                        kube::Api::all_with(c.clone(), &kube::api::ApiResource::from_gvk(&gvk));
                    let obj: kube::api::DynamicObject =
                        serde_json::from_value(o).unwrap_or_else(|e| panic!("probe object: {e}"));
                    let pp = kube::api::PostParams {
                        dry_run: true,
                        ..Default::default()
                    };
                    let answer = match api.create(&pp, &obj).await {
                        Ok(_) => "admitted".to_string(),
                        Err(kube::Error::Api(s)) => format!("{} {}", s.code, s.message),
                        Err(e) => e.to_string(),
                    };
                    answers.push((kind, answer));
                }
                answers
            });
            let pending: Vec<&(String, String)> = answers
                .iter()
                .filter(|(_, a)| !(a.starts_with("403") && a.contains("(rule node-identity)")))
                .collect();
            if pending.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::Unexpected {
                    what: "the node authority".into(),
                    found: format!("{pending:?}"),
                    expected: "every kind refused by rule node-identity within 30 s".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The lines of an agent's log that report a write the node authority refused (an agent
/// writing only its own records has none). A policy the API server could not configure yet
/// (just restarted, its parameters' kind not discovered: "failed to configure policy") judged
/// nothing; the agent retries that write, so it is not a refusal.
pub fn refusals(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            l.contains("ValidatingAdmissionPolicy") && !l.contains("failed to configure policy")
        })
        .collect()
}
