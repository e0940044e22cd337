//! One agent per node. The agent takes an exclusive lock on `<socket dir>/agent.lock` (next to
//! its socket, the path every client and the CNI plugin share) before it touches anything: a
//! second agent started by mistake (a stuck DaemonSet rollout, an operator's manual run) exits
//! with a clear error and leaves the running agent's socket, programs, maps and nftables alone.
//! The lock goes with the process (kill -9 included), so a crash never blocks the next start.
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error(
        "another calix-agent{} already runs for {socket}: it holds {lock}. Stop it first \
         (this one changed nothing)",
        .pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    AlreadyRunning {
        socket: PathBuf,
        lock: PathBuf,
        pid: Option<u32>,
    },
    #[error("cannot use the instance lock {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Held for the agent's lifetime.
pub struct InstanceLock {
    _lock: Flock<File>,
    path: PathBuf,
}

/// The lock file of the agent serving `socket`.
pub fn lock_path(socket: &Path) -> PathBuf {
    socket.with_file_name("agent.lock")
}

impl InstanceLock {
    /// Takes the lock of the agent serving `socket`, or fails at once if another holds it.
    pub fn acquire(socket: &Path) -> Result<Self, InstanceError> {
        let path = lock_path(socket);
        let io = |source| InstanceError::Io {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(InstanceError::AlreadyRunning {
                    socket: socket.to_path_buf(),
                    lock: path,
                    pid: text.trim().parse().ok(),
                });
            }
            Err((_, e)) => return Err(io(std::io::Error::from(e))),
        };
        // Our pid, for the next one's error message.
        lock.set_len(0).map_err(io)?;
        lock.rewind().map_err(io)?;
        writeln!(lock, "{}", std::process::id()).map_err(io)?;
        Ok(Self { _lock: lock, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_instance_is_refused_and_names_the_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("agent.sock");
        let first = InstanceLock::acquire(&socket).expect("first");
        assert_eq!(first.path(), dir.path().join("agent.lock"));
        match InstanceLock::acquire(&socket) {
            Err(InstanceError::AlreadyRunning { pid, .. }) => {
                assert_eq!(pid, Some(std::process::id()))
            }
            other => panic!("second instance: {:?}", other.map(|l| l.path().to_owned())),
        }
        drop(first);
        InstanceLock::acquire(&socket).expect("free again once the first is gone");
    }
}
