//! The three clusters and every variant's pods and servers: calix's (eBPF, kernel) and the
//! plain one, with its flannel-like VXLAN.
use std::net::Ipv4Addr;

use anyhow::{Context, Result};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::{Tools, Traffic};
use calix_testbed::{veth, Cluster, Dataplane, Guarded, Netns, Plugin};
use serde_json::json;

use super::{Variant, PLAIN_DEV, PLAIN_MTU, PLAIN_VNI, POOLS, SUBNETS, VXLAN_PORT};
use crate::bench::baseline::Calix;
use crate::bench::harness::{check_interrupted, warm_up, Bench, Compared};

/// The three clusters, and every pod; removed when dropped (pods first).
pub(super) struct Beds {
    pods: Vec<Netns>,
    ebpf: Cluster,
    kernel: Cluster,
    plain: Cluster,
    /// The baseline's calix eBPF cluster (`--baseline`).
    base: Option<Cluster>,
}

impl Beds {
    fn cluster(&self, v: Variant) -> Result<&Cluster> {
        Ok(match v {
            Variant::Ebpf | Variant::EbpfVxlan => &self.ebpf,
            Variant::Kernel | Variant::KernelVxlan => &self.kernel,
            Variant::Underlay | Variant::PlainVxlan => &self.plain,
            Variant::BaseEbpf | Variant::BaseEbpfVxlan => self
                .base
                .as_ref()
                .context("a baseline variant without a baseline")?,
        })
    }
}

/// One variant's servers and traffic; the servers stop when dropped.
pub(super) struct Topology {
    pub(super) traffic: Traffic,
    /// The client's and the server's node namespaces.
    pub(super) nodes: [Netns; 2],
    _servers: Vec<Guarded>,
}

/// A calix cluster with `spec`'s agents (`bins`: this build's or a baseline's).
fn calix_cluster(b: &Bench, ca: &Ca, tag: &str, spec: calix_testbed::AgentSpec) -> Result<Cluster> {
    let mut c = Cluster::launch_with(
        || b.name(&format!("{tag}-u")),
        |i| b.name(&format!("{tag}-n{i}")),
        spec,
        &SUBNETS,
        |_, _| String::new(),
    )?;
    c.configure(|i, c| {
        Ok(format!(
            "{}{POOLS}{}",
            c.base_config(i),
            c.routes_config(i, ca, "")?
        ))
    })?;
    c.try_start()?;
    Ok(c)
}

/// The VTEP MAC of plain node `i`.
fn plain_mac(i: usize) -> String {
    format!("0e:fe:00:00:00:{:02x}", i + 1)
}

/// Plain node `i`'s pod subnet (10.50.<i+1>.0/24: the node .1, its pod .2) and VTEP address
/// (its .0).
fn plain_net(i: usize, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 50, i as u8 + 1, host)
}

/// The plain VXLAN between nodes 0 and 2 of `c`, flannel's way: a VXLAN device per node
/// without learning, the peer's VTEP as a permanent neighbour and forwarding entry, the
/// peer's pod subnet routed `via <its VTEP> onlink`, and one pod per node on a plain veth pair
/// (the node routes it). Returns (client pod, server pod, server address).
fn plain_vxlan(b: &Bench, c: &Cluster) -> Result<(Netns, Netns, Ipv4Addr)> {
    let ends = [0, 2];
    let mut pods = Vec::new();
    for (k, &i) in ends.iter().enumerate() {
        let ns = &c.nodes[i].ns;
        ns.sysctl("net.ipv4.ip_forward=1")?;
        ns.ip(&format!(
            "link add {PLAIN_DEV} type vxlan id {PLAIN_VNI} local {} dev eth0 dstport \
             {VXLAN_PORT} nolearning",
            c.address(i)
        ))?;
        ns.ip(&format!(
            "link set {PLAIN_DEV} address {} mtu {PLAIN_MTU} up",
            plain_mac(i)
        ))?;
        ns.ip(&format!("addr add {}/32 dev {PLAIN_DEV}", plain_net(i, 0)))?;
        let peer = ends[1 - k];
        ns.ip(&format!(
            "neigh add {} lladdr {} dev {PLAIN_DEV} nud permanent",
            plain_net(peer, 0),
            plain_mac(peer)
        ))?;
        calix_testbed::checked(ns.command("bridge")?.args([
            "fdb",
            "append",
            &plain_mac(peer),
            "dev",
            PLAIN_DEV,
            "dst",
            &c.address(peer),
        ]))?;
        ns.ip(&format!(
            "route add {}/24 via {} dev {PLAIN_DEV} onlink",
            plain_net(peer, 0),
            plain_net(peer, 0)
        ))?;
        let pod = b.netns(&format!("pvx-{}", if k == 0 { "c" } else { "s" }))?;
        veth(ns, "vethpod", &pod, "eth0")?;
        ns.ip(&format!("addr add {}/24 dev vethpod", plain_net(i, 1)))?;
        ns.ip(&format!("link set vethpod mtu {PLAIN_MTU} up"))?;
        pod.ip(&format!("addr add {}/24 dev eth0", plain_net(i, 2)))?;
        pod.ip(&format!("link set eth0 mtu {PLAIN_MTU} up"))?;
        pod.ip(&format!("route add default via {}", plain_net(i, 1)))?;
        pods.push(pod);
    }
    let server = pods.pop().context("server pod")?;
    let client = pods.pop().context("client pod")?;
    Ok((client, server, plain_net(2, 2)))
}

/// Builds every variant's wiring: the clusters, the pods, the servers.
pub(super) fn build(
    b: &Bench,
    ca: &Ca,
    tools: &Tools,
    variants: &[Variant],
    base: Option<&Calix>,
) -> Result<(Beds, Vec<Topology>)> {
    println!("[setup] calix eBPF cluster (3 nodes)");
    let ebpf = calix_cluster(b, ca, "e", b.spec(Dataplane::Ebpf))?;
    println!("[setup] calix kernel cluster (3 nodes)");
    let kernel = calix_cluster(b, ca, "k", b.spec(Dataplane::Kernel))?;
    let base_cluster = match base {
        Some(base) => {
            println!(
                "[setup] calix eBPF cluster of the baseline {} (3 nodes)",
                base.label
            );
            let mut spec = b.spec(Dataplane::Ebpf);
            spec.bins = base.agent_bins.clone();
            Some(calix_cluster(b, ca, "b", spec)?)
        }
        None => None,
    };
    println!("[setup] plain cluster (3 nodes, no calix)");
    let plain = Cluster::launch_with(
        || b.name("p-u"),
        |i| b.name(&format!("p-n{i}")),
        b.spec(Dataplane::Kernel),
        &SUBNETS,
        |_, _| String::new(),
    )?;
    let mut beds = Beds {
        pods: Vec::new(),
        ebpf,
        kernel,
        plain,
        base: base_cluster,
    };
    let conf = json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } });
    // Declared after the clusters: dropped before them on an error.
    let mut pods = Vec::new();
    let mut topo = Vec::new();
    for &v in variants {
        check_interrupted()?;
        let tag = v.tag();
        let c = beds.cluster(v)?;
        let s = v.server_node();
        let (client, server, server_ip) = match v {
            Variant::Underlay => (
                Netns::borrowed(c.name(0)),
                Netns::borrowed(c.name(1)),
                c.address(1).parse()?,
            ),
            Variant::PlainVxlan => {
                let (client, server, ip) = plain_vxlan(b, c)?;
                let t = (
                    Netns::borrowed(&client.name),
                    Netns::borrowed(&server.name),
                    ip,
                );
                pods.extend([client, server]);
                t
            }
            _ => {
                let binary = match (v, base) {
                    (Variant::BaseEbpf | Variant::BaseEbpfVxlan, Some(base)) => base.plugin.clone(),
                    _ => b.bins.join("calix"),
                };
                let plugin = |i: usize| {
                    let n = &c.nodes[i];
                    Plugin::new(
                        v.label(),
                        binary.clone(),
                        Some(&n.ns),
                        &n.conf(conf.clone()),
                    )
                };
                let (client, server) =
                    (b.netns(&format!("{tag}-c"))?, b.netns(&format!("{tag}-s"))?);
                plugin(0).add_pod(&client, &format!("{tag}-c"))?;
                let ip = plugin(s).add_pod(&server, &format!("{tag}-s"))?;
                let t = (
                    Netns::borrowed(&client.name),
                    Netns::borrowed(&server.name),
                    ip,
                );
                pods.extend([client, server]);
                t
            }
        };
        let traffic = Traffic::new(&client, &server, server_ip);
        let servers = tools.start(&traffic, &b.dir)?;
        let t = Topology {
            traffic,
            nodes: [Netns::borrowed(c.name(0)), Netns::borrowed(c.name(s))],
            _servers: servers,
        };
        // The first connections wait for routes to spread and devices to appear.
        let patience = std::time::Duration::from_secs(20);
        warm_up(
            tools,
            v.label(),
            &t.traffic,
            &server_ip.to_string(),
            patience,
        )?;
        topo.push(t);
    }
    beds.pods = pods;
    Ok((beds, topo))
}
