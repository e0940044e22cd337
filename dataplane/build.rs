//! Builds the eBPF object from `ebpf/programs` and leaves it at `$OUT_DIR/calix.bpf.o`, where
//! `ebpf::OBJECT` embeds it with `include_bytes_aligned!`. Runs again whenever an eBPF source
//! changes, so the dataplane (and the agent) never embeds a stale object.

use std::{env, path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    for path in calix_ebpf_build::ebpf_sources() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    // The nested build's directory follows it (see `ebpf_target_dir`).
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    let Some(out_dir) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        eprintln!("error: OUT_DIR is not set (this build script runs only under cargo)");
        return ExitCode::FAILURE;
    };
    match calix_ebpf_build::build_ebpf(&out_dir) {
        Ok(_object) => ExitCode::SUCCESS,
        Err(e) => {
            // cargo shows this build script's stderr when it fails.
            eprintln!(
                "error: building the calix eBPF object failed: {}",
                calix_log::error_chain(&e)
            );
            ExitCode::FAILURE
        }
    }
}
