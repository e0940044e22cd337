//! The untimed runs that show each variant's path: forwarding, the BPF programs' run time, the
//! CPU's profile.
use anyhow::Result;
use calix_testbed::bpf::{attached, run_time_by_id, Attached};
use calix_testbed::traffic::netperf::Mode;
use calix_testbed::traffic::{nstat, Tools};
use calix_testbed::Netns;

use super::topology::Topology;
use super::{Variant, PATH_SECS};
use crate::bench::harness::{Bench, Compared};

/// One BPF program (one id: one node's, on every device it is attached to) that ran.
pub(super) struct Prog {
    /// 0: the client's node, 1: the server's.
    pub(super) node: usize,
    pub(super) name: String,
    /// `dev/hook` of each attachment.
    pub(super) at: Vec<String>,
    pub(super) runs: u64,
    pub(super) ns: u64,
}

/// What the untimed runs showed of a variant's path.
#[derive(Default)]
pub(super) struct PathRun {
    /// Connections made in the TCP_CRR run.
    pub(super) conns: f64,
    /// IpForwDatagrams per connection on the client's and the server's node.
    pub(super) fwd: [f64; 2],
    /// The eBPF variants' programs that ran during TCP_CRR.
    pub(super) progs: Vec<Prog>,
    /// The eBPF variants' programs' run time per round trip of a TCP_RR run (ns).
    pub(super) rr_bpf_ns: f64,
    /// The bench CPU's time by symbol during TCP_CRR (%, symbol).
    pub(super) profile: Vec<(f64, String)>,
}

impl PathRun {
    /// BPF run time per connection (ns).
    pub(super) fn bpf_per_conn(&self) -> f64 {
        self.progs.iter().map(|p| p.ns as f64).sum::<f64>() / self.conns.max(1.0)
    }
}

/// The untimed runs of variant `v`: TCP_CRR with both nodes' forwarding counted and (eBPF
/// variants) the BPF statistics on; for the eBPF variants TCP_RR with the statistics on; then
/// TCP_CRR again with `perf` sampling the bench CPU.
pub(super) fn path(b: &Bench, tools: &Tools, t: &Topology, v: Variant) -> Result<PathRun> {
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
    let profile = crate::bench::profile::profile(b.cpu, &["xtask", &softirqd], &data, || {
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
