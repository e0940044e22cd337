//! How many Services each variant has programmed: calix, its frontends in use
//! (`calix_services_room{kind="frontend",of="used"}`); kube-proxy in iptables mode, the
//! `KUBE-SERVICES` jumps to a Service's chain (`iptables-save -t nat`); in nftables mode, the
//! elements of its `service-ips` map.
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{Lane, Variant};
use crate::util::output;

/// How long a stage's Services may take to be programmed everywhere.
const PATIENCE: Duration = Duration::from_secs(900);

/// Waits until every lane has programmed at least `want` Services, written from `t0` on;
/// returns the seconds each took.
pub(super) fn wait(lanes: &[Lane], want: usize, t0: Instant) -> Result<[f64; 3]> {
    let mut took = [f64::NAN; 3];
    let mut said = Instant::now();
    loop {
        super::super::harness::check_interrupted()?;
        let mut counts = [0; 3];
        for (i, l) in lanes.iter().enumerate() {
            if !took[i].is_nan() {
                counts[i] = want;
                continue;
            }
            counts[i] = count(l).unwrap_or(0);
            if counts[i] >= want {
                took[i] = t0.elapsed().as_secs_f64();
            }
        }
        if took.iter().all(|t| !t.is_nan()) {
            return Ok(took);
        }
        if t0.elapsed() > PATIENCE {
            bail!("after {PATIENCE:?}, programmed {counts:?} of {want} Services (calix, iptables, nftables)");
        }
        if said.elapsed() > Duration::from_secs(10) {
            println!("[wait] programmed {counts:?} of {want} (calix, iptables, nftables)");
            said = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Services `lane` has programmed.
fn count(lane: &Lane) -> Result<usize> {
    match lane.v {
        Variant::Calix => {
            let m = super::super::policy::metrics(lane.node).context("the agent's metrics")?;
            let used = m
                .get("calix_services_room{kind=\"frontend\",of=\"used\"}")
                .context("calix_services_room")?;
            Ok(*used as usize)
        }
        Variant::Iptables => {
            let text = output(lane.node.ns.command("iptables-save")?.args(["-t", "nat"]))?;
            Ok(iptables_services(&text))
        }
        Variant::Nftables => {
            let mut cmd = lane.node.ns.command("nft")?;
            let text = output(cmd.args(["-j", "list", "map", "ip", "kube-proxy", "service-ips"]))?;
            nft_elements(&text)
        }
    }
}

/// The Service ports `iptables-save -t nat` sends to a Service's chain.
fn iptables_services(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES ") && l.contains(" -j KUBE-SVC-"))
        .count()
}

/// The elements of the map `nft -j list map` printed.
fn nft_elements(text: &str) -> Result<usize> {
    let v: serde_json::Value = serde_json::from_str(text).context("nft -j output")?;
    let maps = v["nftables"]
        .as_array()
        .context("nft -j: no nftables list")?;
    Ok(maps
        .iter()
        .filter_map(|o| o["map"]["elem"].as_array())
        .map(Vec::len)
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_kube_proxy_wrote() {
        let ipt = "*nat\n-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment \"default/kubernetes:https cluster IP\" -j KUBE-SVC-NPX46M4PTMTKRN6Y\n\
                   -A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -j KUBE-NODEPORTS\n\
                   -A KUBE-SVC-NPX46M4PTMTKRN6Y -j KUBE-SEP-X\n";
        assert_eq!(iptables_services(ipt), 1);
        let nft = r#"{"nftables": [{"metainfo": {}}, {"map": {"family": "ip", "name": "service-ips",
            "elem": [[{"concat": ["10.96.0.1", "tcp", 443]}, {"goto": "service-x"}],
                     [{"concat": ["10.96.1.1", "tcp", 80]}, {"goto": "service-y"}]]}}]}"#;
        assert_eq!(nft_elements(nft).ok(), Some(2));
        assert!(nft_elements("not json").is_err());
    }
}
