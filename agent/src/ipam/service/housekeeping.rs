//! Housekeeping: leak GC (allocations of this node that no endpoint uses), the release of this
//! node's empty blocks, and the repair of handle and affinity records from the blocks. Leak GC and block
//! release wait a grace period and recheck before they act, and log every release with its
//! reason. Every write is one object.
use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Instant;

use calix_core::ipam::Pool;
use calix_core::store::keys;

use super::{Inner, IpamService};
use crate::error::AgentError;
use calix_datastore::{Compare, Durability, Op};

/// Who uses this node's addresses: the endpoints, each as (IPAM handle, ifname). Leak GC
/// releases an allocation only when neither the endpoints in memory nor, rechecked just
/// before the release, the ones recorded in the datastore use it.
#[tonic::async_trait]
pub trait AddressUsers: Sync {
    async fn in_use(&self) -> HashSet<(String, String)>;
    async fn in_use_recorded(&self) -> Result<HashSet<(String, String)>, AgentError>;
}

/// What one housekeeping pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Leaked addresses released.
    pub released: Vec<IpAddr>,
    /// Allocations now waiting out the grace period.
    pub candidates: usize,
    /// Empty blocks released (or deleted, when no pool has their layout any more).
    pub blocks_released: Vec<String>,
    /// Handle records created, rewritten or deleted to match the blocks.
    pub handles_repaired: usize,
    /// Affinity records created or deleted to match the blocks.
    pub affinities_repaired: usize,
}

/// Whether `cidr` is a block of one of `pools` as configured now (disabled pools included).
fn current_layout(pools: &[Pool], cidr: &ipnet::IpNet) -> bool {
    pools
        .iter()
        .any(|p| cidr.prefix_len() == p.block_size && p.cidr.contains(&cidr.network()))
}

impl IpamService {
    /// One housekeeping pass at `now`: leak GC, empty blocks, handle records.
    pub async fn housekeep(
        &self,
        now: Instant,
        users: &dyn AddressUsers,
    ) -> Result<Swept, AgentError> {
        let mut out = Swept::default();
        // The live endpoints first (the registry's lock before the IPAM lock).
        let live_now = users.in_use().await;
        let mut inner = self.inner.lock().await;
        self.refresh_blocks(&mut inner).await?;

        // Leaks: allocations of this node whose (handle, ifname) has no endpoint.
        let orphaned: Vec<(IpAddr, u64, String, String)> = inner
            .ipam
            .allocations_of(&self.node.name)
            .filter(|(_, a)| !live_now.contains(&(a.handle.clone(), a.ifname.clone())))
            .map(|(addr, a)| (addr, a.seq, a.handle.clone(), a.ifname.clone()))
            .collect();
        let keep: HashSet<(IpAddr, u64)> = orphaned.iter().map(|(a, s, _, _)| (*a, *s)).collect();
        inner.leak_candidates.retain(|k, _| keep.contains(k));
        let mut due = Vec::new();
        for (addr, seq, handle, ifname) in orphaned {
            let first = *inner.leak_candidates.entry((addr, seq)).or_insert(now);
            if now.duration_since(first) >= self.housekeeping.leak_grace {
                due.push((addr, seq, handle, ifname, now.duration_since(first)));
            }
        }
        if !due.is_empty() {
            // Recheck against the datastore's endpoint records, not just memory.
            let live_stored = users.in_use_recorded().await?;
            for (addr, seq, handle, ifname, waited) in due {
                inner.leak_candidates.remove(&(addr, seq));
                if live_stored.contains(&(handle.clone(), ifname.clone())) {
                    continue;
                }
                let reason = format!(
                    "leak: no endpoint for {handle}/{ifname} for {}s (grace {}s)",
                    waited.as_secs(),
                    self.housekeeping.leak_grace.as_secs()
                );
                if self
                    .release_address_locked(&mut inner, addr, Some(seq), &reason)
                    .await?
                {
                    out.released.push(addr);
                }
            }
        }
        out.candidates = inner.leak_candidates.len();

        self.release_empty_blocks(&mut inner, now, &mut out).await?;
        inner.passes_since_repair += 1;
        if inner.handles_dirty
            || !inner.legacy_retired.is_empty()
            || inner.passes_since_repair >= super::records::REPAIR_EVERY
        {
            inner.passes_since_repair = 0;
            out.handles_repaired = self.repair_handles(&mut inner).await?;
            out.affinities_repaired = self.repair_affinities(&mut inner).await?;
        } else if inner.affinities_dirty {
            out.affinities_repaired = self.repair_affinities(&mut inner).await?;
        }
        Ok(out)
    }

    /// Releases this node's blocks that stayed empty for the grace period: each is written
    /// back affine to nobody (one compare-and-swap), keeping its sequence counter, so the next
    /// claim, by any node, continues it. A block no pool of this node has in its layout any
    /// more (blockSize changed, pool removed) is deleted instead, and so is any released block
    /// of such a layout inside this node's pools, so the new layout's blocks can be claimed:
    /// a block claimed where none is stored starts its sequence numbers above the store's
    /// revision, which covers every life it had.
    async fn release_empty_blocks(
        &self,
        inner: &mut Inner,
        now: Instant,
        out: &mut Swept,
    ) -> Result<(), AgentError> {
        // The configured pools only: a retained block is no layout to keep.
        let pools = self.configured_pools();
        let empty: Vec<(String, ipnet::IpNet)> = inner
            .ipam
            .blocks
            .iter()
            .filter(|(_, b)| b.affinity == self.node.name && b.allocations.is_empty())
            .map(|(k, b)| (k.clone(), b.cidr))
            .collect();
        let empty_keys: HashSet<&String> = empty.iter().map(|(k, _)| k).collect();
        inner.empty_since.retain(|k, _| empty_keys.contains(k));
        for (key, cidr) in &empty {
            let first = *inner.empty_since.entry(key.clone()).or_insert(now);
            if now.duration_since(first) < self.housekeeping.empty_block_grace {
                continue;
            }
            inner.empty_since.remove(key);
            let reason = "empty for longer than the grace period";
            if !current_layout(&pools, cidr) {
                let rev = inner.ipam.blocks.get(key).map_or(0, |b| b.revision);
                if self.delete_block(inner, cidr, rev).await? {
                    tracing::info!(block = %cidr, %reason, layout = "in no pool's layout",
                        "block deleted");
                    out.blocks_released.push(key.clone());
                }
                continue;
            }
            let Some(b) = inner.ipam.blocks.get_mut(key) else {
                continue;
            };
            b.affinity.clear();
            if self
                .commit_block(inner, key, Durability::Process)
                .await?
                .is_some()
            {
                tracing::info!(block = %cidr, empty_for_s = now.duration_since(first).as_secs(),
                    %reason, "block released");
                out.blocks_released.push(key.clone());
            }
        }
        let old_layout: Vec<(ipnet::IpNet, i64)> = inner
            .ipam
            .retired
            .values()
            .filter(|r| {
                r.revision != 0
                    && pools.iter().any(|p| p.cidr.contains(&r.cidr.network()))
                    && !current_layout(&pools, &r.cidr)
            })
            .map(|r| (r.cidr, r.revision))
            .collect();
        for (cidr, rev) in old_layout {
            if self.delete_block(inner, &cidr, rev).await? {
                tracing::info!(block = %cidr, "released block of an old layout deleted");
            }
        }
        // Blocks of a size their pool no longer makes (not in previousBlockSizes either), or in
        // no pool any more, do not count for anyone (`wellformed`): an empty one of this
        // node's, or released, is deleted, so it is not reported for ever and the new layout's
        // claims are clear.
        let me = self.node.name.clone();
        let gone: Vec<(ipnet::IpNet, i64, bool)> = inner
            .ignored
            .iter()
            .filter(|(i, _)| {
                matches!(
                    i.rule,
                    calix_core::ipam::wellformed::Rule::BlockSize
                        | calix_core::ipam::wellformed::Rule::OutsidePools
                ) && i.allocations.is_empty()
                    && (i.affinity == me || i.affinity.is_empty())
            })
            .filter_map(|(i, rev)| Some((i.cidr?, *rev, i.affinity == me)))
            .collect();
        for (cidr, rev, mine) in gone {
            if self.delete_block(inner, &cidr, rev).await? {
                tracing::info!(block = %cidr, layout = "a size its pool no longer makes",
                    "empty block deleted");
                if mine {
                    out.blocks_released.push(cidr.to_string());
                }
            }
        }
        Ok(())
    }

    /// Deletes block `cidr` if it is still at `revision`; whether it was deleted.
    async fn delete_block(
        &self,
        inner: &mut Inner,
        cidr: &ipnet::IpNet,
        revision: i64,
    ) -> Result<bool, AgentError> {
        let k = keys::block(cidr);
        let done = self
            .store
            .txn(
                &[Compare::Revision(k.clone(), revision)],
                &[Op::Delete(k)],
                Durability::Process,
            )
            .await?;
        let key = cidr.to_string();
        match done {
            Some(rev) => {
                inner.ipam.blocks.remove(&key);
                inner.ipam.retired.remove(&key);
                inner.ipam.revision = inner.ipam.revision.max(rev);
                self.follow_affinity(inner, cidr).await;
                Ok(true)
            }
            None => {
                self.refresh_blocks(inner).await?;
                Ok(false)
            }
        }
    }
}
