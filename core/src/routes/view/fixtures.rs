//! The node records that the view's tests (and the engine's, and the agent's route handover
//! tests) build their views from. Built with `cfg(test)` or the `fixtures` feature (the
//! agent's dev-dependency), never into a release.
use crate::model::NodeRecord;
use crate::store::{keys, KeyValue};

/// Node `name`'s record (its Routes endpoint on its first address, port 5474).
pub fn node_kv(name: &str, addresses: &[&str], reflector: bool) -> KeyValue {
    let r = NodeRecord {
        name: name.into(),
        addresses: addresses.iter().map(|a| a.to_string()).collect(),
        routes_endpoint: format!("{}:5474", addresses.first().copied().unwrap_or("")),
        reflector,
        ..Default::default()
    };
    KeyValue {
        key: keys::node(name),
        value: serde_json::to_vec(&r).expect("json"),
        revision: 1,
        created: 1,
    }
}
