//! The reconciler on a thread of its own, driven by commands from the async side.
//!
//! Every kernel write of the dataplane happens on this one thread (Felix's "one dataplane
//! driver"): netlink calls may wait for the RTNL lock, and the maps and filters must never be
//! written by two parties at once. The async side sends a command and awaits its answer; the
//! thread also wakes on its own for the periodic resync and for retries.
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use calix_core::policy::tables::Tables;
use calix_core::reconcile::remote::{RemoteRoute, Underlay};
use calix_kernel::host::HostKernel;
use ipnet::IpNet;
use tokio::sync::oneshot;

use super::{Backoff, Health, Reconciler};
use calix_dataplane::doors::PeerNodes;
use calix_dataplane::{Attached, Dataplane, DataplaneError, EndpointSpec, Reload};

/// What the reconciler reports about the endpoints.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub health: BTreeMap<String, Health>,
    pub attached: BTreeMap<String, Attached>,
    pub repairs: BTreeMap<&'static str, u64>,
    /// Full passes so far.
    pub resyncs: u64,
    /// Why the node's own objects (forwarding, nftables tables) are not as desired.
    pub node_error: Option<String>,
    /// Why the routes to other nodes are not as desired.
    pub routes_error: Option<String>,
    /// Desired routes to other nodes that cannot be programmed as asked, and why.
    pub route_problems: BTreeMap<IpNet, String>,
}

enum Command {
    Upsert(
        EndpointSpec,
        oneshot::Sender<Result<Attached, DataplaneError>>,
    ),
    Adopt(Vec<EndpointSpec>),
    Remove(String, oneshot::Sender<Result<(), DataplaneError>>),
    /// A host link, if its alias names this owner.
    DeleteOwnedLink(
        String,
        String,
        oneshot::Sender<Result<bool, DataplaneError>>,
    ),
    Resync(oneshot::Sender<()>),
    SetPools(Vec<IpNet>, oneshot::Sender<Result<(), DataplaneError>>),
    Reload(Box<Reload>, oneshot::Sender<Result<(), DataplaneError>>),
    /// After the initial sync: the dataplane removes what no programmed endpoint owns.
    Sweep(oneshot::Sender<Result<(), DataplaneError>>),
    Snapshot(oneshot::Sender<Snapshot>),
    /// Route distribution's desired routes to other nodes' pods (the whole set), and whether
    /// it is complete; when it was sent.
    RemoteRoutes(Vec<RemoteRoute>, bool, Instant, oneshot::Sender<()>),
    /// The other nodes, for the doors ([`Dataplane::set_peer_nodes`]).
    PeerNodes(PeerNodes, oneshot::Sender<Result<(), DataplaneError>>),
    /// NetworkPolicy's tables for this node's pods ([`Dataplane::set_policy`]).
    Policy(Box<Tables>, oneshot::Sender<Result<(), DataplaneError>>),
    /// The Services translated at the sockets, and the pods' network namespaces
    /// ([`Dataplane::set_services`]).
    Services(
        Box<calix_dataplane::ebpf::services::Translation>,
        Vec<std::path::PathBuf>,
        oneshot::Sender<Result<(), DataplaneError>>,
    ),
    /// Agent exit: programs stay attached, maps pinned; the thread ends.
    Release(oneshot::Sender<()>),
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("the dataplane driver thread is gone")]
    Gone,
    #[error("cannot start the dataplane driver")]
    Start(#[source] std::io::Error),
    #[error("cannot open the node's kernel for the reconciler")]
    Kernel(#[source] calix_kernel::netlink::NetlinkError),
}

/// The async side's handle on the driver thread. Cheap to clone.
#[derive(Clone)]
pub struct Driver {
    tx: mpsc::Sender<Command>,
}

/// How often the driver checks everything, and how it backs off after failures.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub resync: Duration,
    pub backoff: Backoff,
}

impl Driver {
    /// Starts the driver thread. `kernel` is called on the thread (its netlink socket is made
    /// in the thread's namespace, the agent's).
    pub fn spawn<K, F>(
        kernel: F,
        dataplane: Box<dyn Dataplane>,
        underlay: Underlay,
        timing: Timing,
    ) -> Result<Self, DriverError>
    where
        K: HostKernel + 'static,
        F: FnOnce() -> Result<K, calix_kernel::netlink::NetlinkError> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("calix-dataplane".into())
            .spawn(move || {
                let kernel = match kernel() {
                    Ok(k) => {
                        let _ = ready_tx.send(Ok(()));
                        k
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                run(
                    Reconciler::new(kernel, dataplane, timing.backoff).with_underlay(underlay),
                    rx,
                    timing.resync,
                );
            })
            .map_err(DriverError::Start)?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self { tx }),
            Ok(Err(e)) => Err(DriverError::Kernel(e)),
            Err(_) => Err(DriverError::Gone),
        }
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, DriverError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).map_err(|_| DriverError::Gone)?;
        rx.await.map_err(|_| DriverError::Gone)
    }

    /// Programs an endpoint now and keeps it true from then on.
    pub async fn upsert(&self, spec: EndpointSpec) -> Result<Attached, DataplaneError> {
        self.ask(|tx| Command::Upsert(spec, tx))
            .await
            .map_err(gone)?
    }

    /// Makes recorded endpoints desired; the next resync applies them.
    pub fn adopt(&self, specs: Vec<EndpointSpec>) -> Result<(), DriverError> {
        self.tx
            .send(Command::Adopt(specs))
            .map_err(|_| DriverError::Gone)
    }

    pub async fn remove(&self, key: String) -> Result<(), DataplaneError> {
        self.ask(|tx| Command::Remove(key, tx))
            .await
            .map_err(gone)?
    }

    /// Deletes host link `name` if its alias still names `owner`
    /// ([`Reconciler::delete_owned_link`]); whether it did.
    pub async fn delete_owned_link(
        &self,
        name: String,
        owner: String,
    ) -> Result<bool, DataplaneError> {
        self.ask(|tx| Command::DeleteOwnedLink(name, owner, tx))
            .await
            .map_err(gone)?
    }

    /// A full pass now; returns when it is done.
    pub async fn resync(&self) -> Result<(), DriverError> {
        self.ask(Command::Resync).await
    }

    pub async fn set_pools(&self, pools: Vec<IpNet>) -> Result<(), DataplaneError> {
        self.ask(|tx| Command::SetPools(pools, tx))
            .await
            .map_err(gone)?
    }

    /// A config reload (SIGHUP): see [`Dataplane::reload`].
    pub async fn reload(&self, r: Reload) -> Result<(), DataplaneError> {
        self.ask(|tx| Command::Reload(Box::new(r), tx))
            .await
            .map_err(gone)?
    }

    pub async fn sweep(&self) -> Result<(), DataplaneError> {
        self.ask(Command::Sweep).await.map_err(gone)?
    }

    /// Replaces the desired routes to other nodes' pods ([`Reconciler::set_remote_routes`]);
    /// returns once the reconciler programmed them (or failed to: it retries by itself; see
    /// [`Snapshot::routes_error`]).
    pub async fn set_remote_routes(
        &self,
        routes: Vec<RemoteRoute>,
        complete: bool,
    ) -> Result<(), DriverError> {
        self.ask(|tx| Command::RemoteRoutes(routes, complete, Instant::now(), tx))
            .await
    }

    /// The other nodes as route distribution knows them: pods may not reach the agents'
    /// ports on their addresses ([`Dataplane::set_peer_nodes`]).
    pub async fn set_peer_nodes(&self, peers: PeerNodes) -> Result<(), DataplaneError> {
        self.ask(|tx| Command::PeerNodes(peers, tx))
            .await
            .map_err(gone)?
    }

    /// NetworkPolicy: the tables this node's pods enforce from now on
    /// ([`Dataplane::set_policy`]).
    pub async fn set_policy(&self, tables: Tables) -> Result<(), DataplaneError> {
        self.ask(|tx| Command::Policy(Box::new(tables), tx))
            .await
            .map_err(gone)?
    }

    /// The Services translated at the sockets; `clients`: the node's pods' network
    /// namespaces ([`Dataplane::set_services`]).
    pub async fn set_services(
        &self,
        services: calix_dataplane::ebpf::services::Translation,
        clients: Vec<std::path::PathBuf>,
    ) -> Result<(), DataplaneError> {
        self.ask(|tx| Command::Services(Box::new(services), clients, tx))
            .await
            .map_err(gone)?
    }

    pub async fn snapshot(&self) -> Result<Snapshot, DriverError> {
        self.ask(Command::Snapshot).await
    }

    /// Agent exit: programs stay attached and maps pinned; the driver thread ends.
    pub async fn release(&self) {
        let _ = self.ask(Command::Release).await;
    }
}

fn gone(e: DriverError) -> DataplaneError {
    DataplaneError::Driver(e.to_string())
}

fn run<K: HostKernel>(mut r: Reconciler<K>, rx: mpsc::Receiver<Command>, every: Duration) {
    let mut next_resync = Instant::now() + every;
    loop {
        let now = Instant::now();
        let wake = r.next_retry().map_or(next_resync, |t| t.min(next_resync));
        let command = match rx.recv_timeout(wake.saturating_duration_since(now)) {
            Ok(c) => Some(c),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        match command {
            Some(Command::Upsert(spec, reply)) => {
                let _ = reply.send(r.upsert(spec));
            }
            Some(Command::Adopt(specs)) => specs.into_iter().for_each(|s| r.adopt(s)),
            Some(Command::Remove(key, reply)) => {
                let _ = reply.send(r.remove(&key));
            }
            Some(Command::DeleteOwnedLink(name, owner, reply)) => {
                let _ = reply.send(r.delete_owned_link(&name, &owner));
            }
            Some(Command::Resync(reply)) => {
                let now = Instant::now();
                log_pass(&r.resync(now), "resync", now);
                next_resync = now + every;
                let _ = reply.send(());
            }
            Some(Command::SetPools(pools, reply)) => {
                let _ = reply.send(r.dataplane().set_pools(&pools));
            }
            Some(Command::Reload(reload, reply)) => {
                let _ = reply.send(r.dataplane().reload(&reload));
            }
            Some(Command::Sweep(reply)) => {
                let known = r.programmed_interfaces();
                let _ = reply.send(r.dataplane().reconcile(&known));
            }
            Some(Command::Snapshot(reply)) => {
                let health = r.health();
                let attached = health
                    .keys()
                    .filter_map(|k| Some((k.clone(), r.attached(k)?)))
                    .collect();
                let _ = reply.send(Snapshot {
                    health,
                    attached,
                    repairs: r.repairs().clone(),
                    resyncs: r.resyncs(),
                    node_error: r.node_error().map(str::to_string),
                    routes_error: r.routes_error().map(str::to_string),
                    route_problems: r.route_problems().clone(),
                });
            }
            Some(Command::RemoteRoutes(routes, complete, sent, reply)) => {
                let taken = Instant::now();
                let count = routes.len();
                r.set_remote_routes(routes, complete);
                tracing::debug!(routes = count, complete, queued = ?taken.saturating_duration_since(sent),
                    took = ?taken.elapsed(), "remote routes set");
                let _ = reply.send(());
            }
            Some(Command::PeerNodes(peers, reply)) => {
                let _ = reply.send(r.dataplane().set_peer_nodes(&peers));
            }
            Some(Command::Policy(tables, reply)) => {
                let _ = reply.send(r.dataplane().set_policy(*tables));
            }
            Some(Command::Services(services, clients, reply)) => {
                let _ = reply.send(r.dataplane().set_services(&services, &clients));
            }
            Some(Command::Release(reply)) => {
                r.dataplane().release();
                let _ = reply.send(());
                return;
            }
            None => {
                let now = Instant::now();
                if now >= next_resync {
                    log_pass(&r.resync(now), "periodic resync", now);
                    next_resync = now + every;
                } else {
                    log_pass(&r.retry_due(now), "retry", now);
                }
            }
        }
    }
}

fn log_pass(pass: &super::Pass, what: &str, started: Instant) {
    if pass.repairs.is_empty() && pass.unhealthy == 0 {
        tracing::debug!(checked = pass.checked, took = ?started.elapsed(), "{what}: nothing drifted");
    } else {
        tracing::info!(
            checked = pass.checked,
            repairs = pass.repairs.len(),
            unhealthy = pass.unhealthy,
            "{what} done"
        );
    }
}
