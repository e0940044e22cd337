//! The agent's core: IPAM and the endpoint registry over one datastore and one dataplane.
//! Nothing is acknowledged before the datastore has it; every write is one object, and IPAM
//! writes are compare-and-swap on one block's revision, so agents sharing a datastore never
//! hand out an address twice.
mod ipam;
mod leak;
mod report;
mod snat;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use calix_common::EndpointCounters;
use tokio::sync::Mutex;

use crate::dataplane::{Attached, Dataplane, DataplaneError, DataplaneStats, EndpointSpec};
use crate::datastore::{keys, Datastore, DatastoreError, Durability, Op};
use crate::ipam::{Block, IpamError, IpamState, Policy, Pool, Retired};
use crate::model::{EndpointRecord, NodeRecord};
use ipnet::IpNet;

pub use leak::Swept;
pub use report::{BlockUse, CheckReport, Finding, IpamReport, NodeUse, PoolUse};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Ipam(#[from] IpamError),
    #[error(transparent)]
    Datastore(#[from] DatastoreError),
    #[error("programming endpoint {host_ifname} failed")]
    Dataplane {
        host_ifname: String,
        #[source]
        source: DataplaneError,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("pool change refused: {0}")]
    PoolChange(String),
}

/// One endpoint with its live dataplane state, for listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointView {
    pub record: EndpointRecord,
    pub ifindex: Option<u32>,
    pub bpf_attached: bool,
    pub counters: Option<EndpointCounters>,
}

/// One drop counter, for calixctl and /metrics.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DropView {
    pub ifindex: u32,
    pub ifname: Option<String>,
    pub reason: String,
    pub packets: u64,
    pub bytes: u64,
}

/// Timings of the background IPAM housekeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Housekeeping {
    pub leak_grace: Duration,
    pub empty_block_grace: Duration,
}

/// IPAM state, behind its own lock.
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
}

/// The endpoint registry and the dataplane, behind another lock: programming an endpoint
/// (netlink, waiting for the RTNL lock other ADDs hold) never stalls allocations.
struct Eps {
    /// This node's endpoints, keyed by "containerID/ifname".
    endpoints: BTreeMap<String, EndpointRecord>,
    dataplane: Box<dyn Dataplane>,
    /// Endpoint key ("containerID/ifname") → attach result, for endpoints programmed by this
    /// process.
    attached: BTreeMap<String, Attached>,
}

/// Lock order, where both are needed: `eps`, then `inner`.
pub struct Agent {
    node: NodeRecord,
    pools: RwLock<(Vec<Pool>, Policy)>,
    housekeeping: Housekeeping,
    store: Box<dyn Datastore>,
    inner: Mutex<Inner>,
    eps: Mutex<Eps>,
    /// The dataplane's counters, read without the `eps` lock.
    stats: Option<Box<dyn DataplaneStats>>,
    /// SNAT's conntrack table (pin directory, settings), once the eBPF dataplane is up.
    conntrack: std::sync::OnceLock<(std::path::PathBuf, calix_common::NatConfig)>,
}

/// Attempts at a compare-and-swap write before giving up (each after re-reading).
const CAS_ATTEMPTS: u32 = 64;

impl Agent {
    /// Reads this node's state from the datastore, records the node, and checks the pools
    /// against the addresses the node holds.
    pub async fn new(
        node: NodeRecord,
        pools: Vec<Pool>,
        policy: Policy,
        housekeeping: Housekeeping,
        store: Box<dyn Datastore>,
        dataplane: Box<dyn Dataplane>,
    ) -> Result<Self, AgentError> {
        if node.name.is_empty() {
            return Err(AgentError::Invalid("node name is empty".into()));
        }
        let mut endpoints = BTreeMap::new();
        for kv in store.list(&keys::endpoints_of(&node.name)).await? {
            let ep: EndpointRecord = kv.decode()?;
            endpoints.insert(EndpointRecord::key(&ep.container_id, &ep.ifname), ep);
        }
        store
            .txn(
                &[],
                &[Op::put_json(keys::node(&node.name), &node)],
                Durability::Process,
            )
            .await?;
        let stats = dataplane.stats().map_err(|source| AgentError::Dataplane {
            host_ifname: String::new(),
            source,
        })?;
        let agent = Self {
            node,
            pools: RwLock::new((Vec::new(), policy)),
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
            }),
            eps: Mutex::new(Eps {
                endpoints,
                dataplane,
                attached: BTreeMap::new(),
            }),
            stats,
            conntrack: std::sync::OnceLock::new(),
        };
        {
            let mut inner = agent.inner.lock().await;
            agent.refresh_blocks(&mut inner).await?;
            agent.check_pools(&inner.ipam, &pools)?;
            agent.set_pools_unchecked(pools, policy);
            // An agent that died between a block's commit and its handle record left the
            // record missing (or stale): rebuild the records from the blocks first thing.
            if let Err(e) = agent.repair_handles(&mut inner).await {
                tracing::warn!(error = %e, "handle records not repaired at start; housekeeping retries");
            }
        }
        Ok(agent)
    }

    pub fn node(&self) -> &str {
        &self.node.name
    }

    pub fn datastore_kind(&self) -> &'static str {
        self.store.kind()
    }

    pub fn pools(&self) -> Vec<Pool> {
        self.pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
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
        let cidrs: Vec<ipnet::IpNet> = pools.iter().map(|p| p.cidr).collect();
        self.set_pools_unchecked(pools, policy);
        drop(inner);
        if let Err(e) = self.eps.lock().await.dataplane.set_pools(&cidrs) {
            tracing::warn!(error = %e, "cannot give the dataplane the new pools");
        }
        Ok(())
    }

    fn check_pools(&self, ipam: &IpamState, pools: &[Pool]) -> Result<(), AgentError> {
        for (addr, a) in ipam.allocations_of(&self.node.name) {
            if !pools.iter().any(|p| p.cidr.contains(&addr)) {
                let block = ipam
                    .block_of(addr)
                    .map(|b| b.cidr.to_string())
                    .unwrap_or_default();
                let was = self
                    .pools()
                    .iter()
                    .find(|p| p.cidr.contains(&addr))
                    .map(|p| format!("pool {}", p.cidr))
                    .unwrap_or_else(|| format!("the pool of block {block}"));
                return Err(AgentError::PoolChange(format!(
                    "{was} no longer contains {addr}, which {}/{} still holds: \
                     keep the pool (set disabled = true to stop new allocations) until its \
                     addresses are released",
                    a.handle, a.ifname
                )));
            }
        }
        Ok(())
    }

    /// Re-reads every block (released ones included, and the previous version's retired-block
    /// records) from the datastore.
    /// Until it succeeds the view counts as stale: a caller that changed the view and could
    /// not commit leaves it to be listed again before the next decision.
    async fn refresh_blocks(&self, inner: &mut Inner) -> Result<(), AgentError> {
        inner.stale = true;
        let (kvs, revision) = self.store.list_with_revision(keys::BLOCKS).await?;
        let mut blocks = Vec::new();
        for kv in kvs {
            let mut b: Block = kv.decode()?;
            b.revision = kv.revision;
            blocks.push(b);
        }
        let mut retired = Vec::new();
        let mut legacy = Vec::new();
        for kv in self.store.list(keys::RETIRED).await? {
            let r: Retired = kv.decode()?;
            legacy.push((r.cidr, kv.revision));
            retired.push(r);
        }
        inner.ipam.replace(blocks, retired, revision);
        inner.legacy_retired = legacy;
        inner.stale = false;
        Ok(())
    }

    /// Reads one block again into the view (gone: out of the view).
    async fn reread_block(&self, inner: &mut Inner, cidr: &IpNet) -> Result<(), AgentError> {
        match self.store.get(&keys::block(cidr)).await? {
            Some(kv) => {
                let mut b: Block = kv.decode()?;
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
        use crate::datastore::Compare;
        let Some(b) = inner.ipam.blocks.get(key) else {
            return Ok(None);
        };
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
                if let Some(mut b) = inner.ipam.blocks.remove(key) {
                    b.revision = rev;
                    // A released block moves to the retired; a claimed one leaves them.
                    inner.ipam.put_block(b);
                }
                inner.ipam.revision = inner.ipam.revision.max(rev);
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

    /// Records the endpoint and programs the dataplane for it; returns once both are done.
    ///
    /// Another endpoint recorded on the same host interface name is an older sandbox of the
    /// same pod (the plugin replaced its veth): its record is deleted first, its addresses kept
    /// until its own DEL (or leak GC) releases them. One object per write: an agent that dies
    /// between the two leaves the new endpoint unrecorded, as if its ADD had failed.
    pub async fn register(&self, ep: EndpointRecord) -> Result<Attached, AgentError> {
        if ep.container_id.is_empty() || ep.ifname.is_empty() || ep.host_ifname.is_empty() {
            return Err(AgentError::Invalid(
                "container_id, ifname and host_ifname are required".into(),
            ));
        }
        let key = ep.id();
        let mut eps = self.eps.lock().await;
        let t0 = Instant::now();
        let retired: Vec<EndpointRecord> = eps
            .endpoints
            .values()
            .filter(|o| o.host_ifname == ep.host_ifname && o.id() != key)
            .cloned()
            .collect();
        let spec = EndpointSpec::from_record(&ep);
        let attached =
            blocking(|| eps.dataplane.attach(&spec)).map_err(|source| AgentError::Dataplane {
                host_ifname: ep.host_ifname.clone(),
                source,
            })?;
        let t_attach = t0.elapsed();
        let mut ops: Vec<Op> = retired
            .iter()
            .map(|r| Op::Delete(keys::endpoint(&self.node.name, &r.container_id, &r.ifname)))
            .collect();
        ops.push(Op::put_json(
            keys::endpoint(&self.node.name, &ep.container_id, &ep.ifname),
            &ep,
        ));
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = self
                .store
                .txn(&[], std::slice::from_ref(op), Durability::Process)
                .await
            {
                // Not durable: undo the attach so nothing runs that the registry doesn't know.
                let _ = eps.dataplane.detach(&key);
                for r in &retired[..i.min(retired.len())] {
                    eps.endpoints.remove(&r.id());
                    eps.attached.remove(&r.id());
                }
                return Err(e.into());
            }
        }
        for r in &retired {
            eps.endpoints.remove(&r.id());
            eps.attached.remove(&r.id());
            tracing::info!(host_ifname = %ep.host_ifname, retired = %r.id(), by = %key,
                "older sandbox retired: its interface name belongs to a new sandbox of the same pod");
        }
        tracing::info!(host_ifname = %ep.host_ifname, endpoint = %key, ifindex = attached.ifindex,
            bpf = attached.bpf, attach_us = t_attach.as_micros() as u64,
            total_us = t0.elapsed().as_micros() as u64, "endpoint programmed");
        eps.endpoints.insert(key.clone(), ep);
        eps.attached.insert(key, attached);
        Ok(attached)
    }

    /// Forgets the endpoint and detaches its programs; with `release_handle`, also releases
    /// what that handle holds for `ifname`. Two writes, the endpoint record first: an agent that
    /// dies between them leaves an allocation without an endpoint, which leak GC reclaims (the
    /// other order could leave an endpoint record naming an address free for the next pod).
    /// Idempotent; returns whether the endpoint existed and what was released.
    pub async fn unregister(
        &self,
        container_id: &str,
        ifname: &str,
        release_handle: Option<&str>,
    ) -> Result<(bool, Vec<IpAddr>), AgentError> {
        let key = EndpointRecord::key(container_id, ifname);
        let mut eps = self.eps.lock().await;
        let t0 = Instant::now();
        let ep = eps.endpoints.get(&key).cloned();
        if let Some(ep) = &ep {
            blocking(|| eps.dataplane.detach(&key)).map_err(|source| AgentError::Dataplane {
                host_ifname: ep.host_ifname.clone(),
                source,
            })?;
            eps.attached.remove(&key);
        }
        if ep.is_some() {
            let op = Op::Delete(keys::endpoint(&self.node.name, container_id, ifname));
            self.store.txn(&[], &[op], Durability::Process).await?;
        }
        eps.endpoints.remove(&key);
        let released = match release_handle {
            Some(h) => {
                let mut inner = self.inner.lock().await;
                self.release_attachment_locked(&mut inner, h, ifname, "released by CNI DEL")
                    .await?
            }
            None => Vec::new(),
        };
        if let Some(ep) = &ep {
            tracing::info!(host_ifname = %ep.host_ifname, total_us = t0.elapsed().as_micros() as u64, "endpoint removed");
        }
        Ok((ep.is_some(), released))
    }

    /// Re-programs every recorded endpoint whose interface still exists (agent restart: the
    /// programs are replaced in place, the pinned maps kept), then — the initial sync being
    /// complete — lets the dataplane sweep what no endpoint owns.
    pub async fn resync(&self) {
        let mut eps = self.eps.lock().await;
        let pools: Vec<ipnet::IpNet> = self.pools().iter().map(|p| p.cidr).collect();
        if let Err(e) = eps.dataplane.set_pools(&pools) {
            tracing::warn!(error = %e, "cannot give the dataplane the pools");
        }
        // Records that name their link (ifindex) first: a record of an older plugin never
        // takes over an interface name that a record with a checked link holds.
        let mut records: Vec<EndpointRecord> = eps.endpoints.values().cloned().collect();
        records.sort_by_key(|r| r.host_ifindex == 0);
        let mut known: Vec<String> = Vec::new();
        for ep in records {
            if ep.host_ifindex == 0 && known.contains(&ep.host_ifname) {
                tracing::warn!(host_ifname = %ep.host_ifname, endpoint = %ep.id(),
                    "recorded endpoint not programmed: its interface belongs to a newer endpoint");
                continue;
            }
            match eps.dataplane.attach(&EndpointSpec::from_record(&ep)) {
                Ok(a) => {
                    eps.attached.insert(ep.id(), a);
                    known.push(ep.host_ifname.clone());
                }
                Err(e) => {
                    tracing::warn!(host_ifname = %ep.host_ifname, endpoint = %ep.id(), error = %e,
                        "recorded endpoint not programmed")
                }
            }
        }
        if let Err(e) = eps.dataplane.reconcile(&known) {
            tracing::warn!(error = %e, "dataplane reconcile failed");
        }
    }

    /// Every drop counter: (host ifname if known, ifindex, reason, packets, bytes). The maps
    /// are read without the endpoints lock.
    pub async fn drops(&self) -> Result<Vec<DropView>, AgentError> {
        let Some(stats) = &self.stats else {
            return Ok(Vec::new());
        };
        let names: HashMap<u32, String> = {
            let eps = self.eps.lock().await;
            eps.attached
                .iter()
                .filter_map(|(k, a)| Some((a.ifindex, eps.endpoints.get(k)?.host_ifname.clone())))
                .collect()
        };
        let drops = blocking(|| stats.drops()).map_err(|source| AgentError::Dataplane {
            host_ifname: String::new(),
            source,
        })?;
        Ok(drops
            .into_iter()
            .map(|(k, c)| DropView {
                ifindex: k.ifindex,
                ifname: names.get(&k.ifindex).cloned().or_else(|| {
                    nix::net::if_::if_indextoname(k.ifindex)
                        .ok()
                        .map(|n| n.to_string_lossy().into_owned())
                }),
                reason: calix_common::DropReason::from_u32(k.reason)
                    .map_or_else(|| format!("reason_{}", k.reason), |r| r.name().to_string()),
                packets: c.packets,
                bytes: c.bytes,
            })
            .collect())
    }

    /// Every endpoint with its dataplane state. The registry is copied under the endpoints
    /// lock; the counters are read after it is released.
    pub async fn list(&self) -> Result<Vec<EndpointView>, AgentError> {
        let snapshot: Vec<(EndpointRecord, Option<Attached>)> = {
            let eps = self.eps.lock().await;
            eps.endpoints
                .iter()
                .map(|(k, r)| (r.clone(), eps.attached.get(k).copied()))
                .collect()
        };
        blocking(|| {
            snapshot
                .into_iter()
                .map(|(record, att)| {
                    let counters = match (att, &self.stats) {
                        (Some(a), Some(stats)) if a.bpf => {
                            stats
                                .counters(a.ifindex)
                                .map_err(|source| AgentError::Dataplane {
                                    host_ifname: record.host_ifname.clone(),
                                    source,
                                })?
                        }
                        _ => None,
                    };
                    Ok(EndpointView {
                        ifindex: att.map(|a| a.ifindex),
                        bpf_attached: att.is_some_and(|a| a.bpf),
                        counters,
                        record,
                    })
                })
                .collect()
        })
    }

    /// A copy of the IPAM view, re-read from the datastore (for calixctl and tests).
    pub async fn ipam(&self) -> Result<IpamState, AgentError> {
        let mut inner = self.inner.lock().await;
        self.refresh_blocks(&mut inner).await?;
        Ok(inner.ipam.clone())
    }

    /// Agent exit: programs stay attached and maps pinned, so traffic keeps flowing.
    pub async fn shutdown(&self) {
        let mut eps = self.eps.lock().await;
        eps.dataplane.release();
        eps.attached.clear();
    }
}

/// Runs a blocking dataplane call (netlink, which may wait for the RTNL lock) without holding
/// up the runtime's other tasks: on the multi-threaded runtime the worker hands them over first.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
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

#[cfg(test)]
mod tests;
