//! `cargo xtask image`: the calix image, built offline. The binaries as static musl
//! executables (release), stripped copies staged in target/image/context (the build context
//! holds only them), `podman build` from the Containerfile (FROM scratch: nothing to pull),
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

    println!("[1/4] building the binaries: static ({MUSL_TARGET}), release");
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

    println!("[2/4] staging {}", context.display());
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
    let files = stage_nft(&context.join("rootfs"))?;
    println!(
        "      nft and the {} shared libraries it loads (rootfs/)",
        files - 1
    );
    std::fs::copy(root.join("Containerfile"), context.join("Containerfile"))?;

    println!("[3/4] podman build {reference} (offline: FROM scratch, no RUN)");
    run(Command::new("podman")
        .args(["build", "--pull=never", "--network=none", "--quiet", "-f"])
        .arg(context.join("Containerfile"))
        .args(["-t", &reference])
        .arg(&context))
    .context("podman build")?;
    let id = output(
        Command::new("podman").args(["image", "inspect", "--format", "{{.Id}}", &reference]),
    )?;

    println!(
        "[4/4] podman save --format oci-archive -> {}",
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

/// The agent writes its nftables tables with `nft -f -` (agent/src/dataplane/nft.rs), so the
/// image carries the node OS's `nft` with the shared libraries it loads (ldd) and its dynamic
/// loader, at their paths below `rootfs`: the one dynamically linked program in the image.
/// Returns how many files were staged.
fn stage_nft(rootfs: &Path) -> Result<usize> {
    let nft = PathBuf::from("/usr/sbin/nft");
    if !nft.is_file() {
        bail!(
            "{} is missing (cargo xtask setup installs nftables)",
            nft.display()
        );
    }
    let ldd = output(Command::new("ldd").arg(&nft))?;
    let mut files = vec![nft];
    files.extend(ldd_paths(&ldd));
    for f in &files {
        let to = rootfs.join(f.strip_prefix("/").unwrap_or(f));
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // (Follows symlinks: the file under the name the loader asks for.)
        std::fs::copy(f, &to).with_context(|| format!("copying {} into the image", f.display()))?;
    }
    Ok(files.len())
}

/// The absolute paths of the libraries `ldd` lists (`name => /path (addr)`, or the loader as
/// `/path (addr)`; the vDSO has no file).
fn ldd_paths(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
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
    fn ldd_output_gives_the_files_to_copy() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibnftables.so.1 => /lib/x86_64-linux-gnu/libnftables.so.1 (0x00007f20)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f20d9465000)\n\tlibgone.so => not found\n";
        assert_eq!(
            ldd_paths(text),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libnftables.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
    }

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
}
