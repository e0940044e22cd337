//! `cargo xtask build-ebpf`: builds the eBPF object into `target/ebpf/calix.bpf.o` and says what
//! is in it. The agent's build script does the same build on its own; this is for looking at
//! the object (bpftool, llvm-objdump) or for timing the build.

use std::{fs, time::Instant};

use anyhow::{Context, Result};

pub fn run(feature: Option<&str>) -> Result<()> {
    let out_dir = calix_ebpf_build::ebpf_target_dir();
    let started = Instant::now();
    let object = match feature {
        None => calix_ebpf_build::build_ebpf(&out_dir),
        Some(f) => calix_ebpf_build::build_ebpf_feature(&out_dir, f),
    }
    .context("building the eBPF programs")?;
    let elapsed = started.elapsed();

    let bytes = fs::read(&object).with_context(|| format!("reading {}", object.display()))?;
    let programs = calix_ebpf_build::programs(&bytes)
        .with_context(|| format!("{} is not an ELF64 object", object.display()))?;
    println!(
        "{} ({} bytes, built in {:.1} s)",
        object.display(),
        bytes.len(),
        elapsed.as_secs_f64()
    );
    for program in &programs {
        println!("  {:<12} {}", program.section, program.name);
    }
    Ok(())
}
