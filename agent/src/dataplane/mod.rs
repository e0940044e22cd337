//! The dataplane behind one narrow trait: attach an endpoint's programs, detach them, read its
//! counters. `ebpf` loads the tc programs; `kernel` leaves forwarding to the kernel's routes.
pub mod ebpf;

use calix_common::EndpointCounters;

pub use ebpf::EbpfDataplane;

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("interface {ifname} does not exist on this node")]
    NoInterface { ifname: String },
    #[error("loading the eBPF object failed")]
    Load(#[source] Box<aya::EbpfError>),
    #[error("eBPF program {name}: {op} failed")]
    Program {
        name: &'static str,
        op: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("eBPF map {name}: {op} failed")]
    Map {
        name: &'static str,
        op: &'static str,
        #[source]
        source: Box<aya::maps::MapError>,
    },
}

/// What attaching an endpoint produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    pub ifindex: u32,
    pub bpf: bool,
}

pub trait Dataplane: Send {
    /// Programs the endpoint whose host-side veth is `ifname`. Idempotent.
    fn attach(&mut self, ifname: &str) -> Result<Attached, DataplaneError>;
    /// Removes what `attach` did for `ifname` (the veth may already be gone). Idempotent.
    fn detach(&mut self, ifname: &str) -> Result<(), DataplaneError>;
    /// The endpoint's counters, summed over CPUs; `None` when there is no entry.
    fn counters(&self, ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError>;
    /// Detaches everything (shutdown).
    fn detach_all(&mut self);
}

/// Resolves an interface name in the agent's network namespace.
pub fn ifindex(ifname: &str) -> Result<u32, DataplaneError> {
    nix::net::if_::if_nametoindex(ifname).map_err(|_| DataplaneError::NoInterface {
        ifname: ifname.to_string(),
    })
}

/// Kernel mode: no BPF; routes and proxy_arp (set by the CNI plugin) do the forwarding.
#[derive(Default)]
pub struct KernelDataplane;

impl Dataplane for KernelDataplane {
    fn attach(&mut self, ifname: &str) -> Result<Attached, DataplaneError> {
        Ok(Attached {
            ifindex: ifindex(ifname)?,
            bpf: false,
        })
    }
    fn detach(&mut self, _ifname: &str) -> Result<(), DataplaneError> {
        Ok(())
    }
    fn counters(&self, _ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError> {
        Ok(None)
    }
    fn detach_all(&mut self) {}
}
