//! What the Services tests share: a cgroup of the test's own for the socket programs, a
//! Kubernetes node whose agent translates Services, pods on it.
use std::path::PathBuf;

use calix_testbed::{unique, Dataplane, KubeApi, Node, Pod};
use serde_json::{json, Value};

/// A cgroup of this test's own on the v2 hierarchy, removed when dropped (its processes have
/// exited by then).
pub struct TestCgroup(pub PathBuf);

impl TestCgroup {
    pub fn new(tag: &str) -> Self {
        let hybrid = PathBuf::from("/sys/fs/cgroup/unified");
        let root = if hybrid.join("cgroup.procs").exists() {
            hybrid
        } else {
            PathBuf::from("/sys/fs/cgroup")
        };
        let dir = root.join(tag);
        std::fs::create_dir_all(&dir).expect("create the test cgroup");
        Self(dir)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// What each test runs on: a node whose agent translates Services for the processes of a
/// cgroup of the test's own, started with a pool of `cidr` and its Node object's `address`,
/// and a namespace for the test's objects. Bound `let Bed { cg, node, .. }`: the node goes
/// first (bindings are dropped in reverse), then the cgroup.
pub struct Bed {
    pub cg: TestCgroup,
    pub node: Node,
    pub tag: String,
    pub ns: String,
}

impl Bed {
    pub fn new(api: &KubeApi, tag: &str, cidr: &str, address: &str) -> Self {
        Self::wired(api, tag, &[cidr], &[address], |_| {}, "")
    }

    /// As [`Bed::new`] with a pool of each of `cidrs` and an address of each of `addresses`
    /// (a dual-stack node: one of each family), `wire` called on the node before its agent
    /// starts, `top` (top-level keys) put first in its config.
    pub fn wired(
        api: &KubeApi,
        tag: &str,
        cidrs: &[&str],
        addresses: &[&str],
        wire: impl FnOnce(&Node),
        top: &str,
    ) -> Self {
        let u = unique(tag);
        let cg = TestCgroup::new(&u);
        let node = api
            .kubernetes_node(
                Node::create(Dataplane::Ebpf, None),
                None,
                &format!(
                    "[services]\nenabled = true\ntranslate = true\ncgroup = \"{}\"\n",
                    cg.0.display()
                ),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        let config = node.agent().spec.config.clone().unwrap_or_default();
        let node = node.with_config(&format!("{top}{config}"));
        wire(&node);
        let node = api
            .started_with_pools(node, &u, cidrs, addresses)
            .unwrap_or_else(|e| panic!("{e}"));
        let ns = format!("{u}-svc");
        api.namespace(&ns, json!({}), json!({}))
            .unwrap_or_else(|e| panic!("{e}"));
        Self {
            cg,
            node,
            tag: u,
            ns,
        }
    }
}

/// Pod `name` of namespace `ns` on `node`, Running (labelled `app: <name>`).
pub fn running<'a>(api: &KubeApi, node: &'a Node, ns: &str, name: &str) -> Pod<'a> {
    api.running_pod(node, ns, name, json!({"app": name}))
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()))
}

/// The cluster IP of Service object `svc`.
pub fn cluster_ip(svc: &Value) -> String {
    svc["spec"]["clusterIP"]
        .as_str()
        .expect("a cluster IP")
        .to_string()
}

/// The counters (connections, refused) of the first frontend of `calixctl services -o json`'s
/// first row (`r`) that `which` picks.
pub fn frontend_counters(r: &Value, which: impl Fn(&Value) -> bool) -> (u64, u64) {
    let row = &r["list"][0];
    let fronts = row["frontends"].as_array().expect("frontends");
    let i = fronts
        .iter()
        .position(|f| which(&f["frontend"]))
        .unwrap_or_else(|| panic!("no such frontend: {r}"));
    let c = &row["counters"][i];
    (
        c["connections"].as_u64().unwrap_or(0),
        c["refused"].as_u64().unwrap_or(0),
    )
}

/// The detail of the `Service` step of `calixctl trace -o json`'s report `trace`.
pub fn service_step(trace: &Value) -> String {
    trace["steps"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["stage"] == "Service"))
        .unwrap_or_else(|| panic!("no Service step: {trace}"))["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}
