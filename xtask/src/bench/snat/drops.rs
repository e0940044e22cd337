//! The drop part: each filter's receiver, the flood's frames, and what the drops cost.
use std::process::Command;

use anyhow::{bail, Context, Result};
use calix_testbed::packets::{eth, udp_with, Ip4, ETH_P_IP, UDP};
use calix_testbed::traffic::cpu::{load_average, task_cpu_ns, CpuStat};
use calix_testbed::traffic::flood::flood;
use calix_testbed::{json, Dataplane, Netns, Node};
use serde_json::Value;

use super::topology::{agent_config, nft, uplinked};
use super::{
    Filter, DENY_CIDR, FLOOD_PORT, FLOOD_SRC, FLOOR_ETHERTYPE, NODE_UP, PEER_IF, UPLINK, XDP_REASON,
};
use crate::bench::harness::{Bench, Compared};

/// One drop filter's wiring.
pub(super) struct DropTopo {
    node: Node,
    pub(super) inet: Netns,
    pub(super) frame: Vec<u8>,
}

/// Builds filter `f`: node + uplink + internet, the calix agent with XDP or the nft rule.
pub(super) fn drop_topology(b: &Bench, f: Filter) -> Result<DropTopo> {
    let config = f
        .xdp_mode()
        .map(|mode| agent_config(true, false, Some(mode), None));
    let (node, inet) = uplinked(b, f.tag(), Dataplane::Ebpf, config)?;
    if f.xdp_mode().is_some() {
        node.agent().start(&[])?;
    }
    if let Some(mode) = f.xdp_mode() {
        let want = if mode == "native" { 1 } else { 2 };
        let v = json(Command::new("ip").args([
            "-n",
            &node.ns.name,
            "-j",
            "-d",
            "link",
            "show",
            "dev",
            UPLINK,
        ]))?;
        let got = v[0]["xdp"]["mode"].as_u64();
        if got != Some(want) {
            bail!("XDP on {UPLINK} attached in mode {got:?}, expected {want} ({mode})");
        }
    }
    // A set with interval flags: the same lookup structure for one CIDR as for many, like the
    // deny list's LPM trie.
    let set = format!(
        "  set deny {{\n    type ipv4_addr; flags interval;\n    elements = {{ {DENY_CIDR} }}\n  }}\n"
    );
    let rule = "ip saddr @deny counter drop";
    let chain = match f {
        Filter::NftIngress => Some(format!(
            "ingress {{\n    type filter hook ingress device {UPLINK:?} priority -500; policy accept;"
        )),
        Filter::NftPrerouting => Some("pre {\n    type filter hook prerouting priority raw; policy accept;".into()),
        _ => None,
    };
    if let (Some(table), Some(chain)) = (f.nft_table(), chain) {
        let rules = format!("table {table} {{\n{set}  chain {chain}\n    {rule}\n  }}\n}}\n");
        nft(b, &node.ns, &rules)?;
    }
    let ethertype = if f == Filter::Floor {
        FLOOR_ETHERTYPE
    } else {
        ETH_P_IP
    };
    let frame = flood_frame(node.ns.mac(UPLINK)?, inet.mac(PEER_IF)?, ethertype);
    Ok(DropTopo { node, inet, frame })
}

/// The flood's frame: 60 bytes of Ethernet + IPv4 + UDP from FLOOD_SRC to the node's UDP
/// discard port, 18 bytes of payload, the UDP checksum 0 (none, allowed over IPv4).
pub(super) fn flood_frame(dst: [u8; 6], src: [u8; 6], ethertype: u16) -> Vec<u8> {
    let udp = udp_with(40000, FLOOD_PORT, &[b'x'; 18]);
    let ip = Ip4::new(FLOOD_SRC.octets(), NODE_UP.octets(), UDP, udp).bytes();
    eth(dst, src, ethertype, &ip)
}

/// Packets the filter of `t` dropped so far (its own counter).
pub(super) fn dropped(f: Filter, t: &DropTopo) -> Result<f64> {
    if f.xdp_mode().is_some() {
        return Ok(t.node.agent().dropped(UPLINK, XDP_REASON)? as f64);
    }
    let ns = &t.node.ns;
    if f == Filter::Floor {
        let v = json(
            Command::new("ip").args(["-n", &ns.name, "-j", "-s", "link", "show", "dev", UPLINK]),
        )?;
        // An unhandled protocol counts as rx_dropped (rx_nohandler only for exact-match
        // deliveries); iproute2 leaves a key out while it is 0.
        let rx = &v[0]["stats64"]["rx"];
        return Ok(["dropped", "nohandler"]
            .iter()
            .filter_map(|k| rx[*k].as_f64())
            .sum());
    }
    let table = f.nft_table().context("a filter without a counter")?;
    let mut cmd = ns.command("nft")?;
    Ok(nft_counter(&json(
        cmd.args(["-j", "list", "table"]).args(table.split(' ')),
    )?))
}

/// The sum of every rule counter's packets in `nft -j` output.
pub(super) fn nft_counter(v: &Value) -> f64 {
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o["rule"]["expr"].as_array())
        .flatten()
        .filter_map(|e| e["counter"]["packets"].as_f64())
        .sum()
}

/// One filter over every repetition.
#[derive(Default)]
pub(super) struct DropSamples {
    pub(super) sent_rate: Vec<f64>,
    pub(super) drop_rate: Vec<f64>,
    /// Dropped by the filter / sent (%).
    pub(super) share: Vec<f64>,
    /// The bench CPU's softirq time per dropped packet (ns).
    pub(super) softirq_ns: Vec<f64>,
    /// The sender thread's and the bench CPU's ksoftirqd's CPU time (every receive softirq
    /// included) per dropped packet (ns).
    pub(super) total_ns: Vec<f64>,
    /// The share (%) of that CPU time ksoftirqd ran.
    pub(super) ksoftirqd: Vec<f64>,
    pub(super) load: Vec<f64>,
    pub(super) others_busy: Vec<f64>,
}

/// One flood of `secs` through filter `f`, recorded in `s`; its progress line.
pub(super) fn measure_drops(
    (cpu, ksoftirqd): (usize, Option<u32>),
    f: Filter,
    t: &DropTopo,
    secs: u64,
    s: &mut DropSamples,
) -> Result<String> {
    let load = load_average();
    let d0 = dropped(f, t)?;
    let cpu0 = CpuStat::read();
    let k0 = task_cpu_ns(ksoftirqd);
    let fl = flood(&t.inet, PEER_IF, cpu, t.frame.clone(), secs as f64)?;
    let k1 = task_cpu_ns(ksoftirqd);
    let cpu1 = CpuStat::read();
    let drops = dropped(f, t)? - d0;
    let (others, _) = cpu1.shares_since(&cpu0, cpu);
    if drops < 1.0 {
        bail!("{}: nothing dropped ({} frames sent)", f.label(), fl.sent);
    }
    let softirq_ns = cpu1.softirq_ns_since(&cpu0, cpu) / drops;
    let total_ns = (fl.cpu_ns + k1 - k0) / drops;
    let in_ksoftirqd = 100.0 * (k1 - k0) / (fl.cpu_ns + k1 - k0).max(1.0);
    let share = 100.0 * drops / (fl.sent.max(1) as f64);
    s.sent_rate.push(fl.sent as f64 / fl.secs);
    s.drop_rate.push(drops / fl.secs);
    s.share.push(share);
    s.softirq_ns.push(softirq_ns);
    s.total_ns.push(total_ns);
    s.ksoftirqd.push(in_ksoftirqd);
    s.load.push(load);
    s.others_busy.push(others);
    Ok(format!(
        "(load {load:.2}, other CPUs {others:.0}% busy): sent {:.2} Mpps, dropped {:.2} Mpps \
         ({share:.1}% of sent), softirq {softirq_ns:.0} ns/drop, sender+softirq {total_ns:.0} \
         ns/drop ({in_ksoftirqd:.0}% in ksoftirqd)",
        fl.sent as f64 / fl.secs / 1e6,
        drops / fl.secs / 1e6,
    ))
}
