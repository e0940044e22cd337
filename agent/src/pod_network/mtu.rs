//! The MTU a pod's interface gets when its network config sets none (the conflist's `mtu`):
//! the first uplink's MTU, less the VXLAN encapsulation when the pod's traffic to other nodes
//! may be encapsulated — route distribution is on and one of its addresses comes from a pool
//! whose `vxlan` is not `never` (50 bytes for an IPv4 address, which goes through
//! `vxlan.calix` over IPv4; 70 for IPv6, through `vxlan-v6.calix`; the largest for a
//! dual-stack pod). Otherwise the agent has no opinion and the kernel's default stays. Told to
//! the plugin in the allocation's answer, so a pod never sends what the tunnel cannot carry
//! (no "fragmentation needed" round trips, no black holes where ICMP is filtered).
use std::net::IpAddr;

use calix_kernel::vxlan;
use ipnet::IpNet;

/// What decides a pod's MTU (from the config; replaced on SIGHUP).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodMtu {
    /// The uplink the VXLAN devices sit on; `None`: no opinion.
    uplink: Option<String>,
    /// This node's pools whose traffic to other nodes may be encapsulated.
    tunnelled: Vec<IpNet>,
}

impl PodMtu {
    /// `uplink`: the one the VXLAN devices sit on (`None`: no opinion, e.g. a single node,
    /// where nothing is ever encapsulated); `tunnelled`: this node's pools whose traffic to
    /// other nodes may be encapsulated.
    pub fn new(uplink: Option<String>, tunnelled: Vec<IpNet>) -> Self {
        Self { uplink, tunnelled }
    }

    /// The MTU for a pod with `addresses` when the uplink's is `uplink_mtu`; `None` when none
    /// of them may be encapsulated (or the agent has no uplink).
    pub fn compute(&self, addresses: &[IpAddr], uplink_mtu: u32) -> Option<u32> {
        self.uplink.as_ref()?;
        let overhead = addresses
            .iter()
            .filter(|a| self.tunnelled.iter().any(|p| p.contains(*a)))
            .map(|a| vxlan::Underlay::of(*a).overhead())
            .max()?;
        Some(uplink_mtu.saturating_sub(overhead))
    }

    /// The MTU for a pod with `addresses`, the uplink's read now; `None`: no opinion (also
    /// when the uplink cannot be read, which is logged).
    pub fn of(&self, addresses: &[IpAddr]) -> Option<u32> {
        let uplink = self.uplink.as_ref()?;
        match calix_kernel::netlink::link_mtu(uplink) {
            Ok(mtu) => self.compute(addresses, mtu),
            Err(e) => {
                tracing::warn!(%uplink, error = %e, "cannot read the uplink's MTU: pods keep the default");
                None
            }
        }
    }
}
