//! A netperf-style request/response client and server (netperf is not packaged in Debian 12).
//! `cargo xtask netperf <server|crr|rr>` runs them; the benches exec that inside their
//! namespaces.
//!
//! - server: accepts connections one at a time; on each, answers every 1-byte request with a
//!   1-byte reply until the peer closes.
//! - [`Mode::Crr`] (netperf's TCP_CRR): connect, 1-byte request, 1-byte reply, close, again and
//!   again for `secs`: plain blocking calls, no socket options, so each connection costs
//!   exactly `socket`, `connect`, `write`, `read`, `close`. The client closes first (its side
//!   keeps the TIME_WAIT): the benches widen the client namespace's port range and enable
//!   `tcp_tw_reuse`.
//! - [`Mode::Rr`] (TCP_RR): one connection (`TCP_NODELAY`), 1-byte ping-pong for `secs`, every
//!   round trip timed.
//!
//! A client prints one JSON line ([`Report`]). One that does not finish within `secs` + 10 s is
//! killed by SIGALRM (a dataplane that drops a SYN must not hang a bench). A client may first
//! join a cgroup ([`join_cgroup`]: calix's socket programs translate Services there).
//!
//! [`first_connect`] times a change: it tries to connect until a try succeeds, and says when.
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use crate::process::num;
use crate::stats::percentile;
use crate::{Error, Result};

#[derive(Clone, Copy)]
pub enum Mode {
    Crr,
    Rr,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Crr => "crr",
            Self::Rr => "rr",
        }
    }
}

/// What a client measured: exchanges (connections for TCP_CRR, round trips for TCP_RR), over
/// how long, their rate per second and, for TCP_RR, the round trip's percentiles and mean.
pub struct Report {
    pub count: f64,
    pub secs: f64,
    pub rate: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

impl Report {
    pub fn to_json(&self) -> Value {
        json!({ "count": self.count, "secs": self.secs, "rate": self.rate,
                "p50_us": self.p50_us, "p99_us": self.p99_us, "mean_us": self.mean_us })
    }

    pub fn from_json(v: &Value) -> Result<Self> {
        // TCP_CRR has no round-trip percentiles: NaN, printed as null.
        let opt = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        Ok(Self {
            count: num(v, &["count"])?,
            secs: num(v, &["secs"])?,
            rate: num(v, &["rate"])?,
            p50_us: opt("p50_us"),
            p99_us: opt("p99_us"),
            mean_us: opt("mean_us"),
        })
    }
}

/// Runs client `mode` against `to` for `secs` under the SIGALRM watchdog.
pub fn client(mode: Mode, to: SocketAddr, secs: f64) -> Result<Report> {
    let limit = secs.max(0.0).ceil() as u32 + 10;
    // SAFETY: alarm(2) has no preconditions; SIGALRM's default action ends the process.
    unsafe { libc::alarm(limit) };
    match mode {
        Mode::Crr => crr(to, secs),
        Mode::Rr => rr(to, secs),
    }
}

/// Serves 1-byte request/reply exchanges, one connection at a time, until killed.
pub fn server(listen: SocketAddr) -> Result<()> {
    let l = TcpListener::bind(listen).map_err(Error::io(format!("listen on {listen}")))?;
    loop {
        let Ok((mut s, _)) = l.accept() else {
            continue;
        };
        // A client that vanished without closing must not block the server forever.
        if s.set_nodelay(true).is_err()
            || s.set_read_timeout(Some(Duration::from_secs(30))).is_err()
        {
            continue;
        }
        let mut b = [0u8; 1];
        loop {
            match s.read(&mut b) {
                Ok(1) => {
                    if s.write_all(&b).is_err() {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                _ => break,
            }
        }
    }
}

/// One request and its reply on `s`.
fn exchange(s: &mut TcpStream, b: &mut [u8; 1]) -> std::io::Result<()> {
    s.write_all(&b[..])?;
    s.read_exact(&mut b[..])
}

fn crr(to: SocketAddr, secs: f64) -> Result<Report> {
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    let mut count = 0u64;
    let mut b = [b'x'; 1];
    while Instant::now() < end {
        let what = || format!("connection {} to {to}", count + 1);
        let mut s = TcpStream::connect(to).map_err(Error::io(what()))?;
        exchange(&mut s, &mut b).map_err(Error::io(what()))?;
        drop(s);
        count += 1;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let (count, nan) = (count as f64, f64::NAN);
    Ok(Report {
        count,
        secs: elapsed,
        rate: count / elapsed,
        p50_us: nan,
        p99_us: nan,
        mean_us: nan,
    })
}

fn rr(to: SocketAddr, secs: f64) -> Result<Report> {
    let mut s = TcpStream::connect(to).map_err(Error::io(format!("connect to {to}")))?;
    s.set_nodelay(true)
        .map_err(Error::io(format!("TCP_NODELAY to {to}")))?;
    let mut b = [b'x'; 1];
    // Round trips in ns; ~30k/s expected, reserve a little more.
    let mut rtts = Vec::with_capacity((secs * 50_000.0) as usize);
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    loop {
        let t = Instant::now();
        if t >= end {
            break;
        }
        exchange(&mut s, &mut b).map_err(Error::io(format!(
            "round trip {} with {to}",
            rtts.len() + 1
        )))?;
        rtts.push(t.elapsed().as_nanos() as f64);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let count = rtts.len() as f64;
    Ok(Report {
        count,
        secs: elapsed,
        rate: count / elapsed,
        p50_us: percentile(&rtts, 50.0) / 1e3,
        p99_us: percentile(&rtts, 99.0) / 1e3,
        mean_us: rtts.iter().sum::<f64>() / count.max(1.0) / 1e3,
    })
}

/// Moves this process into the cgroup v2 directory `dir` (its `cgroup.procs`).
pub fn join_cgroup(dir: &Path) -> Result<()> {
    let procs = dir.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string())
        .map_err(Error::io(format!("join {}", procs.display())))
}

/// How long one try of [`first_connect`] may wait for its handshake.
pub const TRY_TIMEOUT: Duration = Duration::from_millis(10);

/// Tries to connect to `to`, each try at most [`TRY_TIMEOUT`] and 1 ms apart, until one
/// succeeds (its wall-clock time returned, to compare with another process's clock) or
/// `limit` has passed. The first try must fail (what is timed is not there yet): `probing`
/// is called after it.
pub fn first_connect(
    to: SocketAddr,
    limit: Duration,
    probing: impl FnOnce(),
) -> Result<SystemTime> {
    if TcpStream::connect_timeout(&to, TRY_TIMEOUT).is_ok() {
        return Err(Error::Unexpected {
            what: format!("a connection to {to}"),
            found: "made before the change".into(),
            expected: "refused or unanswered until the change".into(),
        });
    }
    probing();
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if TcpStream::connect_timeout(&to, TRY_TIMEOUT).is_ok() {
            return Ok(SystemTime::now());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Err(Error::Unexpected {
        what: format!("a connection to {to}"),
        found: format!("none within {limit:?}"),
        expected: "one once the change took effect".into(),
    })
}
