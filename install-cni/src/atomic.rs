//! Replacing a file so that nobody ever sees half of it: the new content goes to a temporary
//! file in the same directory (same filesystem), is flushed to disk, and is renamed over the
//! old name in one step. A reader opens either the old file or the new one, whole; a running
//! program keeps executing the old inode (no `ETXTBSY`, which copying over it would give).
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::InstallError;

/// What [`replace`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The file had exactly this content and mode already: nothing was written.
    Unchanged,
    Written,
}

/// Temporary files start with this; a crashed run's leftovers are recognisable (and removed
/// by [`remove_stale_temporaries`]).
pub const TEMP_PREFIX: &str = ".calix-install.";

/// Makes `path` hold `content` with permission bits `mode`, atomically (see the module).
pub fn replace(path: &Path, content: &[u8], mode: u32) -> Result<Outcome, InstallError> {
    if is_current(path, content, mode) {
        return Ok(Outcome::Unchanged);
    }
    let dir = path.parent().ok_or_else(|| InstallError::NoParent {
        path: path.to_path_buf(),
    })?;
    let (temp, mut file) = Temp::create(dir, mode)?;
    let io = |source| InstallError::Io {
        what: "writing",
        path: temp.path.clone(),
        source,
    };
    file.write_all(content).map_err(io)?;
    // The mode asked for, whatever the umask took away at creation.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    temp.persist(path)?;
    // The rename itself survives a crash once the directory is synced.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| InstallError::Io {
            what: "syncing",
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(Outcome::Written)
}

/// Whether `path` is a regular file with exactly `content` and `mode`.
fn is_current(path: &Path, content: &[u8], mode: u32) -> bool {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return false;
    };
    meta.is_file()
        && meta.permissions().mode() & 0o7777 == mode
        && meta.len() == content.len() as u64
        && fs::read(path).is_ok_and(|old| old == content)
}

/// A temporary file older than this is a crashed run's (a live one exists for milliseconds);
/// younger ones may belong to another installer writing into the same directory right now.
pub const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// Removes temporary files a crashed run left in `dir`: only ours ([`TEMP_PREFIX`]), only
/// those older than [`STALE_AFTER`]. (They never load as network configs: the runtimes read
/// `.conf`, `.conflist` and `.json` files only.)
pub fn remove_stale_temporaries(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return removed;
    };
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= STALE_AFTER);
        if e.file_name().to_string_lossy().starts_with(TEMP_PREFIX)
            && stale
            && fs::remove_file(e.path()).is_ok()
        {
            removed.push(e.path());
        }
    }
    removed
}

/// A temporary file, removed on drop unless it was renamed into place.
struct Temp {
    path: PathBuf,
}

impl Temp {
    fn create(dir: &Path, mode: u32) -> Result<(Self, File), InstallError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut last = None;
        // A name nobody else uses: pid and a counter; create_new refuses to reuse one.
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!("{TEMP_PREFIX}{}.{n}", std::process::id()));
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&path)
            {
                Ok(file) => return Ok((Self { path }, file)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(source) => {
                    return Err(InstallError::Io {
                        what: "creating a temporary file in",
                        path: dir.to_path_buf(),
                        source,
                    })
                }
            }
        }
        Err(InstallError::Io {
            what: "creating a temporary file in",
            path: dir.to_path_buf(),
            source: last.unwrap_or_else(|| std::io::Error::other("no free name")),
        })
    }

    fn persist(mut self, to: &Path) -> Result<(), InstallError> {
        fs::rename(&self.path, to).map_err(|source| InstallError::Io {
            what: "renaming into place",
            path: to.to_path_buf(),
            source,
        })?;
        // Renamed: nothing left to remove.
        self.path = PathBuf::new();
        Ok(())
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = fs::remove_file(&self.path);
        }
    }
}
