//! Convergence: from a pod's ADD returning on node A to the pod answering pings from nodes B
//! and C, over two 3-node clusters built before anything is timed.
//!
//! Each cluster is the test bed's: nodes A and B on subnet 1, C on subnet 2 (so C reaches A
//! through VXLAN, the pools' default `crossSubnet`), real etcd in the underlay, release agents
//! with the eBPF dataplane and route distribution over mutual TLS (full mesh). The variants
//! differ in how a new pod's address reaches the others:
//! - **new block**: pools in blocks of one address (`blockSize = 32`), so every ADD on A claims
//!   a block, which A advertises and B and C validate against etcd and program;
//! - **borrowed**: the pool is one block, claimed by B before anything is timed; A owns no
//!   block, so each of its pods borrows an address of B's block, which A advertises as a /32.
//!
//! Per pod (variants alternating, order reversed every other pod): the real `calix` plugin's
//! ADD on A, exec'd as a runtime does; from the moment it returns, a probe pod on B and one on
//! C ping the new address every [`PROBE_INTERVAL`] from raw ICMP sockets until the first
//! reply, and a netlink listener in B's and C's namespaces stamps when the route to the
//! address appeared in their kernels. In the same round, a pod on A that is long reachable is
//! probed the same way from C: the floor (what the probing itself takes).
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::probe::{first_replies, Pinger};
use calix_testbed::{Cluster, Dataplane, Netns, Plugin};
use ipnet::{IpNet, Ipv4Net};
use plotters::style::RGBColor;
use serde_json::json;

use super::super::chart;
use super::super::harness::{check_interrupted, order, Bench, Compared};
use super::super::routewatch::RouteWatch;

/// How often a probe pings until the first reply.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(1);
/// How long a probe waits for a reply before the pod counts as unreachable.
pub const PROBE_LIMIT: Duration = Duration::from_secs(2);
/// The subnets of nodes A, B and C.
const SUBNETS: [u8; 3] = [1, 1, 2];
/// The borrowed variant's pool: one block of 1022 addresses.
const BORROW_POOL: &str = "10.244.0.0/22";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Variant {
    NewBlock,
    Borrowed,
}

pub const VARIANTS: [Variant; 2] = [Variant::NewBlock, Variant::Borrowed];

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::NewBlock => ("new block (blockSize 32)", "cb", chart::BLUE),
            Self::Borrowed => ("borrowed address (/32)", "cw", chart::ORANGE),
        }
    }
}

impl Variant {
    fn pools(self) -> String {
        match self {
            Self::NewBlock => "[[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 32\n".into(),
            Self::Borrowed => format!("[[pools]]\ncidr = \"{BORROW_POOL}\"\nblockSize = 22\n"),
        }
    }
}

/// What one observer (node B or C) saw of one pod, in ms after the ADD returned.
#[derive(Default)]
pub struct Seen {
    /// When the route to the pod appeared in its kernel (negative: before the ADD returned;
    /// NaN: never seen).
    pub route: Vec<f64>,
    /// The same, in ms after the ADD started.
    pub route_from_start: Vec<f64>,
    /// The first reply (infinite: none within [`PROBE_LIMIT`]).
    pub reply: Vec<f64>,
}

/// One variant over every pod.
#[derive(Default)]
pub struct Samples {
    /// ADD fork-to-exit (ms).
    pub add: Vec<f64>,
    /// Node B (same subnet) and node C (across subnets, VXLAN).
    pub seen: [Seen; 2],
    /// The floor: a pod long reachable, probed from C the same way (ms).
    pub floor: Vec<f64>,
    /// The 1-minute load average before each pod.
    pub load: Vec<f64>,
}

/// One variant's cluster, probes and watches; removed when dropped (the probes' pods, then
/// the cluster).
struct Bed {
    v: Variant,
    plugin: Plugin,
    /// Probes on B and C, and C's floor probe.
    pingers: [Pinger; 3],
    watches: [RouteWatch; 2],
    /// The pod the floor probe pings.
    reachable: Ipv4Addr,
    pods: Vec<Netns>,
    _probes: Vec<Netns>,
    cluster: Cluster,
}

fn ms_since(t0: Instant, t: Instant) -> f64 {
    match t.checked_duration_since(t0) {
        Some(d) => d.as_secs_f64() * 1e3,
        None => -(t0 - t).as_secs_f64() * 1e3,
    }
}

/// A cluster of three nodes for `v`, started, with a probe pod on B and on C that reach a
/// first pod on A.
fn bed(b: &Bench, ca: &Ca, v: Variant) -> Result<Bed> {
    let tag = v.tag();
    let mut cluster = Cluster::launch_with(
        || b.name(&format!("{tag}-u")),
        |i| b.name(&format!("{tag}-n{i}")),
        b.spec(Dataplane::Ebpf),
        &SUBNETS,
        |_, _| String::new(),
    )?;
    cluster.configure(|i, c| {
        Ok(format!(
            "{}{}{}",
            c.base_config(i),
            v.pools(),
            c.routes_config(i, ca, "")?
        ))
    })?;
    cluster.try_start()?;
    let conf = json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } });
    let plugins: Vec<Plugin> = cluster
        .nodes
        .iter()
        .map(|n| {
            Plugin::new(
                v.label(),
                b.bins.join("calix"),
                Some(&n.ns),
                &n.conf(conf.clone()),
            )
        })
        .collect();
    // B first: in the borrowed variant it claims the pool's one block.
    let mut probes = Vec::new();
    for (i, name) in [(1, "probe-b"), (2, "probe-c")] {
        let ns = b.netns(&format!("{tag}-{name}"))?;
        plugins[i].add_pod(&ns, name)?;
        probes.push(ns);
    }
    let first = b.netns(&format!("{tag}-first"))?;
    let reachable = plugins[0].add_pod(&first, "first")?;
    let mut pingers = [
        Pinger::open(&probes[0])?,
        Pinger::open(&probes[1])?,
        Pinger::open(&probes[1])?,
    ];
    // Until the cluster is whole: both probes reach the first pod.
    let [pb, pc, _] = &mut pingers;
    let got = first_replies(
        &mut [(pb, reachable), (pc, reachable)],
        Duration::from_millis(20),
        Duration::from_secs(20),
    )?;
    if got.iter().any(Option::is_none) {
        bail!(
            "{}: the probes on nodes B and C do not reach {reachable} on A (replies: {got:?})",
            v.label()
        );
    }
    let watches = [
        RouteWatch::start(&cluster.nodes[1].ns)?,
        RouteWatch::start(&cluster.nodes[2].ns)?,
    ];
    let plugin = plugins.into_iter().next().context("node A's plugin")?;
    Ok(Bed {
        v,
        plugin,
        pingers,
        watches,
        reachable,
        pods: vec![first],
        _probes: probes,
        cluster,
    })
}

impl Bed {
    /// ADDs pod `k` on A and times its way to B and C; the progress line.
    fn pod(&mut self, b: &Bench, k: usize, s: &mut Samples) -> Result<String> {
        s.load.push(calix_testbed::traffic::cpu::load_average());
        let name = format!("p{k}");
        let ns = b.netns(&format!("{}-{name}", self.v.tag()))?;
        let t = Instant::now();
        let ip = self.plugin.add_pod(&ns, &name)?;
        let added = Instant::now();
        self.pods.push(ns);
        let [pb, pc, floor] = &mut self.pingers;
        let got = first_replies(
            &mut [(pb, ip), (pc, ip), (floor, self.reachable)],
            PROBE_INTERVAL,
            PROBE_LIMIT,
        )?;
        let dst = IpNet::V4(Ipv4Net::new(ip, 32)?);
        s.add.push(ms_since(t, added));
        let mut line = format!("ADD {:.1} ms", ms_since(t, added));
        for (o, who) in ["B", "C"].iter().enumerate() {
            // The reply came through the route, or none came: either way no more waiting.
            let route = self.watches[o].appeared(dst, Duration::from_millis(10))?;
            s.seen[o]
                .route_from_start
                .push(route.map_or(f64::NAN, |at| ms_since(t, at)));
            let route = route.map_or(f64::NAN, |at| ms_since(added, at));
            let reply = got[o].map_or(f64::INFINITY, |at| ms_since(added, at));
            s.seen[o].route.push(route);
            s.seen[o].reply.push(reply);
            line.push_str(&format!(
                "; {who}: route {route:.1} ms, reply {reply:.1} ms"
            ));
        }
        let floor = got[2].map_or(f64::INFINITY, |at| ms_since(added, at));
        s.floor.push(floor);
        line.push_str(&format!("; floor {floor:.1} ms ({ip})"));
        Ok(line)
    }
}

/// Runs the convergence part: `pods` pods per variant.
pub fn run(b: &Bench, ca: &Ca, pods: usize) -> Result<[Samples; 2]> {
    let mut beds = Vec::new();
    for v in VARIANTS {
        check_interrupted()?;
        println!(
            "[setup] convergence, {}: 3 nodes, probes on B and C",
            v.label()
        );
        beds.push(bed(b, ca, v).with_context(|| format!("setting up {}", v.label()))?);
    }
    let mut res: [Samples; 2] = Default::default();
    for k in 0..pods {
        for v in order(&VARIANTS, k, false) {
            check_interrupted()?;
            let i = v as usize;
            let line = beds[i]
                .pod(b, k, &mut res[i])
                .with_context(|| format!("{}: pod {k}", v.label()))?;
            if k % 20 == 0 || k + 1 == pods {
                println!("[pod {}/{pods}] {}: {line}", k + 1, v.label());
            }
        }
    }
    for bed in &beds {
        println!(
            "[done] convergence, {}: {} pods on {}, {} routes seen appearing on C",
            bed.v.label(),
            bed.pods.len(),
            bed.cluster.name(0),
            bed.watches[1].count()
        );
    }
    Ok(res)
}
