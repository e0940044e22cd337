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
//!   connection openings (a SYN without an ACK) from `cali*` interfaces to the ports (any
//!   local address is the node's own), its forward chain the same to the other nodes'
//!   addresses (a set). No connection can be opened, and every other segment passes: the
//!   answers to connections the node itself opened to a pod among them. The match is
//!   stateless on purpose: a `ct` match would switch on netfilter's connection tracking in
//!   the node's namespace, for every packet the host stack sees (in eBPF mode the VXLAN
//!   traffic: −19 % throughput, +8 % round-trip time, `bench crossnode` of 2026-12-02).
//!
//! The node itself (the kubelet's probes, host-network pods) is never a `cali*` interface and
//! is not affected. [`Doors::of`] is the one place that says what is closed.
use std::collections::BTreeSet;
use std::net::IpAddr;

use aya::maps::{Array, HashMap, MapData};
use aya::Ebpf;
use calix_common::{AgentPorts, AGENT_PORTS_MAP, MAX_AGENT_PORTS, PEERS_V4_MAP, PEERS_V6_MAP};

use super::bpf::{map_err, take};
use calix_kernel::nft::rule::IPPROTO_TCP;
use calix_kernel::nft::{Addr, Chain, CmpOp, Element, Family, Hook, KeyType, Rule, Set, Table};

use super::DataplaneError;

/// The nftables table the agent owns in both dataplanes.
pub const TABLE: &str = "calix_doors";
pub const FAMILY: Family = Family::Inet;

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

/// The table `d` asks for, written in one transaction (created if missing, else deleted and
/// recreated); `None` with no port to close (the table is only deleted then).
pub fn table(d: &Doors) -> Option<Table> {
    if d.ports.is_empty() {
        return None;
    }
    let ports: Vec<u16> = d.ports.iter().copied().collect();
    let set = |v6: bool| {
        let (name, key) = if v6 {
            ("peers_v6", KeyType::IPV6_ADDR)
        } else {
            ("peers_v4", KeyType::IPV4_ADDR)
        };
        let mut set = Set::new(name, key);
        set.elements = d
            .peers
            .iter()
            .filter_map(|a| match a {
                IpAddr::V4(a) if !v6 => Some(Element::key(a.octets())),
                IpAddr::V6(a) if v6 => Some(Element::key(a.octets())),
                _ => None,
            })
            .collect();
        set
    };
    let rule = || Rule::builder(FAMILY);
    // What every chain lets through first: not from a pod, not TCP, not a closed port, not a
    // connection's opening (what else a pod sends there belongs to no connection of its own,
    // or answers one the node opened).
    let chain = |name: &str, hook: Hook| {
        Chain::filter(name, hook)
            // iifname != "cali*" accept
            .with_rule(rule().iifname(CmpOp::Neq, "cali*").accept())
            // meta l4proto != tcp accept
            .with_rule(rule().l4proto(CmpOp::Neq, IPPROTO_TCP).accept())
            // tcp dport != { ports } accept
            .with_rule(rule().dport_in(IPPROTO_TCP, &ports, true).accept())
            // tcp flags & (syn | ack) != syn accept
            .with_rule(rule().tcp_syn(CmpOp::Neq).accept())
    };
    let peers = |v6: bool, set: &str| {
        // ip daddr @peers_v4 counter drop (ip6 daddr @peers_v6 ...)
        rule()
            .addr_in_set(v6, Addr::Destination, set, false)
            .counter()
            .drop()
    };
    Some(
        Table::new(FAMILY, TABLE)
            .with_comment("calix: pods do not reach the calix agents' ports on the nodes' addresses; calix-agent --uninstall removes it")
            .with_set(set(false))
            .with_set(set(true))
            // ... counter drop
            .with_chain(chain("input", Hook::Input).with_rule(rule().counter().drop()))
            .with_chain(
                chain("forward", Hook::Forward)
                    .with_rule(peers(false, "peers_v4"))
                    .with_rule(peers(true, "peers_v6")),
            ),
    )
}

/// Installs (or replaces) the table in the agent's network namespace.
pub fn apply(d: &Doors) -> Result<(), DataplaneError> {
    match table(d) {
        Some(t) => super::nft::apply(&t),
        None => remove(),
    }
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    super::nft::remove(FAMILY, TABLE)
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
    use calix_kernel::nft::{ChainType, Verdict};

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

    fn lines(r: &Rule) -> Vec<String> {
        r.exprs.iter().map(ToString::to_string).collect()
    }

    /// The rules are what `nft` compiled the old script's lines to (`nft --debug=netlink`).
    #[test]
    fn the_table_drops_pods_tcp_to_the_ports_of_the_nodes() {
        let d = Doors {
            ports: [5474, 9091].into(),
            peers: ips(&["172.31.1.2", "172.31.2.3", "fd31:1::2"]),
        };
        let t = table(&d).expect("a table");
        assert_eq!(t.id(), "inet calix_doors");
        assert!(t
            .comment
            .as_deref()
            .is_some_and(|c| c.starts_with("calix: ")));
        let keys = |name: &str| -> Vec<IpAddr> {
            let s = t.set(name).unwrap_or_else(|| panic!("set {name}"));
            assert!(!s.interval && !s.constant && s.map.is_none(), "{s:?}");
            s.elements
                .iter()
                .map(|e| match e.key.len() {
                    4 => IpAddr::from(<[u8; 4]>::try_from(e.key.as_slice()).expect("v4")),
                    _ => IpAddr::from(<[u8; 16]>::try_from(e.key.as_slice()).expect("v6")),
                })
                .collect()
        };
        assert_eq!(
            keys("peers_v4"),
            Vec::from_iter(ips(&["172.31.1.2", "172.31.2.3"]))
        );
        assert_eq!(keys("peers_v6"), Vec::from_iter(ips(&["fd31:1::2"])));
        assert_eq!(t.set("peers_v4").map(|s| s.key), Some(KeyType::IPV4_ADDR));
        assert_eq!(t.set("peers_v6").map(|s| s.key), Some(KeyType::IPV6_ADDR));
        let head: [Vec<&str>; 4] = [
            // iifname != "cali*" accept
            vec![
                "[ meta load iifname => reg 1 ]",
                "[ cmp neq reg 1 0x696c6163 ]",
                "[ immediate reg 0 accept ]",
            ],
            // meta l4proto != tcp accept
            vec![
                "[ meta load l4proto => reg 1 ]",
                "[ cmp neq reg 1 0x00000006 ]",
                "[ immediate reg 0 accept ]",
            ],
            // tcp dport != { 5474, 9091 } accept
            vec![
                "[ meta load l4proto => reg 1 ]",
                "[ cmp eq reg 1 0x00000006 ]",
                "[ payload load 2b @ transport header + 2 => reg 1 ]",
                "[ lookup reg 1 set __set%d 0x1 ]",
                "[ immediate reg 0 accept ]",
            ],
            // tcp flags & (syn | ack) != syn accept
            vec![
                "[ meta load l4proto => reg 1 ]",
                "[ cmp eq reg 1 0x00000006 ]",
                "[ payload load 1b @ transport header + 13 => reg 1 ]",
                "[ bitwise reg 1 = ( reg 1 & 0x00000012 ) ^ 0x00000000 ]",
                "[ cmp neq reg 1 0x00000002 ]",
                "[ immediate reg 0 accept ]",
            ],
        ];
        for (chain, hook, tail) in [
            (
                "input",
                Hook::Input,
                vec![vec![
                    "[ counter pkts 0 bytes 0 ]",
                    "[ immediate reg 0 drop ]",
                ]],
            ),
            (
                "forward",
                Hook::Forward,
                vec![
                    vec![
                        "[ meta load nfproto => reg 1 ]",
                        "[ cmp eq reg 1 0x00000002 ]",
                        "[ payload load 4b @ network header + 16 => reg 1 ]",
                        "[ lookup reg 1 set peers_v4 ]",
                        "[ counter pkts 0 bytes 0 ]",
                        "[ immediate reg 0 drop ]",
                    ],
                    vec![
                        "[ meta load nfproto => reg 1 ]",
                        "[ cmp eq reg 1 0x0000000a ]",
                        "[ payload load 16b @ network header + 24 => reg 1 ]",
                        "[ lookup reg 1 set peers_v6 ]",
                        "[ counter pkts 0 bytes 0 ]",
                        "[ immediate reg 0 drop ]",
                    ],
                ],
            ),
        ] {
            let c = t.chain(chain).unwrap_or_else(|| panic!("chain {chain}"));
            let base = c.base.as_ref().expect("a base chain");
            assert_eq!(
                (&base.kind, base.hook, base.priority, &base.policy),
                (&ChainType::Filter, hook, 0, &Verdict::Accept),
                "type filter hook {chain} priority filter; policy accept;"
            );
            let want: Vec<Vec<&str>> = head.iter().cloned().chain(tail).collect();
            let got: Vec<Vec<String>> = c.rules.iter().map(lines).collect();
            assert_eq!(got, want, "chain {chain}");
        }
        // The ports' set: 5474 and 9091, in network order.
        let Some(calix_kernel::nft::Expr::Lookup {
            set: calix_kernel::nft::SetRef::Anonymous(ports),
            ..
        }) = t.chains[0].rules[2].exprs.get(3)
        else {
            panic!("the ports' set")
        };
        assert_eq!(
            ports.elements,
            [
                Element::key(5474u16.to_be_bytes()),
                Element::key(9091u16.to_be_bytes())
            ]
        );
        // No peer yet: empty sets, still valid.
        let alone = table(&Doors {
            ports: [9091].into(),
            peers: BTreeSet::new(),
        })
        .expect("a table");
        assert!(alone.sets.iter().all(|s| s.elements.is_empty()));
        alone.validate().expect("valid");
        // Nothing to close: the table only goes.
        assert_eq!(table(&Doors::default()), None);
    }
}
