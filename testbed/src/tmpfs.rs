//! A small tmpfs: a disk that can be filled.
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::process::run_ok;
use crate::unique;

/// A small tmpfs mounted on a fresh `cxt` directory under /tmp (a disk that can be filled);
/// unmounted and removed on drop, even when the test fails.
pub struct Tmpfs {
    pub dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (mount(8) syntax, e.g. "2m").
    pub fn mount(tag: &str, size: &str) -> Self {
        crate::require_root();
        let dir = std::env::temp_dir().join(unique(tag));
        std::fs::create_dir(&dir).expect("tmpfs mount point");
        // The guard exists before the mount, so a failure below still removes the directory.
        let fs = Self { dir };
        run_ok(
            Command::new("mount")
                .args([
                    "-t",
                    "tmpfs",
                    "-o",
                    &format!("size={size},mode=0700"),
                    "tmpfs",
                ])
                .arg(&fs.dir),
        );
        fs
    }

    /// Fills the file system with `<dir>/filler` until a write fails with ENOSPC; returns the
    /// filler's size.
    pub fn fill(&self) -> u64 {
        use std::io::Write;
        let mut f = std::fs::File::create(self.filler()).expect("filler");
        for chunk in [64 * 1024, 4096, 1] {
            let buf = vec![0xa5u8; chunk];
            loop {
                match f.write(&buf) {
                    Ok(n) if n > 0 => {}
                    Ok(_) => break,
                    Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                    Err(e) => panic!("filling {}: {e}", self.dir.display()),
                }
            }
        }
        f.metadata().expect("filler size").len()
    }

    /// Frees `bytes` of the filler.
    pub fn free(&self, bytes: u64) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.filler())
            .expect("filler");
        let len = f.metadata().expect("filler size").len();
        f.set_len(len.saturating_sub(bytes)).expect("shrink filler");
    }

    fn filler(&self) -> PathBuf {
        self.dir.join("filler")
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let umount = |lazy: bool| {
            let mut c = Command::new("umount");
            if lazy {
                c.arg("-l");
            }
            c.arg(&self.dir)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !umount(false) && !umount(true) {
            eprintln!("cannot unmount {}", self.dir.display());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
