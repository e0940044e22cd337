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
use calix_core::store::keys;
use calix_proto::handle;
use ipnet::IpNet;

use super::{cas_backoff, Inner, IpamService, CAS_ATTEMPTS};
use crate::datastore::{Compare, DatastoreError, Durability, Op};
use crate::error::AgentError;

/// The (network, container ID) an allocation was made for, if a CNI plugin made it: from its
/// handle, or for a handle of the previous plugin's encoding, with the container ID stored
/// beside it.
fn attachment_of(a: &Allocation) -> Option<(&str, &str)> {
    handle::attachment(
        &a.handle,
        a.attributes
            .get(handle::CONTAINER_ID_ATTRIBUTE)
            .map(String::as_str),
    )
}

/// One allocation of a (handle, ifname), as its block holds it.
#[derive(Debug, Clone)]
struct Holding {
    addr: IpAddr,
    allocation: Allocation,
    /// Revision of the block it was read from.
    revision: i64,
}

/// Housekeeping repairs the handle records at least every this many passes.
pub(super) const REPAIR_EVERY: u32 = 10;

/// A handle record as stored: its revision and what it says; `None` when there is none.
type Stored = Option<(i64, HandleRecord)>;

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
    async fn allocate_family(
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
    fn landed(
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
    async fn held(
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

    /// The handle record of (handle, ifname) as stored. One that does not decode is reported
    /// and treated as an empty record, which the next write by handle (or the repair) replaces.
    async fn read_record(&self, handle: &str, ifname: &str) -> Result<Stored, AgentError> {
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
    fn record_of<'a>(
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
    async fn follow_record(&self, inner: &mut Inner, handle: &str, ifname: &str) {
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

    /// The previous plugin's handle (`<network>.<containerID>`) of the attachment `handle`
    /// names, when the blocks hold addresses of it for `ifname` that were all allocated for that
    /// very container. Its encoding is ambiguous (`a.b.c`: network `a` or `a.b`), so ownership
    /// is proven by the container ID every allocation of the plugin carries, never assumed.
    async fn legacy_handle(
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
    async fn fold_legacy_retired(&self, inner: &mut Inner) {
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
