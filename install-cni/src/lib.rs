//! `calix-install-cni`: what the calix DaemonSet's init container does on each node. It
//! copies the static `calix` plugin into the node's CNI bin dir and writes
//! `10-calix.conflist` (calix, then portmap) into its CNI conf dir, each atomically (a
//! temporary file in the same directory, then a rename: [`atomic`]); a second run with the
//! same inputs writes nothing. [`uninstall`] removes the conflist (when it is calix's), so the
//! runtime stops sending new pods to calix; the binary stays for the pods that still need
//! their DEL.
pub mod atomic;
pub mod conflist;

use std::path::{Path, PathBuf};

pub use atomic::Outcome;
pub use conflist::Conflist;

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(
        "the CNI {what} {path} does not exist or is not a directory (is the host path mounted?)"
    )]
    NotADirectory { what: &'static str, path: PathBuf },
    #[error("plugin binary {path} cannot be read")]
    Source {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("plugin binary {path} is not a regular executable file")]
    NotExecutable { path: PathBuf },
    #[error("{path} has no parent directory")]
    NoParent { path: PathBuf },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{key} {value:?} {why}")]
    Config {
        key: &'static str,
        value: String,
        why: &'static str,
    },
    /// The plugin's own error: its CNI code, message and what to do.
    #[error("the calix plugin would refuse this configuration: {} ({})", .0.msg, .0.details)]
    Refused(calix_cni::error::CniError),
    #[error(
        "`portmap` is not in the CNI bin dir {bin_dir}: the conflist chains it after calix \
         (hostPort). Install the CNI reference plugins on the node, or turn portmap off \
         (--no-portmap; chart value cni.portmap=false)"
    )]
    NoPortmap { bin_dir: PathBuf },
    #[error("cannot encode the conflist")]
    Json {
        #[source]
        source: serde_json::Error,
    },
}

/// Where to install and what.
#[derive(Debug, Clone)]
pub struct Install {
    /// The node's CNI bin dir (as mounted in the container).
    pub bin_dir: PathBuf,
    /// The node's CNI conf dir (as mounted in the container).
    pub net_dir: PathBuf,
    /// Binaries to put into `bin_dir`, each under its own file name.
    pub plugins: Vec<PathBuf>,
    /// The conflist's file name in `net_dir`.
    pub file_name: String,
    pub conflist: Conflist,
}

/// What an install did, file by file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub files: Vec<(PathBuf, Outcome)>,
    /// Network configs in the conf dir that sort before calix's: a runtime that uses the
    /// first file (containerd, CRI-O) would use them instead.
    pub shadowed_by: Vec<PathBuf>,
    /// A crashed run's temporary files, removed.
    pub stale_removed: Vec<PathBuf>,
}

fn require_dir(what: &'static str, path: &Path) -> Result<(), InstallError> {
    if path.is_dir() {
        Ok(())
    } else {
        Err(InstallError::NotADirectory {
            what,
            path: path.to_path_buf(),
        })
    }
}

/// A file name only (no directory part, not `.`/`..`): a conflist name from the command line
/// must not write elsewhere.
fn check_file_name(name: &str) -> Result<(), InstallError> {
    let ok = !name.is_empty()
        && !name.contains('/')
        && name != "."
        && name != ".."
        && name.ends_with(".conflist");
    if ok {
        Ok(())
    } else {
        Err(InstallError::Config {
            key: "conflist file name",
            value: name.to_string(),
            why: "must be a plain file name ending in .conflist",
        })
    }
}

/// Installs the plugins, then the conflist (so the runtime never sees a config whose plugin
/// is missing). Everything is checked before anything is written.
pub fn install(spec: &Install) -> Result<Report, InstallError> {
    require_dir("bin dir", &spec.bin_dir)?;
    require_dir("conf dir", &spec.net_dir)?;
    check_file_name(&spec.file_name)?;
    let text = spec.conflist.render()?;
    let mut binaries = Vec::new();
    for path in &spec.plugins {
        let name = path
            .file_name()
            .ok_or_else(|| InstallError::NotExecutable {
                path: path.to_path_buf(),
            })?;
        binaries.push((spec.bin_dir.join(name), read_executable(path)?));
    }
    let portmap = spec.bin_dir.join("portmap");
    if spec.conflist.portmap && !portmap.is_file() && !binaries.iter().any(|(to, _)| *to == portmap)
    {
        return Err(InstallError::NoPortmap {
            bin_dir: spec.bin_dir.clone(),
        });
    }
    let mut stale_removed = atomic::remove_stale_temporaries(&spec.bin_dir);
    stale_removed.extend(atomic::remove_stale_temporaries(&spec.net_dir));
    let mut files = Vec::new();
    for (to, content) in binaries {
        let outcome = atomic::replace(&to, &content, 0o755)?;
        files.push((to, outcome));
    }
    let to = spec.net_dir.join(&spec.file_name);
    files.push((to.clone(), atomic::replace(&to, text.as_bytes(), 0o644)?));
    Ok(Report {
        files,
        shadowed_by: shadowing(&spec.net_dir, &spec.file_name),
        stale_removed,
    })
}

fn read_executable(path: &Path) -> Result<Vec<u8>, InstallError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|source| InstallError::Source {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(InstallError::NotExecutable {
            path: path.to_path_buf(),
        });
    }
    std::fs::read(path).map_err(|source| InstallError::Source {
        path: path.to_path_buf(),
        source,
    })
}

/// Network config files in `dir` that a runtime would pick before `ours` (it takes the first
/// `.conf`, `.conflist` or `.json` file in lexical order).
fn shadowing(dir: &Path, ours: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut before: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let config = [".conf", ".conflist", ".json"]
                .iter()
                .any(|ext| name.ends_with(ext));
            config && name.as_str() < ours && e.path().is_file()
        })
        .map(|e| e.path())
        .collect();
    before.sort();
    before
}

/// What [`uninstall`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    Removed,
    /// Nothing there: already uninstalled.
    Absent,
    /// A file of that name that is not calix's: left alone.
    NotOurs,
}

/// Removes `net_dir/file_name` if it is calix's conflist. Idempotent.
pub fn uninstall(net_dir: &Path, file_name: &str) -> Result<Removal, InstallError> {
    check_file_name(file_name)?;
    let path = net_dir.join(file_name);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Removal::Absent),
        Err(source) => {
            return Err(InstallError::Io {
                what: "reading",
                path,
                source,
            })
        }
    };
    if !conflist::is_calix(&text) {
        return Ok(Removal::NotOurs);
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(Removal::Removed),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Removal::Absent),
        Err(source) => Err(InstallError::Io {
            what: "removing",
            path,
            source,
        }),
    }
}
