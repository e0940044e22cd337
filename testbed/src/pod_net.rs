//! Traffic from inside pods' network namespaces (a sandbox's, [`crate::KubeNode::pod_netns`]):
//! a command run there, and a long-lived TCP flow between two pods whose longest silence tells
//! how much a restart of the dataplane disturbed it.
use std::time::{Duration, Instant};

/// Runs `argv` (host tools, busybox's applets through `/bin/busybox`) in the network namespace
/// at `netns` (a pod's); its output when it succeeds.
pub fn in_pod(netns: &str, argv: &[&str]) -> Option<String> {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={netns}"))
        .args(argv)
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The port of [`Flow`]'s echo server.
pub const FLOW_PORT: u16 = 9000;

/// One TCP connection from a pod to another, a byte echoed every 10 ms: the server in the
/// second pod's namespace, the client in the first's (threads that entered them).
pub struct Flow {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    client: std::thread::JoinHandle<Result<(u64, Duration), FlowError>>,
}

/// How a [`Flow`] broke: it never started, or it stopped after `after` echoes.
#[derive(Debug, thiserror::Error)]
pub enum FlowError {
    #[error("{addr} is not an address and port")]
    Address { addr: String },
    #[error("connect")]
    Connect(#[source] std::io::Error),
    #[error("write after {after} echoes")]
    Write {
        after: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("read after {after} echoes")]
    Read {
        after: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("the flow's client panicked")]
    Panicked,
}

impl Flow {
    pub fn start(client_ns: &str, server_ns: &str, server_ip: &str) -> Self {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering;
        let enter = |path: &str| {
            let f = std::fs::File::open(path).expect("a pod's namespace");
            // SAFETY: setns(2) of the calling thread only, on a namespace fd we hold.
            assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let server_path = server_ns.to_string();
        std::thread::spawn(move || {
            enter(&server_path);
            let l = std::net::TcpListener::bind(("0.0.0.0", FLOW_PORT)).expect("bind");
            tx.send(()).expect("ready");
            let (mut c, _) = l.accept().expect("accept");
            // The port is free again at once: the next flow to this pod binds it while this
            // one's echo may still be winding down.
            drop(l);
            let mut b = [0u8; 1];
            while c.read_exact(&mut b).is_ok() && c.write_all(&b).is_ok() {}
        });
        rx.recv().expect("the echo server");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (client_path, addr, done) =
            (client_ns.to_string(), server_ip.to_string(), stop.clone());
        let client = std::thread::spawn(move || {
            enter(&client_path);
            let text = format!("{addr}:{FLOW_PORT}");
            let addr: std::net::SocketAddr = text
                .parse()
                .map_err(|_| FlowError::Address { addr: text })?;
            let mut c = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .map_err(FlowError::Connect)?;
            c.set_read_timeout(Some(Duration::from_secs(30)))
                .map_err(FlowError::Connect)?;
            let (mut n, mut gap, mut last) = (0u64, Duration::ZERO, Instant::now());
            let mut b = [0u8; 1];
            while !done.load(Ordering::Relaxed) {
                c.write_all(b"x")
                    .map_err(|source| FlowError::Write { after: n, source })?;
                c.read_exact(&mut b)
                    .map_err(|source| FlowError::Read { after: n, source })?;
                n += 1;
                gap = gap.max(last.elapsed());
                last = Instant::now();
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok((n, gap))
        });
        Self { stop, client }
    }

    /// Stops the client: the echoes and the longest time between two of them; panics when
    /// the flow broke.
    pub fn stop(self) -> (u64, Duration) {
        self.finish()
            .unwrap_or_else(|e| panic!("the TCP flow broke: {}", calix_log::error_chain(&e)))
    }

    /// Stops the client: the echoes and the longest time between two of them, or how the
    /// flow broke.
    pub fn finish(self) -> Result<(u64, Duration), FlowError> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.client.join().map_err(|_| FlowError::Panicked)?
    }
}
