//! Where route distribution learns the nodes (its peers, and the addresses their routes may go
//! through): the agents' own node records ([`Records`]), or another source read as node
//! records (Kubernetes' Node objects: `crate::kubernetes::peers`, with the `kubernetes` datastore).
use calix_core::store::KeyValue;
use calix_core::store::WatchEvent;

use calix_core::routes::view::Part;

/// A source of node records in the datastore.
pub trait NodeSource: Send + Sync + 'static {
    /// The prefix it lists and watches.
    fn prefix(&self) -> &'static str;

    /// What the view takes of a listing: node records.
    fn listed(&self, kvs: Vec<KeyValue>) -> Vec<KeyValue>;

    /// A change as a node record's change; `None`: none.
    fn event(&self, ev: WatchEvent) -> Option<WatchEvent>;
}

/// The agents' node records (`nodes/`): each announces its own Routes endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Records;

impl NodeSource for Records {
    fn prefix(&self) -> &'static str {
        Part::Nodes.prefix()
    }

    fn listed(&self, kvs: Vec<KeyValue>) -> Vec<KeyValue> {
        kvs
    }

    fn event(&self, ev: WatchEvent) -> Option<WatchEvent> {
        Some(ev)
    }
}
