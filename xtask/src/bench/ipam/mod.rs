//! `cargo xtask bench ipam`: IPAM allocations per second, calix-agent with the embedded, the
//! etcd and the kubernetes datastore against Debian's reference `host-local` plugin, in one run
//! (DESIGN.md §10).
//!
//! calix is driven through its real gRPC API (`calix.v1.Ipam` on the agent's unix socket) from
//! this process: one HTTP/2 connection, each call timed client-side. host-local is a process per
//! allocation, as a runtime runs it: fork, exec with the CNI environment and the network config
//! on stdin, timed fork-to-exit.
//!
//! Per variant and repetition: the load average, a fresh state (a new test-bed agent, release
//! build, `--dataplane kernel`, with its own directory, config file, socket and datastore; a
//! fresh etcd key prefix; a fresh host-local `dataDir`), one untimed warm-up allocation and
//! release, then `allocs` sequential allocations, the same `allocs` released sequentially,
//! `allocs` fresh allocations with 16 in flight, and their release (16 in flight, untimed), after
//! which nothing may be left allocated. Variants are interleaved: repetitions outer, variants
//! inner, the order reversed every other repetition. Each repetition starts with two floors:
//! fork+exec `/bin/true` (what host-local pays per call before doing anything) and an append +
//! `fdatasync` in the bench's directory (what a durable allocation pays at least).
//!
//! etcd (`/usr/bin/etcd`, one member, its data under the bench's directory) runs for the whole
//! bench in a namespace of its own, `cxb-<pid>-ipam`, and the agents run there too, reaching it
//! on that namespace's 127.0.0.1 (and changing nothing of the host's). Everything is stopped and
//! removed on drop, on error too; the children also die with the bench (`PR_SET_PDEATHSIG`).
//! The kubernetes variant's API server (kube-apiserver v1.36.2 from `../shared/k8s`, its own
//! etcd, calix's CRDs, one `IPPool`) runs likewise in `cxb-<pid>-kube`, with its agents; its
//! objects stay across repetitions (each repetition's agent is a new node, whose blocks are
//! new, or released ones claimed again).
//!
//! Writes docs/bench/ipam.md and docs/bench/ipam.svg.
mod calix;
mod host_local;
mod report;
mod samples;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use calix_proto::v1 as pb;
use calix_testbed::traffic::cpu::load_average;
use calix_testbed::{EtcdNs, KubeApi};
use plotters::style::RGBColor;
use serde_json::json;
use tonic::transport::Channel;

use super::chart;
use super::harness::{cni_plugins_version, order, repetition, Bench, Compared};
use crate::util::output;
use calix::run_calix;
use host_local::run_host_local;
use report::{chart, Report};
use samples::{Floors, Ids, Samples};

const CALIX_POOL: &str = "10.240.0.0/16";
const BLOCK_SIZE: u8 = 26;
const HOST_LOCAL_SUBNET: &str = "10.250.0.0/16";
const NETWORK: &str = "benchnet";
const ETCD: &str = "/usr/bin/etcd";
const IN_FLIGHT: usize = 16;
/// Both /16s hold 65k addresses; stay well below.
const MAX_ALLOCS: usize = 60_000;
const RPC_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes per append of the fdatasync floor.
const FSYNC_LINE: usize = 512;

type Client = pb::ipam_client::IpamClient<Channel>;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Embedded,
    Etcd,
    Kubernetes,
    HostLocal,
}

const VARIANTS: [Variant; 4] = [
    Variant::Embedded,
    Variant::Etcd,
    Variant::Kubernetes,
    Variant::HostLocal,
];
/// The calix variants (every one but host-local).
const CALIX: [Variant; 3] = [Variant::Embedded, Variant::Etcd, Variant::Kubernetes];

impl Compared for Variant {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Embedded => ("calix, embedded", "e", chart::BLUE),
            Self::Etcd => ("calix, etcd", "d", chart::GREEN),
            Self::Kubernetes => ("calix, kubernetes", "k", chart::PURPLE),
            Self::HostLocal => ("host-local", "h", chart::ORANGE),
        }
    }
}

pub fn run(allocs: usize, reps: usize) -> Result<()> {
    if !(2..=MAX_ALLOCS).contains(&allocs) || reps < 1 {
        bail!("--allocs must be 2..={MAX_ALLOCS} and --reps at least 1");
    }
    if !Path::new(ETCD).exists() {
        bail!("{ETCD} is missing: install etcd-server (cargo xtask setup)");
    }
    let b = Bench::setup("the IPAM benchmark", &[], &["host-local"])?;
    println!(
        "[setup] starting etcd in {} (data in {})",
        b.name("ipam"),
        b.dir.display()
    );
    let etcd = EtcdNs::launch(b.netns("ipam")?)?;
    println!("[setup] starting kube-apiserver in {}", b.name("kube"));
    let kube = KubeApi::launch(Some(b.netns("kube")?), b.name("kube"), true)?;
    kube.apply(json!({
        "apiVersion": "calix.dev/v1",
        "kind": "IPPool",
        "metadata": {"name": "bench"},
        "spec": {"cidr": CALIX_POOL, "blockSize": BLOCK_SIZE},
    }))?;
    let kube_store = format!(
        "type = \"kubernetes\"\nkubeconfig = \"{}\"\ntimeout_ms = 10000",
        kube.kubeconfig().display()
    );
    let kube_ns = kube.ns.as_ref().context("the API server's namespace")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a tokio runtime")?;

    let mut floors = Floors::default();
    let mut res: [Samples; 4] = Default::default();
    for rep in 0..reps {
        repetition(
            rep,
            reps,
            &[()],
            |()| "floors".into(),
            |()| floors.run(&b.dir, allocs),
        )?;
        repetition(
            rep,
            reps,
            &order(&VARIANTS, rep, false),
            |v| v.label().into(),
            |v| {
                let load = load_average();
                let ids = Ids {
                    n: allocs,
                    rep: rep + 1,
                    tag: v.tag(),
                };
                let m = match v {
                    Variant::Embedded => run_calix(&b, &rt, &etcd.ns, "type = \"embedded\"", &ids)?,
                    Variant::Etcd => {
                        let store = format!(
                        "type = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\nprefix = \"/cxb/r{}/\"",
                        rep + 1
                    );
                        run_calix(&b, &rt, &etcd.ns, &store, &ids)?
                    }
                    Variant::Kubernetes => run_calix(&b, &rt, kube_ns, &kube_store, &ids)?,
                    Variant::HostLocal => {
                        let dir = b.dir.join(format!("r{}-{}", rep + 1, v.tag()));
                        let m = run_host_local(&rt, &dir, &ids);
                        let _ = std::fs::remove_dir_all(&dir);
                        m?
                    }
                };
                let s = &mut res[v as usize];
                s.load.push(load);
                Ok(format!("(load {load:.2}): {}", s.push(allocs, m)))
            },
        )?;
    }
    drop((rt, etcd, kube));
    b.done();

    let etcd_version = output(Command::new(ETCD).arg("--version"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("etcd Version:")
                    .map(|v| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| "unknown".into());
    let report = Report {
        allocs,
        reps,
        plugins_version: cni_plugins_version(),
        etcd_version,
        res,
        floors,
        bench: b,
    };
    Bench::publish("ipam", &report.markdown(), false, |p| chart(p, &report))
}
