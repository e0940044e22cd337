//! 10,000 prefixes advertised to a receiving BIRD 2 router: from calix's speaker (the agent's
//! peer task, in `calix-bgpsend`) and from another BIRD, on the same wire.
//!
//! Two namespaces joined by a veth: the receiver (10.253.0.1, BIRD with one passive eBGP
//! session per sender, importing everything) and the senders (10.253.0.2: calix; 10.253.0.3:
//! BIRD, whose static protocol holds the 10,000 routes, disabled). Both sessions come up
//! before anything is timed and stay up. Per repetition and sender (the order rotating): the
//! clock starts when the sender is told to announce (calix: the whole set put in the peer
//! task's `wanted` watch; BIRD: `enable` of its static protocol, over its control socket) and
//! stops when the receiver's protocol holds all 10,000 (`show protocols all`, polled every
//! [`POLL`]); BIRD's own timestamps of the routes say when the first and the last UPDATE was
//! read. Then the same for the withdrawal (the empty set; `disable`), until the receiver
//! holds none.
use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use calix_testbed::traffic::cpu::load_average;
use calix_testbed::{veth, Netns};
use plotters::style::RGBColor;

use super::super::chart;
use super::super::harness::{check_interrupted, repetitions, Bench, Compared};
use super::super::report::median;
use super::bird::{epoch_now, Bird, Ctl, TIMEFORMAT};

/// How many prefixes each sender announces.
pub const PREFIXES: u32 = 10_000;
/// The prefixes: consecutive /26s (pod blocks' default size) from here.
const FIRST: Ipv4Addr = Ipv4Addr::new(10, 192, 0, 0);
const LEN: u8 = 26;
/// How often the receiver is asked while a clock runs.
pub const POLL: Duration = Duration::from_millis(1);
/// The most a phase may take before the repetition fails.
const LIMIT: Duration = Duration::from_secs(30);
const RECEIVER: &str = "10.253.0.1";
const RECEIVER_AS: u32 = 65001;
/// Hold time both sides propose (s).
pub const HOLD: u16 = 90;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sender {
    Calix,
    Bird,
}

pub const SENDERS: [Sender; 2] = [Sender::Calix, Sender::Bird];

impl Compared for Sender {
    fn info(self) -> (&'static str, &'static str, RGBColor) {
        match self {
            Self::Calix => ("calix (agent's peer task)", "calix", chart::BLUE),
            Self::Bird => ("BIRD 2", "bird", chart::GREY),
        }
    }
}

impl Sender {
    /// The receiver's protocol for it.
    fn proto(self) -> &'static str {
        match self {
            Self::Calix => "from_calix",
            Self::Bird => "from_bird",
        }
    }

    /// Its address and AS.
    fn end(self) -> (&'static str, u32) {
        match self {
            Self::Calix => ("10.253.0.2", 65002),
            Self::Bird => ("10.253.0.3", 65003),
        }
    }
}

/// One sender over every repetition (ms after its clock started; segments; load).
#[derive(Default)]
pub struct Samples {
    /// The sender answered the cue (calix-bgpsend's `ok`; BIRD's reply to `enable`).
    pub cue: Vec<f64>,
    /// The receiver holds all of them (polled).
    pub all: Vec<f64>,
    /// BIRD's timestamps of the first and the last route (when their UPDATEs were read).
    pub first_in: Vec<f64>,
    pub last_in: Vec<f64>,
    /// The receiver holds none after the withdrawal (polled).
    pub gone: Vec<f64>,
    /// TCP segments the senders' namespace sent for the announcement.
    pub segments: Vec<f64>,
    pub load: Vec<f64>,
}

/// What `Advertised::update_to` takes in calix-bgpsend for the whole set: ms to announce, ms
/// to withdraw; the announcement's messages and bytes.
#[derive(Clone, Copy, Default)]
pub struct Encode {
    pub announce_ms: f64,
    pub withdraw_ms: f64,
    pub messages: usize,
    pub bytes: usize,
}

#[derive(Default)]
pub struct Results {
    pub by: [Samples; 2],
    /// One question to the receiver, round trip (ms).
    pub poll_ms: Vec<f64>,
    pub encode: Encode,
}

/// The prefixes, as BIRD's static routes.
fn static_routes() -> String {
    let mut s = String::new();
    for k in 0..PREFIXES {
        let a = Ipv4Addr::from(u32::from(FIRST) + (k << (32 - u32::from(LEN))));
        s.push_str(&format!("  route {a}/{LEN} blackhole;\n"));
    }
    s
}

/// The receiver: a passive session per sender, everything imported, nothing exported.
pub(super) fn receiver_conf() -> String {
    let mut c = format!("router id {RECEIVER};\n{TIMEFORMAT}protocol device {{}}\n");
    for s in SENDERS {
        let (addr, asn) = s.end();
        c.push_str(&format!(
            "protocol bgp {} {{ local {RECEIVER} as {RECEIVER_AS}; neighbor {addr} as {asn}; \
             passive on; hold time {HOLD}; ipv4 {{ import all; export none; }}; }}\n",
            s.proto()
        ));
    }
    c
}

/// The BIRD sender: the routes in a static protocol, disabled until the clock starts.
pub(super) fn sender_conf() -> String {
    let (addr, asn) = Sender::Bird.end();
    format!(
        "router id {addr};\nprotocol device {{}}\nprotocol static tenk {{ disabled yes; ipv4;\n{}}}\n\
         protocol bgp receiver {{ local {addr} as {asn}; neighbor {RECEIVER} as {RECEIVER_AS}; \
         hold time {HOLD}; connect delay time 1; connect retry time 1; error wait time 1, 2; \
         ipv4 {{ import none; export where proto = \"tenk\"; }}; }}\n",
        static_routes()
    )
}

/// `calix-bgpsend`: its stdout's lines as they come, its stdin to cue it. Killed on drop.
struct Calix {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Calix {
    fn start(b: &Bench, ns: &Netns) -> Result<Self> {
        let (addr, asn) = Sender::Calix.end();
        let mut cmd = ns.daemon(b.bins.join("calix-bgpsend"), None)?;
        cmd.args(["--local", addr, "--peer", RECEIVER])
            .args(["--asn", &asn.to_string()])
            .args(["--peer-asn", &RECEIVER_AS.to_string()])
            .args(["--hold-time", &HOLD.to_string()])
            .args(["--prefixes", &PREFIXES.to_string()])
            .args(["--first", &FIRST.to_string(), "--len", &LEN.to_string()]);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(b.dir.join("bgpsend.log"))?)
            .spawn()
            .context("starting calix-bgpsend")?;
        let stdout = child.stdout.take().context("its stdout")?;
        let stdin = child.stdin.take();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            lines,
        })
    }

    /// The next line, which must start with `word`: the rest of it.
    fn expect(&mut self, word: &str, timeout: Duration) -> Result<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => line
                .strip_prefix(word)
                .map(|r| r.trim().to_string())
                .ok_or_else(|| anyhow!("calix-bgpsend said {line:?}, expected {word}")),
            Err(RecvTimeoutError::Timeout) => bail!("calix-bgpsend: no {word} within {timeout:?}"),
            Err(RecvTimeoutError::Disconnected) => {
                let st = self.child.wait()?;
                bail!("calix-bgpsend exited ({st}) before {word} (its log: bgpsend.log)")
            }
        }
    }

    /// `announce` or `withdraw`, and its `ok`.
    fn tell(&mut self, what: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("calix-bgpsend's stdin")?;
        stdin.write_all(format!("{what}\n").as_bytes())?;
        stdin.flush()?;
        self.expect("ok", Duration::from_secs(5)).map(drop)
    }
}

impl Drop for Calix {
    fn drop(&mut self) {
        // EOF on stdin: a Cease to the receiver, then it exits; killed if it does not.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The topology, both sessions up. Dropped senders first, then the receiver, then the
/// namespaces.
struct Bed {
    calix: Calix,
    sender: Bird,
    receiver: Bird,
    senders_ns: Netns,
    _receiver_ns: Netns,
}

fn bed(b: &Bench) -> Result<(Bed, Encode)> {
    let rns = b.netns("bgp-r")?;
    let sns = b.netns("bgp-s")?;
    veth(&rns, "r0", &sns, "s0")?;
    rns.ip_batch(&format!("addr add {RECEIVER}/24 dev r0\nlink set r0 up"))?;
    let (calix, bird) = (Sender::Calix.end().0, Sender::Bird.end().0);
    sns.ip_batch(&format!(
        "addr add {calix}/24 dev s0\naddr add {bird}/24 dev s0\nlink set s0 up"
    ))?;
    let receiver = Bird::start(&rns, &b.dir, "receiver", &receiver_conf())?;
    let sender = Bird::start(&sns, &b.dir, "sender", &sender_conf())?;
    let mut c = Calix::start(b, &sns)?;
    let enc: Vec<f64> = c
        .expect("encoded", Duration::from_secs(30))?
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    let encode = match enc[..] {
        [a, w, m, bytes] => Encode {
            announce_ms: a,
            withdraw_ms: w,
            messages: m as usize,
            bytes: bytes as usize,
        },
        _ => bail!("calix-bgpsend's encoded line: {enc:?}"),
    };
    c.expect("established", Duration::from_secs(70))?;
    let mut bed = Bed {
        calix: c,
        sender,
        receiver,
        senders_ns: sns,
        _receiver_ns: rns,
    };
    let protos: Vec<&str> = SENDERS.iter().map(|s| s.proto()).collect();
    bed.receiver
        .ctl
        .until_up(&protos, 0, Duration::from_secs(30))?;
    Ok((bed, encode))
}

/// TCP segments sent from `ns` so far (`Tcp: OutSegs` of its /proc/net/snmp).
fn out_segments(ns: &Netns) -> Result<f64> {
    let snmp = ns
        .spawn(None, || {
            std::fs::read_to_string("/proc/thread-self/net/snmp").unwrap_or_default()
        })?
        .join()
        .map_err(|_| anyhow!("reading /proc/net/snmp in {}", ns.name))?;
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (keys, values) = (tcp.next().unwrap_or(""), tcp.next().unwrap_or(""));
    keys.split_whitespace()
        .zip(values.split_whitespace())
        .find_map(|(k, v)| (k == "OutSegs").then(|| v.parse().ok())?)
        .context("no Tcp OutSegs in /proc/net/snmp")
}

/// Polls `proto`'s routes at the receiver until `done` holds; when it did.
fn until(ctl: &mut Ctl, proto: &str, done: impl Fn(usize) -> bool) -> Result<Instant> {
    let start = Instant::now();
    loop {
        let n = ctl.imported(proto)?;
        let now = Instant::now();
        if done(n) {
            return Ok(now);
        }
        if now - start > LIMIT {
            bail!("the receiver's {proto} still holds {n} routes after {LIMIT:?}");
        }
        std::thread::sleep(POLL);
    }
}

impl Bed {
    fn tell(&mut self, s: Sender, announce: bool) -> Result<()> {
        match (s, announce) {
            (Sender::Calix, true) => self.calix.tell("announce"),
            (Sender::Calix, false) => self.calix.tell("withdraw"),
            (Sender::Bird, true) => self.sender.ctl.cmd("enable tenk").map(drop),
            (Sender::Bird, false) => self.sender.ctl.cmd("disable tenk").map(drop),
        }
    }

    /// One announcement and withdrawal by `s`; the progress line.
    fn measure(&mut self, s: Sender, out: &mut Samples) -> Result<String> {
        let proto = s.proto();
        let load = load_average();
        let segs0 = out_segments(&self.senders_ns)?;
        let (t0, w0) = (Instant::now(), epoch_now());
        self.tell(s, true)?;
        let cue = t0.elapsed().as_secs_f64() * 1e3;
        let all = until(&mut self.receiver.ctl, proto, |n| n >= PREFIXES as usize)?;
        let all = (all - t0).as_secs_f64() * 1e3;
        let segs = out_segments(&self.senders_ns)? - segs0;
        let times = self
            .receiver
            .ctl
            .route_times(&format!("protocol {proto}"))?;
        let ms = |t: f64| (t - w0) * 1e3;
        let first = ms(times.iter().copied().fold(f64::INFINITY, f64::min));
        let last = ms(times.iter().copied().fold(f64::NEG_INFINITY, f64::max));
        std::thread::sleep(Duration::from_millis(100));
        let t1 = Instant::now();
        self.tell(s, false)?;
        let gone = (until(&mut self.receiver.ctl, proto, |n| n == 0)? - t1).as_secs_f64() * 1e3;
        std::thread::sleep(Duration::from_millis(100));
        let (state, _) = self.receiver.ctl.protocol(proto)?;
        if state != "up" {
            bail!("the session from {} went down ({state})", s.label());
        }
        out.cue.push(cue);
        out.all.push(all);
        out.first_in.push(first);
        out.last_in.push(last);
        out.gone.push(gone);
        out.segments.push(segs);
        out.load.push(load);
        Ok(format!(
            "(load {load:.2}): cue answered in {cue:.2} ms, all {PREFIXES} held after {all:.2} ms \
             (first read at {first:.2}, last at {last:.2}; {segs:.0} TCP segments), none after \
             the withdrawal {gone:.2} ms"
        ))
    }
}

/// Runs the part: `reps` repetitions of both senders.
pub fn run(b: &Bench, reps: usize) -> Result<Results> {
    println!(
        "[setup] {PREFIXES} prefixes: receiver and senders (calix-bgpsend, BIRD) in two \
         namespaces, sessions coming up"
    );
    let (mut bed, encode) = bed(b)?;
    let mut res = Results {
        encode,
        ..Results::default()
    };
    // The floor of a poll: one question's round trip, asked as the clocks ask.
    for _ in 0..200 {
        let t = Instant::now();
        bed.receiver.ctl.imported(Sender::Bird.proto())?;
        res.poll_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "[setup] sessions up; calix builds the {PREFIXES} routes' UPDATEs in {:.2} ms ({} \
         messages, {} bytes); a poll of the receiver takes {:.3} ms",
        encode.announce_ms,
        encode.messages,
        encode.bytes,
        median(&res.poll_ms)
    );
    repetitions(reps, &SENDERS, |s| {
        check_interrupted()?;
        bed.measure(s, &mut res.by[s as usize])
    })?;
    Ok(res)
}
