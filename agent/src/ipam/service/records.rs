//! Handle records (`ipam/handles/<handle>/<ifname>`): an index of the blocks' allocations by
//! handle, written after the block's commit, best effort, checked against the blocks by every
//! read, and rebuilt from the blocks by [`IpamService::repair_handles`] (at start and in
//! housekeeping).
use std::collections::BTreeMap;
use std::net::IpAddr;

use calix_core::ipam::{pool_of, Allocation, HandleRecord, Held};
use calix_core::store::keys;
use ipnet::IpNet;

use super::{Inner, IpamService};
use crate::error::AgentError;
use calix_datastore::{Compare, Durability, Op};

/// Housekeeping repairs the handle records at least every this many passes.
pub(super) const REPAIR_EVERY: u32 = 10;

/// A handle record as stored: its revision and what it says; `None` when there is none.
pub(super) type Stored = Option<(i64, HandleRecord)>;

/// Whether two records say the same (addresses in any order).
fn same_record(a: &HandleRecord, b: &HandleRecord) -> bool {
    let sorted = |r: &HandleRecord| {
        let mut v: Vec<(IpAddr, u64, IpNet)> = r
            .addresses
            .iter()
            .map(|h| (h.addr, h.seq, h.pool))
            .collect();
        v.sort();
        v
    };
    a.node == b.node && sorted(a) == sorted(b)
}

impl IpamService {
    /// The handle record of (handle, ifname) as stored. One that does not decode is reported
    /// and treated as an empty record, which the next write by handle (or the repair) replaces.
    pub(super) async fn read_record(
        &self,
        handle: &str,
        ifname: &str,
    ) -> Result<Stored, AgentError> {
        let Some(kv) = self.store.get(&keys::handle(handle, ifname)).await? else {
            return Ok(None);
        };
        let rec = kv.decode::<HandleRecord>().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "unreadable handle record: the blocks decide, and it is rewritten");
            HandleRecord::default()
        });
        Ok(Some((kv.revision, rec)))
    }

    /// The record the blocks say a handle should have: `None` when it holds nothing.
    pub(super) fn record_of<'a>(
        &self,
        held: impl IntoIterator<Item = (IpAddr, &'a Allocation)>,
    ) -> Option<HandleRecord> {
        let pools = self.pools();
        let mut node = None;
        let addresses: Vec<Held> = held
            .into_iter()
            .map(|(addr, a)| {
                node.get_or_insert_with(|| a.node.clone());
                Held {
                    addr,
                    pool: pool_of(&pools, addr),
                    seq: a.seq,
                }
            })
            .collect();
        Some(HandleRecord {
            node: node?,
            addresses,
        })
    }

    /// Makes the stored record of (handle, ifname) say `desired` (deleted when `None`), with a
    /// compare-and-swap on what `stored` says it is. A stored record of another node is left as
    /// it is (not this node's to write). Best effort: a lost race or a failure is
    /// logged, reads check the blocks anyway, and [`Self::repair_handles`] settles it at the
    /// next housekeeping pass. Returns whether the record now says `desired`.
    pub(super) async fn write_record(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        stored: &Stored,
        desired: Option<&HandleRecord>,
    ) -> bool {
        let hkey = keys::handle(handle, ifname);
        if let Some((_, cur)) = stored {
            if !cur.node.is_empty() && cur.node != self.node.name {
                // Another node's record (stale, or forged): that node's to fix, or an
                // operator's. Reads check the blocks; `ipam check` reports it.
                tracing::debug!(%handle, %ifname, node = %cur.node,
                    "handle record of another node left as it is");
                return false;
            }
        }
        let (compare, op) = match (stored, desired) {
            (Some((_, cur)), Some(d)) if same_record(cur, d) => return true,
            (None, None) => return true,
            (Some((rev, _)), None) => (Compare::Revision(hkey.clone(), *rev), Op::Delete(hkey)),
            (Some((rev, _)), Some(d)) => {
                (Compare::Revision(hkey.clone(), *rev), Op::put_json(hkey, d))
            }
            (None, Some(d)) => (Compare::Absent(hkey.clone()), Op::put_json(hkey, d)),
        };
        match self.store.txn(&[compare], &[op], Durability::Process).await {
            Ok(Some(_)) => true,
            Ok(None) => {
                tracing::debug!(%handle, %ifname,
                    "handle record changed meanwhile; the repair settles it from the blocks");
                inner.handles_dirty = true;
                false
            }
            Err(e) => {
                tracing::warn!(%handle, %ifname, error = %e,
                    "handle record not written: reads check the blocks, and the repair rewrites it");
                inner.handles_dirty = true;
                false
            }
        }
    }

    /// Makes the record of (handle, ifname) say what the view's blocks hold for it.
    pub(super) async fn follow_record(&self, inner: &mut Inner, handle: &str, ifname: &str) {
        let desired = self.record_of(
            inner
                .ipam
                .held_by(handle, ifname)
                .into_iter()
                .map(|(_, addr, a)| (addr, a)),
        );
        match self.read_record(handle, ifname).await {
            Ok(stored) => {
                self.write_record(inner, handle, ifname, &stored, desired.as_ref())
                    .await;
            }
            Err(e) => {
                tracing::warn!(%handle, %ifname, error = %e,
                    "handle record not read; the repair rewrites it");
                inner.handles_dirty = true;
            }
        }
    }

    /// Rebuilds this node's handle records from the blocks: a record missing for an allocation
    /// of this node is created, one that says otherwise than the blocks is rewritten, one of
    /// this node for a handle the blocks give nothing is deleted. Records of other nodes are
    /// theirs to repair. Also folds the previous version's retired-block records into released
    /// block objects. Runs at start, and in housekeeping after a record write failed or lost a
    /// race (and every [`REPAIR_EVERY`] passes: another node may have written this node's
    /// records); it lists every handle record of the store. Returns the records fixed.
    pub(super) async fn repair_handles(&self, inner: &mut Inner) -> Result<usize, AgentError> {
        inner.handles_dirty = false;
        // Under the IPAM lock nothing of this node's changes meanwhile: the view has every
        // allocation this node made (listed again if a write left it in doubt).
        let mut stored: BTreeMap<(String, String), (i64, HandleRecord)> = BTreeMap::new();
        // This node's handles only (the API server selects them by label).
        for kv in self
            .store
            .list_of_node(keys::HANDLES, &self.node.name)
            .await?
        {
            let Some((handle, ifname)) = kv
                .key
                .strip_prefix(keys::HANDLES)
                .and_then(|rest| rest.rsplit_once('/'))
            else {
                continue;
            };
            let rec = kv.decode::<HandleRecord>().unwrap_or_default();
            stored.insert((handle.to_string(), ifname.to_string()), (kv.revision, rec));
        }
        if inner.stale {
            self.refresh_blocks(inner).await?;
        }
        let mut held: BTreeMap<(String, String), Vec<(IpAddr, &Allocation)>> = BTreeMap::new();
        for (addr, a) in inner.ipam.allocations_of(&self.node.name) {
            held.entry((a.handle.clone(), a.ifname.clone()))
                .or_default()
                .push((addr, a));
        }
        let desired: BTreeMap<(String, String), HandleRecord> = held
            .into_iter()
            .filter_map(|(k, mut v)| {
                v.sort_by_key(|(addr, _)| (addr.is_ipv6(), *addr));
                Some((k, self.record_of(v)?))
            })
            .collect();
        let mut fixed = 0;
        for ((handle, ifname), want) in &desired {
            let have = stored.get(&(handle.clone(), ifname.clone())).cloned();
            if matches!(&have, Some((_, h)) if same_record(h, want)) {
                continue;
            }
            if self
                .write_record(inner, handle, ifname, &have, Some(want))
                .await
            {
                tracing::info!(%handle, %ifname, missing = have.is_none(),
                    "handle record repaired from the blocks");
                fixed += 1;
            }
        }
        for ((handle, ifname), have) in &stored {
            if have.1.node != self.node.name
                || desired.contains_key(&(handle.clone(), ifname.clone()))
            {
                continue;
            }
            if self
                .write_record(inner, handle, ifname, &Some(have.clone()), None)
                .await
            {
                tracing::info!(%handle, %ifname,
                    "stale handle record deleted: the blocks give the handle nothing");
                fixed += 1;
            }
        }
        self.fold_legacy_retired(inner).await;
        Ok(fixed)
    }

    /// The previous version released a block by deleting it and writing `ipam/retired/<block>`.
    /// Each such record becomes a released block object (compared absent), then goes.
    pub(super) async fn fold_legacy_retired(&self, inner: &mut Inner) {
        for (cidr, record_rev) in std::mem::take(&mut inner.legacy_retired) {
            let key = cidr.to_string();
            let has_object = inner.ipam.blocks.contains_key(&key)
                || inner
                    .ipam
                    .retired
                    .get(&key)
                    .is_some_and(|r| r.revision != 0);
            if !has_object {
                let next_seq = inner.ipam.retired.get(&key).map_or(1, |r| r.next_seq);
                let mut released = calix_core::ipam::Block::new(cidr, "");
                released.next_seq = next_seq;
                let bkey = keys::block(&cidr);
                let put = self
                    .store
                    .txn(
                        &[Compare::Absent(bkey.clone())],
                        &[Op::put_json(bkey, &released)],
                        Durability::Process,
                    )
                    .await;
                match put {
                    Ok(Some(rev)) => {
                        released.revision = rev;
                        inner.ipam.put_block(released);
                    }
                    Ok(None) => {
                        inner.stale = true;
                        inner.legacy_retired.push((cidr, record_rev));
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(block = %cidr, error = %e, "retired record not folded; retrying later");
                        inner.legacy_retired.push((cidr, record_rev));
                        continue;
                    }
                }
            }
            let rkey = keys::retired(&cidr);
            match self
                .store
                .txn(
                    &[Compare::Revision(rkey.clone(), record_rev)],
                    &[Op::Delete(rkey)],
                    Durability::Process,
                )
                .await
            {
                Ok(_) => {
                    tracing::info!(block = %cidr, "retired record folded into the block object")
                }
                Err(e) => {
                    tracing::warn!(block = %cidr, error = %e, "retired record not deleted; retrying later");
                    inner.legacy_retired.push((cidr, record_rev));
                }
            }
        }
    }
}
