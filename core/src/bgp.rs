//! BGP's records in the Kubernetes datastore (issue 23): the specs of `BGPConfiguration` and
//! `BGPPeer` (the CRDs' schemas are generated from these types), and which of them a node
//! takes. Field names follow Calico's resources of the same names where they mean the same.
//!
//! - `BGPConfiguration` `default`: the cluster's AS number and restart time;
//!   `node.<node name>`: one node's own AS number, router ID and next hops, over `default`.
//! - `BGPPeer`: a router, and which nodes peer with it (`node`: one node; `nodeSelector`: the
//!   nodes carrying every label; neither: every node).
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The name of the cluster-wide BGPConfiguration.
pub const DEFAULT_CONFIGURATION: &str = "default";

/// The name of node `node`'s own BGPConfiguration.
pub fn node_configuration(node: &str) -> String {
    format!("node.{node}")
}

/// A `BGPConfiguration`'s spec: every field optional, the node's over the cluster's over the
/// agent's config file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BgpConfigurationSpec {
    /// The AS number (1–4294967295, not 23456).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub as_number: Option<u32>,
    /// The BGP identifier (an IPv4 address); a node's own configuration only.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "routerID")]
    pub router_id: Option<String>,
    /// The next hops the node advertises (one per family); a node's own configuration only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_addresses: Vec<String>,
    /// Graceful restart's restart time, 1–4095 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_time_secs: Option<u64>,
    /// The port nodes listen on for their peers' connections; 0: they only connect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen_port: Option<u16>,
    /// Service ranges every node advertises as well (the cluster's only): ClusterIPs,
    /// external IPs, LoadBalancer IPs.
    #[serde(
        default,
        rename = "serviceClusterIPs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub service_cluster_ips: Vec<ServiceRange>,
    #[serde(
        default,
        rename = "serviceExternalIPs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub service_external_ips: Vec<ServiceRange>,
    #[serde(
        default,
        rename = "serviceLoadBalancerIPs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub service_load_balancer_ips: Vec<ServiceRange>,
}

/// A range of Service addresses advertised over BGP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServiceRange {
    pub cidr: String,
}

/// A Secret's key (the agent reads the one Secret mounted into it, docs/install.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SecretKeyRef {
    pub name: String,
    pub key: String,
}

/// Where a peer's TCP MD5 password is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BgpPassword {
    pub secret_key_ref: SecretKeyRef,
}

/// A `BGPPeer`'s spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BgpPeerSpec {
    /// The router's address.
    #[serde(rename = "peerIP")]
    pub peer_ip: String,
    pub as_number: u32,
    /// Its BGP port; default 179.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Only this node peers with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Only the nodes carrying every one of these labels peer with it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<BgpPassword>,
    /// 0, or 3–65535; default 90.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_time_secs: Option<u64>,
    /// Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graceful_restart: Option<bool>,
    /// Default 10,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prefixes: Option<u64>,
    /// `refuse` (default) or `reset`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prefixes_action: Option<String>,
    /// "asn:value", put on every route advertised to the peer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub communities: Vec<String>,
}

impl BgpPeerSpec {
    /// Whether node `node`, labelled `labels`, peers with it.
    pub fn selects(&self, node: &str, labels: &BTreeMap<String, String>) -> bool {
        if let Some(n) = &self.node {
            if n != node {
                return false;
            }
        }
        self.node_selector
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// The configuration a node takes: `node.<node>` over `default` (field by field).
pub fn effective(
    configurations: &BTreeMap<String, BgpConfigurationSpec>,
    node: &str,
) -> BgpConfigurationSpec {
    let mut out = configurations
        .get(DEFAULT_CONFIGURATION)
        .cloned()
        .unwrap_or_default();
    // A node's router ID and next hops are its own: never the cluster's.
    out.router_id = None;
    out.node_addresses.clear();
    if let Some(own) = configurations.get(&node_configuration(node)) {
        // (A node's own Service ranges are ignored: every node advertises the same.)
        out.as_number = own.as_number.or(out.as_number);
        out.restart_time_secs = own.restart_time_secs.or(out.restart_time_secs);
        out.listen_port = own.listen_port.or(out.listen_port);
        out.router_id.clone_from(&own.router_id);
        out.node_addresses.clone_from(&own.node_addresses);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(node: Option<&str>, selector: &[(&str, &str)]) -> BgpPeerSpec {
        BgpPeerSpec {
            peer_ip: "172.31.1.254".into(),
            as_number: 65000,
            port: None,
            node: node.map(Into::into),
            node_selector: selector
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            password: None,
            hold_time_secs: None,
            graceful_restart: None,
            max_prefixes: None,
            max_prefixes_action: None,
            communities: Vec::new(),
        }
    }

    #[test]
    fn which_nodes_peer() {
        let labels: BTreeMap<String, String> = [("rack".to_string(), "a".to_string())].into();
        assert!(peer(None, &[]).selects("n1", &labels), "every node");
        assert!(peer(Some("n1"), &[]).selects("n1", &labels));
        assert!(!peer(Some("n2"), &[]).selects("n1", &labels));
        assert!(peer(None, &[("rack", "a")]).selects("n1", &labels));
        assert!(!peer(None, &[("rack", "b")]).selects("n1", &labels));
        assert!(
            !peer(Some("n1"), &[("rack", "b")]).selects("n1", &labels),
            "both must hold"
        );
    }

    #[test]
    fn a_node_configuration_overrides_the_default_field_by_field() {
        let mut c = BTreeMap::new();
        c.insert(
            DEFAULT_CONFIGURATION.to_string(),
            BgpConfigurationSpec {
                as_number: Some(64512),
                restart_time_secs: Some(60),
                router_id: Some("10.0.0.1".into()),
                ..Default::default()
            },
        );
        let e = effective(&c, "n1");
        assert_eq!(e.as_number, Some(64512));
        assert_eq!(e.router_id, None, "the cluster's router ID is no node's");
        c.insert(
            node_configuration("n1"),
            BgpConfigurationSpec {
                as_number: Some(64601),
                router_id: Some("172.31.1.1".into()),
                listen_port: Some(1179),
                ..Default::default()
            },
        );
        let e = effective(&c, "n1");
        assert_eq!(
            (e.as_number, e.restart_time_secs, e.router_id.as_deref()),
            (Some(64601), Some(60), Some("172.31.1.1"))
        );
        assert_eq!(e.listen_port, Some(1179), "a node's own port");
        assert_eq!(effective(&c, "n2").as_number, Some(64512));
        assert_eq!(effective(&c, "n2").listen_port, None);
        let json = serde_json::json!({"peerIP": "fd00::1", "asNumber": 65000,
            "password": {"secretKeyRef": {"name": "calix-bgp-passwords", "key": "tor"}}});
        let p: BgpPeerSpec = serde_json::from_value(json).expect("a Calico-shaped BGPPeer");
        assert_eq!(p.password.expect("password").secret_key_ref.key, "tor");
    }
}
