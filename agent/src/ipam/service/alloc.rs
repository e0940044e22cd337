//! Allocation and release by handle. The block is the truth and the commit point: every
//! allocation or release is one compare-and-swap on exactly one block object. Handle records
//! (`ipam/handles/<handle>/<ifname>`) are an index that follows: written after the block's
//! commit, best effort, checked against the blocks by every read, and rebuilt from the blocks
//! by [`IpamService::repair_handles`] (at start and in housekeeping).
//!
//! The view (`Inner::ipam`) holds every allocation this agent committed (its writes update it,
//! a failed write marks it stale and it is listed again before the next decision), so the
//! allocations of a handle are found in memory; what is answered without a write (an idempotent
//! ADD, CHECK's lookup) is read again from the store first, and everything else is checked by
//! the compare-and-swap of the write that acts on it.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use calix_core::ipam::{pool_of, Allocated, Allocation, HandleRecord, Held, PoolChoice};
use calix_proto::handle;
use ipnet::IpNet;

use super::records::Stored;
use super::{cas_backoff, Inner, IpamService, CAS_ATTEMPTS};
use crate::error::AgentError;
use calix_datastore::{DatastoreError, Durability};

/// The (network, container ID) an allocation was made for, if a CNI plugin made it: from its
/// handle, or for a handle of the previous plugin's encoding, with the container ID stored
/// beside it.
pub(super) fn attachment_of(a: &Allocation) -> Option<(&str, &str)> {
    handle::attachment(
        &a.handle,
        a.attributes
            .get(handle::CONTAINER_ID_ATTRIBUTE)
            .map(String::as_str),
    )
}

/// One allocation of a (handle, ifname), as its block holds it.
#[derive(Debug, Clone)]
pub(super) struct Holding {
    addr: IpAddr,
    allocation: Allocation,
    /// Revision of the block it was read from.
    revision: i64,
}

impl IpamService {
    /// Allocates the requested families for (handle, ifname): one block commit per family, the
    /// first rolled back if the second fails (an agent that dies in between leaves one family
    /// allocated without an endpoint: found by handle, released by DEL, reclaimed by leak GC).
    /// Then the handle record, best effort. Returns the addresses with their pools, and
    /// whether the handle already held them.
    pub async fn allocate(
        &self,
        handle: &str,
        ifname: &str,
        v4: bool,
        v6: bool,
        requested: &[IpAddr],
        attributes: &BTreeMap<String, String>,
    ) -> Result<(Vec<(IpAddr, IpNet)>, bool), AgentError> {
        self.allocate_from(
            handle,
            ifname,
            v4,
            v6,
            requested,
            attributes,
            &PoolChoice::default(),
        )
        .await
    }

    /// [`IpamService::allocate`] from the pools `choice` allows (a pod's: the pools its
    /// namespace may use, narrowed by its `calix.dev/ipv4pools` / `ipv6pools`); the default
    /// choice uses every pool without a namespaceSelector. A requested address too must lie
    /// in a pool the choice allows.
    #[allow(clippy::too_many_arguments)]
    pub async fn allocate_from(
        &self,
        handle: &str,
        ifname: &str,
        v4: bool,
        v6: bool,
        requested: &[IpAddr],
        attributes: &BTreeMap<String, String>,
        choice: &PoolChoice,
    ) -> Result<(Vec<(IpAddr, IpNet)>, bool), AgentError> {
        if handle.is_empty() || ifname.is_empty() || handle.contains('/') || ifname.contains('/') {
            return Err(AgentError::Invalid(
                "handle and ifname are required and may not contain '/'".into(),
            ));
        }
        // A requested address replaces the automatic one of its family.
        let want_v4 = v4 || requested.iter().any(IpAddr::is_ipv4);
        let want_v6 = v6 || requested.iter().any(IpAddr::is_ipv6);
        if !want_v4 && !want_v6 {
            return Err(AgentError::Invalid(
                "ask for at least one of ipv4, ipv6".into(),
            ));
        }
        let mut inner = self.inner.lock().await;
        let (held, stored) = self.held(&mut inner, handle, ifname, true).await?;
        if !held.is_empty() {
            // Idempotency: a handle that holds addresses gets them back.
            let of = |fam: bool| held.iter().find(|h| h.addr.is_ipv4() == fam);
            for (want, fam) in [(want_v4, true), (want_v6, false)] {
                let Some(h) = of(fam) else {
                    if want {
                        return Err(AgentError::Invalid(format!(
                            "{handle}/{ifname} already holds {} but not {}: release it first",
                            held.iter()
                                .map(|h| h.addr.to_string())
                                .collect::<Vec<_>>()
                                .join(", "),
                            if fam { "IPv4" } else { "IPv6" }
                        )));
                    }
                    continue;
                };
                if let Some(r) = requested.iter().find(|a| a.is_ipv4() == fam) {
                    if *r != h.addr {
                        return Err(calix_core::ipam::IpamError::HeldOther {
                            handle: handle.into(),
                            ifname: ifname.into(),
                            held: h.addr,
                            addr: *r,
                        }
                        .into());
                    }
                }
            }
            let out = held
                .iter()
                .map(|h| (h.addr, self.pool_of(h.addr)))
                .collect();
            let revision = held.iter().map(|h| h.revision).max().unwrap_or(0);
            // A missing or stale record is rewritten from the blocks.
            let desired = self.record_of(held.iter().map(|h| (h.addr, &h.allocation)));
            self.write_record(&mut inner, handle, ifname, &stored, desired.as_ref())
                .await;
            drop(inner);
            // The allocation may be a concurrent request's, not yet flushed.
            self.store.sync(revision).await?;
            return Ok((out, true));
        }
        let mut got: Vec<Allocated> = Vec::new();
        let mut revision = 0;
        for (want, fam) in [(want_v4, true), (want_v6, false)] {
            if !want {
                continue;
            }
            let requested = requested.iter().find(|a| a.is_ipv4() == fam).copied();
            match self
                .allocate_family(
                    &mut inner, handle, ifname, fam, requested, attributes, choice,
                )
                .await
            {
                Ok((a, rev)) => {
                    revision = revision.max(rev);
                    got.push(a);
                }
                Err(e) => {
                    // All or nothing. A rollback that fails leaves an allocation without an
                    // endpoint, which leak GC reclaims.
                    for a in &got {
                        if let Err(re) = self
                            .release_address_locked(
                                &mut inner,
                                a.addr,
                                Some(a.seq),
                                "rollback: the other family failed",
                            )
                            .await
                        {
                            tracing::warn!(%handle, %ifname, addr = %a.addr, error = %re,
                                "rollback failed; leak GC reclaims the address");
                        }
                    }
                    return Err(e);
                }
            }
        }
        // The blocks are committed: the record follows, best effort.
        let record = HandleRecord {
            node: self.node.name.clone(),
            addresses: got
                .iter()
                .map(|a| Held {
                    addr: a.addr,
                    pool: a.pool,
                    seq: a.seq,
                })
                .collect(),
        };
        self.write_record(&mut inner, handle, ifname, &stored, Some(&record))
            .await;
        drop(inner);
        // Appended under the lock, flushed outside it: the allocations queued behind this one
        // are computed and appended meanwhile and share a flush (group commit). Nothing is
        // acknowledged before its flush.
        self.store.sync(revision).await?;
        Ok((got.into_iter().map(|a| (a.addr, a.pool)).collect(), false))
    }

    /// Allocates one address of a family (`requested`, or the allocator's choice) and commits
    /// its block alone. Returns it with the revision of the commit.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn allocate_family(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        v4: bool,
        requested: Option<IpAddr>,
        attributes: &BTreeMap<String, String>,
        choice: &PoolChoice,
    ) -> Result<(Allocated, i64), AgentError> {
        let mut listed = false;
        let mut lost = false;
        for attempt in 0..CAS_ATTEMPTS {
            if inner.stale {
                self.refresh_blocks(inner).await?;
                listed = true;
            }
            let pools = choice.apply(self.pools(), v4);
            if lost {
                // A lost compare may be this very write, landed on a retried request (the
                // store retried after a connection loss): the handle held nothing of this
                // family when the request began, so an allocation of it now is ours.
                if let Some(ours) = self.landed(inner, &pools, handle, ifname, v4) {
                    tracing::info!(%handle, %ifname, addr = %ours.0.addr, attempt,
                        "allocated (the write reported lost had landed)");
                    return Ok(ours);
                }
            }
            let a = match requested {
                Some(addr) => inner.ipam.allocate_specific(
                    &pools,
                    &self.policy(),
                    &self.node.name,
                    handle,
                    ifname,
                    addr,
                    attributes,
                ),
                None => inner.ipam.allocate(
                    &pools,
                    &self.policy(),
                    &self.node.name,
                    handle,
                    ifname,
                    v4,
                    attributes,
                ),
            }?;
            let creates = inner
                .ipam
                .blocks
                .get(&a.block)
                .is_some_and(|b| b.revision == 0);
            if creates && !listed {
                // A block never stored starts its sequence numbers above the view's revision:
                // decide on a fresh listing (see `IpamState::fresh_block`).
                self.refresh_blocks(inner).await?;
                listed = true;
                continue;
            }
            if let Some(rev) = self
                .commit_block(inner, &a.block, Durability::Process)
                .await?
            {
                tracing::info!(%handle, %ifname, addr = %a.addr, seq = a.seq, block = %a.block,
                    borrowed = a.borrowed, attempt, "allocated");
                return Ok((a, rev));
            }
            listed = true;
            lost = true;
            tracing::debug!(%handle, attempt, "allocation lost a race; retrying");
            cas_backoff(attempt).await;
        }
        Err(DatastoreError::Contended {
            attempts: CAS_ATTEMPTS,
            what: format!("allocation for {handle}/{ifname}"),
        }
        .into())
    }

    /// The view's allocation of (handle, ifname) by this node in family `v4`, with its block's
    /// revision.
    pub(super) fn landed(
        &self,
        inner: &Inner,
        pools: &[calix_core::ipam::Pool],
        handle: &str,
        ifname: &str,
        v4: bool,
    ) -> Option<(Allocated, i64)> {
        let (key, addr, a) = inner
            .ipam
            .held_by(handle, ifname)
            .into_iter()
            .find(|(_, addr, a)| addr.is_ipv4() == v4 && a.node == self.node.name)?;
        let block = inner.ipam.blocks.get(key)?;
        Some((
            Allocated {
                addr,
                pool: pool_of(pools, addr),
                seq: a.seq,
                block: key.to_string(),
                borrowed: block.affinity != self.node.name,
            },
            block.revision,
        ))
    }

    /// What (handle, ifname) holds — or, when nothing, what the previous plugin's handle for
    /// the same attachment holds (an allocation made before an upgrade). Read from the blocks.
    pub async fn lookup(
        &self,
        handle: &str,
        ifname: &str,
    ) -> Result<Vec<(IpAddr, IpNet)>, AgentError> {
        let mut inner = self.inner.lock().await;
        let (mut held, _) = self.held(&mut inner, handle, ifname, true).await?;
        if held.is_empty() {
            if let Some(legacy) = self.legacy_handle(&mut inner, handle, ifname, true).await? {
                held = self.held(&mut inner, &legacy, ifname, true).await?.0;
            }
        }
        Ok(held
            .iter()
            .map(|h| (h.addr, self.pool_of(h.addr)))
            .collect())
    }

    /// The allocations of (handle, ifname) as the blocks hold them, and its stored record.
    ///
    /// The record is only a hint: when it names an address the view does not give this handle,
    /// the view may be behind (or the record stale), and the blocks are listed again. With
    /// `fresh`, for an answer no write will check, the blocks involved are read again.
    pub(super) async fn held(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        fresh: bool,
    ) -> Result<(Vec<Holding>, Stored), AgentError> {
        if inner.stale {
            self.refresh_blocks(inner).await?;
        }
        let stored = self.read_record(handle, ifname).await?;
        let mut listed = false;
        if let Some((_, rec)) = &stored {
            let agrees = rec.addresses.iter().all(|h| {
                inner
                    .ipam
                    .block_of(h.addr)
                    .and_then(|b| b.allocations.get(&b.offset_of(h.addr)?))
                    .is_some_and(|a| a.seq == h.seq && a.handle == handle && a.ifname == ifname)
            });
            if !agrees {
                self.refresh_blocks(inner).await?;
                listed = true;
            }
        }
        if fresh && !listed {
            let cidrs: BTreeSet<IpNet> = inner
                .ipam
                .held_by(handle, ifname)
                .iter()
                .filter_map(|(key, ..)| inner.ipam.blocks.get(*key).map(|b| b.cidr))
                .collect();
            for cidr in cidrs {
                self.reread_block(inner, &cidr).await?;
            }
        }
        let held = inner
            .ipam
            .held_by(handle, ifname)
            .into_iter()
            .map(|(key, addr, a)| Holding {
                addr,
                allocation: a.clone(),
                revision: inner.ipam.blocks.get(key).map_or(0, |b| b.revision),
            })
            .collect();
        Ok((held, stored))
    }

    /// The previous plugin's handle (`<network>.<containerID>`) of the attachment `handle`
    /// names, when the blocks hold addresses of it for `ifname` that were all allocated for that
    /// very container. Its encoding is ambiguous (`a.b.c`: network `a` or `a.b`), so ownership
    /// is proven by the container ID every allocation of the plugin carries, never assumed.
    pub(super) async fn legacy_handle(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        fresh: bool,
    ) -> Result<Option<String>, AgentError> {
        let Some((network, container_id)) = handle::decode(handle) else {
            return Ok(None);
        };
        let legacy = handle::legacy(network, container_id);
        let (held, _) = self.held(inner, &legacy, ifname, fresh).await?;
        let ours = !held.is_empty()
            && held
                .iter()
                .all(|h| attachment_of(&h.allocation) == Some((network, container_id)));
        Ok(ours.then_some(legacy))
    }

    /// CNI GC: releases every allocation of this node whose attachment (network, container
    /// ID; ifname) `stale` says the runtime no longer has. The runtime's list is authoritative,
    /// so this is immediate (leak GC, for allocations nobody vouches for, waits a grace
    /// period). Returns the released addresses.
    pub async fn gc(
        &self,
        stale: &calix_core::model::IsStale<'_>,
    ) -> Result<Vec<IpAddr>, AgentError> {
        let mut inner = self.inner.lock().await;
        self.refresh_blocks(&mut inner).await?;
        let handles: BTreeSet<(String, String)> = inner
            .ipam
            .allocations_of(&self.node.name)
            .filter(|(_, a)| stale(attachment_of(a), &a.ifname))
            .map(|(_, a)| (a.handle.clone(), a.ifname.clone()))
            .collect();
        let mut released = Vec::new();
        for (handle, ifname) in handles {
            released.extend(
                self.release_handle_locked(
                    &mut inner,
                    &handle,
                    &ifname,
                    "not in the runtime's valid attachments (CNI GC)",
                )
                .await?,
            );
        }
        Ok(released)
    }

    /// Free addresses this node can still hand out: (IPv4, IPv6).
    pub async fn free(&self) -> (u64, u64) {
        let pools = self.pools();
        let inner = self.inner.lock().await;
        (
            inner.ipam.free(&pools, &self.node.name, true),
            inner.ipam.free(&pools, &self.node.name, false),
        )
    }

    /// The pool an address belongs to, for display.
    pub fn pool_of(&self, addr: IpAddr) -> IpNet {
        pool_of(&self.pools(), addr)
    }
}
