//! Builds the calix eBPF programs (`ebpf/programs`, crate `calix-ebpf`) into one BPF object.
//!
//! The eBPF crate needs the nightly toolchain and `-Z build-std=core`, so it cannot be an
//! ordinary dependency of the agent. [`build_ebpf`] runs a nested
//! `cargo +nightly build --release --target bpfel-unknown-none -Z build-std=core` for it, with a
//! clean environment, and copies the object to `<out_dir>/calix.bpf.o`. It is called from
//! `dataplane/build.rs` (so every agent build embeds the object of the current sources) and from
//! `cargo xtask build-ebpf`.
//!
//! The nested build always uses `target/ebpf/<arch>` (see [`ebpf_target_dir`]), never the outer
//! build's profile directory, so it cannot wait on a lock the outer cargo holds, and the debug,
//! release, clippy and test builds of the agent and xtask share one eBPF build instead of
//! compiling `core` each.

mod elf;
mod env;
mod locate;
mod toolchain;

pub use toolchain::cargo_bin_dir;

pub use elf::{programs, Program};

use std::{
    collections::VecDeque,
    ffi::OsString,
    fmt, fs,
    io::{self, BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    thread,
};

/// Name of the object [`build_ebpf`] writes into its `out_dir`.
pub const OBJECT_FILE: &str = "calix.bpf.o";

/// The `[[bin]]` of the eBPF crate: the ELF object cargo produces is named after it.
const BIN_NAME: &str = "calix";
/// The toolchain the eBPF crate is built with (it needs `-Z build-std`).
const TOOLCHAIN: &str = "nightly";
/// How many lines of the nested cargo's stderr a [`BuildError::CargoFailed`] carries.
const TAIL_LINES: usize = 40;
/// Programs the agent loads by name; the build fails if the object lacks one.
const EXPECTED_PROGRAMS: &[&str] = &calix_common::ALL_PROGRAMS;
/// What every missing-prerequisite error tells the reader to do.
const SETUP_HINT: &str = "run `cargo xtask setup`";

/// Why the eBPF object could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(
        "the `{TOOLCHAIN}` Rust toolchain is not usable (`{command}`: {detail}); {SETUP_HINT}"
    )]
    NightlyMissing { command: String, detail: String },

    #[error(
        "the `{TOOLCHAIN}` toolchain has no `rust-src` component ({} is missing); {SETUP_HINT}",
        path.display()
    )]
    RustSrcMissing { path: PathBuf },

    #[error(
        "bpf-linker is neither on PATH nor in {}; {SETUP_HINT}",
        cargo_bin.display()
    )]
    BpfLinkerMissing { cargo_bin: PathBuf },

    #[error("could not run `{command}`")]
    Spawn {
        command: String,
        #[source]
        source: io::Error,
    },

    #[error("could not read the output of `{command}`")]
    Output {
        command: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "`{command}` in {} failed ({status}); last lines of its output:\n{tail}",
        dir.display()
    )]
    CargoFailed {
        command: String,
        dir: PathBuf,
        status: ExitStatus,
        tail: Tail,
    },

    #[error(
        "the eBPF build succeeded but no BPF object named `{BIN_NAME}` was found (cargo reported \
         {reported:?}; searched {})",
        searched.display()
    )]
    ObjectNotFound {
        reported: Vec<PathBuf>,
        searched: PathBuf,
    },

    #[error(
        "{} lacks the program(s) {missing:?} (it has {found:?}); is an entry in \
         ebpf/programs/src/main.rs missing or renamed?",
        object.display()
    )]
    MissingPrograms {
        object: PathBuf,
        missing: Vec<String>,
        found: Vec<String>,
    },

    #[error("could not read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("could not write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The last lines a failed command printed, shown one per line.
#[derive(Debug, Clone, Default)]
pub struct Tail(pub Vec<String>);

impl fmt::Display for Tail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("  (no output)");
        }
        for (i, line) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "  {line}")?;
        }
        Ok(())
    }
}

/// The workspace root (`/…/calix`), fixed when this crate is compiled.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    // ebpf/builder → ebpf → root
    match manifest_dir.ancestors().nth(2) {
        Some(root) => root.to_path_buf(),
        None => manifest_dir.join("../.."),
    }
}

/// The eBPF crate (`ebpf/programs`).
pub fn programs_dir() -> PathBuf {
    workspace_root().join("ebpf").join("programs")
}

/// Every file or directory whose change can change the object: for `cargo:rerun-if-changed`.
/// Directories are fine there (cargo walks them). Not the whole `ebpf/programs`, which may hold
/// a `target/` from a build run there by hand.
pub fn ebpf_sources() -> Vec<PathBuf> {
    let root = workspace_root();
    let programs = programs_dir();
    vec![
        programs.join("src"),
        programs.join("Cargo.toml"),
        programs.join("Cargo.lock"),
        root.join("ebpf").join("common").join("src"),
        root.join("ebpf").join("common").join("Cargo.toml"),
    ]
}

/// `$CARGO_TARGET_DIR/ebpf` when that is set (a relative value is taken from the workspace
/// root), else `<root>/target/ebpf`. The nested cargo builds in `<this>/<arch>/`; xtask puts the
/// object at `<this>/calix.bpf.o`.
pub fn ebpf_target_dir() -> PathBuf {
    let root = workspace_root();
    match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => root.join(dir).join("ebpf"),
        None => root.join("target").join("ebpf"),
    }
}

/// Builds the eBPF object from the current sources and copies it to `<out_dir>/calix.bpf.o`,
/// returning that path. Cheap when nothing changed (the nested cargo finds everything fresh).
///
/// The nested cargo's progress goes to this process's stderr as it happens; on failure the
/// error carries its last lines.
pub fn build_ebpf(out_dir: &Path) -> Result<PathBuf, BuildError> {
    build(out_dir, None)
}

/// The same build with one cargo feature of the eBPF crate turned on (e.g. `upgrade-test`, a
/// build whose programs differ, for the agent-upgrade test), installed as
/// `<out_dir>/calix-<feature>.bpf.o`.
pub fn build_ebpf_feature(out_dir: &Path, feature: &str) -> Result<PathBuf, BuildError> {
    build(out_dir, Some(feature))
}

fn build(out_dir: &Path, feature: Option<&str>) -> Result<PathBuf, BuildError> {
    let target = BpfTarget::from_build_env();
    let tools = toolchain::check()?;
    // One cargo target directory per arch (and feature): cargo re-links `release/calix` to the
    // variant of the last build, so two variants sharing a directory could hand one build the
    // other's object.
    let target_dir = match feature {
        None => ebpf_target_dir().join(&target.arch),
        Some(f) => ebpf_target_dir().join(format!("{}-{f}", target.arch)),
    };
    let programs = programs_dir();

    let mut cmd = Command::new(&tools.cargo);
    cmd.arg(format!("+{TOOLCHAIN}"))
        .args(["build", "--release", "--bins", "-Z", "build-std=core"])
        .args(feature.map(|f| format!("--features={f}")))
        .args(["--message-format", "json-render-diagnostics"])
        .args(["--target", target.triple()])
        .arg("--target-dir")
        .arg(&target_dir)
        .current_dir(&programs);
    env::clean(&mut cmd);
    cmd.env("PATH", &tools.path)
        .env("CARGO_ENCODED_RUSTFLAGS", target.encoded_rustflags());
    let command = describe(&cmd);

    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| BuildError::Spawn {
            command: command.clone(),
            source,
        })?;

    // stderr: progress and rendered diagnostics. Echo it and keep the tail for the error.
    let stderr = child.stderr.take();
    let tail = thread::spawn(move || {
        let mut tail = VecDeque::with_capacity(TAIL_LINES);
        let Some(stderr) = stderr else { return tail };
        let mut echo = io::stderr().lock();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            // Losing the echo (a closed stderr) must not lose the build.
            let _ = writeln!(echo, "{line}");
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        }
        tail
    });

    // stdout: one JSON message per line; the artifact messages name the object.
    let mut reported = Vec::new();
    let mut read_error = None;
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            match line {
                Ok(line) => reported.extend(locate::artifact_paths(&line, BIN_NAME)),
                Err(e) => {
                    // Nobody reads its stdout any more: stop it rather than wait on a full pipe.
                    let _ = child.kill();
                    read_error = Some(e);
                    break;
                }
            }
        }
    }

    // Reap the child even when its output could not be read.
    let status = child.wait();
    let tail = tail.join().unwrap_or_default();
    let output_err = |source| BuildError::Output {
        command: command.clone(),
        source,
    };
    if let Some(e) = read_error {
        return Err(output_err(e));
    }
    let status = status.map_err(output_err)?;
    if !status.success() {
        return Err(BuildError::CargoFailed {
            command,
            dir: programs,
            status,
            tail: Tail(tail.into()),
        });
    }

    let release_dir = target_dir.join(target.triple()).join("release");
    let object = locate::find_object(&reported, &release_dir, BIN_NAME).ok_or_else(|| {
        BuildError::ObjectNotFound {
            reported: reported.clone(),
            searched: release_dir.clone(),
        }
    })?;
    check_programs(&object)?;
    let name = match feature {
        None => OBJECT_FILE.to_string(),
        Some(f) => format!("calix-{f}.bpf.o"),
    };
    install(&object, out_dir, &name)
}

/// Fails unless every program in [`EXPECTED_PROGRAMS`] is in `object`.
fn check_programs(object: &Path) -> Result<(), BuildError> {
    let bytes = fs::read(object).map_err(|source| BuildError::Read {
        path: object.to_path_buf(),
        source,
    })?;
    let found: Vec<String> = programs(&bytes)
        .unwrap_or_default()
        .into_iter()
        .map(|p| p.name)
        .collect();
    let missing: Vec<String> = EXPECTED_PROGRAMS
        .iter()
        .filter(|name| !found.iter().any(|f| f == *name))
        .map(|name| (*name).to_owned())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(BuildError::MissingPrograms {
            object: object.to_path_buf(),
            missing,
            found,
        })
    }
}

/// Copies `object` to `<out_dir>/<name>` through a temporary file, so a reader never sees
/// half an object.
fn install(object: &Path, out_dir: &Path, name: &str) -> Result<PathBuf, BuildError> {
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BuildError::Write { path, source }
    };
    fs::create_dir_all(out_dir).map_err(write_err(out_dir))?;
    let dest = out_dir.join(name);
    let tmp = out_dir.join(format!("{name}.tmp"));
    fs::copy(object, &tmp).map_err(write_err(&tmp))?;
    fs::rename(&tmp, &dest).map_err(write_err(&dest))?;
    Ok(dest)
}

/// The BPF target to build for: the byte order and arch of the target the caller is built for
/// when cargo says (a build script), else of the host (xtask). Set explicitly either way, so
/// xtask and a native agent build pass identical flags and share one build.
struct BpfTarget {
    big_endian: bool,
    /// `bpf_target_arch` for aya-ebpf (it picks the `pt_regs` layout).
    arch: String,
}

impl BpfTarget {
    fn from_build_env() -> Self {
        let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
        let big_endian = match var("CARGO_CFG_TARGET_ENDIAN") {
            Some(endian) => endian == "big",
            None => cfg!(target_endian = "big"),
        };
        let arch = var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|| std::env::consts::ARCH.into());
        // aya-ebpf knows "riscv64", not the "riscv64gc"-style names.
        let arch = if arch.starts_with("riscv64") {
            "riscv64".to_owned()
        } else {
            arch
        };
        Self { big_endian, arch }
    }

    fn triple(&self) -> &'static str {
        if self.big_endian {
            "bpfeb-unknown-none"
        } else {
            "bpfel-unknown-none"
        }
    }

    /// As the aya template: full debug info, from which bpf-linker emits the BTF aya needs.
    fn encoded_rustflags(&self) -> OsString {
        let arch = format!("--cfg=bpf_target_arch=\"{}\"", self.arch);
        ["-Cdebuginfo=2", "-Clink-arg=--btf", &arch]
            .join("\x1f")
            .into()
    }
}

/// `program arg arg…` for messages.
fn describe(cmd: &Command) -> String {
    let mut out = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        out.push(' ');
        out.push_str(&arg.to_string_lossy());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_point_into_this_workspace() {
        let root = workspace_root();
        assert!(root.join("Cargo.toml").is_file(), "{}", root.display());
        for path in ebpf_sources() {
            assert!(path.starts_with(&root), "{}", path.display());
        }
        assert!(programs_dir().join("Cargo.toml").is_file());
        assert!(root.join("ebpf/common/src").is_dir());
    }

    #[test]
    fn rustflags_are_unit_separated() {
        let target = BpfTarget {
            big_endian: false,
            arch: "aarch64".into(),
        };
        assert_eq!(target.triple(), "bpfel-unknown-none");
        assert_eq!(
            target.encoded_rustflags(),
            "-Cdebuginfo=2\x1f-Clink-arg=--btf\x1f--cfg=bpf_target_arch=\"aarch64\""
        );
        let big = BpfTarget {
            big_endian: true,
            arch: "s390x".into(),
        };
        assert_eq!(big.triple(), "bpfeb-unknown-none");
    }

    #[test]
    fn tail_is_indented_one_line_each() {
        let tail = Tail(vec!["error: x".into(), "  --> y".into()]);
        assert_eq!(tail.to_string(), "  error: x\n    --> y");
        assert_eq!(Tail::default().to_string(), "  (no output)");
    }
}
