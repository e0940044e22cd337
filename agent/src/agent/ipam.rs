//! Allocation and release: the allocator's decisions committed with compare-and-swap.
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;

use calix_proto::handle;
use ipnet::IpNet;

use super::{cas_backoff, Agent, AgentError, Inner, CAS_ATTEMPTS};
use crate::datastore::{keys, Compare, DatastoreError, Durability, Op};
use crate::ipam::{pool_of, Allocation, HandleRecord, Held};
use crate::model::EndpointRecord;

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

impl Agent {
    /// Allocates the requested families for (handle, ifname). All-or-nothing: the handle
    /// record and every block change are one transaction. Returns the addresses with their
    /// pools, and whether the handle already held them.
    pub async fn allocate(
        &self,
        handle: &str,
        ifname: &str,
        v4: bool,
        v6: bool,
        requested: &[IpAddr],
        attributes: &BTreeMap<String, String>,
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
        let hkey = keys::handle(handle, ifname);
        let mut inner = self.inner.lock().await;
        for attempt in 0..CAS_ATTEMPTS {
            // Idempotency: a handle that holds addresses gets them back.
            if let Some(kv) = self.store.get(&hkey).await? {
                let rec: HandleRecord = kv.decode()?;
                let held = |fam: bool| rec.addresses.iter().find(|h| h.addr.is_ipv4() == fam);
                for (want, fam) in [(want_v4, true), (want_v6, false)] {
                    let Some(h) = held(fam) else {
                        if want {
                            return Err(AgentError::Invalid(format!(
                                "{handle}/{ifname} already holds {} but not {}: release it first",
                                rec.addresses
                                    .iter()
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
                            return Err(crate::ipam::IpamError::HeldOther {
                                handle: handle.into(),
                                ifname: ifname.into(),
                                held: h.addr,
                                addr: *r,
                            }
                            .into());
                        }
                    }
                }
                let out = rec.addresses.iter().map(|h| (h.addr, h.pool)).collect();
                drop(inner);
                // The record may be a concurrent allocation's, not yet flushed.
                self.store.sync(kv.revision).await?;
                return Ok((out, true));
            }
            let pools = self.pools();
            let policy = self.policy();
            let mut got = Vec::new();
            let mut failure = None;
            for (want, fam) in [(want_v4, true), (want_v6, false)] {
                if !want {
                    continue;
                }
                let r = match requested.iter().find(|a| a.is_ipv4() == fam) {
                    Some(addr) => inner.ipam.allocate_specific(
                        &pools,
                        &self.node.name,
                        handle,
                        ifname,
                        *addr,
                        attributes,
                    ),
                    None => inner.ipam.allocate(
                        &pools,
                        &policy,
                        &self.node.name,
                        handle,
                        ifname,
                        fam,
                        attributes,
                    ),
                };
                match r {
                    Ok(a) => got.push(a),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = failure {
                // Undo the other family's change in the view.
                if !got.is_empty() {
                    self.refresh_blocks(&mut inner).await?;
                }
                return Err(e.into());
            }
            let rec = HandleRecord {
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
            let touched: Vec<String> = got.iter().map(|a| a.block.clone()).collect();
            // Appended now, flushed below: the flush waits outside `inner`, so the allocations
            // queued behind this one are computed and appended meanwhile and share a flush
            // (group commit). Nothing is acknowledged before its flush.
            let committed = self
                .commit_blocks(
                    &mut inner,
                    &touched,
                    vec![Compare::Absent(hkey.clone())],
                    vec![Op::put_json(hkey.clone(), &rec)],
                    Durability::Process,
                )
                .await?;
            if let Some(rev) = committed {
                drop(inner);
                self.store.sync(rev).await?;
                for a in &got {
                    tracing::info!(%handle, %ifname, addr = %a.addr, seq = a.seq, block = %a.block,
                        borrowed = a.borrowed, attempt, "allocated");
                }
                return Ok((got.into_iter().map(|a| (a.addr, a.pool)).collect(), false));
            }
            tracing::debug!(%handle, attempt, "allocation lost a race; retrying");
            cas_backoff(attempt).await;
        }
        Err(DatastoreError::Contended {
            attempts: CAS_ATTEMPTS,
            what: format!("allocation for {handle}/{ifname}"),
        }
        .into())
    }

    /// What (handle, ifname) holds — or, when nothing, what the previous plugin's handle for
    /// the same attachment holds (an allocation made before an upgrade).
    pub async fn lookup(
        &self,
        handle: &str,
        ifname: &str,
    ) -> Result<Vec<(IpAddr, IpNet)>, AgentError> {
        let held = |kv: crate::datastore::KeyValue| -> Result<Vec<(IpAddr, IpNet)>, AgentError> {
            Ok(kv
                .decode::<HandleRecord>()?
                .addresses
                .into_iter()
                .map(|h| (h.addr, h.pool))
                .collect())
        };
        if let Some(kv) = self.store.get(&keys::handle(handle, ifname)).await? {
            return held(kv);
        }
        let mut inner = self.inner.lock().await;
        match self.legacy_handle(&mut inner, handle, ifname).await? {
            Some(legacy) => match self.store.get(&keys::handle(&legacy, ifname)).await? {
                Some(kv) => held(kv),
                None => Ok(Vec::new()),
            },
            None => Ok(Vec::new()),
        }
    }

    /// The previous plugin's handle (`<network>.<containerID>`) of the attachment `handle`
    /// names, when it holds addresses for `ifname` that were allocated for that very container.
    /// Its encoding is ambiguous (`a.b.c`: network `a` or `a.b`), so ownership is proven by the
    /// container ID every allocation of the plugin carries, never assumed.
    async fn legacy_handle(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
    ) -> Result<Option<String>, AgentError> {
        let Some((network, container_id)) = handle::decode(handle) else {
            return Ok(None);
        };
        let legacy = handle::legacy(network, container_id);
        let Some(kv) = self.store.get(&keys::handle(&legacy, ifname)).await? else {
            return Ok(None);
        };
        let rec: HandleRecord = kv.decode()?;
        if rec.addresses.is_empty() {
            return Ok(None);
        }
        for refreshed in [false, true] {
            let ours = rec.addresses.iter().all(|h| {
                inner
                    .ipam
                    .block_of(h.addr)
                    .and_then(|b| b.allocations.get(&b.offset_of(h.addr)?))
                    .is_some_and(|a| {
                        a.seq == h.seq
                            && a.handle == legacy
                            && attachment_of(a) == Some((network, container_id))
                    })
            });
            if ours {
                return Ok(Some(legacy));
            }
            if !refreshed {
                self.refresh_blocks(inner).await?;
            }
        }
        Ok(None)
    }

    /// Releases what (handle, ifname) holds. Idempotent; returns what was released.
    pub async fn release(&self, handle: &str, ifname: &str) -> Result<Vec<IpAddr>, AgentError> {
        let mut inner = self.inner.lock().await;
        self.release_attachment_locked(&mut inner, handle, ifname, None, "released by CNI DEL")
            .await
    }

    /// [`Self::release_handle_locked`] for an attachment's handle; when that held nothing,
    /// also what the previous plugin's handle for the same attachment holds.
    pub(super) async fn release_attachment_locked(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        extra: Option<Op>,
        reason: &str,
    ) -> Result<Vec<IpAddr>, AgentError> {
        let mut released = self
            .release_handle_locked(inner, handle, ifname, extra, reason)
            .await?;
        if released.is_empty() {
            if let Some(legacy) = self.legacy_handle(inner, handle, ifname).await? {
                released = self
                    .release_handle_locked(inner, &legacy, ifname, None, reason)
                    .await?;
            }
        }
        Ok(released)
    }

    /// Releases every address of (handle, ifname) — each only if its block still holds that
    /// very allocation (sequence number) — deletes the handle record, and applies `extra`, in
    /// one transaction.
    pub(super) async fn release_handle_locked(
        &self,
        inner: &mut Inner,
        handle: &str,
        ifname: &str,
        extra: Option<Op>,
        reason: &str,
    ) -> Result<Vec<IpAddr>, AgentError> {
        let hkey = keys::handle(handle, ifname);
        for attempt in 0..CAS_ATTEMPTS {
            let Some(kv) = self.store.get(&hkey).await? else {
                if let Some(op) = &extra {
                    self.store
                        .txn(&[], std::slice::from_ref(op), Durability::Process)
                        .await?;
                }
                return Ok(Vec::new());
            };
            let rec: HandleRecord = kv.decode()?;
            if rec
                .addresses
                .iter()
                .any(|h| inner.ipam.block_of(h.addr).is_none())
            {
                self.refresh_blocks(inner).await?;
            }
            let mut touched = BTreeSet::new();
            let mut released = Vec::new();
            for h in &rec.addresses {
                if let Some((block, _)) = inner.ipam.release_address(h.addr, Some(h.seq)) {
                    touched.insert(block);
                    released.push(h.addr);
                }
            }
            let touched: Vec<String> = touched.into_iter().collect();
            let mut ops = vec![Op::Delete(hkey.clone())];
            ops.extend(extra.clone());
            if self
                .commit_blocks(
                    inner,
                    &touched,
                    vec![Compare::Revision(hkey.clone(), kv.revision)],
                    ops,
                    Durability::Process,
                )
                .await?
                .is_some()
            {
                for addr in &released {
                    tracing::info!(%handle, %ifname, %addr, %reason, "released");
                }
                return Ok(released);
            }
            cas_backoff(attempt).await;
        }
        Err(DatastoreError::Contended {
            attempts: CAS_ATTEMPTS,
            what: format!("release of {handle}/{ifname}"),
        }
        .into())
    }

    /// Releases one address (calixctl, leak GC) — only if it is still allocation `seq` when
    /// given — and removes it from its handle's record. Returns whether it was released.
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
            if inner.ipam.block_of(addr).is_none() {
                self.refresh_blocks(inner).await?;
            }
            let Some((block, gone)) = inner.ipam.release_address(addr, seq) else {
                return Ok(false);
            };
            let hkey = keys::handle(&gone.handle, &gone.ifname);
            let mut compares = Vec::new();
            let mut ops = Vec::new();
            match self.store.get(&hkey).await? {
                Some(kv) => {
                    let mut rec: HandleRecord = kv.decode()?;
                    compares.push(Compare::Revision(hkey.clone(), kv.revision));
                    rec.addresses
                        .retain(|h| !(h.addr == addr && h.seq == gone.seq));
                    ops.push(if rec.addresses.is_empty() {
                        Op::Delete(hkey.clone())
                    } else {
                        Op::put_json(hkey.clone(), &rec)
                    });
                }
                None => compares.push(Compare::Absent(hkey.clone())),
            }
            if self
                .commit_blocks(inner, &[block], compares, ops, Durability::Process)
                .await?
                .is_some()
            {
                tracing::info!(handle = %gone.handle, ifname = %gone.ifname, %addr, seq = gone.seq,
                    %reason, "released");
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

    /// CNI GC: releases every allocation of this node for `network` whose (containerID,
    /// ifname) is not in `valid`, and forgets (and detaches) the endpoints of those
    /// attachments. The runtime's list is authoritative, so this is immediate (leak GC, for
    /// allocations nobody vouches for, waits a grace period). Returns the released addresses
    /// and the forgotten endpoints.
    pub async fn gc(
        &self,
        network: &str,
        valid: &HashSet<(String, String)>,
    ) -> Result<(Vec<IpAddr>, Vec<EndpointRecord>), AgentError> {
        if !handle::is_cni_name(network) {
            return Err(AgentError::Invalid(format!(
                "{network:?} is not a CNI network name"
            )));
        }
        // Exactly this network's attachments: `k8s` never matches `k8s.x`'s.
        let is_stale = |attachment: Option<(&str, &str)>, ifname: &str| {
            attachment.is_some_and(|(net, cid)| {
                net == network && !valid.contains(&(cid.to_string(), ifname.to_string()))
            })
        };
        let mut eps = self.eps.lock().await;
        let stale_eps: Vec<EndpointRecord> = eps
            .endpoints
            .values()
            .filter(|e| {
                is_stale(
                    handle::attachment(&e.handle, Some(&e.container_id)),
                    &e.ifname,
                )
            })
            .cloned()
            .collect();
        for ep in &stale_eps {
            if let Err(e) = eps.dataplane.detach(&ep.host_ifname) {
                tracing::warn!(host_ifname = %ep.host_ifname, error = %e, "GC: detach failed");
            }
            eps.attached.remove(&ep.host_ifname);
            let op = Op::Delete(keys::endpoint(
                &self.node.name,
                &ep.container_id,
                &ep.ifname,
            ));
            self.store.txn(&[], &[op], Durability::Process).await?;
            eps.endpoints
                .remove(&EndpointRecord::key(&ep.container_id, &ep.ifname));
        }
        let mut inner = self.inner.lock().await;
        self.refresh_blocks(&mut inner).await?;
        let handles: BTreeSet<(String, String)> = inner
            .ipam
            .allocations_of(&self.node.name)
            .filter(|(_, a)| is_stale(attachment_of(a), &a.ifname))
            .map(|(_, a)| (a.handle.clone(), a.ifname.clone()))
            .collect();
        let mut released = Vec::new();
        for (handle, ifname) in handles {
            released.extend(
                self.release_handle_locked(
                    &mut inner,
                    &handle,
                    &ifname,
                    None,
                    "not in the runtime's valid attachments (CNI GC)",
                )
                .await?,
            );
        }
        Ok((released, stale_eps))
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
