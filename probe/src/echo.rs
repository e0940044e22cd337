//! The TCP echo: one line (at most [`MAX_LINE`] bytes) in, the same line back.
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// Longest line the server reads; a longer one closes the connection.
pub const MAX_LINE: usize = 256;
/// How long a server waits for a client's line.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum EchoError {
    #[error("cannot connect to {addr}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: SocketAddr, timeout: Duration },
    #[error("talking to {addr}")]
    Io {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{addr} answered {got:?}, not the token sent ({sent:?})")]
    Mismatch {
        addr: SocketAddr,
        sent: String,
        got: String,
    },
}

/// Serves echo on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let _ = tokio::time::timeout(READ_TIMEOUT, echo_one(stream)).await;
        });
    }
}

async fn echo_one(stream: TcpStream) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = Vec::new();
    let mut reader = BufReader::new(read).take(MAX_LINE as u64 + 1);
    reader.read_until(b'\n', &mut line).await?;
    if line.len() > MAX_LINE || !line.ends_with(b"\n") {
        return Ok(());
    }
    write.write_all(&line).await?;
    write.shutdown().await
}

/// Sends `token` to `addr` and checks it comes back; returns the round trip.
pub async fn exchange(
    addr: SocketAddr,
    token: &str,
    timeout: Duration,
) -> Result<Duration, EchoError> {
    let start = std::time::Instant::now();
    let run = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|source| EchoError::Connect { addr, source })?;
        let io = |source| EchoError::Io { addr, source };
        stream
            .write_all(format!("{token}\n").as_bytes())
            .await
            .map_err(io)?;
        let mut got = Vec::new();
        (&mut stream)
            .take(MAX_LINE as u64 + 1)
            .read_to_end(&mut got)
            .await
            .map_err(io)?;
        let got = String::from_utf8_lossy(&got).trim_end().to_string();
        if got != token {
            return Err(EchoError::Mismatch {
                addr,
                sent: token.to_string(),
                got,
            });
        }
        Ok(start.elapsed())
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| EchoError::Timeout { addr, timeout })?
}
