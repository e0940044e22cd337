//! The cluster demo's checks: which way two pods' traffic goes, the routes every node must
//! have for it, ping and TCP between two pods, and the nodes' IP forwarding counters around
//! same-subnet traffic. Each fails with what it expected and what it found.
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_kernel::vxlan::{DEVICES, DEVICE_V4, DEVICE_V6};
use calix_testbed::traffic::echo::{echo_roundtrip, ECHO_PORT};
use calix_testbed::traffic::nstat;
use calix_testbed::{Cluster, Netns};
use ipnet::IpNet;

use super::{DemoPod, SUBNETS};
use crate::demo::Mode;
use crate::interrupt;

/// How long route distribution may take to program every node.
const ROUTES_WITHIN: Duration = Duration::from_secs(10);

/// The way between two pods' nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    SameNode,
    /// Another node on the same subnet: `block via <node> dev eth0`.
    Direct,
    /// A node on the other subnet: through the VXLAN devices.
    Vxlan,
}

impl Path {
    pub(super) fn between(a: usize, b: usize) -> Self {
        match (a == b, SUBNETS[a] == SUBNETS[b]) {
            (true, _) => Self::SameNode,
            (false, true) => Self::Direct,
            (false, false) => Self::Vxlan,
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Self::SameNode => "same node",
            Self::Direct => "other node, same subnet (direct route)",
            Self::Vxlan => "other node, other subnet (VXLAN)",
        }
    }
}

/// Ping and a TCP echo from `from` to each of `to`'s addresses.
pub(super) fn reaches(from: &DemoPod, to: &DemoPod, path: Path) -> Result<()> {
    for ip in to.ips() {
        let what = format!(
            "{}: {} (node{}) -> {} (node{}) at {ip}",
            path.label(),
            from.name,
            from.node,
            to.name,
            to.node
        );
        if !from.pod.ns.ping(&ip.to_string(), 1) {
            interrupt::check()?;
            bail!("{what}: no ping reply");
        }
        echo_roundtrip(
            &from.pod.ns,
            SocketAddr::new(ip, ECHO_PORT),
            64 * 1024,
            Duration::from_secs(5),
        )
        .or_else(|e| interrupt::check().and(Err(e.into())))
        .with_context(|| format!("{what}: TCP"))?;
    }
    Ok(())
}

/// One route of calix's (protocol 202) in a node's main table.
#[derive(Debug)]
struct KernelRoute {
    dst: IpNet,
    gateway: Option<IpAddr>,
    dev: String,
}

/// Node `ns`'s calix routes, both families.
fn calix_routes(ns: &Netns) -> Result<Vec<KernelRoute>> {
    let mut routes = Vec::new();
    for family in ["-4", "-6"] {
        let v = calix_testbed::json(Command::new("ip").args([
            "-n", &ns.name, "-j", family, "route", "show", "proto", "202",
        ]))?;
        for r in v.as_array().into_iter().flatten() {
            let dst = r["dst"].as_str().unwrap_or_default();
            let dst = dst
                .parse::<IpNet>()
                .or_else(|_| dst.parse::<IpAddr>().map(IpNet::from))
                .with_context(|| {
                    format!("a route without a destination in {ns:?}: {r}", ns = ns.name)
                })?;
            routes.push(KernelRoute {
                dst,
                gateway: r["gateway"].as_str().and_then(|g| g.parse().ok()),
                dev: r["dev"].as_str().unwrap_or_default().to_string(),
            });
        }
    }
    Ok(routes)
}

/// What node `i` must route to `ip`, a pod of node `j`: via `j`'s underlay address, out of
/// eth0 on the same subnet, else out of the VXLAN device of the address's family.
fn expected_route(
    cluster: &Cluster,
    j: usize,
    ip: IpAddr,
    path: Path,
) -> Result<(IpAddr, &'static str)> {
    let gateway = match ip {
        IpAddr::V4(_) => cluster.address(j),
        IpAddr::V6(_) => cluster.address6(j),
    };
    let dev = match (path, ip) {
        (Path::Vxlan, IpAddr::V4(_)) => DEVICE_V4,
        (Path::Vxlan, IpAddr::V6(_)) => DEVICE_V6,
        _ => "eth0",
    };
    let gateway = gateway
        .parse()
        .with_context(|| format!("node{j}'s address {gateway}"))?;
    Ok((gateway, dev))
}

/// Waits until every node routes every other node's pods the way [`expected_route`] says (and,
/// in eBPF mode, has its host-device programs on its VXLAN devices); fails after
/// [`ROUTES_WITHIN`] naming what is missing.
pub(super) fn routes_in_place(cluster: &Cluster, pods: &[DemoPod], mode: Mode) -> Result<()> {
    let deadline = Instant::now() + ROUTES_WITHIN;
    loop {
        interrupt::check()?;
        let mut missing = Vec::new();
        for (i, node) in cluster.nodes.iter().enumerate() {
            let routes = calix_routes(&node.ns)?;
            for p in pods.iter().filter(|p| p.node != i) {
                for ip in p.ips() {
                    let path = Path::between(i, p.node);
                    let (gateway, dev) = expected_route(cluster, p.node, ip, path)?;
                    let found = routes
                        .iter()
                        .any(|r| r.dst.contains(&ip) && r.gateway == Some(gateway) && r.dev == dev);
                    if !found {
                        missing.push(format!(
                            "node{i} has no route to {} ({ip}) via {gateway} dev {dev}",
                            p.name
                        ));
                    }
                }
            }
            if mode == Mode::Ebpf {
                for dev in node
                    .ns
                    .links()
                    .iter()
                    .filter(|l| DEVICES.contains(&l.as_str()))
                {
                    if node.filter_prog(dev, "ingress").is_none() {
                        missing.push(format!("node{i} has no from_host_dev on {dev}"));
                    }
                }
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "route distribution did not program every node within {} s:\n  {}",
                ROUTES_WITHIN.as_secs(),
                missing.join("\n  ")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Same-subnet traffic from node 0's pod to node 1's pods, with both nodes' IP forwarding
/// counters read around it: unchanged in eBPF mode (the programs redirect from the pod's veth
/// out of eth0 and from eth0 into the pod), counted in kernel mode.
pub(super) fn ip_forwarding(cluster: &Cluster, pods: &[DemoPod], mode: Mode) -> Result<()> {
    const COUNTERS: [&str; 2] = ["IpForwDatagrams", "Ip6OutForwDatagrams"];
    const PINGS: u32 = 20;
    const BYTES: usize = 256 * 1024;
    let (a, b) = (0, 1);
    let from = pods
        .iter()
        .find(|p| p.node == a)
        .context("node0 has no pod")?;
    let read = || -> Result<Vec<f64>> {
        let mut v = Vec::new();
        for n in [a, b] {
            for c in COUNTERS {
                v.push(nstat(&cluster.nodes[n].ns, c)?);
            }
        }
        Ok(v)
    };
    let before = read()?;
    let mut sent = (0, 0);
    for to in pods.iter().filter(|p| p.node == b) {
        for ip in to.ips() {
            let count = PINGS.to_string();
            let out = from.pod.ns.exec(&[
                "ping",
                "-c",
                &count,
                "-i",
                "0.01",
                "-W",
                "2",
                "-q",
                &ip.to_string(),
            ]);
            if !out.status.success() {
                bail!(
                    "{} -> {} at {ip}: pings lost\n{}",
                    from.name,
                    to.name,
                    String::from_utf8_lossy(&out.stdout).trim()
                );
            }
            echo_roundtrip(
                &from.pod.ns,
                SocketAddr::new(ip, ECHO_PORT),
                BYTES,
                Duration::from_secs(5),
            )
            .with_context(|| format!("{} -> {} at {ip}: TCP", from.name, to.name))?;
            sent.0 += PINGS;
            sent.1 += BYTES;
        }
    }
    let after = read()?;
    println!(
        "      {} (node0) -> pod-1a, pod-1b (node1), IPv4 and IPv6: {} pings, {} KiB echoed over TCP",
        from.name,
        sent.0,
        sent.1 / 1024
    );
    let mut deltas = Vec::new();
    for (k, (x, y)) in before.iter().zip(&after).enumerate() {
        let node = if k < COUNTERS.len() { a } else { b };
        let counter = COUNTERS[k % COUNTERS.len()];
        let delta = y - x;
        println!("      node{node} {counter:<20} {x:>8} -> {y:>8}  (+{delta})");
        deltas.push((node, counter, delta));
    }
    match mode {
        Mode::Ebpf => {
            if let Some((node, counter, d)) = deltas.iter().find(|(_, _, d)| *d != 0.0) {
                bail!(
                    "eBPF mode: node{node}'s {counter} went up by {d}: same-subnet traffic \
                     between nodes went through its IP stack"
                );
            }
            println!(
                "      unchanged: from_pod sends it out of eth0 (bpf_fib_lookup + \
                 bpf_redirect_neigh), from_host_dev hands it to the pod (bpf_redirect_peer)"
            );
        }
        Mode::Kernel => {
            if let Some((node, counter, _)) = deltas.iter().find(|(_, _, d)| *d == 0.0) {
                bail!(
                    "kernel mode: node{node}'s {counter} did not move: the traffic did not go \
                     through its IP stack"
                );
            }
            println!("      counted: in kernel mode both nodes' IP stacks forward every packet");
        }
    }
    Ok(())
}
