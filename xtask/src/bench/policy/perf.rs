//! Per packet: a client and a server pod on one node, isolated both ways by a NetworkPolicy of
//! `n` rules in each direction (one lets the pair talk; the others name other peers (an
//! ipBlock /32 each) on other ports, a fifth of them port ranges), against the same pair with
//! no policy. Measured per repetition and variant, interleaved: conn/s, TCP_RR and throughput
//! (the test bed's traffic tools), then `from_pod`'s and `to_pod`'s run time per packet (the
//! kernel's BPF statistics over an untimed TCP_CRR run).
use std::time::Duration;

use anyhow::{Context, Result};
use calix_testbed::traffic::netperf::Mode;
use calix_testbed::traffic::{Tools, Traffic};
use calix_testbed::{Guarded, KubeApi, Node, Pod};
use plotters::style::RGBColor;
use serde_json::{json, Value};

use crate::bench::chart;
use crate::bench::harness::{repetitions, warm_up, Bench, Compared};
use crate::bench::report::Traffic as Samples;

/// The untimed TCP_CRR run the programs' cost per packet is measured over (seconds).
pub(super) const PROG_COST_SECS: f64 = 2.0;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Variant {
    None,
    R10,
    R100,
    R1000,
    /// No policy either, a pair of its own: the control (A/A). Its ratio to [`Variant::None`]
    /// is what two pairs differ by with nothing between them but their pods (addresses,
    /// namespaces, port tables), the yardstick for the others' ratios.
    NoneAgain,
}

pub(super) const VARIANTS: [Variant; 5] = [
    Variant::None,
    Variant::R10,
    Variant::R100,
    Variant::R1000,
    Variant::NoneAgain,
];

impl Variant {
    /// Rules in each direction (0: no policy selects the pods).
    pub(super) fn rules(self) -> usize {
        match self {
            Self::None | Self::NoneAgain => 0,
            Self::R10 => 10,
            Self::R100 => 100,
            Self::R1000 => 1000,
        }
    }
}

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::None => ("no policy", "none", chart::GREY),
            Self::R10 => ("10 rules", "r10", chart::LIGHT_BLUE),
            Self::R100 => ("100 rules", "r100", chart::BLUE),
            Self::R1000 => ("1,000 rules", "r1000", chart::PURPLE),
            Self::NoneAgain => ("no policy, second pair", "none2", chart::LIGHT_GREY),
        }
    }
}

/// The programs' run time in one variant, per repetition.
#[derive(Default)]
pub(super) struct PerPacket {
    /// ns per run over TCP_CRR (new connections) and over TCP_RR (one established).
    pub(super) from_pod_ns: Vec<f64>,
    pub(super) from_pod_rr_ns: Vec<f64>,
    pub(super) to_pod_ns: Vec<f64>,
    pub(super) to_pod_runs: Vec<f64>,
}

/// Every variant's results (by [`Variant`] as usize), and what the policies held.
pub(super) struct Results {
    pub(super) traffic: [Samples; VARIANTS.len()],
    pub(super) by_variant: [PerPacket; VARIANTS.len()],
    /// What the dataplane held for policy (`calixctl policy`'s dataplane line).
    pub(super) programmed: String,
    pub(super) cpu: usize,
    /// The bench CPU's time by symbol over a TCP_CRR run of no policy and of 100 rules.
    pub(super) profiles: Vec<Profile>,
}

/// Where the bench CPU's time went over one untimed TCP_CRR run of a variant (`perf record`,
/// the BPF statistics off): each symbol's share (%) and the connections the run made.
pub(super) struct Profile {
    pub(super) variant: Variant,
    pub(super) conns: f64,
    pub(super) secs: f64,
    pub(super) symbols: Vec<(f64, String)>,
}

impl Profile {
    /// The CPU time of `sym` per connection (ns): the client and server keep the bench CPU
    /// busy, so a share of the samples is a share of the run's time.
    pub(super) fn ns_per_conn(&self, sym: &str) -> f64 {
        let share = self
            .symbols
            .iter()
            .find(|(_, s)| s == sym)
            .map_or(0.0, |(p, _)| *p);
        share / 100.0 * self.secs * 1e9 / self.conns.max(1.0)
    }
}

/// The untimed TCP_CRR run a variant is profiled over (seconds).
pub(super) const PROFILE_SECS: f64 = 4.0;

/// The profiled runs, in order: each variant's two runs placed symmetrically (each run's
/// TIME_WAIT sockets slow the next one's connects). The control's pair tells what two pairs
/// with no policy differ by.
const PROFILED: [Variant; 6] = [
    Variant::None,
    Variant::R100,
    Variant::NoneAgain,
    Variant::NoneAgain,
    Variant::R100,
    Variant::None,
];

/// A symbol's CPU time per connection (ns) over `v`'s runs in `profiles` (their mean).
pub(super) fn ns_per_conn(profiles: &[Profile], v: Variant, sym: &str) -> f64 {
    let of: Vec<f64> = profiles
        .iter()
        .filter(|p| p.variant == v)
        .map(|p| p.ns_per_conn(sym))
        .collect();
    of.iter().sum::<f64>() / of.len().max(1) as f64
}

/// A connection's time (µs) over `v`'s runs in `profiles` (their mean).
pub(super) fn us_per_conn(profiles: &[Profile], v: Variant) -> f64 {
    let of: Vec<f64> = profiles
        .iter()
        .filter(|p| p.variant == v)
        .map(|p| p.secs * 1e6 / p.conns.max(1.0))
        .collect();
    of.iter().sum::<f64>() / of.len().max(1) as f64
}

/// Where the per-packet pairs' policies name their other peers: above the pool's addresses.
const OTHERS: [u8; 2] = [172, 16];

/// The NetworkPolicy of `rules` rules each way for the pods labelled `bench: tag`: one lets
/// the pair in, the others each name a /32 in `net`.0.0/16 (the per-packet pairs': [`OTHERS`]).
/// The compiler numbers identities in address order, and kernel mode's chain lists an
/// endpoint's entries by identity: peers below the pool's addresses put the pair's own entry
/// last in that chain, peers above it first (eBPF's lookups do not depend on it).
pub(super) fn policy_with_others_in(
    namespace: &str,
    tag: &str,
    rules: usize,
    net: [u8; 2],
) -> Value {
    let pair = json!({"podSelector": {"matchLabels": {"bench": tag}}});
    let other = |i: usize| {
        let port = 10_000 + (50 * i as u64) % 50_000;
        let mut p = json!({"protocol": if i % 3 == 1 { "UDP" } else { "TCP" }, "port": port});
        if i.is_multiple_of(5) {
            p["endPort"] = json!(port + 40);
        }
        (
            json!({"ipBlock": {"cidr": format!("{}.{}.{}.{}/32", net[0], net[1], i / 256, i % 256)}}),
            json!([p]),
        )
    };
    let rules_of = |peer: &str| -> Vec<Value> {
        let mut v = vec![json!({ peer: [pair.clone()] })];
        v.extend((1..rules).map(|i| {
            let (who, ports) = other(i);
            json!({ peer: [who], "ports": ports })
        }));
        v
    };
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "bench", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": {"bench": tag}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": rules_of("from"),
            "egress": rules_of("to"),
        }
    })
}

/// A client and a server pod on one node (namespace and labels `bench: tag`), isolated by
/// [`policy_with_others_in`] of `rules` rules (none: 0; the others in `others`.0.0/16), the traffic tools' servers running.
pub(super) struct Pair<'a> {
    pub(super) traffic: Traffic,
    _servers: Vec<Guarded>,
    _pods: [Pod<'a>; 2],
}

impl<'a> Pair<'a> {
    pub(super) fn start(
        b: &Bench,
        api: &KubeApi,
        tools: &Tools,
        node: &'a Node,
        tag: &str,
        rules: usize,
        others: [u8; 2],
    ) -> Result<Self> {
        let namespace = b.name(tag);
        api.namespace(&namespace, json!({}), json!({}))?;
        let labels = |role: &str| json!({"bench": tag, "role": role});
        let client = api.running_pod(node, &namespace, "client", labels("client"))?;
        let server = api.running_pod(node, &namespace, "server", labels("server"))?;
        if rules > 0 {
            api.apply(policy_with_others_in(&namespace, tag, rules, others))?;
        }
        let ip = server.ip().parse().context("the server pod's address")?;
        let traffic = Traffic::new(&client.ns, &server.ns, ip);
        let servers = tools.start(&traffic, &b.dir)?;
        Ok(Self {
            traffic,
            _servers: servers,
            _pods: [client, server],
        })
    }
}

pub(super) fn run(
    b: &Bench,
    api: &KubeApi,
    tools: &Tools,
    node: &Node,
    reps: usize,
    secs: u64,
) -> Result<Results> {
    let mut pairs = Vec::new();
    for v in VARIANTS {
        pairs.push(Pair::start(
            b,
            api,
            tools,
            node,
            v.tag(),
            v.rules(),
            OTHERS,
        )?);
    }
    let programmed = wait_programmed(node)?;
    println!("[setup] policies programmed: {programmed}");
    for (v, p) in VARIANTS.iter().zip(&pairs) {
        let tr = &p.traffic;
        warm_up(
            tools,
            v.label(),
            tr,
            &tr.server_ip.to_string(),
            Duration::from_secs(20),
        )?;
    }
    let pins = ["from_pod", "to_pod"]
        .iter()
        .map(|p| node.prog_pin(p).with_context(|| format!("no pin of {p}")))
        .collect::<Result<Vec<_>>>()?;
    let mut by_variant: [PerPacket; VARIANTS.len()] = Default::default();
    let mut traffic: [Samples; VARIANTS.len()] = Default::default();
    repetitions(reps, &VARIANTS, |v| {
        let (p, r) = (&pairs[v as usize], &mut by_variant[v as usize]);
        let m = tools.measure(&p.traffic, secs, Some(&node.ns), true)?;
        let mut line = traffic[v as usize].push(&m);
        let rt = calix_testbed::bpf::pinned_run_time(&pins, || {
            tools
                .netperf(&p.traffic, Mode::Crr, PROG_COST_SECS)
                .map(drop)
        })
        .context("measuring the programs' run time")?;
        let from = rt[0].ns_per_run.context("from_pod did not run")?;
        r.from_pod_ns.push(from);
        r.to_pod_runs.push(rt[1].runs as f64);
        if let Some(to) = rt[1].ns_per_run {
            r.to_pod_ns.push(to);
        }
        let rr = calix_testbed::bpf::pinned_run_time(&pins[..1], || {
            tools
                .netperf(&p.traffic, Mode::Rr, PROG_COST_SECS)
                .map(drop)
        })
        .context("measuring the programs' run time over TCP_RR")?;
        let from_rr = rr[0].ns_per_run.context("from_pod did not run")?;
        r.from_pod_rr_ns.push(from_rr);
        line.push_str(&format!(
            ", from_pod {from:.1} ns/packet (TCP_CRR), {from_rr:.1} (TCP_RR)"
        ));
        Ok(line)
    })?;
    // A, B, C, C, B, A: each run leaves ~60 s of TIME_WAIT sockets in the host's port tables,
    // which slow the next run's connects whatever its variant.
    let mut profiles = Vec::new();
    for v in PROFILED {
        println!("[profile] {}: TCP_CRR under perf record", v.label());
        profiles.push(profile(b, tools, &pairs[v as usize], v)?);
    }
    Ok(Results {
        traffic,
        by_variant,
        programmed,
        cpu: tools.cpu,
        profiles,
    })
}

/// `v`'s pair under `perf record` of the bench CPU over a TCP_CRR run.
fn profile(b: &Bench, tools: &Tools, pair: &Pair, v: Variant) -> Result<Profile> {
    let softirqd = format!("ksoftirqd/{}", tools.cpu);
    let data = b.dir.join(format!("{}.perf.data", v.tag()));
    let mut conns = 0.0;
    let symbols = crate::bench::profile::profile(tools.cpu, &["xtask", &softirqd], &data, || {
        conns = tools.netperf(&pair.traffic, Mode::Crr, PROFILE_SECS)?.count;
        Ok(())
    });
    let _ = std::fs::remove_file(&data);
    Ok(Profile {
        variant: v,
        conns,
        secs: PROFILE_SECS,
        symbols: symbols.context("profiling the bench CPU")?,
    })
}

/// Waits until the agent isolates the pods of the variants with a policy (two each) both ways
/// and what it programmed has stayed the same for a second; returns what the dataplane holds.
fn wait_programmed(node: &Node) -> Result<String> {
    let want = 2.0 * VARIANTS.iter().filter(|v| v.rules() > 0).count() as f64;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let (mut last, mut same) = (-1.0, 0);
    loop {
        if let Some(m) = super::metrics(node) {
            let get = |k: &str| m.get(k).copied().unwrap_or(-1.0);
            let entries = get("calix_policy_dataplane_entries{kind=\"entry\"}");
            same = if entries == last { same + 1 } else { 0 };
            last = entries;
            if get("calix_policy_isolated_endpoints{direction=\"ingress\"}") == want
                && get("calix_policy_isolated_endpoints{direction=\"egress\"}") == want
                && get("calix_policy_not_programmed") == 0.0
                && entries > 0.0
                && same >= 4
            {
                let report = node.agent().calixctl_json(&["policy"])?;
                return Ok(report["dataplane"].as_str().unwrap_or("?").to_string());
            }
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the policies were not programmed within 60 s:\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(variant: Variant, conns: f64, symbols: &[(f64, &str)]) -> Profile {
        Profile {
            variant,
            conns,
            secs: 4.0,
            symbols: symbols.iter().map(|&(p, s)| (p, s.to_string())).collect(),
        }
    }

    #[test]
    fn a_symbols_time_per_connection_is_the_mean_of_its_variants_runs() {
        let p = [
            run(Variant::None, 100_000.0, &[(10.0, "[k] a")]),
            run(Variant::R100, 80_000.0, &[(20.0, "[k] a"), (5.0, "[k] b")]),
            run(Variant::R100, 40_000.0, &[(10.0, "[k] a")]),
        ];
        // 10 % of 4 s over 100,000 connections: 4 µs each.
        assert_eq!(ns_per_conn(&p, Variant::None, "[k] a"), 4_000.0);
        // (20 % of 4 s / 80,000 + 10 % of 4 s / 40,000) / 2 = (10 µs + 10 µs) / 2.
        assert_eq!(ns_per_conn(&p, Variant::R100, "[k] a"), 10_000.0);
        // Missing from a run: nothing there.
        assert_eq!(ns_per_conn(&p, Variant::R100, "[k] b"), 1_250.0);
        assert_eq!(ns_per_conn(&p, Variant::None, "[k] b"), 0.0);
        assert_eq!(us_per_conn(&p, Variant::None), 40.0);
        assert_eq!(us_per_conn(&p, Variant::R100), 75.0);
        assert_eq!(ns_per_conn(&p, Variant::R10, "[k] a"), 0.0);
    }
}
