//! Block affinity records (`ipam/affinities/<node>/<block>`, Calico's BlockAffinity): one per
//! block affine to a node, so a node's blocks are listed without reading every block (on
//! Kubernetes `kubectl get blockaffinities -l calix.dev/node=<node>`, or the store's listing of
//! [`keys::affinities_of`]). The block object stays the truth and the one commit point; a record
//! follows it like a handle record: written (or deleted) right after the commit that made the
//! block this node's (or no longer), best effort, and made to match the blocks again at start
//! and by housekeeping after a failure (and every `REPAIR_EVERY` passes).
use std::collections::{BTreeMap, BTreeSet};

use calix_core::ipam::AffinityRecord;
use calix_core::store::keys;
use ipnet::IpNet;

use super::{Inner, IpamService};
use crate::error::AgentError;
use calix_datastore::{Compare, Durability, Op};

impl IpamService {
    /// This node's blocks, by the view.
    fn affine_blocks(&self, inner: &Inner) -> BTreeSet<IpNet> {
        inner
            .ipam
            .blocks
            .values()
            .filter(|b| b.affinity == self.node.name)
            .map(|b| b.cidr)
            .collect()
    }

    /// After a commit of block `cidr`: its affinity record follows. A failed write leaves the
    /// records to [`IpamService::repair_affinities`].
    pub(super) async fn follow_affinity(&self, inner: &mut Inner, cidr: &IpNet) {
        if inner.affinities_dirty {
            return;
        }
        let mine = inner
            .ipam
            .blocks
            .get(&cidr.to_string())
            .is_some_and(|b| b.affinity == self.node.name);
        let recorded = inner.affinities.get(cidr).copied();
        let done = match (mine, recorded) {
            (true, None) => self.create_affinity(inner, cidr).await,
            (false, Some(rev)) => self.delete_affinity(inner, cidr, rev).await,
            _ => true,
        };
        if !done {
            inner.affinities_dirty = true;
        }
    }

    /// Creates the record of `cidr`; whether it was written.
    async fn create_affinity(&self, inner: &mut Inner, cidr: &IpNet) -> bool {
        let key = keys::affinity(&self.node.name, cidr);
        let record = AffinityRecord {
            node: self.node.name.clone(),
            cidr: *cidr,
        };
        match self
            .store
            .txn(
                &[Compare::Absent(key.clone())],
                &[Op::put_json(key.clone(), &record)],
                Durability::Process,
            )
            .await
        {
            Ok(Some(rev)) => {
                inner.affinities.insert(*cidr, rev);
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(%key, error = %e, "affinity record not written; housekeeping repairs it");
                false
            }
        }
    }

    /// Deletes the record of `cidr` at `revision`; whether it was deleted.
    async fn delete_affinity(&self, inner: &mut Inner, cidr: &IpNet, revision: i64) -> bool {
        let key = keys::affinity(&self.node.name, cidr);
        match self
            .store
            .txn(
                &[Compare::Revision(key.clone(), revision)],
                &[Op::Delete(key.clone())],
                Durability::Process,
            )
            .await
        {
            Ok(Some(_)) => {
                inner.affinities.remove(cidr);
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(%key, error = %e, "affinity record not deleted; housekeeping repairs it");
                false
            }
        }
    }

    /// Makes this node's affinity records what the blocks say: one per block affine to it,
    /// nothing else under [`keys::affinities_of`] (a record that does not decode, or names
    /// another node or block than its key, is deleted). Returns the records fixed.
    pub(super) async fn repair_affinities(&self, inner: &mut Inner) -> Result<usize, AgentError> {
        inner.affinities_dirty = true;
        let prefix = keys::affinities_of(&self.node.name);
        let mut stored: BTreeMap<IpNet, i64> = BTreeMap::new();
        let mut junk: Vec<(String, i64)> = Vec::new();
        for kv in self.store.list(&prefix).await? {
            match kv.decode::<AffinityRecord>() {
                Ok(r) if r.node == self.node.name && keys::affinity(&r.node, &r.cidr) == kv.key => {
                    stored.insert(r.cidr, kv.revision);
                }
                _ => junk.push((kv.key, kv.revision)),
            }
        }
        if inner.stale {
            self.refresh_blocks(inner).await?;
        }
        inner.affinities = stored;
        let desired = self.affine_blocks(inner);
        let mut fixed = 0;
        let mut failed = false;
        for cidr in &desired {
            if inner.affinities.contains_key(cidr) {
                continue;
            }
            if self.create_affinity(inner, cidr).await {
                tracing::info!(block = %cidr, "affinity record repaired from the blocks");
                fixed += 1;
            } else {
                failed = true;
            }
        }
        let extra: Vec<(IpNet, i64)> = inner
            .affinities
            .iter()
            .filter(|(c, _)| !desired.contains(c))
            .map(|(c, r)| (*c, *r))
            .collect();
        for (cidr, rev) in extra {
            if self.delete_affinity(inner, &cidr, rev).await {
                tracing::info!(block = %cidr, "stale affinity record deleted: the block is not this node's");
                fixed += 1;
            } else {
                failed = true;
            }
        }
        for (key, rev) in junk {
            let done = self
                .store
                .txn(
                    &[Compare::Revision(key.clone(), rev)],
                    &[Op::Delete(key.clone())],
                    Durability::Process,
                )
                .await?;
            if done.is_some() {
                tracing::warn!(%key, "affinity record that is not calix's deleted");
                fixed += 1;
            } else {
                failed = true;
            }
        }
        inner.affinities_dirty = failed;
        Ok(fixed)
    }
}
