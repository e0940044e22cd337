//! The endpoint registry: this node's endpoints as the datastore records them, each kept
//! programmed by the dataplane driver (the reconciler, `crate::reconcile`). The registry says
//! what should be; the driver makes the node match and keeps it matching.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use calix_common::EndpointCounters;
use calix_core::model::EndpointRecord;
use calix_core::store::keys;
use ipnet::IpNet;
use tokio::sync::Mutex;

use crate::error::AgentError;
use crate::ipam::service::AddressUsers;
use crate::reconcile::driver::{Driver, Snapshot};
use crate::reconcile::Health;
use calix_dataplane::{Attached, DataplaneError, DataplaneStats, EndpointSpec};
use calix_datastore::{Datastore, Durability, Op};

/// One endpoint with its live state, for listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointView {
    pub record: EndpointRecord,
    pub ifindex: Option<u32>,
    pub bpf_attached: bool,
    pub counters: Option<EndpointCounters>,
    /// Whether it is in its desired state, and why not (`ok`, `interface missing`...).
    pub health: Option<Health>,
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

/// This node's endpoints.
pub struct EndpointRegistry {
    node: String,
    store: Arc<dyn Datastore>,
    /// "containerID/ifname" → record. Held across a change, so changes are one at a time.
    records: Mutex<BTreeMap<String, EndpointRecord>>,
    driver: Driver,
    /// The dataplane's counters, read without the registry's lock or the driver.
    stats: Option<Box<dyn DataplaneStats>>,
}

fn dataplane_err(host_ifname: &str) -> impl FnOnce(DataplaneError) -> AgentError + '_ {
    move |source| AgentError::Dataplane {
        host_ifname: host_ifname.to_string(),
        source,
    }
}

impl EndpointRegistry {
    /// Reads this node's endpoint records. Nothing is programmed before [`Self::start`].
    pub async fn load(
        node: &str,
        store: Arc<dyn Datastore>,
        driver: Driver,
        stats: Option<Box<dyn DataplaneStats>>,
    ) -> Result<Self, AgentError> {
        let mut records = BTreeMap::new();
        for kv in store.list(&keys::endpoints_of(node)).await? {
            let ep: EndpointRecord = kv.decode()?;
            records.insert(ep.id(), ep);
        }
        Ok(Self {
            node: node.to_string(),
            store,
            records: Mutex::new(records),
            driver,
            stats,
        })
    }

    /// The initial sync: the pools and every recorded endpoint go to the reconciler, which
    /// programs them in one pass (an agent restart replaces the programs in place, the pinned
    /// maps kept); then, the initial sync being complete, the dataplane sweeps what no
    /// endpoint owns.
    pub async fn start(&self, pools: Vec<IpNet>) -> Result<(), AgentError> {
        self.driver
            .set_pools(pools)
            .await
            .map_err(dataplane_err(""))?;
        let records = self.records.lock().await;
        // Records that name their link (ifindex) first: a record of an older plugin never
        // takes over an interface name that a record with a checked link holds.
        let mut specs: Vec<&EndpointRecord> = records.values().collect();
        specs.sort_by_key(|r| r.host_ifindex == 0);
        let mut names = HashSet::new();
        let mut adopt = Vec::new();
        for ep in specs {
            if ep.host_ifindex == 0 && names.contains(&ep.host_ifname) {
                tracing::warn!(host_ifname = %ep.host_ifname, endpoint = %ep.id(),
                    "recorded endpoint not programmed: its interface belongs to a newer endpoint");
                continue;
            }
            names.insert(ep.host_ifname.clone());
            adopt.push(EndpointSpec::from_record(ep));
        }
        drop(records);
        self.driver
            .adopt(adopt)
            .map_err(|e| dataplane_err("")(DataplaneError::Driver(e.to_string())))?;
        self.driver
            .resync()
            .await
            .map_err(|e| dataplane_err("")(DataplaneError::Driver(e.to_string())))?;
        if let Err(e) = self.driver.sweep().await {
            tracing::warn!(error = %e, "dataplane sweep after the initial sync failed");
        }
        Ok(())
    }

    /// Records the endpoint and programs it; returns once both are done (CNI ADD waits).
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
        let mut records = self.records.lock().await;
        let t0 = Instant::now();
        let retired: Vec<EndpointRecord> = records
            .values()
            .filter(|o| o.host_ifname == ep.host_ifname && o.id() != key)
            .cloned()
            .collect();
        let attached = self
            .driver
            .upsert(EndpointSpec::from_record(&ep))
            .await
            .map_err(dataplane_err(&ep.host_ifname))?;
        let t_attach = t0.elapsed();
        let mut ops: Vec<Op> = retired
            .iter()
            .map(|r| Op::Delete(keys::endpoint(&self.node, &r.container_id, &r.ifname)))
            .collect();
        ops.push(Op::put_json(
            keys::endpoint(&self.node, &ep.container_id, &ep.ifname),
            &ep,
        ));
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = self
                .store
                .txn(&[], std::slice::from_ref(op), Durability::Process)
                .await
            {
                // Not durable: undo the attach so nothing runs that the registry doesn't know.
                let _ = self.driver.remove(key.clone()).await;
                for r in &retired[..i.min(retired.len())] {
                    records.remove(&r.id());
                }
                return Err(e.into());
            }
        }
        for r in &retired {
            records.remove(&r.id());
            tracing::info!(host_ifname = %ep.host_ifname, retired = %r.id(), by = %key,
                "older sandbox retired: its interface name belongs to a new sandbox of the same pod");
        }
        tracing::info!(host_ifname = %ep.host_ifname, endpoint = %key, ifindex = attached.ifindex,
            bpf = attached.bpf, attach_us = t_attach.as_micros() as u64,
            total_us = t0.elapsed().as_micros() as u64, "endpoint programmed");
        records.insert(key, ep);
        Ok(attached)
    }

    /// Forgets the endpoint: its record, then what was programmed for it. Idempotent; returns
    /// the record it had.
    pub async fn unregister(
        &self,
        container_id: &str,
        ifname: &str,
    ) -> Result<Option<EndpointRecord>, AgentError> {
        let key = EndpointRecord::key(container_id, ifname);
        let mut records = self.records.lock().await;
        let Some(ep) = records.get(&key).cloned() else {
            return Ok(None);
        };
        let t0 = Instant::now();
        let op = Op::Delete(keys::endpoint(&self.node, container_id, ifname));
        self.store.txn(&[], &[op], Durability::Process).await?;
        records.remove(&key);
        self.driver
            .remove(key)
            .await
            .map_err(dataplane_err(&ep.host_ifname))?;
        tracing::info!(host_ifname = %ep.host_ifname, total_us = t0.elapsed().as_micros() as u64,
            "endpoint removed");
        Ok(Some(ep))
    }

    /// CNI GC: forgets every endpoint whose attachment (network, container ID; ifname)
    /// `stale` says the runtime no longer has. Returns them.
    pub async fn gc(
        &self,
        stale: &calix_core::model::IsStale<'_>,
    ) -> Result<Vec<EndpointRecord>, AgentError> {
        let gone: Vec<EndpointRecord> = self
            .records
            .lock()
            .await
            .values()
            .filter(|e| {
                stale(
                    calix_proto::handle::attachment(&e.handle, Some(&e.container_id)),
                    &e.ifname,
                )
            })
            .cloned()
            .collect();
        for ep in &gone {
            self.unregister(&ep.container_id, &ep.ifname).await?;
        }
        Ok(gone)
    }

    /// Every endpoint's record.
    pub async fn records(&self) -> Vec<EndpointRecord> {
        self.records.lock().await.values().cloned().collect()
    }

    /// Deletes `ep`'s host veth if it is still `ep`'s (its owner alias): both ends go, and the
    /// pod's route with them. Whether it was there.
    pub async fn delete_host_link(&self, ep: &EndpointRecord) -> Result<bool, AgentError> {
        self.driver
            .delete_owned_link(
                ep.host_ifname.clone(),
                calix_kernel::pod::owner_alias(&ep.container_id, &ep.ifname),
            )
            .await
            .map_err(dataplane_err(&ep.host_ifname))
    }

    /// Every endpoint with its live state. The registry is copied under its lock; the health
    /// comes from the reconciler; the counters are read from the maps after both.
    pub async fn list(&self) -> Result<Vec<EndpointView>, AgentError> {
        let records: Vec<EndpointRecord> = self.records.lock().await.values().cloned().collect();
        let snapshot = self.driver.snapshot().await.unwrap_or_default();
        blocking(|| {
            records
                .into_iter()
                .map(|record| {
                    let key = record.id();
                    let att = snapshot.attached.get(&key).copied();
                    let counters = match (att, &self.stats) {
                        (Some(a), Some(stats)) if a.bpf => stats
                            .counters(a.ifindex)
                            .map_err(dataplane_err(&record.host_ifname))?,
                        _ => None,
                    };
                    Ok(EndpointView {
                        ifindex: att.map(|a| a.ifindex),
                        bpf_attached: att.is_some_and(|a| a.bpf),
                        counters,
                        health: snapshot.health.get(&key).cloned(),
                        record,
                    })
                })
                .collect()
        })
    }

    /// The reconciler's state: its repairs so far by kind, its full passes, the node's error.
    pub async fn reconciler(&self) -> Snapshot {
        self.driver.snapshot().await.unwrap_or_default()
    }

    /// Every drop counter: (host ifname if known, ifindex, reason, packets, bytes). The maps
    /// are read without the registry's lock.
    pub async fn drops(&self) -> Result<Vec<DropView>, AgentError> {
        let Some(stats) = &self.stats else {
            return Ok(Vec::new());
        };
        let names: HashMap<u32, String> = {
            let records = self.records.lock().await;
            let snapshot = self.driver.snapshot().await.unwrap_or_default();
            snapshot
                .attached
                .iter()
                .filter_map(|(k, a)| Some((a.ifindex, records.get(k)?.host_ifname.clone())))
                .collect()
        };
        let drops = blocking(|| stats.drops()).map_err(dataplane_err(""))?;
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

    /// Each attached endpoint: its ifindex, host ifname and pod (`namespace/name`).
    pub async fn attached_pods(&self) -> Vec<(u32, String, Option<String>)> {
        let records = self.records.lock().await;
        let snapshot = self.driver.snapshot().await.unwrap_or_default();
        snapshot
            .attached
            .iter()
            .filter_map(|(k, a)| {
                let r = records.get(k)?;
                Some((a.ifindex, r.host_ifname.clone(), pod_of(r)))
            })
            .collect()
    }

    /// Packets NetworkPolicy denied per attached endpoint: (host ifname, pod, to the pod, from
    /// it). Empty without counts.
    pub async fn policy_denied(&self) -> Vec<(String, Option<String>, u64, u64)> {
        let Some(stats) = &self.stats else {
            return Vec::new();
        };
        let eps = self.attached_pods().await;
        let keys: Vec<(u32, String)> = eps.iter().map(|(i, n, _)| (*i, n.clone())).collect();
        match blocking(|| stats.policy_denied(&keys)) {
            Ok(counts) => eps
                .into_iter()
                .zip(counts)
                .map(|((_, ifname, pod), (i, e))| (ifname, pod, i, e))
                .collect(),
            Err(e) => {
                tracing::debug!(error = %e, "reading the policy's denied counts");
                Vec::new()
            }
        }
    }

    /// The endpoint on this node with address `ip`: its host veth, the ifindex it is attached
    /// on (None: not attached), its pod (`namespace/name`).
    pub async fn local_with_address(
        &self,
        ip: std::net::IpAddr,
    ) -> Option<(String, Option<u32>, Option<String>)> {
        let records = self.records.lock().await;
        let (key, r) = records.iter().find(|(_, r)| {
            r.addresses
                .iter()
                .any(|a| a.split('/').next().and_then(|a| a.parse().ok()) == Some(ip))
        })?;
        let snapshot = self.driver.snapshot().await.unwrap_or_default();
        let pod = pod_of(r);
        Some((
            r.host_ifname.clone(),
            snapshot.attached.get(key).map(|a| a.ifindex),
            pod,
        ))
    }

    /// What the live policy maps say (see `DataplaneStats::policy_verdict`); `None` without
    /// maps to read (kernel mode).
    pub async fn live_verdict(
        &self,
        ifindex: u32,
        ingress: bool,
        peer: std::net::IpAddr,
        proto: u8,
        port: u16,
    ) -> Result<Option<calix_dataplane::LiveVerdict>, AgentError> {
        let Some(stats) = &self.stats else {
            return Ok(None);
        };
        blocking(|| stats.policy_verdict(ifindex, ingress, peer, proto, port))
            .map_err(dataplane_err(""))
    }

    /// Each endpoint's slot → its host veth and its pod (`namespace/name`, when it has one):
    /// how drop events name an endpoint. Empty without a dataplane that has slots.
    pub async fn slot_names(&self) -> HashMap<u32, (String, Option<String>)> {
        let Some(stats) = &self.stats else {
            return HashMap::new();
        };
        let by_ifindex: HashMap<u32, (String, Option<String>)> = self
            .attached_pods()
            .await
            .into_iter()
            .map(|(i, ifname, pod)| (i, (ifname, pod)))
            .collect();
        let slots = match blocking(|| stats.slots()) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "reading the endpoints' slots");
                return HashMap::new();
            }
        };
        slots
            .into_iter()
            .filter_map(|(slot, ifindex)| Some((slot, by_ifindex.get(&ifindex)?.clone())))
            .collect()
    }

    /// NetworkPolicy's counts of pod `namespace/name`'s endpoints on this node, summed (None:
    /// it has none attached, or the dataplane counts none).
    pub async fn policy_counts(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<calix_dataplane::PolicyCounts>, AgentError> {
        let Some(stats) = &self.stats else {
            return Ok(None);
        };
        let targets: Vec<(u32, String)> = {
            let records = self.records.lock().await;
            let snapshot = self.driver.snapshot().await.unwrap_or_default();
            records
                .iter()
                .filter(|(_, r)| r.pod_namespace == namespace && r.pod_name == name)
                .filter_map(|(k, r)| {
                    Some((snapshot.attached.get(k)?.ifindex, r.host_ifname.clone()))
                })
                .collect()
        };
        blocking(|| {
            let mut sum: Option<calix_dataplane::PolicyCounts> = None;
            for (ifindex, ifname) in &targets {
                let Some(c) = stats
                    .policy_counts(*ifindex, ifname)
                    .map_err(dataplane_err(ifname))?
                else {
                    continue;
                };
                let s = sum.get_or_insert_with(Default::default);
                for (rule, n) in c.hits {
                    *s.hits.entry(rule).or_insert(0) += n;
                }
                s.denied_ingress += c.denied_ingress;
                s.denied_egress += c.denied_egress;
            }
            Ok(sum)
        })
    }

    /// The pools changed: remote pod addresses the dataplane forwards directly.
    pub async fn set_pools(&self, pools: Vec<IpNet>) -> Result<(), AgentError> {
        self.driver
            .set_pools(pools)
            .await
            .map_err(dataplane_err(""))
    }

    /// A config reload (SIGHUP) for the dataplane.
    pub async fn reload_dataplane(&self, r: calix_dataplane::Reload) -> Result<(), AgentError> {
        self.driver.reload(r).await.map_err(dataplane_err(""))
    }

    /// Agent exit: programs stay attached and maps pinned, so traffic keeps flowing.
    pub async fn shutdown(&self) {
        self.driver.release().await;
    }
}

#[tonic::async_trait]
impl AddressUsers for EndpointRegistry {
    async fn in_use(&self) -> HashSet<(String, String)> {
        self.records
            .lock()
            .await
            .values()
            .map(|e| (e.handle.clone(), e.ifname.clone()))
            .collect()
    }

    async fn in_use_recorded(&self) -> Result<HashSet<(String, String)>, AgentError> {
        let mut out = HashSet::new();
        for kv in self.store.list(&keys::endpoints_of(&self.node)).await? {
            let ep: EndpointRecord = kv.decode()?;
            out.insert((ep.handle, ep.ifname));
        }
        Ok(out)
    }
}

/// Runs a blocking read of the maps without holding up the runtime's other tasks: on the
/// multi-threaded runtime the worker hands them over first.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The pod of endpoint `r`, as `namespace/name` (None: a runtime that did not say).
fn pod_of(r: &EndpointRecord) -> Option<String> {
    (!r.pod_name.is_empty()).then(|| format!("{}/{}", r.pod_namespace, r.pod_name))
}
