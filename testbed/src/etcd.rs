//! A real etcd server, one member, in a network namespace of its own.
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::netns::{veth, Netns};
use crate::process::wait_ready;
use crate::{Error, Result};

/// etcd in its own namespace, listening on 2379 on every address there: on its loopback for
/// agents in that namespace, and on veth pairs to node namespaces (10.98.<i>.1 ↔
/// 10.98.<i>.2/30, [`EtcdNs::wire`]). Killed (and its namespace removed) on drop.
pub struct EtcdNs {
    pub ns: Netns,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
    links: AtomicU32,
}

impl EtcdNs {
    /// etcd in a test namespace ([`crate::unique`]`("e")`); panics on failure.
    pub fn start() -> Self {
        crate::require_root();
        Self::launch(Netns::new("e")).unwrap_or_else(|e| panic!("{e}"))
    }

    /// etcd in `ns`, its data in `$TMPDIR/<ns name>`, up and healthy.
    pub fn launch(ns: Netns) -> Result<Self> {
        let dir = std::env::temp_dir().join(&ns.name);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("create {}", dir.display())))?;
        let etcd = Self {
            ns,
            dir,
            child: Mutex::new(None),
            links: AtomicU32::new(0),
        };
        etcd.try_spawn()?;
        Ok(etcd)
    }

    /// (Re)starts etcd on its data directory and waits until it answers; panics on failure.
    pub fn spawn(&self) {
        self.try_spawn().unwrap_or_else(|e| panic!("{e}"));
    }

    /// (Re)starts etcd on its data directory and waits until it is healthy.
    pub fn try_spawn(&self) -> Result<()> {
        let data = self.dir.join("data");
        let log = self.dir.join("etcd.log");
        let mut cmd = self.ns.daemon("etcd", None)?;
        cmd.args([
            "--name",
            "default",
            "--listen-client-urls",
            "http://0.0.0.0:2379",
            "--advertise-client-urls",
            "http://127.0.0.1:2379",
            "--listen-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-cluster",
            "default=http://127.0.0.1:2380",
            "--data-dir",
        ])
        .arg(&data);
        // Appended to: a restart keeps the earlier run's lines.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(Error::io(format!("open {}", log.display())))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .map_err(|source| Error::Spawn {
                cmd: "etcd".into(),
                source,
            })?;
        let mut guard = self.child.lock().unwrap_or_else(|p| p.into_inner());
        let child = guard.insert(child);
        let ns = Netns::borrowed(&self.ns.name);
        wait_ready(
            "etcd (apt-get install etcd-server; cargo xtask setup does)",
            child,
            &log,
            Duration::from_secs(20),
            || ns.run(healthy),
        )
    }

    /// Kills etcd (SIGKILL).
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// Connects `node` to etcd; returns the client URL the node uses.
    pub fn wire(&self, node: &Netns) -> String {
        let i = self.links.fetch_add(1, Ordering::Relaxed) + 1;
        let host = format!("e{i}");
        let wired = veth(&self.ns, &host, node, "etcd0")
            .and_then(|()| self.ns.ip(&format!("addr add 10.98.{i}.1/30 dev {host}")))
            .and_then(|()| self.ns.ip(&format!("link set {host} up")))
            .and_then(|()| node.ip(&format!("addr add 10.98.{i}.2/30 dev etcd0")))
            .and_then(|()| node.ip("link set etcd0 up"));
        wired.unwrap_or_else(|e| panic!("{e}"));
        format!("http://10.98.{i}.1:2379")
    }
}

impl Drop for EtcdNs {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether etcd on this thread's namespace's 127.0.0.1:2379 says it is healthy.
fn healthy() -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 2379));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut body = String::new();
    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .and_then(|_| s.read_to_string(&mut body))
        .is_ok()
        && body.contains(r#""health":"true""#)
}
