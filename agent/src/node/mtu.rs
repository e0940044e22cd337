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

use crate::config::{AgentConfig, VxlanMode};

/// What decides a pod's MTU (from the config; replaced on SIGHUP).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodMtu {
    /// The uplink the VXLAN devices sit on; `None`: no opinion.
    uplink: Option<String>,
    /// This node's pools whose traffic to other nodes may be encapsulated.
    tunnelled: Vec<IpNet>,
}

impl PodMtu {
    pub fn from_config(cfg: &AgentConfig) -> Self {
        if !cfg.routes.enabled {
            // A single node: nothing is ever encapsulated.
            return Self::default();
        }
        Self {
            uplink: cfg.uplinks.first().cloned(),
            tunnelled: cfg
                .pools
                .iter()
                .filter(|p| p.selects(&cfg.node_labels) && p.vxlan != VxlanMode::Never)
                .map(|p| p.cidr)
                .collect(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str) -> AgentConfig {
        let cfg: AgentConfig = toml::from_str(toml).expect("config");
        cfg
    }

    const POOLS: &str = r#"
uplinks = ["eth0"]
[routes]
enabled = true
plaintext = true
[[pools]]
cidr = "10.244.0.0/16"
[[pools]]
cidr = "fd00:244::/64"
[[pools]]
cidr = "10.245.0.0/16"
vxlan = "never"
"#;

    #[test]
    fn the_encapsulation_comes_off_where_vxlan_may_carry_the_pod() {
        let m = PodMtu::from_config(&config(POOLS));
        let ip = |s: &str| -> IpAddr { s.parse().expect("ip") };
        assert_eq!(m.compute(&[ip("10.244.0.5")], 1500), Some(1450));
        assert_eq!(m.compute(&[ip("fd00:244::5")], 1500), Some(1430));
        // Dual stack: the larger encapsulation.
        assert_eq!(
            m.compute(&[ip("10.244.0.5"), ip("fd00:244::5")], 9000),
            Some(8930)
        );
        // A pool that never tunnels, an address outside every pool: no opinion.
        assert_eq!(m.compute(&[ip("10.245.0.5")], 1500), None);
        assert_eq!(m.compute(&[ip("192.0.2.1")], 1500), None);
    }

    #[test]
    fn no_opinion_on_a_single_node_or_without_an_uplink() {
        let single = POOLS.replace("enabled = true", "enabled = false");
        let m = PodMtu::from_config(&config(&single));
        assert_eq!(m, PodMtu::default());
        assert_eq!(m.compute(&["10.244.0.5".parse().expect("ip")], 1500), None);
        let no_uplink = POOLS.replace("uplinks = [\"eth0\"]", "");
        let m = PodMtu::from_config(&config(&no_uplink));
        assert_eq!(m.compute(&["10.244.0.5".parse().expect("ip")], 1500), None);
    }
}
