//! calix nodes in Kubernetes mode on this API server, and the objects they serve: Node and
//! Namespace objects, IPPools, and pods wired by the real CNI plugin through the agent with
//! their Pod objects (what the kubelet would write), shared by the tests and the benches.
use std::time::Duration;

use serde_json::{json, Value};

use super::KubeApi;
use crate::{wait_for, Error, Node, Pod, Result};

/// An IPPool `name` of `cidr` (blocks of /28, IPv6 /124: 16 addresses) for the nodes
/// `selector` selects.
pub fn ippool(name: &str, cidr: &str, selector: Value) -> Value {
    let block = if cidr.contains(':') { 124 } else { 28 };
    json!({
        "apiVersion": "calix.dev/v1",
        "kind": "IPPool",
        "metadata": {"name": name},
        "spec": {"cidr": cidr, "blockSize": block, "nodeSelector": selector},
    })
}

impl KubeApi {
    /// `node` (not started) made a Kubernetes-mode node of this API server: its agent reads
    /// the datastore through a kubeconfig of its own, authenticated with `token` (by default
    /// the agents' ServiceAccount bound to a pod on the node, as a DaemonSet pod's), named
    /// only by `CALIX_NODE_NAME` (no `--node-name`), `extra` config appended after
    /// `[datastore]`.
    pub fn kubernetes_node(&self, node: Node, token: Option<&str>, extra: &str) -> Result<Node> {
        let token = match token {
            Some(t) => t.to_string(),
            None => self.agent_token(&node.ns.name)?,
        };
        let kubeconfig = self.wire_as(&node.ns, &token)?;
        let mut node = node.with_config(&format!(
            "[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"{}\"\ntimeout_ms = 5000\nattempts = 40\n{extra}",
            kubeconfig.display()
        ));
        let name = node.ns.name.clone();
        let spec = &mut node.agent_mut().spec;
        spec.node_name_flag = false;
        spec.env = vec![("CALIX_NODE_NAME".into(), name)];
        Ok(node)
    }

    /// Applies Node `name` with `labels` and `addresses` (type, address) in its status.
    pub fn node_object(&self, name: &str, labels: Value, addresses: &[(&str, &str)]) -> Result<()> {
        let meta = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
        let mut object = meta.clone();
        object["metadata"]["labels"] = labels;
        self.apply(object)?;
        let addresses: Vec<Value> = addresses
            .iter()
            .map(|(t, a)| json!({"type": t, "address": a}))
            .collect();
        self.patch_status(meta, json!({ "addresses": addresses }))
    }

    /// Applies Namespace `name` with `labels` and `annotations`.
    pub fn namespace(&self, name: &str, labels: Value, annotations: Value) -> Result<()> {
        self.apply(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
        }))
        .map(drop)
    }

    /// `node` with a Node object labelled `calix.dev/test: tag` at InternalIP `ip`, an IPPool
    /// `cidr` of its own (one CIDR in two IPPools stops every agent reading them), its agent
    /// started and allocating from that pool.
    pub fn started_with_pool(&self, node: Node, tag: &str, cidr: &str, ip: &str) -> Result<Node> {
        self.started_with_pools(node, tag, &[cidr], &[ip])
    }

    /// As [`KubeApi::started_with_pool`], with an InternalIP of each of `ips` and an IPPool of
    /// each of `cidrs` (the first named `tag`, the others `tag-1`, `tag-2`...): a dual-stack
    /// node with an address and a pool of each family.
    pub fn started_with_pools(
        &self,
        node: Node,
        tag: &str,
        cidrs: &[&str],
        ips: &[&str],
    ) -> Result<Node> {
        let addresses: Vec<(&str, &str)> = ips.iter().map(|ip| ("InternalIP", *ip)).collect();
        self.node_object(&node.ns.name, json!({"calix.dev/test": tag}), &addresses)?;
        for (i, cidr) in cidrs.iter().enumerate() {
            let name = match i {
                0 => tag.to_string(),
                i => format!("{tag}-{i}"),
            };
            self.apply(ippool(&name, cidr, json!({"calix.dev/test": tag})))?;
        }
        node.agent().start(&[])?;
        wait_pools(&node, cidrs);
        Ok(node)
    }

    /// Pod `namespace/name` labelled `labels` on `node`: its Pod object, its network through
    /// the CNI plugin and the agent, and its address in the Pod's status (as the kubelet
    /// writes it).
    /// A pod named `<name>-<node>` in `default` on `node`, with its Pod object (what a
    /// kubelet's pod has: the agent's NetworkPolicy isolates a pod it has no object of), wired
    /// by the CNI plugin; panics when that fails. For tests of other things than policy.
    pub fn node_pod<'a>(&self, node: &'a Node, name: &str) -> Pod<'a> {
        let name = format!("{name}-{}", node.ns.name);
        self.running_pod(node, "default", &name, serde_json::json!({}))
            .unwrap_or_else(|e| panic!("pod {name}: {e}"))
    }

    pub fn running_pod<'a>(
        &self,
        node: &'a Node,
        namespace: &str,
        name: &str,
        labels: Value,
    ) -> Result<Pod<'a>> {
        self.running_pod_with(node, namespace, name, labels, Value::Null)
    }

    /// As [`KubeApi::running_pod`], `extra` merged into the CNI ADD's network config (e.g.
    /// `{"ipam": {"type": "calix-ipam", "assign_ipv6": true}}`: an address of each family,
    /// both in the Pod's status).
    pub fn running_pod_with<'a>(
        &self,
        node: &'a Node,
        namespace: &str,
        name: &str,
        labels: Value,
        extra: Value,
    ) -> Result<Pod<'a>> {
        // (No controller-manager makes the namespace's default ServiceAccount, which admission
        // wants.)
        self.apply(json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "default", "namespace": namespace},
        }))?;
        let meta = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace}});
        let mut pod = meta.clone();
        pod["metadata"]["labels"] = labels;
        pod["spec"] =
            json!({"nodeName": node.ns.name, "containers": [{"name": "c", "image": "pause"}]});
        let made = self.apply(pod)?;
        let uid = made["metadata"]["uid"]
            .as_str()
            .ok_or_else(|| Error::Kube {
                what: format!("pod {namespace}/{name}"),
                detail: "no UID in the API server's answer".into(),
            })?
            .to_string();
        let p = Pod::try_add_k8s(node, namespace, name, &uid, extra);
        if !p.result.success {
            return Err(Error::Kube {
                what: format!("CNI ADD of {namespace}/{name}"),
                detail: p.result.stdout.clone(),
            });
        }
        let ips: Vec<Value> = p.ips().into_iter().map(|ip| json!({ "ip": ip })).collect();
        self.patch_status(meta, json!({"podIP": p.ip(), "podIPs": ips}))?;
        Ok(p)
    }
}

/// Waits until the pools `node`'s agent allocates from (the enabled ones its node selects) are
/// `want`; panics with its log after 30 s.
pub fn wait_pools(node: &Node, want: &[&str]) {
    wait_for(
        &format!("the agent allocates from {want:?}"),
        Duration::from_secs(30),
        || {
            let show = node.agent().calixctl_json(&["ipam", "show"]).ok()?;
            let pools: Vec<String> = show["pools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["disabled"] == false)
                .filter_map(|p| p["cidr"].as_str().map(String::from))
                .collect();
            let mut want: Vec<&str> = want.to_vec();
            let mut pools: Vec<&str> = pools.iter().map(String::as_str).collect();
            want.sort_unstable();
            pools.sort_unstable();
            (pools == want).then_some(())
        },
        || node.agent_log(),
    );
}
