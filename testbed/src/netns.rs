//! Named network namespaces (/run/netns/<name>), deleted on drop; commands, threads and raw
//! sockets inside them; tcpdump captures.
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::{checked, command_in, run, run_ok, Guarded};
use crate::{unique, Error, Result};

/// A named network namespace, deleted on drop unless it is a borrowed view of another.
pub struct Netns {
    pub name: String,
    owned: bool,
}

impl Netns {
    /// A namespace named [`unique`]`(tag)`, loopback up; panics on failure.
    pub fn new(tag: &str) -> Self {
        Self::create(unique(tag)).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A namespace named exactly `name`, loopback up.
    pub fn create(name: String) -> Result<Self> {
        checked(Command::new("ip").args(["netns", "add", &name]))?;
        // Owned from here: a half-set-up namespace is still deleted.
        let ns = Self { name, owned: true };
        ns.ip("link set lo up")?;
        Ok(ns)
    }

    /// A view of namespace `name` that does not delete it.
    pub fn borrowed(name: &str) -> Self {
        Self {
            name: name.to_string(),
            owned: false,
        }
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// A command that runs `argv` inside this namespace through `ip netns exec`.
    pub fn cmd(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).args(argv);
        c
    }

    /// A command that runs `argv` in this namespace by `setns` alone, keeping the caller's
    /// mount namespace (unlike `ip netns exec`, which remounts /sys privately: a daemon started
    /// that way would pin into a bpffs nobody else sees).
    pub fn cmd_setns(&self, argv: &[&str]) -> Command {
        let (program, args) = argv.split_first().expect("a program to run");
        let mut c = self.command(program).unwrap_or_else(|e| panic!("{e}"));
        c.args(args);
        c
    }

    /// `program` run in this namespace by `setns`, as a runtime execs a plugin there.
    pub fn command(&self, program: &str) -> Result<Command> {
        command_in(Some(self.path().as_ref()), program, None, false)
    }

    /// `program` as a daemon of this namespace: `setns`, on CPU `cpu` only when given, killed
    /// when the thread that starts it exits.
    pub fn daemon(
        &self,
        program: impl AsRef<std::ffi::OsStr>,
        cpu: Option<usize>,
    ) -> Result<Command> {
        command_in(Some(self.path().as_ref()), program, cpu, true)
    }

    pub fn exec(&self, argv: &[&str]) -> Output {
        run(&mut self.cmd(argv))
    }

    pub fn exec_ok(&self, argv: &[&str]) -> Output {
        run_ok(&mut self.cmd(argv))
    }

    /// `ip -n <this> <args>` (`args` split at whitespace).
    pub fn ip(&self, args: &str) -> Result<()> {
        let mut cmd = Command::new("ip");
        checked(cmd.args(["-n", &self.name]).args(args.split_whitespace())).map(drop)
    }

    /// `ip -n <this> -force -batch -` with `script` on stdin.
    pub fn ip_batch(&self, script: &str) -> Result<()> {
        use std::io::Write;
        let mut cmd = Command::new("ip");
        cmd.args(["-n", &self.name, "-force", "-batch", "-"]);
        let spawn_err = |source| Error::Spawn {
            cmd: format!("ip -n {} -batch", self.name),
            source,
        };
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        if let Some(mut si) = child.stdin.take() {
            si.write_all(script.as_bytes()).map_err(spawn_err)?;
        }
        let out = child.wait_with_output().map_err(spawn_err)?;
        if !out.status.success() {
            return Err(Error::Failed {
                cmd: format!("ip -n {} -batch <<< {script:?}", self.name),
                status: out.status,
                stdout: String::new(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(())
    }

    /// `sysctl -qw <kv>` inside this namespace.
    pub fn sysctl(&self, kv: &str) -> Result<()> {
        checked(
            self.command("sysctl")?
                .args(["-qw", kv])
                .stdout(Stdio::null()),
        )
        .map(drop)
    }

    /// The MAC address of `ifname` in this namespace.
    pub fn mac(&self, ifname: &str) -> Result<[u8; 6]> {
        let v = crate::process::json(
            Command::new("ip").args(["-n", &self.name, "-j", "link", "show", "dev", ifname]),
        )?;
        let s = v[0]["address"].as_str().unwrap_or_default();
        let bytes: Vec<u8> = s
            .split(':')
            .filter_map(|b| u8::from_str_radix(b, 16).ok())
            .collect();
        bytes.try_into().map_err(|_| Error::Missing {
            field: format!("MAC address of {ifname}"),
            value: v.to_string(),
        })
    }

    /// Runs `f` on a thread of its own inside this namespace (sockets it opens live there).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let h = self.spawn(None, f).unwrap_or_else(|e| panic!("{e}"));
        h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    /// Starts `f` on a new thread that entered this namespace (`setns` moves only that thread)
    /// and, with `cpu`, runs on that CPU only. Sockets keep the namespace they were created
    /// in, whichever thread uses them later.
    pub fn spawn<T: Send + 'static>(
        &self,
        cpu: Option<usize>,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<std::thread::JoinHandle<T>> {
        let path = self.path();
        let file = std::fs::File::open(&path).map_err(Error::io(format!("open {path}")))?;
        Ok(std::thread::spawn(move || {
            // SAFETY: setns(2) on a namespace fd we hold; CLONE_NEWNET moves this thread only.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                panic!("setns {path}: {}", std::io::Error::last_os_error());
            }
            if let Some(c) = cpu {
                // SAFETY: cpu_set_t is plain data (all zeroes: the empty set); CPU_SET sets one
                // bit; sched_setaffinity(0, …) pins this thread.
                let ok = unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(c, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) == 0
                };
                assert!(ok, "pin to CPU {c}: {}", std::io::Error::last_os_error());
            }
            f()
        }))
    }

    /// Pings `dst` `count` times from inside this namespace; returns whether all replies came.
    pub fn ping(&self, dst: &str, count: u32) -> bool {
        let count = count.to_string();
        let argv = ["ping", "-c", &count, "-i", "0.2", "-W", "2", "-q", dst];
        self.exec(&argv).status.success()
    }

    /// Names of the links in this namespace.
    pub fn links(&self) -> Vec<String> {
        let out = self.exec_ok(&["ip", "-j", "link", "show"]);
        let v: Value = serde_json::from_slice(&out.stdout).expect("ip -j link");
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|l| l["ifname"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Routes of the main table, as `ip -j route` objects.
    pub fn routes(&self) -> Vec<Value> {
        let out = self.exec_ok(&["ip", "-j", "route", "show"]);
        serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
    }

    /// Writes each of `frames` (whole Ethernet frames, as built by [`crate::packets`]) onto
    /// `ifname` inside this namespace through a raw `AF_PACKET` socket: what a hostile pod can
    /// put on its veth.
    pub fn send_frames(&self, ifname: &str, frames: &[Vec<u8>]) {
        let ifname = ifname.to_string();
        let frames = frames.to_vec();
        let sent = self.run(move || -> std::io::Result<()> {
            let mut s = PacketSocket::open(&ifname, 0, false)?;
            frames.iter().try_for_each(|f| s.send(f))
        });
        if let Err(e) = sent {
            panic!("sending raw frames in {}: {e}", self.name);
        }
    }

    /// Starts tcpdump on `ifname` in this namespace (every frame, written as it comes) and
    /// waits until it listens.
    pub fn capture(&self, ifname: &str) -> Capture {
        let pcap = std::env::temp_dir().join(format!("{}-{ifname}.pcap", self.name));
        let log = pcap.with_extension("log");
        let log_file = std::fs::File::create(&log).expect("tcpdump log");
        let child = self
            .cmd(&["tcpdump", "-i", ifname, "-n", "-U", "-w"])
            .arg(&pcap)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn tcpdump");
        let capture = Capture {
            child: Guarded(child),
            pcap,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(&capture.log)
            .unwrap_or_default()
            .contains("listening on")
        {
            assert!(
                Instant::now() < deadline,
                "tcpdump did not start on {ifname}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        capture
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if self.owned {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.name])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A veth pair: `a_if` in `a`, its peer `b_if` in `b`, both down and unaddressed.
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> Result<()> {
    a.ip(&format!(
        "link add {a_if} type veth peer name {b_if} netns {}",
        b.name
    ))?;
    // No DAD on either end's link-local address: a router sends no neighbour solicitation for
    // a forwarded packet while the link's link-local address is tentative (up to 2 s after
    // the link comes up), so a test's first IPv6 packet through a fresh router was lost now
    // and then. A real underlay's links finished DAD long before their first pod.
    a.sysctl(&format!("net/ipv6/conf/{a_if}/accept_dad=0"))?;
    b.sysctl(&format!("net/ipv6/conf/{b_if}/accept_dad=0"))
}

/// Wires a node's uplink: veth `uplink` in `node`, addressed `node_cidr` and up, whose peer is
/// `eth0` (up, unaddressed: the caller gives it its addresses) in `outside`.
pub fn uplink(node: &Netns, outside: &Netns, uplink: &str, node_cidr: &str) -> Result<()> {
    veth(node, uplink, outside, "eth0")?;
    node.ip(&format!("addr add {node_cidr} dev {uplink}"))?;
    node.ip(&format!("link set {uplink} up"))?;
    outside.ip("link set eth0 up")
}

/// A running tcpdump ([`Netns::capture`]); its files go when it is dropped.
pub struct Capture {
    child: Guarded,
    pcap: PathBuf,
    log: PathBuf,
}

impl Capture {
    /// What was captured so far, as `tcpdump -r -n -e -A` prints it (link-level headers, VLAN
    /// tags and payloads as text).
    pub fn text(&self) -> String {
        let out = run(Command::new("tcpdump")
            .args(["-r"])
            .arg(&self.pcap)
            .args(["-n", "-e", "-A"]));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
        let _ = std::fs::remove_file(&self.pcap);
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A raw `AF_PACKET` socket that writes whole Ethernet frames out of one interface of the
/// namespace of the thread that opens it.
pub struct PacketSocket {
    pub fd: OwnedFd,
    /// The destination address: the interface, the frames' protocol, their destination MAC.
    pub to: libc::sockaddr_ll,
}

impl PacketSocket {
    /// Opens it on `ifname`; `protocol` (host order, 0 for "from the frame") goes into the
    /// address; with `qdisc_bypass`, frames go straight to the driver.
    pub fn open(ifname: &str, protocol: u16, qdisc_bypass: bool) -> std::io::Result<Self> {
        let name = std::ffi::CString::new(ifname).map_err(std::io::Error::other)?;
        // SAFETY: a NUL-terminated name, looked up in this thread's namespace.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index == 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: plain socket(2); protocol 0: a send-only packet socket (it receives nothing).
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: socket(2) just returned it; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with an int option of the right size.
        if qdisc_bypass
            && unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_PACKET,
                    libc::PACKET_QDISC_BYPASS,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            } != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: all-zero is a valid sockaddr_ll.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_protocol = protocol.to_be();
        to.sll_ifindex = i32::try_from(index).map_err(std::io::Error::other)?;
        to.sll_halen = 6;
        Ok(Self { fd, to })
    }

    /// Sets the destination MAC of the address to `frame`'s.
    pub fn address(&mut self, frame: &[u8]) {
        self.to.sll_addr[..6].copy_from_slice(&frame[..6]);
    }

    /// Writes one frame.
    pub fn send(&mut self, frame: &[u8]) -> std::io::Result<()> {
        self.address(frame);
        // SAFETY: the frame and the address are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&self.to as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}
