//! Desired state → kernel, the Felix way: the endpoint reconciler.
//!
//! The registry says what each endpoint should have (its [`EndpointSpec`]); the reconciler
//! makes the node match and keeps it matching:
//!
//! - on change: [`Reconciler::upsert`] programs an endpoint at once (CNI ADD waits for it),
//!   [`Reconciler::remove`] takes it away;
//! - periodically: [`Reconciler::resync`] compares every endpoint with the kernel — a cheap
//!   diff of reads, with writes only for a difference — and repairs what drifted;
//! - after a failure: an endpoint that could not be brought to its desired state stays dirty
//!   and is retried with backoff ([`Reconciler::retry_due`]) until it is.
//!
//! Per endpoint it checks, in dependency order: the host veth (present, the same link, up),
//! its settings ([`host_settings`]), its host routes ([`HostRoute`], protocol 202), then the
//! dataplane's filters and map entries ([`Dataplane::verify`]). A veth that is gone is
//! reported, never re-created: only the CNI plugin creates pods' interfaces. An interface that
//! does not carry calix's mark for the endpoint (a `cali…` name and the endpoint's owner alias,
//! `calix:<containerID>/<ifname>`) is never programmed — a record naming the uplink or `lo`,
//! from a forged datastore write, gets no route, setting, program or map entry — and is
//! reported ([`Health::NotCalix`]). Every repair is
//! logged with what was wrong and counted by kind (`calix_repairs_total{kind}`). It touches
//! only what carries calix's mark: routes with calix's protocol to endpoint addresses, the
//! settings of the veths it records, filters at calix's priority and handle, map entries.
//!
//! Each pass also checks the node's own objects: its forwarding sysctls ([`node_settings`]),
//! the dataplane's nftables tables ([`Dataplane::node_drift`]) and the host-device programs on
//! the uplinks and calix's VXLAN devices ([`Dataplane::verify_host_dev`]); a failure there is
//! retried with the same backoff.
//!
//! Routes to other nodes' pods ([`remote`]) are desired state too: programmed when route
//! distribution changes them ([`Reconciler::set_remote_routes`]), checked every pass, retried
//! with backoff.
pub mod driver;
mod endpoint;
pub mod remote;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use calix_core::reconcile::remote::{RemoteRoute, Underlay};
use calix_kernel::host::HostKernel;
use calix_kernel::netlink::NetlinkError;
use calix_kernel::pod::{node_settings, HostSetting};
use calix_kernel::vxlan;

use calix_dataplane::{Attached, Dataplane, DataplaneError, EndpointSpec};
use endpoint::not_its_veth;

/// Why an endpoint is not in its desired state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// As desired (after repairs, if any were needed).
    Ok,
    /// Its host veth is gone: reported, not re-created (the plugin owns pods' interfaces).
    InterfaceMissing,
    /// Its host veth's name belongs to another link now (a newer sandbox's).
    Replaced { found: u32 },
    /// The interface its record names does not carry calix's mark for it (a `cali…` name and
    /// the endpoint's owner alias): never programmed, whatever the record says.
    NotCalix { found: String },
    /// The last attempt to apply it failed; it is retried with backoff.
    Failing { error: String },
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Health::Ok => write!(f, "ok"),
            Health::InterfaceMissing => write!(f, "interface missing"),
            Health::Replaced { found } => write!(f, "interface replaced (now ifindex {found})"),
            Health::NotCalix { found } => {
                write!(f, "interface not calix's ({found}): never programmed")
            }
            Health::Failing { error } => write!(f, "failing: {error}"),
        }
    }
}

/// Where an endpoint stands.
#[derive(Debug, Clone)]
struct State {
    health: Health,
    attached: Option<Attached>,
    /// Failed attempts in a row.
    failures: u32,
    /// When to try again (dirty endpoints only).
    retry_at: Option<Instant>,
}

/// The node's own objects (not an endpoint's): whether they are as desired.
#[derive(Debug, Default)]
struct NodeState {
    failures: u32,
    retry_at: Option<Instant>,
    /// Why the last pass could not bring them to their desired state.
    error: Option<String>,
}

/// The key node-wide repairs are reported under in a [`Pass`].
pub const NODE: &str = "node";
/// The key repairs of routes to other nodes (and their VXLAN devices) are reported under.
pub const ROUTES: &str = "routes";

/// One repair: its kind (`calix_repairs_total{kind}`) and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repair {
    pub kind: &'static str,
    pub what: String,
}

/// What a pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    pub checked: usize,
    pub repairs: Vec<(String, Repair)>,
    /// Endpoints not in their desired state after the pass.
    pub unhealthy: usize,
}

/// Backoff after failures: `first`, doubling, at most `max`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(500),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    fn after(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(16);
        self.first
            .checked_mul(1 << shift)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    #[error("{what}")]
    Kernel {
        what: String,
        #[source]
        source: Box<NetlinkError>,
    },
}

fn kernel_err(what: impl Into<String>) -> impl FnOnce(NetlinkError) -> ReconcileError {
    let what = what.into();
    move |source| ReconcileError::Kernel {
        what,
        source: Box::new(source),
    }
}

/// The endpoint reconciler over the node's kernel `K` and a dataplane.
pub struct Reconciler<K: HostKernel> {
    kernel: K,
    dataplane: Box<dyn Dataplane>,
    desired: BTreeMap<String, EndpointSpec>,
    state: BTreeMap<String, State>,
    node: NodeState,
    /// Routes to other nodes' pods (route distribution's desired state) and the underlay.
    remote: remote::Remote,
    /// Whether they are as desired.
    remote_state: NodeState,
    repairs: BTreeMap<&'static str, u64>,
    /// Full passes ([`Reconciler::resync`]) so far.
    resyncs: u64,
    backoff: Backoff,
}

impl<K: HostKernel> Reconciler<K> {
    pub fn new(kernel: K, dataplane: Box<dyn Dataplane>, backoff: Backoff) -> Self {
        Self {
            kernel,
            dataplane,
            desired: BTreeMap::new(),
            state: BTreeMap::new(),
            node: NodeState::default(),
            remote: remote::Remote::default(),
            remote_state: NodeState::default(),
            repairs: BTreeMap::new(),
            resyncs: 0,
            backoff,
        }
    }

    /// What routes to other nodes leave through (the uplinks, this node's addresses, VXLAN).
    pub fn with_underlay(mut self, underlay: Underlay) -> Self {
        self.remote.underlay = underlay;
        self
    }

    /// The dataplane, for what is not per endpoint (pools, the sweep, release, uninstall).
    pub fn dataplane(&mut self) -> &mut dyn Dataplane {
        self.dataplane.as_mut()
    }

    /// Makes `spec` desired and programs it now (CNI ADD waits for this). A failure is
    /// returned and the endpoint is not kept: the caller (the registry) rolls back.
    pub fn upsert(&mut self, spec: EndpointSpec) -> Result<Attached, DataplaneError> {
        let link =
            self.kernel
                .link(&spec.host_ifname)
                .map_err(|source| DataplaneError::Kernel {
                    what: format!("link {}", spec.host_ifname),
                    source: Box::new(source),
                })?;
        if let Some(found) = link.and_then(|l| not_its_veth(&spec, &l)) {
            return Err(DataplaneError::NotCalix {
                ifname: spec.host_ifname.clone(),
                found,
            });
        }
        // Another endpoint on the same interface name is an older sandbox of the same pod:
        // its interface is gone or is this one; it is no longer desired.
        let older: Vec<String> = self
            .desired
            .iter()
            .filter(|(k, s)| **k != spec.key && s.host_ifname == spec.host_ifname)
            .map(|(k, _)| k.clone())
            .collect();
        for k in older {
            self.desired.remove(&k);
            self.state.remove(&k);
        }
        let attached = self.dataplane.attach(&spec)?;
        self.state.insert(
            spec.key.clone(),
            State {
                health: Health::Ok,
                attached: Some(attached),
                failures: 0,
                retry_at: None,
            },
        );
        self.desired.insert(spec.key.clone(), spec);
        Ok(attached)
    }

    /// Makes a recorded endpoint desired without programming it yet (agent start: the first
    /// [`Reconciler::resync`] applies it).
    pub fn adopt(&mut self, spec: EndpointSpec) {
        self.state.insert(
            spec.key.clone(),
            State {
                health: Health::Failing {
                    error: "not applied yet".into(),
                },
                attached: None,
                failures: 0,
                retry_at: None,
            },
        );
        self.desired.insert(spec.key.clone(), spec);
    }

    /// Forgets endpoint `key` and removes what was programmed for it (only what is still its
    /// own: see [`Dataplane::detach`]).
    pub fn remove(&mut self, key: &str) -> Result<(), DataplaneError> {
        self.desired.remove(key);
        self.state.remove(key);
        self.dataplane.detach(key)
    }

    /// Deletes host link `name` if its alias still names `owner` (a pod's veth: both ends go,
    /// and the kernel takes the pod's route with it). Whether it was deleted.
    pub fn delete_owned_link(&mut self, name: &str, owner: &str) -> Result<bool, DataplaneError> {
        let err = |source| DataplaneError::Kernel {
            what: format!("link {name}"),
            source: Box::new(source),
        };
        match self.kernel.link(name).map_err(err)? {
            Some(l) if l.alias.as_deref() == Some(owner) => {
                self.kernel.delete_link(name).map_err(err)
            }
            _ => Ok(false),
        }
    }

    /// The endpoint's attach result, when it is programmed.
    pub fn attached(&self, key: &str) -> Option<Attached> {
        self.state.get(key).and_then(|s| s.attached)
    }

    /// Every endpoint's health.
    pub fn health(&self) -> BTreeMap<String, Health> {
        self.state
            .iter()
            .map(|(k, s)| (k.clone(), s.health.clone()))
            .collect()
    }

    /// Repairs so far, by kind.
    pub fn repairs(&self) -> &BTreeMap<&'static str, u64> {
        &self.repairs
    }

    /// The host interface names of the endpoints that are programmed (for the sweep of what
    /// no endpoint owns).
    pub fn programmed_interfaces(&self) -> Vec<String> {
        self.desired
            .iter()
            .filter(|(k, _)| self.state.get(*k).is_some_and(|s| s.attached.is_some()))
            .map(|(_, s)| s.host_ifname.clone())
            .collect()
    }

    /// When the next dirty endpoint (or the node's objects) is due.
    pub fn next_retry(&self) -> Option<Instant> {
        self.state
            .values()
            .filter_map(|s| s.retry_at)
            .chain(self.node.retry_at)
            .chain(self.remote_state.retry_at)
            .min()
    }

    /// Why the node's own objects are not as desired; `None` when they are.
    pub fn node_error(&self) -> Option<&str> {
        self.node.error.as_deref()
    }

    /// Why the routes to other nodes are not as desired; `None` when they are.
    pub fn routes_error(&self) -> Option<&str> {
        self.remote_state.error.as_deref()
    }

    /// Desired routes to other nodes that cannot be programmed as asked, and why.
    pub fn route_problems(&self) -> &BTreeMap<ipnet::IpNet, String> {
        &self.remote.problems
    }

    /// Full passes so far.
    pub fn resyncs(&self) -> u64 {
        self.resyncs
    }

    /// Checks every desired endpoint against the kernel and repairs what drifted.
    pub fn resync(&mut self, now: Instant) -> Pass {
        self.resyncs += 1;
        let keys: Vec<String> = self.desired.keys().cloned().collect();
        let t0 = Instant::now();
        let mut pass = self.check_all(&keys, now);
        let t1 = Instant::now();
        self.check_remote(now, &mut pass);
        let t2 = Instant::now();
        self.check_node(now, &mut pass);
        tracing::debug!(endpoints = ?t1 - t0, remote = ?t2 - t1, node = ?t2.elapsed(), "resync stages");
        pass
    }

    /// Retries the dirty endpoints whose backoff has run out.
    pub fn retry_due(&mut self, now: Instant) -> Pass {
        let keys: Vec<String> = self
            .state
            .iter()
            .filter(|(_, s)| s.retry_at.is_some_and(|t| t <= now))
            .map(|(k, _)| k.clone())
            .collect();
        let mut pass = Pass::default();
        if !keys.is_empty() {
            pass = self.check_all(&keys, now);
        }
        if self.remote_state.retry_at.is_some_and(|t| t <= now) {
            self.check_remote(now, &mut pass);
        }
        if self.node.retry_at.is_some_and(|t| t <= now) {
            self.check_node(now, &mut pass);
        }
        pass
    }

    /// Routes to other nodes: programmed or repaired, retried with backoff when that fails.
    /// What a pass writes after the desired set was applied counts as repairs; while it is
    /// being applied (a change, its retries) it is programming.
    fn check_remote(&mut self, now: Instant, pass: &mut Pass) {
        let counting = self.remote.applied;
        let synced = self.remote.sync(&mut self.kernel).and_then(|mut done| {
            if !counting {
                // Devices made just now get their programs at once, not at the next pass.
                done.extend(self.sync_host_devs(&vxlan::DEVICES)?);
            }
            Ok(done)
        });
        match synced {
            Ok(done) => {
                if self.remote_state.error.take().is_some() {
                    tracing::info!("routes to other nodes are in their desired state again");
                }
                self.remote.applied = true;
                self.remote_state.failures = 0;
                self.remote_state.retry_at = None;
                if !counting && !done.is_empty() {
                    for r in &done {
                        tracing::debug!(kind = r.kind, what = %r.what, "programmed");
                    }
                    tracing::info!(
                        changes = done.len(),
                        routes = self.remote.desired.len(),
                        complete = self.remote.complete,
                        "routes to other nodes programmed"
                    );
                }
                if counting {
                    for r in done {
                        tracing::warn!(kind = r.kind, what = %r.what, "repaired a route to another node");
                        *self.repairs.entry(r.kind).or_default() += 1;
                        pass.repairs.push((ROUTES.to_string(), r));
                    }
                }
            }
            Err(e) => {
                self.remote_state.failures += 1;
                let wait = self.backoff.after(self.remote_state.failures);
                self.remote_state.retry_at = Some(now + wait);
                let error = calix_log::error_chain(&e);
                tracing::warn!(%error, attempts = self.remote_state.failures, retry_in = ?wait,
                    "cannot bring the routes to other nodes to their desired state");
                self.remote_state.error = Some(error);
            }
        }
    }

    /// The host-device programs on each of `names` that exists (uplinks, VXLAN devices).
    fn sync_host_devs<S: AsRef<str>>(
        &mut self,
        names: &[S],
    ) -> Result<Vec<Repair>, ReconcileError> {
        let mut repairs = Vec::new();
        for name in names {
            let name = name.as_ref();
            let Some(link) = self
                .kernel
                .link(name)
                .map_err(kernel_err(format!("reading link {name}")))?
            else {
                continue;
            };
            let drift = self
                .dataplane
                .verify_host_dev(name, link.index, &mut self.kernel)?;
            if !drift.is_empty() {
                self.dataplane.attach_host_dev(name)?;
                repairs.extend(drift.iter().map(|d| Repair {
                    kind: d.kind(),
                    what: format!("{name}: {d}"),
                }));
            }
        }
        Ok(repairs)
    }

    /// The node's own objects: repaired when they drifted, retried with backoff when that
    /// fails.
    fn check_node(&mut self, now: Instant, pass: &mut Pass) {
        match self.repair_node() {
            Ok(repairs) => {
                if self.node.error.take().is_some() {
                    tracing::info!("the node's objects are in their desired state again");
                }
                self.node.failures = 0;
                self.node.retry_at = None;
                for r in repairs {
                    tracing::warn!(kind = r.kind, what = %r.what, "repaired on the node");
                    *self.repairs.entry(r.kind).or_default() += 1;
                    pass.repairs.push((NODE.to_string(), r));
                }
            }
            Err(e) => {
                self.node.failures += 1;
                let wait = self.backoff.after(self.node.failures);
                self.node.retry_at = Some(now + wait);
                let error = calix_log::error_chain(&e);
                tracing::warn!(%error, attempts = self.node.failures, retry_in = ?wait,
                    "cannot bring the node's objects to their desired state");
                self.node.error = Some(error);
            }
        }
    }

    fn repair_node(&mut self) -> Result<Vec<Repair>, ReconcileError> {
        let mut repairs = Vec::new();
        sync_settings(&mut self.kernel, node_settings(), &mut repairs)?;
        let drift = self.dataplane.node_drift()?;
        if !drift.is_empty() {
            self.dataplane.repair_node()?;
            repairs.extend(drift.iter().map(|d| Repair {
                kind: d.kind(),
                what: d.to_string(),
            }));
        }
        let devices: Vec<String> = self
            .remote
            .underlay
            .uplinks
            .iter()
            .cloned()
            .chain(vxlan::DEVICES.map(String::from))
            .collect();
        repairs.extend(self.sync_host_devs(&devices)?);
        Ok(repairs)
    }

    /// Makes `routes` the desired routes to other nodes' pods (replacing the previous set)
    /// and programs them now: routes through an uplink or calix's VXLAN devices (made while
    /// some route needs one), their forwarding and neighbour entries. `complete`: route
    /// distribution has heard from every peer (a snapshot, or its grace ran out), so a calix
    /// route to another node that is not in the set is stale and goes, and so does a VXLAN
    /// device no route needs. Before that (an agent just started, re-learning) missing routes
    /// are added and none removed: traffic to the peers keeps its routes meanwhile. A failure
    /// is retried with backoff; every later pass checks them again.
    pub fn set_remote_routes(&mut self, routes: Vec<RemoteRoute>, complete: bool) {
        self.remote.desired = routes.into_iter().map(|r| (r.prefix, r)).collect();
        self.remote.complete = complete;
        self.remote.applied = false;
        let mut pass = Pass::default();
        self.check_remote(Instant::now(), &mut pass);
    }

    /// The desired routes to other nodes' pods.
    pub fn remote_routes(&self) -> impl Iterator<Item = &RemoteRoute> {
        self.remote.desired.values()
    }

    /// Endpoint keys the reconciler holds (for tests and listings).
    pub fn keys(&self) -> HashSet<String> {
        self.desired.keys().cloned().collect()
    }
}

/// Writes each of `settings` that differs from what the kernel has, adding a repair for it.
fn sync_settings<K: HostKernel>(
    kernel: &mut K,
    settings: Vec<HostSetting>,
    repairs: &mut Vec<Repair>,
) -> Result<(), ReconcileError> {
    for setting in settings {
        let now = kernel
            .sysctl(&setting.path)
            .map_err(kernel_err(format!("reading {}", setting.path)))?;
        match now {
            None if setting.optional => {}
            Some(v) if v == setting.value => {}
            was => {
                kernel
                    .set_sysctl(&setting.path, setting.value)
                    .map_err(kernel_err(format!("writing {}", setting.path)))?;
                repairs.push(Repair {
                    kind: "sysctl",
                    what: format!(
                        "{} was {}, want {}",
                        setting.path,
                        was.as_deref().unwrap_or("missing"),
                        setting.value
                    ),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod remote_tests;
#[cfg(test)]
mod tests;
