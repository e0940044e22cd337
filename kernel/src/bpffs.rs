//! The BPF filesystem at `/sys/fs/bpf`, where calix pins its maps and programs.
//!
//! A fresh machine (or a container, or a mount namespace) may not have it mounted. Everything
//! that pins — the agent, the program tests, xtask — mounts it through [`ensure_mounted`],
//! which serialises concurrent callers with a lock on the mount point, so two agents starting
//! at once never stack two bpffs instances (the second would hide the first's pins).
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::Mode;
use std::path::{Path, PathBuf};

/// Where the kernel's BPF filesystem is mounted by convention.
pub const MOUNT_POINT: &str = "/sys/fs/bpf";

#[derive(Debug, thiserror::Error)]
pub enum BpffsError {
    #[error("cannot inspect {path}")]
    Stat {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("cannot lock {path} while mounting bpffs")]
    Lock {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("cannot mount bpffs at {path} (needs root, CAP_SYS_ADMIN)")]
    Mount {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
}

/// Whether `path` is the root of (or inside) a mounted bpffs.
pub fn is_bpffs(path: &Path) -> Result<bool, BpffsError> {
    let st = nix::sys::statfs::statfs(path).map_err(|source| BpffsError::Stat {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(st.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}

/// Mounts bpffs at [`MOUNT_POINT`] unless it is mounted there already, when `pin_root` lies
/// below it (a pin root elsewhere is the caller's own bpffs). Returns whether it mounted.
pub fn ensure_mounted_for(pin_root: &Path) -> Result<bool, BpffsError> {
    if !pin_root.starts_with(MOUNT_POINT) {
        return Ok(false);
    }
    ensure_mounted()
}

/// Mounts bpffs at [`MOUNT_POINT`] unless it is mounted there already. Returns whether it
/// mounted. Safe to call from several processes at once.
pub fn ensure_mounted() -> Result<bool, BpffsError> {
    let point = Path::new(MOUNT_POINT);
    if is_bpffs(point)? {
        return Ok(false);
    }
    // Lock the mount point's directory (the sysfs one, before the mount): whoever holds it
    // re-checks, so only the first of several racing callers mounts.
    let lock_err = |source| BpffsError::Lock {
        path: point.to_path_buf(),
        source,
    };
    let dir = nix::fcntl::open(
        point,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(lock_err)?;
    let _lock = Flock::lock(dir, FlockArg::LockExclusive).map_err(|(_, e)| lock_err(e))?;
    if is_bpffs(point)? {
        return Ok(false);
    }
    nix::mount::mount(
        Some("bpf"),
        point,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|source| BpffsError::Mount {
        path: point.to_path_buf(),
        source,
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_roots_elsewhere_are_left_alone() {
        assert!(!ensure_mounted_for(Path::new("/tmp/not-bpffs")).expect("no-op"));
    }

    #[test]
    fn a_plain_directory_is_not_bpffs() {
        assert!(!is_bpffs(Path::new("/")).expect("statfs /"));
    }
}
