//! `cargo xtask bench <scenario>`: benchmarks on this machine, the way DESIGN.md §10 says gives
//! stable numbers: release binaries, every variant built side by side and interleaved
//! (repetitions outer, variants inner), medians with [min–max] over repetitions, the load
//! average recorded before each variant. Results go to stdout and to docs/bench/<scenario>.md.
//!
//! Each scenario's file holds its topology (what it wires, on the calix-testbed test bed, which
//! also takes the traffic measurements) and its report; `harness` and `report` hold what they
//! share.
mod baseline;
mod bgp;
mod chart;
mod cni;
mod crossnode;
mod dataplane;
mod harness;
mod ipam;
mod policy;
mod profile;
mod report;
mod routes;
mod routewatch;
mod services;
mod snat;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use calix_testbed::traffic::netperf;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Scenario {
    /// CNI ADD/DEL latency (p50, p99) and 20/50 concurrent ADDs: calix (release, eBPF agent)
    /// against Debian's ptp + host-local, next to the floors (`/bin/true`, `ip link del`).
    Cni {
        /// Pods per variant and repetition (sequential ADDs, then sequential DELs).
        #[arg(long, default_value_t = 200)]
        pods: usize,
        /// Repetitions (each runs every variant once, in alternating order).
        #[arg(long, default_value_t = 4)]
        reps: usize,
        /// Also run calix (plugin and agent) built from this git revision (under
        /// target/baseline/), as a third variant, and report this build against it.
        #[arg(long, value_name = "REV")]
        baseline: Option<String>,
    },
    /// IPAM allocations per second: calix-agent over gRPC with the embedded and the etcd
    /// datastore, against Debian's host-local plugin (a process per allocation).
    Ipam {
        /// Allocations per variant, phase and repetition.
        #[arg(long, default_value_t = 1000)]
        allocs: usize,
        /// Repetitions (each runs every variant once, in alternating order).
        #[arg(long, default_value_t = 4)]
        reps: usize,
    },
    /// Same-node pod-to-pod performance: calix eBPF and kernel mode against Debian's bridge
    /// plugin and a raw veth pair: connections/s (TCP_CRR), TCP_RR latency, iperf3 throughput,
    /// and the node's IpForwDatagrams.
    Dataplane {
        #[command(flatten)]
        run: TrafficArgs,
        /// Also run calix eBPF built from this git revision (its agent and static plugin,
        /// under target/baseline/) as one more variant, and report this build against it.
        #[arg(long, value_name = "REV")]
        baseline: Option<String>,
    },
    /// Routes between nodes (issue 13): a new pod's way to two other nodes (3 real nodes, a
    /// new block and a borrowed address), and one agent taking 100 simulated peers × 100
    /// blocks (mesh, reflector): time to the kernel, RSS, CPU.
    Routes {
        /// Pods per convergence variant [default: 200; 20 with --quick].
        #[arg(long)]
        pods: Option<usize>,
        /// Repetitions of the scale part (each runs both topologies) [default: 3; 1 with
        /// --quick].
        #[arg(long)]
        reps: Option<usize>,
        /// Development mode: 20 pods, 1 repetition, results in target/bench/.
        #[arg(long)]
        quick: bool,
        /// Also run the scale part with the agent of this git revision (built in release
        /// mode under target/baseline/), interleaved, and report this build against it.
        #[arg(long, value_name = "REV")]
        baseline: Option<String>,
    },
    /// Pod to pod across nodes: calix kernel, eBPF and VXLAN in both, against the underlay
    /// (node to node, the ceiling) and a plain kernel VXLAN device with static routes
    /// (flannel's way): conn/s (TCP_CRR), TCP_RR, iperf3 throughput, and where the time goes.
    Crossnode {
        #[command(flatten)]
        run: TrafficArgs,
        /// Also run a calix eBPF cluster built from this git revision (its agent and static
        /// plugin, under target/baseline/): two more variants, this build reported against it.
        #[arg(long, value_name = "REV")]
        baseline: Option<String>,
    },
    /// NetworkPolicy in calix eBPF, on nodes in Kubernetes mode (a real kube-apiserver): the
    /// programs' cost per packet and same-node conn/s with 10, 100 and 1,000 rules against no
    /// policy; programming latency on 3 nodes (a policy written, a label changed); one agent
    /// facing 10,000 pods and 1,000 policies (time to program, RSS, one change).
    Policy {
        #[command(flatten)]
        run: TrafficArgs,
        /// Changes of each kind (policy, label) for the latency [default: 100; 10 with
        /// --quick].
        #[arg(long)]
        changes: Option<usize>,
        /// Pods cluster-wide at scale (a tenth as many policies) [default: 10000; 1000 with
        /// --quick].
        #[arg(long)]
        scale_pods: Option<usize>,
    },
    /// BGP (issue 23): 10,000 prefixes to a BIRD router from calix's speaker against from
    /// another BIRD (until all are held, until a withdrawal is seen); the agent's CPU and RSS
    /// with 4 BGP peers against BGP off; a pod's ADD on a new block until it is reachable from
    /// outside through the router.
    Bgp {
        /// Repetitions of the 10,000 prefixes, both senders each [default: 20; 3 with
        /// --quick].
        #[arg(long)]
        prefix_reps: Option<usize>,
        /// Clusters of the CPU and RSS part [default: 3; 1 with --quick].
        #[arg(long)]
        idle_reps: Option<usize>,
        /// Seconds each of those is measured idle [default: 30; 5 with --quick].
        #[arg(long)]
        idle_secs: Option<u64>,
        /// Pods of the new-block part [default: 100; 20 with --quick].
        #[arg(long)]
        pods: Option<usize>,
        /// Development mode: the smaller defaults, results in target/bench/.
        #[arg(long)]
        quick: bool,
    },
    /// Pod → outside through calix eBPF SNAT against iptables/nftables MASQUERADE and routing
    /// without NAT (conn/s, TCP_RR, iperf3), and the XDP deny list's CPU per dropped packet
    /// against nftables drop rules.
    Snat {
        #[command(flatten)]
        run: TrafficArgs,
        /// TOML appended to the calix SNAT node's agent config (e.g. a `[nat]` section).
        #[arg(long)]
        snat_config: Option<PathBuf>,
    },
    /// Services (issue 24): calix eBPF (socket translation) against kube-proxy in iptables and
    /// nftables mode, one node each of one API server, at 10, 1,000 and 10,000 Services:
    /// pod → ClusterIP conn/s and TCP_RR, a change until it takes effect (p50, p99), the RSS
    /// and CPU of what programs Services.
    Services {
        #[command(flatten)]
        run: TrafficArgs,
        /// Changes timed per stage, on every variant [default: 20; 5 with --quick].
        #[arg(long)]
        changes: Option<usize>,
        /// Services cluster-wide at each stage [default: 10,1000,10000; 10,1000 with --quick].
        #[arg(long, value_delimiter = ',')]
        stages: Option<Vec<usize>>,
    },
}

/// The traffic benches' repetitions, durations and mode.
#[derive(clap::Args)]
pub struct TrafficArgs {
    /// Repetitions (each runs every variant once, in rotating order) [default: 6; 2 with
    /// --quick].
    #[arg(long)]
    reps: Option<usize>,
    /// Seconds per measurement (TCP_CRR, TCP_RR, iperf3 each) [default: 3; 1 with --quick].
    #[arg(long)]
    secs: Option<u64>,
    /// Development mode: 2 repetitions of 1 s, results in target/bench/ (numbers not worth
    /// publishing).
    #[arg(long)]
    quick: bool,
}

impl TrafficArgs {
    /// Repetitions and seconds (each at least 1), and whether it is a development run.
    fn resolve(&self) -> Result<(usize, u64, bool)> {
        let (r, s) = if self.quick { (2, 1) } else { (6, 3) };
        let (reps, secs) = (self.reps.unwrap_or(r), self.secs.unwrap_or(s));
        anyhow::ensure!(
            reps >= 1 && secs >= 1,
            "--reps and --secs must be at least 1"
        );
        Ok((reps, secs, self.quick))
    }
}

pub fn run(scenario: Scenario) -> Result<()> {
    crate::util::ensure_bpffs()?;
    match scenario {
        Scenario::Cni {
            pods,
            reps,
            baseline,
        } => cni::run(pods, reps, baseline.as_deref()),
        Scenario::Ipam { allocs, reps } => ipam::run(allocs, reps),
        Scenario::Dataplane { run, baseline } => {
            let (reps, secs, quick) = run.resolve()?;
            dataplane::run(reps, secs, quick, baseline.as_deref())
        }
        Scenario::Crossnode { run, baseline } => {
            let (reps, secs, quick) = run.resolve()?;
            crossnode::run(reps, secs, quick, baseline.as_deref())
        }
        Scenario::Routes {
            pods,
            reps,
            quick,
            baseline,
        } => {
            let (p, r) = if quick { (20, 1) } else { (200, 3) };
            routes::run(
                pods.unwrap_or(p),
                reps.unwrap_or(r),
                quick,
                baseline.as_deref(),
            )
        }
        Scenario::Policy {
            run,
            changes,
            scale_pods,
        } => {
            let (reps, secs, quick) = run.resolve()?;
            let (c, p) = if quick { (10, 1000) } else { (100, 10_000) };
            policy::run(policy::Args {
                reps,
                secs,
                changes: changes.unwrap_or(c),
                scale_pods: scale_pods.unwrap_or(p),
                quick,
            })
        }
        Scenario::Bgp {
            prefix_reps,
            idle_reps,
            idle_secs,
            pods,
            quick,
        } => {
            let (r, i, t, p) = if quick {
                (3, 1, 5, 20)
            } else {
                (20, 3, 30, 100)
            };
            bgp::run(bgp::Args {
                prefix_reps: prefix_reps.unwrap_or(r),
                idle_reps: idle_reps.unwrap_or(i),
                idle_secs: idle_secs.unwrap_or(t),
                pods: pods.unwrap_or(p),
                quick,
            })
        }
        Scenario::Services {
            run,
            changes,
            stages,
        } => {
            let (reps, secs, quick) = run.resolve()?;
            let (c, st) = match quick {
                true => (5, vec![10, 1000]),
                false => (20, vec![10, 1000, 10_000]),
            };
            services::run(services::Args {
                reps,
                secs,
                changes: changes.unwrap_or(c),
                stages: stages.unwrap_or(st),
                quick,
            })
        }
        Scenario::Snat { run, snat_config } => {
            let (reps, secs, quick) = run.resolve()?;
            snat::run(reps, secs, quick, snat_config)
        }
    }
}

/// The request/response tool the traffic benches exec in their namespaces
/// ([`calix_testbed::traffic::netperf`]).
#[derive(Subcommand)]
pub enum Netperf {
    /// Serve 1-byte request/reply exchanges, one connection at a time, until killed.
    Server {
        #[arg(long)]
        listen: SocketAddr,
    },
    /// TCP_CRR: connect, 1-byte request, 1-byte reply, close, for `secs` seconds.
    Crr {
        #[command(flatten)]
        client: Client,
    },
    /// TCP_RR: 1-byte ping-pong on one connection for `secs` seconds.
    Rr {
        #[command(flatten)]
        client: Client,
    },
    /// Tries to connect until a try succeeds (the first must fail), for at most `secs`:
    /// prints `probing` after the first, then the wall-clock time of the success (ns since
    /// the epoch).
    Wait {
        #[command(flatten)]
        client: Client,
    },
}

#[derive(clap::Args)]
pub struct Client {
    #[arg(long)]
    to: SocketAddr,
    #[arg(long)]
    secs: f64,
    /// Join this cgroup v2 first (calix's socket programs translate Services there).
    #[arg(long)]
    cgroup: Option<PathBuf>,
}

pub fn netperf(mode: Netperf) -> Result<()> {
    let (mode, c) = match mode {
        Netperf::Server { listen } => return Ok(netperf::server(listen)?),
        Netperf::Crr { client } => (Some(netperf::Mode::Crr), client),
        Netperf::Rr { client } => (Some(netperf::Mode::Rr), client),
        Netperf::Wait { client } => (None, client),
    };
    if let Some(cg) = &c.cgroup {
        netperf::join_cgroup(cg)?;
    }
    let Some(mode) = mode else {
        let limit = std::time::Duration::from_secs_f64(c.secs.max(0.0));
        let at = netperf::first_connect(c.to, limit, || {
            use std::io::Write;
            println!("probing");
            let _ = std::io::stdout().flush();
        })?;
        println!("{}", at.duration_since(std::time::UNIX_EPOCH)?.as_nanos());
        return Ok(());
    };
    println!("{}", netperf::client(mode, c.to, c.secs)?.to_json());
    Ok(())
}
