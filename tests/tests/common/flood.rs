//! Floods of idle TCP connections from inside a namespace (a door under attack): each source
//! opens a connection, holds it while the other end does, and opens it again 200 ms after it
//! ended, until dropped; what the connections came to is counted.
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the connections of one [`Flood`] came to.
#[derive(Default, Debug)]
pub struct FloodCounts {
    /// TCP handshakes that completed (the node's kernel answered the SYN).
    connected: AtomicU64,
    /// Closed by the other end within a second of connecting (or reset while connecting).
    closed_at_once: AtomicU64,
    /// Held open by the other end for a second or more.
    held: AtomicU64,
    /// No answer to the SYN within 2 s.
    timed_out: AtomicU64,
    /// Refused (RST to the SYN) or unreachable.
    failed: AtomicU64,
}

/// Idle TCP connections to `to` from inside a namespace, one task per source in `from`
/// (`None`: the kernel picks), each reopened 200 ms after it ended, until dropped.
pub struct Flood {
    counts: Arc<FloodCounts>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    pub fn start(ns: &calix_testbed::Netns, from: Vec<Option<IpAddr>>, to: SocketAddr) -> Self {
        let counts = Arc::new(FloodCounts::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (counts.clone(), stop.clone());
        let thread = ns
            .spawn(None, move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let tasks: Vec<_> = from
                        .into_iter()
                        .map(|src| tokio::spawn(hold(src, to, c.clone(), s.clone())))
                        .collect();
                    for t in tasks {
                        let _ = t.await;
                    }
                });
            })
            .expect("flood thread");
        Self {
            counts,
            stop,
            thread: Some(thread),
        }
    }

    pub fn get(&self) -> [u64; 5] {
        let c = &self.counts;
        [
            &c.connected,
            &c.closed_at_once,
            &c.held,
            &c.timed_out,
            &c.failed,
        ]
        .map(|a| a.load(Ordering::Relaxed))
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One connection of a [`Flood`], again and again.
async fn hold(src: Option<IpAddr>, to: SocketAddr, c: Arc<FloodCounts>, stop: Arc<AtomicBool>) {
    use tokio::io::AsyncReadExt;
    let add = |a: &AtomicU64| a.fetch_add(1, Ordering::Relaxed);
    while !stop.load(Ordering::Relaxed) {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        if let Some(src) = src {
            sock.bind(SocketAddr::new(src, 0)).expect("bind the source");
        }
        match tokio::time::timeout(Duration::from_secs(2), sock.connect(to)).await {
            Err(_) => {
                add(&c.timed_out);
            }
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                add(&c.connected);
                add(&c.closed_at_once);
            }
            Ok(Err(_)) => {
                add(&c.failed);
            }
            Ok(Ok(mut s)) => {
                add(&c.connected);
                let opened = Instant::now();
                let mut b = [0u8; 64];
                loop {
                    match tokio::time::timeout(Duration::from_millis(250), s.read(&mut b)).await {
                        Ok(Ok(0) | Err(_)) => break,
                        Ok(Ok(_)) | Err(_) if stop.load(Ordering::Relaxed) => break,
                        _ => {}
                    }
                }
                if opened.elapsed() < Duration::from_secs(1) {
                    add(&c.closed_at_once);
                } else {
                    add(&c.held);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
