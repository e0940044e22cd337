//! `cargo xtask image`: the calix image, built offline. The binaries as static musl
//! executables (release), stripped copies staged in target/image/context (the build context
//! holds only them), `podman build` from the Containerfile (FROM scratch: nothing to pull),
//! every file of the built image checked (exported, no dynamically linked ELF: no program
//! calix runs needs a libc or a loader, and calix execs none: nftables go over netlink),
//! then `podman save --format oci-archive` to target/image/calix.oci.tar, which containerd
//! imports (`ctr -n k8s.io images import`). The image is tagged `localhost/calix:<version>`,
//! the chart's default (`image.repository`, appVersion), and untagged from podman's store once
//! saved: the archive is the product.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::setup::MUSL_TARGET;
use crate::util::{self, output, run};

/// (package, binary) of everything in the image.
const BINARIES: &[(&str, &str)] = &[
    ("calix-agent", "calix-agent"),
    ("calix-agent", "calixctl"),
    ("calix-agent", "calix-signer"),
    ("calix-cni", "calix"),
    ("calix-install-cni", "calix-install-cni"),
    ("calix-probe", "calix-probe"),
];

pub const REPOSITORY: &str = "localhost/calix";

/// The image's tag: the workspace version, which the chart's appVersion matches.
pub fn tag() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

pub fn run_image() -> Result<PathBuf> {
    let root = util::workspace_root();
    let started = Instant::now();
    let out_dir = root.join("target").join("image");
    let context = out_dir.join("context");
    let archive = out_dir.join("calix.oci.tar");
    let reference = format!("{REPOSITORY}:{}", tag());

    println!("[1/5] building the binaries: static ({MUSL_TARGET}), release");
    let mut cargo = crate::util::cargo();
    cargo.args(["build", "--release", "--target", MUSL_TARGET]);
    let mut packages: Vec<&str> = BINARIES.iter().map(|(p, _)| *p).collect();
    packages.dedup();
    for p in &packages {
        cargo.args(["-p", p]);
    }
    for (_, bin) in BINARIES {
        cargo.args(["--bin", bin]);
    }
    run(&mut cargo).context(
        "building the image's binaries (cargo xtask setup installs the musl target and musl-tools)",
    )?;
    let built = root.join("target").join(MUSL_TARGET).join("release");

    println!("[2/5] staging {}", context.display());
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&context)?;
    for (_, bin) in BINARIES {
        let from = built.join(bin);
        let to = context.join(bin);
        check_static(&from)?;
        std::fs::copy(&from, &to)
            .with_context(|| format!("copying {} into the context", from.display()))?;
        run(Command::new("strip").arg(&to))?;
        println!(
            "      {bin}: {} (stripped, static)",
            size(std::fs::metadata(&to)?.len())
        );
    }
    std::fs::copy(root.join("Containerfile"), context.join("Containerfile"))?;

    println!("[3/5] podman build {reference} (offline: FROM scratch, no RUN)");
    run(Command::new("podman")
        .args(["build", "--pull=never", "--network=none", "--quiet", "-f"])
        .arg(context.join("Containerfile"))
        .args(["-t", &reference])
        .arg(&context))
    .context("podman build")?;
    let id = output(
        Command::new("podman").args(["image", "inspect", "--format", "{{.Id}}", &reference]),
    )?;

    println!("[4/5] checking every file of the image: no dynamically linked ELF");
    let checked = check_image(&reference, &out_dir.join("rootfs"));
    if checked.is_err() {
        let _ = output(Command::new("podman").args(["rmi", &reference]));
    }
    println!("      {} files, all static", checked?);

    println!(
        "[5/5] podman save --format oci-archive -> {}",
        archive.display()
    );
    let _ = std::fs::remove_file(&archive);
    let saved = run(Command::new("podman")
        .args(["save", "--format", "oci-archive", "-o"])
        .arg(&archive)
        .arg(&reference));
    // The archive is the product: take the tag out of podman's store either way.
    let _ = output(Command::new("podman").args(["rmi", &reference]));
    saved.context("podman save")?;
    println!(
        "image {reference} (id {}) saved: {}, {} in {:.1?}",
        &id.trim()[..12.min(id.trim().len())],
        archive.display(),
        size(std::fs::metadata(&archive)?.len()),
        started.elapsed()
    );
    println!(
        "import it with: ctr -n k8s.io images import {}",
        archive.display()
    );
    Ok(archive)
}

/// Exports image `reference`'s file system (a container created, not run, then removed)
/// into `dir` and checks every file in it ([`dynamic_files`]). Returns how many files it holds.
fn check_image(reference: &str, dir: &Path) -> Result<usize> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let tar = dir.with_extension("tar");
    let id = output(Command::new("podman").args(["create", "--pull=never", reference]))?;
    let id = id.trim();
    let exported = run(Command::new("podman")
        .args(["export", "-o"])
        .arg(&tar)
        .arg(id));
    let _ = output(Command::new("podman").args(["rm", id]));
    exported.context("podman export")?;
    run(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(dir))?;
    let _ = std::fs::remove_file(&tar);
    let (files, dynamic) = dynamic_files(dir)?;
    let _ = std::fs::remove_dir_all(dir);
    if !dynamic.is_empty() {
        bail!(
            "the image holds dynamically linked files: {}",
            dynamic.join(", ")
        );
    }
    Ok(files)
}

/// Every regular file under `root` (an image's file system), and those that are dynamically
/// linked ELF objects, with why: a program that names a loader (`PT_INTERP`), an object
/// that needs shared libraries (`DT_NEEDED`), or a shared library (`DT_SONAME`). A static
/// (or static-pie) executable has none of these.
fn dynamic_files(root: &Path) -> Result<(usize, Vec<String>)> {
    let mut files = 0;
    let mut dynamic = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let entry = entry?;
            let ty = entry.file_type()?;
            if ty.is_dir() {
                dirs.push(entry.path());
                continue;
            }
            if !ty.is_file() {
                continue;
            }
            files += 1;
            let bytes = std::fs::read(entry.path())?;
            if let Some(why) = elf_dynamic(&bytes) {
                let name = entry.path();
                let name = name.strip_prefix(root).unwrap_or(&name);
                dynamic.push(format!("/{} ({why})", name.display()));
            }
        }
    }
    dynamic.sort();
    Ok((files, dynamic))
}

/// Why an ELF file is dynamically linked; `None` for a static one or a file that is not ELF.
fn elf_dynamic(b: &[u8]) -> Option<&'static str> {
    if elf_has_interp(b)? {
        return Some("a program interpreter");
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    for i in 0..usize::from(u16_at(0x38)?) {
        let ph = phoff + i * phentsize;
        // PT_DYNAMIC: its entries, (tag, value) pairs up to DT_NULL.
        if u32_at(ph)? != 2 {
            continue;
        }
        let (off, size) = (
            usize::try_from(u64_at(ph + 8)?).ok()?,
            usize::try_from(u64_at(ph + 32)?).ok()?,
        );
        for e in (off..off + size).step_by(16) {
            match u64_at(e)? {
                0 => break,
                1 => return Some("needs shared libraries"),
                14 => return Some("a shared library"),
                _ => {}
            }
        }
    }
    None
}

/// Refuses a dynamically linked binary: the image has no libc.
fn check_static(path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    // ELF program headers: a PT_INTERP (3) entry names the dynamic loader.
    let interp = elf_has_interp(&bytes)
        .with_context(|| format!("{} is not a 64-bit little-endian ELF file", path.display()))?;
    if interp {
        bail!(
            "{} is dynamically linked: the image has no libc",
            path.display()
        );
    }
    Ok(())
}

fn elf_has_interp(b: &[u8]) -> Option<bool> {
    if b.get(..4)? != b"\x7fELF" || *b.get(4)? != 2 || *b.get(5)? != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let kind = u32::from_le_bytes(
            b.get(phoff + i * phentsize..phoff + i * phentsize + 4)?
                .try_into()
                .ok()?,
        );
        if kind == 3 {
            return Some(true);
        }
    }
    Some(false)
}

fn size(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_executable_is_told_from_a_static_one() {
        // This test binary is dynamically linked (glibc).
        let me = std::fs::read(std::env::current_exe().expect("exe")).expect("read");
        assert_eq!(elf_has_interp(&me), Some(true));
        assert_eq!(elf_has_interp(b"not an elf"), None);
        // busybox-static (cargo xtask setup installs it) has no interpreter.
        let b = std::fs::read("/bin/busybox").expect("busybox-static: run cargo xtask setup");
        assert_eq!(elf_has_interp(&b), Some(false));
    }

    /// What `cargo xtask image` checks in the image it built: a tree with a dynamically
    /// linked program, a shared library with its loader, a static program and a text file
    /// gives the first three, each with why.
    #[test]
    fn every_dynamically_linked_file_of_a_tree_is_found() {
        let root = std::env::temp_dir().join(format!("calix-image-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("usr/local/bin")).expect("mkdir");
        std::fs::create_dir_all(root.join("lib64")).expect("mkdir");
        let copy = |from: &Path, to: &str| {
            std::fs::copy(from, root.join(to)).expect("copy");
        };
        copy(
            &std::env::current_exe().expect("exe"),
            "usr/local/bin/dynamic",
        );
        copy(Path::new("/bin/busybox"), "usr/local/bin/static");
        let loader = Path::new("/lib64/ld-linux-x86-64.so.2");
        copy(loader, "lib64/ld-linux-x86-64.so.2");
        std::fs::write(root.join("usr/local/bin/notes.txt"), "not ELF").expect("write");
        let (files, dynamic) = dynamic_files(&root).expect("walk");
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(files, 4);
        assert_eq!(
            dynamic,
            [
                "/lib64/ld-linux-x86-64.so.2 (a shared library)",
                "/usr/local/bin/dynamic (a program interpreter)"
            ]
        );
        // A library that needs others (libc itself names a loader: it runs as a program).
        let libm = std::fs::read("/lib/x86_64-linux-gnu/libm.so.6").expect("libm");
        assert_eq!(elf_dynamic(&libm), Some("needs shared libraries"));
    }
}
