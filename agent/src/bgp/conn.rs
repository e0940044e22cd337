//! One BGP connection: whole messages read and written on a TCP stream, and a
//! [`Session`] driven by them and by its timers until it closes.
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use calix_bgp::session::{Output, Session};
use calix_bgp::wire::{frame_len, MAX_LEN};
use calix_bgp::{DecodeError, Message};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::md5;

/// The BGP port.
pub const PORT: u16 = 179;

/// Connects to `peer` from `local` (when given), signing with `password` (when given).
pub async fn connect(
    local: Option<IpAddr>,
    peer: SocketAddr,
    password: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let socket = match peer {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    if let Some(key) = password {
        md5::set_password(socket.as_fd(), peer.ip(), key)?;
    }
    if let Some(ip) = local {
        socket.bind(SocketAddr::new(ip, 0))?;
    }
    let stream = tokio::time::timeout(timeout, socket.connect(peer))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("connect to {peer}")))??;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// What [`Connection::read`] got.
#[derive(Debug)]
pub enum Read {
    /// A whole message, decoded (or why it could not be).
    Message(Result<Message, DecodeError>),
    /// The peer closed the connection.
    Eof,
}

/// A TCP stream cut into BGP messages.
pub struct Connection {
    stream: TcpStream,
    /// Bytes read and not yet a whole message: at most one message's worth and a read.
    buf: Vec<u8>,
}

impl Connection {
    pub fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: Vec::with_capacity(2 * MAX_LEN),
        }
    }

    /// The next message. `four_octet_as`: how its AS numbers read.
    pub async fn read(&mut self, four_octet_as: bool) -> io::Result<Read> {
        loop {
            match frame_len(&self.buf) {
                Err(e) => {
                    self.buf.clear();
                    return Ok(Read::Message(Err(e)));
                }
                Ok(Some(len)) if self.buf.len() >= len => {
                    let msg = Message::decode(&self.buf[..len], four_octet_as);
                    self.buf.drain(..len);
                    return Ok(Read::Message(msg));
                }
                Ok(_) => {}
            }
            let mut chunk = [0u8; MAX_LEN];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(Read::Eof);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    pub async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Sends what `outputs` asks to send; returns the rest, in order, and the first write
    /// that failed (nothing is written after it).
    pub async fn send(&mut self, outputs: Vec<Output>) -> (Vec<Output>, Option<io::Error>) {
        let mut rest = Vec::new();
        let mut failed = None;
        for o in outputs {
            match o {
                Output::Send(bytes) => {
                    if failed.is_none() {
                        failed = self.write(&bytes).await.err();
                    }
                }
                o => rest.push(o),
            }
        }
        (rest, failed)
    }

    /// Waits for the next thing `session` must hear: a message, or its next deadline.
    /// Returns what the session said besides bytes (sent already). A broken connection is
    /// told to the session as lost.
    pub async fn step(&mut self, session: &mut Session) -> Vec<Output> {
        let deadline = session.next_deadline();
        let four = session.four_octet_as();
        let outputs = tokio::select! {
            r = self.read(four) => match r {
                Ok(Read::Message(m)) => session.on_message(Instant::now(), m),
                Ok(Read::Eof) => session.connection_lost("closed by the peer"),
                Err(e) => session.connection_lost(&e.to_string()),
            },
            _ = sleep_until(deadline) => session.tick(Instant::now()),
        };
        let (mut rest, failed) = self.send(outputs).await;
        if let Some(e) = failed {
            rest.extend(session.connection_lost(&e.to_string()));
        }
        rest
    }
}

pub(super) async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}
