//! Several nodes on one underlay, as a cluster's machines are: each node's uplink `eth0` is
//! a veth into the underlay namespace, where it is a port of the bridge of its subnet. Two
//! subnets — 172.31.1.0/24 (`bra`) and 172.31.2.0/24 (`brb`), with fd31:1::/64 and fd31:2::/64
//! — and the underlay namespace routes between them (`.254` / `::fe` on each bridge, every
//! node's default gateway), so a node on subnet 2 is "across a router" from those on subnet 1
//! (VXLAN's `crossSubnet`). etcd runs in the underlay namespace, on 2379 at each bridge's
//! `.254`. Node `i` on subnet `s` is 172.31.`s`.`i+1` and fd31:`s`::`i+1`.
//!
//! Dropped in order: the agents stop first, then the node namespaces, then etcd and the
//! underlay.
use crate::agent::{AgentSpec, Dataplane};
use crate::etcd::EtcdNs;
use crate::netns::{veth, Netns};
use crate::node::Node;
use crate::{unique, Result};

/// The underlay's subnets: the first is 1, the second 2.
pub const SUBNETS: [u8; 2] = [1, 2];

/// A cluster on one machine.
pub struct Cluster {
    // Declared first: the nodes (and their agents) go before etcd and the underlay.
    pub nodes: Vec<Node>,
    /// etcd, in the underlay namespace ([`Cluster::underlay`]).
    pub etcd: EtcdNs,
    /// The subnet each node sits on (1 or 2).
    pub subnets: Vec<u8>,
}

impl Cluster {
    /// A cluster whose node `i` sits on subnet `subnets[i]` (1 or 2) and runs `dataplane`;
    /// every agent configured by `config(i, &cluster)` (TOML: start from
    /// [`Cluster::base_config`]), not yet started. Panics on failure.
    pub fn create(
        dataplane: Dataplane,
        subnets: &[u8],
        config: impl Fn(usize, &Cluster) -> String,
    ) -> Self {
        crate::require_root();
        Self::launch_with(
            || unique("u"),
            |i| unique(&format!("n{i}")),
            AgentSpec::new(crate::bin_dir(), dataplane),
            subnets,
            config,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Cluster::create`], named by `underlay_name` and `node_name(i)` (benches), every
    /// agent as `spec` says (its binaries, dataplane; the config is replaced), errors returned.
    pub fn launch_with(
        underlay_name: impl FnOnce() -> String,
        node_name: impl Fn(usize) -> String,
        spec: AgentSpec,
        subnets: &[u8],
        config: impl Fn(usize, &Cluster) -> String,
    ) -> Result<Self> {
        let underlay = Netns::create(underlay_name())?;
        for s in SUBNETS {
            let br = bridge(s);
            underlay.ip(&format!("link add {br} type bridge mcast_snooping 0"))?;
            // No DAD on its link-local address, as on the testbed's veths ([`crate::netns::veth`]).
            underlay.sysctl(&format!("net.ipv6.conf.{br}.accept_dad=0"))?;
            underlay.ip(&format!("addr add {} dev {br}", gateway_cidr(s, false)))?;
            underlay.ip(&format!(
                "addr add {} dev {br} nodad",
                gateway_cidr(s, true)
            ))?;
            underlay.ip(&format!("link set {br} up"))?;
        }
        underlay.sysctl("net.ipv4.ip_forward=1")?;
        underlay.sysctl("net.ipv6.conf.all.forwarding=1")?;
        let etcd = EtcdNs::launch(underlay)?;
        let mut cluster = Self {
            nodes: Vec::new(),
            etcd,
            subnets: subnets.to_vec(),
        };
        for (i, &s) in subnets.iter().enumerate() {
            let ns = Netns::create(node_name(i))?;
            let port = format!("u{i}");
            veth(&ns, "eth0", &cluster.etcd.ns, &port)?;
            cluster
                .etcd
                .ns
                .ip(&format!("link set {port} master {} up", bridge(s)))?;
            ns.ip(&format!("addr add {}/24 dev eth0", node_address(i, s)))?;
            ns.ip(&format!(
                "addr add {}/64 dev eth0 nodad",
                node_address6(i, s)
            ))?;
            ns.ip("link set eth0 up")?;
            ns.ip("link set lo up")?;
            ns.ip(&format!("route add default via {}", gateway(s, false)))?;
            ns.ip(&format!("-6 route add default via {}", gateway(s, true)))?;
            let node = Node::in_ns(ns, spec.clone(), &node_address(i, s))?;
            cluster.nodes.push(node);
        }
        // Until each node reaches its gateway both ways (IPv6 addresses and neighbours of
        // freshly created links take a moment), so the cluster is whole when it is returned.
        for (i, n) in cluster.nodes.iter().enumerate() {
            for v6 in [false, true] {
                let gw = gateway(cluster.subnets[i], v6);
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !n.ns.ping(&gw, 1) {
                    if std::time::Instant::now() > deadline {
                        return Err(crate::Error::Unexpected {
                            what: format!("node {i}'s underlay"),
                            found: format!("no answer from its gateway {gw} within 10 s"),
                            expected: "ping replies".into(),
                        });
                    }
                }
            }
        }
        for i in 0..cluster.nodes.len() {
            let text = config(i, &cluster);
            cluster.nodes[i].agent_mut().spec.config = Some(text);
        }
        Ok(cluster)
    }

    /// Sets every agent's config to `config(i, &cluster)` (TOML), for configs that can fail to
    /// build (e.g. with [`Cluster::routes_config`]).
    pub fn configure(&mut self, config: impl Fn(usize, &Cluster) -> Result<String>) -> Result<()> {
        for i in 0..self.nodes.len() {
            let text = config(i, self)?;
            self.nodes[i].agent_mut().spec.config = Some(text);
        }
        Ok(())
    }

    /// Starts every agent, in order, each until it answers. Panics on failure.
    pub fn start(&self) {
        self.try_start().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts every agent, in order, each until it answers.
    pub fn try_start(&self) -> Result<()> {
        self.nodes.iter().try_for_each(|n| n.agent().start(&[]))
    }

    /// The underlay namespace (bridges, the router, etcd).
    pub fn underlay(&self) -> &Netns {
        &self.etcd.ns
    }

    /// Node `i`'s underlay IPv4 address.
    pub fn address(&self, i: usize) -> String {
        node_address(i, self.subnets[i])
    }

    /// Node `i`'s underlay IPv6 address.
    pub fn address6(&self, i: usize) -> String {
        node_address6(i, self.subnets[i])
    }

    /// The etcd client URL node `i` uses (its subnet's gateway).
    pub fn etcd_url(&self, i: usize) -> String {
        format!("http://{}:2379", gateway(self.subnets[i], false))
    }

    /// Node `i`'s name (its agent's `node_name`, its namespace's name).
    pub fn name(&self, i: usize) -> &str {
        &self.nodes[i].ns.name
    }

    /// A `[routes]` section turning route distribution on for node `i` with mutual TLS: its
    /// certificate from `ca` (written to the node's directory), then `extra` lines of
    /// `[routes]` (e.g. `grace_secs = 5`). Append after [`Cluster::base_config`] and pools.
    pub fn routes_config(&self, i: usize, ca: &crate::tls::Ca, extra: &str) -> Result<String> {
        let files = ca.write(&self.nodes[i].dir.join("tls"), self.name(i))?;
        Ok(format!(
            "[routes]\nenabled = true\n{extra}\n{}",
            files.toml()
        ))
    }

    /// The config every cluster node needs (TOML, top-level keys then `[datastore]`): its
    /// uplink, etcd. Append pools and other sections after it.
    pub fn base_config(&self, i: usize) -> String {
        format!(
            "uplinks = [\"eth0\"]\n[datastore]\ntype = \"etcd\"\nendpoints = [\"{}\"]\n",
            self.etcd_url(i)
        )
    }
}

fn bridge(subnet: u8) -> String {
    format!("br{}", (b'a' + subnet - 1) as char)
}

fn gateway(subnet: u8, v6: bool) -> String {
    if v6 {
        format!("fd31:{subnet}::fe")
    } else {
        format!("172.31.{subnet}.254")
    }
}

fn gateway_cidr(subnet: u8, v6: bool) -> String {
    format!("{}/{}", gateway(subnet, v6), if v6 { 64 } else { 24 })
}

fn node_address(i: usize, subnet: u8) -> String {
    format!("172.31.{subnet}.{}", i + 1)
}

fn node_address6(i: usize, subnet: u8) -> String {
    format!("fd31:{subnet}::{:x}", i + 1)
}
