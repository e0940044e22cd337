//! calix's key space on the Kubernetes API: which custom resource holds which keys, how a key
//! becomes an object (name, labels, the key annotation, the value as `spec`) and back.
//!
//! | key | kind (`calix.dev/v1`, cluster-scoped) |
//! |---|---|
//! | `ipam/blocks/<block>` | `IPAMBlock` (label `calix.dev/node`: its affinity) |
//! | `ipam/handles/<handle>/<ifname>` | `IPAMHandle` (label `calix.dev/node`: its node) |
//! | `ipam/affinities/<node>/<block>` | `BlockAffinity` (label `calix.dev/node`: selects by node) |
//! | `nodes/<node>` | `CalixNode` |
//! | `endpoints/<node>/<containerID>/<ifname>` | `CalixEndpoint` (label `calix.dev/node`: selects by node) |
//! | `pools/<name>` | `IPPool` |
//! | `bgp/configurations/<name>` | `BGPConfiguration` |
//! | `bgp/peers/<name>` | `BGPPeer` |
//!
//! Every object carries its key in the annotation `calix.dev/key` (hand-made `IPPool`s need not:
//! a name that is not hashed reads as `<prefix><name>`). Keys outside these prefixes (the
//! previous version's `ipam/retired/`) have no object: they read as absent and cannot be written.
//!
//! Below `k8s/` are Kubernetes' own objects, read-only ([`super::views`]).
use std::collections::BTreeMap;

use kube::api::{ApiResource, DynamicObject, ObjectMeta};
use serde_json::Value;

use super::names::{label_value, object_name};
use super::views::{self, ViewOf};

pub const GROUP: &str = "calix.dev";
pub const VERSION: &str = "v1";
/// The annotation holding an object's key.
pub const KEY_ANNOTATION: &str = "calix.dev/key";
/// The label naming the node an object belongs to (a hashed form when the name is not a label
/// value: [`label_value`]).
pub const NODE_LABEL: &str = "calix.dev/node";

/// One kind of object and the keys it holds.
#[derive(Debug)]
pub struct Kind {
    /// Every key of this kind starts with it.
    pub prefix: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    /// Keys are `<prefix><node>/...` and the objects carry [`NODE_LABEL`] for that node: a
    /// listing or watch below one node's prefix selects by label.
    pub node_in_key: bool,
    /// The field of the value whose content is the object's [`NODE_LABEL`] (informational).
    pub node_field: Option<&'static str>,
    /// API group (`""`: core) and version.
    pub group: &'static str,
    pub version: &'static str,
    /// A Kubernetes object calix reads and never writes, seen through a projection; `None`:
    /// calix's own record, the object's `spec`.
    pub view: Option<&'static ViewOf>,
}

pub const KINDS: &[Kind] = &[
    Kind {
        prefix: "ipam/blocks/",
        kind: "IPAMBlock",
        plural: "ipamblocks",
        node_in_key: false,
        node_field: Some("affinity"),
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: "ipam/handles/",
        kind: "IPAMHandle",
        plural: "ipamhandles",
        node_in_key: false,
        node_field: Some("node"),
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: "ipam/affinities/",
        kind: "BlockAffinity",
        plural: "blockaffinities",
        node_in_key: true,
        node_field: None,
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: "nodes/",
        kind: "CalixNode",
        plural: "calixnodes",
        node_in_key: false,
        node_field: None,
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: "endpoints/",
        kind: "CalixEndpoint",
        plural: "calixendpoints",
        node_in_key: true,
        node_field: None,
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: "pools/",
        kind: "IPPool",
        plural: "ippools",
        node_in_key: false,
        node_field: None,
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: "bgp/configurations/",
        kind: "BGPConfiguration",
        plural: "bgpconfigurations",
        node_in_key: false,
        node_field: None,
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: "bgp/peers/",
        kind: "BGPPeer",
        plural: "bgppeers",
        node_in_key: false,
        node_field: None,
        group: GROUP,
        version: VERSION,
        view: None,
    },
    Kind {
        prefix: views::NODES,
        kind: "Node",
        plural: "nodes",
        node_in_key: false,
        node_field: None,
        group: "",
        version: "v1",
        view: Some(&views::NODE),
    },
    Kind {
        prefix: views::PODS,
        kind: "Pod",
        plural: "pods",
        node_in_key: false,
        node_field: None,
        group: "",
        version: "v1",
        view: Some(&views::POD),
    },
    Kind {
        prefix: views::SERVICE_CIDRS,
        kind: "ServiceCIDR",
        plural: "servicecidrs",
        node_in_key: false,
        node_field: None,
        group: "networking.k8s.io",
        version: "v1",
        view: Some(&views::SERVICE_CIDR),
    },
    Kind {
        prefix: views::NAMESPACES,
        kind: "Namespace",
        plural: "namespaces",
        node_in_key: false,
        node_field: None,
        group: "",
        version: "v1",
        view: Some(&views::NAMESPACE),
    },
    Kind {
        prefix: views::CLUSTER_PODS,
        kind: "Pod",
        plural: "pods",
        node_in_key: false,
        node_field: None,
        group: "",
        version: "v1",
        view: Some(&views::CLUSTER_POD),
    },
    Kind {
        prefix: views::NETWORK_POLICIES,
        kind: "NetworkPolicy",
        plural: "networkpolicies",
        node_in_key: false,
        node_field: None,
        group: "networking.k8s.io",
        version: "v1",
        view: Some(&views::NETWORK_POLICY),
    },
    Kind {
        prefix: views::SERVICES,
        kind: "Service",
        plural: "services",
        node_in_key: false,
        node_field: None,
        group: "",
        version: "v1",
        view: Some(&views::SERVICE),
    },
    Kind {
        prefix: views::ENDPOINT_SLICES,
        kind: "EndpointSlice",
        plural: "endpointslices",
        node_in_key: false,
        node_field: None,
        group: "discovery.k8s.io",
        version: "v1",
        view: Some(&views::ENDPOINT_SLICE),
    },
];

/// Longest key the store accepts (it travels in an annotation and in error messages).
pub const MAX_KEY: usize = 4096;

impl Kind {
    pub fn api_resource(&self) -> ApiResource {
        ApiResource {
            group: self.group.into(),
            version: self.version.into(),
            api_version: if self.group.is_empty() {
                self.version.into()
            } else {
                format!("{}/{}", self.group, self.version)
            },
            kind: self.kind.into(),
            plural: self.plural.into(),
        }
    }

    /// The value `obj` holds: its projection, or calix's record (its `spec`).
    pub fn value_of(&self, obj: &DynamicObject) -> Value {
        match self.view {
            Some(v) => (v.value)(obj),
            None => obj.data.get("spec").cloned().unwrap_or(Value::Null),
        }
    }

    /// The field selector for a listing or watch of `prefix` (read-only kinds only).
    pub fn field_selector(&self, prefix: &str) -> Option<String> {
        let rest = prefix.strip_prefix(self.prefix)?;
        (self.view?.field_selector)(rest)
    }

    /// The object name of `key` (of this kind).
    pub fn name_of(&self, key: &str) -> String {
        object_name(&key[self.prefix.len()..])
    }

    /// The object holding `value` at `key`, to create (no resourceVersion) or to replace.
    pub fn object(&self, key: &str, spec: Value, resource_version: Option<i64>) -> DynamicObject {
        let mut labels = BTreeMap::new();
        if self.node_in_key {
            if let Some(node) = key[self.prefix.len()..].split('/').next() {
                labels.insert(NODE_LABEL.to_string(), label_value(node));
            }
        }
        if let Some(node) = self
            .node_field
            .and_then(|f| spec.get(f))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            labels.insert(NODE_LABEL.to_string(), label_value(node));
        }
        let mut obj = DynamicObject::new(&self.name_of(key), &self.api_resource());
        obj.metadata = ObjectMeta {
            name: Some(self.name_of(key)),
            labels: (!labels.is_empty()).then_some(labels),
            annotations: Some(BTreeMap::from([(
                KEY_ANNOTATION.to_string(),
                key.to_string(),
            )])),
            resource_version: resource_version.map(|r| r.to_string()),
            ..ObjectMeta::default()
        };
        obj.data = serde_json::json!({ "spec": spec });
        obj
    }

    /// The key `obj` holds: its annotation, checked against its name, or (no annotation) its
    /// plain name after the prefix. `None` for an object that is not a calix record of this
    /// kind (wrong annotation, a hashed name without one).
    pub fn key_of(&self, obj: &DynamicObject) -> Option<String> {
        if let Some(v) = self.view {
            return (v.key)(obj).filter(|k| k.starts_with(self.prefix));
        }
        let name = obj.metadata.name.as_deref()?;
        match obj
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(KEY_ANNOTATION))
        {
            Some(key) => (key.starts_with(self.prefix)
                && key.len() > self.prefix.len()
                && self.name_of(key) == name)
                .then(|| key.clone()),
            None => {
                let key = format!("{}{name}", self.prefix);
                (self.name_of(&key) == name).then_some(key)
            }
        }
    }

    /// The label selector for a listing or watch of `prefix` (a prefix of keys of this kind),
    /// when one narrows it: `<prefix><node>/…` of a kind with the node in its keys.
    pub fn selector(&self, prefix: &str) -> Option<String> {
        if !self.node_in_key {
            return None;
        }
        let rest = prefix.strip_prefix(self.prefix)?;
        let (node, _) = rest.split_once('/')?;
        Some(format!("{NODE_LABEL}={}", label_value(node)))
    }
}

/// The kind holding `key`.
pub fn kind_of(key: &str) -> Option<&'static Kind> {
    KINDS
        .iter()
        .find(|k| key.starts_with(k.prefix) && key.len() > k.prefix.len())
}

/// The kinds that can hold keys starting with `prefix`: the one whose prefix `prefix` extends,
/// or every kind whose prefix extends `prefix` (`""`, `ipam/`). Kubernetes' own objects only
/// for a prefix below [`views::ROOT`]: a listing of everything is calix's records.
pub fn kinds_under(prefix: &str) -> Vec<&'static Kind> {
    if let Some(k) = KINDS.iter().find(|k| prefix.starts_with(k.prefix)) {
        return vec![k];
    }
    KINDS
        .iter()
        .filter(|k| k.prefix.starts_with(prefix))
        .filter(|k| k.view.is_none() || prefix.starts_with(views::ROOT))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_their_kind_and_back() {
        for key in [
            "ipam/blocks/10.244.0.64-26",
            "ipam/blocks/fd00--40-122",
            "ipam/handles/k8s-pod-network:0123abc/eth0",
            "ipam/handles/Weird:Name/With/Slashes",
            "nodes/node-a",
            "nodes/Node_A",
            "nodes/a/b/c",
            "endpoints/node-a/0123abc/eth0",
            "ipam/affinities/node-a/10.244.0.64-26",
            "endpoints/Node A/c/eth0",
            "pools/default-ipv4",
        ] {
            let kind = kind_of(key).unwrap_or_else(|| panic!("no kind for {key}"));
            let obj = kind.object(key, serde_json::json!({}), Some(7));
            assert!(super::super::names::is_subdomain(
                obj.metadata.name.as_deref().expect("name")
            ));
            assert_eq!(kind.key_of(&obj).as_deref(), Some(key));
            assert_eq!(obj.metadata.resource_version.as_deref(), Some("7"));
        }
        assert!(kind_of("ipam/retired/10.0.0.0-26").is_none());
        assert!(kind_of("nodes/").is_none());
        assert!(kind_of("other").is_none());
    }

    #[test]
    fn a_hand_made_pool_reads_by_its_name_and_a_forged_annotation_is_refused() {
        let pools = kind_of("pools/x").expect("pools");
        let mut obj = DynamicObject::new("default-ipv4", &pools.api_resource());
        assert_eq!(pools.key_of(&obj).as_deref(), Some("pools/default-ipv4"));
        // An annotation naming another key than the object's name: not a calix record.
        obj.metadata.annotations = Some(BTreeMap::from([(
            KEY_ANNOTATION.to_string(),
            "pools/other".to_string(),
        )]));
        assert_eq!(pools.key_of(&obj), None);
        obj.metadata.annotations = Some(BTreeMap::from([(
            KEY_ANNOTATION.to_string(),
            "nodes/default-ipv4".to_string(),
        )]));
        assert_eq!(pools.key_of(&obj), None);
    }

    #[test]
    fn node_labels_come_from_the_key_or_the_value() {
        let eps = kind_of("endpoints/n").expect("endpoints");
        let obj = eps.object("endpoints/n1/c/eth0", serde_json::json!({}), None);
        assert_eq!(
            obj.metadata.labels.as_ref().and_then(|l| l.get(NODE_LABEL)),
            Some(&"n1".to_string())
        );
        assert_eq!(
            eps.selector("endpoints/n1/").as_deref(),
            Some("calix.dev/node=n1")
        );
        // "endpoints/n1" also matches n10's keys: no selector, the prefix filters.
        assert_eq!(eps.selector("endpoints/n1"), None);
        let blocks = kind_of("ipam/blocks/x").expect("blocks");
        let obj = blocks.object(
            "ipam/blocks/10.0.0.0-26",
            serde_json::json!({"affinity": "node a"}),
            None,
        );
        assert_eq!(
            obj.metadata.labels.as_ref().and_then(|l| l.get(NODE_LABEL)),
            Some(&label_value("node a"))
        );
    }

    #[test]
    fn prefixes_pick_their_kinds() {
        let names = |p: &str| -> Vec<&str> { kinds_under(p).iter().map(|k| k.kind).collect() };
        assert_eq!(names("endpoints/n1/"), ["CalixEndpoint"]);
        assert_eq!(names("ipam/blocks/"), ["IPAMBlock"]);
        assert_eq!(names("ipam/"), ["IPAMBlock", "IPAMHandle", "BlockAffinity"]);
        assert_eq!(names("ipam/affinities/n1/"), ["BlockAffinity"]);
        assert_eq!(
            names("").len(),
            KINDS.iter().filter(|k| k.view.is_none()).count()
        );
        assert!(names("ipam/retired/").is_empty());
        assert!(names("zzz").is_empty());
        assert_eq!(
            names("k8s/"),
            [
                "Node",
                "Pod",
                "ServiceCIDR",
                "Namespace",
                "Pod",
                "NetworkPolicy",
                "Service",
                "EndpointSlice"
            ]
        );
        assert_eq!(names("k8s/pods/n1/"), ["Pod"]);
        assert_eq!(names("k8s/clusterpods/"), ["Pod"]);
        assert_eq!(names("k8s/networkpolicies/"), ["NetworkPolicy"]);
        assert_eq!(names("k8s/services/"), ["Service"]);
        assert_eq!(names("k8s/endpointslices/"), ["EndpointSlice"]);
        // Every pod of the cluster: no field selector.
        assert_eq!(
            kind_of("k8s/clusterpods/default/web")
                .expect("pod")
                .field_selector("k8s/clusterpods/"),
            None
        );
        assert_eq!(
            kind_of("k8s/pods/n1/default/web")
                .expect("pod")
                .field_selector("k8s/pods/n1/")
                .as_deref(),
            Some("spec.nodeName=n1")
        );
    }
}
