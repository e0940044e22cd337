//! A TCP echo server in a namespace and a client that checks its bytes come back: "reaches
//! by TCP" for the tests, with payloads big enough to need full-size segments (a path whose
//! MTU is smaller than the sender thinks shows as a stall, not a pass).
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::netns::Netns;
use crate::{Error, Result};

/// The port [`EchoServer`] listens on.
pub const ECHO_PORT: u16 = 7007;

/// An echo server on `[::]:ECHO_PORT` (IPv4 too) inside a namespace, on a thread of its own;
/// stops on drop.
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EchoServer {
    pub fn start(ns: &Netns) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = ns.spawn(None, move || {
            let listener = match TcpListener::bind(("::", ECHO_PORT))
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
            {
                Ok(l) => {
                    let _ = ready_tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        std::thread::spawn(move || {
                            let _ = echo_one(conn);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        })?;
        ready_rx
            .recv()
            .map_err(|_| Error::Panicked {
                what: "the echo server".into(),
            })?
            .map_err(Error::io(format!("echo server in {}", ns.name)))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn echo_one(mut conn: TcpStream) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut buf = Vec::new();
    conn.read_to_end(&mut buf)?;
    conn.write_all(&buf)?;
    conn.shutdown(Shutdown::Write)
}

/// Connects from inside `ns` to `to`'s echo server, sends `bytes` bytes and checks they come
/// back; how long the round trip took. Fails after `timeout`.
pub fn echo_roundtrip(
    ns: &Netns,
    to: SocketAddr,
    bytes: usize,
    timeout: Duration,
) -> Result<Duration> {
    ns.run(move || {
        let start = Instant::now();
        let what = format!("TCP echo of {bytes} bytes with {to}");
        let payload: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        let mut s = TcpStream::connect_timeout(&to, timeout).map_err(Error::io(what.clone()))?;
        s.set_read_timeout(Some(timeout))
            .and_then(|()| s.set_write_timeout(Some(timeout)))
            .and_then(|()| s.write_all(&payload))
            .and_then(|()| s.shutdown(Shutdown::Write))
            .map_err(Error::io(what.clone()))?;
        let mut back = Vec::with_capacity(bytes);
        s.read_to_end(&mut back).map_err(Error::io(what.clone()))?;
        if back != payload {
            return Err(Error::Unexpected {
                what,
                found: format!("{} bytes back", back.len()),
                expected: "the same bytes back".into(),
            });
        }
        Ok(start.elapsed())
    })
}
