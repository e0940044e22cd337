//! The custom resources of group `calix.dev`, defined once: each one's spec IS the record calix
//! stores under the matching key (`calix_core::ipam::Block`, `calix_core::ipam::HandleRecord`,
//! `calix_core::model::NodeRecord`, `calix_core::model::EndpointRecord`, `calix_core::ipam::pool::PoolSpec`),
//! so the OpenAPI schema the API server validates against is generated from the same Rust types
//! the agent reads and writes (`calix_core::ipam::AffinityRecord` for `BlockAffinity`). [`manifests`] renders the CustomResourceDefinitions that
//! `charts/calix/crds/` holds (a test keeps those files current: `crds_are_current`).
//!
//! The store itself reads and writes these objects untyped (`kube::core::DynamicObject`): it
//! moves the record's JSON in and out of `spec` (see `super::kinds`).
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResource;
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use calix_core::bgp::{BgpConfigurationSpec, BgpPeerSpec};
use calix_core::ipam::pool::PoolSpec;
use calix_core::ipam::{AffinityRecord, Block, HandleRecord};
use calix_core::model::{EndpointRecord, NodeRecord};

/// An IPAM block: its CIDR, the node it is affine to, every allocation in it and its next
/// sequence number. The one object an IPAM write commits.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "IPAMBlock",
    plural = "ipamblocks",
    singular = "ipamblock",
    shortname = "cxblock",
    category = "calix",
    doc = "calix IPAM block: the commit point of every allocation in its CIDR",
    printcolumn = r#"{"name":"CIDR","type":"string","jsonPath":".spec.cidr"}"#,
    printcolumn = r#"{"name":"Affinity","type":"string","jsonPath":".spec.affinity"}"#,
    printcolumn = r#"{"name":"Next-Seq","type":"integer","jsonPath":".spec.next_seq"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct IPAMBlockSpec {
    #[serde(flatten)]
    pub block: Block,
}

/// What one (handle, interface) holds: an index of the blocks, repaired from them.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "IPAMHandle",
    plural = "ipamhandles",
    singular = "ipamhandle",
    shortname = "cxhandle",
    category = "calix",
    doc = "calix IPAM handle: the addresses one attachment holds (an index that follows the blocks)",
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.node"}"#,
    printcolumn = r#"{"name":"Addresses","type":"string","jsonPath":".spec.addresses[*].addr"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct IPAMHandleSpec {
    #[serde(flatten)]
    pub handle: HandleRecord,
}

/// A block's affinity to a node: one object per (node, block), so a node's blocks are listed
/// by label without reading every block. Follows the block, which stays the truth.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "BlockAffinity",
    plural = "blockaffinities",
    singular = "blockaffinity",
    shortname = "cxaffinity",
    category = "calix",
    doc = "calix block affinity: block spec.cidr is affine to node spec.node (an index that follows the IPAMBlock)",
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.node"}"#,
    printcolumn = r#"{"name":"CIDR","type":"string","jsonPath":".spec.cidr"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct BlockAffinitySpec {
    #[serde(flatten)]
    pub affinity: AffinityRecord,
}

/// A node as its agent announces itself: what the Node object does not hold (the agent's
/// version, the addresses it advertises).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "CalixNode",
    plural = "calixnodes",
    singular = "calixnode",
    shortname = "cxnode",
    category = "calix",
    doc = "calix node record, written by the node's agent",
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.name"}"#,
    printcolumn = r#"{"name":"Addresses","type":"string","jsonPath":".spec.addresses"}"#,
    printcolumn = r#"{"name":"Agent","type":"string","jsonPath":".spec.agent_version"}"#
)]
pub struct CalixNodeSpec {
    #[serde(flatten)]
    pub node: NodeRecord,
}

/// A pod interface calix wired on a node.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "CalixEndpoint",
    plural = "calixendpoints",
    singular = "calixendpoint",
    shortname = "cxep",
    category = "calix",
    doc = "calix endpoint: one pod interface on one node (label calix.dev/node)",
    printcolumn = r#"{"name":"Namespace","type":"string","jsonPath":".spec.pod_namespace"}"#,
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.pod_name"}"#,
    printcolumn = r#"{"name":"Interface","type":"string","jsonPath":".spec.host_ifname"}"#,
    printcolumn = r#"{"name":"Addresses","type":"string","jsonPath":".spec.addresses"}"#
)]
pub struct CalixEndpointSpec {
    #[serde(flatten)]
    pub endpoint: EndpointRecord,
}

/// An IP pool (with the `kubernetes` datastore the agents take their pools from these).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "IPPool",
    plural = "ippools",
    singular = "ippool",
    shortname = "cxpool",
    category = "calix",
    doc = "calix IP pool: pods' addresses come from its blocks",
    printcolumn = r#"{"name":"CIDR","type":"string","jsonPath":".spec.cidr"}"#,
    printcolumn = r#"{"name":"Block-Size","type":"integer","jsonPath":".spec.blockSize"}"#,
    printcolumn = r#"{"name":"NAT","type":"boolean","jsonPath":".spec.natOutgoing"}"#,
    printcolumn = r#"{"name":"Disabled","type":"boolean","jsonPath":".spec.disabled"}"#,
    printcolumn = r#"{"name":"VXLAN","type":"string","jsonPath":".spec.vxlan"}"#
)]
pub struct IPPoolSpec {
    #[serde(flatten)]
    pub pool: PoolSpec,
}

/// The cluster's BGP settings (`default`) or one node's (`node.<node>`), issue 23.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "BGPConfiguration",
    plural = "bgpconfigurations",
    singular = "bgpconfiguration",
    shortname = "cxbgpconfig",
    category = "calix",
    doc = "calix BGP configuration: `default` for the cluster, `node.<node>` for one node",
    printcolumn = r#"{"name":"AS","type":"integer","jsonPath":".spec.asNumber"}"#,
    printcolumn = r#"{"name":"Router-ID","type":"string","jsonPath":".spec.routerID"}"#
)]
pub struct BGPConfigurationSpec {
    #[serde(flatten)]
    pub configuration: BgpConfigurationSpec,
}

/// A router the nodes peer with, and which nodes do.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "calix.dev",
    version = "v1",
    kind = "BGPPeer",
    plural = "bgppeers",
    singular = "bgppeer",
    shortname = "cxbgppeer",
    category = "calix",
    doc = "calix BGP peer: a router, and the nodes that peer with it",
    printcolumn = r#"{"name":"Peer","type":"string","jsonPath":".spec.peerIP"}"#,
    printcolumn = r#"{"name":"AS","type":"integer","jsonPath":".spec.asNumber"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.node"}"#
)]
pub struct BGPPeerSpec {
    #[serde(flatten)]
    pub peer: BgpPeerSpec,
}

/// Every CRD, with the file name it has under `charts/calix/crds/`.
pub fn manifests() -> Vec<(String, CustomResourceDefinition)> {
    [
        IPAMBlock::crd(),
        IPAMHandle::crd(),
        BlockAffinity::crd(),
        CalixNode::crd(),
        CalixEndpoint::crd(),
        IPPool::crd(),
        BGPConfiguration::crd(),
        BGPPeer::crd(),
    ]
    .into_iter()
    .map(|mut crd| {
        // The agent fills in its own defaults when it reads a record: the API server must
        // not add fields the agent did not write (the store checks that what it reads back
        // is what it wrote).
        for v in &mut crd.spec.versions {
            if let Some(schema) = v
                .schema
                .as_mut()
                .and_then(|s| s.open_api_v3_schema.as_mut())
            {
                strip_defaults(schema);
            }
        }
        (
            format!("{}.yaml", crd.metadata.name.clone().unwrap_or_default()),
            crd,
        )
    })
    .collect()
}

/// Removes every `default` from a schema, recursively.
fn strip_defaults(
    schema: &mut k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps,
) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
    };
    schema.default = None;
    for p in schema.properties.iter_mut().flat_map(|m| m.values_mut()) {
        strip_defaults(p);
    }
    if let Some(JSONSchemaPropsOrBool::Schema(s)) = schema.additional_properties.as_mut() {
        strip_defaults(s);
    }
    match schema.items.as_mut() {
        Some(JSONSchemaPropsOrArray::Schema(s)) => strip_defaults(s),
        Some(JSONSchemaPropsOrArray::Schemas(v)) => v.iter_mut().for_each(strip_defaults),
        None => {}
    }
    for list in [&mut schema.all_of, &mut schema.any_of, &mut schema.one_of]
        .into_iter()
        .flatten()
    {
        list.iter_mut().for_each(strip_defaults);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// One CRD as the YAML file the chart ships.
    fn to_yaml(crd: &CustomResourceDefinition) -> String {
        let body = serde_saphyr::to_string(crd).expect("CRD as YAML");
        format!("# Generated from datastore/src/kubernetes/crds.rs: do not edit (CALIX_UPDATE_CRDS=1 cargo test -p calix-datastore --lib crds_are_current).\n{body}")
    }

    /// The manifests under charts/calix/crds/ are what the types say. Run with
    /// `CALIX_UPDATE_CRDS=1` to rewrite them after changing a record.
    #[test]
    fn crds_are_current() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/calix/crds");
        let update = std::env::var_os("CALIX_UPDATE_CRDS").is_some();
        let mut stale = Vec::new();
        for (file, crd) in manifests() {
            let path = dir.join(&file);
            let want = to_yaml(&crd);
            if update {
                std::fs::create_dir_all(&dir).expect("create crds dir");
                std::fs::write(&path, &want).expect("write crd");
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(want.as_str()) {
                stale.push(file);
            }
        }
        assert!(
            stale.is_empty(),
            "{stale:?} under charts/calix/crds/ are stale: CALIX_UPDATE_CRDS=1 cargo test -p calix-agent --lib crds_are_current"
        );
    }

    #[test]
    fn schemas_have_every_field_and_no_defaults() {
        for (file, crd) in manifests() {
            let text = serde_json::to_string(&crd).expect("json");
            assert!(!text.contains("\"default\""), "{file}: {text}");
            assert_eq!(crd.spec.group, "calix.dev");
            assert_eq!(crd.spec.scope, "Cluster");
        }
        let (_, block) = manifests().remove(0);
        let text = serde_json::to_string(&block).expect("json");
        for field in [
            "cidr",
            "affinity",
            "allocations",
            "next_seq",
            "handle",
            "seq",
        ] {
            assert!(text.contains(&format!("\"{field}\"")), "{field}: {text}");
        }
    }
}
