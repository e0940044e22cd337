//! BIRD 2 as the bench's router: a daemon in a namespace with a given configuration, killed on
//! drop, and its control socket spoken to directly (no `birdc` process per question: the
//! bench asks every millisecond while it times).
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use calix_testbed::{Guarded, Netns};

/// What every BIRD of the bench prints a route's time as: seconds since the epoch with
/// microseconds (the time BIRD's loop read the UPDATE that brought it).
pub const TIMEFORMAT: &str = "timeformat route \"%s.%6f\";\n";

/// A running BIRD and a connection to its control socket.
pub struct Bird {
    pub ctl: Ctl,
    _daemon: Guarded,
}

impl Bird {
    /// BIRD in `ns` with `conf` (its files under `dir`, named `name`), until it answers.
    pub fn start(ns: &Netns, dir: &Path, name: &str, conf: &str) -> Result<Self> {
        let (conf_path, sock, log) = (
            dir.join(format!("{name}.conf")),
            dir.join(format!("{name}.ctl")),
            dir.join(format!("{name}.log")),
        );
        std::fs::write(&conf_path, conf)?;
        let _ = std::fs::remove_file(&sock);
        let mut cmd = ns.daemon("bird", None)?;
        cmd.arg("-f")
            .arg("-c")
            .arg(&conf_path)
            .arg("-s")
            .arg(&sock)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        let mut daemon = Guarded(cmd.spawn().context("starting bird (cargo xtask setup)")?);
        let deadline = Instant::now() + Duration::from_secs(10);
        let ctl = loop {
            if let Some(st) = daemon.0.try_wait()? {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                bail!("{name}: bird exited ({st}): {}", log.trim());
            }
            match Ctl::connect(&sock) {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => {
                    return Err(e).with_context(|| format!("{name}: bird's control socket"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        Ok(Self {
            ctl,
            _daemon: daemon,
        })
    }
}

/// A connection to BIRD's control socket: a command, then its reply, up to the line whose
/// 4-digit code is followed by a space (continuation lines have a `-` there, or start with a
/// space).
pub struct Ctl {
    out: UnixStream,
    reader: BufReader<UnixStream>,
    path: PathBuf,
}

impl Ctl {
    pub fn connect(path: &Path) -> Result<Self> {
        let out = UnixStream::connect(path)?;
        let mut c = Self {
            reader: BufReader::new(out.try_clone()?),
            out,
            path: path.to_path_buf(),
        };
        c.reply()?; // the greeting: "0001 BIRD 2.0.x ready."
        Ok(c)
    }

    /// `line`'s reply, every line of it.
    pub fn cmd(&mut self, line: &str) -> Result<String> {
        self.out.write_all(format!("{line}\n").as_bytes())?;
        self.reply()
            .with_context(|| format!("bird ({}): {line}", self.path.display()))
    }

    fn reply(&mut self) -> Result<String> {
        let mut all = String::new();
        loop {
            let mut l = String::new();
            if self.reader.read_line(&mut l)? == 0 {
                bail!("bird closed its control socket");
            }
            all.push_str(&l);
            let b = l.as_bytes();
            if b.len() >= 5 && b[..4].iter().all(u8::is_ascii_digit) && b[4] == b' ' {
                // 8xxx: nothing to show ("Network not found"); 9xxx: a bad command.
                if b[0] == b'9' {
                    bail!("bird: {}", l.trim());
                }
                return Ok(all);
            }
        }
    }

    /// Protocol `p`'s state (`up`, `start`, …) and its routes in the table (`Routes: N
    /// imported`; 0 when it shows none).
    pub fn protocol(&mut self, p: &str) -> Result<(String, usize)> {
        let out = self.cmd(&format!("show protocols all {p}"))?;
        Ok(parse_protocol(&out, p))
    }

    /// Protocol `p`'s routes in the table.
    pub fn imported(&mut self, p: &str) -> Result<usize> {
        Ok(self.protocol(p)?.1)
    }

    /// Waits up to `timeout` until every one of `protos` is up with at least `routes` routes.
    pub fn until_up(&mut self, protos: &[&str], routes: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut missing = Vec::new();
            for p in protos {
                let (state, n) = self.protocol(p)?;
                if state != "up" || n < routes {
                    missing.push(format!("{p}: {state}, {n} routes"));
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "not within {timeout:?}: {} up with {routes} routes or more ({})",
                    protos.join(", "),
                    missing.join("; ")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The times (s since the epoch) of every route `show route <args>` lists.
    pub fn route_times(&mut self, args: &str) -> Result<Vec<f64>> {
        let out = self.cmd(&format!("show route {args}"))?;
        Ok(parse_times(&out))
    }
}

/// State and route count from `show protocols all <p>`.
fn parse_protocol(out: &str, p: &str) -> (String, usize) {
    let state = out
        .lines()
        .map(|l| l.trim_start_matches(|c: char| c.is_ascii_digit() || c == '-'))
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some(p)).then(|| w.nth(2).map(str::to_string))?
        })
        .unwrap_or_default();
    let routes = out
        .lines()
        .find_map(|l| {
            let rest = l.trim().strip_prefix("Routes:")?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or(0);
    (state, routes)
}

/// Every `[proto <secs>.<micros>]` of a `show route` listing, in seconds since the epoch.
fn parse_times(out: &str) -> Vec<f64> {
    out.lines()
        .filter_map(|l| {
            let inner = l.split_once('[')?.1.split_once(']')?.0;
            inner.split_whitespace().nth(1)?.parse().ok()
        })
        .collect()
}

/// Now, in seconds since the epoch (what [`TIMEFORMAT`] prints).
pub fn epoch_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(f64::NAN, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_read_as_bird_writes_them() {
        let proto = "1002-Name       Proto      Table      State  Since         Info\n\
                     1002-calix      BGP        ---        up     1796358937.4  Established\n\
                     1006-  BGP state:          Established\n\
                     \x20 Channel ipv4\n    Routes:         10000 imported, 0 exported, 10000 preferred\n\
                     0000 \n";
        assert_eq!(parse_protocol(proto, "calix"), ("up".into(), 10000));
        assert_eq!(parse_protocol("0000 \n", "calix"), (String::new(), 0));
        let routes = "1007-Table master4:\n\
                      \x2010.192.0.0/26        unicast [calix 1796358937.450028] * (100) [AS65002i]\n\
                      1008-\tvia 10.253.0.2 on r0\n\
                      \x2010.192.0.64/26       unicast [calix 1796358937.451000] * (100) [AS65002i]\n0000 \n";
        let t = parse_times(routes);
        assert_eq!(t.len(), 2);
        assert!((t[1] - 1796358937.451).abs() < 1e-6, "{t:?}");
    }
}
