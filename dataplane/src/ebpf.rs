//! The eBPF dataplane. Maps live pinned under `<pin root>/<node>/v<layout>/` and the programs
//! under `.../progs/`, and the tc attachments (pinned tcx links, or cls_bpf filters: `tcx.rs`)
//! stay when the agent exits: an agent restart (or a crash) never interrupts traffic. A new
//! agent reuses the pinned maps and replaces each attachment's program in place (one atomic
//! update), so an upgrade with a changed program never leaves an interface without one. A changed map layout
//! gets a new version directory; the old one is removed once every interface runs the new
//! programs ([`Dataplane::reconcile`]). With `[xdp]` enabled, the uplinks also run the XDP
//! prefilter (`xdp.rs`: pinned links, replaced in place the same way).
use std::collections::HashMap as StdHashMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData, MapError, PerCpuArray, PerCpuHashMap, PerCpuValues};
use aya::programs::tc::TcAttachType;
use aya::programs::{Program, ProgramError, SchedClassifier};
use aya::{Ebpf, EbpfLoader};
use calix_common::{
    direct_bucket, DirectEndpoint, DropCount, DropKey, EndpointCounters, EndpointInfo, FlowKey,
    LocalEndpoint, StackFlow, ALL_PROGRAMS, COUNTERS_MAP, CT_FREED_MAP, CT_MAP, CT_OWNED_MAP,
    DROPS_MAP, ENDPOINTS_DIRECT_MAP, ENDPOINTS_MAP, EP_HAS_V4, EP_HAS_V6, LAYOUT_VERSION,
    LOCAL_V4_MAP, LOCAL_V6_MAP, MAX_ENDPOINTS, POOLS_V4_MAP, POOLS_V6_MAP, PROG_FROM_HOST_DEV,
    PROG_FROM_POD, PROG_TO_HOST_DEV, PROG_TO_POD, STACK_CLEARED_MAP, STACK_EPS_MAP,
    STACK_FLOWS_MAP, STACK_MARKED, STACK_OVERFLOW_MAP,
};
use ipnet::IpNet;

use super::bpf::{map_err, open_hash, open_per_cpu_array, pin_err, prog_err, take};
use super::doors::{DoorMaps, DoorPolicy, Doors, PeerNodes};
use super::host_addrs::HostAddrs;
use super::nat::{NatMaps, NatSettings};
use super::pins;
use super::slots::Slots;
use super::tcx::{self, Attacher, Attachment, TcAttach, TC_HANDLE, TC_PRIORITY};
use super::xdp::{self, XdpFilter, XdpSettings};
use super::{
    endpoint_ifindex, ifindex, Attached, Dataplane, DataplaneError, DataplaneStats, Drift,
    EndpointSpec,
};
use calix_kernel::host::HostKernel;

/// The object built from ebpf/programs by build.rs, always matching the current sources.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/calix.bpf.o"));

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
    /// How the tc programs attach.
    pub tc_attach: TcAttach,
    /// The agents' ports pods may not reach ([`super::doors`]).
    pub doors: DoorPolicy,
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

    /// Where the tcx links are pinned (outside the layout directory, as the XDP links).
    pub fn tcx_links_dir(&self) -> PathBuf {
        tcx::links_dir(&self.node_dir())
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

/// The counters and drops maps (and the endpoints, for their slots), opened from their pins:
/// [`DataplaneStats`] for readers that must not wait for (or hold up) the dataplane.
pub struct EbpfStats {
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    counters: PerCpuArray<MapData, EndpointCounters>,
    drops: PerCpuHashMap<MapData, DropKey, DropCount>,
}

impl EbpfStats {
    pub fn open(pin_dir: &Path) -> Result<Self, DataplaneError> {
        let path = pin_dir.join(DROPS_MAP);
        let drops = MapData::from_pin(&path)
            .map(aya::maps::Map::PerCpuHashMap)
            .map_err(map_err(DROPS_MAP, "open pin"))?;
        Ok(Self {
            endpoints: open_hash(pin_dir, ENDPOINTS_MAP)?,
            counters: open_per_cpu_array(pin_dir, COUNTERS_MAP)?,
            drops: PerCpuHashMap::try_from(drops).map_err(map_err(DROPS_MAP, "open"))?,
        })
    }
}

impl DataplaneStats for EbpfStats {
    fn counters(&self, ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError> {
        let slot = match self.endpoints.get(&ifindex, 0) {
            Ok(info) => info.slot,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(map_err(ENDPOINTS_MAP, "lookup")(e)),
        };
        let per_cpu = self
            .counters
            .get(&slot, 0)
            .map_err(map_err(COUNTERS_MAP, "lookup"))?;
        let mut sum = EndpointCounters::default();
        per_cpu.iter().for_each(|c| sum.accumulate(c));
        Ok(Some(sum))
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
    /// By slot.
    counters: PerCpuArray<MapData, EndpointCounters>,
    /// The endpoint table, and its direct-mapped copy the programs look in first
    /// ([`Self::write_endpoint`]).
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    direct: Array<MapData, DirectEndpoint>,
    /// The stack-flow marks by slot (`STACK_EPS_MAP`, `STACK_OVERFLOW_MAP`,
    /// `STACK_CLEARED_MAP`), zeroed with the counters when a slot is handed out.
    stack_marks: [Array<MapData, u32>; 3],
    /// Which slot each endpoint (host veth ifindex) has, as the endpoint map says.
    slots: Slots,
    /// Until the initial sync is over: the marks an endpoint inherits when it gets its slot.
    inherited: Option<Inherited>,
    /// Per-endpoint entries the agent removes with the endpoint: the conntrack budget's
    /// counts (`CT_OWNED_MAP`, `CT_FREED_MAP`).
    per_endpoint: Vec<HashMap<MapData, u32, u32>>,
    local_v4: HashMap<MapData, [u8; 4], LocalEndpoint>,
    local_v6: HashMap<MapData, [u8; 16], LocalEndpoint>,
    pools_v4: LpmTrie<MapData, [u8; 4], u32>,
    pools_v6: LpmTrie<MapData, [u8; 16], u32>,
    /// Endpoint key ("containerID/ifname") → what was programmed for it.
    programmed: StdHashMap<String, Programmed>,
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
    /// tcx links or cls_bpf filters, for this kernel.
    attacher: Attacher,
    /// The host stack's masquerade (from the start or the last reload), and its table as the
    /// kernel held it after the agent wrote it (for repairs).
    stack_nat: Option<super::nat::NatSettings>,
    tables: Vec<super::nft::OwnedTable>,
    /// The doors' maps, and the other nodes as last told ([`Dataplane::set_peer_nodes`]).
    doors: DoorMaps,
    peers: PeerNodes,
}

/// What an endpoint programmed during the initial sync inherits: the stack-flow marks of an
/// older layout (by ifindex, into a new slot), and a mark when a flow in the stack-flow table
/// names one of its addresses (flows recorded by a build from before the marks, or carried
/// from an older layout): the fast path must check those flows.
struct Inherited {
    marks: pins::OldMarks,
    flow_addrs: std::collections::HashSet<[u8; 16]>,
}

impl Inherited {
    fn read(marks: pins::OldMarks, flows: &HashMap<MapData, FlowKey, StackFlow>) -> Self {
        Self {
            marks,
            flow_addrs: flows.keys().filter_map(Result::ok).map(|k| k.pod).collect(),
        }
    }

    /// (`STACK_EPS_MAP`, `STACK_OVERFLOW_MAP`) values for the endpoint `ep` on `ifindex`.
    fn for_endpoint(&self, ifindex: u32, ep: &EndpointSpec) -> (u32, u32) {
        let old = self.marks.get(ifindex);
        let mut v4 = [0u8; 16];
        let named = ep.ipv4.is_some_and(|a| {
            v4[..4].copy_from_slice(&a.octets());
            self.flow_addrs.contains(&v4)
        }) || ep
            .ipv6
            .is_some_and(|a| self.flow_addrs.contains(&a.octets()));
        let marked = if old.is_some() || named {
            STACK_MARKED
        } else {
            0
        };
        (marked, old.unwrap_or(0))
    }
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
        let mut endpoints: HashMap<MapData, u32, EndpointInfo> =
            take(&mut bpf, ENDPOINTS_MAP, HashMap::try_from)?;
        // The slots as the pinned endpoint map has them (an agent restart keeps them, and the
        // counters with them); an entry whose slot is out of range or taken twice goes (its
        // endpoint gets a slot again when it is programmed).
        let (slots, rejected) = Slots::restore(
            MAX_ENDPOINTS,
            endpoints
                .iter()
                .filter_map(Result::ok)
                .map(|(i, e)| (i, e.slot)),
        );
        for i in rejected {
            tracing::warn!(ifindex = i, "endpoint entry with a bad slot removed");
            let _ = endpoints.remove(&i);
        }
        let flows = take(&mut bpf, STACK_FLOWS_MAP, HashMap::try_from)?;
        let inherited = Inherited::read(carried.old_marks(), &flows);
        let attachment = cfg.tc_attach.resolve();
        let cfg_tcx_dir = cfg.tcx_links_dir();
        tracing::info!(
            "tc programs attach with {}",
            match attachment {
                Attachment::Tcx => "tcx links",
                Attachment::ClsBpf => "cls_bpf filters",
            }
        );
        // The doors: this node's own addresses (kept current from now on, for the XDP
        // failsafe too) and the agents' ports, before any pod's packet meets the programs;
        // the other nodes' addresses as the pins hold them until route distribution says.
        let mut host = HostAddrs::open(&mut bpf)?;
        host.refresh()?;
        host.watch();
        let mut doors = DoorMaps::open(&mut bpf)?;
        let kept = PeerNodes {
            addresses: doors.peers(),
            routes_ports: Default::default(),
        };
        doors.set(&Doors::of(&cfg.doors, &kept))?;
        let mut dp = Self {
            doors,
            counters: take(&mut bpf, COUNTERS_MAP, PerCpuArray::try_from)?,
            endpoints,
            direct: take(&mut bpf, ENDPOINTS_DIRECT_MAP, Array::try_from)?,
            stack_marks: [
                take(&mut bpf, STACK_EPS_MAP, Array::try_from)?,
                take(&mut bpf, STACK_OVERFLOW_MAP, Array::try_from)?,
                take(&mut bpf, STACK_CLEARED_MAP, Array::try_from)?,
            ],
            slots,
            inherited: Some(inherited),
            per_endpoint: vec![
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
            pools: Vec::new(),
            xdp: None,
            nat: None,
            carried: Some(carried),
            endpoint_prog_ids,
            host_dev_prog_ids,
            attacher: Attacher::new(attachment, cfg_tcx_dir),
            stack_nat: None,
            tables: Vec::new(),
            peers: PeerNodes::default(),
        };
        let mut nat_maps = NatMaps::open(&mut dp.bpf)?;
        if let Some(n) = &dp.cfg.nat {
            nat_maps.apply(n, &dp.cfg.uplinks)?;
        }
        dp.nat = Some(nat_maps);
        for uplink in dp.cfg.uplinks.clone() {
            dp.attach_pair(&uplink, PROG_FROM_HOST_DEV, PROG_TO_HOST_DEV)?;
            tracing::info!(%uplink, "uplink programs attached");
        }
        dp.start_xdp()?;
        // What the programs leave to the host stack (Service traffic it DNATs out of the
        // node, fragments, other protocols) is masqueraded there, on ports the programs never
        // hand out; and it meets the doors' table.
        dp.stack_nat = dp.cfg.nat.clone();
        dp.peers = kept;
        dp.apply_tables()?;
        // A table a kernel-mode run left behind: the programs guard the pods now.
        if let Err(e) = super::antispoof::remove() {
            tracing::warn!(error = %e, "cannot remove a kernel-mode anti-spoofing table");
        }
        Ok(dp)
    }

    /// Writes the host stack's masquerade table as `stack_nat` says, and the doors' table,
    /// and records them.
    fn apply_tables(&mut self) -> Result<(), DataplaneError> {
        self.tables.clear();
        if let Some(n) = &self.stack_nat {
            super::masquerade::apply_stack(n)?;
            self.tables.push(super::nft::OwnedTable::record(
                super::masquerade::FAMILY,
                super::masquerade::TABLE,
            )?);
        }
        self.apply_doors_table()
    }

    fn apply_doors_table(&mut self) -> Result<(), DataplaneError> {
        self.tables
            .retain(|t| !t.is(super::doors::FAMILY, super::doors::TABLE));
        super::doors::apply(&Doors::of(&self.cfg.doors, &self.peers))?;
        self.tables.push(super::nft::OwnedTable::record(
            super::doors::FAMILY,
            super::doors::TABLE,
        )?);
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
        // The failsafe ports apply to the node's own addresses only: those are in the maps
        // since the load, and kept current.
        xdp::detach_except(&links, &self.cfg.uplinks);
        for uplink in &self.cfg.uplinks {
            xdp::attach(xdp_program(&mut self.bpf)?, uplink, settings.mode, &links)?;
        }
        Ok(())
    }

    /// Attaches `ingress` and `egress` on `ifname` ([`Attacher::attach`]: replacing what
    /// runs there now, atomically).
    fn attach_pair(
        &mut self,
        ifname: &str,
        ingress: &'static str,
        egress: &'static str,
    ) -> Result<(), DataplaneError> {
        let progs = self.cfg.pin_dir().join("progs");
        for (name, at) in [
            (ingress, TcAttachType::Ingress),
            (egress, TcAttachType::Egress),
        ] {
            let prog = program(&mut self.bpf, name)?;
            self.attacher
                .attach(prog, name, &progs.join(name), ifname, at)?;
        }
        Ok(())
    }

    /// Removes calix's programs from `ifname` (either direction and kind; missing is fine).
    pub fn detach_filters(&self, ifname: &str) {
        self.attacher.detach(ifname);
    }

    /// How calix's attachments on `ifname` (link `index`) differ from running the programs
    /// `ids` (ingress, egress): a tcx link or a cls_bpf filter runs each (a hook moving to tcx
    /// has the filter until the move); a filter only, with `tc_attach = "tc"`.
    fn attachment_drift(
        &self,
        ifname: &str,
        index: u32,
        ids: (u32, u32),
        kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        let filters = kernel
            .bpf_filters(index)
            .map_err(|source| DataplaneError::Kernel {
                what: format!("the tc filters of {ifname}"),
                source: Box::new(source),
            })?;
        let mut drift = filter_drift(&filters, ids);
        if self.attacher.how() == Attachment::Tcx && !drift.is_empty() {
            let on_link = |at: TcAttachType, want: u32| {
                tcx::programs(ifname, at)
                    .map(|progs| progs.contains(&want))
                    .map_err(|e| DataplaneError::Program {
                        name: "tcx",
                        op: "query",
                        source: Box::new(e),
                    })
            };
            let (ingress, egress) = (
                on_link(TcAttachType::Ingress, ids.0)?,
                on_link(TcAttachType::Egress, ids.1)?,
            );
            drift.retain(|d| match d {
                Drift::Filter { ingress: true, .. } => !ingress,
                Drift::Filter { ingress: false, .. } => !egress,
                _ => true,
            });
        }
        Ok(drift)
    }

    /// Marks what an older layout's programs marked until they were replaced (the endpoints
    /// have their slots now). Programs may write overflow marks meanwhile: either value
    /// stands for an overflow, so the race is harmless.
    fn write_old_marks(&mut self, marks: &pins::OldMarks) {
        for (ifindex, overflow) in marks.iter() {
            let Some(slot) = self.slots.get(ifindex) else {
                continue;
            };
            let _ = self.stack_marks[0].set(slot, STACK_MARKED, 0);
            if overflow != 0 {
                let _ = self.stack_marks[1].set(slot, overflow, 0);
            }
        }
    }

    fn zero_counters() -> Result<PerCpuValues<EndpointCounters>, DataplaneError> {
        let n = aya::util::nr_cpus()
            .map_err(|(_, e)| map_err(COUNTERS_MAP, "count CPUs")(MapError::IoError(e)))?;
        PerCpuValues::try_from(vec![EndpointCounters::default(); n])
            .map_err(|e| map_err(COUNTERS_MAP, "build per-CPU value")(MapError::IoError(e)))
    }

    /// Zeroes the per-endpoint arrays at `slot`, newly handed to the endpoint `ep` on
    /// `ifindex` (marks it inherits during the initial sync excepted).
    fn clear_slot(
        &mut self,
        slot: u32,
        ifindex: u32,
        ep: &EndpointSpec,
    ) -> Result<(), DataplaneError> {
        let (marked, overflow) = self
            .inherited
            .as_ref()
            .map_or((0, 0), |i| i.for_endpoint(ifindex, ep));
        self.counters
            .set(slot, Self::zero_counters()?, 0)
            .map_err(map_err(COUNTERS_MAP, "zero a slot"))?;
        let names = [STACK_EPS_MAP, STACK_OVERFLOW_MAP, STACK_CLEARED_MAP];
        for ((m, name), v) in self
            .stack_marks
            .iter_mut()
            .zip(names)
            .zip([marked, overflow, 0])
        {
            m.set(slot, v, 0).map_err(map_err(name, "set a slot"))?;
        }
        Ok(())
    }

    /// Writes the endpoint on `idx` into the endpoint table, then into its direct-mapped bucket
    /// when the bucket is free, stale (an interface that has no slot) or its own; a bucket
    /// another live endpoint holds stays as it is, and the programs find this one in the
    /// table.
    fn write_endpoint(&mut self, idx: u32, info: EndpointInfo) -> Result<(), DataplaneError> {
        self.endpoints
            .insert(idx, info, 0)
            .map_err(map_err(ENDPOINTS_MAP, "insert"))?;
        let bucket = direct_bucket(idx);
        let held = self
            .direct
            .get(&bucket, 0)
            .map_err(map_err(ENDPOINTS_DIRECT_MAP, "lookup"))?
            .ifindex;
        if held == 0 || held == idx || self.slots.get(held).is_none() {
            let d = DirectEndpoint {
                ifindex: idx,
                _pad: 0,
                info,
            };
            self.direct
                .set(bucket, d, 0)
                .map_err(map_err(ENDPOINTS_DIRECT_MAP, "set"))?;
        }
        Ok(())
    }

    /// Removes the endpoint on `idx` from the table and its bucket; another endpoint that
    /// shares the bucket moves in.
    fn forget_endpoint(&mut self, idx: u32) {
        let _ = self.endpoints.remove(&idx);
        let bucket = direct_bucket(idx);
        if self.direct.get(&bucket, 0).is_ok_and(|d| d.ifindex == idx) {
            let next = self
                .slots
                .iter()
                .map(|(i, _)| i)
                .filter(|i| *i != idx && direct_bucket(*i) == bucket)
                .find_map(|i| Some((i, self.endpoints.get(&i, 0).ok()?)));
            let d = next.map_or(DirectEndpoint::default(), |(ifindex, info)| {
                DirectEndpoint {
                    ifindex,
                    _pad: 0,
                    info,
                }
            });
            let _ = self.direct.set(bucket, d, 0);
        }
    }

    fn forget_entries(&mut self, p: &Programmed) {
        self.forget_endpoint(p.ifindex);
        self.slots.release(p.ifindex);
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

    /// The endpoint map's value for `ep` in `slot`.
    fn endpoint_info(&self, ep: &EndpointSpec, slot: u32) -> EndpointInfo {
        let mut info = EndpointInfo {
            slot,
            ..EndpointInfo::default()
        };
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
        // An endpoint keeps its slot (and its counters) across an agent restart; a new one
        // gets a zeroed slot before anything points at it.
        let (slot, new) = self.slots.assign(idx)?;
        if new {
            if let Err(e) = self.clear_slot(slot, idx, ep) {
                self.slots.release(idx);
                return Err(e);
            }
        } else if self
            .inherited
            .as_ref()
            .is_some_and(|i| i.for_endpoint(idx, ep).0 != 0)
        {
            // A slot the endpoint kept across the restart, with a stack flow in the table but
            // no mark (a build from before the marks recorded it): marked now. Only ever set
            // (as the programs do), never cleared here.
            self.stack_marks[0]
                .set(slot, STACK_MARKED, 0)
                .map_err(map_err(STACK_EPS_MAP, "mark"))?;
        }
        let info = self.endpoint_info(ep, slot);
        self.write_endpoint(idx, info)?;
        if let Some(mac) = ep.mac {
            let local = LocalEndpoint {
                ifindex: idx,
                slot,
                mac,
                _pad: [0; 2],
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
            self.detach_filters(ifname);
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
        match ifindex(&p.ifname) {
            // The veth is still ours: remove our programs.
            Ok(i) if i == p.ifindex => self.detach_filters(&p.ifname),
            // CNI DEL deleted the veth first: the kernel detached the programs with it; only
            // the tcx links' pins are left.
            Err(_) => self.detach_filters(&p.ifname),
            // A recreated pod's veth has the name now: its programs are not ours to remove.
            Ok(_) => {}
        }
        Ok(())
    }

    fn verify(
        &self,
        ep: &EndpointSpec,
        kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        let idx = endpoint_ifindex(ep)?;
        let mut drift =
            self.attachment_drift(&ep.host_ifname, idx, self.endpoint_prog_ids, kernel)?;
        let slot = self.slots.get(idx);
        let want = slot.map(|s| self.endpoint_info(ep, s));
        // Its bucket holds it, or another live endpoint (then the table alone does).
        let bucket_ok = self
            .direct
            .get(&direct_bucket(idx), 0)
            .is_ok_and(|d| match d.ifindex {
                i if i == idx => Some(d.info) == want,
                0 => false,
                other => self.slots.get(other).is_some(),
            });
        if want.is_none() || self.endpoints.get(&idx, 0).ok() != want || !bucket_ok {
            drift.push(Drift::EndpointEntry);
        }
        if ep.mac.is_some() {
            let points_here = |l: Option<LocalEndpoint>| {
                l.is_some_and(|l| l.ifindex == idx && Some(l.slot) == slot && Some(l.mac) == ep.mac)
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
        self.attachment_drift(ifname, index, self.host_dev_prog_ids, kernel)
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
        // Direct-mapped buckets of interfaces no endpoint owns.
        let mut stale_buckets = 0usize;
        for bucket in 0..MAX_ENDPOINTS {
            let held = self.direct.get(&bucket, 0).map_or(0, |d| d.ifindex);
            if held != 0 && !known_idx.contains(&held) {
                let _ = self.direct.set(bucket, DirectEndpoint::default(), 0);
                stale_buckets += 1;
            }
        }
        // An endpoint a stale one kept out of its bucket moves in.
        for idx in known_idx.iter().copied() {
            let bucket = direct_bucket(idx);
            if self.direct.get(&bucket, 0).is_ok_and(|d| d.ifindex == 0) {
                if let Ok(info) = self.endpoints.get(&idx, 0) {
                    let d = DirectEndpoint {
                        ifindex: idx,
                        _pad: 0,
                        info,
                    };
                    let _ = self.direct.set(bucket, d, 0);
                }
            }
        }
        // Slots of interfaces no endpoint owns go back (zeroed when handed out again).
        let stale_slots: Vec<u32> = self
            .slots
            .iter()
            .map(|(i, _)| i)
            .filter(|i| !known_idx.contains(i))
            .collect();
        for i in &stale_slots {
            self.slots.release(*i);
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
                    self.detach_filters(&name);
                    swept += 1;
                }
            }
        }
        // Every known interface runs this build's programs now: what the old ones added to
        // the maps carried over since the start is copied, then the old maps go.
        if let Some(c) = self.carried.take() {
            let late = c.catch_up();
            self.write_old_marks(&late);
        }
        // From now on a new slot starts unmarked: the programs mark what they record.
        self.inherited = None;
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
            stale_entries = stale.len()
                + stale_buckets
                + stale_slots.len()
                + v4.len()
                + v6.len()
                + stale_budget,
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
        self.apply_tables()
    }

    fn set_peer_nodes(&mut self, peers: &PeerNodes) -> Result<(), DataplaneError> {
        if *peers == self.peers {
            return Ok(());
        }
        self.peers = peers.clone();
        self.doors.set(&Doors::of(&self.cfg.doors, peers))?;
        self.apply_doors_table()
    }

    fn node_drift(&self) -> Result<Vec<Drift>, DataplaneError> {
        super::nft::drift_of(&self.tables)
    }

    fn repair_node(&mut self) -> Result<(), DataplaneError> {
        self.apply_tables()
    }

    fn release(&mut self) {
        // Filters stay attached (their links were forgotten at attach), tcx links and maps
        // stay pinned. The tcx mover stops: after this the agent may uninstall calix.
        self.attacher.release();
        self.programmed.clear();
    }
}
