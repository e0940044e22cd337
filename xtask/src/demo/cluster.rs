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
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_kernel::vxlan::{DEVICES, DEVICE_V4, DEVICE_V6, OVERHEAD_V6};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::echo::{echo_roundtrip, EchoServer, ECHO_PORT};
use calix_testbed::traffic::nstat;
use calix_testbed::{Cluster, Netns, Pod};
use ipnet::IpNet;
use serde_json::json;

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
/// How long route distribution may take to program every node.
const ROUTES_WITHIN: Duration = Duration::from_secs(10);
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
        mode.dataplane(),
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

/// The way between two pods' nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    SameNode,
    /// Another node on the same subnet: `block via <node> dev eth0`.
    Direct,
    /// A node on the other subnet: through the VXLAN devices.
    Vxlan,
}

impl Path {
    fn between(a: usize, b: usize) -> Self {
        match (a == b, SUBNETS[a] == SUBNETS[b]) {
            (true, _) => Self::SameNode,
            (false, true) => Self::Direct,
            (false, false) => Self::Vxlan,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::SameNode => "same node",
            Self::Direct => "other node, same subnet (direct route)",
            Self::Vxlan => "other node, other subnet (VXLAN)",
        }
    }
}

/// Ping and a TCP echo from `from` to each of `to`'s addresses.
fn reaches(from: &DemoPod, to: &DemoPod, path: Path) -> Result<()> {
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
fn routes_in_place(cluster: &Cluster, pods: &[DemoPod], mode: Mode) -> Result<()> {
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
fn ip_forwarding(cluster: &Cluster, pods: &[DemoPod], mode: Mode) -> Result<()> {
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
