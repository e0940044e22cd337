//! What the eBPF variants' programs and their attachment cost per packet, measured in each
//! repetition.
use anyhow::{Context, Result};
use calix_kernel::pod::HOST_VETH_MAC;
use calix_testbed::packets::{eth, udp_with, Ip4, ETH_P_IP, UDP};
use calix_testbed::traffic::cpu::task_cpu_ns;
use calix_testbed::traffic::flood::flood;
use calix_testbed::traffic::netperf::Mode;
use calix_testbed::traffic::{Tools, Traffic};
use calix_testbed::Node;

use super::{FLOOD_SECS, PROG_COST_SECS, SPOOFED};

/// What the pod-side programs cost per packet in one variant, per repetition: the kernel's BPF
/// run-time statistics (`kernel.bpf_stats_enabled`) over an untimed TCP_CRR run right after the
/// variant's measurements (the statistics add two clock reads per run, so never during one).
#[derive(Default)]
pub(super) struct Cost {
    /// `from_pod`'s ns per run.
    pub(super) from_pod_ns: Vec<f64>,
    pub(super) from_pod_runs: Vec<f64>,
    /// `to_pod`'s runs meanwhile: 0 when every packet took the fast path.
    pub(super) to_pod_runs: Vec<f64>,
}

impl Cost {
    pub(super) fn measure(
        &mut self,
        tools: &Tools,
        tr: &Traffic,
        pins: &[std::path::PathBuf],
    ) -> Result<String> {
        let rt = calix_testbed::bpf::pinned_run_time(pins, || {
            tools.netperf(tr, Mode::Crr, PROG_COST_SECS).map(drop)
        })
        .context("measuring the programs' run time")?;
        let (from, to) = (rt[0], rt[1]);
        let ns = from
            .ns_per_run
            .context("from_pod did not run during the cost measurement")?;
        self.from_pod_ns.push(ns);
        self.from_pod_runs.push(from.runs as f64);
        self.to_pod_runs.push(to.runs as f64);
        Ok(format!(
            ", from_pod {ns:.1} ns/packet over {} packets",
            from.runs
        ))
    }
}

/// What the attachment costs in one calix eBPF variant, per repetition: a flood of frames from
/// the client pod that `from_pod` drops (a spoofed source) — the pod's veth, its peer's
/// receive, the hook, the program up to its anti-spoofing check, the drop counter — timed as
/// the sender thread's CPU plus the bench CPU's ksoftirqd (a veth delivers on the sending
/// CPU), per dropped frame. The same program in both variants: the difference is tcx against
/// cls_bpf.
#[derive(Default)]
pub(super) struct Attach {
    pub(super) ns_per_packet: Vec<f64>,
    pub(super) mpps: Vec<f64>,
}

impl Attach {
    pub(super) fn measure(
        &mut self,
        node: &Node,
        tr: &Traffic,
        (cpu, ksoftirqd): (usize, Option<u32>),
    ) -> Result<String> {
        let mac = tr.client.mac("eth0")?;
        let payload = udp_with(9, 9, &[0; 18]);
        let ip = Ip4::new(SPOOFED, tr.server_ip.octets(), UDP, payload);
        let frame = eth(HOST_VETH_MAC, mac, ETH_P_IP, &ip.bytes());
        let dropped = || -> u64 {
            node.cali_links()
                .iter()
                .map(|l| node.dropped(l, "spoofed_source_v4"))
                .sum()
        };
        let d0 = dropped();
        let k0 = task_cpu_ns(ksoftirqd);
        let fl = flood(&tr.client, "eth0", cpu, frame, FLOOD_SECS)?;
        let k1 = task_cpu_ns(ksoftirqd);
        let drops = dropped().saturating_sub(d0) as f64;
        anyhow::ensure!(
            drops >= 0.9 * fl.sent as f64,
            "from_pod dropped {drops} of {} flooded frames",
            fl.sent
        );
        let ns = (fl.cpu_ns + k1 - k0) / drops;
        self.ns_per_packet.push(ns);
        self.mpps.push(drops / fl.secs / 1e6);
        Ok(format!(", flood {ns:.0} ns/packet"))
    }
}
