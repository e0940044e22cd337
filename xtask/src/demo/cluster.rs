//! `cargo xtask demo --nodes 3`: a cluster on one machine, on the test bed's underlay
//! ([`Cluster`]): nodes 0 and 1 on subnet 1, node 2 on subnet 2 behind the underlay's router,
//! etcd in the underlay; a real calix-agent per node with route distribution over mutual TLS;
//! two dual-stack pods per node wired by the real CNI plugin. Every line it prints is a check
//! that fails the demo when it does not hold: the routes each node programs (direct on the
//! shared subnet, through VXLAN across subnets), ping and TCP between every two pods in both
//! families, and in eBPF mode no IP forwarding for same-subnet traffic between nodes. It shows
//! `calixctl nodes`, `calixctl routes` and the kernel's calix routes of node 0.
//!
//! Everything is named `calix-demo-<pid>-…` and dropped on the way out (on an error or Ctrl-C
//! too: pods first, then the agents, the node namespaces, etcd and the underlay); the last
//! check is that nothing of that name is left.
mod checks;

use std::net::IpAddr;
use std::process::{Command, Output};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use calix_kernel::vxlan::{DEVICE_V4, DEVICE_V6, OVERHEAD_V6};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::echo::EchoServer;
use calix_testbed::{Cluster, Netns, Pod};
use serde_json::json;

use self::checks::{ip_forwarding, reaches, routes_in_place, Path};
use super::{step, Mode, PREFIX};
use crate::{interrupt, leftovers, util};

/// Nodes 0 and 1 share subnet 1; node 2 sits alone on subnet 2, behind the underlay's router.
const SUBNETS: [u8; 3] = [1, 1, 2];
/// A dual-stack pool pair with the default blocks (/26, /122) and `vxlan = "crossSubnet"`.
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\n[[pools]]\ncidr = \"fd00:244::/64\"\n";
/// The node whose tables the demo shows: it has a neighbour on its subnet and one across.
const SHOWN: usize = 0;
/// The MTU of the underlay's links.
const UNDERLAY_MTU: u32 = 1500;
const TOTAL: u32 = 9;

pub fn run(mode: Mode) -> Result<()> {
    util::require_root("the demo")?;
    step(1, TOTAL, "Installing prerequisites (cargo xtask setup)")?;
    crate::setup::run()?;
    util::ensure_bpffs()?;
    step(
        2,
        TOTAL,
        "Building calix (CNI plugin), calix-agent and calixctl",
    )?;
    util::build_bins()?;
    interrupt::catch();
    leftovers::remove_stale(PREFIX)?;
    let run = format!("{PREFIX}-{}", std::process::id());
    let started = Instant::now();
    // Ctrl-C also kills the running step's children: name the interrupt, not their failure.
    let outcome = cluster_demo(&run, mode).or_else(|e| interrupt::check().and(Err(e)));
    // Everything the demo made is dropped by now, whatever happened: prove it is gone.
    let left = leftovers::left_behind(&run)?;
    let left = (!left.is_empty())
        .then(|| format!("the demo left things behind:\n  {}", left.join("\n  ")));
    match (outcome, left) {
        (Err(e), Some(left)) => return Err(e.context(left)),
        (Err(e), None) => return Err(e),
        (Ok(()), Some(left)) => bail!(left),
        (Ok(()), None) => {}
    }
    println!("      nothing left behind: no {run}* namespace, pin root, directory or process");
    println!(
        "\ndemo finished in {:.1} s after the build: 3 nodes on etcd, 6 dual-stack pods, \
         same-node, direct and VXLAN traffic checked, everything removed.",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Steps 3 to 9; what they create is dropped when this returns.
fn cluster_demo(run: &str, mode: Mode) -> Result<()> {
    step(
        3,
        TOTAL,
        "Creating the underlay (two subnets, a router between them, etcd) and three nodes",
    )?;
    let mut cluster = Cluster::launch_with(
        || format!("{run}-underlay"),
        |i| format!("{run}-node{i}"),
        calix_testbed::AgentSpec::new(calix_testbed::bin_dir(), mode.dataplane()),
        &SUBNETS,
        // Configured below, where a failure is an error rather than a panic.
        |_, _| String::new(),
    )?;
    println!(
        "      underlay {}: bridges for 172.31.1.0/24 and 172.31.2.0/24 (fd31:1::/64, \
         fd31:2::/64), routing between them; etcd on .254 of each",
        cluster.underlay().name
    );
    for i in 0..cluster.nodes.len() {
        println!(
            "      node{i}  {}  eth0 {} {}  subnet {}",
            cluster.name(i),
            cluster.address(i),
            cluster.address6(i),
            cluster.subnets[i]
        );
    }

    step(
        4,
        TOTAL,
        &format!(
            "Starting calix-agent on each node (etcd datastore, route distribution over mutual \
             TLS, {} dataplane)",
            mode.label()
        ),
    )?;
    let ca = Ca::new("calix-demo-ca")?;
    for i in 0..cluster.nodes.len() {
        let config = format!(
            "{}{POOLS}{}",
            cluster.base_config(i),
            cluster.routes_config(i, &ca, "")?
        );
        cluster.nodes[i].agent_mut().spec.config = Some(config);
    }
    for (i, n) in cluster.nodes.iter().enumerate() {
        interrupt::check()?;
        let t = Instant::now();
        n.agent().start(&[])?;
        println!(
            "      node{i}: agent up in {:.1} s; its certificate names {} (one CA signs all three)",
            t.elapsed().as_secs_f64(),
            cluster.name(i)
        );
    }
    with_pods(&cluster, mode)?;
    let t = Instant::now();
    let namespaces = cluster.nodes.len() + 1;
    drop(cluster);
    println!(
        "      agents and etcd stopped, {namespaces} namespaces and the pin roots removed in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A pod of the demo: its name (`pod-<node><a|b>`) and node.
struct DemoPod<'a> {
    name: String,
    node: usize,
    pod: Pod<'a>,
}

impl DemoPod<'_> {
    fn ips(&self) -> Vec<IpAddr> {
        self.pod
            .ips()
            .iter()
            .filter_map(|a| a.parse().ok())
            .collect()
    }
}

/// Steps 5 to 9 on a started cluster. On an error the agents' last log lines are printed
/// while the pods still exist, then the pods are DELeted before the cluster goes.
fn with_pods(cluster: &Cluster, mode: Mode) -> Result<()> {
    let mut pods = Vec::new();
    let outcome = exercise(cluster, &mut pods, mode);
    if outcome.is_err() && interrupt::check().is_ok() {
        print_logs(cluster);
    }
    outcome
}

/// Steps 5 to 9: ADDs the pods into `pods`, checks, DELs them.
fn exercise<'a>(cluster: &'a Cluster, pods: &mut Vec<DemoPod<'a>>, mode: Mode) -> Result<()> {
    step(
        5,
        TOTAL,
        "ADDing two dual-stack pods per node through the calix CNI plugin",
    )?;
    let dual = json!({"ipam": {"type": "calix-ipam", "assign_ipv6": "true"}});
    for (i, node) in cluster.nodes.iter().enumerate() {
        for x in ['a', 'b'] {
            interrupt::check()?;
            let name = format!("pod-{i}{x}");
            let ns = Netns::create(format!("{}-{name}", node.ns.name))?;
            let pod = Pod::launch(node, ns, &name, dual.clone())?;
            let p = DemoPod { name, node: i, pod };
            let mtu = mtu(&p.pod.ns)?;
            let want = UNDERLAY_MTU - OVERHEAD_V6;
            if mtu != want {
                bail!(
                    "{}'s eth0 has MTU {mtu}, expected {want} (the underlay's {UNDERLAY_MTU} \
                     less VXLAN's {OVERHEAD_V6} over IPv6)",
                    p.name
                );
            }
            let ips: Vec<String> = p.ips().iter().map(IpAddr::to_string).collect();
            println!(
                "      {} on node{i}: {}  (eth0 mtu {mtu}: {UNDERLAY_MTU} less VXLAN; host side {})",
                p.name,
                ips.join(", "),
                p.pod.host_ifname()
            );
            if ips.len() != 2 {
                bail!(
                    "{} got {ips:?}, expected an IPv4 and an IPv6 address",
                    p.name
                );
            }
            pods.push(p);
        }
    }
    let added = Instant::now();
    let _servers = pods
        .iter()
        .map(|p| EchoServer::start(&p.pod.ns))
        .collect::<Result<Vec<_>, _>>()?;

    step(
        6,
        TOTAL,
        "Route distribution: every node routes to the other nodes' pods",
    )?;
    routes_in_place(cluster, pods, mode)?;
    println!(
        "      all in place {:.2} s after the last ADD: node0 <-> node1 direct via eth0, \
         node2 through {DEVICE_V4} / {DEVICE_V6}",
        added.elapsed().as_secs_f64()
    );
    let shown = &cluster.nodes[SHOWN];
    for (what, out) in [
        ("calixctl nodes", shown.calixctl(&["nodes"])),
        ("calixctl routes", shown.calixctl(&["routes"])),
        (
            "ip route show proto 202",
            shown.ns.exec(&["ip", "route", "show", "proto", "202"]),
        ),
        (
            "ip -6 route show proto 202",
            shown
                .ns
                .exec(&["ip", "-6", "route", "show", "proto", "202"]),
        ),
    ] {
        println!("\n      {what}   (on node{SHOWN})");
        for l in succeeded(what, out)?.lines() {
            println!("        {l}");
        }
    }

    step(
        7,
        TOTAL,
        "Pod to pod: ping and TCP (64 KiB echoed), IPv4 and IPv6, both ways",
    )?;
    for path in [Path::SameNode, Path::Direct, Path::Vxlan] {
        let mut pairs = 0;
        for (k, from) in pods.iter().enumerate() {
            for to in &pods[k + 1..] {
                if Path::between(from.node, to.node) != path {
                    continue;
                }
                interrupt::check()?;
                reaches(from, to, path)?;
                reaches(to, from, path)?;
                pairs += 1;
            }
        }
        let checks = pairs * 2 * 2;
        println!(
            "      {:<44} {pairs} pod pairs: {checks} pings, {checks} TCP echoes: ok",
            path.label()
        );
    }

    step(
        8,
        TOTAL,
        "Same subnet, node0 -> node1: do the nodes' IP stacks forward it? (nstat)",
    )?;
    ip_forwarding(cluster, pods, mode)?;

    step(
        9,
        TOTAL,
        "DELeting the pods, stopping the agents and etcd, removing everything",
    )?;
    for p in pods.iter_mut() {
        p.pod.try_del()?;
    }
    for (i, n) in cluster.nodes.iter().enumerate() {
        let eps = n.agent().calixctl_json(&["endpoints"])?;
        let left = eps["endpoints"].as_array().map_or(0, Vec::len);
        if left != 0 {
            bail!("node{i} still has {left} endpoint(s) after every DEL: {eps}");
        }
    }
    let allocated = shown.agent().allocated()?;
    if allocated != 0 {
        bail!("{allocated} address(es) still allocated in etcd after every DEL");
    }
    println!(
        "      {} pods deleted: no endpoint on any node, no address allocated in etcd",
        pods.len()
    );
    Ok(())
}

/// `ip -j link show eth0` in `ns`: its MTU.
fn mtu(ns: &Netns) -> Result<u32> {
    let v = calix_testbed::json(
        Command::new("ip").args(["-n", &ns.name, "-j", "link", "show", "dev", "eth0"]),
    )?;
    v[0]["mtu"]
        .as_u64()
        .and_then(|m| u32::try_from(m).ok())
        .with_context(|| format!("no MTU in {v}"))
}

/// The stdout of a command that must have succeeded.
fn succeeded(what: &str, out: Output) -> Result<String> {
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The last lines of every agent's log, before they go with the cluster.
fn print_logs(cluster: &Cluster) {
    const LINES: usize = 12;
    for (i, n) in cluster.nodes.iter().enumerate() {
        let log = n.agent_log();
        let lines: Vec<&str> = log.lines().collect();
        eprintln!(
            "--- node{i}'s agent log, last {LINES} lines ---\n{}",
            lines[lines.len().saturating_sub(LINES)..].join("\n")
        );
    }
}
