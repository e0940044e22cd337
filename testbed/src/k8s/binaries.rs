//! The shared Kubernetes binaries, checked against their SHA-256 and decompressed into
//! `target/k8s/`; where calix's CRDs are.
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::{Error, Result};

/// The workspace's root (this crate is `<root>/testbed`).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testbed/ has a parent")
        .to_path_buf()
}

/// Where calix's CRDs are: `charts/calix/crds/`.
pub fn crds_dir() -> PathBuf {
    workspace_root().join("charts/calix/crds")
}

/// The shared Kubernetes binaries: `$CALIX_K8S_BIN_DIR`, else `<root>/../shared/k8s/bin`.
fn shared_bin_dir() -> PathBuf {
    std::env::var_os("CALIX_K8S_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/k8s/bin"))
}

/// `target/k8s/kube-apiserver`, decompressed from the shared `.xz` when missing or not from
/// the `.xz` whose checksum `SHA256SUMS` lists (checked first).
pub fn kube_apiserver() -> Result<PathBuf> {
    k8s_binary("kube-apiserver")
}

/// A shared Kubernetes binary (`kube-apiserver`, `kubelet`...), decompressed into
/// `target/k8s/` once its `.xz` matches `SHA256SUMS`.
pub fn k8s_binary(name: &str) -> Result<PathBuf> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let shared = shared_bin_dir();
    let xz = shared.join(format!("{name}.xz"));
    let sums = shared.join("SHA256SUMS");
    let sums_text = std::fs::read_to_string(&sums).map_err(Error::io(format!(
        "read {} (the shared Kubernetes binaries)",
        sums.display()
    )))?;
    let want = sums_text
        .lines()
        .filter_map(|l| l.split_once("  "))
        .find(|(_, f)| f.trim() == format!("{name}.xz"))
        .map(|(sum, _)| sum.trim().to_string())
        .ok_or_else(|| Error::Missing {
            field: format!("{name}.xz"),
            value: sums.display().to_string(),
        })?;
    let cache = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("k8s");
    let bin = cache.join(name);
    let stamp = cache.join(format!("{name}.sha256"));
    if bin.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        return Ok(bin);
    }
    let data = std::fs::read(&xz).map_err(Error::io(format!("read {}", xz.display())))?;
    use sha2::Digest;
    let got: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if got != want {
        return Err(Error::Unexpected {
            what: xz.display().to_string(),
            found: format!("SHA-256 {got}"),
            expected: format!("{want} (SHA256SUMS)"),
        });
    }
    std::fs::create_dir_all(&cache).map_err(Error::io(format!("create {}", cache.display())))?;
    let tmp = cache.join(format!(".{name}.{}", std::process::id()));
    let out =
        std::fs::File::create(&tmp).map_err(Error::io(format!("create {}", tmp.display())))?;
    let status = std::process::Command::new("xz")
        .arg("-dc")
        .arg(&xz)
        .stdout(out)
        .status()
        .map_err(|source| Error::Spawn {
            cmd: "xz -dc (apt-get install xz-utils; cargo xtask setup does)".into(),
            source,
        })?;
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Unexpected {
            what: format!("xz -dc {}", xz.display()),
            found: status.to_string(),
            expected: "success".into(),
        });
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(Error::io(format!("chmod {}", tmp.display())))?;
    std::fs::rename(&tmp, &bin).map_err(Error::io(format!("rename to {}", bin.display())))?;
    std::fs::write(&stamp, &want).map_err(Error::io(format!("write {}", stamp.display())))?;
    Ok(bin)
}
