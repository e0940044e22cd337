//! `calixctl ipam show` and `calixctl ipam check`: the datastore's IPAM state across every
//! node, read fresh.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;

use calix_core::ipam::wellformed::{self, Ignored};
use calix_core::ipam::{AffinityRecord, Block, HandleRecord, Pool};
use calix_core::model::{EndpointRecord, NodeRecord};
use calix_core::store::keys;
use serde::{Deserialize, Serialize};

use super::IpamService;
use crate::error::AgentError;
use calix_datastore::Datastore;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolUse {
    pub cidr: String,
    pub block_size: u8,
    pub disabled: bool,
    pub size: u64,
    pub blocks: usize,
    pub used: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockUse {
    pub cidr: String,
    pub affinity: String,
    pub size: u64,
    pub used: u64,
    /// Addresses in this block allocated by other nodes.
    pub borrowed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeUse {
    pub node: String,
    /// The node's own addresses, from its node record (empty for a node without one).
    #[serde(default)]
    pub addresses: Vec<String>,
    pub blocks: usize,
    pub used: u64,
    pub endpoints: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpamReport {
    pub node: String,
    pub pools: Vec<PoolUse>,
    pub blocks: Vec<BlockUse>,
    pub nodes: Vec<NodeUse>,
    /// Free addresses this node can use: (IPv4, IPv6).
    pub free_v4: u64,
    pub free_v6: u64,
}

/// One problem `ipam check` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// `leak`, `duplicate`, `orphan-handle`, `orphan-allocation`, `orphan-block`,
    /// `missing-affinity`, `orphan-affinity`, `ignored-block` (a stored block that breaks the
    /// rule for blocks: `rule` says which), `unreadable` (a record that does not decode).
    pub kind: String,
    /// For `ignored-block`: the rule it broke (`ipam::wellformed::Rule` names).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rule: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(default)]
    pub handle: String,
    #[serde(default)]
    pub ifname: String,
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub block: String,
    pub detail: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckReport {
    pub allocations: u64,
    pub blocks: usize,
    pub handles: usize,
    pub endpoints: usize,
    pub findings: Vec<Finding>,
}

/// The datastore's IPAM records, read at once.
pub struct Snapshot {
    /// The blocks that count, released ones left out.
    blocks: Vec<Block>,
    /// The blocks that do not.
    ignored: Vec<Ignored>,
    /// Records that do not decode: (key, why). Skipped by everything else.
    unreadable: Vec<(String, String)>,
    handles: Vec<(String, HandleRecord)>,
    /// Affinity records: (key, record; `None` when it does not decode).
    affinities: Vec<(String, Option<AffinityRecord>)>,
    endpoints: Vec<(String, EndpointRecord)>,
    nodes: Vec<NodeRecord>,
}

impl IpamService {
    async fn snapshot(&self) -> Result<Snapshot, AgentError> {
        // This node's IPAM writes come in pairs (a block, then its handle record): read between
        // two, and a check would report the handle as an orphan. Other nodes' pairs can still be
        // seen half done; their housekeeping settles those.
        let _no_ipam_writes = self.inner.lock().await;
        snapshot(&*self.store, &self.pools()).await
    }

    /// Pools, blocks and per-node use, across every node of the datastore.
    pub async fn ipam_report(&self) -> Result<IpamReport, AgentError> {
        let snap = self.snapshot().await?;
        let free = self.free().await;
        Ok(report(&snap, &self.pools(), &self.node.name, free))
    }

    /// Leaks, duplicates and orphans across every node of the datastore, and the blocks this
    /// node retains under a refused pool change.
    pub async fn ipam_check(&self) -> Result<CheckReport, AgentError> {
        let mut r = check(&self.snapshot().await?);
        for p in self.retained() {
            r.findings.push(Finding {
                kind: "retained-block".into(),
                rule: String::new(),
                address: None,
                seq: None,
                handle: String::new(),
                ifname: String::new(),
                node: self.node.name.clone(),
                block: p.cidr.to_string(),
                detail: "holds addresses of this node, but no configured pool makes this block \
                         any more (a pool deleted or shrunk, or its blockSize changed): kept \
                         on this node, no new addresses from it, until they are released; \
                         restore the pool (or add its size to previousBlockSizes)"
                    .into(),
            });
        }
        Ok(r)
    }
}

/// Reads every IPAM record of `store` (blocks not released, handles, affinities, endpoints,
/// nodes), the blocks sorted by the rule against `pools`. A record that does not decode is
/// skipped and reported (`unreadable`), never the end of the report.
pub async fn snapshot(store: &dyn Datastore, pools: &[Pool]) -> Result<Snapshot, AgentError> {
    let sorted = wellformed::sort(&store.list(keys::BLOCKS).await?, pools);
    // A released block is back in its pool: not in use, affine to nobody.
    let blocks = sorted
        .counted
        .into_iter()
        .filter(|b| !b.is_released())
        .collect();
    let mut unreadable: Vec<(String, String)> = Vec::new();
    /// `kv` decoded, or `None` and `kv` in `bad`.
    fn typed<T: for<'de> Deserialize<'de>>(
        kv: &calix_core::store::KeyValue,
        bad: &mut Vec<(String, String)>,
    ) -> Option<T> {
        match kv.decode::<T>() {
            Ok(v) => Some(v),
            Err(e) => {
                bad.push((kv.key.clone(), e.to_string()));
                None
            }
        }
    }
    let mut handles = Vec::new();
    for kv in store.list(keys::HANDLES).await? {
        if let Some(h) = typed::<HandleRecord>(&kv, &mut unreadable) {
            handles.push((kv.key.clone(), h));
        }
    }
    let mut affinities = Vec::new();
    for kv in store.list(keys::AFFINITIES).await? {
        affinities.push((kv.key.clone(), kv.decode::<AffinityRecord>().ok()));
    }
    let mut endpoints = Vec::new();
    for kv in store.list(keys::ENDPOINTS).await? {
        // endpoints/<node>/<cid>/<ifname>
        let node = kv
            .key
            .strip_prefix(keys::ENDPOINTS)
            .and_then(|r| r.split('/').next())
            .unwrap_or_default()
            .to_string();
        if let Some(e) = typed::<EndpointRecord>(&kv, &mut unreadable) {
            endpoints.push((node, e));
        }
    }
    let mut nodes = Vec::new();
    for kv in store.list(keys::NODES).await? {
        if let Some(n) = typed::<NodeRecord>(&kv, &mut unreadable) {
            nodes.push(n);
        }
    }
    Ok(Snapshot {
        blocks,
        ignored: sorted.ignored,
        unreadable,
        handles,
        affinities,
        endpoints,
        nodes,
    })
}

/// Pools, blocks and per-node use in `snap`; `node` is who asks, `free` what it can still
/// allocate (IPv4, IPv6).
pub fn report(snap: &Snapshot, pools: &[Pool], node: &str, free: (u64, u64)) -> IpamReport {
    let mut per_node: BTreeMap<String, NodeUse> = BTreeMap::new();
    fn node_use<'a>(per_node: &'a mut BTreeMap<String, NodeUse>, name: &str) -> &'a mut NodeUse {
        per_node.entry(name.to_string()).or_insert_with(|| NodeUse {
            node: name.to_string(),
            addresses: Vec::new(),
            blocks: 0,
            used: 0,
            endpoints: 0,
        })
    }
    for n in &snap.nodes {
        node_use(&mut per_node, &n.name).addresses = n.addresses.clone();
    }
    let mut blocks = Vec::new();
    for b in &snap.blocks {
        node_use(&mut per_node, &b.affinity).blocks += 1;
        for a in b.allocations.values() {
            node_use(&mut per_node, &a.node).used += 1;
        }
        blocks.push(BlockUse {
            cidr: b.cidr.to_string(),
            affinity: b.affinity.clone(),
            size: b.size(),
            used: b.allocations.len() as u64,
            borrowed: b
                .allocations
                .values()
                .filter(|a| a.node != b.affinity)
                .count() as u64,
        });
    }
    for (node, _) in &snap.endpoints {
        node_use(&mut per_node, node).endpoints += 1;
    }
    let pools = pools
        .iter()
        .map(|p| {
            let inside: Vec<&Block> = snap
                .blocks
                .iter()
                .filter(|b| p.cidr.contains(&b.cidr.network()))
                .collect();
            let bits = u32::from(p.cidr.max_prefix_len() - p.cidr.prefix_len());
            PoolUse {
                cidr: p.cidr.to_string(),
                block_size: p.block_size,
                disabled: p.disabled,
                size: if bits >= 63 { u64::MAX / 2 } else { 1 << bits },
                blocks: inside.len(),
                used: inside.iter().map(|b| b.allocations.len() as u64).sum(),
            }
        })
        .collect();
    let (free_v4, free_v6) = free;
    IpamReport {
        node: node.to_string(),
        pools,
        blocks,
        nodes: per_node.into_values().collect(),
        free_v4,
        free_v6,
    }
}

/// Leaks, duplicates and orphans in `snap`.
pub fn check(snap: &Snapshot) -> CheckReport {
    let mut findings = Vec::new();
    let live: HashSet<(&str, &str, &str)> = snap
        .endpoints
        .iter()
        .map(|(n, e)| (n.as_str(), e.handle.as_str(), e.ifname.as_str()))
        .collect();
    let handles: HashMap<(String, String), &HandleRecord> = snap
        .handles
        .iter()
        .filter_map(|(k, h)| {
            let rest = k.strip_prefix(keys::HANDLES)?;
            let (handle, ifname) = rest.rsplit_once('/')?;
            Some(((handle.to_string(), ifname.to_string()), h))
        })
        .collect();
    let known_nodes: HashSet<&str> = snap.nodes.iter().map(|n| n.name.as_str()).collect();
    let mut seen: HashMap<IpAddr, String> = HashMap::new();
    let mut allocations = 0u64;
    for b in &snap.blocks {
        if !known_nodes.contains(b.affinity.as_str()) {
            findings.push(Finding {
                kind: "orphan-block".into(),
                rule: String::new(),
                address: None,
                seq: None,
                handle: String::new(),
                ifname: String::new(),
                node: b.affinity.clone(),
                block: b.cidr.to_string(),
                detail: format!("block affine to unknown node {}", b.affinity),
            });
        }
        for (off, a) in &b.allocations {
            allocations += 1;
            let addr = b.address(*off);
            let base = Finding {
                kind: String::new(),
                rule: String::new(),
                address: Some(addr),
                seq: Some(a.seq),
                handle: a.handle.clone(),
                ifname: a.ifname.clone(),
                node: a.node.clone(),
                block: b.cidr.to_string(),
                detail: String::new(),
            };
            if let Some(other) = seen.insert(addr, b.cidr.to_string()) {
                findings.push(Finding {
                    kind: "duplicate".into(),
                    rule: String::new(),
                    detail: format!("{addr} is allocated in blocks {other} and {}", b.cidr),
                    ..base.clone()
                });
            }
            let held = handles
                .get(&(a.handle.clone(), a.ifname.clone()))
                .is_some_and(|h| h.addresses.iter().any(|x| x.addr == addr && x.seq == a.seq));
            if !held {
                findings.push(Finding {
                    kind: "orphan-allocation".into(),
                    rule: String::new(),
                    detail: "allocated in its block but no handle record holds it (the \
                             allocating node's housekeeping rebuilds the record)"
                        .into(),
                    ..base.clone()
                });
            }
            if !live.contains(&(a.node.as_str(), a.handle.as_str(), a.ifname.as_str())) {
                findings.push(Finding {
                    kind: "leak".into(),
                    rule: String::new(),
                    detail: format!("no endpoint on node {} uses it", a.node),
                    ..base
                });
            }
        }
    }
    for ((handle, ifname), rec) in &handles {
        for h in &rec.addresses {
            let in_block = snap.blocks.iter().any(|b| {
                b.offset_of(h.addr)
                    .and_then(|o| b.allocations.get(&o))
                    .is_some_and(|a| a.seq == h.seq && &a.handle == handle)
            });
            if !in_block {
                findings.push(Finding {
                    kind: "orphan-handle".into(),
                    rule: String::new(),
                    address: Some(h.addr),
                    seq: Some(h.seq),
                    handle: handle.clone(),
                    ifname: ifname.clone(),
                    node: rec.node.clone(),
                    block: String::new(),
                    detail: "handle record names an address its block does not hold (reads \
                             ignore it; the node's housekeeping deletes it)"
                        .into(),
                });
            }
        }
    }
    findings.extend(affinity_findings(snap));
    for i in &snap.ignored {
        findings.push(Finding {
            kind: "ignored-block".into(),
            rule: i.rule.name().into(),
            address: None,
            seq: None,
            handle: String::new(),
            ifname: String::new(),
            node: i.affinity.clone(),
            block: i.cidr.map_or_else(|| i.key.clone(), |c| c.to_string()),
            detail: format!(
                "{} ({}; {} allocation(s)): not used by any node",
                i.detail,
                i.key,
                i.allocations.len()
            ),
        });
    }
    for (key, why) in &snap.unreadable {
        findings.push(Finding {
            kind: "unreadable".into(),
            rule: String::new(),
            address: None,
            seq: None,
            handle: String::new(),
            ifname: String::new(),
            node: String::new(),
            block: String::new(),
            detail: format!("{key} does not decode ({why}): skipped"),
        });
    }
    CheckReport {
        allocations,
        blocks: snap.blocks.len(),
        handles: handles.len(),
        endpoints: snap.endpoints.len(),
        findings,
    }
}

/// Blocks without their affinity record, and records without their block (each node's
/// housekeeping repairs its own).
fn affinity_findings(snap: &Snapshot) -> Vec<Finding> {
    let finding = |kind: &str, node: &str, block: String, detail: String| Finding {
        kind: kind.into(),
        rule: String::new(),
        address: None,
        seq: None,
        handle: String::new(),
        ifname: String::new(),
        node: node.to_string(),
        block,
        detail,
    };
    let recorded: HashSet<String> = snap.affinities.iter().map(|(k, _)| k.clone()).collect();
    let mut out = Vec::new();
    for b in &snap.blocks {
        if !recorded.contains(&keys::affinity(&b.affinity, &b.cidr)) {
            out.push(finding(
                "missing-affinity",
                &b.affinity,
                b.cidr.to_string(),
                format!("block affine to {} has no affinity record", b.affinity),
            ));
        }
    }
    let affine: HashSet<String> = snap
        .blocks
        .iter()
        .map(|b| keys::affinity(&b.affinity, &b.cidr))
        .collect();
    for (key, record) in &snap.affinities {
        match record {
            Some(r) if affine.contains(key) && keys::affinity(&r.node, &r.cidr) == *key => {}
            _ => out.push(finding(
                "orphan-affinity",
                record.as_ref().map_or("", |r| r.node.as_str()),
                record
                    .as_ref()
                    .map_or_else(String::new, |r| r.cidr.to_string()),
                format!("affinity record {key} names no block affine to its node"),
            )),
        }
    }
    out
}

/// `/metrics` line: blocks retained under a refused pool change.
pub fn retained_metrics(retained: usize) -> String {
    format!(
        "# HELP calix_ipam_retained_blocks Blocks holding this node's addresses that no configured pool makes any more (a refused pool change, kept until released).\n# TYPE calix_ipam_retained_blocks gauge\ncalix_ipam_retained_blocks {retained}\n"
    )
}

/// `/metrics` lines: the stored blocks that do not count, by the rule they broke (every rule
/// listed, 0 included, so an alert can watch for any of them).
pub fn ignored_metrics(ignored: &[Ignored]) -> String {
    let mut out = String::from(
        "# HELP calix_ipam_ignored_blocks Stored IPAM blocks that break the rule for blocks and are ignored, by rule (calixctl ipam check lists them).\n# TYPE calix_ipam_ignored_blocks gauge\n",
    );
    for rule in wellformed::Rule::ALL {
        let n = ignored.iter().filter(|i| i.rule == rule).count();
        out.push_str(&format!(
            "calix_ipam_ignored_blocks{{rule=\"{}\"}} {n}\n",
            rule.name()
        ));
    }
    out
}
