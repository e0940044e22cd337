//! Kubernetes' own objects that the agent reads, as read-only keys of the store (under
//! [`ROOT`]): each object's key and value are a projection of what calix needs of it, so the
//! agent lists, watches and follows Nodes, Pods and ServiceCIDRs with the machinery it has for
//! its own records (`datastore::follow`: re-watch after the API server restarts, re-list after
//! 410 Gone, bookmarks), and the revisions are the objects' resourceVersions.
//!
//! | key | object | value |
//! |---|---|---|
//! | `k8s/nodes/<name>` | core/v1 Node | [`NodeView`] |
//! | `k8s/pods/<node>/<namespace>/<name>` | core/v1 Pod with `spec.nodeName` | [`PodView`] (a listing or watch of `k8s/pods/<node>/` asks for `spec.nodeName=<node>`) |
//! | `k8s/servicecidrs/<name>` | networking.k8s.io/v1 ServiceCIDR | [`ServiceCidrView`] |
//! | `k8s/namespaces/<name>` | core/v1 Namespace | [`NamespaceView`] |
//! | `k8s/clusterpods/<namespace>/<name>` | core/v1 Pod, every one | the Pod cut to what NetworkPolicy reads ([`CLUSTER_POD`]) |
//! | `k8s/networkpolicies/<namespace>/<name>` | networking.k8s.io/v1 NetworkPolicy | its namespace, name and `spec` ([`NETWORK_POLICY`]) |
//! | `k8s/services/<namespace>/<name>` | core/v1 Service | its namespace, name, `spec` and `status.loadBalancer` ([`SERVICE`]) |
//! | `k8s/endpointslices/<namespace>/<name>` | discovery.k8s.io/v1 EndpointSlice | its namespace, name, Service label, address type, endpoints and ports ([`ENDPOINT_SLICE`]) |
//!
//! A write to one of these keys is refused ([`crate::DatastoreError::ReadOnly`]).
use std::collections::BTreeMap;

use kube::api::DynamicObject;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Every read-only key starts with it.
pub const ROOT: &str = "k8s/";
pub const NODES: &str = "k8s/nodes/";
pub const PODS: &str = "k8s/pods/";
pub const SERVICE_CIDRS: &str = "k8s/servicecidrs/";
pub const NAMESPACES: &str = "k8s/namespaces/";
pub const CLUSTER_PODS: &str = "k8s/clusterpods/";
pub const NETWORK_POLICIES: &str = "k8s/networkpolicies/";
pub const SERVICES: &str = "k8s/services/";
pub const ENDPOINT_SLICES: &str = "k8s/endpointslices/";

/// The label naming an EndpointSlice's Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Labels of a Service or an EndpointSlice no default proxy serves (kube-proxy's own rule,
/// its informers' label selector for both): another proxy's, or one marked headless. The
/// Service and EndpointSlice views keep them.
pub const NOT_PROXIED: [&str; 2] = [
    "service.kubernetes.io/service-proxy-name",
    "service.kubernetes.io/headless",
];

/// The key of Node `name`.
pub fn node_key(name: &str) -> String {
    format!("{NODES}{name}")
}

/// The prefix of the Pods bound to `node`.
pub fn pods_of(node: &str) -> String {
    format!("{PODS}{node}/")
}

/// One of a Node's `status.addresses`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddress {
    /// `InternalIP`, `ExternalIP`, `Hostname`...
    #[serde(rename = "type")]
    pub kind: String,
    pub address: String,
}

/// What calix reads of a Node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub addresses: Vec<NodeAddress>,
}

impl NodeView {
    /// The node's `InternalIP` addresses that parse, in the Node's order.
    pub fn internal_ips(&self) -> Vec<std::net::IpAddr> {
        self.addresses
            .iter()
            .filter(|a| a.kind == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect()
    }
}

/// What calix reads of a Pod.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub phase: String,
    /// `metadata.deletionTimestamp` is set: the pod is going (its containers may still run).
    #[serde(default)]
    pub deleting: bool,
    #[serde(default)]
    pub host_network: bool,
}

/// What calix reads of a ServiceCIDR.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceCidrView {
    pub name: String,
    #[serde(default)]
    pub cidrs: Vec<String>,
}

/// Where an object is: its namespace (`None`: cluster-scoped) and name.
pub type Location = (Option<String>, String);

/// What calix reads of a Namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceView {
    pub name: String,
    /// Matched by IPPools' `namespaceSelector`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// How one kind of Kubernetes object appears in the store.
#[derive(Debug)]
pub struct ViewOf {
    /// The object's key, `None` for one calix does not show (a Pod not yet scheduled).
    pub key: fn(&DynamicObject) -> Option<String>,
    /// The object's value.
    pub value: fn(&DynamicObject) -> Value,
    /// Where a key's object is: (namespace, name), `None` for a key no object can have.
    pub locate: fn(&str) -> Option<Location>,
    /// The field selector that narrows a listing or watch of a prefix below the kind's.
    pub field_selector: fn(&str) -> Option<String>,
}

fn text(obj: &DynamicObject, path: &[&str]) -> String {
    path.iter()
        .fold(&obj.data, |v, k| &v[*k])
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn string_map(m: &Option<BTreeMap<String, String>>) -> BTreeMap<String, String> {
    m.clone().unwrap_or_default()
}

pub const NODE: ViewOf = ViewOf {
    key: |o| o.metadata.name.as_deref().map(node_key),
    value: |o| {
        let addresses = o.data["status"]["addresses"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| serde_json::from_value::<NodeAddress>(x.clone()).ok())
                    .collect()
            })
            .unwrap_or_default();
        serde_json::to_value(NodeView {
            name: o.metadata.name.clone().unwrap_or_default(),
            labels: string_map(&o.metadata.labels),
            addresses,
        })
        .unwrap_or_default()
    },
    locate: |rest| (!rest.is_empty() && !rest.contains('/')).then(|| (None, rest.to_string())),
    field_selector: |_| None,
};

pub const POD: ViewOf = ViewOf {
    key: |o| {
        let node = text(o, &["spec", "nodeName"]);
        let (ns, name) = (
            o.metadata.namespace.as_deref()?,
            o.metadata.name.as_deref()?,
        );
        (!node.is_empty()).then(|| format!("{PODS}{node}/{ns}/{name}"))
    },
    value: |o| {
        serde_json::to_value(PodView {
            namespace: o.metadata.namespace.clone().unwrap_or_default(),
            name: o.metadata.name.clone().unwrap_or_default(),
            uid: o.metadata.uid.clone().unwrap_or_default(),
            node: text(o, &["spec", "nodeName"]),
            labels: string_map(&o.metadata.labels),
            annotations: string_map(&o.metadata.annotations),
            phase: text(o, &["status", "phase"]),
            deleting: o.metadata.deletion_timestamp.is_some(),
            host_network: o.data["spec"]["hostNetwork"].as_bool().unwrap_or(false),
        })
        .unwrap_or_default()
    },
    locate: |rest| {
        let mut parts = rest.splitn(3, '/');
        let (_node, ns, name) = (parts.next()?, parts.next()?, parts.next()?);
        (!ns.is_empty() && !name.is_empty() && !name.contains('/'))
            .then(|| (Some(ns.to_string()), name.to_string()))
    },
    field_selector: |rest| {
        let (node, _) = rest.split_once('/')?;
        // Node names are DNS subdomains; anything else is filtered by the prefix alone.
        let plain = !node.is_empty()
            && node
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
        plain.then(|| format!("spec.nodeName={node}"))
    },
};

pub const SERVICE_CIDR: ViewOf = ViewOf {
    key: |o| {
        o.metadata
            .name
            .as_deref()
            .map(|n| format!("{SERVICE_CIDRS}{n}"))
    },
    value: |o| {
        let cidrs = o.data["spec"]["cidrs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| c.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        serde_json::to_value(ServiceCidrView {
            name: o.metadata.name.clone().unwrap_or_default(),
            cidrs,
        })
        .unwrap_or_default()
    },
    locate: |rest| (!rest.is_empty() && !rest.contains('/')).then(|| (None, rest.to_string())),
    field_selector: |_| None,
};

pub const NAMESPACE: ViewOf = ViewOf {
    key: |o| {
        o.metadata
            .name
            .as_deref()
            .map(|n| format!("{NAMESPACES}{n}"))
    },
    value: |o| {
        serde_json::to_value(NamespaceView {
            name: o.metadata.name.clone().unwrap_or_default(),
            labels: string_map(&o.metadata.labels),
            annotations: string_map(&o.metadata.annotations),
        })
        .unwrap_or_default()
    },
    locate: |rest| (!rest.is_empty() && !rest.contains('/')).then(|| (None, rest.to_string())),
    field_selector: |_| None,
};

/// `(namespace, name)` of a `<namespace>/<name>` key's rest.
fn namespaced(rest: &str) -> Option<Location> {
    let (ns, name) = rest.split_once('/')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains('/'))
        .then(|| (Some(ns.to_string()), name.to_string()))
}

/// `<prefix><namespace>/<name>` of a namespaced object.
fn namespaced_key(prefix: &str, o: &DynamicObject) -> Option<String> {
    Some(format!(
        "{prefix}{}/{}",
        o.metadata.namespace.as_deref()?,
        o.metadata.name.as_deref()?
    ))
}

/// Every Pod of the cluster, cut to what NetworkPolicy reads of it: still a Pod (a client
/// reads it as one) with its namespace, name, labels, `spec.hostNetwork`, `spec.nodeName`,
/// its containers' names and ports, and `status.podIP(s)`. Annotations, images, probes and
/// the rest of the status stay out: the agent holds every pod of the cluster.
pub const CLUSTER_POD: ViewOf = ViewOf {
    key: |o| namespaced_key(CLUSTER_PODS, o),
    value: |o| {
        let containers: Vec<Value> = o.data["spec"]["containers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        let mut out = serde_json::json!({ "name": c["name"].clone() });
                        if c["ports"].is_array() {
                            out["ports"] = c["ports"].clone();
                        }
                        out
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut spec = serde_json::json!({ "containers": containers });
        for field in ["hostNetwork", "nodeName"] {
            if !o.data["spec"][field].is_null() {
                spec[field] = o.data["spec"][field].clone();
            }
        }
        let mut status = serde_json::json!({});
        for field in ["podIP", "podIPs"] {
            if !o.data["status"][field].is_null() {
                status[field] = o.data["status"][field].clone();
            }
        }
        serde_json::json!({
            "metadata": {
                "namespace": o.metadata.namespace,
                "name": o.metadata.name,
                "labels": string_map(&o.metadata.labels),
            },
            "spec": spec,
            "status": status,
        })
    },
    locate: namespaced,
    field_selector: |_| None,
};

/// A NetworkPolicy: its namespace, name and `spec`, still a NetworkPolicy.
pub const NETWORK_POLICY: ViewOf = ViewOf {
    key: |o| namespaced_key(NETWORK_POLICIES, o),
    value: |o| {
        serde_json::json!({
            "metadata": {
                "namespace": o.metadata.namespace,
                "name": o.metadata.name,
            },
            "spec": o.data["spec"].clone(),
        })
    },
    locate: namespaced,
    field_selector: |_| None,
};

/// A Service: its namespace, name, the labels of [`NOT_PROXIED`], `spec` and
/// `status.loadBalancer`, still a Service.
pub const SERVICE: ViewOf = ViewOf {
    key: |o| namespaced_key(SERVICES, o),
    value: |o| {
        let mut v = serde_json::json!({
            "metadata": {
                "namespace": o.metadata.namespace,
                "name": o.metadata.name,
            },
            "spec": o.data["spec"].clone(),
        });
        let labels: BTreeMap<String, String> = string_map(&o.metadata.labels)
            .into_iter()
            .filter(|(k, _)| NOT_PROXIED.contains(&k.as_str()))
            .collect();
        if !labels.is_empty() {
            v["metadata"]["labels"] = serde_json::json!(labels);
        }
        if !o.data["status"]["loadBalancer"].is_null() {
            v["status"] =
                serde_json::json!({"loadBalancer": o.data["status"]["loadBalancer"].clone()});
        }
        v
    },
    locate: namespaced,
    field_selector: |_| None,
};

/// An EndpointSlice: its namespace, name, the label naming its Service and those of
/// [`NOT_PROXIED`], its address type, endpoints and ports, still an EndpointSlice (other
/// labels, annotations and owner references stay out).
pub const ENDPOINT_SLICE: ViewOf = ViewOf {
    key: |o| namespaced_key(ENDPOINT_SLICES, o),
    value: |o| {
        let labels: BTreeMap<String, String> = string_map(&o.metadata.labels)
            .into_iter()
            .filter(|(k, _)| k == SERVICE_NAME_LABEL || NOT_PROXIED.contains(&k.as_str()))
            .collect();
        let mut v = serde_json::json!({
            "metadata": {
                "namespace": o.metadata.namespace,
                "name": o.metadata.name,
                "labels": labels,
            },
            "addressType": o.data["addressType"].clone(),
        });
        for field in ["endpoints", "ports"] {
            if !o.data[field].is_null() {
                v[field] = o.data[field].clone();
            }
        }
        v
    },
    locate: namespaced,
    field_selector: |_| None,
};

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::{ApiResource, GroupVersionKind};

    #[test]
    fn services_and_slices_keep_what_forwarding_reads() {
        let svc = obj(
            "Service",
            serde_json::json!({
                "metadata": {"name": "web", "namespace": "shop",
                    "annotations": {"big": "x"}},
                "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]},
                "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.8"}]},
                    "conditions": []}
            }),
        );
        assert_eq!(
            (SERVICE.key)(&svc).as_deref(),
            Some("k8s/services/shop/web")
        );
        assert_eq!(
            (SERVICE.value)(&svc),
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "web"},
                "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]},
                "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.8"}]}}
            })
        );
        // Another proxy's Service: its label is kept (and only that one).
        let other = obj(
            "Service",
            serde_json::json!({
                "metadata": {"name": "web", "namespace": "shop",
                    "labels": {"service.kubernetes.io/service-proxy-name": "foo-bar", "app": "x"}},
                "spec": {"clusterIP": "10.96.0.11"}
            }),
        );
        assert_eq!(
            (SERVICE.value)(&other)["metadata"]["labels"],
            serde_json::json!({"service.kubernetes.io/service-proxy-name": "foo-bar"})
        );
        let slice = obj(
            "EndpointSlice",
            serde_json::json!({
                "metadata": {"name": "web-abc", "namespace": "shop",
                    "labels": {"kubernetes.io/service-name": "web", "other": "x",
                        "service.kubernetes.io/headless": ""},
                    "ownerReferences": [{"kind": "Service", "name": "web"}]},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.244.1.5"]}],
                "ports": [{"port": 8080}]
            }),
        );
        assert_eq!(
            (ENDPOINT_SLICE.key)(&slice).as_deref(),
            Some("k8s/endpointslices/shop/web-abc")
        );
        assert_eq!(
            (ENDPOINT_SLICE.value)(&slice),
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "web-abc",
                    "labels": {"kubernetes.io/service-name": "web",
                        "service.kubernetes.io/headless": ""}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.244.1.5"]}],
                "ports": [{"port": 8080}]
            })
        );
    }

    fn obj(kind: &str, json: Value) -> DynamicObject {
        let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("", "v1", kind));
        let mut o: DynamicObject = serde_json::from_value(json).expect("object");
        o.types = Some(kube::core::TypeMeta {
            api_version: ar.api_version,
            kind: ar.kind,
        });
        o
    }

    #[test]
    fn pods_project_to_their_node_namespace_and_name() {
        let p = obj(
            "Pod",
            serde_json::json!({
                "metadata": {"name": "web-0", "namespace": "shop", "uid": "u-1",
                    "labels": {"app": "web"}, "deletionTimestamp": "2026-01-01T00:00:00Z"},
                "spec": {"nodeName": "node-a", "containers": []},
                "status": {"phase": "Running"}
            }),
        );
        assert_eq!((POD.key)(&p).as_deref(), Some("k8s/pods/node-a/shop/web-0"));
        let v: PodView = serde_json::from_value((POD.value)(&p)).expect("view");
        assert_eq!(
            (v.uid.as_str(), v.phase.as_str(), v.deleting),
            ("u-1", "Running", true)
        );
        assert_eq!(v.labels["app"], "web");
        assert_eq!(
            (POD.locate)("node-a/shop/web-0"),
            Some((Some("shop".into()), "web-0".into()))
        );
        assert_eq!(
            (POD.field_selector)("node-a/").as_deref(),
            Some("spec.nodeName=node-a")
        );
        assert_eq!((POD.field_selector)("node-a"), None);
        assert_eq!((POD.field_selector)("a,b=c/"), None);
        // Not scheduled yet: no key.
        let pending = obj(
            "Pod",
            serde_json::json!({"metadata": {"name": "x", "namespace": "d"}, "spec": {}}),
        );
        assert_eq!((POD.key)(&pending), None);
    }

    #[test]
    fn cluster_pods_keep_what_policy_reads_and_nothing_else() {
        let p = obj(
            "Pod",
            serde_json::json!({
                "metadata": {"name": "web-0", "namespace": "shop", "uid": "u-1",
                    "labels": {"app": "web"},
                    "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}"}},
                "spec": {"nodeName": "node-a", "containers": [
                    {"name": "web", "image": "nginx", "ports": [
                        {"name": "http", "containerPort": 80, "protocol": "TCP"}]},
                    {"name": "side", "image": "x", "args": ["--a"]}]},
                "status": {"phase": "Running", "podIP": "10.0.0.7",
                    "podIPs": [{"ip": "10.0.0.7"}, {"ip": "fd00::7"}],
                    "containerStatuses": [{"name": "web"}]}
            }),
        );
        assert_eq!(
            (CLUSTER_POD.key)(&p).as_deref(),
            Some("k8s/clusterpods/shop/web-0")
        );
        assert_eq!(
            (CLUSTER_POD.value)(&p),
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "web-0", "labels": {"app": "web"}},
                "spec": {"nodeName": "node-a", "containers": [
                    {"name": "web", "ports": [
                        {"name": "http", "containerPort": 80, "protocol": "TCP"}]},
                    {"name": "side"}]},
                "status": {"podIP": "10.0.0.7",
                    "podIPs": [{"ip": "10.0.0.7"}, {"ip": "fd00::7"}]}
            })
        );
        assert_eq!(
            (CLUSTER_POD.locate)("shop/web-0"),
            Some((Some("shop".into()), "web-0".into()))
        );
        assert_eq!((CLUSTER_POD.locate)("shop/"), None);
        assert_eq!((CLUSTER_POD.locate)("shop/a/b"), None);
        // Not scheduled yet: still a pod of the cluster (its labels count once it has an IP).
        let pending = obj(
            "Pod",
            serde_json::json!({"metadata": {"name": "x", "namespace": "d"}, "spec": {}}),
        );
        assert_eq!(
            (CLUSTER_POD.key)(&pending).as_deref(),
            Some("k8s/clusterpods/d/x")
        );
    }

    #[test]
    fn network_policies_keep_their_spec() {
        let np = obj(
            "NetworkPolicy",
            serde_json::json!({
                "metadata": {"name": "deny", "namespace": "shop", "generation": 3},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
            }),
        );
        assert_eq!(
            (NETWORK_POLICY.key)(&np).as_deref(),
            Some("k8s/networkpolicies/shop/deny")
        );
        assert_eq!(
            (NETWORK_POLICY.value)(&np),
            serde_json::json!({
                "metadata": {"namespace": "shop", "name": "deny"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
            })
        );
    }

    #[test]
    fn nodes_keep_their_labels_and_addresses() {
        let n = obj(
            "Node",
            serde_json::json!({
                "metadata": {"name": "node-a", "labels": {"zone": "a"}},
                "status": {"addresses": [
                    {"type": "Hostname", "address": "node-a"},
                    {"type": "InternalIP", "address": "10.0.0.5"},
                    {"type": "InternalIP", "address": "fd00::5"},
                    {"type": "InternalIP", "address": "not-an-ip"}
                ]}
            }),
        );
        let v: NodeView = serde_json::from_value((NODE.value)(&n)).expect("view");
        assert_eq!(v.labels["zone"], "a");
        assert_eq!(
            v.internal_ips(),
            [
                "10.0.0.5".parse::<std::net::IpAddr>().expect("ip"),
                "fd00::5".parse().expect("ip")
            ]
        );
        assert_eq!((NODE.key)(&n).as_deref(), Some("k8s/nodes/node-a"));
    }
}
