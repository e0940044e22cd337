//! The IPAM service: this node's view of the blocks over the datastore, allocation and release
//! by handle (`alloc`, `release`; the handle records: `records`), housekeeping (leak GC, empty blocks, handle records: `housekeeping`),
//! and the reports `calixctl ipam show/check` print (`report`). Nothing is acknowledged before
//! the datastore has it; every write is one object, and IPAM writes are compare-and-swap on one
//! block's revision, so agents sharing a datastore never hand out an address twice.
mod affinity;
mod alloc;
mod housekeeping;
mod records;
mod release;
pub mod report;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use calix_core::ipam::allocator::IpamState;
use calix_core::ipam::wellformed::{self, Ignored, Rule};
use calix_core::ipam::{Block, IpamError, NotCounted, Policy, Pool, Retired};
use calix_core::model::NodeRecord;
use calix_core::store::keys;
use ipnet::IpNet;
use tokio::sync::Mutex;

use crate::error::AgentError;
use calix_datastore::{Datastore, Durability, Op};

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
    /// The stored blocks that do not count (`wellformed`), as of the last listing, each with
    /// the revision it was read at.
    ignored: Vec<(Ignored, i64)>,
    /// Ignored blocks already reported (key, rule): each is logged and noticed once.
    reported: std::collections::BTreeSet<(String, Rule)>,
    /// Ignored blocks found since the last [`IpamService::take_ignored`].
    newly_ignored: Vec<Ignored>,
}

/// IPAM for one node over a shared datastore.
pub struct IpamService {
    node: NodeRecord,
    /// The configured pools and the policy.
    pools: RwLock<(Vec<Pool>, Policy)>,
    /// Blocks kept as pools of their own, disabled: blocks holding addresses of this node that
    /// the configured pools no longer make (a pool deleted or shrunk, or its blockSize changed,
    /// while this agent was down). Kept so the node keeps serving those addresses (found by
    /// handle, released, never handed out twice) and reports the refusal; each goes once it
    /// holds none of this node's addresses.
    retained: RwLock<Vec<Pool>>,
    /// A retention not yet noticed (the node turns it into a Warning).
    retention_notice: std::sync::Mutex<Option<String>>,
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
            retained: RwLock::new(Vec::new()),
            retention_notice: std::sync::Mutex::new(None),
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
                ignored: Vec::new(),
                reported: Default::default(),
                newly_ignored: Vec::new(),
            }),
        };
        {
            let mut inner = service.inner.lock().await;
            // The blocks are sorted against the pools (`wellformed`): set them first.
            service.set_pools_unchecked(pools, policy);
            // A block of this node the pools no longer make does not stop the agent: it is
            // retained (and reported) by the listing.
            service.refresh_blocks(&mut inner).await?;
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

    /// The pools the node works with: the configured ones, then the retained blocks (disabled
    /// pools of their own).
    pub fn pools(&self) -> Vec<Pool> {
        let mut pools = self.configured_pools();
        pools.extend(self.retained());
        pools
    }

    /// The pools as configured.
    pub fn configured_pools(&self) -> Vec<Pool> {
        self.pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// The blocks retained under a refused pool change (see `retained`).
    pub fn retained(&self) -> Vec<Pool> {
        self.retained
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A retention not yet noticed, once.
    pub fn take_retention_notice(&self) -> Option<String> {
        self.retention_notice
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
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
        // Blocks count or not by the pools: sort them again.
        self.refresh_blocks(&mut inner).await?;
        Ok(())
    }

    /// Refuses `pools` when a block holding an address of this node would no longer count
    /// under them: a pool shrunk or removed under it, or its block size no longer the pool's
    /// (neither `blockSize` nor in `previousBlockSizes`).
    fn check_pools(&self, ipam: &IpamState, pools: &[Pool]) -> Result<(), AgentError> {
        for (addr, a) in ipam.allocations_of(&self.node.name) {
            let Some(block) = ipam.block_of(addr) else {
                continue;
            };
            let why = match wellformed::check(&keys::block(&block.cidr), block, pools) {
                Ok(_) => continue,
                Err((Rule::OutsidePools, _)) => {
                    let was = self
                        .pools()
                        .iter()
                        .find(|p| p.cidr.contains(&addr))
                        .map(|p| format!("pool {}", p.cidr))
                        .unwrap_or_else(|| format!("the pool of block {}", block.cidr));
                    format!(
                        "{was} no longer contains {addr}, which {}/{} still holds: keep the \
                         pool (set disabled = true to stop new allocations) until its \
                         addresses are released",
                        a.handle, a.ifname
                    )
                }
                Err((_, detail)) => format!(
                    "block {} would no longer count ({detail}), and {}/{} holds {addr} in it: \
                     add /{} to the pool's previousBlockSizes",
                    block.cidr,
                    a.handle,
                    a.ifname,
                    block.cidr.prefix_len()
                ),
            };
            return Err(AgentError::PoolChange(why));
        }
        Ok(())
    }

    /// Re-reads every block (released ones included, and the previous version's retired-block
    /// records) from the datastore, and sorts them by the rule (`wellformed`): those that do
    /// not count are left out of the view, remembered and reported once.
    /// Until it succeeds the view counts as stale: a caller that changed the view and could
    /// not commit leaves it to be listed again before the next decision.
    async fn refresh_blocks(&self, inner: &mut Inner) -> Result<(), AgentError> {
        inner.stale = true;
        let (kvs, revision) = self.store.list_with_revision(keys::BLOCKS).await?;
        let configured = self.configured_pools();
        let mut sorted = wellformed::sort(&kvs, &configured);
        let retained = self.retention(&sorted.ignored);
        if !retained.is_empty() {
            let mut pools = configured;
            pools.extend(retained.iter().cloned());
            sorted = wellformed::sort(&kvs, &pools);
        }
        self.set_retained(retained);
        let mut retired = Vec::new();
        let mut legacy = Vec::new();
        for kv in self.store.list(keys::RETIRED).await? {
            match kv.decode::<Retired>() {
                Ok(r) => {
                    legacy.push((r.cidr, kv.revision));
                    retired.push(r);
                }
                Err(e) => {
                    tracing::warn!(key = %kv.key, error = %e, "retired-block record not understood; ignored")
                }
            }
        }
        inner.ipam.replace(sorted.counted, retired, revision);
        inner.ipam.avoid = sorted.avoid;
        let revisions: std::collections::HashMap<&str, i64> = kvs
            .iter()
            .map(|kv| (kv.key.as_str(), kv.revision))
            .collect();
        let ignored: Vec<(Ignored, i64)> = sorted
            .ignored
            .into_iter()
            .map(|i| {
                let rev = revisions.get(i.key.as_str()).copied().unwrap_or(0);
                (i, rev)
            })
            .collect();
        self.note_ignored(inner, ignored);
        inner.legacy_retired = legacy;
        inner.stale = false;
        Ok(())
    }

    /// The blocks to retain: ignored only because the configured pools do not make them (inside
    /// none, or not of a size the pool makes), otherwise sound (key, alignment, an allowed
    /// size), and holding an address this node allocated.
    fn retention(&self, ignored: &[Ignored]) -> Vec<Pool> {
        let me = &self.node.name;
        ignored
            .iter()
            .filter(|i| matches!(i.rule, Rule::OutsidePools | Rule::BlockSize))
            .filter(|i| i.allocations.iter().any(|(_, n)| n == me))
            .filter_map(|i| i.cidr)
            .filter(|c| {
                c.trunc() == *c
                    && wellformed::block_sizes(matches!(c, IpNet::V4(_))).contains(&c.prefix_len())
            })
            .map(|c| Pool {
                cidr: c,
                block_size: c.prefix_len(),
                disabled: true,
                previous_block_sizes: Vec::new(),
                restricted: false,
            })
            .collect()
    }

    /// Sets the retained blocks; a change is logged, and a new retention noticed.
    fn set_retained(&self, retained: Vec<Pool>) {
        let mut current = self.retained.write().unwrap_or_else(|p| p.into_inner());
        if *current == retained {
            return;
        }
        let cidrs: Vec<String> = retained.iter().map(|p| p.cidr.to_string()).collect();
        if retained.is_empty() {
            tracing::info!(
                "IPAM: no block retained any more: the pools hold every address of this node"
            );
        } else {
            let msg = format!(
                "pool change refused for {} block(s) ({}): they hold addresses of this node but \
                 the configured pools no longer make them (a pool deleted or shrunk, or its \
                 blockSize changed without previousBlockSizes); they are kept, with no new \
                 addresses from them, until those addresses are released (or restore the pool)",
                cidrs.len(),
                cidrs.join(", ")
            );
            tracing::error!("{msg}");
            *self
                .retention_notice
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(msg);
        }
        *current = retained;
    }

    /// Keeps the ignored blocks of the last listing; logs each new (block, rule) once.
    fn note_ignored(&self, inner: &mut Inner, ignored: Vec<(Ignored, i64)>) {
        let now: std::collections::BTreeSet<(String, Rule)> = ignored
            .iter()
            .map(|(i, _)| (i.key.clone(), i.rule))
            .collect();
        for (i, _) in &ignored {
            if inner.reported.contains(&(i.key.clone(), i.rule)) {
                continue;
            }
            tracing::warn!(key = %i.key, rule = %i.rule, affinity = %i.affinity,
                addresses = i.allocations.len(), detail = %i.detail,
                "IPAM block ignored: it breaks the rule for blocks (calixctl ipam check)");
            inner.newly_ignored.push(i.clone());
        }
        inner.reported = now;
        inner.ignored = ignored;
    }

    /// The ignored blocks found since the last call (each once), for the node's notices.
    pub async fn take_ignored(&self) -> Vec<Ignored> {
        std::mem::take(&mut self.inner.lock().await.newly_ignored)
    }

    /// The stored blocks that do not count, as of the last listing.
    pub async fn ignored(&self) -> Vec<Ignored> {
        self.inner
            .lock()
            .await
            .ignored
            .iter()
            .map(|(i, _)| i.clone())
            .collect()
    }

    /// Reads one block again into the view (gone: out of the view). A block that no longer
    /// passes the rule has the whole view sorted again.
    async fn reread_block(&self, inner: &mut Inner, cidr: &IpNet) -> Result<(), AgentError> {
        let key = keys::block(cidr);
        match self.store.get(&key).await? {
            Some(kv) => {
                let decoded = kv.decode::<Block>().ok().filter(|b| {
                    b.cidr == *cidr && wellformed::check(&key, b, &self.pools()).is_ok()
                });
                let Some(mut b) = decoded else {
                    return self.refresh_blocks(inner).await;
                };
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
        use calix_datastore::Compare;
        let Some(b) = inner.ipam.blocks.get(key) else {
            return Ok(None);
        };
        if b.revision == 0 {
            // A new block: never one that would not count.
            if let Err(why) = self.creatable(&inner.ipam, key, b) {
                let block = b.cidr;
                inner.ipam.blocks.remove(key);
                inner.stale = true;
                tracing::warn!(%block, %why, "IPAM: refused to create a block that would not count");
                return Err(IpamError::BadBlock { block, why }.into());
            }
        }
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

    /// Why new block `b` (at view key `key`) would not count, if it would not: the rule's own
    /// checks, and no overlap with a block of the view (claimed or released) or a block the
    /// view keeps clear of.
    fn creatable(&self, ipam: &IpamState, key: &str, b: &Block) -> Result<(), NotCounted> {
        wellformed::check(&keys::block(&b.cidr), b, &self.pools())
            .map_err(|(rule, detail)| NotCounted::Breaks { rule, detail })?;
        let overlaps = |other: &IpNet| calix_core::ipam::overlap(&b.cidr, other);
        if let Some(o) = ipam
            .blocks
            .iter()
            .filter(|(k, _)| k.as_str() != key)
            .map(|(_, o)| o.cidr)
            .chain(
                ipam.retired
                    .values()
                    .filter(|r| r.revision != 0 && r.cidr != b.cidr)
                    .map(|r| r.cidr),
            )
            .chain(ipam.avoid.iter().copied())
            .find(|o| overlaps(o))
        {
            return Err(NotCounted::Overlaps {
                block: b.cidr,
                other: o,
            });
        }
        Ok(())
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
