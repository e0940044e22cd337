//! IPAM without an agent: what `calixctl --kubeconfig` does with the cluster's records
//! directly (`ipam show`, `check`, `release`), for a cluster whose agents are down or
//! unreachable. The same reports as through an agent ([`super::service::report`]) and the same
//! commit point: a release is one compare-and-swap on the address's block, through the pure
//! allocator's `release_address`; the handle record follows, best effort (the owning node's
//! housekeeping repairs it otherwise).
use std::net::IpAddr;
use std::time::Duration;

use calix_core::ipam::allocator::IpamState;
use calix_core::ipam::pool::PoolSpec;
use calix_core::ipam::{HandleRecord, Pool};
use calix_core::store::keys;

use super::service::report::{self, Snapshot};
use super::service::{CheckReport, IpamReport};
use crate::error::AgentError;
use calix_datastore::{Compare, Datastore, DatastoreError, Durability, Op};

/// Where IPPool objects are (the `kubernetes` datastore's pools).
const POOLS: &str = "pools/";
/// Compare-and-swap attempts of a release.
const ATTEMPTS: u32 = 32;

/// The pools the store holds (IPPool objects), none disabled by a node's selection: who
/// asks is no node. An IPPool that does not decode is skipped (logged).
async fn pools(store: &dyn Datastore) -> Result<Vec<Pool>, AgentError> {
    let mut out = Vec::new();
    for kv in store.list(POOLS).await? {
        let p: PoolSpec = match kv.decode() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(key = %kv.key, error = %e, "IPPool not understood; skipped");
                continue;
            }
        };
        out.push(Pool {
            cidr: p.cidr.trunc(),
            block_size: p.block_size(),
            disabled: p.disabled,
            restricted: p.namespace_selector.is_some(),
            previous_block_sizes: p.previous_block_sizes.clone(),
        });
    }
    Ok(out)
}

/// `ipam show` of the whole store (no node's free count: 0).
pub async fn show(store: &dyn Datastore) -> Result<IpamReport, AgentError> {
    let pools = pools(store).await?;
    let snap: Snapshot = report::snapshot(store, &pools).await?;
    Ok(report::report(&snap, &pools, "", (0, 0)))
}

/// `ipam check` of the whole store.
pub async fn check(store: &dyn Datastore) -> Result<CheckReport, AgentError> {
    Ok(report::check(
        &report::snapshot(store, &pools(store).await?).await?,
    ))
}

/// Releases `addr` if it is allocated (and still allocation `seq` when given): one
/// compare-and-swap on its block, retried on a lost race. Whether it was released.
pub async fn release(
    store: &dyn Datastore,
    addr: IpAddr,
    seq: Option<u64>,
    reason: &str,
) -> Result<bool, AgentError> {
    let pools = pools(store).await?;
    for attempt in 0..ATTEMPTS {
        let (kvs, revision) = store.list_with_revision(keys::BLOCKS).await?;
        // Only a block that counts is released from: the agents' own rule.
        let sorted = calix_core::ipam::wellformed::sort(&kvs, &pools);
        let mut view = IpamState::default();
        view.replace(sorted.counted, Vec::new(), revision);
        let Some((key, gone)) = view.release_address(addr, seq) else {
            return Ok(false);
        };
        let Some(block) = view.blocks.get(&key) else {
            return Ok(false);
        };
        let k = keys::block(&block.cidr);
        let done = store
            .txn(
                &[Compare::Revision(k.clone(), block.revision)],
                &[Op::put_json(k, block)],
                Durability::Process,
            )
            .await?;
        if done.is_some() {
            tracing::info!(handle = %gone.handle, ifname = %gone.ifname, %addr, seq = gone.seq,
                %reason, "released");
            follow_record(store, &gone.handle, &gone.ifname, addr, gone.seq).await;
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt + 1))).await;
    }
    Err(DatastoreError::Contended {
        attempts: ATTEMPTS,
        what: format!("release of {addr}"),
    }
    .into())
}

/// Takes `addr` (`seq`) out of (handle, ifname)'s record: rewritten, or deleted when it held
/// nothing else; compared at the revision read. A failure is left to the owning node's
/// housekeeping.
async fn follow_record(store: &dyn Datastore, handle: &str, ifname: &str, addr: IpAddr, seq: u64) {
    let key = keys::handle(handle, ifname);
    let Ok(Some(kv)) = store.get(&key).await else {
        return;
    };
    let Ok(mut rec) = kv.decode::<HandleRecord>() else {
        return;
    };
    rec.addresses.retain(|h| !(h.addr == addr && h.seq == seq));
    let op = if rec.addresses.is_empty() {
        Op::Delete(key.clone())
    } else {
        Op::put_json(key.clone(), &rec)
    };
    if let Err(e) = store
        .txn(
            &[Compare::Revision(key.clone(), kv.revision)],
            &[op],
            Durability::Process,
        )
        .await
    {
        tracing::warn!(%key, error = %e, "handle record not updated; its node's housekeeping repairs it");
    }
}
