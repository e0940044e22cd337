//! Container images built here, since nothing can be pulled: a rootfs of Debian's static busybox
//! (`busybox-static`, `/bin/busybox`) with a symlink per applet, and an OCI image layout tarball
//! of it (one uncompressed layer) that `ctr images import` and `podman load` take. The tests'
//! pod images and the Kubernetes nodes' pause image are this, with different commands; the
//! upstream suites' `agnhost` image adds the static `agnhost` and the host's `nc` and `curl`.
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

const BUSYBOX: &str = "/bin/busybox";
/// Directories of the rootfs.
const ROOTFS_DIRS: [&str; 8] = ["bin", "dev", "etc", "proc", "run", "sys", "tmp", "var"];
/// The applets the images offer (symlinks to busybox in /bin).
pub const APPLETS: [&str; 12] = [
    "cat", "hostname", "httpd", "ip", "nc", "ping", "sh", "sleep", "timeout", "true", "wget",
    "echo",
];

/// Whether `path` is an ELF executable without a program interpreter (statically linked).
fn is_static_elf(path: &str) -> bool {
    let Ok(b) = std::fs::read(path) else {
        return false;
    };
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 {
        return false; // not a 64-bit ELF
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().unwrap_or([0; 8])) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        // PT_INTERP = 3.
        b.get(o..o + 4)
            .is_some_and(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]) != 3)
    })
}

/// Debian's static busybox, or an error saying how to get it.
fn busybox() -> Result<Vec<u8>> {
    if !is_static_elf(BUSYBOX) {
        return Err(Error::Missing {
            field: format!("a static {BUSYBOX}"),
            value: "this machine: install busybox-static (`cargo xtask setup`)".into(),
        });
    }
    std::fs::read(BUSYBOX).map_err(Error::io(format!("read {BUSYBOX}")))
}

/// `<dir>/rootfs`: /bin/busybox (static) and a symlink per applet of [`APPLETS`].
pub fn busybox_rootfs(dir: &Path) -> Result<PathBuf> {
    let data = busybox()?;
    let root = dir.join("rootfs");
    for d in ROOTFS_DIRS {
        let p = root.join(d);
        std::fs::create_dir_all(&p).map_err(Error::io(format!("create {}", p.display())))?;
    }
    let bb = root.join("bin/busybox");
    std::fs::write(&bb, data).map_err(Error::io(format!("write {}", bb.display())))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bb, std::fs::Permissions::from_mode(0o755))
        .map_err(Error::io(format!("chmod {}", bb.display())))?;
    for a in APPLETS {
        let link = root.join("bin").join(a);
        std::os::unix::fs::symlink("busybox", &link)
            .map_err(Error::io(format!("symlink {}", link.display())))?;
    }
    Ok(root)
}

fn sha256_hex(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

fn tar_entry(
    b: &mut tar::Builder<Vec<u8>>,
    path: &str,
    kind: tar::EntryType,
    mode: u32,
    data: &[u8],
) -> Result<()> {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(data.len() as u64);
    b.append_data(&mut h, path, data)
        .map_err(Error::io(format!("tar entry {path}")))
}

/// `bin/<applet>`, a symlink to busybox, for each of `applets`.
fn applet_links(layer: &mut tar::Builder<Vec<u8>>, applets: &[&str]) -> Result<()> {
    for a in applets {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_mode(0o777);
        h.set_size(0);
        h.set_mtime(0);
        layer
            .append_link(&mut h, format!("bin/{a}"), "busybox")
            .map_err(Error::io(format!("tar symlink bin/{a}")))?;
    }
    Ok(())
}

/// An OCI image layout tarball named `name` (e.g. `localhost/cxt-busybox:test`): one
/// uncompressed layer with the busybox rootfs, `cmd` its command.
pub fn busybox_oci_tar(name: &str, cmd: &[&str]) -> Result<Vec<u8>> {
    let busybox = busybox()?;
    let mut layer = tar::Builder::new(Vec::new());
    for d in ROOTFS_DIRS {
        tar_entry(&mut layer, d, tar::EntryType::Directory, 0o755, &[])?;
    }
    tar_entry(
        &mut layer,
        "bin/busybox",
        tar::EntryType::Regular,
        0o755,
        &busybox,
    )?;
    applet_links(&mut layer, &APPLETS)?;
    let layer = layer.into_inner().map_err(Error::io("the layer tar"))?;
    oci_tar(name, &layer, cmd, &["PATH=/bin"])
}

/// Busybox's applets in the upstream suites' `agnhost` image: what their shell commands call
/// besides `nc` and `curl` (`for i in $(seq 1 N); do …; done`, `hostname`, `sleep`;
/// `nslookup <service FQDN>` for ExternalName Services: busybox's own resolver).
const AGNHOST_APPLETS: [&str; 21] = [
    "seq", "sleep", "cat", "echo", "hostname", "ip", "true", "false", "timeout", "grep", "ls",
    "ps", "env", "printf", "test", "head", "tr", "cut", "wc", "date", "nslookup",
];

/// The host tools the upstream suites' commands run with options busybox lacks, and where
/// they go in the image: OpenBSD's `nc` (`nc -v -t -w 2 host port`), `curl` and GNU `wget`
/// (Debian's static busybox `wget` segfaults in glibc's lookups: every `wget -q -O - -T 1`
/// of the suites' "service up" checks failed); and dash as `/bin/sh`, since busybox's shell
/// runs its own applets before any in `PATH` (its `nc` would answer the suite's `nc -v`).
const AGNHOST_HOST_TOOLS: [(&str, &str); 4] = [
    ("/usr/bin/nc.openbsd", "usr/bin/nc"),
    ("/usr/bin/curl", "usr/bin/curl"),
    ("/usr/bin/wget", "usr/bin/wget"),
    ("/usr/bin/dash", "bin/sh"),
];

/// The upstream suites' `agnhost` image, built here since nothing can be pulled: the static
/// `agnhost` at `/agnhost`, its entrypoint with `pause` the default argument (as upstream, so
/// a pod's `args: [netexec, …]` runs it), and the tools the suites' commands run in it through
/// `/bin/sh -c`: this machine's dash as the shell, busybox's applets, and its OpenBSD `nc` and
/// `curl`, with the shared libraries they load (as `ldd` lists them, at the same paths).
pub fn agnhost_oci_tar(name: &str, agnhost: &[u8]) -> Result<Vec<u8>> {
    let layer = agnhost_layer(agnhost)?;
    oci_tar_with(
        name,
        &layer,
        &["/agnhost"],
        &["pause"],
        &["PATH=/usr/local/bin:/usr/bin:/bin:/"],
    )
}

/// The one layer of [`agnhost_oci_tar`].
fn agnhost_layer(agnhost: &[u8]) -> Result<Vec<u8>> {
    let busybox = busybox()?;
    let mut layer = tar::Builder::new(Vec::new());
    let mut dirs = std::collections::BTreeSet::new();
    for d in ROOTFS_DIRS {
        let mode = if d == "tmp" { 0o1777 } else { 0o755 };
        tar_entry(&mut layer, d, tar::EntryType::Directory, mode, &[])?;
        dirs.insert(d.to_string());
    }
    let file = tar::EntryType::Regular;
    tar_entry(&mut layer, "agnhost", file, 0o755, agnhost)?;
    tar_entry(&mut layer, "bin/busybox", file, 0o755, &busybox)?;
    applet_links(&mut layer, &AGNHOST_APPLETS)?;
    let mut files = std::collections::BTreeMap::new();
    for (host, at) in AGNHOST_HOST_TOOLS {
        files.insert(at.to_string(), host.to_string());
        for lib in shared_libraries(host)? {
            files.insert(lib.trim_start_matches('/').to_string(), lib);
        }
    }
    for (at, host) in &files {
        let data = std::fs::read(host).map_err(Error::io(format!("read {host}")))?;
        let mut parent = String::new();
        for part in at
            .split('/')
            .collect::<Vec<_>>()
            .split_last()
            .map(|l| l.1)
            .unwrap_or(&[])
        {
            parent = if parent.is_empty() {
                part.to_string()
            } else {
                format!("{parent}/{part}")
            };
            if dirs.insert(parent.clone()) {
                tar_entry(&mut layer, &parent, tar::EntryType::Directory, 0o755, &[])?;
            }
        }
        tar_entry(&mut layer, at, file, 0o755, &data)?;
    }
    layer.into_inner().map_err(Error::io("the layer tar"))
}

/// The shared libraries `binary` loads, the dynamic loader too: the absolute paths `ldd`
/// prints (`libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)`,
/// `/lib64/ld-linux-x86-64.so.2 (0x…)`); none for a static binary.
pub fn shared_libraries(binary: &str) -> Result<Vec<String>> {
    if !Path::new(binary).is_file() {
        return Err(Error::Missing {
            field: binary.to_string(),
            value: "this machine (`cargo xtask setup` installs it)".into(),
        });
    }
    if is_static_elf(binary) {
        return Ok(Vec::new());
    }
    let out = crate::process::checked(std::process::Command::new("ldd").arg(binary))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if let Some(line) = text.lines().find(|l| l.contains("not found")) {
        return Err(Error::Missing {
            field: format!("a library of {binary}"),
            value: format!("this machine: {}", line.trim()),
        });
    }
    Ok(parse_ldd(&text))
}

/// The absolute paths of `ldd`'s output.
fn parse_ldd(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| path.to_string())
        })
        .collect()
}

/// The image layout tarball of one uncompressed `layer`.
fn oci_tar(name: &str, layer: &[u8], cmd: &[&str], env: &[&str]) -> Result<Vec<u8>> {
    oci_tar_with(name, layer, &[], cmd, env)
}

/// The image layout tarball of one uncompressed `layer`, with an entrypoint (none if empty).
fn oci_tar_with(
    name: &str,
    layer: &[u8],
    entrypoint: &[&str],
    cmd: &[&str],
    env: &[&str],
) -> Result<Vec<u8>> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let config = serde_json::json!({
        "architecture": arch,
        "os": "linux",
        "config": if entrypoint.is_empty() {
            serde_json::json!({ "Cmd": cmd, "Env": env })
        } else {
            serde_json::json!({ "Entrypoint": entrypoint, "Cmd": cmd, "Env": env })
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(layer))] },
    })
    .to_string()
    .into_bytes();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{}", sha256_hex(&config)),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{}", sha256_hex(layer)),
            "size": layer.len(),
        }],
    })
    .to_string()
    .into_bytes();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{}", sha256_hex(&manifest)),
            "size": manifest.len(),
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": name.rsplit(':').next().unwrap_or("latest"),
            },
        }],
    })
    .to_string()
    .into_bytes();
    let mut image = tar::Builder::new(Vec::new());
    let file = tar::EntryType::Regular;
    tar_entry(
        &mut image,
        "oci-layout",
        file,
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    tar_entry(&mut image, "index.json", file, 0o644, &index)?;
    tar_entry(&mut image, "blobs", tar::EntryType::Directory, 0o755, &[])?;
    tar_entry(
        &mut image,
        "blobs/sha256",
        tar::EntryType::Directory,
        0o755,
        &[],
    )?;
    for blob in [layer, &config, &manifest] {
        let path = format!("blobs/sha256/{}", sha256_hex(blob));
        tar_entry(&mut image, &path, file, 0o644, blob)?;
    }
    image.into_inner().map_err(Error::io("the image tar"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The suites' commands run in the image's root as they do in a pod: dash, OpenBSD's `nc`
    /// with its options (not busybox's), busybox's `seq`, `curl`, GNU `wget` (root: chroot).
    #[test]
    fn the_agnhost_image_runs_the_suites_shell_commands() {
        struct Gone(PathBuf);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let dir = std::env::temp_dir().join(format!("cxt-agnhost-{}", std::process::id()));
        let _gone = Gone(dir.clone());
        let layer = agnhost_layer(b"#!/bin/sh\necho agnhost \"$@\"\n").expect("the layer");
        tar::Archive::new(&layer[..])
            .unpack(&dir)
            .expect("unpack the layer");
        let out = std::process::Command::new("/usr/sbin/chroot")
            .arg(&dir)
            .args(["/bin/sh", "-x", "-c"])
            .arg(
                "echo hostName | nc -v -t -w 1 127.0.0.1 9 2>&1; \
                 for i in $(seq 1 3); do printf $i; done; echo; \
                 curl -q -s --connect-timeout 1 http://127.0.0.1:9/ || echo curl $?; \
                 wget -q -O - -T 1 http://127.0.0.1:9/ 2>&1 || echo wget $?; \
                 command -v nslookup; \
                 /agnhost pause",
            )
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin:/")
            .output()
            .expect("chroot");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The loopback of the test's own namespace: nothing listens on the discard port.
        assert!(
            stdout.contains("nc: connect to 127.0.0.1 port 9 (tcp) failed: Connection refused"),
            "OpenBSD's nc: {stdout}\n{stderr}"
        );
        assert!(stdout.contains("\n123\n"), "{stdout}");
        assert!(
            stdout.contains("curl 7"),
            "curl's exit code 7, no connection: {stdout}"
        );
        assert!(
            stdout.contains("wget 4"),
            "GNU wget's exit code 4, a network failure (busybox's segfaults: 139): {stdout}"
        );
        assert!(stdout.contains("/bin/nslookup"), "{stdout}");
        assert!(stdout.contains("agnhost pause"), "{stdout}");
    }

    #[test]
    fn ldd_output_gives_the_libraries_and_the_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibcurl.so.4 => /lib/x86_64-linux-gnu/libcurl.so.4 (0x00007f10)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f20)\n\
                    \tlibgone.so.1 => not found\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f30)\n";
        assert_eq!(
            parse_ldd(text),
            [
                "/lib/x86_64-linux-gnu/libcurl.so.4",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
        );
    }
}
