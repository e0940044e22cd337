//! Housekeeping: leak GC (allocations of this node that no endpoint uses) and the release of
//! this node's empty blocks. Both wait a grace period and recheck before they act, and log
//! every release with its reason.
use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Instant;

use super::{Agent, AgentError};
use crate::datastore::{keys, Compare, Durability, Op};
use crate::ipam::Retired;
use crate::model::EndpointRecord;

/// What one housekeeping pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Leaked addresses released.
    pub released: Vec<IpAddr>,
    /// Allocations now waiting out the grace period.
    pub candidates: usize,
    /// Empty blocks released.
    pub blocks_released: Vec<String>,
}

impl Agent {
    /// One leak-GC and empty-block pass at `now`.
    pub async fn housekeep(&self, now: Instant) -> Result<Swept, AgentError> {
        let mut out = Swept::default();
        // The live endpoints first (the endpoint lock is taken before the IPAM lock).
        let live_now: HashSet<(String, String)> = self
            .eps
            .lock()
            .await
            .endpoints
            .values()
            .map(|e| (e.handle.clone(), e.ifname.clone()))
            .collect();
        let mut inner = self.inner.lock().await;
        self.refresh_blocks(&mut inner).await?;

        // Leaks: allocations of this node whose (handle, ifname) has no endpoint.
        let live = |eps: &std::collections::BTreeMap<String, EndpointRecord>| -> HashSet<(String, String)> {
            eps.values()
                .map(|e| (e.handle.clone(), e.ifname.clone()))
                .collect()
        };
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
            let mut stored = std::collections::BTreeMap::new();
            for kv in self
                .store
                .list(&keys::endpoints_of(&self.node.name))
                .await?
            {
                let ep: EndpointRecord = kv.decode()?;
                stored.insert(EndpointRecord::key(&ep.container_id, &ep.ifname), ep);
            }
            let live_stored = live(&stored);
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

        // Empty blocks of this node.
        let empty: Vec<(String, ipnet::IpNet, i64, u64)> = inner
            .ipam
            .blocks
            .iter()
            .filter(|(_, b)| b.affinity == self.node.name && b.allocations.is_empty())
            .map(|(k, b)| (k.clone(), b.cidr, b.revision, b.next_seq))
            .collect();
        let empty_keys: HashSet<&String> = empty.iter().map(|(k, _, _, _)| k).collect();
        let mut still = inner.empty_since.clone();
        still.retain(|k, _| empty_keys.contains(k));
        inner.empty_since = still;
        for (key, cidr, rev, next_seq) in &empty {
            let first = *inner.empty_since.entry(key.clone()).or_insert(now);
            if now.duration_since(first) < self.housekeeping.empty_block_grace {
                continue;
            }
            let bkey = keys::block(cidr);
            // The block goes, its sequence counter stays: the next claim starts above it.
            let retired = Retired {
                cidr: *cidr,
                next_seq: inner
                    .ipam
                    .retired
                    .get(key)
                    .map_or(*next_seq, |r| r.next_seq.max(*next_seq)),
                revision: 0,
            };
            let done = self
                .store
                .txn(
                    &[Compare::Revision(bkey.clone(), *rev)],
                    &[
                        Op::Delete(bkey),
                        Op::put_json(keys::retired(cidr), &retired),
                    ],
                    Durability::Process,
                )
                .await?;
            inner.empty_since.remove(key);
            if let Some(done) = done {
                inner.ipam.blocks.remove(key);
                inner.ipam.retired.insert(
                    key.clone(),
                    Retired {
                        revision: done,
                        ..retired
                    },
                );
                inner.ipam.revision = inner.ipam.revision.max(done);
                tracing::info!(block = %cidr, empty_for_s = now.duration_since(first).as_secs(),
                    reason = "empty for longer than the grace period", "block released");
                out.blocks_released.push(key.clone());
            }
        }
        Ok(out)
    }
}
