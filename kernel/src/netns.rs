//! Network namespaces: open one, run code inside it, talk netlink inside it.
//!
//! Rules this module enforces (STYLE.md, "Netlink and namespaces"):
//! - Code that must run inside another namespace runs on a dedicated, short-lived std thread that
//!   `setns`es into it and then exits. No thread ever goes back to the caller's namespace, so no
//!   thread can be left behind in a pod's namespace, and no tokio worker thread ever moves.
//! - A netlink socket acts on the namespace it was *created* in, so [`netlink_in`] creates the
//!   socket on such a thread and hands the connection back to the caller's runtime.
//! - `/proc/sys/net/...` resolves against the namespace of the thread that opens the file, so a
//!   sysctl of another namespace is written through [`run_in`] ([`write_sysctl_in`]).

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::sched::CloneFlags;

/// Where the calling thread's own network namespace is visible.
pub const THREAD_SELF_NETNS: &str = "/proc/thread-self/ns/net";

/// Name given to the threads that enter a namespace (visible in `ps -T`, panics, debuggers).
const THREAD_NAME: &str = "calix-netns";

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file is gone. DEL treats this as "nothing left to clean up".
    #[error("network namespace {path} does not exist")]
    NotFound { path: PathBuf },
    #[error("cannot open network namespace {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not a network namespace")]
    NotNetns { path: PathBuf },
    #[error("cannot inspect namespace file {path}")]
    Inspect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start a thread to enter network namespace {path}")]
    Spawn {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot enter network namespace {path}")]
    Enter {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("code running in network namespace {path} panicked: {message}")]
    Panicked { path: PathBuf, message: String },
    #[error("netlink_in/netlink_here must be called from within a tokio runtime")]
    NoRuntime,
    #[error("cannot open a netlink socket in network namespace {path}")]
    Netlink {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write {value:?} to {path}")]
    WriteSysctl {
        path: PathBuf,
        value: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot read {path}")]
    ReadSysctl {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl NetnsError {
    /// True when the namespace does not exist (any more): DEL succeeds on this.
    pub fn is_not_found(&self) -> bool {
        matches!(self, NetnsError::NotFound { .. })
    }
}

/// An open network namespace file (`/run/netns/x`, `/var/run/netns/cni-<uuid>`,
/// `/proc/<pid>/ns/net`). Holding the fd keeps the namespace alive.
#[derive(Debug)]
pub struct NetNs {
    file: File,
    path: PathBuf,
}

impl NetNs {
    /// Opens a namespace file and checks that it really is a network namespace.
    pub fn open(path: impl AsRef<Path>) -> Result<NetNs, NetnsError> {
        let path = path.as_ref().to_path_buf();
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(NetnsError::NotFound { path })
            }
            Err(source) => return Err(NetnsError::Open { path, source }),
        };
        check_is_netns(&file, &path)?;
        Ok(NetNs { file, path })
    }

    /// The calling thread's network namespace.
    pub fn current() -> Result<NetNs, NetnsError> {
        NetNs::open(THREAD_SELF_NETNS)
    }

    /// The path this namespace was opened from (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A second fd on the same namespace.
    pub fn try_clone(&self) -> Result<NetNs, NetnsError> {
        let file = self.file.try_clone().map_err(|source| NetnsError::Open {
            path: self.path.clone(),
            source,
        })?;
        Ok(NetNs {
            file,
            path: self.path.clone(),
        })
    }

    /// Whether both handles refer to the same namespace (same nsfs inode), e.g. to refuse a
    /// "pod" namespace that is really the host's.
    pub fn is_same(&self, other: &NetNs) -> Result<bool, NetnsError> {
        Ok(self.id()? == other.id()?)
    }

    /// (device, inode) of the namespace: identifies it for as long as it lives.
    pub fn id(&self) -> Result<(u64, u64), NetnsError> {
        let meta = self.file.metadata().map_err(|source| NetnsError::Inspect {
            path: self.path.clone(),
            source,
        })?;
        Ok((meta.dev(), meta.ino()))
    }
}

impl AsFd for NetNs {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl AsRawFd for NetNs {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// `NS_GET_NSTYPE` (Linux ≥ 4.11) says which kind of namespace an nsfs file is. Kernels 3.19 to
/// 4.10 answer ENOTTY; then accept any nsfs file and let `setns(CLONE_NEWNET)` reject a wrong
/// type later. Anything else (a plain file, an unmounted /run/netns entry) is not a netns.
fn check_is_netns(file: &File, path: &Path) -> Result<(), NetnsError> {
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd, which `file` keeps open.
    let kind = unsafe { libc::ioctl(file.as_raw_fd(), libc::NS_GET_NSTYPE as _) };
    if kind >= 0 {
        return if kind == libc::CLONE_NEWNET {
            Ok(())
        } else {
            Err(NetnsError::NotNetns {
                path: path.to_path_buf(),
            })
        };
    }
    let fs = nix::sys::statfs::fstatfs(file).map_err(|e| NetnsError::Inspect {
        path: path.to_path_buf(),
        source: io::Error::from(e),
    })?;
    if fs.filesystem_type() == nix::sys::statfs::NSFS_MAGIC {
        Ok(())
    } else {
        Err(NetnsError::NotNetns {
            path: path.to_path_buf(),
        })
    }
}

/// Runs `f` on a fresh thread inside `ns` and waits for it. The thread exits afterwards, so
/// nothing stays in the namespace. Blocking: from async code use [`run_in_async`].
pub fn run_in<T: Send + 'static>(
    ns: &NetNs,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, NetnsError> {
    let thread = spawn_in(ns, move |entered| entered.map(|()| f()))?;
    match thread.join() {
        Ok(result) => result,
        Err(payload) => Err(NetnsError::Panicked {
            path: ns.path.clone(),
            message: panic_message(payload.as_ref()),
        }),
    }
}

/// Like [`run_in`], but awaits the thread instead of blocking the executor.
pub async fn run_in_async<T: Send + 'static>(
    ns: &NetNs,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, NetnsError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    // The thread is detached: it ends on its own right after sending.
    let _thread = spawn_in(ns, move |entered| {
        // Nobody is waiting any more when the caller's future was dropped; that is fine.
        let _ = tx.send(entered.map(|()| f()));
    })?;
    match rx.await {
        Ok(result) => result,
        // The sender was dropped without sending: `f` panicked (the panic hook printed it).
        Err(_) => Err(NetnsError::Panicked {
            path: ns.path.clone(),
            message: "the namespace thread ended without a result".to_string(),
        }),
    }
}

/// Starts a thread that enters `ns` and then calls `body` with the outcome of `setns`.
fn spawn_in<R: Send + 'static>(
    ns: &NetNs,
    body: impl FnOnce(Result<(), NetnsError>) -> R + Send + 'static,
) -> Result<std::thread::JoinHandle<R>, NetnsError> {
    // The thread gets its own fd so it does not borrow from the caller.
    let target = ns.try_clone()?;
    std::thread::Builder::new()
        .name(THREAD_NAME.to_string())
        .spawn(move || {
            let entered =
                nix::sched::setns(target.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| {
                    NetnsError::Enter {
                        path: target.path.clone(),
                        source,
                    }
                });
            drop(target);
            body(entered)
        })
        .map_err(|source| NetnsError::Spawn {
            path: ns.path.clone(),
            source,
        })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Opens an rtnetlink connection that acts on `ns`: the socket is created on a thread inside
/// `ns`, then its connection task is spawned on the caller's tokio runtime. The task ends when
/// the last clone of the returned handle is dropped.
pub async fn netlink_in(ns: &NetNs) -> Result<rtnetlink::Handle, NetnsError> {
    netlink_in_with(ns, || ()).await.map(|(handle, ())| handle)
}

/// [`netlink_in`], and `f` runs inside `ns` first, on the same thread (one thread, one `setns`
/// for both: an ADD needs a sysctl written and a netlink socket in the pod's namespace).
pub async fn netlink_in_with<T: Send + 'static>(
    ns: &NetNs,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<(rtnetlink::Handle, T), NetnsError> {
    netlink_hearing_in_with(ns, &[], f)
        .await
        .map(|(handle, _events, out)| (handle, out))
}

/// What a netlink connection hears of the multicast groups it joined.
pub type NetlinkEvents = futures::channel::mpsc::UnboundedReceiver<(
    netlink_packet_core::NetlinkMessage<netlink_packet_route::RouteNetlinkMessage>,
    rtnetlink::sys::SocketAddr,
)>;

/// [`netlink_in_with`], the connection also joining `groups` in `ns`: what it hears from then
/// on comes on the returned [`NetlinkEvents`] (unread, it queues: join only groups that say
/// little, such as a pod namespace's links).
pub async fn netlink_hearing_in_with<T: Send + 'static>(
    ns: &NetNs,
    groups: &'static [rtnetlink::MulticastGroup],
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<(rtnetlink::Handle, NetlinkEvents, T), NetnsError> {
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| NetnsError::NoRuntime)?;
    let path = ns.path.clone();
    let (connection, handle, events, out) = run_in_async(ns, move || {
        let out = f();
        // The tokio socket registers with the runtime's reactor when it is created.
        let _entered = runtime.enter();
        rtnetlink::new_multicast_connection(groups)
            .map(|(connection, handle, events)| (connection, handle, events, out))
    })
    .await?
    .map_err(|source| NetnsError::Netlink { path, source })?;
    tokio::spawn(connection);
    Ok((handle, events, out))
}

/// An rtnetlink connection in the calling thread's namespace (the host's, in the CNI plugin).
pub async fn netlink_here() -> Result<rtnetlink::Handle, NetnsError> {
    tokio::runtime::Handle::try_current().map_err(|_| NetnsError::NoRuntime)?;
    let (connection, handle, _unsolicited) =
        rtnetlink::new_connection().map_err(|source| NetnsError::Netlink {
            path: PathBuf::from(THREAD_SELF_NETNS),
            source,
        })?;
    tokio::spawn(connection);
    Ok(handle)
}

/// Writes a `/proc/sys` file in the calling thread's network namespace.
pub fn write_sysctl(path: impl AsRef<Path>, value: &str) -> Result<(), NetnsError> {
    let path = path.as_ref();
    let err = |source| NetnsError::WriteSysctl {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(err)?;
    file.write_all(value.as_bytes()).map_err(err)
}

/// As [`write_sysctl`], but only when the file does not already hold `value`. For the knobs
/// that take the RTNL lock with trylock-and-restart (`forwarding`, IPv6 `disable_ipv6`): such a
/// write spins while concurrent ADDs hold the lock, so a needless one is worth skipping.
pub fn write_sysctl_if_changed(path: impl AsRef<Path>, value: &str) -> Result<(), NetnsError> {
    let path = path.as_ref();
    match read_sysctl(path) {
        Ok(current) if current == value => Ok(()),
        _ => write_sysctl(path, value),
    }
}

/// Reads a `/proc/sys` file in the calling thread's network namespace, trimmed.
pub fn read_sysctl(path: impl AsRef<Path>) -> Result<String, NetnsError> {
    let path = path.as_ref();
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| NetnsError::ReadSysctl {
            path: path.to_path_buf(),
            source,
        })
}

/// Writes a `/proc/sys` file as seen from inside `ns` (blocking; see [`run_in`]).
pub fn write_sysctl_in(ns: &NetNs, path: impl AsRef<Path>, value: &str) -> Result<(), NetnsError> {
    let path = path.as_ref().to_path_buf();
    let value = value.to_string();
    run_in(ns, move || write_sysctl(&path, &value))?
}

/// Reads a `/proc/sys` file as seen from inside `ns` (blocking; see [`run_in`]).
pub fn read_sysctl_in(ns: &NetNs, path: impl AsRef<Path>) -> Result<String, NetnsError> {
    let path = path.as_ref().to_path_buf();
    run_in(ns, move || read_sysctl(&path))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_missing_is_not_found() {
        let err = NetNs::open("/run/netns/calix-unit-test-does-not-exist")
            .expect_err("a missing namespace must not open");
        assert!(err.is_not_found(), "{err:?}");
    }

    #[test]
    fn open_regular_file_is_not_a_netns() {
        let err = NetNs::open("/proc/self/cmdline").expect_err("a regular file is no namespace");
        assert!(matches!(err, NetnsError::NotNetns { .. }), "{err:?}");
    }

    #[test]
    fn current_is_same_as_itself() {
        // Needs no privilege: every process may open its own namespace file.
        let a = NetNs::current().expect("open own netns");
        let b = NetNs::open("/proc/self/ns/net").expect("open own netns by pid");
        assert!(a.is_same(&b).expect("compare"));
    }
}
