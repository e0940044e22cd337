//! Whom this agent follows, from the node records: every other node with a Routes endpoint
//! (full mesh); or, with `topology = "reflectors"`, a reflector follows every other node for
//! its own routes and every other agent follows the reflectors for everything they relay.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::view::View;

/// Who follows whom (`routes.topology`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    /// Every node follows every other.
    #[default]
    Mesh,
    /// Nodes follow only the route reflectors, which follow everyone.
    Reflectors,
}

/// A peer to follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `address:port` of its Routes service.
    pub endpoint: String,
    /// Ask for what it relays too (it is a reflector and this agent is not).
    pub relayed: bool,
}

/// The peers `me` follows, by node name.
pub fn wanted(
    view: &View,
    me: &str,
    topology: Topology,
    reflector: bool,
) -> BTreeMap<String, Target> {
    view.nodes()
        .filter(|n| n.record.name != me && !n.record.routes_endpoint.is_empty())
        .filter_map(|n| {
            let relayed = match topology {
                Topology::Mesh => false,
                Topology::Reflectors if reflector => false,
                Topology::Reflectors if n.record.reflector => true,
                Topology::Reflectors => return None,
            };
            Some((
                n.record.name.clone(),
                Target {
                    endpoint: n.record.routes_endpoint.clone(),
                    relayed,
                },
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::view::tests::{node_kv, put};
    use crate::store::{keys, KeyValue};

    fn view() -> View {
        let mut v = crate::routes::view::tests::view();
        for (n, a, refl) in [
            ("a", "192.0.2.1", false),
            ("b", "192.0.2.2", false),
            ("r1", "192.0.2.8", true),
            ("r2", "192.0.2.9", true),
        ] {
            v.apply(&put(node_kv(n, &[a], refl)));
        }
        // A node without route distribution (an older agent, or routes off).
        v.apply(&put(KeyValue {
            key: keys::node("old"),
            value: br#"{"name":"old","addresses":["192.0.2.7"]}"#.to_vec(),
            revision: 1,
            created: 1,
        }));
        v
    }

    #[test]
    fn mesh_follows_every_other_node_with_an_endpoint() {
        let w = wanted(&view(), "a", Topology::Mesh, false);
        assert_eq!(w.keys().collect::<Vec<_>>(), ["b", "r1", "r2"]);
        assert!(w.values().all(|t| !t.relayed));
        assert_eq!(w["b"].endpoint, "192.0.2.2:5474");
    }

    #[test]
    fn reflectors_topology() {
        let v = view();
        // A client follows the reflectors only, for everything they relay.
        let w = wanted(&v, "a", Topology::Reflectors, false);
        assert_eq!(w.keys().collect::<Vec<_>>(), ["r1", "r2"]);
        assert!(w.values().all(|t| t.relayed));
        // A reflector follows everyone, for their own routes.
        let w = wanted(&v, "r1", Topology::Reflectors, true);
        assert_eq!(w.keys().collect::<Vec<_>>(), ["a", "b", "r2"]);
        assert!(w.values().all(|t| !t.relayed));
    }
}
