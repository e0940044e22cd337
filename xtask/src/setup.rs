//! `cargo xtask setup`: installs everything calix needs on a fresh Debian 12, idempotently.
//!
//! Each step checks first and installs only what is missing, so a second run only prints `ok`
//! lines. Order matters: the apt packages bring LLVM 22, which bpf-linker is built against.
//! Needs root for apt-get and rustup (rustup itself must already be there).

use std::{env, path::PathBuf, process::Command};

use anyhow::{bail, Context, Result};

/// Debian packages: LLVM for bpf-linker, the network tools the tests and benchmarks drive, the
/// CNI reference plugins (loopback) and etcd for the datastore tests (and under the shared
/// kube-apiserver). No `protoc`: the protos
/// are compiled by protox, in Rust, so building xtask itself needs nothing from this list.
const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "iproute2",
    "iputils-ping",
    "iperf3",
    "etcd-server",
    "containernetworking-plugins",
    "bpftool",
    "tcpdump",
    "nftables",
    "procps",
    "podman",
    "containerd",
    "busybox-static",
    "iptables",
    "python3",
    "runc",
    // BGP's real peers (issue 23): BIRD 2 and FRR (zebra, bgpd) in a network namespace. FRR's
    // package enables and starts a service of its own, which the next step turns off.
    "bird2",
    "frr",
    // The chart's Python tools live in a virtual environment of Debian's python3 (PEP 668: no
    // pip into the system); the image's binaries are static musl executables (ring's C code
    // needs musl's compiler wrapper).
    "python3-venv",
    "musl-tools",
    // The Kubernetes datastore's tests: the shared kube-apiserver is xz-compressed; its
    // service-account key is made with openssl.
    "xz-utils",
    "openssl",
    // The upstream Services suite's commands in its agnhost image (`nc -v -t -w 2`, `curl`,
    // `wget`): copied from this machine with their libraries (busybox's nc lacks those
    // options; its static wget segfaults).
    "netcat-openbsd",
    "curl",
    "wget",
];

/// The LLVM bpf-linker is built against: the `llvm-22-dev` above. It must be at least as new
/// as the LLVM of the nightly rustc (DESIGN.md §11).
const LLVM_MAJOR: u32 = 22;

/// One prerequisite: how to tell it is there, and how to install it.
struct Step {
    what: &'static str,
    check: fn() -> Result<State>,
    install: fn() -> Result<()>,
}

/// What a check found; the text says what exactly.
enum State {
    Present(String),
    Missing(String),
}

const STEPS: &[Step] = &[
    Step {
        what: "apt packages",
        check: check_apt,
        install: install_apt,
    },
    Step {
        what: "FRR's system service off",
        check: check_frr_service,
        install: stop_frr_service,
    },
    Step {
        what: "rustfmt (stable)",
        check: check_rustfmt,
        install: install_rustfmt,
    },
    Step {
        what: "clippy (stable)",
        check: check_clippy,
        install: install_clippy,
    },
    Step {
        what: "nightly toolchain",
        check: check_nightly,
        install: install_nightly,
    },
    Step {
        what: "rust-src (nightly)",
        check: check_rust_src,
        install: install_rust_src,
    },
    Step {
        what: "musl target (stable)",
        check: check_musl_target,
        install: install_musl_target,
    },
    Step {
        what: "bpf-linker",
        check: check_bpf_linker,
        install: install_bpf_linker,
    },
    Step {
        what: "chart tools (helm-python-sdk, kubernetes-validate)",
        check: check_chart_tools,
        install: install_chart_tools,
    },
];

pub fn run() -> Result<()> {
    let total = STEPS.len();
    for (i, step) in STEPS.iter().enumerate() {
        let prefix = format!("[{}/{total}] {}", i + 1, step.what);
        let check = || (step.check)().with_context(|| format!("checking {}", step.what));
        match check()? {
            State::Present(detail) => println!("{prefix} … ok{}", suffix(&detail)),
            State::Missing(detail) => {
                println!("{prefix} … missing{}; installing", suffix(&detail));
                (step.install)().with_context(|| format!("installing {}", step.what))?;
                match check()? {
                    State::Present(detail) => {
                        println!("{prefix} … installed{}", suffix(&detail))
                    }
                    State::Missing(detail) => {
                        bail!(
                            "{} is still missing after installing it: {detail}",
                            step.what
                        )
                    }
                }
            }
        }
    }
    if let Some(warning) = llvm_warning()? {
        println!("warning: {warning}");
    }
    Ok(())
}

fn suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(" ({detail})")
    }
}

// --- apt ---------------------------------------------------------------------------------

fn missing_packages() -> Result<Vec<&'static str>> {
    let mut missing = Vec::new();
    for &package in APT_PACKAGES {
        // Unknown packages make dpkg-query fail: that is "missing" too.
        let status = capture("dpkg-query", &["-W", "-f=${Status}\n", package])?;
        let installed = status
            .as_deref()
            .is_some_and(|s| s.lines().any(|l| l.trim() == "install ok installed"));
        if !installed {
            missing.push(package);
        }
    }
    Ok(missing)
}

fn check_apt() -> Result<State> {
    let missing = missing_packages()?;
    Ok(if missing.is_empty() {
        State::Present(format!("{} packages", APT_PACKAGES.len()))
    } else {
        State::Missing(missing.join(" "))
    })
}

fn install_apt() -> Result<()> {
    let missing = missing_packages()?;
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("apt-get");
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        run_shown(&mut cmd).context("apt-get failed (it needs root)")
    };
    apt(&["update"])?;
    let mut args = vec!["install", "-y", "--no-install-recommends"];
    args.extend(missing);
    apt(&args)
}

// --- FRR's system service ----------------------------------------------------------------

// frr's postinst enables frr.service and starts it (`invoke-rc.d frr start`, unless a
// policy-rc.d forbids it, as in containers): watchfrr, zebra and staticd in the host's network
// namespace (bgpd too, and a listener on port 179, once /etc/frr/daemons says `bgpd=yes`; the
// packaged file says no). A routing daemon on the host network is nothing the tests want, and
// zebra there would be taken for a test's leftover: the tests start their own daemons, in
// their namespaces, with their own sockets. So the service is stopped and disabled, for good
// (an upgrade leaves a disabled service alone).

/// The daemons of the service, by their pid files.
const FRR_DAEMONS: &[&str] = &["watchfrr", "zebra", "bgpd", "staticd", "mgmtd"];

fn systemd() -> bool {
    std::path::Path::new("/run/systemd/system").exists()
}

/// The service's daemons that run (their pid files name a live process of that name).
fn frr_running() -> Vec<&'static str> {
    FRR_DAEMONS
        .iter()
        .copied()
        .filter(|d| {
            std::fs::read_to_string(format!("/run/frr/{d}.pid"))
                .ok()
                .and_then(|pid| std::fs::read_to_string(format!("/proc/{}/comm", pid.trim())).ok())
                .is_some_and(|comm| comm.trim() == *d)
        })
        .collect()
}

/// Whether the service starts at boot.
fn frr_enabled() -> Result<bool> {
    if systemd() {
        let state = capture("systemctl", &["is-enabled", "frr"])?;
        return Ok(state.is_some_and(|s| s.trim() == "enabled"));
    }
    // SysV init: a start link in a multi-user runlevel.
    Ok((2..=5).any(|level| {
        std::fs::read_dir(format!("/etc/rc{level}.d"))
            .map(|dir| {
                dir.flatten().any(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.starts_with('S')
                        && name.trim_start_matches(|c: char| c == 'S' || c.is_ascii_digit())
                            == "frr"
                })
            })
            .unwrap_or(false)
    }))
}

fn frr_installed() -> bool {
    std::path::Path::new("/etc/init.d/frr").exists()
        || std::path::Path::new("/lib/systemd/system/frr.service").exists()
}

fn check_frr_service() -> Result<State> {
    if !frr_installed() {
        return Ok(State::Present("not installed".into()));
    }
    let running = frr_running();
    let enabled = frr_enabled()?;
    Ok(match (running.is_empty(), enabled) {
        (true, false) => State::Present("stopped, disabled".into()),
        (true, true) => State::Missing("enabled at boot".into()),
        (false, _) => State::Missing(format!("running: {}", running.join(" "))),
    })
}

fn stop_frr_service() -> Result<()> {
    if systemd() {
        return run_shown(Command::new("systemctl").args(["disable", "--now", "frr"]));
    }
    run_shown(Command::new("update-rc.d").args(["frr", "disable"]))?;
    if !frr_running().is_empty() {
        run_shown(Command::new("/etc/init.d/frr").arg("stop"))?;
    }
    Ok(())
}

// --- rustup toolchains and components ----------------------------------------------------

fn rustup(args: &[&str]) -> Result<Option<String>> {
    capture("rustup", args).context("rustup is needed: install it first (https://rustup.rs)")
}

/// Whether `component` is installed for `toolchain`. rustup lists most components with the
/// host triple (`clippy-x86_64-unknown-linux-gnu`) but some without (`rust-src`).
fn component(toolchain: &str, component: &str) -> Result<State> {
    let Some(list) = rustup(&["component", "list", "--toolchain", toolchain, "--installed"])?
    else {
        return Ok(State::Missing(format!("no `{toolchain}` toolchain")));
    };
    let with_triple = format!("{component}-");
    let found = list
        .lines()
        .map(str::trim)
        .any(|c| c == component || c.starts_with(&with_triple));
    Ok(if found {
        State::Present(String::new())
    } else {
        State::Missing(String::new())
    })
}

fn add_component(toolchain: &str, component: &str) -> Result<()> {
    run_shown(Command::new("rustup").args([
        "component",
        "add",
        component,
        "--toolchain",
        toolchain,
    ]))
}

fn check_rustfmt() -> Result<State> {
    component("stable", "rustfmt")
}

fn install_rustfmt() -> Result<()> {
    add_component("stable", "rustfmt")
}

fn check_clippy() -> Result<State> {
    component("stable", "clippy")
}

fn install_clippy() -> Result<()> {
    add_component("stable", "clippy")
}

fn check_nightly() -> Result<State> {
    let list = rustup(&["toolchain", "list"])?.unwrap_or_default();
    let nightly = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .find(|t| *t == "nightly" || t.starts_with("nightly-"));
    Ok(match nightly {
        Some(name) => State::Present(name.to_owned()),
        None => State::Missing(String::new()),
    })
}

fn install_nightly() -> Result<()> {
    run_shown(Command::new("rustup").args([
        "toolchain",
        "install",
        "nightly",
        "--profile",
        "minimal",
    ]))
}

/// The target the CNI plugin ships for: a static musl executable (docs/decisions.md, "CNI
/// concurrency"); `bench cni` and the chart's image build it.
pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";

fn check_musl_target() -> Result<State> {
    let list = rustup(&["target", "list", "--installed", "--toolchain", "stable"])?;
    Ok(
        if list.is_some_and(|l| l.lines().any(|t| t.trim() == MUSL_TARGET)) {
            State::Present(MUSL_TARGET.to_owned())
        } else {
            State::Missing(MUSL_TARGET.to_owned())
        },
    )
}

fn install_musl_target() -> Result<()> {
    run_shown(Command::new("rustup").args(["target", "add", MUSL_TARGET, "--toolchain", "stable"]))
}

fn check_rust_src() -> Result<State> {
    component("nightly", "rust-src")
}

fn install_rust_src() -> Result<()> {
    add_component("nightly", "rust-src")
}

// --- bpf-linker --------------------------------------------------------------------------

use calix_ebpf_build::cargo_bin_dir;

fn find_bpf_linker() -> Option<PathBuf> {
    let path = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path)
        .chain(std::iter::once(cargo_bin_dir()))
        .map(|dir| dir.join("bpf-linker"))
        .find(|p| p.is_file())
}

/// The `llvm-NN` features `cargo install` recorded for bpf-linker, or `None` when it was not
/// installed by `cargo install` (or the record cannot be read).
fn bpf_linker_llvm_features() -> Option<Vec<String>> {
    let crates2 = cargo_bin_dir().parent()?.join(".crates2.json");
    let text = std::fs::read_to_string(crates2).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let (_, install) = json["installs"]
        .as_object()?
        .iter()
        .find(|(id, _)| id.starts_with("bpf-linker "))?;
    Some(
        install["features"]
            .as_array()?
            .iter()
            .filter_map(|f| f.as_str())
            .filter(|f| f.starts_with("llvm-"))
            .map(str::to_owned)
            .collect(),
    )
}

fn check_bpf_linker() -> Result<State> {
    let Some(path) = find_bpf_linker() else {
        return Ok(State::Missing("not on PATH nor in ~/.cargo/bin".into()));
    };
    let wanted = format!("llvm-{LLVM_MAJOR}");
    Ok(match bpf_linker_llvm_features() {
        Some(features) if !features.contains(&wanted) => State::Missing(format!(
            "{} was built with features {features:?}, not `{wanted}`",
            path.display()
        )),
        Some(_) => State::Present(format!("{}, LLVM {LLVM_MAJOR}", path.display())),
        None => State::Present(format!("{}, not from cargo install", path.display())),
    })
}

fn install_bpf_linker() -> Result<()> {
    let llvm_prefix = format!("/usr/lib/llvm-{LLVM_MAJOR}");
    let features = format!("llvm-{LLVM_MAJOR}");
    let mut cmd = Command::new("cargo");
    cmd.args([
        "install",
        "bpf-linker",
        "--no-default-features",
        "--features",
        &features,
    ])
    .env("LLVM_PREFIX", &llvm_prefix);
    // Present but built against another LLVM: replace it.
    if find_bpf_linker().is_some() {
        cmd.arg("--force");
    }
    run_shown(&mut cmd)
}

/// A warning when the nightly rustc's LLVM is newer than bpf-linker's: the eBPF build would
/// then fail to read rustc's bitcode, and only a newer `LLVM_MAJOR` here fixes it.
fn llvm_warning() -> Result<Option<String>> {
    let Some(version) = capture("rustc", &["+nightly", "-vV"])? else {
        return Ok(None);
    };
    let major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.trim().parse::<u32>().ok());
    Ok(match major {
        Some(major) if major > LLVM_MAJOR => Some(format!(
            "the nightly rustc uses LLVM {major} but bpf-linker is built against LLVM \
             {LLVM_MAJOR}; raise LLVM_MAJOR in xtask/src/setup.rs (and the llvm-* packages)"
        )),
        _ => None,
    })
}

// --- the chart's Python tools ------------------------------------------------------------

use calix_testbed::chart_tools;

fn check_chart_tools() -> Result<State> {
    let venv = chart_tools::venv_dir(&crate::util::workspace_root())
        .with_context(|| format!("reading {}", chart_tools::REQUIREMENTS))?;
    Ok(if chart_tools::is_complete(&venv) {
        State::Present(venv.display().to_string())
    } else {
        State::Missing(venv.display().to_string())
    })
}

/// A virtual environment of Debian's python3 with the pinned, hash-checked wheels, built in a
/// temporary directory beside its final name and renamed into place when complete: a run that
/// stops halfway leaves no environment that looks whole, and two runs at once do not mix.
fn install_chart_tools() -> Result<()> {
    let root = crate::util::workspace_root();
    let venv = chart_tools::venv_dir(&root)?;
    let parent = venv
        .parent()
        .context("the environment has a parent directory")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let temp = parent.join(format!(
        ".{}.tmp-{}",
        venv.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&temp);
    let result = (|| {
        run_shown(
            Command::new("/usr/bin/python3")
                .arg("-m")
                .arg("venv")
                .arg(&temp),
        )?;
        run_shown(
            Command::new(chart_tools::python(&temp))
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(["--require-hashes", "--only-binary=:all:", "-r"])
                .arg(root.join(chart_tools::REQUIREMENTS)),
        )?;
        std::fs::write(temp.join(chart_tools::COMPLETE_MARK), "")?;
        match std::fs::rename(&temp, &venv) {
            // Another run finished first: its environment is as good as this one.
            Err(_) if chart_tools::is_complete(&venv) => Ok(()),
            other => other.with_context(|| format!("renaming into {}", venv.display())),
        }
    })();
    let _ = std::fs::remove_dir_all(&temp);
    result
}

// --- running commands --------------------------------------------------------------------

/// Runs `program args…` and returns its stdout, or `None` when it exits unsuccessfully.
/// Fails only when it cannot be started.
fn capture(program: &str, args: &[&str]) -> Result<Option<String>> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running `{program} {}`", args.join(" ")))?;
    Ok(out
        .status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// Runs `cmd` with its output shown, and fails unless it succeeds.
fn run_shown(cmd: &mut Command) -> Result<()> {
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    println!("      $ {shown}");
    let status = cmd.status().with_context(|| format!("running `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}
