//! A pod whose ADD needs a new block, until that block is reachable from outside the cluster.
//!
//! One node (release agent, eBPF dataplane, etcd) whose pools hand out blocks of one address
//! (`blockSize = 32`), so every ADD claims a block that the agent's speaker advertises to the
//! router: BIRD in the underlay, which installs what it learns in the underlay's kernel (its
//! `kernel` protocol) and routes toward an "outside" namespace behind it (198.18.9.0/24).
//! Per pod: the real `calix` plugin's ADD, exec'd as a runtime does, timed fork-to-exit; from
//! the moment it returns, the outside pings the new address every [`PROBE_INTERVAL`] from a
//! raw ICMP socket until the first reply. Where the time went, from the ADD's start: when
//! BIRD read the UPDATE (its own timestamp of the route), when the route reached the router's
//! kernel (a netlink listener in the underlay), the first reply. In the same round a pod long
//! reachable is pinged the same way: the floor.
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::traffic::cpu::load_average;
use calix_testbed::traffic::probe::{first_replies, Pinger};
use calix_testbed::{veth, Cluster, Dataplane, Netns, Plugin};
use ipnet::{IpNet, Ipv4Net};
use serde_json::json;

use super::super::harness::{check_interrupted, Bench};
use super::super::routewatch::{RouteWatch, Which};
use super::bird::{epoch_now, Bird, TIMEFORMAT};

/// How often the outside pings a new pod until the first reply.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(5);
/// How long it waits for a reply before the pod counts as unreachable.
pub const PROBE_LIMIT: Duration = Duration::from_secs(2);
/// `RTPROT_BIRD`: the routes BIRD installs.
const RTPROT_BIRD: u8 = 12;
const ROUTER_AS: u32 = 65000;
const NODE_AS: u32 = 64601;
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\nblockSize = 32\n";

/// Every pod, in ms (NaN: not seen; infinite: no reply within [`PROBE_LIMIT`]).
#[derive(Default)]
pub struct Samples {
    /// The ADD, fork-to-exit.
    pub add: Vec<f64>,
    /// After the ADD started: BIRD read the route, the route in the router's kernel, the
    /// first reply from outside.
    pub at_bird: Vec<f64>,
    pub in_kernel: Vec<f64>,
    pub reply: Vec<f64>,
    /// The first reply after the ADD returned.
    pub reply_after_add: Vec<f64>,
    /// The floor: a pod long reachable, pinged from outside the same way (ms).
    pub floor: Vec<f64>,
    pub load: Vec<f64>,
}

fn agent_config(c: &Cluster) -> String {
    format!(
        "{}{POOLS}[bgp]\nenabled = true\nas_number = {NODE_AS}\n\
         [[bgp.peers]]\nname = \"tor\"\naddress = \"172.31.1.254\"\nas_number = {ROUTER_AS}\n",
        c.base_config(0)
    )
}

/// The router: one session with the node, what it learns into the underlay's kernel.
pub(super) fn bird_conf(node: &str) -> String {
    format!(
        "router id 172.31.1.254;\n{TIMEFORMAT}protocol device {{}}\n\
         protocol kernel k4 {{ ipv4 {{ import none; export where source = RTS_BGP; }}; }}\n\
         protocol bgp node {{ local 172.31.1.254 as {ROUTER_AS}; neighbor {node} as {NODE_AS}; \
         passive on; ipv4 {{ import all; export none; }}; }}\n"
    )
}

/// The outside: a namespace behind the router.
fn outside(b: &Bench, c: &Cluster) -> Result<Netns> {
    let out = b.netns("reach-out")?;
    veth(&out, "eth0", c.underlay(), "out0")?;
    c.underlay()
        .ip_batch("addr add 198.18.9.1/24 dev out0\nlink set out0 up")?;
    out.ip_batch(
        "addr add 198.18.9.2/24 dev eth0\nlink set eth0 up\nroute add default via 198.18.9.1",
    )?;
    Ok(out)
}

/// The milliseconds from `t0` to `t` (negative when before).
fn ms_since(t0: Instant, t: Instant) -> f64 {
    match t.checked_duration_since(t0) {
        Some(d) => d.as_secs_f64() * 1e3,
        None => -(t0 - t).as_secs_f64() * 1e3,
    }
}

struct Bed {
    plugin: Plugin,
    /// The new pod's probe, the floor's.
    pingers: [Pinger; 2],
    watch: RouteWatch,
    bird: Bird,
    reachable: Ipv4Addr,
    pods: Vec<Netns>,
    _outside: Netns,
    _cluster: Cluster,
}

fn bed(b: &Bench) -> Result<Bed> {
    let mut cluster = Cluster::launch_with(
        || b.name("reach-u"),
        |i| b.name(&format!("reach-n{i}")),
        b.spec(Dataplane::Ebpf),
        &[1],
        |_, _| String::new(),
    )?;
    cluster.configure(|_, c| Ok(agent_config(c)))?;
    let mut bird = Bird::start(
        cluster.underlay(),
        &b.dir,
        "reach",
        &bird_conf(&cluster.address(0)),
    )?;
    let out = outside(b, &cluster)?;
    cluster.try_start()?;
    bird.ctl.until_up(&["node"], 0, Duration::from_secs(60))?;
    let node = &cluster.nodes[0];
    let conf = node.conf(json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } }));
    let plugin = Plugin::new("calix", b.bins.join("calix"), Some(&node.ns), &conf);
    let first = b.netns("reach-first")?;
    let reachable = plugin.add_pod(&first, "first")?;
    let mut pingers = [Pinger::open(&out)?, Pinger::open(&out)?];
    let got = first_replies(
        &mut [(&mut pingers[1], reachable)],
        Duration::from_millis(20),
        Duration::from_secs(20),
    )?;
    if got[0].is_none() {
        bail!(
            "the outside does not reach the first pod {reachable}\nrouter: {}",
            bird.ctl.cmd("show route")?
        );
    }
    let watch = RouteWatch::start_of(cluster.underlay(), Which::Protocol(RTPROT_BIRD))?;
    Ok(Bed {
        plugin,
        pingers,
        watch,
        bird,
        reachable,
        pods: vec![first],
        _outside: out,
        _cluster: cluster,
    })
}

impl Bed {
    /// ADDs pod `k` and times its way out; the progress line.
    fn pod(&mut self, b: &Bench, k: usize, s: &mut Samples) -> Result<String> {
        s.load.push(load_average());
        let name = format!("p{k}");
        let ns = b.netns(&format!("reach-{name}"))?;
        let (t0, w0) = (Instant::now(), epoch_now());
        let ip = self.plugin.add_pod(&ns, &name)?;
        let added = Instant::now();
        self.pods.push(ns);
        let [new, floor] = &mut self.pingers;
        let got = first_replies(
            &mut [(new, ip), (floor, self.reachable)],
            PROBE_INTERVAL,
            PROBE_LIMIT,
        )?;
        let dst = IpNet::V4(Ipv4Net::new(ip, 32)?);
        let kernel = self
            .watch
            .appeared(dst, Duration::from_millis(20))?
            .map_or(f64::NAN, |at| ms_since(t0, at));
        let at_bird = self
            .bird
            .ctl
            .route_times(&dst.to_string())?
            .first()
            .map_or(f64::NAN, |t| (t - w0) * 1e3);
        let reply = got[0].map_or(f64::INFINITY, |at| ms_since(t0, at));
        let after = got[0].map_or(f64::INFINITY, |at| ms_since(added, at));
        let fl = got[1].map_or(f64::INFINITY, |at| ms_since(added, at));
        let add = ms_since(t0, added);
        s.add.push(add);
        s.at_bird.push(at_bird);
        s.in_kernel.push(kernel);
        s.reply.push(reply);
        s.reply_after_add.push(after);
        s.floor.push(fl);
        Ok(format!(
            "{ip}: ADD {add:.1} ms; at BIRD {at_bird:.1} ms, in its kernel {kernel:.1} ms, \
             first reply {reply:.1} ms after the ADD started ({after:.1} after it returned); \
             floor {fl:.2} ms"
        ))
    }
}

/// Runs the part: `pods` pods, each on a new block.
pub fn run(b: &Bench, pods: usize) -> Result<Samples> {
    println!(
        "[setup] new block to outside: a node speaking BGP to BIRD in the underlay, an outside \
         namespace behind it"
    );
    let mut bed = bed(b).context("setting up the new-block part")?;
    let mut s = Samples::default();
    for k in 0..pods {
        check_interrupted()?;
        let line = bed.pod(b, k, &mut s).with_context(|| format!("pod {k}"))?;
        if k % 5 == 0 || k + 1 == pods {
            println!("[pod {}/{pods}] {line}", k + 1);
        }
    }
    println!(
        "[done] new block to outside: {} pods, {} routes seen in the router's kernel",
        bed.pods.len(),
        bed.watch.count()
    );
    Ok(s)
}
