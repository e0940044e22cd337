//! A calix-agent process: its command line, directory (socket, datastore, config, log), bpffs
//! pin root, start, readiness, stop; calixctl against it.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;

use crate::netns::Netns;
use crate::process::{checked, command_in, run, spawn_logged, terminate, wait_ready};
use crate::{Error, Result};

/// The pool of an agent started without a config file.
pub const POOL: &str = "10.244.0.0/16";

/// Which dataplane an agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dataplane {
    Ebpf,
    Kernel,
}

impl Dataplane {
    /// The dataplane for tests that work in either: `CALIX_TEST_DATAPLANE` (`ebpf` or
    /// `kernel`), default eBPF. `cargo xtask test` runs those suites once per mode.
    pub fn under_test() -> Self {
        match std::env::var("CALIX_TEST_DATAPLANE").as_deref() {
            Ok("kernel") => Self::Kernel,
            _ => Self::Ebpf,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Kernel => "kernel",
        }
    }
}

/// How an agent runs: which binaries, which dataplane, its configuration.
#[derive(Clone)]
pub struct AgentSpec {
    /// Where `calix-agent` and `calixctl` are (target/<profile>).
    pub bins: PathBuf,
    pub dataplane: Dataplane,
    /// The config file's text (TOML); without one the agent gets `--pool <pool>`.
    pub config: Option<String>,
    pub pool: String,
    /// The embedded datastore's file (default `<dir>/store.json`).
    pub store_path: Option<PathBuf>,
    /// `--bpf-object`: programs other than the built-in ones.
    pub object: Option<PathBuf>,
    pub log_level: &'static str,
    /// Environment variables for the agent.
    pub env: Vec<(String, String)>,
    /// Pass `--node-name` (else the agent finds its name itself, e.g. in `CALIX_NODE_NAME`).
    pub node_name_flag: bool,
}

impl AgentSpec {
    /// The binaries in `bins`, pool [`POOL`], log level info.
    pub fn new(bins: PathBuf, dataplane: Dataplane) -> Self {
        Self {
            bins,
            dataplane,
            config: None,
            pool: POOL.into(),
            store_path: None,
            object: None,
            log_level: "info",
            env: Vec::new(),
            node_name_flag: true,
        }
    }
}

/// A calix-agent named `name`, in a network namespace or the root one. Stopped on drop; its
/// directory and pin root (`/sys/fs/bpf/<name>`) removed.
pub struct Agent {
    pub name: String,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub spec: AgentSpec,
    netns: Option<PathBuf>,
    child: Mutex<Option<Child>>,
}

impl Agent {
    /// The agent of `name` (not started), its files in `dir` (created).
    pub fn new(name: &str, dir: PathBuf, netns: Option<&Netns>, spec: AgentSpec) -> Result<Self> {
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("create {}", dir.display())))?;
        Ok(Self {
            name: name.to_string(),
            socket: dir.join("agent.sock"),
            dir,
            spec,
            netns: netns.map(|n| n.path().into()),
            child: Mutex::new(None),
        })
    }

    /// Its bpffs pin root (the agent pins below `<root>/<name>`).
    pub fn pin_root(&self) -> PathBuf {
        Path::new("/sys/fs/bpf").join(&self.name)
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    /// The agent's command line (the binary, its flags, then `extra`); writes its config file.
    pub fn args(&self, extra: &[&str]) -> Result<Vec<String>> {
        let s = &self.spec;
        let path = |p: &Path| p.display().to_string();
        let store = s.store_path.clone().unwrap_or(self.dir.join("store.json"));
        let mut args: Vec<String> = vec![path(&s.bins.join("calix-agent"))];
        if s.node_name_flag {
            args.extend(["--node-name".into(), self.name.clone()]);
        }
        args.extend([
            "--socket".into(),
            path(&self.socket),
            "--datastore-path".into(),
            path(&store),
            "--dataplane".into(),
            s.dataplane.as_str().into(),
            "--log-level".into(),
            s.log_level.into(),
            "--bpf-pin-root".into(),
            path(&self.pin_root()),
        ]);
        match &s.config {
            Some(text) => {
                let p = self.dir.join("agent.toml");
                std::fs::write(&p, text).map_err(Error::io(format!("write {}", p.display())))?;
                args.extend(["--config".into(), path(&p)]);
            }
            None => args.extend(["--pool".into(), s.pool.clone()]),
        }
        if let Some(o) = &s.object {
            args.extend(["--bpf-object".into(), path(o)]);
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        Ok(args)
    }

    /// (Re)starts the agent with `extra` arguments without waiting for it. It dies with the
    /// thread that starts it.
    pub fn spawn(&self, extra: &[&str]) -> Result<()> {
        let args = self.args(extra)?;
        let mut cmd = command_in(self.netns.as_deref(), &args[0], None, true)?;
        cmd.envs(self.spec.env.iter().map(|(k, v)| (k, v)));
        let child = spawn_logged(cmd.args(&args[1..]), &self.log_path())?;
        *self.child() = Some(child);
        Ok(())
    }

    /// (Re)starts the agent with `extra` arguments and waits until its socket answers.
    pub fn start(&self, extra: &[&str]) -> Result<()> {
        self.spawn(extra)?;
        let mut guard = self.child();
        let child = guard.as_mut().expect("spawned above");
        wait_ready(
            &format!("calix-agent ({} dataplane)", self.spec.dataplane.as_str()),
            child,
            &self.log_path(),
            Duration::from_secs(20),
            || self.calixctl(&["endpoints"]).status.success(),
        )
    }

    /// Kills the agent with SIGKILL (a crash) and reaps it.
    pub fn kill(&self) {
        if let Some(mut c) = self.child().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the agent with SIGTERM (it removes its socket) and waits for it, up to 10 s.
    pub fn stop(&self) {
        if let Some(mut c) = self.child().take() {
            terminate(&mut c, Duration::from_secs(10));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child().as_ref().map(Child::id)
    }

    /// Whether the agent exited, and how.
    pub fn exited(&self) -> Option<std::process::ExitStatus> {
        self.child()
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Runs `calixctl --socket <this agent's socket> <args>`.
    pub fn calixctl(&self, args: &[&str]) -> Output {
        run(Command::new(self.spec.bins.join("calixctl"))
            .arg("--socket")
            .arg(&self.socket)
            .args(args))
    }

    /// `calixctl --socket <this agent's>`, to add arguments to and run (e.g. spawn, for a
    /// command that streams).
    pub fn calixctl_command(&self) -> Command {
        let mut c = Command::new(self.spec.bins.join("calixctl"));
        c.arg("--socket").arg(&self.socket);
        c
    }

    /// `calixctl <args> -o json`, parsed.
    pub fn calixctl_json(&self, args: &[&str]) -> Result<Value> {
        crate::process::json(
            Command::new(self.spec.bins.join("calixctl"))
                .arg("--socket")
                .arg(&self.socket)
                .args(args)
                .args(["-o", "json"]),
        )
    }

    /// Number of addresses allocated in the datastore (`calixctl ipam show`).
    pub fn allocated(&self) -> Result<usize> {
        Ok(used(&self.calixctl_json(&["ipam", "show"])?))
    }

    /// Packets dropped on `iface` for `reason` (0 when never), from `calixctl bpf counters`.
    pub fn dropped(&self, iface: &str, reason: &str) -> Result<u64> {
        let v = self.calixctl_json(&["bpf", "counters"])?;
        Ok(v["drops"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|x| x["interface"] == iface && x["reason"] == reason)
            .filter_map(|x| x["packets"].as_u64())
            .sum())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- agent log of {} ---\n{}", self.name, self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(self.pin_root());
    }
}

/// Number of addresses allocated, from `calixctl ipam show -o json` output.
pub fn allocated_from(out: &Output) -> usize {
    assert!(
        out.status.success(),
        "calixctl ipam show failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("ipam show json");
    used(&v)
}

/// Addresses in use in every block of a `calixctl ipam show -o json` report.
fn used(report: &Value) -> usize {
    report["blocks"]
        .as_array()
        .map(|b| {
            b.iter()
                .map(|blk| blk["used"].as_u64().unwrap_or(0) as usize)
                .sum()
        })
        .unwrap_or(0)
}

/// Parses `calixctl endpoints -o json` output; panics with calixctl's stderr if it failed.
pub fn endpoints_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "calixctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("calixctl json")
}

/// Held by the one [`RootAgent`] a test process may run at a time.
static ROOT_AGENT_LOCK: Mutex<()> = Mutex::new(());

/// The forwarding sysctls the agent writes.
const FORWARDING_SYSCTLS: [&str; 2] = [
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/net/ipv6/conf/all/forwarding",
];

/// A calix-agent in the root network namespace, for the real container runtimes (podman,
/// containerd): they create the pod namespaces and exec the plugin from the host namespace, so
/// the host veths, routes and eBPF programs land there. The agent sets the host's forwarding
/// sysctls; they are saved first and restored on drop. Only one exists at a time per process
/// (it holds a lock), so its pool, links and sysctls never mix with another test's.
pub struct RootAgent {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub node_name: String,
    pub pool: String,
    agent: Agent,
    saved_sysctls: Vec<(&'static str, String)>,
    _lock: std::sync::MutexGuard<'static, ()>,
}

impl RootAgent {
    /// Starts an eBPF-dataplane agent on `pool` (e.g. `10.251.10.0/24`) and waits until its
    /// socket answers. Blocks while another `RootAgent` of this process runs.
    pub fn start(tag: &str, pool: &str) -> Self {
        crate::require_root();
        let lock = ROOT_AGENT_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let saved_sysctls = FORWARDING_SYSCTLS
            .iter()
            .filter_map(|p| {
                std::fs::read_to_string(p)
                    .ok()
                    .map(|v| (*p, v.trim().to_string()))
            })
            .collect();
        let node_name = format!("cxt-rt-{}-{tag}", std::process::id());
        let dir = std::env::temp_dir().join(crate::unique(tag));
        let spec = AgentSpec {
            pool: pool.to_string(),
            ..AgentSpec::new(crate::bin_dir(), Dataplane::Ebpf)
        };
        let agent = Agent::new(&node_name, dir, None, spec).unwrap_or_else(|e| panic!("{e}"));
        // Built before the agent starts, so that drop restores the sysctls even if start fails.
        let root = Self {
            dir: agent.dir.clone(),
            socket: agent.socket.clone(),
            node_name,
            pool: pool.to_string(),
            agent,
            saved_sysctls,
            _lock: lock,
        };
        root.agent.start(&[]).unwrap_or_else(|e| panic!("{e}"));
        root
    }

    pub fn agent_log(&self) -> String {
        self.agent.log()
    }

    /// Runs `calixctl --socket <this agent's socket> <args>`.
    pub fn calixctl(&self, args: &[&str]) -> Output {
        self.agent.calixctl(args)
    }

    /// `calixctl endpoints -o json`.
    pub fn endpoints(&self) -> Value {
        endpoints_json(&self.calixctl(&["endpoints", "-o", "json"]))
    }

    /// Number of addresses allocated in the datastore (`calixctl ipam show`).
    pub fn allocated(&self) -> usize {
        allocated_from(&self.calixctl(&["ipam", "show", "-o", "json"]))
    }

    /// `cali*` links in the root namespace.
    pub fn cali_links(&self) -> Vec<String> {
        let v = crate::process::json(Command::new("ip").args(["-j", "link", "show"]))
            .unwrap_or_else(|e| panic!("{e}"));
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["ifname"].as_str())
            .filter(|n| n.starts_with("cali"))
            .map(String::from)
            .collect()
    }

    /// Root-namespace routes (main table) to addresses inside this agent's pool.
    pub fn pool_routes(&self) -> Vec<Value> {
        let out = checked(Command::new("ip").args(["-j", "route", "show", "root", &self.pool]))
            .unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
    }
}

impl Drop for RootAgent {
    fn drop(&mut self) {
        self.agent.stop();
        // A stopped agent leaves its programs and nftables tables for the next one to take
        // over (restarts keep traffic flowing); in the root namespace nothing takes over:
        // `--uninstall` removes them, as an operator would.
        if let Some((bin, args)) = self
            .agent
            .args(&["--uninstall"])
            .ok()
            .as_deref()
            .and_then(<[String]>::split_first)
        {
            let _ = Command::new(bin)
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
        for (path, value) in &self.saved_sysctls {
            let _ = std::fs::write(path, value);
        }
        // The agent's own drop (after this) prints its log on a panic and removes its files.
    }
}
