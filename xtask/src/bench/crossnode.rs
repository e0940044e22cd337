//! `cargo xtask bench crossnode`: pod to pod across nodes — calix's kernel mode, eBPF, and
//! VXLAN in both — against the underlay itself (the ceiling) and a plain kernel VXLAN device
//! with static routes (what flannel does), in one run on one machine (DESIGN.md §10).
//!
//! Three clusters of the test bed, all built before any measurement and kept for the whole
//! run, each with nodes 0 and 1 on subnet 1 and node 2 on subnet 2 (behind the underlay
//! namespace's router):
//! - **calix eBPF** and **calix kernel**: release agents with that dataplane, etcd, route
//!   distribution over mutual TLS; pods wired by the real `calix` plugin. Node 0 → node 1 is
//!   the direct route (same subnet), node 0 → node 2 goes through `vxlan.calix` (the pools'
//!   default `crossSubnet`);
//! - **plain**: no calix at all. Node 0 → node 1 between the node namespaces' own `eth0`
//!   addresses is the **underlay** (the ceiling: no pod, no veth, no forwarding); node 0 →
//!   node 2 is **plain VXLAN**: a `flannel.1`-style VXLAN device on each node (no learning,
//!   static forwarding entry and neighbour, routes `via <vtep> onlink`), pods as plain veth
//!   pairs routed by the node (MTU 1450, as calix's pods get), the kernel forwarding.
//!
//! The test bed's traffic tools measure client → server per repetition and variant: TCP_CRR,
//! TCP_RR and iperf3, client and servers pinned to one CPU, the client node's
//! `IpForwDatagrams` read around them; variants interleaved (order rotated every repetition).
//! Before the measurements, an untimed TCP_CRR run per variant shows the path: both nodes'
//! forwarded datagrams per connection, and for the eBPF variants the kernel's run time of every
//! calix program on both nodes (`kernel.bpf_stats_enabled`, per program id). Everything is
//! named `cxb-<pid>-…` and removed on drop, on error and Ctrl-C too. Writes
//! docs/bench/crossnode.md and .svg (with `--quick`, target/bench/ instead).
use std::net::Ipv4Addr;
use std::path::Path;

use anyhow::{Context, Result};
use calix_testbed::bpf::{attached, run_time_by_id, Attached};
use calix_testbed::tls::Ca;
use calix_testbed::traffic::netperf::Mode;
use calix_testbed::traffic::{nstat, Tools, Traffic, IPERF_NICE, TW_REUSE_DELAY};
use calix_testbed::{veth, Cluster, Dataplane, Guarded, Netns, Plugin};
use plotters::style::RGBColor;
use serde_json::json;

use super::chart::{self, traffic_chart, traffic_title};
use super::harness::{check_interrupted, repetitions, version, warm_up, Bench, Compared, Machine};
use super::report::{
    busy_note_of, fmt_0, fmt_1, fmt_2, heading, median, ratio, targets, traffic_table,
    Traffic as Samples, RATIOS_NOTE,
};

/// Node 0 and 1 on subnet 1, node 2 on subnet 2.
const SUBNETS: [u8; 3] = [1, 1, 2];
const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\n";
/// The untimed TCP_CRR run that shows each variant's path.
const PATH_SECS: f64 = 2.0;
/// The plain VXLAN: the device's name, VNI and port, and the MTU of its pods (calix's: the
/// uplink's 1500 less IPv4 VXLAN's 50).
const PLAIN_DEV: &str = "flannel.1";
const PLAIN_VNI: u32 = 1;
const VXLAN_PORT: u16 = 4789;
const PLAIN_MTU: u32 = 1450;
const CA_NAME: &str = "calix-bench-ca";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Underlay,
    Kernel,
    Ebpf,
    KernelVxlan,
    EbpfVxlan,
    PlainVxlan,
}

const VARIANTS: [Variant; 6] = [
    Variant::Underlay,
    Variant::Kernel,
    Variant::Ebpf,
    Variant::KernelVxlan,
    Variant::EbpfVxlan,
    Variant::PlainVxlan,
];

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Underlay => ("underlay (node to node)", "und", chart::GREY),
            Self::Kernel => ("calix kernel", "kern", chart::GREEN),
            Self::Ebpf => ("calix eBPF", "ebpf", chart::BLUE),
            Self::KernelVxlan => ("calix kernel, VXLAN", "kvx", chart::LIGHT_GREEN),
            Self::EbpfVxlan => ("calix eBPF, VXLAN", "evx", chart::LIGHT_BLUE),
            Self::PlainVxlan => ("plain VXLAN (flannel-like)", "pvx", chart::ORANGE),
        }
    }
}

impl Variant {
    /// The server's node in its cluster (the client is always on node 0).
    fn server_node(self) -> usize {
        match self {
            Self::Underlay | Self::Kernel | Self::Ebpf => 1,
            _ => 2,
        }
    }

    fn ebpf(self) -> bool {
        matches!(self, Self::Ebpf | Self::EbpfVxlan)
    }
}

/// The three clusters, and every pod; removed when dropped (pods first).
struct Beds {
    pods: Vec<Netns>,
    ebpf: Cluster,
    kernel: Cluster,
    plain: Cluster,
}

impl Beds {
    fn cluster(&self, v: Variant) -> &Cluster {
        match v {
            Variant::Ebpf | Variant::EbpfVxlan => &self.ebpf,
            Variant::Kernel | Variant::KernelVxlan => &self.kernel,
            Variant::Underlay | Variant::PlainVxlan => &self.plain,
        }
    }
}

/// One variant's servers and traffic; the servers stop when dropped.
struct Topology {
    traffic: Traffic,
    /// The client's and the server's node namespaces.
    nodes: [Netns; 2],
    _servers: Vec<Guarded>,
}

fn calix_cluster(b: &Bench, ca: &Ca, tag: &str, dataplane: Dataplane) -> Result<Cluster> {
    let mut c = Cluster::launch_with(
        || b.name(&format!("{tag}-u")),
        |i| b.name(&format!("{tag}-n{i}")),
        b.spec(dataplane),
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
fn build(b: &Bench, ca: &Ca, tools: &Tools) -> Result<(Beds, Vec<Topology>)> {
    println!("[setup] calix eBPF cluster (3 nodes)");
    let ebpf = calix_cluster(b, ca, "e", Dataplane::Ebpf)?;
    println!("[setup] calix kernel cluster (3 nodes)");
    let kernel = calix_cluster(b, ca, "k", Dataplane::Kernel)?;
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
    };
    let conf = json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } });
    // Declared after the clusters: dropped before them on an error.
    let mut pods = Vec::new();
    let mut topo = Vec::new();
    for v in VARIANTS {
        check_interrupted()?;
        let tag = v.tag();
        let c = beds.cluster(v);
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
                let plugin = |i: usize| {
                    let n = &c.nodes[i];
                    Plugin::new(
                        v.label(),
                        b.bins.join("calix"),
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

/// One BPF program (one id: one node's, on every device it is attached to) that ran.
struct Prog {
    /// 0: the client's node, 1: the server's.
    node: usize,
    name: String,
    /// `dev/hook` of each attachment.
    at: Vec<String>,
    runs: u64,
    ns: u64,
}

/// What the untimed runs showed of a variant's path.
#[derive(Default)]
struct PathRun {
    /// Connections made in the TCP_CRR run.
    conns: f64,
    /// IpForwDatagrams per connection on the client's and the server's node.
    fwd: [f64; 2],
    /// The eBPF variants' programs that ran during TCP_CRR.
    progs: Vec<Prog>,
    /// The eBPF variants' programs' run time per round trip of a TCP_RR run (ns).
    rr_bpf_ns: f64,
    /// The bench CPU's time by symbol during TCP_CRR (%, symbol).
    profile: Vec<(f64, String)>,
}

impl PathRun {
    /// BPF run time per connection (ns).
    fn bpf_per_conn(&self) -> f64 {
        self.progs.iter().map(|p| p.ns as f64).sum::<f64>() / self.conns.max(1.0)
    }
}

/// The untimed runs of variant `v`: TCP_CRR with both nodes' forwarding counted and (eBPF
/// variants) the BPF statistics on; for the eBPF variants TCP_RR with the statistics on; then
/// TCP_CRR again with `perf` sampling the bench CPU.
fn path(b: &Bench, tools: &Tools, t: &Topology, v: Variant) -> Result<PathRun> {
    let fwd = |n: &Netns| nstat(n, "IpForwDatagrams");
    let before = [fwd(&t.nodes[0])?, fwd(&t.nodes[1])?];
    let mut attachments: Vec<(usize, Attached)> = Vec::new();
    if v.ebpf() {
        for (k, n) in t.nodes.iter().enumerate() {
            attachments.extend(attached(n)?.into_iter().map(|a| (k, a)));
        }
    }
    // One program id per (node, program): attached to several devices, it counts once.
    let mut progs: Vec<Prog> = Vec::new();
    let mut ids: Vec<u64> = Vec::new();
    for (k, a) in attachments {
        let at = format!("{}/{}", a.dev, a.hook);
        match ids.iter().position(|&id| id == a.id) {
            Some(i) => progs[i].at.push(at),
            None => {
                ids.push(a.id);
                progs.push(Prog {
                    node: k,
                    name: a.name,
                    at: vec![at],
                    runs: 0,
                    ns: 0,
                });
            }
        }
    }
    let mut conns = 0.0;
    let stats = run_time_by_id(&ids, || {
        conns = tools.netperf(&t.traffic, Mode::Crr, PATH_SECS)?.count;
        Ok::<_, anyhow::Error>(())
    })?;
    let after = [fwd(&t.nodes[0])?, fwd(&t.nodes[1])?];
    for (p, (ns, runs)) in progs.iter_mut().zip(stats) {
        (p.ns, p.runs) = (ns, runs);
    }
    progs.retain(|p| p.runs > 0);
    let mut rr_bpf_ns = f64::NAN;
    if v.ebpf() {
        let mut trips = 0.0;
        let rr = run_time_by_id(&ids, || {
            trips = tools.netperf(&t.traffic, Mode::Rr, PATH_SECS)?.count;
            Ok::<_, anyhow::Error>(())
        })?;
        rr_bpf_ns = rr.iter().map(|x| x.0 as f64).sum::<f64>() / f64::max(trips, 1.0);
    }
    // Profiled apart: the BPF statistics' clock reads would show in the profile.
    let softirqd = format!("ksoftirqd/{}", b.cpu);
    let data = b.dir.join(format!("{}.perf.data", v.tag()));
    let profile = super::profile::profile(b.cpu, &["xtask", &softirqd], &data, || {
        tools.netperf(&t.traffic, Mode::Crr, PATH_SECS)?;
        Ok(())
    });
    let _ = std::fs::remove_file(&data);
    let per = |k: usize| (after[k] - before[k]) / f64::max(conns, 1.0);
    Ok(PathRun {
        conns,
        fwd: [per(0), per(1)],
        progs,
        rr_bpf_ns,
        profile: profile?,
    })
}

pub fn run(reps: usize, secs: u64, quick: bool) -> Result<()> {
    let b = Bench::setup(
        "the cross-node benchmark",
        &[
            "iperf3", "nstat", "sysctl", "bpftool", "bridge", "etcd", "perf",
        ],
        &[],
    )?;
    let ca = Ca::new(CA_NAME)?;
    let tools = b.tools();
    let (beds, topo) = build(&b, &ca, &tools)?;
    let mut paths = Vec::new();
    for (v, t) in VARIANTS.iter().zip(&topo) {
        check_interrupted()?;
        let p = path(&b, &tools, t, *v).with_context(|| format!("{}: the path", v.label()))?;
        println!(
            "[setup] {}: path over {:.0} connections: IpForwDatagrams per connection {:.2} \
             (client node) {:.2} (server node){}",
            v.label(),
            p.conns,
            p.fwd[0],
            p.fwd[1],
            if p.progs.is_empty() {
                String::new()
            } else {
                format!(
                    ", BPF {:.0} ns per connection, {:.0} ns per TCP_RR round trip",
                    p.bpf_per_conn(),
                    p.rr_bpf_ns
                )
            }
        );
        paths.push(p);
    }
    let mut res: [Samples; 6] = Default::default();
    repetitions(reps, &VARIANTS, |v| {
        let t = &topo[v as usize];
        let m = tools.measure(&t.traffic, secs, Some(&t.nodes[0]), false)?;
        Ok(res[v as usize].push(&m))
    })?;
    drop(topo);
    drop(beds);
    b.done();
    let report = Report {
        reps,
        secs,
        quick,
        cpu: b.cpu,
        tw_delay: Path::new(TW_REUSE_DELAY).exists(),
        iperf_version: version("iperf3"),
        res,
        paths,
        bench: b,
    };
    Bench::publish("crossnode", &report.markdown(), quick, |p| {
        chart(p, &report)
    })
}

// --- report --------------------------------------------------------------------------------

struct Report {
    reps: usize,
    secs: u64,
    quick: bool,
    cpu: usize,
    tw_delay: bool,
    iperf_version: String,
    res: [Samples; 6],
    paths: Vec<PathRun>,
    bench: Bench,
}

impl Report {
    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    fn machine(&self) -> &Machine {
        &self.bench.machine
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let m = |v: Variant, f: fn(&Samples) -> &Vec<f64>| median(f(self.get(v)));
        let (ec, kc) = (m(Variant::Ebpf, |s| &s.crr), m(Variant::Kernel, |s| &s.crr));
        let (el, kl) = (
            m(Variant::Ebpf, |s| &s.rr_p50),
            m(Variant::Kernel, |s| &s.rr_p50),
        );
        let (eg, kg) = (
            m(Variant::Ebpf, |s| &s.gbps),
            m(Variant::Kernel, |s| &s.gbps),
        );
        let (vc, pc) = (
            m(Variant::EbpfVxlan, |s| &s.crr),
            m(Variant::PlainVxlan, |s| &s.crr),
        );
        vec![
            (
                format!(
                    "calix eBPF ≥ 1.10× calix kernel conn/s: {} vs {} ({})",
                    fmt_0(ec),
                    fmt_0(kc),
                    ratio(ec, kc)
                ),
                Some(ec >= 1.10 * kc),
            ),
            (
                format!(
                    "calix eBPF TCP_RR p50 ≤ 0.9× calix kernel's: {} µs vs {} µs ({})",
                    fmt_1(el),
                    fmt_1(kl),
                    ratio(el, kl)
                ),
                Some(el <= 0.9 * kl),
            ),
            (
                format!(
                    "calix VXLAN (eBPF) ≥ 1.0× plain VXLAN conn/s: {} vs {} ({})",
                    fmt_0(vc),
                    fmt_0(pc),
                    ratio(vc, pc)
                ),
                Some(vc >= pc),
            ),
            (
                format!(
                    "calix eBPF throughput ≥ 0.95× calix kernel's: {} vs {} Gbit/s ({})",
                    fmt_1(eg),
                    fmt_1(kg),
                    ratio(eg, kg)
                ),
                Some(eg >= 0.95 * kg),
            ),
        ]
    }

    fn markdown(&self) -> String {
        let m = self.machine();
        let mut s = heading(
            "Cross-node pod to pod: calix kernel, eBPF and VXLAN vs the underlay and plain VXLAN",
            self.quick,
        );
        s.push_str(&format!(
            "{}: release build, `calix-agent --dataplane ebpf` / `kernel`, etcd, route \
             distribution over mutual TLS, pods wired by the `calix` CNI plugin; {}.\n\n",
            self.bench.measured(&format!(
                "crossnode --reps {} --secs {}",
                self.reps, self.secs
            )),
            self.iperf_version,
        ));
        s.push_str(&format!(
            "Three clusters of the test bed, built before the first measurement: nodes 0 and 1 \
             on one subnet, node 2 on another behind the underlay namespace's router; every \
             node's uplink a veth into the underlay's bridge of its subnet. The client is on \
             node 0. **underlay**: node 0's namespace → node 1's `eth0` address, no calix (the \
             ceiling). **calix kernel** / **calix eBPF**: pod on node 0 → pod on node 1 (the \
             direct route `<block> via <node 1>`). **calix kernel, VXLAN** / **calix eBPF, \
             VXLAN**: pod on node 0 → pod on node 2 through `vxlan.calix` (`crossSubnet`). \
             **plain VXLAN**: no calix; node 0 → node 2 through a `{PLAIN_DEV}` VXLAN device per \
             node as flannel makes it (VNI {PLAIN_VNI}, port {VXLAN_PORT}, `nolearning`, the \
             peer's VTEP as a permanent neighbour and forwarding entry, `<pod subnet> via \
             <VTEP> onlink`), pods on plain veth pairs routed by the node, MTU {PLAIN_MTU} like \
             calix's pods. Per variant and repetition, each {} s long, client and server pinned \
             to CPU {} (so the whole path, both nodes' softirqs included, runs on that CPU): \
             **TCP_CRR** (`xtask netperf crr`; client ports 1024–65535 with `tcp_tw_reuse=1`{}), \
             **TCP_RR** (`xtask netperf rr`, p50/p99 of every round trip) and **throughput** \
             (`iperf3 -C cubic -t {}`, one stream, receiver at nice {IPERF_NICE}). {} \
             repetitions, variants interleaved (order rotated every repetition); median \
             [min–max] over repetitions.\n\n",
            self.secs,
            self.cpu,
            if self.tw_delay {
                " and `tcp_tw_reuse_delay=1` ms"
            } else {
                ""
            },
            self.secs,
            self.reps,
        ));
        let row = |v: Variant| (v.label(), self.get(v));
        s.push_str(&traffic_table(
            VARIANTS.map(row),
            [
                (Variant::Ebpf, Variant::Kernel),
                (Variant::EbpfVxlan, Variant::PlainVxlan),
                (Variant::KernelVxlan, Variant::PlainVxlan),
                (Variant::EbpfVxlan, Variant::KernelVxlan),
                (Variant::Ebpf, Variant::Underlay),
                (Variant::Kernel, Variant::Underlay),
                (Variant::EbpfVxlan, Variant::Underlay),
                (Variant::PlainVxlan, Variant::Underlay),
            ]
            .map(|(a, b)| (row(a), row(b))),
        ));
        s.push_str(RATIOS_NOTE);
        s.push_str(&targets(
            "Targets (issue 13, medians):",
            &self.targets(),
            "",
        ));
        s.push_str(&self.where_time_goes());
        s.push_str(&busy_note_of(self.cpu, m.cpus, &self.res));
        s.push_str("\n![crossnode chart](crossnode.svg)\n");
        s
    }

    fn path(&self, v: Variant) -> &PathRun {
        &self.paths[v as usize]
    }

    /// The paths: forwarding per connection, the BPF programs' run time, the CPU's profile,
    /// and what the missed targets would take.
    fn where_time_goes(&self) -> String {
        let mut s = format!(
            "\n## Where the time goes\n\nAn untimed {PATH_SECS} s TCP_CRR run per variant before \
             the measurements (then, for the eBPF variants, an untimed TCP_RR run). \
             IpForwDatagrams per connection (`nstat`, both nodes; a TCP_CRR connection is \
             about 5 packets each way, so ~10 per node means the node's IP stack forwarded \
             every packet):\n\n\
             | variant | connections | client node | server node |\n|---|---|---|---|\n"
        );
        for v in VARIANTS {
            let p = self.path(v);
            s.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                v.label(),
                fmt_0(p.conns),
                fmt_2(p.fwd[0]),
                fmt_2(p.fwd[1])
            ));
        }
        s.push_str(
            "\nThe eBPF variants' programs during the TCP_CRR run (kernel BPF statistics, \
             `kernel.bpf_stats_enabled`, per program id: each node's agent loads its own \
             programs, and one program attached to several devices counts once, over all of \
             them; every program that ran; run times include the statistics' own two clock \
             reads per run):\n\n\
             | variant | node | program | attached to | runs per connection | ns per run | ns \
             per connection |\n|---|---|---|---|---|---|---|\n",
        );
        for v in VARIANTS.into_iter().filter(|v| v.ebpf()) {
            let p = self.path(v);
            let conns = p.conns.max(1.0);
            for x in &p.progs {
                let at: Vec<String> = x
                    .at
                    .iter()
                    .map(|a| match a.strip_prefix("cali") {
                        Some(rest) => format!("cali…/{}", rest.rsplit('/').next().unwrap_or("")),
                        None => a.clone(),
                    })
                    .collect();
                let mut at = at;
                at.dedup();
                s.push_str(&format!(
                    "| {} | {} | `{}` | {} | {} | {} | {} |\n",
                    v.label(),
                    if x.node == 0 { "client's" } else { "server's" },
                    x.name,
                    at.join(", "),
                    fmt_1(x.runs as f64 / conns),
                    fmt_0(x.ns as f64 / x.runs as f64),
                    fmt_0(x.ns as f64 / conns),
                ));
            }
            let conn_us = 1e6 / median(&self.get(v).crr);
            s.push_str(&format!(
                "| {} | both | **all** | | | | **{} ns of a connection's {} µs ({:.0} %); {} ns \
                 per TCP_RR round trip** |\n",
                v.label(),
                fmt_0(p.bpf_per_conn()),
                fmt_1(conn_us),
                100.0 * p.bpf_per_conn() / 1e3 / conn_us,
                fmt_0(p.rr_bpf_ns),
            ));
        }
        s.push_str(&self.what_would_reach());
        s.push_str(&format!(
            "\n<details><summary>The bench CPU's time by symbol during a third untimed TCP_CRR \
             run (`perf record -e cpu-clock` on CPU {}, the BPF statistics off; samples of the \
             bench's processes and the CPU's softirq thread; the 20 largest symbols of at least \
             0.5 %)</summary>\n\n",
            self.cpu
        ));
        for v in VARIANTS {
            s.push_str(&format!("**{}**:", v.label()));
            let top: Vec<String> = self
                .path(v)
                .profile
                .iter()
                .take(20)
                .map(|(share, sym)| format!(" {share:.1} % `{sym}`"))
                .collect();
            s.push_str(&top.join(","));
            s.push_str("\n\n");
        }
        s.push_str("</details>\n");
        s
    }

    /// For each missed target, what the BPF programs' time would have to come down to, all
    /// else equal.
    fn what_would_reach(&self) -> String {
        let conn_us = |v: Variant| 1e6 / median(&self.get(v).crr);
        let rr_us = |v: Variant| median(&self.get(v).rr_p50);
        let mut lines = Vec::new();
        let mut need = |what: &str, now_us: f64, goal_us: f64, bpf_ns: f64, per: &str| {
            let cut = (now_us - goal_us) * 1e3;
            if cut > 0.0 {
                lines.push(format!(
                    "- {what}: {} µs {per} now, {} µs needed: {} ns less, i.e. the programs at \
                     {} ns instead of {} ns {per} ({:.0} % less), everything else equal.",
                    fmt_2(now_us),
                    fmt_2(goal_us),
                    fmt_0(cut),
                    fmt_0(bpf_ns - cut),
                    fmt_0(bpf_ns),
                    100.0 * cut / bpf_ns
                ));
            }
        };
        let e = self.path(Variant::Ebpf);
        need(
            "eBPF ≥ 1.10× kernel conn/s",
            conn_us(Variant::Ebpf),
            conn_us(Variant::Kernel) / 1.10,
            e.bpf_per_conn(),
            "per connection",
        );
        need(
            "eBPF TCP_RR p50 ≤ 0.9× kernel's",
            rr_us(Variant::Ebpf),
            0.9 * rr_us(Variant::Kernel),
            e.rr_bpf_ns,
            "per round trip",
        );
        need(
            "calix VXLAN ≥ 1.0× plain VXLAN conn/s",
            conn_us(Variant::EbpfVxlan),
            conn_us(Variant::PlainVxlan),
            self.path(Variant::EbpfVxlan).bpf_per_conn(),
            "per connection",
        );
        if lines.is_empty() {
            return String::new();
        }
        format!(
            "\nWhat the missed targets would take, from the medians above (a connection's time \
             is 1 / conn/s on the one CPU that runs the whole path):\n\n{}\n",
            lines.join("\n")
        )
    }
}

fn chart(path: &Path, r: &Report) -> Result<()> {
    let title = traffic_title("Cross-node pod to pod", r.reps, r.secs, &r.machine().date);
    let variants = VARIANTS.map(|v| (v.label(), v.color(), Some(r.get(v))));
    traffic_chart(path, (1300, 480), &title, &variants)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::render;

    #[test]
    fn the_report_renders() {
        let reps = 3;
        let res = [1.5, 1.0, 1.1, 0.8, 0.9, 0.85].map(|k| Samples::fake(k, reps));
        let paths = VARIANTS
            .iter()
            .map(|v| PathRun {
                conns: 50_000.0,
                fwd: if v.ebpf() { [0.0, 0.0] } else { [10.0, 10.0] },
                progs: if v.ebpf() {
                    vec![Prog {
                        node: 0,
                        name: "from_pod".into(),
                        at: vec!["cali1234/tcx_ingress".into()],
                        runs: 250_000,
                        ns: 25_000_000,
                    }]
                } else {
                    Vec::new()
                },
                rr_bpf_ns: if v.ebpf() { 900.0 } else { f64::NAN },
                profile: vec![(12.5, "tcp_v4_rcv".into()), (3.0, "bpf_prog_run".into())],
            })
            .collect();
        let r = Report {
            reps,
            secs: 3,
            quick: true,
            cpu: 1,
            tw_delay: false,
            iperf_version: "iperf 3.18".into(),
            res,
            paths,
            bench: Bench::fake(),
        };
        let md = r.markdown();
        let svg = render("crossnode", &md, |p| chart(p, &r));
        assert!(md.starts_with("# Cross-node pod to pod"));
        assert!(md.contains("## Where the time goes"));
        assert!(svg.contains("plain VXLAN (flannel-like)"));
    }
}
