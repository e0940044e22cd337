//! Traffic measurements between two namespaces, as the benches take them: TCP_CRR and TCP_RR
//! with the netperf-style tool ([`netperf`]), iperf3 throughput, nstat counters around them,
//! how busy the rest of the machine was meanwhile ([`cpu`]); a packet flood ([`flood`]); a TCP
//! echo for reachability checks ([`echo`]); ICMP probes that time reachability ([`probe`]).
pub mod cpu;
pub mod echo;
pub mod flood;
pub mod netperf;
pub mod probe;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use netperf::{Mode, Report};

use crate::netns::Netns;
use crate::process::{json, num, spawn_logged, stdout, wait_ready, Guarded};
use crate::{Error, Result};

pub const NETPERF_PORT: u16 = 7001;
pub const IPERF_PORT: u16 = 5201;
/// Niceness of the receiving iperf3 (see [`Tools::start`]).
pub const IPERF_NICE: &str = "-5";
/// Linux ≥ 6.13: how long a TIME_WAIT port waits before `tcp_tw_reuse` may reuse it.
pub const TW_REUSE_DELAY: &str = "/proc/sys/net/ipv4/tcp_tw_reuse_delay";
/// The receiver's counter of zero-window advertisements (a receiver that fell behind).
const ZERO_WINDOW: &str = "TcpExtTCPToZeroWindowAdv";
/// The untimed warm-up: TCP_CRR then TCP_RR for this long.
const WARMUP_SECS: f64 = 0.5;

/// Client → server traffic: the client's namespace, the server's, and the server's address
/// (a Service's: the client in `client_cgroup`, where calix's socket programs are attached).
pub struct Traffic {
    pub client: Netns,
    pub server: Netns,
    pub server_ip: Ipv4Addr,
    pub client_cgroup: Option<PathBuf>,
}

impl Traffic {
    pub fn new(client: &Netns, server: &Netns, server_ip: Ipv4Addr) -> Self {
        Self {
            client: Netns::borrowed(&client.name),
            server: Netns::borrowed(&server.name),
            server_ip,
            client_cgroup: None,
        }
    }

    /// With the netperf client in the cgroup v2 directory `dir`.
    pub fn in_cgroup(mut self, dir: &Path) -> Self {
        self.client_cgroup = Some(dir.to_path_buf());
        self
    }
}

/// What measures: the binary whose `netperf` subcommand runs [`netperf`] (xtask), and the one
/// CPU every client and server is pinned to.
pub struct Tools {
    pub netperf: PathBuf,
    pub cpu: usize,
}

/// One repetition of [`Tools::measure`].
pub struct Measured {
    /// The load average before it.
    pub load: f64,
    /// Over it: how busy the CPUs the measurement does not use were (%), and its CPU's steal
    /// time (%).
    pub others_busy: f64,
    pub steal: f64,
    pub crr: Report,
    pub rr: Report,
    pub gbps: f64,
    /// Zero-window advertisements of the iperf3 receiver (NaN unless watched).
    pub zero_windows: f64,
    /// IpForwDatagrams of the watched namespace during TCP_CRR, TCP_RR and iperf3.
    pub forwarded: Option<[f64; 3]>,
}

impl Tools {
    /// The servers of `t` (netperf and iperf3, pinned to the CPU), up and listening, their logs
    /// in `logs`; the client's namespace set for TCP_CRR.
    pub fn start(&self, t: &Traffic, logs: &Path) -> Result<Vec<Guarded>> {
        // TCP_CRR opens tens of thousands of connections a second and the client closes first,
        // so its ports sit in TIME_WAIT: every port of the client's namespace, and TIME_WAIT
        // ports reused for new connections (safe with timestamps) after 1 ms instead of 1 s.
        // Without the delay, connect() (which takes even ports first) runs out at ~32k
        // connections/s on any dataplane.
        t.client.sysctl("net.ipv4.ip_local_port_range=1024 65535")?;
        t.client.sysctl("net.ipv4.tcp_tw_reuse=1")?;
        if Path::new(TW_REUSE_DELAY).exists() {
            t.client.sysctl("net.ipv4.tcp_tw_reuse_delay=1")?;
        }
        let listen = SocketAddr::from((t.server_ip, NETPERF_PORT)).to_string();
        let mut netperf = t.server.daemon(&self.netperf, Some(self.cpu))?;
        netperf.args(["netperf", "server", "--listen", &listen]);
        // The receiving iperf3 runs at nice -5: with both ends on one CPU the sender also runs
        // the receive softirq, and an equal-priority receiver falls behind in about half the
        // runs on this kernel — the window closes thousands of times a second and the run
        // settles near a third of its throughput, on any dataplane (even a raw veth).
        let mut iperf = t.server.daemon("nice", Some(self.cpu))?;
        let (ip, port) = (t.server_ip.to_string(), IPERF_PORT.to_string());
        iperf.args(["-n", IPERF_NICE, "iperf3", "-s", "-B", &ip, "-p", &port]);
        let mut servers = Vec::new();
        for (name, mut cmd, port) in [
            ("netperf", netperf, NETPERF_PORT),
            ("iperf3", iperf, IPERF_PORT),
        ] {
            let log = logs.join(format!("{}-{name}.log", t.server.name));
            // Guarded before it is waited for: a server that never listens is killed too.
            let mut server = Guarded(spawn_logged(&mut cmd, &log)?);
            let pid = server.0.id();
            let what = format!("the {name} server in {}", t.server.name);
            wait_ready(&what, &mut server.0, &log, Duration::from_secs(10), || {
                listening(pid, port)
            })?;
            servers.push(server);
        }
        Ok(servers)
    }

    /// `netperf <mode>` from the client to the server for `secs`.
    pub fn netperf(&self, t: &Traffic, mode: Mode, secs: f64) -> Result<Report> {
        let to = SocketAddr::from((t.server_ip, NETPERF_PORT)).to_string();
        let mut cmd = t.client.daemon(&self.netperf, Some(self.cpu))?;
        cmd.args(["netperf", mode.as_str(), "--to", &to, "--secs"])
            .arg(secs.to_string());
        if let Some(cg) = &t.client_cgroup {
            cmd.arg("--cgroup").arg(cg);
        }
        Report::from_json(&json(&mut cmd)?)
    }

    /// iperf3 (cubic) from the client to the server for `secs`: Gbit/s received.
    pub fn iperf(&self, t: &Traffic, secs: u64) -> Result<f64> {
        let mut cmd = t.client.daemon("iperf3", Some(self.cpu))?;
        let (ip, port) = (t.server_ip.to_string(), IPERF_PORT.to_string());
        cmd.args(["-c", &ip, "-p", &port, "-t", &secs.to_string()])
            .args(["-C", "cubic", "--connect-timeout", "3000", "-J"]);
        let v = json(&mut cmd)?;
        let cc = v["end"]["sender_tcp_congestion"].as_str().unwrap_or("?");
        if cc != "cubic" {
            return Err(Error::Unexpected {
                what: "iperf3's congestion control".into(),
                found: cc.into(),
                expected: "cubic".into(),
            });
        }
        Ok(num(&v, &["end", "sum_received", "bits_per_second"])? / 1e9)
    }

    /// The untimed warm-up, which also proves the path works before anything is timed:
    /// TCP_CRR, then TCP_RR (returned).
    pub fn warm_up(&self, t: &Traffic) -> Result<Report> {
        self.netperf(t, Mode::Crr, WARMUP_SECS)?;
        self.netperf(t, Mode::Rr, WARMUP_SECS)
    }

    /// One repetition: TCP_CRR, TCP_RR and iperf3, each `secs` long; with `forwarding`, that
    /// namespace's IpForwDatagrams read around each; with `zero_windows`, the receiver's
    /// zero-window advertisements around iperf3.
    pub fn measure(
        &self,
        t: &Traffic,
        secs: u64,
        forwarding: Option<&Netns>,
        zero_windows: bool,
    ) -> Result<Measured> {
        let fwd = || forwarding.map(|n| nstat(n, "IpForwDatagrams")).transpose();
        let load = cpu::load_average();
        let cpu0 = cpu::CpuStat::read();
        let f0 = fwd()?;
        let crr = self.netperf(t, Mode::Crr, secs as f64)?;
        let f1 = fwd()?;
        let rr = self.netperf(t, Mode::Rr, secs as f64)?;
        let f2 = fwd()?;
        let zero = || -> Result<f64> {
            match zero_windows {
                true => nstat(&t.server, ZERO_WINDOW),
                false => Ok(f64::NAN),
            }
        };
        let z0 = zero()?;
        let gbps = self.iperf(t, secs)?;
        let zero_windows = zero()? - z0;
        let f3 = fwd()?;
        let (others_busy, steal) = cpu::CpuStat::read().shares_since(&cpu0, self.cpu);
        let forwarded = match (f0, f1, f2, f3) {
            (Some(a), Some(b), Some(c), Some(d)) => Some([b - a, c - b, d - c]),
            _ => None,
        };
        Ok(Measured {
            load,
            others_busy,
            steal,
            crr,
            rr,
            gbps,
            zero_windows,
            forwarded,
        })
    }
}

/// Counter `name` of namespace `ns` (`nstat -asz <name>` run inside it).
pub fn nstat(ns: &Netns, name: &str) -> Result<f64> {
    let out = stdout(ns.command("nstat")?.args(["-asz", name]))?;
    out.lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(name))
                .then(|| it.next().and_then(|v| v.parse().ok()))
                .flatten()
        })
        .ok_or_else(|| Error::Missing {
            field: name.into(),
            value: out.clone(),
        })
}

/// Whether process `pid`'s network namespace has a TCP socket listening on `port`.
pub fn listening(pid: u32, port: u16) -> bool {
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{f}"))
            .is_ok_and(|table| listens_on(&table, port))
    })
}

/// Whether a `/proc/net/tcp{,6}` table holds a LISTEN socket (state `0A`) on local `port`.
fn listens_on(table: &str, port: u16) -> bool {
    table.lines().skip(1).any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.len() > 3
            && cols[3] == "0A"
            && cols[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_sockets_are_found_by_port() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0200F40A:1B59 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0200F40A:1451 0100F40A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1
";
        assert!(listens_on(table, 7001));
        // Established, not listening.
        assert!(!listens_on(table, 5201));
        assert!(!listens_on("", 7001));
    }
}
