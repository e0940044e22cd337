//! The eBPF dataplane. Maps live pinned under `<pin root>/<node>/v<layout>/` and the programs
//! under `.../progs/`, and the tc attachments (pinned tcx links, or cls_bpf filters: `tcx.rs`)
//! stay when the agent exits: an agent restart (or a crash) never interrupts traffic. A new
//! agent reuses the pinned maps and replaces each attachment's program in place (one atomic
//! update), so an upgrade with a changed program never leaves an interface without one. A changed map layout
//! gets a new version directory; the old one is removed once every interface runs the new
//! programs ([`Dataplane::reconcile`]). With `[xdp]` enabled, the uplinks also run the XDP
//! prefilter (`xdp.rs`: pinned links, replaced in place the same way).
//!
//! The endpoints' map entries (slots, endpoint table and its direct-mapped copy, local
//! delivery) are kept by `endpoints.rs`, through the map seam of `maps.rs`: unit-tested on
//! in-memory maps (`tests.rs`). The counters' readers are in `stats.rs`.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use aya::programs::tc::TcAttachType;
use aya::programs::{Program, ProgramError, SchedClassifier};
use aya::{Ebpf, EbpfLoader};
use calix_common::{
    FlowKey, StackFlow, ALL_PROGRAMS, COUNTERS_MAP, CT_FREED_MAP, CT_MAP, CT_OWNED_MAP,
    ENDPOINTS_DIRECT_MAP, ENDPOINTS_MAP, LAYOUT_VERSION, LOCAL_V4_MAP, LOCAL_V6_MAP, POOLS_V4_MAP,
    POOLS_V6_MAP, PROG_FROM_HOST_DEV, PROG_FROM_POD, PROG_TO_HOST_DEV, PROG_TO_POD,
    STACK_CLEARED_MAP, STACK_EPS_MAP, STACK_FLOWS_MAP, STACK_OVERFLOW_MAP,
};
use ipnet::IpNet;

use super::bpf::{map_err, pin_err, prog_err, take};
use super::doors::{DoorMaps, DoorPolicy, Doors, PeerNodes};
use super::host_addrs::HostAddrs;
use super::nat::{NatMaps, NatSettings};
use super::pins;
use super::tcx::{self, Attacher, Attachment, TcAttach};
use super::xdp::{self, XdpFilter, XdpSettings};
use super::{
    endpoint_ifindex, ifindex, Attached, Dataplane, DataplaneError, DataplaneStats, Drift,
    EndpointSpec,
};
use calix_core::policy::tables::Tables;
use calix_kernel::host::HostKernel;

mod drift;
mod endpoints;
mod events;
mod host_tables;
mod maps;
pub mod policy;
#[cfg(test)]
mod policy_tests;
mod service_keys;
pub mod services;
mod stats;
#[cfg(test)]
mod tests;
mod trace;
mod udp_ends;

use endpoints::{Endpoints, Inherited};
pub use events::PolicyEvents;
use maps::{pinned, EndpointMaps, PinnedSlotArrays};
pub use policy::PolicySettings;
pub use stats::EbpfStats;

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
    /// The NetworkPolicy maps' sizes, and whether established flows outlive a change.
    pub policy: PolicySettings,
    /// Services at the sockets: the cgroup (v2) the programs attach to; `None`: detached.
    pub services_cgroup: Option<PathBuf>,
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

pub struct EbpfDataplane {
    cfg: EbpfConfig,
    bpf: Ebpf,
    /// The endpoints' map entries (slots, endpoint table and its direct-mapped copy,
    /// local delivery, counters and marks by slot) and what this process programmed.
    endpoints: Endpoints,
    pools_v4: LpmTrie<MapData, [u8; 4], u32>,
    pools_v6: LpmTrie<MapData, [u8; 16], u32>,
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
    /// The host devices attached since the start (VXLAN devices): their `to_host_dev` judges
    /// Service traffic after the DNAT ([`super::pending`]).
    host_devs: BTreeSet<String>,
    /// The doors' maps, and the other nodes as last told ([`Dataplane::set_peer_nodes`]).
    doors: DoorMaps,
    peers: PeerNodes,
    /// NetworkPolicy's maps, as the pins held them until the agent says otherwise.
    policy: policy::PolicyProgrammer,
    /// Services at the sockets (`None`: detached).
    services: Option<services::ServiceProgrammer>,
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
        Program::CgroupSockAddr(p) => p.load(),
        _ => Err(ProgramError::UnexpectedProgramType),
    }
    .map_err(prog_err(name, "load"))
}

/// Attaches `ingress` and `egress` of `bpf` on `ifname` ([`Attacher::attach`]: replacing what
/// runs there now, atomically).
fn attach_pair(
    bpf: &mut Ebpf,
    attacher: &Attacher,
    cfg: &EbpfConfig,
    ifname: &str,
    ingress: &'static str,
    egress: &'static str,
) -> Result<(), DataplaneError> {
    let progs = cfg.pin_dir().join("progs");
    for (name, at) in [
        (ingress, TcAttachType::Ingress),
        (egress, TcAttachType::Egress),
    ] {
        let prog = program(bpf, name)?;
        attacher.attach(prog, name, &progs.join(name), ifname, at)?;
    }
    Ok(())
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
        // The configured conntrack and policy sizes are always the sizes in effect: a pinned
        // map of another size is migrated into a new one.
        let ct_entries = cfg.nat.as_ref().map(|n| n.conntrack_entries);
        let mut sizes: Vec<(&str, u32)> = ct_entries.map(|n| (CT_MAP, n)).into_iter().collect();
        sizes.push((calix_common::POLICY_MAP, cfg.policy.entries));
        sizes.push((calix_common::POLICY_FLOWS_MAP, cfg.policy.flows));
        sizes.push((calix_common::POLICY_FLOWS_V4_MAP, cfg.policy.flows));
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
        let verifying = std::time::Instant::now();
        for name in ALL_PROGRAMS {
            let t = std::time::Instant::now();
            load_program(&mut bpf, name)?;
            let prog = find(&mut bpf, name)?;
            let insns = prog
                .info()
                .ok()
                .and_then(|i| i.verified_instruction_count());
            tracing::debug!(program = name, ms = t.elapsed().as_secs_f64() * 1e3,
                verified_insns = ?insns, "eBPF program loaded (verified by the kernel)");
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
        tracing::info!(
            programs = ALL_PROGRAMS.len(),
            ms = verifying.elapsed().as_secs_f64() * 1e3,
            "eBPF programs loaded and verified"
        );
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
        let maps = EndpointMaps {
            endpoints: pinned(&mut bpf, ENDPOINTS_MAP, HashMap::try_from)?,
            direct: pinned(&mut bpf, ENDPOINTS_DIRECT_MAP, Array::try_from)?,
            local_v4: pinned(&mut bpf, LOCAL_V4_MAP, HashMap::try_from)?,
            local_v6: pinned(&mut bpf, LOCAL_V6_MAP, HashMap::try_from)?,
            per_endpoint: vec![
                pinned(&mut bpf, CT_OWNED_MAP, HashMap::try_from)?,
                pinned(&mut bpf, CT_FREED_MAP, HashMap::try_from)?,
            ],
            slots: Box::new(PinnedSlotArrays {
                counters: take(&mut bpf, COUNTERS_MAP, PerCpuArray::try_from)?,
                marks: [
                    take(&mut bpf, STACK_EPS_MAP, Array::try_from)?,
                    take(&mut bpf, STACK_OVERFLOW_MAP, Array::try_from)?,
                    take(&mut bpf, STACK_CLEARED_MAP, Array::try_from)?,
                ],
            }),
        };
        let flows: HashMap<MapData, FlowKey, StackFlow> =
            take(&mut bpf, STACK_FLOWS_MAP, HashMap::try_from)?;
        let inherited = Inherited {
            marks: carried.old_marks(),
            flow_addrs: flows.keys().filter_map(Result::ok).map(|k| k.pod).collect(),
        };
        // The slots as the pinned endpoint map has them; entries with a bad slot go.
        let endpoints = Endpoints::restore(maps, Some(inherited), cfg.nat.clone());
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
        let mut policy =
            policy::PolicyProgrammer::restore(Box::new(policy::PinnedPolicyMaps::open(&mut bpf)?));
        policy.set_keep_established(cfg.policy.keep_established)?;
        if let Some(n) = &cfg.nat {
            policy.set_services(&n.services(), &[])?;
        }
        let sockets = services::links_dir(&cfg.node_dir());
        let services = match &cfg.services_cgroup {
            Some(cg) => {
                services::attach_sockets(&mut bpf, &sockets, cg)?;
                tracing::info!(cgroup = %cg.display(), "Services translated at the sockets");
                Some(services::ServiceProgrammer::restore(Box::new(
                    services::PinnedServiceMaps::open(&mut bpf)?,
                )))
            }
            None => {
                services::detach_sockets(&sockets);
                None
            }
        };
        let mut dp = Self {
            policy,
            services,
            doors,
            endpoints,
            pools_v4: take(&mut bpf, POOLS_V4_MAP, LpmTrie::try_from)?,
            pools_v6: take(&mut bpf, POOLS_V6_MAP, LpmTrie::try_from)?,
            bpf,
            cfg,
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
            host_devs: BTreeSet::new(),
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
        attach_pair(
            &mut self.bpf,
            &self.attacher,
            &self.cfg,
            ifname,
            ingress,
            egress,
        )
    }

    /// Removes calix's programs from `ifname` (either direction and kind; missing is fine).
    pub fn detach_filters(&self, ifname: &str) {
        self.attacher.detach(ifname);
    }
}

impl Dataplane for EbpfDataplane {
    fn attach(&mut self, ep: &EndpointSpec) -> Result<Attached, DataplaneError> {
        let ifname = ep.host_ifname.as_str();
        let idx = endpoint_ifindex(ep)?;
        let (bpf, attacher, cfg) = (&mut self.bpf, &self.attacher, &self.cfg);
        let attached = self.endpoints.attach(ep, idx, || {
            attach_pair(bpf, attacher, cfg, ifname, PROG_FROM_POD, PROG_TO_POD)
        });
        // Its pod's policy before the pod runs: a failure fails the ADD (never unpoliced).
        if let Err(e) = attached.and_then(|()| self.policy.attached(&self.endpoints.pod_slots())) {
            self.detach_filters(ifname);
            return Err(e);
        }
        Ok(Attached {
            ifindex: idx,
            bpf: true,
        })
    }

    fn detach(&mut self, key: &str) -> Result<(), DataplaneError> {
        let slot = self.endpoints.slot_of(key);
        let Some(p) = self.endpoints.detach(key) else {
            return Ok(());
        };
        // Its policy entries go with its slot.
        if let Some(slot) = slot {
            self.policy.detached(slot);
        }
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
        drift.extend(self.endpoints.drift(ep, idx));
        Ok(drift)
    }

    fn attach_host_dev(&mut self, ifname: &str) -> Result<(), DataplaneError> {
        self.attach_pair(ifname, PROG_FROM_HOST_DEV, PROG_TO_HOST_DEV)?;
        tracing::info!(%ifname, "host device programs attached");
        if self.host_devs.insert(ifname.to_string()) {
            self.apply_pending_table()?;
        }
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

    fn policy_events(&self) -> Result<Option<crate::PolicyDrops>, DataplaneError> {
        PolicyEvents::open(&self.cfg.pin_dir()).map(|e| Some(crate::PolicyDrops::Ebpf(e)))
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
        // Map entries, buckets, slots and local entries of interfaces no endpoint owns (a DEL
        // while the agent was away).
        let stale_entries = self.endpoints.sweep();
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
            self.endpoints.write_old_marks(&late);
        }
        // From now on a new slot starts unmarked: the programs mark what they record.
        self.endpoints.end_initial_sync();
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
            stale_entries,
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
        self.policy
            .set_services(&r.nat.services(), &self.endpoints.pod_slots())?;
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

    fn set_services(
        &mut self,
        t: &services::Translation,
        clients: &[std::path::PathBuf],
    ) -> Result<(), DataplaneError> {
        let Some(p) = &mut self.services else {
            return Ok(());
        };
        p.set_nodes(&t.nodes)?;
        let left = match t.whole {
            true => p.set(&t.frontends)?,
            false => p.update(&t.frontends, &t.gone)?,
        };
        let flows = p.end_flows(&left);
        if flows > 0 {
            tracing::info!(
                flows,
                "UDP backends left their Services: flows from outside sent there forgotten"
            );
        }
        if !left.is_empty() {
            let started = std::time::Instant::now();
            let ended = udp_ends::end(&left, clients, p.maps());
            tracing::info!(
                backends = left.len(),
                ended,
                namespaces = clients.len() + 1,
                took = ?started.elapsed(),
                "UDP backends left their Services: connected sockets sent there ended"
            );
        }
        Ok(())
    }

    fn set_policy(&mut self, tables: Tables) -> Result<(), DataplaneError> {
        self.policy.set(tables, &self.endpoints.pod_slots())
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
        self.endpoints.release();
    }
}
