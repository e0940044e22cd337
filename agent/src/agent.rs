//! The agent's core: IPAM and the endpoint registry over one datastore and one dataplane.
//! Every mutation is computed on a copy of the state, committed to the datastore, and only
//! then made current, so what the agent acknowledges is always durable.
use std::collections::BTreeMap;
use std::net::IpAddr;

use calix_common::EndpointCounters;
use ipnet::IpNet;
use tokio::sync::Mutex;

use crate::dataplane::{Attached, Dataplane, DataplaneError};
use crate::datastore::{Datastore, DatastoreError, Durability, EndpointRecord, StoreState};
use crate::ipam::{IpamError, IpamState, Pool};

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
    Invalid(&'static str),
}

/// One endpoint with its live dataplane state, for listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointView {
    pub record: EndpointRecord,
    pub ifindex: Option<u32>,
    pub bpf_attached: bool,
    pub counters: Option<EndpointCounters>,
}

struct Inner {
    state: StoreState,
    dataplane: Box<dyn Dataplane>,
    /// host ifname → attach result, for endpoints programmed by this process.
    attached: BTreeMap<String, Attached>,
}

pub struct Agent {
    node: String,
    pools: Vec<Pool>,
    store: Box<dyn Datastore>,
    inner: Mutex<Inner>,
}

impl Agent {
    pub fn new(
        node: String,
        pools: Vec<Pool>,
        store: Box<dyn Datastore>,
        dataplane: Box<dyn Dataplane>,
    ) -> Result<Self, AgentError> {
        let state = store.load()?;
        Ok(Self {
            node,
            pools,
            store,
            inner: Mutex::new(Inner {
                state,
                dataplane,
                attached: BTreeMap::new(),
            }),
        })
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Applies `f` to the state and commits it; on any failure the state is what was last
    /// committed.
    fn commit_with<T>(
        &self,
        inner: &mut Inner,
        durability: Durability,
        f: impl FnOnce(&mut StoreState) -> Result<T, AgentError>,
    ) -> Result<T, AgentError> {
        // Mutate in place (no copy of the whole state per write); if `f` or the write fails,
        // the datastore still holds the last committed state: read it back.
        let result = f(&mut inner.state).and_then(|out| {
            let revision = self.store.commit(&inner.state, durability)?;
            inner.state.revision = revision;
            Ok(out)
        });
        if result.is_err() {
            match self.store.load() {
                Ok(committed) => inner.state = committed,
                Err(e) => {
                    tracing::error!(error = %e, "cannot re-read the datastore after a failed write")
                }
            }
        }
        result
    }

    /// Allocates the requested families for (handle, ifname). All-or-nothing: if one family
    /// fails nothing is committed.
    pub async fn allocate(
        &self,
        handle: &str,
        ifname: &str,
        v4: bool,
        v6: bool,
        requested: &[IpAddr],
        attributes: &BTreeMap<String, String>,
    ) -> Result<(Vec<(IpAddr, IpNet)>, bool), AgentError> {
        if handle.is_empty() || ifname.is_empty() {
            return Err(AgentError::Invalid("handle and ifname are required"));
        }
        // A requested address replaces the automatic one of its family.
        let want_v4 = v4 || requested.iter().any(IpAddr::is_ipv4);
        let want_v6 = v6 || requested.iter().any(IpAddr::is_ipv6);
        if !want_v4 && !want_v6 {
            return Err(AgentError::Invalid("ask for at least one of ipv4, ipv6"));
        }
        let mut inner = self.inner.lock().await;
        let existing =
            |fam: bool, want: bool| !want || inner.state.ipam.lookup(handle, ifname, fam).is_some();
        let already = existing(true, want_v4) && existing(false, want_v6);
        let allocate = |s: &mut StoreState| {
            let mut out = Vec::new();
            for (want, is_v4) in [(want_v4, true), (want_v6, false)] {
                if !want {
                    continue;
                }
                out.push(match requested.iter().find(|a| a.is_ipv4() == is_v4) {
                    Some(addr) => s.ipam.allocate_specific(
                        &self.pools,
                        &self.node,
                        handle,
                        ifname,
                        *addr,
                        attributes,
                    )?,
                    None => s.ipam.allocate(
                        &self.pools,
                        &self.node,
                        handle,
                        ifname,
                        is_v4,
                        attributes,
                    )?,
                });
            }
            Ok(out)
        };
        let out = if already {
            // Nothing changes: answer from a copy of the state, no datastore write.
            allocate(&mut inner.state.clone())?
        } else {
            self.commit_with(&mut inner, Durability::Power, allocate)?
        };
        for (addr, _) in &out {
            tracing::info!(%handle, %ifname, %addr, already, "allocated");
        }
        Ok((out, already))
    }

    /// Releases what (handle, ifname) holds. Idempotent; returns what was released.
    pub async fn release(&self, handle: &str, ifname: &str) -> Result<Vec<IpAddr>, AgentError> {
        let mut inner = self.inner.lock().await;
        if inner.state.ipam.lookup(handle, ifname, true).is_none()
            && inner.state.ipam.lookup(handle, ifname, false).is_none()
        {
            return Ok(Vec::new());
        }
        let released = self.commit_with(&mut inner, Durability::Process, |s| {
            Ok(s.ipam.release(handle, ifname))
        })?;
        for addr in &released {
            tracing::info!(%handle, %ifname, %addr, reason = "released by CNI DEL", "released");
        }
        Ok(released)
    }

    /// What (handle, ifname) holds.
    pub async fn lookup(&self, handle: &str, ifname: &str) -> Vec<(IpAddr, IpNet)> {
        let inner = self.inner.lock().await;
        inner.state.ipam.lookup_all(&self.pools, handle, ifname)
    }

    /// CNI GC: releases every allocation of `network` whose (containerID, ifname) is not in
    /// `valid`, and forgets (and detaches) the endpoints of those attachments. Returns the
    /// released addresses and the forgotten endpoints' host interfaces.
    pub async fn gc(
        &self,
        network: &str,
        valid: &std::collections::HashSet<(String, String)>,
    ) -> Result<(Vec<IpAddr>, Vec<EndpointRecord>), AgentError> {
        if network.is_empty() {
            return Err(AgentError::Invalid("network is required"));
        }
        let prefix = format!("{network}.");
        let mut inner = self.inner.lock().await;
        let stale_eps: Vec<EndpointRecord> = inner
            .state
            .endpoints
            .values()
            .filter(|e| {
                e.handle.starts_with(&prefix)
                    && !valid.contains(&(e.container_id.clone(), e.ifname.clone()))
            })
            .cloned()
            .collect();
        for ep in &stale_eps {
            if let Err(e) = inner.dataplane.detach(&ep.host_ifname) {
                tracing::warn!(host_ifname = %ep.host_ifname, error = %e, "GC: detach failed");
            }
            inner.attached.remove(&ep.host_ifname);
        }
        let released = self.commit_with(&mut inner, Durability::Process, |s| {
            for ep in &stale_eps {
                s.endpoints
                    .remove(&EndpointRecord::key(&ep.container_id, &ep.ifname));
            }
            Ok(s.ipam.gc(network, valid))
        })?;
        for (handle, ifname, addr) in &released {
            tracing::info!(%handle, %ifname, %addr, reason = "not in the runtime's valid attachments (CNI GC)", "released");
        }
        Ok((released.into_iter().map(|(_, _, a)| a).collect(), stale_eps))
    }

    /// Free addresses this node can still hand out: (IPv4, IPv6).
    pub async fn free(&self) -> (u64, u64) {
        let inner = self.inner.lock().await;
        (
            inner.state.ipam.free(&self.pools, &self.node, true),
            inner.state.ipam.free(&self.pools, &self.node, false),
        )
    }

    pub fn pools(&self) -> &[Pool] {
        &self.pools
    }

    /// Records the endpoint and programs the dataplane for it; returns once both are done.
    pub async fn register(&self, ep: EndpointRecord) -> Result<Attached, AgentError> {
        if ep.container_id.is_empty() || ep.ifname.is_empty() || ep.host_ifname.is_empty() {
            return Err(AgentError::Invalid(
                "container_id, ifname and host_ifname are required",
            ));
        }
        let mut inner = self.inner.lock().await;
        let t0 = std::time::Instant::now();
        let attached =
            inner
                .dataplane
                .attach(&ep.host_ifname)
                .map_err(|source| AgentError::Dataplane {
                    host_ifname: ep.host_ifname.clone(),
                    source,
                })?;
        let t_attach = t0.elapsed();
        let key = EndpointRecord::key(&ep.container_id, &ep.ifname);
        let host_ifname = ep.host_ifname.clone();
        let committed = self.commit_with(&mut inner, Durability::Process, |s| {
            s.endpoints.insert(key, ep);
            Ok(())
        });
        if let Err(e) = committed {
            // Not durable: undo the attach so nothing runs that the registry doesn't know.
            let _ = inner.dataplane.detach(&host_ifname);
            return Err(e);
        }
        tracing::info!(%host_ifname, ifindex = attached.ifindex, bpf = attached.bpf,
            attach_us = t_attach.as_micros() as u64, total_us = t0.elapsed().as_micros() as u64,
            "endpoint programmed");
        inner.attached.insert(host_ifname, attached);
        Ok(attached)
    }

    /// Forgets the endpoint and detaches its programs; with `release_handle`, also releases
    /// what that handle holds for `ifname`, in the same datastore write. Idempotent; returns
    /// whether the endpoint existed and what was released.
    pub async fn unregister(
        &self,
        container_id: &str,
        ifname: &str,
        release_handle: Option<&str>,
    ) -> Result<(bool, Vec<IpAddr>), AgentError> {
        let key = EndpointRecord::key(container_id, ifname);
        let mut inner = self.inner.lock().await;
        let t0 = std::time::Instant::now();
        let ep = inner.state.endpoints.get(&key).cloned();
        if let Some(ep) = &ep {
            inner
                .dataplane
                .detach(&ep.host_ifname)
                .map_err(|source| AgentError::Dataplane {
                    host_ifname: ep.host_ifname.clone(),
                    source,
                })?;
            inner.attached.remove(&ep.host_ifname);
        }
        let holds = release_handle.is_some_and(|h| {
            inner.state.ipam.lookup(h, ifname, true).is_some()
                || inner.state.ipam.lookup(h, ifname, false).is_some()
        });
        if ep.is_none() && !holds {
            return Ok((false, Vec::new()));
        }
        let released = self.commit_with(&mut inner, Durability::Process, |s| {
            s.endpoints.remove(&key);
            Ok(match release_handle {
                Some(h) => s.ipam.release(h, ifname),
                None => Vec::new(),
            })
        })?;
        if let Some(ep) = &ep {
            tracing::info!(host_ifname = %ep.host_ifname, total_us = t0.elapsed().as_micros() as u64, "endpoint removed");
        }
        for addr in &released {
            tracing::info!(handle = release_handle.unwrap_or_default(), %ifname, %addr, reason = "released by CNI DEL", "released");
        }
        Ok((ep.is_some(), released))
    }

    /// Re-programs every recorded endpoint whose interface still exists (agent restart).
    pub async fn resync(&self) {
        let mut inner = self.inner.lock().await;
        let eps: Vec<EndpointRecord> = inner.state.endpoints.values().cloned().collect();
        for ep in eps {
            match inner.dataplane.attach(&ep.host_ifname) {
                Ok(a) => {
                    inner.attached.insert(ep.host_ifname.clone(), a);
                }
                Err(e) => {
                    tracing::warn!(host_ifname = %ep.host_ifname, error = %e, "recorded endpoint not programmed")
                }
            }
        }
    }

    pub async fn list(&self) -> Result<Vec<EndpointView>, AgentError> {
        let inner = self.inner.lock().await;
        inner
            .state
            .endpoints
            .values()
            .map(|r| {
                let att = inner.attached.get(&r.host_ifname);
                let counters = match att {
                    Some(a) if a.bpf => inner.dataplane.counters(a.ifindex).map_err(|source| {
                        AgentError::Dataplane {
                            host_ifname: r.host_ifname.clone(),
                            source,
                        }
                    })?,
                    _ => None,
                };
                Ok(EndpointView {
                    record: r.clone(),
                    ifindex: att.map(|a| a.ifindex),
                    bpf_attached: att.is_some_and(|a| a.bpf),
                    counters,
                })
            })
            .collect()
    }

    /// A copy of the IPAM state (for calixctl and tests).
    pub async fn ipam(&self) -> IpamState {
        self.inner.lock().await.state.ipam.clone()
    }

    pub async fn shutdown(&self) {
        let mut inner = self.inner.lock().await;
        inner.dataplane.detach_all();
        inner.attached.clear();
    }
}
