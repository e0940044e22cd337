//! What route distribution starts with: its settings (from the agent's `[routes]`, `uplinks`
//! and pools, parsed and checked at the edge) and where its service listens.
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use calix_core::ipam::pool::VxlanMode;
use calix_core::routes::peers::Topology;
use ipnet::IpNet;

use super::tls::{CertSource, TlsFiles};

/// Route distribution's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutesSettings {
    /// This node's name.
    pub me: String,
    /// Where the Routes service listens.
    pub listen: ListenOn,
    /// The addresses this node advertises (`routes.node_addresses`); empty: the first uplink's.
    pub node_addresses: Vec<IpAddr>,
    /// The node's uplinks (the first one's addresses are the next hops by default).
    pub uplinks: Vec<String>,
    pub topology: Topology,
    /// This agent relays every node's routes (with [`Topology::Reflectors`]).
    pub reflector: bool,
    /// How long a peer's routes stay after its stream drops (graceful restart).
    pub grace: Duration,
    /// Mutual TLS between nodes; `None`: plain text (`routes.plaintext`).
    pub tls: Option<TlsSettings>,
    /// Each configured pool and its `vxlan` mode.
    pub pools: Vec<(IpNet, VxlanMode)>,
    /// Every pool as the rule for blocks needs it.
    pub blocks: Vec<calix_core::ipam::Pool>,
}

/// Where this node's certificate and the CA come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub source: CertSource,
    /// With [`CertSource::Files`].
    pub files: TlsFiles,
}

/// Where the Routes service listens (`routes.listen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenOn {
    /// `:port`: on this node's own addresses (its next hops).
    NodeAddresses { port: u16 },
    /// `address:port`: on that address (unspecified: every address).
    Address(SocketAddr),
}

impl ListenOn {
    /// `:port` or `address:port` (port 1–65535); `None` otherwise.
    pub fn parse(text: &str) -> Option<Self> {
        if let Some(port) = text.strip_prefix(':') {
            return port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .map(|port| ListenOn::NodeAddresses { port });
        }
        text.parse::<SocketAddr>()
            .ok()
            .filter(|a| a.port() != 0)
            .map(ListenOn::Address)
    }

    pub fn port(self) -> u16 {
        match self {
            ListenOn::NodeAddresses { port } => port,
            ListenOn::Address(a) => a.port(),
        }
    }
}

impl std::fmt::Display for ListenOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenOn::NodeAddresses { port } => write!(f, ":{port}"),
            ListenOn::Address(a) => write!(f, "{a}"),
        }
    }
}
