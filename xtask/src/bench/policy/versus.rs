//! eBPF against kernel mode (nftables) at 1,000 rules: [`perf`](super::perf)'s pair and
//! 1,000-rule policy, once on an eBPF node and twice on a kernel-mode node of the same API
//! server: kernel mode walks an endpoint's entries in order, so once with the pair's own
//! entry first in its chain and once with it last (eBPF's lookups do not depend on it);
//! conn/s (TCP_CRR), TCP_RR and throughput, the three interleaved in each repetition.
use std::time::Duration;

use anyhow::{Context, Result};
use calix_testbed::traffic::Tools;
use calix_testbed::{KubeApi, Node};
use plotters::style::RGBColor;

use super::perf::Pair;

use crate::bench::chart;
use crate::bench::harness::{repetitions, warm_up, Bench, Compared};
use crate::bench::report::Traffic as Samples;

/// Rules in each direction.
pub(super) const RULES: usize = 1000;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Engine {
    Ebpf,
    /// The pair's entry first in its endpoint's chain.
    Nft,
    /// The pair's entry last: 999 entries walked before it.
    NftLast,
}

pub(super) const ENGINES: [Engine; 3] = [Engine::Ebpf, Engine::Nft, Engine::NftLast];

impl Compared for Engine {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Ebpf => ("eBPF, 1,000 rules", "vs-ebpf", chart::PURPLE),
            Self::Nft => (
                "nftables, 1,000 rules, allowing entry first",
                "vs-nft",
                chart::ORANGE,
            ),
            Self::NftLast => (
                "nftables, 1,000 rules, allowing entry last",
                "vs-nftl",
                chart::RED,
            ),
        }
    }
}

impl Engine {
    /// Where the policy's other peers are ([`super::perf::policy_with_others_in`]): above
    /// the pool's addresses, or below.
    fn others(self) -> [u8; 2] {
        match self {
            Self::NftLast => [10, 0],
            _ => [172, 16],
        }
    }
}

pub(super) struct Versus {
    /// By [`Engine`] as usize.
    pub(super) traffic: [Samples; 3],
}

pub(super) fn run(
    b: &Bench,
    api: &KubeApi,
    tools: &Tools,
    [ebpf, kernel]: [&Node; 2],
    reps: usize,
    secs: u64,
) -> Result<Versus> {
    let mut pairs = Vec::new();
    for e in ENGINES {
        let node = if e == Engine::Ebpf { ebpf } else { kernel };
        let pair = Pair::start(b, api, tools, node, e.tag(), RULES, e.others())?;
        pairs.push((pair, node));
    }
    for (e, (_, node)) in ENGINES.iter().zip(&pairs) {
        wait_isolated(node).with_context(|| format!("{}: the policy programmed", e.label()))?;
    }
    println!("[setup] eBPF against nftables: both pairs isolated by {RULES} rules each way");
    for (e, (p, _)) in ENGINES.iter().zip(&pairs) {
        let tr = &p.traffic;
        warm_up(
            tools,
            e.label(),
            tr,
            &tr.server_ip.to_string(),
            Duration::from_secs(20),
        )?;
    }
    let mut traffic: [Samples; 3] = Default::default();
    repetitions(reps, &ENGINES, |e| {
        let (p, node) = &pairs[e as usize];
        let m = tools.measure(&p.traffic, secs, Some(&node.ns), true)?;
        Ok(traffic[e as usize].push(&m))
    })?;
    Ok(Versus { traffic })
}

/// Waits until `node`'s agent isolates the pair both ways (at least two endpoints: the eBPF
/// node may still know the per-packet pairs' Pod objects), with every entry programmed and the
/// same for a second.
fn wait_isolated(node: &Node) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let (mut last, mut same) = (-1.0, 0);
    loop {
        if let Some(m) = super::metrics(node) {
            let get = |k: &str| m.get(k).copied().unwrap_or(-1.0);
            let entries = get("calix_policy_dataplane_entries{kind=\"entry\"}");
            same = if entries == last { same + 1 } else { 0 };
            last = entries;
            if get("calix_policy_isolated_endpoints{direction=\"ingress\"}") >= 2.0
                && get("calix_policy_isolated_endpoints{direction=\"egress\"}") >= 2.0
                && get("calix_policy_not_programmed") == 0.0
                && entries > 0.0
                && same >= 4
            {
                return Ok(());
            }
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "not within 90 s:\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}
