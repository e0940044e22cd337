//! `cargo xtask <task>`: calix developer tasks.
mod build_ebpf;
mod setup;

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
    /// Install every prerequisite (apt packages, nightly rust-src, bpf-linker). Idempotent.
    Setup,
    /// Build the eBPF object into target/ebpf/calix.bpf.o.
    BuildEbpf,
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::run(),
        Task::BuildEbpf => build_ebpf::run(),
    }
}
