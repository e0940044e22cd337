//! What the BGP speaker starts with (from the agent's `[bgp]`, parsed and checked at the
//! edge, `crate::config::bgp`).
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use calix_bgp::peer::LimitAction;
use ipnet::IpNet;

/// The speaker's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct BgpSettings {
    /// This node's name.
    pub me: String,
    /// This node's AS number.
    pub asn: u32,
    /// The BGP identifier; `None`: this node's IPv4 next hop.
    pub router_id: Option<Ipv4Addr>,
    /// The next hops this node advertises its routes with (`bgp.node_addresses`); empty: the
    /// first global address of each family on the first uplink.
    pub node_addresses: Vec<IpAddr>,
    pub uplinks: Vec<String>,
    /// How long peers keep this node's routes when its sessions drop without a NOTIFICATION
    /// (an agent restart), and how long a restarted agent waits for its peers' End-of-RIB
    /// before it removes the routes they did not announce again.
    pub restart_time: Duration,
    /// The port it listens on for its peers' connections, on its next hops; 0: it only
    /// connects.
    pub listen_port: u16,
    /// Service ranges advertised besides the pods' (`service_*_ips`).
    pub services: Vec<IpNet>,
    /// The pools' CIDRs: what the default import rule takes routes within.
    pub pools: Vec<IpNet>,
    /// Every pool as the rule for blocks needs it (which stored blocks count).
    pub blocks: Vec<calix_core::ipam::Pool>,
    pub peers: Vec<PeerSettings>,
}

/// One configured peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSettings {
    /// Its name (the config's), for logs, metrics and calixctl.
    pub name: String,
    pub address: IpAddr,
    pub port: u16,
    pub asn: u32,
    /// The TCP MD5 password (RFC 2385).
    pub password: Option<Vec<u8>>,
    /// Proposed hold time, seconds (0, or 3 and more); keepalives every third of it.
    pub hold_time: u16,
    /// Offer graceful restart (RFC 4724), and help the peer through its restarts.
    pub graceful_restart: bool,
    /// The most prefixes taken from the peer, and what happens past it.
    pub max_prefixes: usize,
    pub limit_action: LimitAction,
    /// Communities put on every route advertised to the peer.
    pub communities: Vec<u32>,
}

impl PeerSettings {
    /// Whether the session is eBGP (another AS).
    pub fn external(&self, own: u32) -> bool {
        self.asn != own
    }
}

/// How long a failed connection waits before the next try: doubling from 1 s up to 30 s.
pub fn connect_backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.min(5)).min(Duration::from_secs(30))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_ceiling() {
        assert_eq!(connect_backoff(0), Duration::from_secs(1));
        assert_eq!(connect_backoff(1), Duration::from_secs(2));
        assert_eq!(connect_backoff(4), Duration::from_secs(16));
        assert_eq!(connect_backoff(5), Duration::from_secs(30));
        assert_eq!(connect_backoff(u32::MAX), Duration::from_secs(30));
    }
}
