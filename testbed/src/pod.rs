//! A test pod: a namespace wired through `calix` ADD on a node, DEL on drop.
use serde_json::Value;

use crate::cni::{plugin_call, CniOutput};
use crate::netns::Netns;
use crate::node::Node;
use crate::{Error, Result};

/// A pod: a namespace wired through `calix` ADD on a node. DEL runs on drop if not done.
pub struct Pod<'a> {
    pub ns: Netns,
    pub node: &'a Node,
    pub container_id: String,
    /// CNI_IFNAME (`eth0` unless added with [`Pod::try_add_as`]).
    pub ifname: String,
    pub cni_args: String,
    /// Extra network-config keys this pod was added with (used again for DEL).
    pub extra: Value,
    pub result: CniOutput,
    deleted: bool,
}
impl<'a> Pod<'a> {
    /// ADDs a pod named `name` in k8s namespace `default`; panics if ADD fails.
    pub fn add(node: &'a Node, name: &str) -> Self {
        Self::add_with(node, name, Value::Null)
    }

    /// ADDs with extra network-config keys; panics if ADD fails.
    pub fn add_with(node: &'a Node, name: &str, extra: Value) -> Self {
        let pod = Self::try_add(node, name, extra);
        assert!(
            pod.result.success,
            "ADD of {name} failed: {}\n{}\nagent log:\n{}",
            pod.result.stdout,
            pod.result.stderr,
            node.agent_log()
        );
        pod
    }

    /// ADDs with extra network-config keys; the result may be a failure.
    pub fn try_add(node: &'a Node, name: &str, extra: Value) -> Self {
        let ns = Netns::new("p");
        let pod_name = format!("{name}-{}", ns.name);
        Self::try_add_in(node, ns, &pod_name, "eth0", extra)
    }

    /// ADDs a new sandbox (its own namespace and container ID) of the Kubernetes pod
    /// `default/<pod_name>` exactly, on interface `ifname`; the result may be a failure. Two
    /// calls with the same name are the same pod recreated.
    pub fn try_add_as(node: &'a Node, pod_name: &str, ifname: &str, extra: Value) -> Self {
        Self::try_add_in(node, Netns::new("p"), pod_name, ifname, extra)
    }

    /// ADDs one more attachment (`ifname`) of this pod's sandbox: same namespace, container
    /// ID and pod name. The returned pod shares the namespace, which stays with `self`.
    pub fn try_attach(&self, ifname: &str, extra: Value) -> Pod<'a> {
        let mut pod = Pod {
            ns: Netns::borrowed(&self.ns.name),
            node: self.node,
            container_id: self.container_id.clone(),
            ifname: ifname.to_string(),
            cni_args: self.cni_args.clone(),
            extra,
            result: CniOutput::default(),
            deleted: true,
        };
        pod.result = pod.call("ADD", Value::Null);
        pod.deleted = !pod.result.success;
        pod
    }

    /// ADDs the Kubernetes pod `default/<pod_name>` in `ns` (a namespace the caller named,
    /// e.g. the demo's); an error with the plugin's output when ADD fails.
    pub fn launch(node: &'a Node, ns: Netns, pod_name: &str, extra: Value) -> Result<Self> {
        let pod = Self::try_add_in(node, ns, pod_name, "eth0", extra);
        if !pod.result.success {
            return Err(Error::Unexpected {
                what: format!("CNI ADD of {pod_name} on {}", node.ns.name),
                found: format!("{}\n{}", pod.result.stdout.trim(), pod.result.stderr.trim()),
                expected: "a result with the pod's addresses".into(),
            });
        }
        Ok(pod)
    }

    /// ADDs a sandbox of the Kubernetes pod `namespace/name` with UID `uid` (as a kubelet
    /// does: every K8S_POD_* argument); panics if ADD fails.
    pub fn add_k8s(node: &'a Node, namespace: &str, name: &str, uid: &str, extra: Value) -> Self {
        let pod = Self::try_add_k8s(node, namespace, name, uid, extra);
        assert!(
            pod.result.success,
            "ADD of {namespace}/{name} failed: {}\n{}\nagent log:\n{}",
            pod.result.stdout,
            pod.result.stderr,
            node.agent_log()
        );
        pod
    }

    /// [`Pod::add_k8s`]; the result may be a failure.
    pub fn try_add_k8s(
        node: &'a Node,
        namespace: &str,
        name: &str,
        uid: &str,
        extra: Value,
    ) -> Self {
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_UID={uid}"
        );
        Self::try_add_with_args(node, Netns::new("p"), args, "eth0", extra)
    }

    fn try_add_in(node: &'a Node, ns: Netns, pod_name: &str, ifname: &str, extra: Value) -> Self {
        let cni_args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod_name}");
        Self::try_add_with_args(node, ns, cni_args, ifname, extra)
    }

    fn try_add_with_args(
        node: &'a Node,
        ns: Netns,
        cni_args: String,
        ifname: &str,
        extra: Value,
    ) -> Self {
        let container_id = format!("{}{}", ns.name, "0123456789abcdef");
        let mut pod = Self {
            ns,
            node,
            container_id,
            ifname: ifname.to_string(),
            cni_args,
            extra,
            result: CniOutput::default(),
            deleted: true,
        };
        pod.result = pod.call("ADD", Value::Null);
        pod.deleted = !pod.result.success;
        pod
    }

    pub fn ip(&self) -> String {
        self.result.ip()
    }

    /// Every address of the ADD result, without prefix.
    pub fn ips(&self) -> Vec<String> {
        self.result
            .json
            .as_ref()
            .and_then(|j| j["ips"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|i| i["address"].as_str())
            .map(|a| a.split('/').next().unwrap_or(a).to_string())
            .collect()
    }

    pub fn host_ifname(&self) -> String {
        self.result
            .json
            .as_ref()
            .and_then(|j| j["interfaces"][0]["name"].as_str().map(String::from))
            .expect("host ifname")
    }

    /// Runs a verb for this pod with its config (plus `more` keys, e.g. prevResult).
    pub fn call(&self, command: &str, more: Value) -> CniOutput {
        let mut conf = self.node.conf(self.extra.clone());
        if let (Some(c), Some(m)) = (conf.as_object_mut(), more.as_object()) {
            for (k, v) in m {
                c.insert(k.clone(), v.clone());
            }
        }
        // The plugin built with the node's agent (release binaries for a bench).
        plugin_call(
            &self.node.ns,
            &self.node.agent().spec.bins.join("calix"),
            command,
            &self.container_id,
            &self.ns.path(),
            &self.ifname,
            &self.cni_args,
            &conf.to_string(),
        )
    }

    /// CHECK with the ADD result as prevResult.
    pub fn check(&self) -> CniOutput {
        let prev = self.result.json.clone().unwrap_or(Value::Null);
        self.call("CHECK", serde_json::json!({ "prevResult": prev }))
    }

    /// DELs the pod; panics if DEL fails.
    pub fn del(&mut self) {
        self.try_del().unwrap_or_else(|e| panic!("{e}"));
    }

    /// DELs the pod; an error with the plugin's output when DEL fails.
    pub fn try_del(&mut self) -> Result<()> {
        let out = self.call("DEL", Value::Null);
        if !out.success {
            return Err(Error::Unexpected {
                what: format!("CNI DEL of {}", self.container_id),
                found: format!("{} {}", out.stdout.trim(), out.stderr.trim()),
                expected: "success".into(),
            });
        }
        self.deleted = true;
        Ok(())
    }
}

impl Drop for Pod<'_> {
    fn drop(&mut self) {
        if !self.deleted {
            let _ = self.call("DEL", Value::Null);
        }
    }
}
