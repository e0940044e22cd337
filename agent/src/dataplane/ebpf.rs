//! The eBPF dataplane. Maps live pinned under `<pin root>/<node>/v<layout>/` and the programs
//! under `.../progs/`, and filters stay attached when the agent exits: an agent restart (or a
//! crash) never interrupts traffic. A new agent reuses the pinned maps and replaces each
//! filter's program in place (same priority and handle: one atomic netlink replace), so an
//! upgrade with a changed program never leaves an interface without one. A changed map layout
//! gets a new version directory; the old one is removed once every interface runs the new
//! programs ([`Dataplane::reconcile`]). With `[xdp]` enabled, the uplinks also run the XDP
//! prefilter (`xdp.rs`: pinned links, replaced in place the same way).
use std::collections::HashMap as StdHashMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, MapData, MapError, PerCpuHashMap, PerCpuValues};
use aya::programs::links::Link;
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcAttachType, TcError};
use aya::programs::{Program, ProgramError, SchedClassifier};
use aya::{Ebpf, EbpfLoader};
use calix_common::{
    DropCount, DropKey, EndpointCounters, EndpointInfo, FlowKey, LocalEndpoint, StackFlow,
    ALL_PROGRAMS, COUNTERS_MAP, CT_FREED_MAP, CT_MAP, CT_OWNED_MAP, DROPS_MAP, ENDPOINTS_MAP,
    EP_HAS_V4, EP_HAS_V6, LAYOUT_VERSION, LOCAL_V4_MAP, LOCAL_V6_MAP, POOLS_V4_MAP, POOLS_V6_MAP,
    PROG_FROM_HOST_DEV, PROG_FROM_POD, PROG_TO_HOST_DEV, PROG_TO_POD, STACK_CLEARED_MAP,
    STACK_EPS_MAP, STACK_FLOWS_MAP,
};
use ipnet::IpNet;

use super::bpf::{map_err, pin_err, prog_err, take};
use super::host_addrs::HostAddrs;
use super::nat::{NatMaps, NatSettings};
use super::pins;
use super::xdp::{self, XdpFilter, XdpSettings};
use super::{
    endpoint_ifindex, ifindex, Attached, Dataplane, DataplaneError, DataplaneStats, Drift,
    EndpointSpec,
};
use calix_kernel::host::HostKernel;

/// The object built from ebpf/programs by build.rs, always matching the current sources.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/calix.bpf.o"));

/// tc priority and handle of every calix filter: fixed, so a new agent can replace them.
pub const TC_PRIORITY: u16 = 1;
pub const TC_HANDLE: u32 = 0xca11;

/// Where and on what the dataplane works.
#[derive(Debug, Clone)]
pub struct EbpfConfig {
    /// bpffs directory holding every node's pins, e.g. `/sys/fs/bpf/calix`.
    pub pin_root: PathBuf,
    pub node: String,
    /// The node's uplinks (`from_host_dev` / `to_host_dev`).
    pub uplinks: Vec<String>,
    /// Load this object file instead of the embedded one (an out-of-band dataplane build).
    pub object: Option<PathBuf>,
    /// The XDP prefilter on the uplinks; `None`: off (and detached where an earlier agent
    /// attached it).
    pub xdp: Option<XdpSettings>,
    /// SNAT for `natOutgoing` pools (`None`: the maps keep their defaults, SNAT is off).
    pub nat: Option<NatSettings>,
}

impl EbpfConfig {
    /// `<pin root>/<node>`: everything this node's dataplane pins.
    pub fn node_dir(&self) -> PathBuf {
        self.pin_root.join(&self.node)
    }

    /// The pin directory of the current map layout.
    pub fn pin_dir(&self) -> PathBuf {
        self.node_dir().join(format!("v{LAYOUT_VERSION}"))
    }

    /// Where the uplinks' XDP links are pinned (outside the layout directory: a build with
    /// another map layout updates the same links).
    pub fn xdp_links_dir(&self) -> PathBuf {
        xdp::links_dir(&self.node_dir())
    }
}

/// One endpoint as this process programmed it.
#[derive(Debug, Clone)]
struct Programmed {
    /// The host veth's name and the link it named when programmed.
    ifname: String,
    ifindex: u32,
    ipv4: Option<Ipv4Addr>,
    ipv6: Option<Ipv6Addr>,
}

/// The counters and drops maps, opened from their pins: [`DataplaneStats`] for readers that
/// must not wait for (or hold up) the dataplane.
pub struct EbpfStats {
    counters: PerCpuHashMap<MapData, u32, EndpointCounters>,
    drops: PerCpuHashMap<MapData, DropKey, DropCount>,
}

impl EbpfStats {
    pub fn open(pin_dir: &Path) -> Result<Self, DataplaneError> {
        let open = |name: &'static str| {
            let path = pin_dir.join(name);
            MapData::from_pin(&path)
                .map(aya::maps::Map::PerCpuHashMap)
                .map_err(map_err(name, "open pin"))
        };
        Ok(Self {
            counters: PerCpuHashMap::try_from(open(COUNTERS_MAP)?)
                .map_err(map_err(COUNTERS_MAP, "open"))?,
            drops: PerCpuHashMap::try_from(open(DROPS_MAP)?).map_err(map_err(DROPS_MAP, "open"))?,
        })
    }
}

impl DataplaneStats for EbpfStats {
    fn counters(&self, ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError> {
        match self.counters.get(&ifindex, 0) {
            Ok(per_cpu) => {
                let mut sum = EndpointCounters::default();
                per_cpu.iter().for_each(|c| sum.accumulate(c));
                Ok(Some(sum))
            }
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(COUNTERS_MAP, "lookup")(e)),
        }
    }

    fn drops(&self) -> Result<Vec<(DropKey, DropCount)>, DataplaneError> {
        let mut out = Vec::new();
        for item in self.drops.iter() {
            let (k, per_cpu) = item.map_err(map_err(DROPS_MAP, "iterate"))?;
            let mut sum = DropCount::default();
            per_cpu.iter().for_each(|c| sum.accumulate(c));
            out.push((k, sum));
        }
        out.sort_by_key(|(k, _)| *k);
        Ok(out)
    }
}

pub struct EbpfDataplane {
    cfg: EbpfConfig,
    bpf: Ebpf,
    counters: PerCpuHashMap<MapData, u32, EndpointCounters>,
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    /// Endpoints the programs marked as having flows through the host stack.
    stack_eps: HashMap<MapData, u32, u32>,
    /// Per-endpoint entries the agent removes with the endpoint: cleared overflow marks,
    /// the conntrack budget's counts (`CT_OWNED_MAP`, `CT_FREED_MAP`).
    per_endpoint: Vec<HashMap<MapData, u32, u32>>,
    local_v4: HashMap<MapData, [u8; 4], LocalEndpoint>,
    local_v6: HashMap<MapData, [u8; 16], LocalEndpoint>,
    pools_v4: LpmTrie<MapData, [u8; 4], u32>,
    pools_v6: LpmTrie<MapData, [u8; 16], u32>,
    /// Endpoint key ("containerID/ifname") → what was programmed for it.
    programmed: StdHashMap<String, Programmed>,
    /// Keys of `counters`. aya 0.13's per-CPU `get` answers a missing key with zeros instead
    /// of `KeyNotFound`, so presence is tracked here (read from the map at load).
    counter_keys: std::collections::HashSet<u32>,
    pools: Vec<IpNet>,
    /// The XDP prefilter's maps while it runs (SIGHUP updates them).
    xdp: Option<XdpFilter>,
    /// The SNAT maps (SIGHUP updates the exclusions).
    nat: Option<NatMaps>,
    /// Entries carried from mismatched or older pinned maps: the old programs may add more
    /// until every interface runs the new ones ([`Dataplane::reconcile`] catches up).
    carried: Option<pins::Carried>,
    /// The ids of the loaded `from_pod` and `to_pod`: what every endpoint's filters must run.
    endpoint_prog_ids: (u32, u32),
    /// The ids of the loaded `from_host_dev` and `to_host_dev` (uplinks, VXLAN devices).
    host_dev_prog_ids: (u32, u32),
    /// The host stack's masquerade (from the start or the last reload), and its table as the
    /// kernel held it after the agent wrote it (for repairs).
    stack_nat: Option<super::nat::NatSettings>,
    tables: Vec<super::nft::OwnedTable>,
}

/// Mounts bpffs at /sys/fs/bpf when the pin root lies below it and nothing is mounted there.
fn ensure_bpffs(root: &Path) -> Result<(), DataplaneError> {
    calix_kernel::bpffs::ensure_mounted_for(root)
        .map(|_| ())
        .map_err(|e| {
            pin_err(Path::new(calix_kernel::bpffs::MOUNT_POINT), "mount bpffs")(
                std::io::Error::other(e),
            )
        })
}

/// How calix's ingress and egress filters among `filters` differ from running the programs
/// `(ingress, egress)`.
fn filter_drift(filters: &[calix_kernel::netlink::BpfFilter], ids: (u32, u32)) -> Vec<Drift> {
    let mut drift = Vec::new();
    for (ingress, want) in [(true, ids.0), (false, ids.1)] {
        let ours = filters
            .iter()
            .find(|f| f.ingress == ingress && f.priority == TC_PRIORITY && f.handle == TC_HANDLE);
        match ours {
            Some(f) if f.prog_id == want => {}
            other => drift.push(Drift::Filter {
                ingress,
                found: other.map(|f| f.prog_id),
            }),
        }
    }
    drift
}

fn find<'a>(bpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut Program, DataplaneError> {
    bpf.program_mut(name).ok_or(DataplaneError::Program {
        name,
        op: "find",
        source: Box::new(ProgramError::NotLoaded),
    })
}

fn program<'a>(
    bpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, DataplaneError> {
    find(bpf, name)?.try_into().map_err(prog_err(name, "cast"))
}

/// The XDP program of the loaded object.
pub(super) fn xdp_program(bpf: &mut Ebpf) -> Result<&mut aya::programs::Xdp, DataplaneError> {
    let name = calix_common::PROG_XDP_HOST_DEV;
    find(bpf, name)?.try_into().map_err(prog_err(name, "cast"))
}

/// Loads (verifies) one program of the object as its own type: tc classifier or XDP.
fn load_program(bpf: &mut Ebpf, name: &'static str) -> Result<(), DataplaneError> {
    match find(bpf, name)? {
        Program::SchedClassifier(p) => p.load(),
        Program::Xdp(p) => p.load(),
        _ => Err(ProgramError::UnexpectedProgramType),
    }
    .map_err(prog_err(name, "load"))
}

impl EbpfDataplane {
    /// Loads the object (reusing this node's pinned maps), loads and pins every program, and
    /// attaches the uplink programs.
    pub fn load(cfg: EbpfConfig) -> Result<Self, DataplaneError> {
        ensure_bpffs(&cfg.pin_root)?;
        let pin_dir = cfg.pin_dir();
        let progs_dir = pin_dir.join("progs");
        std::fs::create_dir_all(&progs_dir).map_err(pin_err(&progs_dir, "create"))?;
        let object = match &cfg.object {
            Some(path) => {
                std::borrow::Cow::Owned(std::fs::read(path).map_err(pin_err(path, "read object"))?)
            }
            None => std::borrow::Cow::Borrowed(OBJECT),
        };
        // The configured conntrack size is always the size in effect: a pinned table of
        // another size is migrated into a new one.
        let ct_entries = cfg.nat.as_ref().map(|n| n.conntrack_entries);
        let sizes: Vec<(&str, u32)> = ct_entries.map(|n| (CT_MAP, n)).into_iter().collect();
        let specs = pins::object_specs(&object, &sizes)?;
        let mut carried = pins::prepare(&pin_dir, &cfg.node_dir(), &specs)?;
        let mut loader = EbpfLoader::new();
        loader.map_pin_path(&pin_dir);
        for (name, size) in &sizes {
            loader.set_max_entries(name, *size);
        }
        let mut bpf = loader
            .load(&object)
            .map_err(|e| DataplaneError::Load(Box::new(e)))?;
        // Before any program runs from the new maps.
        carried.restore();
        for name in ALL_PROGRAMS {
            load_program(&mut bpf, name)?;
            let prog = find(&mut bpf, name)?;
            // Re-pin: the pin names the program the filters run from now on.
            let pin = progs_dir.join(name);
            match std::fs::remove_file(&pin) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(pin_err(&pin, "remove old program pin")(e)),
            }
            prog.pin(&pin).map_err(|e| DataplaneError::Pin {
                path: pin.clone(),
                op: "pin program",
                source: std::io::Error::other(e.to_string()),
            })?;
        }
        let prog_id = |bpf: &mut Ebpf, name: &'static str| -> Result<u32, DataplaneError> {
            Ok(program(bpf, name)?
                .info()
                .map_err(prog_err(name, "read info"))?
                .id())
        };
        let endpoint_prog_ids = (
            prog_id(&mut bpf, PROG_FROM_POD)?,
            prog_id(&mut bpf, PROG_TO_POD)?,
        );
        let host_dev_prog_ids = (
            prog_id(&mut bpf, PROG_FROM_HOST_DEV)?,
            prog_id(&mut bpf, PROG_TO_HOST_DEV)?,
        );
        let mut dp = Self {
            counters: take(&mut bpf, COUNTERS_MAP, PerCpuHashMap::try_from)?,
            endpoints: take(&mut bpf, ENDPOINTS_MAP, HashMap::try_from)?,
            stack_eps: take(&mut bpf, STACK_EPS_MAP, HashMap::try_from)?,
            per_endpoint: vec![
                take(&mut bpf, STACK_CLEARED_MAP, HashMap::try_from)?,
                take(&mut bpf, CT_OWNED_MAP, HashMap::try_from)?,
                take(&mut bpf, CT_FREED_MAP, HashMap::try_from)?,
            ],
            local_v4: take(&mut bpf, LOCAL_V4_MAP, HashMap::try_from)?,
            local_v6: take(&mut bpf, LOCAL_V6_MAP, HashMap::try_from)?,
            pools_v4: take(&mut bpf, POOLS_V4_MAP, LpmTrie::try_from)?,
            pools_v6: take(&mut bpf, POOLS_V6_MAP, LpmTrie::try_from)?,
            bpf,
            cfg,
            programmed: StdHashMap::new(),
            counter_keys: std::collections::HashSet::new(),
            pools: Vec::new(),
            xdp: None,
            nat: None,
            carried: Some(carried),
            endpoint_prog_ids,
            host_dev_prog_ids,
            stack_nat: None,
            tables: Vec::new(),
        };
        let mut nat_maps = NatMaps::open(&mut dp.bpf)?;
        if let Some(n) = &dp.cfg.nat {
            nat_maps.apply(n, &dp.cfg.uplinks)?;
        }
        dp.nat = Some(nat_maps);
        dp.counter_keys = dp.counters.keys().filter_map(Result::ok).collect();
        let flows = take(&mut dp.bpf, STACK_FLOWS_MAP, HashMap::try_from)?;
        dp.mark_stack_flow_endpoints(&flows);
        for uplink in dp.cfg.uplinks.clone() {
            dp.attach_pair(&uplink, PROG_FROM_HOST_DEV, PROG_TO_HOST_DEV)?;
            tracing::info!(%uplink, "uplink programs attached");
        }
        dp.start_xdp()?;
        if let Some(n) = dp.cfg.nat.clone() {
            // What the programs leave to the host stack (Service traffic it DNATs out of the
            // node, fragments, other protocols) is masqueraded there, on ports the programs
            // never hand out.
            dp.stack_nat = Some(n);
            dp.apply_stack()?;
        }
        // A table a kernel-mode run left behind: the programs guard the pods now.
        if let Err(e) = super::antispoof::remove() {
            tracing::warn!(error = %e, "cannot remove a kernel-mode anti-spoofing table");
        }
        Ok(dp)
    }

    /// Writes the host stack's masquerade table as `stack_nat` says, and records it.
    fn apply_stack(&mut self) -> Result<(), DataplaneError> {
        self.tables.clear();
        if let Some(n) = &self.stack_nat {
            super::masquerade::apply_stack(n)?;
            self.tables = vec![super::nft::OwnedTable::record(
                "ip",
                super::masquerade::TABLE,
            )?];
        }
        Ok(())
    }

    /// The XDP prefilter: maps filled before the program attaches (it must enforce the policy
    /// from its first packet), the node's addresses kept current from then on
    /// (`host_addrs`); links of interfaces it should no longer run on detached.
    fn start_xdp(&mut self) -> Result<(), DataplaneError> {
        let links = self.cfg.xdp_links_dir();
        let Some(settings) = self.cfg.xdp.clone() else {
            if xdp::detach_except(&links, &[]) > 0 {
                tracing::info!("XDP prefilter is off: detached from the uplinks");
            }
            return Ok(());
        };
        let mut filter = XdpFilter::open(&mut self.bpf)?;
        filter.set_policy(&settings.policy)?;
        self.xdp = Some(filter);
        // The failsafe ports apply to the node's own addresses only: those must be there
        // before the program runs, and stay current after.
        let mut host = HostAddrs::open(&mut self.bpf)?;
        host.refresh()?;
        xdp::detach_except(&links, &self.cfg.uplinks);
        for uplink in &self.cfg.uplinks {
            xdp::attach(xdp_program(&mut self.bpf)?, uplink, settings.mode, &links)?;
        }
        host.watch();
        Ok(())
    }

    /// Attaches `name` at `at` on `ifname` with calix's fixed priority and handle; replaces
    /// (atomically) whatever program a calix filter there runs now.
    fn attach_prog(
        &mut self,
        name: &'static str,
        ifname: &str,
        at: TcAttachType,
    ) -> Result<(), DataplaneError> {
        let prog = program(&mut self.bpf, name)?;
        let opts = TcAttachOptions::Netlink(NlOptions {
            priority: TC_PRIORITY,
            handle: TC_HANDLE,
        });
        let id = match prog.attach_with_options(ifname, at, opts) {
            Ok(id) => id,
            Err(ProgramError::TcError(TcError::NetlinkError { io_error }))
                if io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                let link = SchedClassifierLink::attached(ifname, at, TC_PRIORITY, TC_HANDLE)
                    .map_err(|e| prog_err(name, "find filter")(ProgramError::IOError(e)))?;
                prog.attach_to_link(link)
                    .map_err(prog_err(name, "replace"))?
            }
            Err(e) => return Err(prog_err(name, "attach")(e)),
        };
        let link = prog.take_link(id).map_err(prog_err(name, "take link"))?;
        // The filter outlives this process: detaching is explicit (`detach_prog`).
        std::mem::forget(link);
        Ok(())
    }

    fn attach_pair(
        &mut self,
        ifname: &str,
        ingress: &'static str,
        egress: &'static str,
    ) -> Result<(), DataplaneError> {
        match aya::programs::tc::qdisc_add_clsact(ifname) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => {
                return Err(prog_err(ingress, "add clsact qdisc")(
                    ProgramError::IOError(e),
                ))
            }
        }
        self.attach_prog(ingress, ifname, TcAttachType::Ingress)?;
        self.attach_prog(egress, ifname, TcAttachType::Egress)
    }

    /// Removes calix's filters from `ifname` (either direction; missing is fine).
    pub fn detach_filters(ifname: &str) {
        for at in [TcAttachType::Ingress, TcAttachType::Egress] {
            if let Ok(link) = SchedClassifierLink::attached(ifname, at, TC_PRIORITY, TC_HANDLE) {
                let _ = link.detach();
            }
        }
    }

    /// Marks (`STACK_EPS_MAP`) every local endpoint with a flow in `STACK_FLOWS_MAP`. The
    /// programs mark endpoints as they record flows; this covers flows recorded by a build
    /// from before the marks (the fast path looks flows up only for marked endpoints).
    fn mark_stack_flow_endpoints(&mut self, flows: &HashMap<MapData, FlowKey, StackFlow>) {
        let mut marked = 0usize;
        for key in flows.keys().filter_map(Result::ok) {
            let local = match key.family {
                4 => {
                    let mut a = [0u8; 4];
                    a.copy_from_slice(&key.pod[..4]);
                    self.local_v4.get(&a, 0).ok()
                }
                6 => self.local_v6.get(&key.pod, 0).ok(),
                _ => None,
            };
            if let Some(l) = local {
                // BPF_NOEXIST: never replace an overflow mark the programs set.
                if self.stack_eps.get(&l.ifindex, 0).is_err()
                    && self.stack_eps.insert(l.ifindex, 0, 1).is_ok()
                {
                    marked += 1;
                }
            }
        }
        if marked > 0 {
            tracing::info!(marked, "endpoints with flows through the host stack marked");
        }
    }

    fn zero_counters() -> Result<PerCpuValues<EndpointCounters>, DataplaneError> {
        let n = aya::util::nr_cpus()
            .map_err(|(_, e)| map_err(COUNTERS_MAP, "count CPUs")(MapError::IoError(e)))?;
        PerCpuValues::try_from(vec![EndpointCounters::default(); n])
            .map_err(|e| map_err(COUNTERS_MAP, "build per-CPU value")(MapError::IoError(e)))
    }

    fn forget_entries(&mut self, p: &Programmed) {
        let _ = self.counters.remove(&p.ifindex);
        self.counter_keys.remove(&p.ifindex);
        let _ = self.endpoints.remove(&p.ifindex);
        let _ = self.stack_eps.remove(&p.ifindex);
        for m in &mut self.per_endpoint {
            let _ = m.remove(&p.ifindex);
        }
        self.forget_addresses(p, None, None);
    }

    /// Removes `p`'s local-delivery entries that still point at its ifindex, except for the
    /// addresses `keep_v4` / `keep_v6` (those of an endpoint taking over the same link).
    fn forget_addresses(
        &mut self,
        p: &Programmed,
        keep_v4: Option<Ipv4Addr>,
        keep_v6: Option<Ipv6Addr>,
    ) {
        if let Some(v4) = p.ipv4.filter(|a| Some(*a) != keep_v4) {
            if self
                .local_v4
                .get(&v4.octets(), 0)
                .is_ok_and(|l| l.ifindex == p.ifindex)
            {
                let _ = self.local_v4.remove(&v4.octets());
            }
        }
        if let Some(v6) = p.ipv6.filter(|a| Some(*a) != keep_v6) {
            if self
                .local_v6
                .get(&v6.octets(), 0)
                .is_ok_and(|l| l.ifindex == p.ifindex)
            {
                let _ = self.local_v6.remove(&v6.octets());
            }
        }
    }

    /// The endpoint map's value for `ep`.
    fn endpoint_info(&self, ep: &EndpointSpec) -> EndpointInfo {
        let mut info = EndpointInfo::default();
        if let Some(v4) = ep.ipv4 {
            info.ipv4 = v4.octets();
            info.flags |= EP_HAS_V4;
            if self.cfg.nat.as_ref().is_some_and(|n| n.translates(v4)) {
                info.flags |= calix_common::EP_NAT_OUTGOING;
            }
        }
        if let Some(v6) = ep.ipv6 {
            info.ipv6 = v6.octets();
            info.flags |= EP_HAS_V6;
        }
        info
    }

    fn program_entries(&mut self, idx: u32, ep: &EndpointSpec) -> Result<(), DataplaneError> {
        // Keep counters across an agent restart: only create a missing entry.
        if !self.counter_keys.contains(&idx) {
            let zero = Self::zero_counters()?;
            self.counters
                .insert(idx, zero, 0)
                .map_err(map_err(COUNTERS_MAP, "insert"))?;
            self.counter_keys.insert(idx);
        }
        let info = self.endpoint_info(ep);
        self.endpoints
            .insert(idx, info, 0)
            .map_err(map_err(ENDPOINTS_MAP, "insert"))?;
        if let Some(mac) = ep.mac {
            let local = LocalEndpoint {
                ifindex: idx,
                _pad: 0,
                mac,
            };
            if let Some(v4) = ep.ipv4 {
                self.local_v4
                    .insert(v4.octets(), local, 0)
                    .map_err(map_err(LOCAL_V4_MAP, "insert"))?;
            }
            if let Some(v6) = ep.ipv6 {
                self.local_v6
                    .insert(v6.octets(), local, 0)
                    .map_err(map_err(LOCAL_V6_MAP, "insert"))?;
            }
        }
        Ok(())
    }
}

impl Dataplane for EbpfDataplane {
    fn attach(&mut self, ep: &EndpointSpec) -> Result<Attached, DataplaneError> {
        let ifname = ep.host_ifname.as_str();
        let idx = endpoint_ifindex(ep)?;
        // What was programmed before on this interface name (an older sandbox of a recreated
        // pod, or this endpoint before a restart of its veth): entries of another link are
        // stale; on this very link only the addresses this endpoint doesn't have.
        let earlier: Vec<String> = self
            .programmed
            .iter()
            .filter(|(k, p)| *k == &ep.key || p.ifname == ifname)
            .map(|(k, _)| k.clone())
            .collect();
        for k in earlier {
            if let Some(old) = self.programmed.remove(&k) {
                if old.ifindex == idx {
                    self.forget_addresses(&old, ep.ipv4, ep.ipv6);
                } else {
                    self.forget_entries(&old);
                }
            }
        }
        let p = Programmed {
            ifname: ifname.to_string(),
            ifindex: idx,
            ipv4: ep.ipv4,
            ipv6: ep.ipv6,
        };
        // Entries before programs: the programs must find the endpoint from the first packet.
        let programmed = self
            .program_entries(idx, ep)
            .and_then(|()| self.attach_pair(ifname, PROG_FROM_POD, PROG_TO_POD));
        if let Err(e) = programmed {
            self.forget_entries(&p);
            Self::detach_filters(ifname);
            return Err(e);
        }
        self.programmed.insert(ep.key.clone(), p);
        Ok(Attached {
            ifindex: idx,
            bpf: true,
        })
    }

    fn detach(&mut self, key: &str) -> Result<(), DataplaneError> {
        let Some(p) = self.programmed.remove(key) else {
            return Ok(());
        };
        if let Some(other) = self
            .programmed
            .values()
            .find(|o| o.ifindex == p.ifindex)
            .cloned()
        {
            // Another endpoint runs on this very link now: it keeps the link's entries and
            // programs; only our own addresses go.
            self.forget_addresses(&p, other.ipv4, other.ipv6);
            return Ok(());
        }
        self.forget_entries(&p);
        if ifindex(&p.ifname).ok() == Some(p.ifindex) {
            // The veth is still ours: remove our filters. (When CNI DEL deleted the veth first,
            // the kernel removed its filters with it; when a recreated pod's veth has the name
            // now, its filters are not ours to remove.)
            Self::detach_filters(&p.ifname);
        }
        Ok(())
    }

    fn verify(
        &self,
        ep: &EndpointSpec,
        kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        let idx = endpoint_ifindex(ep)?;
        let mut drift = Vec::new();
        let filters = kernel
            .bpf_filters(idx)
            .map_err(|source| DataplaneError::Kernel {
                what: format!("the tc filters of {}", ep.host_ifname),
                source: Box::new(source),
            })?;
        drift.extend(filter_drift(&filters, self.endpoint_prog_ids));
        if self.endpoints.get(&idx, 0).ok() != Some(self.endpoint_info(ep)) {
            drift.push(Drift::EndpointEntry);
        }
        if ep.mac.is_some() {
            let points_here = |l: Option<LocalEndpoint>| {
                l.is_some_and(|l| l.ifindex == idx && Some(l.mac) == ep.mac)
            };
            if let Some(v4) = ep.ipv4 {
                if !points_here(self.local_v4.get(&v4.octets(), 0).ok()) {
                    drift.push(Drift::LocalEntry(v4.into()));
                }
            }
            if let Some(v6) = ep.ipv6 {
                if !points_here(self.local_v6.get(&v6.octets(), 0).ok()) {
                    drift.push(Drift::LocalEntry(v6.into()));
                }
            }
        }
        Ok(drift)
    }

    fn attach_host_dev(&mut self, ifname: &str) -> Result<(), DataplaneError> {
        self.attach_pair(ifname, PROG_FROM_HOST_DEV, PROG_TO_HOST_DEV)?;
        tracing::info!(%ifname, "host device programs attached");
        Ok(())
    }

    fn verify_host_dev(
        &self,
        ifname: &str,
        index: u32,
        kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        let filters = kernel
            .bpf_filters(index)
            .map_err(|source| DataplaneError::Kernel {
                what: format!("the tc filters of {ifname}"),
                source: Box::new(source),
            })?;
        Ok(filter_drift(&filters, self.host_dev_prog_ids))
    }

    fn stats(&self) -> Result<Option<Box<dyn DataplaneStats>>, DataplaneError> {
        Ok(Some(Box::new(EbpfStats::open(&self.cfg.pin_dir())?)))
    }

    fn set_pools(&mut self, pools: &[IpNet]) -> Result<(), DataplaneError> {
        for old in std::mem::take(&mut self.pools) {
            match old {
                IpNet::V4(n) => {
                    let _ = self
                        .pools_v4
                        .remove(&Key::new(u32::from(n.prefix_len()), n.network().octets()));
                }
                IpNet::V6(n) => {
                    let _ = self
                        .pools_v6
                        .remove(&Key::new(u32::from(n.prefix_len()), n.network().octets()));
                }
            }
        }
        for p in pools {
            match p {
                IpNet::V4(n) => self
                    .pools_v4
                    .insert(
                        &Key::new(u32::from(n.prefix_len()), n.network().octets()),
                        1,
                        0,
                    )
                    .map_err(map_err(POOLS_V4_MAP, "insert"))?,
                IpNet::V6(n) => self
                    .pools_v6
                    .insert(
                        &Key::new(u32::from(n.prefix_len()), n.network().octets()),
                        1,
                        0,
                    )
                    .map_err(map_err(POOLS_V6_MAP, "insert"))?,
            }
        }
        self.pools = pools.to_vec();
        Ok(())
    }

    fn reconcile(&mut self, known: &[String]) -> Result<(), DataplaneError> {
        let known_idx: std::collections::HashSet<u32> =
            self.programmed.values().map(|p| p.ifindex).collect();
        // Map entries of interfaces no endpoint owns (a DEL while the agent was away).
        let stale: Vec<u32> = self
            .endpoints
            .keys()
            .filter_map(Result::ok)
            .filter(|i| !known_idx.contains(i))
            .collect();
        for i in &stale {
            let _ = self.endpoints.remove(i);
        }
        let stale_marks: Vec<u32> = self
            .stack_eps
            .keys()
            .filter_map(Result::ok)
            .filter(|i| !known_idx.contains(i))
            .collect();
        for i in &stale_marks {
            let _ = self.stack_eps.remove(i);
        }
        let mut stale_budget = 0usize;
        for m in &mut self.per_endpoint {
            let stale: Vec<u32> = m
                .keys()
                .filter_map(Result::ok)
                .filter(|i| !known_idx.contains(i))
                .collect();
            for i in &stale {
                let _ = m.remove(i);
            }
            stale_budget += stale.len();
        }
        let stale_ctr: Vec<u32> = self
            .counters
            .keys()
            .filter_map(Result::ok)
            .filter(|i| !known_idx.contains(i))
            .collect();
        for i in &stale_ctr {
            let _ = self.counters.remove(i);
            self.counter_keys.remove(i);
        }
        let v4: Vec<[u8; 4]> = self
            .local_v4
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, l)| !known_idx.contains(&l.ifindex))
            .map(|(k, _)| k)
            .collect();
        for k in &v4 {
            let _ = self.local_v4.remove(k);
        }
        let v6: Vec<[u8; 16]> = self
            .local_v6
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, l)| !known_idx.contains(&l.ifindex))
            .map(|(k, _)| k)
            .collect();
        for k in &v6 {
            let _ = self.local_v6.remove(k);
        }
        // cali* interfaces that still run calix filters but belong to no endpoint.
        let mut swept = 0usize;
        if let Ok(ifaces) = nix::net::if_::if_nameindex() {
            for i in ifaces.iter() {
                let name = i.name().to_string_lossy().into_owned();
                if name.starts_with("cali") && !known.contains(&name) {
                    Self::detach_filters(&name);
                    swept += 1;
                }
            }
        }
        // Every known interface runs this build's programs now: what the old ones added to
        // the maps carried over since the start is copied, then the old maps go.
        if let Some(c) = self.carried.take() {
            c.catch_up();
        }
        // Pins of older map layouts: every known interface now runs this build's programs.
        let mut old_layouts = Vec::new();
        if let Ok(rd) = std::fs::read_dir(self.cfg.node_dir()) {
            let current = format!("v{LAYOUT_VERSION}");
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('v') && name != current {
                    let _ = std::fs::remove_dir_all(e.path());
                    old_layouts.push(name);
                }
            }
        }
        tracing::info!(
            stale_entries = stale.len() + stale_ctr.len() + v4.len() + v6.len() + stale_budget,
            unknown_cali_interfaces = swept,
            ?old_layouts,
            "dataplane reconciled after the initial sync"
        );
        Ok(())
    }

    fn reload(&mut self, r: &super::Reload) -> Result<(), DataplaneError> {
        if let Some(filter) = &mut self.xdp {
            filter.set_policy(&r.xdp)?;
            tracing::info!("XDP deny list and failsafe ports reloaded");
        }
        if let Some(maps) = &mut self.nat {
            maps.set_no_snat(&r.nat.untranslated())?;
            tracing::info!("SNAT exclusions and service_cidrs reloaded");
        }
        self.stack_nat = Some(r.nat.clone());
        self.apply_stack()
    }

    fn node_drift(&self) -> Result<Vec<Drift>, DataplaneError> {
        super::nft::drift_of(&self.tables)
    }

    fn repair_node(&mut self) -> Result<(), DataplaneError> {
        self.apply_stack()
    }

    fn release(&mut self) {
        // Filters stay attached (their links were forgotten at attach), maps stay pinned.
        self.programmed.clear();
    }
}
