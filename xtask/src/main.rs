//! `cargo xtask <task>`: calix developer tasks.
mod bench;
mod build_ebpf;
mod demo;
mod docs;
mod e2e;
mod fuzz;
mod image;
mod interrupt;
mod layers;
mod leftovers;
mod setup;
mod test;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "calix developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install every prerequisite (apt packages, nightly rust-src, the musl target, bpf-linker).
    /// Idempotent.
    Setup,
    /// Build the eBPF object into target/ebpf/calix.bpf.o (with --feature F: the build with
    /// that feature of the eBPF crate, into target/ebpf/calix-F.bpf.o).
    BuildEbpf {
        /// A cargo feature of the eBPF crate, e.g. `upgrade-test`.
        #[arg(long)]
        feature: Option<String>,
    },
    /// One node, two pods, pings, calixctl, teardown (needs root). With `--nodes 3`: three
    /// nodes on etcd (two on one subnet, one behind a router), route distribution over mutual
    /// TLS, two dual-stack pods each, same-node, direct and VXLAN traffic checked.
    Demo {
        /// 1 (one node, embedded datastore) or 3 (a cluster).
        #[arg(long, default_value_t = 1)]
        nodes: usize,
        /// The agents' dataplane.
        #[arg(long, value_enum, default_value_t = demo::Mode::Ebpf)]
        mode: demo::Mode,
    },
    /// Setup, build, run every test, check nothing is left behind (needs root).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Check the crates' layers (no crate depends on a layer above it or beside it), that
    /// calix-core pulls in no tokio, aya, kube, tonic or netlink, that no crate's modules form a
    /// cycle, and that no source file outside tests is over 700 lines. `cargo xtask test` runs
    /// it first.
    Layers {
        /// Print what the checks find without failing.
        #[arg(long)]
        report: bool,
    },
    /// The calix image, offline: static musl binaries, `podman build` (FROM scratch), then
    /// `podman save --format oci-archive` to target/image/calix.oci.tar.
    Image,
    /// calix installed from its Helm chart on a real cluster on this machine (kube-apiserver,
    /// controller-manager, scheduler, kubelet nodes with containerd and kube-proxy), checked
    /// in eBPF then kernel mode and uninstalled (needs root, ../shared/k8s); with
    /// `--conformance netpol` (or `services`), Kubernetes' own NetworkPolicy (Services) suite too.
    E2e {
        /// Use this image (an OCI archive) instead of building one with `cargo xtask image`.
        #[arg(long)]
        image: Option<std::path::PathBuf>,
        /// The dataplane modes, in order.
        #[arg(long, default_value = "ebpf,kernel")]
        modes: String,
        /// Also run upstream conformance suites, comma-separated (`netpol`: `[sig-network]
        /// Netpol`; `services`: `[sig-network] Services`; `services-ci`: the part of it CI
        /// runs) after the checks, and write docs/conformance/<suite>.md; fails if a spec fails.
        #[arg(long)]
        conformance: Option<String>,
        /// The modes the suite runs in (default: all of `--modes`; `ebpf` alone is calix's
        /// Services, kernel mode's are kube-proxy's).
        #[arg(long)]
        conformance_modes: Option<String>,
        /// How many kubelet nodes (2 or more; default: 3 with the full `services` suite, one of
        /// whose specs needs 3 schedulable nodes, else 2).
        #[arg(long)]
        nodes: Option<usize>,
    },
    /// Fuzz with cargo-fuzz (nightly): the CNI plugin's input parsing, the route stream's
    /// decoder; fails on any crash.
    Fuzz {
        /// How long to fuzz each target.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
    /// Check that every relative link in README.md and docs/ resolves (files and #anchors) and
    /// that the README is at most 200 lines (also a unit test, so `cargo xtask test` runs it).
    Docs,
    /// Benchmarks (need root); results go to docs/bench/.
    Bench {
        #[command(subcommand)]
        scenario: bench::Scenario,
    },
    /// The request/response client and server the traffic benches exec in their namespaces.
    #[command(hide = true)]
    Netperf {
        #[command(subcommand)]
        mode: bench::Netperf,
    },
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::run(),
        Task::BuildEbpf { feature } => build_ebpf::run(feature.as_deref()),
        Task::Demo { nodes, mode } => demo::run_demo(nodes, mode),
        Task::Test { args } => test::run_tests(&args),
        Task::Layers { report } => layers::run(report),
        Task::Image => image::run_image().map(|_| ()),
        Task::E2e {
            image,
            modes,
            conformance,
            conformance_modes,
            nodes,
        } => e2e::run_e2e(
            image,
            &modes,
            conformance.as_deref(),
            conformance_modes.as_deref(),
            nodes,
        ),
        Task::Fuzz { seconds } => fuzz::run_fuzz(seconds),
        Task::Docs => docs::run(),
        Task::Bench { scenario } => bench::run(scenario),
        Task::Netperf { mode } => bench::netperf(mode),
    }
}
