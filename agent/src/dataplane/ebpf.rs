//! The eBPF dataplane: loads the embedded object once, attaches `from_pod` (tc ingress) and
//! `to_pod` (tc egress) to every endpoint's host veth, and keeps a per-CPU counters entry per
//! endpoint. Links are owned here; dropping one detaches it.
use std::collections::HashMap;

use aya::maps::{MapData, PerCpuHashMap, PerCpuValues};
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcAttachType};
use aya::programs::SchedClassifier;
use aya::Ebpf;
use calix_common::{EndpointCounters, COUNTERS_MAP, PROG_FROM_POD, PROG_TO_POD};

use super::{ifindex, Attached, Dataplane, DataplaneError};

/// The object built from ebpf/programs by build.rs, always matching the current sources.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/calix.bpf.o"));

struct EndpointLinks {
    ifindex: u32,
    // Held for their Drop: dropping a link detaches the program.
    _from_pod: SchedClassifierLink,
    _to_pod: SchedClassifierLink,
}

pub struct EbpfDataplane {
    bpf: Ebpf,
    counters: PerCpuHashMap<MapData, u32, EndpointCounters>,
    links: HashMap<String, EndpointLinks>,
}

fn prog_err(
    name: &'static str,
    op: &'static str,
) -> impl FnOnce(aya::programs::ProgramError) -> DataplaneError {
    move |e| DataplaneError::Program {
        name,
        op,
        source: Box::new(e),
    }
}

fn map_err(op: &'static str) -> impl FnOnce(aya::maps::MapError) -> DataplaneError {
    move |e| DataplaneError::Map {
        name: COUNTERS_MAP,
        op,
        source: Box::new(e),
    }
}

impl EbpfDataplane {
    /// Loads the object and both programs into the kernel (through the verifier).
    pub fn load() -> Result<Self, DataplaneError> {
        let mut bpf = Ebpf::load(OBJECT).map_err(|e| DataplaneError::Load(Box::new(e)))?;
        for name in [PROG_FROM_POD, PROG_TO_POD] {
            Self::program(&mut bpf, name)?
                .load()
                .map_err(prog_err(name, "load"))?;
        }
        let map = bpf.take_map(COUNTERS_MAP).ok_or(DataplaneError::Map {
            name: COUNTERS_MAP,
            op: "find",
            source: Box::new(aya::maps::MapError::InvalidName {
                name: COUNTERS_MAP.to_string(),
            }),
        })?;
        let counters = PerCpuHashMap::try_from(map).map_err(map_err("open"))?;
        Ok(Self {
            bpf,
            counters,
            links: HashMap::new(),
        })
    }

    fn program<'a>(
        bpf: &'a mut Ebpf,
        name: &'static str,
    ) -> Result<&'a mut SchedClassifier, DataplaneError> {
        let prog = bpf.program_mut(name).ok_or(DataplaneError::Program {
            name,
            op: "find",
            source: Box::new(aya::programs::ProgramError::NotLoaded),
        })?;
        prog.try_into().map_err(prog_err(name, "cast"))
    }

    fn attach_one(
        &mut self,
        name: &'static str,
        ifname: &str,
        at: TcAttachType,
    ) -> Result<SchedClassifierLink, DataplaneError> {
        let prog = Self::program(&mut self.bpf, name)?;
        // Classic tc (clsact + cls_bpf, direct action) rather than TCX: a TCX attach waits for
        // an RCU grace period (~15 ms here) per program, which would dominate CNI ADD.
        let id = prog
            .attach_with_options(ifname, at, TcAttachOptions::Netlink(NlOptions::default()))
            .map_err(prog_err(name, "attach"))?;
        prog.take_link(id).map_err(prog_err(name, "take link"))
    }
}

impl Dataplane for EbpfDataplane {
    fn attach(&mut self, ifname: &str) -> Result<Attached, DataplaneError> {
        let idx = ifindex(ifname)?;
        if let Some(l) = self.links.get(ifname) {
            if l.ifindex == idx {
                return Ok(Attached {
                    ifindex: idx,
                    bpf: true,
                });
            }
            // Same name, new interface: the old links are dead; replace them.
            self.detach(ifname)?;
        }
        // The entry must exist before traffic flows: the programs only update entries.
        let zero = PerCpuValues::try_from(vec![
            EndpointCounters::default();
            aya::util::nr_cpus().map_err(|(_, e)| {
                DataplaneError::Map {
                    name: COUNTERS_MAP,
                    op: "count CPUs",
                    source: Box::new(aya::maps::MapError::IoError(e)),
                }
            })?
        ])
        .map_err(|e| DataplaneError::Map {
            name: COUNTERS_MAP,
            op: "build per-CPU value",
            source: Box::new(aya::maps::MapError::IoError(e)),
        })?;
        self.counters
            .insert(idx, zero, 0)
            .map_err(map_err("insert"))?;
        match aya::programs::tc::qdisc_add_clsact(ifname) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => {
                let _ = self.counters.remove(&idx);
                return Err(DataplaneError::Program {
                    name: PROG_FROM_POD,
                    op: "add clsact qdisc",
                    source: Box::new(aya::programs::ProgramError::IOError(e)),
                });
            }
        }
        let from_pod = self.attach_one(PROG_FROM_POD, ifname, TcAttachType::Ingress);
        let to_pod = self.attach_one(PROG_TO_POD, ifname, TcAttachType::Egress);
        match (from_pod, to_pod) {
            (Ok(f), Ok(t)) => {
                self.links.insert(
                    ifname.to_string(),
                    EndpointLinks {
                        ifindex: idx,
                        _from_pod: f,
                        _to_pod: t,
                    },
                );
                Ok(Attached {
                    ifindex: idx,
                    bpf: true,
                })
            }
            (Err(e), _) | (_, Err(e)) => {
                // Whatever did attach is dropped (detached) here; remove the entry too.
                let _ = self.counters.remove(&idx);
                Err(e)
            }
        }
    }

    fn detach(&mut self, ifname: &str) -> Result<(), DataplaneError> {
        if let Some(links) = self.links.remove(ifname) {
            match self.counters.remove(&links.ifindex) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(map_err("remove")(e)),
            }
            if ifindex(ifname).ok() == Some(links.ifindex) {
                // The veth is still there: remove our filters (dropping a link detaches it).
                drop(links);
            } else {
                // The veth is gone (CNI DEL deletes it first), and the kernel removed its
                // filters with it. Dropping the links would send two filter deletes for a dead
                // ifindex under the RTNL lock; they hold no fd, so just forget them.
                std::mem::forget(links);
            }
        }
        Ok(())
    }

    fn counters(&self, ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError> {
        match self.counters.get(&ifindex, 0) {
            Ok(per_cpu) => {
                let mut sum = EndpointCounters::default();
                per_cpu.iter().for_each(|c| sum.accumulate(c));
                Ok(Some(sum))
            }
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err("lookup")(e)),
        }
    }

    fn detach_all(&mut self) {
        let names: Vec<String> = self.links.keys().cloned().collect();
        for n in names {
            if let Err(e) = self.detach(&n) {
                tracing::warn!(ifname = %n, error = %e, "detach failed at shutdown");
            }
        }
    }
}
