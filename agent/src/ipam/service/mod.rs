//! The IPAM service: this node's view of the blocks over the datastore, allocation and release
//! by handle (`alloc`), housekeeping (leak GC, empty blocks, handle records: `housekeeping`),
//! and the reports `calixctl ipam show/check` print (`report`). Nothing is acknowledged before
//! the datastore has it; every write is one object, and IPAM writes are compare-and-swap on one
//! block's revision, so agents sharing a datastore never hand out an address twice.
mod affinity;
mod alloc;
mod housekeeping;
pub mod report;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use tokio::sync::Mutex;

use crate::datastore::{keys, Datastore, Durability, Op};
use crate::error::AgentError;
use crate::ipam::{Block, IpamState, Policy, Pool, Retired};
use crate::model::NodeRecord;

pub use housekeeping::{AddressUsers, Swept};
pub use report::{BlockUse, CheckReport, Finding, IpamReport, NodeUse, PoolUse};

/// Timings of the background IPAM housekeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Housekeeping {
    pub leak_grace: Duration,
    pub empty_block_grace: Duration,
}

/// The IPAM view, behind the service's lock.
struct Inner {
    /// The blocks as last read or written: every allocation this agent committed is in it.
    ipam: IpamState,
    /// A write failed and the view could not be listed again: it may hold a change that was
    /// not committed (or miss one that was). Listed again before the next decision.
    stale: bool,
    /// Retired-block records of the previous version (CIDR, record revision), to fold into
    /// released block objects.
    legacy_retired: Vec<(IpNet, i64)>,
    /// A handle record write failed or lost a race since the last repair.
    handles_dirty: bool,
    /// Housekeeping passes since the last repair of the handle records.
    passes_since_repair: u32,
    /// Allocations of this node without an endpoint: (address, seq) → first seen.
    leak_candidates: HashMap<(IpAddr, u64), Instant>,
    /// This node's empty blocks → first seen empty.
    empty_since: HashMap<String, Instant>,
    /// This node's affinity records as last written or listed: block → revision.
    affinities: std::collections::BTreeMap<IpNet, i64>,
    /// The affinity records may not match the blocks (not listed yet, or a write failed).
    affinities_dirty: bool,
}

/// IPAM for one node over a shared datastore.
pub struct IpamService {
    node: NodeRecord,
    pools: RwLock<(Vec<Pool>, Policy)>,
    housekeeping: Housekeeping,
    store: Arc<dyn Datastore>,
    inner: Mutex<Inner>,
}

/// Attempts at a compare-and-swap write before giving up (each after re-reading).
const CAS_ATTEMPTS: u32 = 64;

impl IpamService {
    /// Records the node, reads the blocks, checks the pools against the addresses the node
    /// holds, and repairs the handle records from the blocks.
    pub async fn new(
        node: NodeRecord,
        pools: Vec<Pool>,
        policy: Policy,
        housekeeping: Housekeeping,
        store: Arc<dyn Datastore>,
    ) -> Result<Self, AgentError> {
        if node.name.is_empty() {
            return Err(AgentError::Invalid("node name is empty".into()));
        }
        store
            .txn(
                &[],
                &[Op::put_json(keys::node(&node.name), &node)],
                Durability::Process,
            )
            .await?;
        let service = Self {
            node,
            pools: RwLock::new((Vec::new(), policy)),
            housekeeping,
            store,
            inner: Mutex::new(Inner {
                ipam: IpamState::default(),
                stale: false,
                legacy_retired: Vec::new(),
                handles_dirty: false,
                passes_since_repair: 0,
                leak_candidates: HashMap::new(),
                empty_since: HashMap::new(),
                affinities: Default::default(),
                affinities_dirty: true,
            }),
        };
        {
            let mut inner = service.inner.lock().await;
            service.refresh_blocks(&mut inner).await?;
            service.check_pools(&inner.ipam, &pools)?;
            service.set_pools_unchecked(pools, policy);
            // An agent that died between a block's commit and its handle record left the
            // record missing (or stale): rebuild the records from the blocks first thing.
            if let Err(e) = service.repair_handles(&mut inner).await {
                tracing::warn!(error = %e, "handle records not repaired at start; housekeeping retries");
            }
            if let Err(e) = service.repair_affinities(&mut inner).await {
                tracing::warn!(error = %e, "affinity records not repaired at start; housekeeping retries");
            }
        }
        Ok(service)
    }

    pub fn node(&self) -> &str {
        &self.node.name
    }

    pub fn datastore_kind(&self) -> &'static str {
        self.store.kind()
    }

    pub fn pools(&self) -> Vec<Pool> {
        self.pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    fn policy(&self) -> Policy {
        self.pools.read().unwrap_or_else(|p| p.into_inner()).1
    }

    fn set_pools_unchecked(&self, pools: Vec<Pool>, policy: Policy) {
        *self.pools.write().unwrap_or_else(|p| p.into_inner()) = (pools, policy);
    }

    /// Replaces the pools (config reload). Refused, naming the pool, when an address this node
    /// holds would no longer be in any pool (a pool shrunk or removed under live addresses).
    pub async fn set_pools(&self, pools: Vec<Pool>, policy: Policy) -> Result<(), AgentError> {
        let mut inner = self.inner.lock().await;
        self.refresh_blocks(&mut inner).await?;
        self.check_pools(&inner.ipam, &pools)?;
        tracing::info!(pools = ?pools.iter().map(|p| p.cidr.to_string()).collect::<Vec<_>>(),
            strict_affinity = policy.strict_affinity, max_blocks_per_node = policy.max_blocks_per_node,
            "pools updated");
        self.set_pools_unchecked(pools, policy);
        Ok(())
    }

    fn check_pools(&self, ipam: &IpamState, pools: &[Pool]) -> Result<(), AgentError> {
        for (addr, a) in ipam.allocations_of(&self.node.name) {
            if !pools.iter().any(|p| p.cidr.contains(&addr)) {
                let block = ipam
                    .block_of(addr)
                    .map(|b| b.cidr.to_string())
                    .unwrap_or_default();
                let was = self
                    .pools()
                    .iter()
                    .find(|p| p.cidr.contains(&addr))
                    .map(|p| format!("pool {}", p.cidr))
                    .unwrap_or_else(|| format!("the pool of block {block}"));
                return Err(AgentError::PoolChange(format!(
                    "{was} no longer contains {addr}, which {}/{} still holds: \
                     keep the pool (set disabled = true to stop new allocations) until its \
                     addresses are released",
                    a.handle, a.ifname
                )));
            }
        }
        Ok(())
    }

    /// Re-reads every block (released ones included, and the previous version's retired-block
    /// records) from the datastore.
    /// Until it succeeds the view counts as stale: a caller that changed the view and could
    /// not commit leaves it to be listed again before the next decision.
    async fn refresh_blocks(&self, inner: &mut Inner) -> Result<(), AgentError> {
        inner.stale = true;
        let (kvs, revision) = self.store.list_with_revision(keys::BLOCKS).await?;
        let mut blocks = Vec::new();
        for kv in kvs {
            let mut b: Block = kv.decode()?;
            b.revision = kv.revision;
            blocks.push(b);
        }
        let mut retired = Vec::new();
        let mut legacy = Vec::new();
        for kv in self.store.list(keys::RETIRED).await? {
            let r: Retired = kv.decode()?;
            legacy.push((r.cidr, kv.revision));
            retired.push(r);
        }
        inner.ipam.replace(blocks, retired, revision);
        inner.legacy_retired = legacy;
        inner.stale = false;
        Ok(())
    }

    /// Reads one block again into the view (gone: out of the view).
    async fn reread_block(&self, inner: &mut Inner, cidr: &IpNet) -> Result<(), AgentError> {
        match self.store.get(&keys::block(cidr)).await? {
            Some(kv) => {
                let mut b: Block = kv.decode()?;
                b.revision = kv.revision;
                inner.ipam.put_block(b);
            }
            None => {
                let key = cidr.to_string();
                inner.ipam.blocks.remove(&key);
                if inner
                    .ipam
                    .retired
                    .get(&key)
                    .is_some_and(|r| r.revision != 0)
                {
                    inner.ipam.retired.remove(&key);
                }
            }
        }
        Ok(())
    }

    /// Writes block `key` of the view, alone: compare-and-swap on the revision it was read at
    /// (a block never stored: compared absent). `Ok(Some(revision))` of the write, or
    /// `Ok(None)`: someone else wrote first; the view has been listed again and the caller
    /// should decide again. On an error the view is listed again too (or marked stale).
    async fn commit_block(
        &self,
        inner: &mut Inner,
        key: &str,
        durability: Durability,
    ) -> Result<Option<i64>, AgentError> {
        use crate::datastore::Compare;
        let Some(b) = inner.ipam.blocks.get(key) else {
            return Ok(None);
        };
        let k = keys::block(&b.cidr);
        let compare = match b.revision {
            0 => Compare::Absent(k.clone()),
            rev => Compare::Revision(k.clone(), rev),
        };
        match self
            .store
            .txn(&[compare], &[Op::put_json(k, b)], durability)
            .await
        {
            Ok(Some(rev)) => {
                let cidr = b.cidr;
                if let Some(mut b) = inner.ipam.blocks.remove(key) {
                    b.revision = rev;
                    // A released block moves to the retired; a claimed one leaves them.
                    inner.ipam.put_block(b);
                }
                inner.ipam.revision = inner.ipam.revision.max(rev);
                self.follow_affinity(inner, &cidr).await;
                Ok(Some(rev))
            }
            Ok(None) => {
                self.refresh_blocks(inner).await?;
                Ok(None)
            }
            Err(e) => {
                // The view holds a change that may or may not be committed: list it again.
                if let Err(re) = self.refresh_blocks(inner).await {
                    tracing::warn!(error = %re, "cannot re-read blocks after a failed write");
                }
                Err(e.into())
            }
        }
    }

    /// A copy of the IPAM view, re-read from the datastore (for calixctl and tests).
    pub async fn ipam(&self) -> Result<IpamState, AgentError> {
        let mut inner = self.inner.lock().await;
        self.refresh_blocks(&mut inner).await?;
        Ok(inner.ipam.clone())
    }
}

/// A short pause before retrying a lost compare-and-swap, growing with the attempt and
/// jittered so agents racing for the same block don't retry in lockstep.
async fn cas_backoff(attempt: u32) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let cap_us = 200u64 << attempt.min(6);
    tokio::time::sleep(Duration::from_micros(u64::from(nanos) % cap_us)).await;
}
