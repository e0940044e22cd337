//! Kubernetes Services at the sockets: the frontends and backends maps the cgroup `sock_addr`
//! programs read (`calix_common::services`), kept as the agent says. A frontend whose
//! backends change gets them under a new id before its entry points there, and the old id's go
//! after: a connection never meets half a change. A restarted agent reads back what the pins
//! hold and changes only what differs, so the Service traffic of a restart never stops.
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, MapData, PerCpuHashMap};
use calix_common::{
    SvcBackend, SvcBackendKey, SvcCounters, SvcFlow, SvcFlowKey, SvcKey, SvcMaglev, SvcNodeKey,
    SvcRevKey, SvcRevValue, SvcValue, SVC_BACKENDS_MAP, SVC_COUNTERS_MAP, SVC_DROP, SVC_EXTERNAL,
    SVC_FLOWS_MAP, SVC_FLOW_IN, SVC_FLOW_OUT, SVC_FRONTENDS_MAP, SVC_MAGLEV_MAP,
    SVC_MAGLEV_MAX_BACKENDS, SVC_MAGLEV_SLOTS, SVC_NODES_MAP, SVC_PROGRAMS, SVC_REJECT,
    SVC_REV_MAP,
};

use super::service_keys::octets;
pub use super::service_keys::{front, key, node_key, Front, TCP, UDP};
use crate::bpf::{link_create, link_detach, map_err, obj_pin, pin_err, prog_err, take};
use crate::DataplaneError;

/// Every frontend, and where each sends new connections.
pub type Frontends = BTreeMap<Front, Target>;

/// What the socket programs translate: every frontend (`whole`) or the frontends changed since
/// the last translation programmed, and the addresses NodePorts answer on (every node's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Translation {
    pub frontends: Frontends,
    /// Not `whole`: the frontends gone since the last translation programmed.
    pub gone: std::collections::BTreeSet<Front>,
    /// `frontends` is every frontend: the maps' others go ([`ServiceProgrammer::set`]); else
    /// only `frontends` and `gone` change ([`ServiceProgrammer::update`]).
    pub whole: bool,
    pub nodes: std::collections::BTreeSet<IpAddr>,
}

/// Where a frontend sends new connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One of `backends` (address, port), never empty; a client keeps its backend while it
    /// connects again within `affinity_secs` (`sessionAffinity: ClientIP`; 0: no affinity).
    To {
        backends: Vec<(IpAddr, u16)>,
        affinity_secs: u32,
    },
    /// None: the connection is refused.
    Refuse,
    /// None here, and a `Local` policy: dropped (external frontends only; at the sockets, as
    /// [`Target::Refuse`]).
    Drop,
}

impl Target {
    /// Any of `backends`, no affinity.
    pub fn to(backends: Vec<(IpAddr, u16)>) -> Self {
        Target::To {
            backends,
            affinity_secs: 0,
        }
    }
}

/// The maps' backend entries of `t` (those of another family than `family` left out), and
/// the flags and affinity of its frontend.
fn entries(t: &Target, family: u8) -> (Vec<SvcBackend>, u32, u32) {
    match t {
        Target::Refuse => (Vec::new(), SVC_REJECT, 0),
        Target::Drop => (Vec::new(), SVC_REJECT | SVC_DROP, 0),
        Target::To {
            backends,
            affinity_secs,
        } => {
            let backs: Vec<SvcBackend> = backends
                .iter()
                .filter_map(|(a, p)| {
                    let (addr, f) = octets(a);
                    (f == family).then_some(SvcBackend {
                        addr,
                        port: p.to_be(),
                        family: f,
                        _pad: 0,
                    })
                })
                .collect();
            let flags = if backs.is_empty() { SVC_REJECT } else { 0 };
            (backs, flags, *affinity_secs)
        }
    }
}

/// Whether frontend `k` with `backs` gets a Maglev table: an external one (its flows may reach
/// any node) of up to [`SVC_MAGLEV_MAX_BACKENDS`] backends.
fn wants_table(k: &SvcKey, backs: &[SvcBackend]) -> bool {
    k.family & SVC_EXTERNAL != 0 && (1..=SVC_MAGLEV_MAX_BACKENDS).contains(&backs.len())
}

/// The Maglev table of `backs` (`calix_core::services::maglev`): each backend named by its
/// address and port, so every node that has the same backends has the same table, whatever
/// their order.
pub fn maglev(backs: &[SvcBackend]) -> SvcMaglev {
    let names: Vec<Vec<u8>> = backs
        .iter()
        .map(|b| {
            let mut n = b.addr.to_vec();
            n.extend_from_slice(&b.port.to_ne_bytes());
            n
        })
        .collect();
    let mut t = SvcMaglev::default();
    let table = calix_core::services::maglev::table(&names, SVC_MAGLEV_SLOTS as usize);
    for (slot, index) in t.slots.iter_mut().zip(table) {
        // At most SVC_MAGLEV_MAX_BACKENDS: an index always fits.
        *slot = u16::try_from(index).unwrap_or(0);
    }
    t
}

/// Every frontend entry and every backend entry, as the maps hold them.
pub type Held = (Vec<(SvcKey, SvcValue)>, Vec<(SvcBackendKey, SvcBackend)>);

/// The maps, behind a narrow interface (the programmer's logic is tested without a kernel).
pub trait ServiceMaps: Send {
    fn set_front(&mut self, k: &SvcKey, v: &SvcValue) -> Result<(), DataplaneError>;
    fn remove_front(&mut self, k: &SvcKey);
    fn set_back(&mut self, k: &SvcBackendKey, v: &SvcBackend) -> Result<(), DataplaneError>;
    fn remove_back(&mut self, k: &SvcBackendKey);
    /// Every frontend and backend entry the maps hold.
    fn read_back(&self) -> Held;
    /// An external frontend's Maglev table, under its backends' id.
    fn set_table(&mut self, id: u32, t: &SvcMaglev) -> Result<(), DataplaneError>;
    fn remove_table(&mut self, id: u32);
    /// The ids that have a table.
    fn read_tables(&self) -> Vec<u32>;
    /// The frontend (address and port) the socket `cookie`'s peer `backend` was chosen for,
    /// if the programs translated it.
    fn translated(&self, cookie: u64, backend: &SvcBackend) -> Option<SvcRevValue>;
    /// The addresses a NodePort answers on.
    fn set_node(&mut self, k: &SvcNodeKey) -> Result<(), DataplaneError>;
    fn remove_node(&mut self, k: &SvcNodeKey);
    fn read_nodes(&self) -> Vec<SvcNodeKey>;
    /// Forgets the flows from outside that `left`'s frontend sent to its backend, both ways
    /// (the client's next datagram picks again); how many flows.
    fn end_flows(&mut self, left: &Left) -> usize;
}

/// The pinned maps.
pub struct PinnedServiceMaps {
    fronts: HashMap<MapData, SvcKey, SvcValue>,
    backs: HashMap<MapData, SvcBackendKey, SvcBackend>,
    rev: HashMap<MapData, SvcRevKey, SvcRevValue>,
    nodes: HashMap<MapData, SvcNodeKey, u32>,
    counts: PerCpuHashMap<MapData, SvcKey, SvcCounters>,
    flows: HashMap<MapData, SvcFlowKey, SvcFlow>,
    maglev: HashMap<MapData, u32, SvcMaglev>,
}

impl PinnedServiceMaps {
    pub fn open(bpf: &mut aya::Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            fronts: take(bpf, SVC_FRONTENDS_MAP, HashMap::try_from)?,
            backs: take(bpf, SVC_BACKENDS_MAP, HashMap::try_from)?,
            rev: take(bpf, SVC_REV_MAP, HashMap::try_from)?,
            nodes: take(bpf, SVC_NODES_MAP, HashMap::try_from)?,
            counts: take(bpf, SVC_COUNTERS_MAP, PerCpuHashMap::try_from)?,
            flows: take(bpf, SVC_FLOWS_MAP, HashMap::try_from)?,
            maglev: take(bpf, SVC_MAGLEV_MAP, HashMap::try_from)?,
        })
    }
}

impl ServiceMaps for PinnedServiceMaps {
    fn set_front(&mut self, k: &SvcKey, v: &SvcValue) -> Result<(), DataplaneError> {
        self.fronts
            .insert(k, v, 0)
            .map_err(map_err(SVC_FRONTENDS_MAP, "insert"))
    }

    fn remove_front(&mut self, k: &SvcKey) {
        let _ = self.fronts.remove(k);
        // A frontend that comes back (a new Service at the address) counts from zero.
        let _ = self.counts.remove(k);
    }

    fn set_back(&mut self, k: &SvcBackendKey, v: &SvcBackend) -> Result<(), DataplaneError> {
        self.backs
            .insert(k, v, 0)
            .map_err(map_err(SVC_BACKENDS_MAP, "insert"))
    }

    fn remove_back(&mut self, k: &SvcBackendKey) {
        let _ = self.backs.remove(k);
    }

    fn read_back(&self) -> Held {
        (
            self.fronts.iter().filter_map(Result::ok).collect(),
            self.backs.iter().filter_map(Result::ok).collect(),
        )
    }

    fn set_table(&mut self, id: u32, t: &SvcMaglev) -> Result<(), DataplaneError> {
        self.maglev
            .insert(id, t, 0)
            .map_err(map_err(SVC_MAGLEV_MAP, "insert"))
    }

    fn remove_table(&mut self, id: u32) {
        let _ = self.maglev.remove(&id);
    }

    fn read_tables(&self) -> Vec<u32> {
        self.maglev.keys().filter_map(Result::ok).collect()
    }

    fn translated(&self, cookie: u64, b: &SvcBackend) -> Option<SvcRevValue> {
        let k = SvcRevKey {
            cookie,
            addr: b.addr,
            port: b.port,
            family: b.family,
            ..SvcRevKey::default()
        };
        self.rev.get(&k, 0).ok()
    }

    fn set_node(&mut self, k: &SvcNodeKey) -> Result<(), DataplaneError> {
        self.nodes
            .insert(k, 1, 0)
            .map_err(map_err(SVC_NODES_MAP, "insert"))
    }

    fn remove_node(&mut self, k: &SvcNodeKey) {
        let _ = self.nodes.remove(k);
    }

    fn read_nodes(&self) -> Vec<SvcNodeKey> {
        self.nodes.keys().filter_map(Result::ok).collect()
    }

    fn end_flows(&mut self, left: &Left) -> usize {
        let held: Vec<(SvcFlowKey, SvcFlow)> = self.flows.iter().filter_map(Result::ok).collect();
        let ended = ended_flows(left, &held);
        for k in &ended {
            let _ = self.flows.remove(k);
        }
        ended.len() / 2
    }
}

/// The entries of `held` (a flows map's) that belong to flows `left`'s frontend sent to its
/// backend: the client's (`IN`) and the backend's (`OUT`), each flow's both. An `OUT` entry
/// whose `IN` the LRU already forgot is one of them too.
pub fn ended_flows(left: &Left, held: &[(SvcFlowKey, SvcFlow)]) -> Vec<SvcFlowKey> {
    let f = &left.front;
    let (backend, port) = left.backend;
    held.iter()
        .filter(|(k, v)| {
            k.proto == f.proto
                && k.family == f.family & !SVC_EXTERNAL
                && match k.dir {
                    SVC_FLOW_IN => {
                        k.b == f.addr && k.b_port == f.port && v.addr == backend && v.port == port
                    }
                    SVC_FLOW_OUT => {
                        k.a == backend && k.a_port == port && v.addr == f.addr && v.port == f.port
                    }
                    _ => false,
                }
        })
        .map(|(k, _)| *k)
        .collect()
}

/// A UDP backend that left a frontend: connected sockets the programs sent there for that
/// frontend are to be ended ([`super::udp_ends`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Left {
    pub front: SvcKey,
    pub backend: (SvcBackendAddr, u16),
}

/// A backend's address as the maps hold it (16 bytes, an IPv4 one in the first 4).
pub type SvcBackendAddr = [u8; 16];

/// Keeps the maps as the agent says.
pub struct ServiceProgrammer {
    maps: Box<dyn ServiceMaps>,
    /// What the maps hold: each frontend's value and its backends in index order.
    applied: BTreeMap<SvcKey, (SvcValue, Vec<SvcBackend>)>,
    /// The last id handed out.
    id: u32,
    /// The addresses NodePorts answer on, as the maps hold them.
    nodes: std::collections::BTreeSet<SvcNodeKey>,
}

impl ServiceProgrammer {
    /// Over `maps` as they are pinned: a frontend whose backends are all there is kept as it
    /// is; the backends of no frontend go.
    pub fn restore(mut maps: Box<dyn ServiceMaps>) -> Self {
        let (fronts, backs) = maps.read_back();
        let tables: std::collections::BTreeSet<u32> = maps.read_tables().into_iter().collect();
        let mut by_id: BTreeMap<u32, BTreeMap<u32, SvcBackend>> = BTreeMap::new();
        for (k, b) in backs {
            by_id.entry(k.id).or_default().insert(k.index, b);
        }
        let mut applied = BTreeMap::new();
        let mut used = std::collections::BTreeSet::new();
        for (k, v) in fronts {
            let list: Vec<SvcBackend> = by_id
                .get(&v.id)
                .map(|m| m.values().copied().collect())
                .unwrap_or_default();
            // Incomplete (an agent stopped between two writes, or an older build wrote no
            // Maglev table): written again at the next set.
            let complete = list.len() == v.count as usize
                && by_id
                    .get(&v.id)
                    .is_none_or(|m| m.keys().copied().eq(0..v.count))
                && wants_table(&k, &list) == tables.contains(&v.id);
            if complete {
                used.insert(v.id);
                applied.insert(k, (v, list));
            }
        }
        for id in tables.iter().filter(|id| !used.contains(*id)) {
            maps.remove_table(*id);
        }
        for (id, m) in &by_id {
            if !used.contains(id) {
                for index in m.keys() {
                    maps.remove_back(&SvcBackendKey {
                        id: *id,
                        index: *index,
                    });
                }
            }
        }
        let id = by_id.keys().copied().max().unwrap_or(0);
        let nodes = maps.read_nodes().into_iter().collect();
        Self {
            maps,
            applied,
            id,
            nodes,
        }
    }

    /// The addresses NodePorts answer on from now on: the new ones added before the old ones
    /// go. A write that fails stops there; the next call starts again from what the maps hold.
    pub fn set_nodes(
        &mut self,
        addresses: &std::collections::BTreeSet<IpAddr>,
    ) -> Result<(), DataplaneError> {
        let want: std::collections::BTreeSet<SvcNodeKey> = addresses.iter().map(node_key).collect();
        let new: Vec<SvcNodeKey> = want.difference(&self.nodes).copied().collect();
        for k in new {
            self.maps.set_node(&k)?;
            self.nodes.insert(k);
        }
        let gone: Vec<SvcNodeKey> = self.nodes.difference(&want).copied().collect();
        for k in gone {
            self.maps.remove_node(&k);
            self.nodes.remove(&k);
        }
        Ok(())
    }

    fn next_id(&mut self) -> u32 {
        self.id = self.id.wrapping_add(1).max(1);
        self.id
    }

    /// Moves the maps to `desired`; the UDP backends that left a frontend. A write that
    /// fails stops there; the next call starts again from what the maps hold.
    pub fn set(&mut self, desired: &BTreeMap<Front, Target>) -> Result<Vec<Left>, DataplaneError> {
        let mut left = Vec::new();
        let mut keep = std::collections::BTreeSet::new();
        for (f, t) in desired {
            let k = key(f);
            keep.insert(k);
            self.put(k, t, &mut left)?;
        }
        let gone: Vec<SvcKey> = self
            .applied
            .keys()
            .filter(|k| !keep.contains(*k))
            .copied()
            .collect();
        for k in gone {
            self.take_out(&k, &mut left);
        }
        Ok(left)
    }

    /// Changes `changed` and removes `gone`, the rest as it is: what changed since a
    /// [`ServiceProgrammer::set`] (the maps' other frontends stay); the UDP backends that left
    /// a frontend. A write that fails stops there (what was written stays written; a whole
    /// [`ServiceProgrammer::set`] puts the rest right).
    pub fn update(
        &mut self,
        changed: &BTreeMap<Front, Target>,
        gone: &std::collections::BTreeSet<Front>,
    ) -> Result<Vec<Left>, DataplaneError> {
        let mut left = Vec::new();
        for (f, t) in changed {
            self.put(key(f), t, &mut left)?;
        }
        for f in gone {
            self.take_out(&key(f), &mut left);
        }
        Ok(left)
    }

    /// Frontend `k` sending to `t`: its backends (and Maglev table) under a new id first, then
    /// the frontend pointed there, then the old id's entries removed; nothing when the maps
    /// hold it already. UDP backends that left it go to `left`.
    fn put(&mut self, k: SvcKey, t: &Target, left: &mut Vec<Left>) -> Result<(), DataplaneError> {
        let (backs, flags, affinity_secs) = entries(t, k.family & !SVC_EXTERNAL);
        if let Some((v, held)) = self.applied.get(&k) {
            if v.flags == flags && v.affinity_secs == affinity_secs && *held == backs {
                return Ok(());
            }
        }
        let id = if backs.is_empty() { 0 } else { self.next_id() };
        for (i, b) in backs.iter().enumerate() {
            let bk = SvcBackendKey {
                id,
                index: i as u32,
            };
            if let Err(e) = self.maps.set_back(&bk, b) {
                for j in 0..i {
                    self.maps.remove_back(&SvcBackendKey {
                        id,
                        index: j as u32,
                    });
                }
                return Err(e);
            }
        }
        if wants_table(&k, &backs) {
            if let Err(e) = self.maps.set_table(id, &maglev(&backs)) {
                self.remove_backs(&SvcValue {
                    id,
                    count: backs.len() as u32,
                    ..SvcValue::default()
                });
                return Err(e);
            }
        }
        let v = SvcValue {
            id,
            count: backs.len() as u32,
            flags,
            affinity_secs,
        };
        self.maps.set_front(&k, &v)?;
        if let Some((old, held)) = self.applied.insert(k, (v, backs.clone())) {
            left.extend(leaving(&k, &held, &backs));
            self.remove_backs(&old);
        }
        Ok(())
    }

    /// Frontend `k` removed, then its backends; its UDP backends go to `left`.
    fn take_out(&mut self, k: &SvcKey, left: &mut Vec<Left>) {
        if let Some((old, held)) = self.applied.remove(k) {
            self.maps.remove_front(k);
            left.extend(leaving(k, &held, &[]));
            self.remove_backs(&old);
        }
    }

    /// Forgets the flows from outside that each of `left` (UDP backends that left a frontend
    /// for clients outside) carried: the client's next datagram meets a backend that is
    /// there, as kube-proxy clears a UDP backend's conntrack entries. TCP flows stay: an
    /// established connection to a terminating endpoint ends as it would. How many flows.
    pub fn end_flows(&mut self, left: &[Left]) -> usize {
        left.iter()
            .filter(|l| l.front.family & SVC_EXTERNAL != 0)
            .map(|l| self.maps.end_flows(l))
            .sum()
    }

    /// The maps (for [`ServiceMaps::translated`]).
    pub fn maps(&self) -> &dyn ServiceMaps {
        &*self.maps
    }

    /// The backends under `v`'s id, and its Maglev table if it has one.
    fn remove_backs(&mut self, v: &SvcValue) {
        for index in 0..v.count {
            self.maps.remove_back(&SvcBackendKey { id: v.id, index });
        }
        if v.id != 0 {
            self.maps.remove_table(v.id);
        }
    }

    /// Frontends and backend entries the maps hold.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.applied.len(),
            self.applied.values().map(|(_, b)| b.len()).sum(),
        )
    }
}

/// The UDP backends of `held` not in `now`, of frontend `k`.
fn leaving(k: &SvcKey, held: &[SvcBackend], now: &[SvcBackend]) -> Vec<Left> {
    if k.proto != UDP {
        return Vec::new();
    }
    held.iter()
        .filter(|b| !now.contains(b))
        .map(|b| Left {
            front: *k,
            backend: (b.addr, b.port),
        })
        .collect()
}

/// `enum bpf_attach_type` of each of [`SVC_PROGRAMS`], in its order.
const ATTACH_TYPES: [u32; 8] = [10, 11, 14, 15, 19, 20, 29, 30];

/// Where the socket programs' links are pinned, below the node's pin directory (outside the
/// layout's: a build with another map layout replaces the same links).
pub fn links_dir(node_dir: &Path) -> PathBuf {
    node_dir.join("sockets")
}

/// Attaches the socket programs of `bpf` to the cgroup (v2) `cgroup`, their links pinned in
/// `dir`: each new link is attached before the one it replaces goes (an agent restart, an
/// upgrade), so no connection meets neither; both translate alike meanwhile (a frontend once
/// translated is a backend, which the other leaves alone).
pub fn attach_sockets(
    bpf: &mut aya::Ebpf,
    dir: &Path,
    cgroup: &Path,
) -> Result<(), DataplaneError> {
    std::fs::create_dir_all(dir).map_err(pin_err(dir, "create"))?;
    let cg = std::fs::File::open(cgroup).map_err(pin_err(cgroup, "open the cgroup"))?;
    for (name, at) in SVC_PROGRAMS.iter().zip(ATTACH_TYPES) {
        let prog = bpf.program(name).ok_or(DataplaneError::Program {
            name,
            op: "find",
            source: Box::new(aya::programs::ProgramError::NotLoaded),
        })?;
        let fd = prog.fd().map_err(prog_err(name, "fd"))?;
        let link =
            link_create(fd.as_fd(), cg.as_fd(), at).map_err(|e| DataplaneError::Program {
                name,
                op: "attach to the cgroup",
                source: Box::new(aya::programs::ProgramError::IOError(e)),
            })?;
        let pin = dir.join(name);
        let new = dir.join(format!("{name}@new"));
        let _ = std::fs::remove_file(&new);
        obj_pin(link.as_fd(), &new).map_err(pin_err(&new, "pin the link"))?;
        // The new link runs: the old one (a pin of an agent before) goes.
        if pin.exists() {
            let _ = link_detach(&pin);
        }
        std::fs::rename(&new, &pin).map_err(pin_err(&pin, "rename the link's pin"))?;
    }
    Ok(())
}

/// Detaches the socket programs whose links are pinned in `dir` (Services off).
pub fn detach_sockets(dir: &Path) {
    for name in SVC_PROGRAMS {
        let pin = dir.join(name);
        if pin.exists() {
            if let Err(e) = link_detach(&pin) {
                tracing::warn!(program = name, error = %e, "socket program not detached");
            }
            let _ = std::fs::remove_file(&pin);
        }
    }
}

#[cfg(test)]
#[path = "services_tests.rs"]
mod tests;
