//! The datastore as route distribution needs it: every block (its affine node, who allocated
//! each address) and every node record, indexed so that advertising and validating a route are
//! a few hash lookups, never a datastore read. Kept current by a watch on `ipam/blocks/` and
//! `nodes/` ([`crate::routes::task`]); a value that does not decode is logged and skipped.
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::datastore::{keys, KeyValue, WatchEvent};
use crate::ipam::Block;
use crate::model::NodeRecord;

/// One block, as far as routes care.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockEntry {
    /// The node it is affine to; empty once released.
    pub affinity: String,
    /// Each allocated address and the node that allocated it.
    pub allocations: HashMap<IpAddr, String>,
}

/// One node record and its addresses, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEntry {
    pub record: NodeRecord,
    pub addresses: HashSet<IpAddr>,
}

/// The blocks and node records of the datastore.
#[derive(Debug, Default)]
pub struct View {
    blocks: HashMap<IpNet, BlockEntry>,
    /// Block key → CIDR (a delete event carries only the key).
    block_keys: HashMap<String, IpNet>,
    /// Prefix lengths of the blocks (family, length) → how many: an address's block is found
    /// by truncating it to each length present.
    lengths: BTreeMap<(bool, u8), usize>,
    /// Node → blocks affine to it.
    affine: HashMap<String, BTreeSet<IpNet>>,
    /// Node → addresses it allocated (in any block).
    allocated_by: HashMap<String, BTreeSet<IpAddr>>,
    nodes: BTreeMap<String, NodeEntry>,
}

/// Which part of the view an event touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Blocks,
    Nodes,
}

impl Part {
    pub fn prefix(self) -> &'static str {
        match self {
            Part::Blocks => keys::BLOCKS,
            Part::Nodes => keys::NODES,
        }
    }
}

impl View {
    /// Applies one watch event; returns whether anything changed.
    pub fn apply(&mut self, ev: &WatchEvent) -> bool {
        match ev {
            WatchEvent::Put(kv) => self.put(kv),
            WatchEvent::Delete { key, .. } => {
                if key.starts_with(keys::BLOCKS) {
                    self.block_keys
                        .remove(key)
                        .is_some_and(|cidr| self.remove_block(&cidr))
                } else if let Some(name) = key.strip_prefix(keys::NODES) {
                    self.nodes.remove(name).is_some()
                } else {
                    false
                }
            }
        }
    }

    /// Replaces one part with a fresh listing (after a compacted watch, or the first one).
    pub fn replace(&mut self, part: Part, kvs: &[KeyValue]) {
        match part {
            Part::Blocks => {
                self.blocks.clear();
                self.block_keys.clear();
                self.lengths.clear();
                self.affine.clear();
                self.allocated_by.clear();
            }
            Part::Nodes => self.nodes.clear(),
        }
        for kv in kvs {
            self.put(kv);
        }
    }

    fn put(&mut self, kv: &KeyValue) -> bool {
        if kv.key.starts_with(keys::BLOCKS) {
            let block: Block = match kv.decode() {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(key = %kv.key, error = %e, "routes: block not understood; ignored");
                    return false;
                }
            };
            let entry = BlockEntry {
                affinity: block.affinity.clone(),
                allocations: block
                    .allocations
                    .iter()
                    .map(|(off, a)| (block.address(*off), a.node.clone()))
                    .collect(),
            };
            if let Some(old) = self.block_keys.insert(kv.key.clone(), block.cidr) {
                if old != block.cidr {
                    self.remove_block(&old);
                }
            }
            if self.blocks.get(&block.cidr) == Some(&entry) {
                return false;
            }
            self.remove_block(&block.cidr);
            self.add_block(block.cidr, entry);
            true
        } else if let Some(name) = kv.key.strip_prefix(keys::NODES) {
            let record: NodeRecord = match kv.decode() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(key = %kv.key, error = %e, "routes: node record not understood; ignored");
                    return false;
                }
            };
            if record.name != name {
                tracing::warn!(key = %kv.key, name = %record.name, "routes: node record names another node; ignored");
                return false;
            }
            let addresses = record
                .addresses
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect();
            let entry = NodeEntry { record, addresses };
            let changed = self.nodes.get(name) != Some(&entry);
            self.nodes.insert(name.to_string(), entry);
            changed
        } else {
            false
        }
    }

    fn add_block(&mut self, cidr: IpNet, entry: BlockEntry) {
        *self
            .lengths
            .entry((is_v6(&cidr), cidr.prefix_len()))
            .or_default() += 1;
        if !entry.affinity.is_empty() {
            self.affine
                .entry(entry.affinity.clone())
                .or_default()
                .insert(cidr);
        }
        for (addr, node) in &entry.allocations {
            self.allocated_by
                .entry(node.clone())
                .or_default()
                .insert(*addr);
        }
        self.blocks.insert(cidr, entry);
    }

    fn remove_block(&mut self, cidr: &IpNet) -> bool {
        let Some(entry) = self.blocks.remove(cidr) else {
            return false;
        };
        let len = (is_v6(cidr), cidr.prefix_len());
        if let Some(n) = self.lengths.get_mut(&len) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&len);
            }
        }
        if let Some(set) = self.affine.get_mut(&entry.affinity) {
            set.remove(cidr);
            if set.is_empty() {
                self.affine.remove(&entry.affinity);
            }
        }
        for (addr, node) in &entry.allocations {
            if let Some(set) = self.allocated_by.get_mut(node) {
                set.remove(addr);
                if set.is_empty() {
                    self.allocated_by.remove(node);
                }
            }
        }
        true
    }

    /// The block with exactly this CIDR.
    pub fn block(&self, cidr: &IpNet) -> Option<&BlockEntry> {
        self.blocks.get(cidr)
    }

    /// The block holding `addr`.
    pub fn block_of(&self, addr: IpAddr) -> Option<(IpNet, &BlockEntry)> {
        let v6 = addr.is_ipv6();
        self.lengths
            .keys()
            .filter(|(f, _)| *f == v6)
            .find_map(|(_, len)| {
                let cidr = IpNet::new(addr, *len).ok()?.trunc();
                self.blocks.get(&cidr).map(|b| (cidr, b))
            })
    }

    /// Blocks affine to `node`.
    pub fn affine_to(&self, node: &str) -> impl Iterator<Item = &IpNet> {
        self.affine.get(node).into_iter().flatten()
    }

    /// Addresses `node` allocated, in any block.
    pub fn allocated_by(&self, node: &str) -> impl Iterator<Item = &IpAddr> {
        self.allocated_by.get(node).into_iter().flatten()
    }

    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.get(name)
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes.values()
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}

fn is_v6(n: &IpNet) -> bool {
    matches!(n, IpNet::V6(_))
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::ipam::Allocation;

    /// A block put event: `cidr` affine to `affinity`, with `allocs` (address, node).
    pub fn block_kv(cidr: &str, affinity: &str, allocs: &[(&str, &str)]) -> KeyValue {
        let cidr: IpNet = cidr.parse().expect("cidr");
        let mut b = Block::new(cidr, affinity);
        for (i, (addr, node)) in allocs.iter().enumerate() {
            let off = b
                .offset_of(addr.parse().expect("addr"))
                .expect("address in block");
            b.allocations.insert(
                off,
                Allocation {
                    handle: format!("h{i}"),
                    ifname: "eth0".into(),
                    node: node.to_string(),
                    seq: i as u64,
                    attributes: Default::default(),
                },
            );
        }
        KeyValue {
            key: keys::block(&cidr),
            value: serde_json::to_vec(&b).expect("json"),
            revision: 1,
            created: 1,
        }
    }

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

    pub fn put(kv: KeyValue) -> WatchEvent {
        WatchEvent::Put(kv)
    }

    #[test]
    fn blocks_index_by_affinity_and_allocating_node() {
        let mut v = View::default();
        assert!(v.apply(&put(block_kv(
            "10.244.0.0/26",
            "a",
            &[("10.244.0.1", "a"), ("10.244.0.2", "b")]
        ))));
        assert!(v.apply(&put(block_kv("fd00::/122", "a", &[]))));
        assert_eq!(v.affine_to("a").count(), 2);
        assert_eq!(
            v.allocated_by("b").collect::<Vec<_>>(),
            vec![&"10.244.0.2".parse::<IpAddr>().expect("ip")]
        );
        let (cidr, b) = v
            .block_of("10.244.0.2".parse().expect("ip"))
            .expect("found");
        assert_eq!(cidr.to_string(), "10.244.0.0/26");
        assert_eq!(b.allocations.len(), 2);
        assert!(v.block_of("10.244.0.64".parse().expect("ip")).is_none());
        assert!(v.block_of("fd00::3".parse().expect("ip")).is_some());
        // The same value again changes nothing.
        assert!(!v.apply(&put(block_kv(
            "10.244.0.0/26",
            "a",
            &[("10.244.0.1", "a"), ("10.244.0.2", "b")]
        ))));
        // Released: affine to nobody, b's borrowed address gone.
        assert!(v.apply(&put(block_kv("10.244.0.0/26", "", &[]))));
        assert_eq!(v.affine_to("a").count(), 1);
        assert_eq!(v.allocated_by("b").count(), 0);
        assert!(v.apply(&WatchEvent::Delete {
            key: keys::block(&"fd00::/122".parse().expect("cidr")),
            revision: 3
        }));
        assert_eq!(v.affine_to("a").count(), 0);
        assert!(v.block_of("fd00::3".parse().expect("ip")).is_none());
        assert_eq!(v.blocks(), 1);
    }

    #[test]
    fn node_records_parse_old_and_new_and_bad_ones_are_skipped() {
        let mut v = View::default();
        // A record of an older agent: no routes endpoint, no reflector flag.
        let old = KeyValue {
            key: keys::node("old"),
            value: br#"{"name":"old","addresses":["192.0.2.1","nonsense"],"labels":{},"agent_version":"0.1.0"}"#.to_vec(),
            revision: 1,
            created: 1,
        };
        assert!(v.apply(&put(old)));
        let n = v.node("old").expect("parsed");
        assert!(n.record.routes_endpoint.is_empty() && !n.record.reflector);
        assert_eq!(n.addresses.len(), 1, "the unparsable address is left out");
        let bad = KeyValue {
            key: keys::node("bad"),
            value: b"{not json".to_vec(),
            revision: 2,
            created: 2,
        };
        assert!(!v.apply(&put(bad)));
        // A record whose name is not its key's.
        let mut liar = node_kv("c", &["192.0.2.3"], false);
        liar.key = keys::node("d");
        assert!(!v.apply(&put(liar)));
        assert!(v.node("d").is_none());
        assert!(v.apply(&put(node_kv("r", &["192.0.2.9"], true))));
        assert!(v.node("r").expect("r").record.reflector);
        v.replace(Part::Nodes, &[node_kv("r", &["192.0.2.9"], true)]);
        assert_eq!(v.nodes().count(), 1);
    }
}
