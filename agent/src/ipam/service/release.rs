//! Release by handle, by attachment or by address: one compare-and-swap on the block, then the
//! handle record follows (see [`super::records`]).
use std::net::IpAddr;

use super::{cas_backoff, Inner, IpamService, CAS_ATTEMPTS};
use crate::error::AgentError;
use calix_datastore::{DatastoreError, Durability};

impl IpamService {
    /// Releases what (handle, ifname) holds. Idempotent; returns what was released.
    pub async fn release(&self, handle: &str, ifname: &str) -> Result<Vec<IpAddr>, AgentError> {
        let mut inner = self.inner.lock().await;
        self.release_attachment_locked(&mut inner, handle, ifname, "released by CNI DEL")
            .await
    }

    /// [`Self::release_handle_locked`] for an attachment's handle; when that held nothing,
    /// also what the previous plugin's handle for the same attachment holds.
    pub(super) async fn release_attachment_locked(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        reason: &str,
    ) -> Result<Vec<IpAddr>, AgentError> {
        let mut released = self
            .release_handle_locked(inner, handle, ifname, reason)
            .await?;
        if released.is_empty() {
            if let Some(legacy) = self.legacy_handle(inner, handle, ifname, false).await? {
                released = self
                    .release_handle_locked(inner, &legacy, ifname, reason)
                    .await?;
            }
        }
        Ok(released)
    }

    /// Releases every address this node allocated for (handle, ifname) — one compare-and-swap
    /// per block, each freeing only the very allocations (sequence numbers) the block holds
    /// for it; another node's allocation of the handle is that node's to release — then
    /// deletes its record (best effort: a record left behind names addresses the blocks no
    /// longer give the handle, which reads ignore and the repair deletes).
    pub(super) async fn release_handle_locked(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        reason: &str,
    ) -> Result<Vec<IpAddr>, AgentError> {
        let (_, stored) = self.held(inner, handle, ifname, false).await?;
        let mut released = Vec::new();
        for attempt in 0..CAS_ATTEMPTS {
            // This node's allocations of it only: another node's are that node's to release.
            let held: Vec<(String, IpAddr, u64)> = inner
                .ipam
                .held_by(handle, ifname)
                .into_iter()
                .filter(|(_, _, a)| a.node == self.node.name)
                .map(|(key, addr, a)| (key.to_string(), addr, a.seq))
                .collect();
            let Some((block, ..)) = held.first().cloned() else {
                self.write_record(inner, handle, ifname, &stored, None)
                    .await;
                return Ok(released);
            };
            let freed: Vec<(IpAddr, u64)> = held
                .iter()
                .filter(|(key, ..)| *key == block)
                .filter_map(|(_, addr, seq)| {
                    inner.ipam.release_address(*addr, Some(*seq))?;
                    Some((*addr, *seq))
                })
                .collect();
            if self
                .commit_block(inner, &block, Durability::Process)
                .await?
                .is_some()
            {
                for (addr, seq) in freed {
                    tracing::info!(%handle, %ifname, %addr, seq, %reason, "released");
                    released.push(addr);
                }
                continue;
            }
            cas_backoff(attempt).await;
        }
        Err(DatastoreError::Contended {
            attempts: CAS_ATTEMPTS,
            what: format!("release of {handle}/{ifname}"),
        }
        .into())
    }

    /// Releases one address (calixctl, leak GC, a rollback) — only if it is still allocation
    /// `seq` when given — then brings its handle's record in line. Returns whether it was
    /// released. An address another node allocated is refused
    /// ([`AgentError::ForeignAllocation`]): only that node's agent writes its allocations (the
    /// kubernetes datastore's node authority would refuse the write anyway).
    pub async fn release_address(
        &self,
        addr: IpAddr,
        seq: Option<u64>,
        reason: &str,
    ) -> Result<bool, AgentError> {
        let mut inner = self.inner.lock().await;
        self.release_address_locked(&mut inner, addr, seq, reason)
            .await
    }

    pub(super) async fn release_address_locked(
        &self,
        inner: &mut Inner,
        addr: IpAddr,
        seq: Option<u64>,
        reason: &str,
    ) -> Result<bool, AgentError> {
        for attempt in 0..CAS_ATTEMPTS {
            if inner.stale || inner.ipam.block_of(addr).is_none() {
                self.refresh_blocks(inner).await?;
            }
            let owner = inner
                .ipam
                .block_of(addr)
                .and_then(|b| b.allocations.get(&b.offset_of(addr)?))
                .filter(|a| seq.is_none_or(|s| s == a.seq))
                .map(|a| a.node.clone());
            if let Some(node) = owner.filter(|n| *n != self.node.name) {
                return Err(AgentError::ForeignAllocation { addr, node });
            }
            let Some((block, gone)) = inner.ipam.release_address(addr, seq) else {
                return Ok(false);
            };
            if self
                .commit_block(inner, &block, Durability::Process)
                .await?
                .is_some()
            {
                tracing::info!(handle = %gone.handle, ifname = %gone.ifname, %addr, seq = gone.seq,
                    %reason, "released");
                self.follow_record(inner, &gone.handle, &gone.ifname).await;
                return Ok(true);
            }
            cas_backoff(attempt).await;
        }
        Err(DatastoreError::Contended {
            attempts: CAS_ATTEMPTS,
            what: format!("release of {addr}"),
        }
        .into())
    }
}
