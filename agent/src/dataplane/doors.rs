//! The calix agents' doors, closed to pods (issue 20): no pod reaches an agent's TCP ports
//! (Routes, metrics) on any node's address — its own node's or another's — unless the
//! operator lets pods in (`[doors]`). The drop happens on the pod's own node, where its
//! source is still its own: with `natOutgoing` another node would see this node's address,
//! a known node, and in the eBPF dataplane `from_pod` sends SNATed traffic out past netfilter.
//!
//! - eBPF: `from_pod` drops such packets (`agent_port`), from three maps this module fills:
//!   the ports (`CALIX_AGENT_PORTS`) and the other nodes' addresses (`CALIX_PEERS_V4/V6`);
//!   this node's own are `CALIX_HOST_V4/V6`, which `host_addrs` keeps current.
//! - Both dataplanes: one nftables table, `inet calix_doors`, for what the host stack
//!   delivers or forwards (kernel mode: everything; eBPF mode: what a Service DNAT turned
//!   into a node's address, which `from_pod` never saw as such). Its input chain drops TCP
//!   from `cali*` interfaces to the ports (any local address is the node's own), its forward
//!   chain the same to the other nodes' addresses (a set). Replies of connections the node
//!   itself opened to a pod (`ct direction reply`) pass: a node process whose local port is
//!   one of these gets its answers.
//!
//! The node itself (the kubelet's probes, host-network pods) is never a `cali*` interface and
//! is not affected. [`Doors::of`] is the one place that says what is closed.
use std::collections::BTreeSet;
use std::net::IpAddr;

use aya::maps::{Array, HashMap, MapData};
use aya::Ebpf;
use calix_common::{AgentPorts, AGENT_PORTS_MAP, MAX_AGENT_PORTS, PEERS_V4_MAP, PEERS_V6_MAP};

use super::bpf::{map_err, take};
use super::nft::nft;
use super::DataplaneError;

/// The nftables table (family `inet`) the agent owns in both dataplanes.
pub const TABLE: &str = "calix_doors";

/// What the agent's config closes to pods: its own TCP ports (Routes, metrics, unless the
/// operator let pods in), and whether the other nodes' Routes ports are closed too.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DoorPolicy {
    pub ports: BTreeSet<u16>,
    /// The Routes ports the other nodes' records name are closed as well (unless pods may
    /// reach the Routes port).
    pub peer_routes_ports: bool,
}

/// The other nodes, as route distribution knows them (their records, or Kubernetes' Node
/// objects): every address they have, and the ports their Routes services listen on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerNodes {
    pub addresses: BTreeSet<IpAddr>,
    pub routes_ports: BTreeSet<u16>,
}

/// What pods may not reach: TCP `ports` on this node's own addresses and on `peers`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Doors {
    pub ports: BTreeSet<u16>,
    pub peers: BTreeSet<IpAddr>,
}

impl Doors {
    pub fn of(policy: &DoorPolicy, peers: &PeerNodes) -> Self {
        let mut ports = policy.ports.clone();
        if policy.peer_routes_ports {
            ports.extend(peers.routes_ports.iter().copied().filter(|p| *p != 0));
        }
        Self {
            ports,
            peers: peers.addresses.iter().map(|a| a.to_canonical()).collect(),
        }
    }

    /// The ports as `from_pod` reads them (network byte order, 0 for unused slots), and the
    /// ports that do not fit (more than [`MAX_AGENT_PORTS`]: the nftables table still closes
    /// them to what the stack handles).
    pub fn bpf_ports(&self) -> (AgentPorts, Vec<u16>) {
        let mut out = AgentPorts::default();
        let mut left = Vec::new();
        for (i, p) in self.ports.iter().enumerate() {
            match out.tcp.get_mut(i) {
                Some(slot) => *slot = p.to_be(),
                None => left.push(*p),
            }
        }
        (out, left)
    }
}

/// The `nft -f` script that makes the table what `d` says, in one transaction (created if
/// missing, deleted and recreated); with no port to close, only deleted.
pub fn ruleset(d: &Doors) -> String {
    let mut out = format!("add table inet {TABLE}\ndelete table inet {TABLE}\n");
    if d.ports.is_empty() {
        return out;
    }
    let list = |items: Vec<String>| items.join(", ");
    let ports = list(d.ports.iter().map(u16::to_string).collect());
    let set = |v6: bool| {
        let elems: Vec<String> = d
            .peers
            .iter()
            .filter(|a| a.is_ipv6() == v6)
            .map(IpAddr::to_string)
            .collect();
        let ty = if v6 { "ipv6_addr" } else { "ipv4_addr" };
        let name = if v6 { "peers_v6" } else { "peers_v4" };
        if elems.is_empty() {
            format!("\tset {name} {{\n\t\ttype {ty}\n\t}}\n")
        } else {
            format!(
                "\tset {name} {{\n\t\ttype {ty}\n\t\telements = {{ {} }}\n\t}}\n",
                list(elems)
            )
        }
    };
    // What every chain lets through first: not from a pod, not TCP, not a closed port, the
    // answers to the node's own connections.
    let head = format!(
        "\t\tiifname != \"cali*\" accept\n\
         \t\tmeta l4proto != tcp accept\n\
         \t\ttcp dport != {{ {ports} }} accept\n\
         \t\tct direction reply accept\n"
    );
    out.push_str(&format!(
        "table inet {TABLE} {{\n\
         \tcomment \"calix: pods do not reach the calix agents' ports on the nodes' addresses; calix-agent --uninstall removes it\"\n"
    ));
    out.push_str(&set(false));
    out.push_str(&set(true));
    out.push_str(&format!(
        "\tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         {head}\
         \t\tcounter drop\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         {head}\
         \t\tip daddr @peers_v4 counter drop\n\
         \t\tip6 daddr @peers_v6 counter drop\n\
         \t}}\n\
         }}\n"
    ));
    out
}

/// Installs (or replaces) the table in the agent's network namespace.
pub fn apply(d: &Doors) -> Result<(), DataplaneError> {
    nft(&ruleset(d))
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    nft(&format!(
        "add table inet {TABLE}\ndelete table inet {TABLE}\n"
    ))
}

/// The eBPF maps of the doors: the ports and the other nodes' addresses.
pub struct DoorMaps {
    ports: Array<MapData, AgentPorts>,
    v4: HashMap<MapData, [u8; 4], u32>,
    v6: HashMap<MapData, [u8; 16], u32>,
}

impl DoorMaps {
    /// Takes the maps out of the loaded object.
    pub fn open(bpf: &mut Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            ports: take(bpf, AGENT_PORTS_MAP, Array::try_from)?,
            v4: take(bpf, PEERS_V4_MAP, HashMap::try_from)?,
            v6: take(bpf, PEERS_V6_MAP, HashMap::try_from)?,
        })
    }

    /// The other nodes' addresses the maps hold.
    pub fn peers(&self) -> BTreeSet<IpAddr> {
        let v4 = self.v4.keys().filter_map(Result::ok).map(IpAddr::from);
        let v6 = self.v6.keys().filter_map(Result::ok).map(IpAddr::from);
        v4.chain(v6).collect()
    }

    /// Brings the maps to `d`: the ports, then the addresses, additions before removals (an
    /// address that stays is never missing meanwhile).
    pub fn set(&mut self, d: &Doors) -> Result<(), DataplaneError> {
        let (ports, left) = d.bpf_ports();
        if !left.is_empty() {
            tracing::warn!(ports = ?left, "more than {MAX_AGENT_PORTS} agent ports: from_pod does not close these (the nftables table closes them to what the host stack handles)");
        }
        self.ports
            .set(0, ports, 0)
            .map_err(map_err(AGENT_PORTS_MAP, "write"))?;
        let have = self.peers();
        for ip in d.peers.difference(&have) {
            match ip {
                IpAddr::V4(a) => self.v4.insert(a.octets(), 1, 0),
                IpAddr::V6(a) => self.v6.insert(a.octets(), 1, 0),
            }
            .map_err(map_err(family_map(ip), "insert"))?;
        }
        for ip in have.difference(&d.peers) {
            match ip {
                IpAddr::V4(a) => self.v4.remove(&a.octets()),
                IpAddr::V6(a) => self.v6.remove(&a.octets()),
            }
            .map_err(map_err(family_map(ip), "remove"))?;
        }
        Ok(())
    }
}

fn family_map(ip: &IpAddr) -> &'static str {
    match ip {
        IpAddr::V4(_) => PEERS_V4_MAP,
        IpAddr::V6(_) => PEERS_V6_MAP,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ips(v: &[&str]) -> BTreeSet<IpAddr> {
        v.iter().map(|a| a.parse().expect("ip")).collect()
    }

    #[test]
    fn the_policy_and_the_peers_make_the_doors() {
        let policy = DoorPolicy {
            ports: [5474, 9091].into(),
            peer_routes_ports: true,
        };
        let peers = PeerNodes {
            addresses: ips(&["172.31.1.2", "::ffff:172.31.2.3", "fd31:1::2"]),
            routes_ports: [5474, 6000, 0].into(),
        };
        let d = Doors::of(&policy, &peers);
        assert_eq!(d.ports, [5474, 6000, 9091].into());
        assert_eq!(
            d.peers,
            ips(&["172.31.1.2", "172.31.2.3", "fd31:1::2"]),
            "IPv4-mapped as IPv4"
        );
        // Pods may reach the Routes port: the policy leaves it out, and the peers' too.
        let metrics_only = DoorPolicy {
            ports: [9091].into(),
            peer_routes_ports: false,
        };
        assert_eq!(Doors::of(&metrics_only, &peers).ports, [9091].into());
    }

    #[test]
    fn from_pod_reads_up_to_eight_ports_in_network_order() {
        let d = Doors {
            ports: (1..=10).collect(),
            peers: BTreeSet::new(),
        };
        let (ports, left) = d.bpf_ports();
        assert_eq!(ports.tcp[0], 1u16.to_be());
        assert_eq!(ports.tcp[7], 8u16.to_be());
        assert_eq!(left, [9, 10]);
        let (none, left) = Doors::default().bpf_ports();
        assert_eq!(none, AgentPorts::default());
        assert!(left.is_empty());
    }

    #[test]
    fn the_table_drops_pods_tcp_to_the_ports_of_the_nodes() {
        let d = Doors {
            ports: [5474, 9091].into(),
            peers: ips(&["172.31.1.2", "172.31.2.3", "fd31:1::2"]),
        };
        let r = ruleset(&d);
        assert!(
            r.starts_with("add table inet calix_doors\ndelete table inet calix_doors\n"),
            "{r}"
        );
        assert!(r.contains("comment \"calix: "), "{r}");
        assert!(
            r.contains("type ipv4_addr\n\t\telements = { 172.31.1.2, 172.31.2.3 }"),
            "{r}"
        );
        assert!(
            r.contains("type ipv6_addr\n\t\telements = { fd31:1::2 }"),
            "{r}"
        );
        for chain in ["input", "forward"] {
            let body = r
                .split(&format!("chain {chain} {{"))
                .nth(1)
                .and_then(|b| b.split("\t}").next())
                .unwrap_or_else(|| panic!("chain {chain}: {r}"));
            let lines: Vec<&str> = body.lines().map(str::trim).collect();
            let at = |l: &str| {
                lines
                    .iter()
                    .position(|x| *x == l)
                    .unwrap_or_else(|| panic!("{chain}: {l:?} missing\n{r}"))
            };
            let first = at(&format!(
                "type filter hook {chain} priority filter; policy accept;"
            ));
            let order = [
                at("iifname != \"cali*\" accept"),
                at("meta l4proto != tcp accept"),
                at("tcp dport != { 5474, 9091 } accept"),
                at("ct direction reply accept"),
            ];
            assert!(
                first < order[0] && order.windows(2).all(|w| w[0] < w[1]),
                "{chain}: {r}"
            );
            let drops: Vec<&&str> = lines.iter().filter(|l| l.ends_with("drop")).collect();
            match chain {
                "input" => assert_eq!(drops, [&"counter drop"], "{r}"),
                _ => assert_eq!(
                    drops,
                    [
                        &"ip daddr @peers_v4 counter drop",
                        &"ip6 daddr @peers_v6 counter drop"
                    ],
                    "{r}"
                ),
            }
            assert!(lines.iter().rposition(|l| l.ends_with("drop")) > Some(order[3]));
        }
        // No peer yet: empty sets, still valid.
        let alone = ruleset(&Doors {
            ports: [9091].into(),
            peers: BTreeSet::new(),
        });
        assert!(
            alone.contains("\tset peers_v4 {\n\t\ttype ipv4_addr\n\t}\n"),
            "{alone}"
        );
        // Nothing to close: the table only goes.
        assert_eq!(
            ruleset(&Doors::default()),
            "add table inet calix_doors\ndelete table inet calix_doors\n"
        );
    }
}
