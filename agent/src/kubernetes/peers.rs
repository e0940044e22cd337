//! Route distribution's peers from Kubernetes' Node objects: with the `kubernetes` datastore
//! the routes view's node part is fed from `k8s/nodes/` instead of the agents' own node
//! records, each Node seen as the [`NodeRecord`] route distribution already understands:
//!
//! - its addresses: the Node's `InternalIP`s and `ExternalIP`s (what a peer's next hop is
//!   checked against: written by the kubelet, not by any agent, so one compromised agent
//!   cannot redirect another node's routes by rewriting a record);
//! - its Routes endpoint: its first `InternalIP` (IPv4 first) with the port every agent of
//!   the cluster listens on (this agent's `routes.listen`);
//! - a route reflector when it carries the reflector label (`routes.reflector_label`) ` =
//!   "true"`: by default a `node-restriction.kubernetes.io/` label, which a kubelet cannot set
//!   on its own Node.
//!
//! A Node without an `InternalIP` is not followed (it has nowhere to be reached).
use std::net::{IpAddr, SocketAddr};

use calix_core::model::NodeRecord;
use calix_core::store::keys;
use calix_core::store::KeyValue;
use calix_core::store::WatchEvent;

use crate::distribution::nodes::NodeSource;
use calix_datastore::kubernetes::views::{self, NodeView};

/// The Node label (` = "true"`) that makes a node a route reflector, by default
/// (`routes.reflector_label`): in `node-restriction.kubernetes.io/`, which a kubelet cannot set
/// on its own Node (the NodeRestriction admission plugin), so a node cannot make itself one.
pub const REFLECTOR_LABEL: &str = "node-restriction.kubernetes.io/calix-route-reflector";

/// How Node objects are read as peers: the port every agent listens on, the reflector label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peering {
    pub port: u16,
    pub reflector_label: String,
}

/// The node record route distribution sees for `node`.
pub fn record(node: &NodeView, p: &Peering) -> NodeRecord {
    let internal = node.internal_ips();
    let reach = internal
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| internal.first())
        .copied();
    let addresses: Vec<String> = node
        .addresses
        .iter()
        .filter(|a| a.kind == "InternalIP" || a.kind == "ExternalIP")
        .filter_map(|a| a.address.parse::<IpAddr>().ok())
        .map(|a| a.to_string())
        .collect();
    NodeRecord {
        name: node.name.clone(),
        addresses,
        labels: node.labels.clone(),
        agent_version: String::new(),
        routes_endpoint: reach
            .map(|ip| SocketAddr::new(ip, p.port).to_string())
            .unwrap_or_default(),
        reflector: node.labels.get(&p.reflector_label).map(String::as_str) == Some("true"),
    }
}

/// A Node's key and value (under `k8s/nodes/`) as a node record's (under `nodes/`); `None`
/// for what is not a Node.
pub fn as_record(kv: &KeyValue, p: &Peering) -> Option<KeyValue> {
    let name = kv.key.strip_prefix(views::NODES)?;
    let node: NodeView = match kv.decode() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(key = %kv.key, error = %e, "routes: Node not understood; ignored");
            return None;
        }
    };
    Some(KeyValue {
        key: keys::node(name),
        value: serde_json::to_vec(&record(&node, p)).ok()?,
        revision: kv.revision,
        created: kv.created,
    })
}

/// A change of a Node as a change of its node record.
pub fn as_record_event(ev: &WatchEvent, p: &Peering) -> Option<WatchEvent> {
    match ev {
        WatchEvent::Put(kv) => as_record(kv, p).map(WatchEvent::Put),
        WatchEvent::Delete { key, revision } => Some(WatchEvent::Delete {
            key: keys::node(key.strip_prefix(views::NODES)?),
            revision: *revision,
        }),
    }
}

/// Kubernetes' Node objects (`k8s/nodes/`) as route distribution's node records.
impl NodeSource for Peering {
    fn prefix(&self) -> &'static str {
        views::NODES
    }

    fn listed(&self, kvs: Vec<KeyValue>) -> Vec<KeyValue> {
        kvs.iter().filter_map(|kv| as_record(kv, self)).collect()
    }

    fn event(&self, ev: WatchEvent) -> Option<WatchEvent> {
        as_record_event(&ev, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_datastore::kubernetes::views::NodeAddress;

    fn peering(port: u16) -> Peering {
        Peering {
            port,
            reflector_label: REFLECTOR_LABEL.into(),
        }
    }

    fn node(addresses: &[(&str, &str)], reflector: bool) -> NodeView {
        NodeView {
            name: "n1".into(),
            labels: if reflector {
                [(REFLECTOR_LABEL.to_string(), "true".to_string())].into()
            } else {
                Default::default()
            },
            addresses: addresses
                .iter()
                .map(|(k, a)| NodeAddress {
                    kind: k.to_string(),
                    address: a.to_string(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_node_is_reached_at_its_internal_ip_and_vouches_for_its_addresses() {
        let r = record(
            &node(
                &[
                    ("Hostname", "n1"),
                    ("InternalIP", "fd00::5"),
                    ("InternalIP", "10.0.0.5"),
                    ("ExternalIP", "203.0.113.5"),
                ],
                true,
            ),
            &peering(5474),
        );
        assert_eq!(r.routes_endpoint, "10.0.0.5:5474");
        assert_eq!(r.addresses, ["fd00::5", "10.0.0.5", "203.0.113.5"]);
        assert!(r.reflector);
        // Another label makes a reflector only when it is the one configured.
        let mut other = node(&[("InternalIP", "10.0.0.5")], false);
        other
            .labels
            .insert("calix.dev/route-reflector".into(), "true".into());
        assert!(!record(&other, &peering(5474)).reflector);
        let custom = Peering {
            port: 5474,
            reflector_label: "example.com/rr".into(),
        };
        other.labels.insert("example.com/rr".into(), "true".into());
        assert!(record(&other, &custom).reflector);
        let v6 = record(&node(&[("InternalIP", "fd00::5")], false), &peering(5474));
        assert_eq!(v6.routes_endpoint, "[fd00::5]:5474");
        assert!(!v6.reflector);
        assert_eq!(
            record(&node(&[("Hostname", "n1")], false), &peering(1)).routes_endpoint,
            ""
        );
    }

    #[test]
    fn node_events_become_record_events() {
        let kv = KeyValue {
            key: views::node_key("n1"),
            value: serde_json::to_vec(&node(&[("InternalIP", "10.0.0.5")], false)).expect("json"),
            revision: 7,
            created: 7,
        };
        let Some(WatchEvent::Put(rec)) = as_record_event(&WatchEvent::Put(kv), &peering(9)) else {
            panic!("a put");
        };
        assert_eq!(rec.key, "nodes/n1");
        assert_eq!(rec.revision, 7);
        let r: NodeRecord = rec.decode().expect("record");
        assert_eq!(r.routes_endpoint, "10.0.0.5:9");
        let del = as_record_event(
            &WatchEvent::Delete {
                key: views::node_key("n1"),
                revision: 8,
            },
            &peering(9),
        );
        assert_eq!(
            del,
            Some(WatchEvent::Delete {
                key: "nodes/n1".into(),
                revision: 8
            })
        );
    }
}
