//! The calix integration-test harness: throwaway network namespaces ("nodes" and "pods"), a real
//! calix-agent per node, the real `calix` CNI binary exec'd with a real environment and stdin.
//! Everything is named with a unique `cxt` prefix and removed on drop, even when a test fails.
//!
//! These tests need root (network namespaces, eBPF). Build the binaries first:
//! `cargo xtask test` does it all.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Prefix of every namespace and directory the tests create.
pub const PREFIX: &str = "cxt";

/// A name unique to this process and call: `cxt<pid>x<n><tag>`.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{PREFIX}{}x{}{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Panics unless running as root, with a clear message.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the calix integration tests need root (network namespaces, eBPF)"
    );
}

/// The upgrade-test build of the eBPF programs (`cargo xtask test` builds it):
/// `target/ebpf/calix-upgrade-test.bpf.o`.
pub fn upgrade_test_object() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let target = exe
        .ancestors()
        .nth(3)
        .expect("test binary lives in target/<profile>/deps");
    let p = target.join("ebpf").join("calix-upgrade-test.bpf.o");
    assert!(
        p.exists(),
        "{} is missing: `cargo xtask test` builds it (the eBPF programs with --features upgrade-test)",
        p.display()
    );
    p
}

/// Path of a workspace binary built next to this test (target/<profile>/<name>).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test>-<hash>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (`cargo build --workspace --bins`, or `cargo xtask test`)",
        p.display()
    );
    p
}

/// Runs a command and returns its output; panics if it cannot be started.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs a command and panics unless it succeeds.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A named network namespace (/run/netns/<name>), deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Self {
        let name = unique(tag);
        run_ok(Command::new("ip").args(["netns", "add", &name]));
        let ns = Self { name };
        ns.exec_ok(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// A command that runs `argv` inside this namespace.
    pub fn cmd(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).args(argv);
        c
    }

    /// A command that runs `argv` in this namespace by `setns` alone, keeping the caller's
    /// mount namespace (unlike `ip netns exec`, which remounts /sys privately: a daemon started
    /// that way would pin into a bpffs nobody else sees).
    pub fn cmd_setns(&self, argv: &[&str]) -> Command {
        use std::os::unix::process::CommandExt;
        let (program, args) = argv.split_first().expect("a program to run");
        let mut c = Command::new(program);
        c.args(args);
        let path = self.path();
        // SAFETY: pre_exec runs in the forked child before exec; open(2) and setns(2) are
        // async-signal-safe, and nothing here allocates after the fork except the CString,
        // which is built before.
        let cpath = std::ffi::CString::new(path).expect("netns path");
        unsafe {
            c.pre_exec(move || {
                let fd = libc::open(cpath.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
                Ok(())
            });
        }
        c
    }

    pub fn exec(&self, argv: &[&str]) -> Output {
        run(&mut self.cmd(argv))
    }

    pub fn exec_ok(&self, argv: &[&str]) -> Output {
        run_ok(&mut self.cmd(argv))
    }

    /// Pings `dst` `count` times from inside this namespace; returns whether all replies came.
    pub fn ping(&self, dst: &str, count: u32) -> bool {
        self.exec(&[
            "ping",
            "-c",
            &count.to_string(),
            "-i",
            "0.2",
            "-W",
            "2",
            "-q",
            dst,
        ])
        .status
        .success()
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
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
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
    v["blocks"]
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

/// Which dataplane a test node runs.
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

/// The outcome of one CNI call.
#[derive(Debug)]
pub struct CniOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    pub json: Option<Value>,
}

impl CniOutput {
    /// The error code of a failed call.
    pub fn code(&self) -> Option<u64> {
        self.json.as_ref().and_then(|j| j["code"].as_u64())
    }

    /// The first IP address of a successful ADD, without prefix.
    pub fn ip(&self) -> String {
        let j = self
            .json
            .as_ref()
            .unwrap_or_else(|| panic!("no JSON result: {self:?}"));
        let a = j["ips"][0]["address"]
            .as_str()
            .unwrap_or_else(|| panic!("no ips in {j}"));
        a.split('/').next().unwrap_or(a).to_string()
    }
}

/// A test node: a namespace with an address on lo, and a calix-agent running inside it.
pub struct Node {
    pub ns: Netns,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub node_ip: String,
    pub dataplane: Dataplane,
    agent: std::sync::Mutex<Option<Child>>,
    config: Option<String>,
}

pub const NODE_IP: &str = "10.99.0.1";
pub const POOL: &str = "10.244.0.0/16";

impl Node {
    /// Starts a node with the default pool.
    pub fn start(dataplane: Dataplane) -> Self {
        Self::start_with_config(dataplane, None)
    }

    /// Starts a node whose agent reads `config` (TOML) in addition to the flags.
    pub fn start_with_config(dataplane: Dataplane, config: Option<&str>) -> Self {
        let node = Self::create(dataplane, config);
        node.start_agent();
        node
    }

    /// A node namespace with its loopback address, the agent not yet started.
    pub fn create(dataplane: Dataplane, config: Option<&str>) -> Self {
        require_root();
        let ns = Netns::new("n");
        ns.exec_ok(&["ip", "addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"]);
        let dir = std::env::temp_dir().join(&ns.name);
        std::fs::create_dir_all(&dir).expect("node dir");
        Self {
            socket: dir.join("agent.sock"),
            dir,
            ns,
            node_ip: NODE_IP.into(),
            dataplane,
            agent: std::sync::Mutex::new(None),
            config: config.map(String::from),
        }
    }

    /// The same node with its agent reading `config` (TOML).
    pub fn with_config(mut self, config: &str) -> Self {
        self.config = Some(config.to_string());
        self
    }

    /// (Re)starts the agent and waits until its socket answers.
    pub fn start_agent(&self) {
        self.start_agent_with(&[]);
    }

    /// (Re)starts the agent with `extra` arguments and waits until its socket answers.
    pub fn start_agent_with(&self, extra: &[&str]) {
        let mut args: Vec<String> = vec![
            bin("calix-agent").display().to_string(),
            "--node-name".into(),
            self.ns.name.clone(),
            "--socket".into(),
            self.socket.display().to_string(),
            "--datastore-path".into(),
            self.dir.join("store.json").display().to_string(),
            "--dataplane".into(),
            self.dataplane.as_str().into(),
            "--log-level".into(),
            "info".into(),
            "--bpf-pin-root".into(),
            self.pin_root().display().to_string(),
        ];
        match &self.config {
            Some(text) => {
                let p = self.dir.join("agent.toml");
                std::fs::write(&p, text).expect("write agent config");
                args.push("--config".into());
                args.push(p.display().to_string());
            }
            None => {
                args.push("--pool".into());
                args.push(POOL.into());
            }
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        let log = std::fs::File::create(self.dir.join("agent.log")).expect("agent log");
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = self
            .ns
            .cmd_setns(&argv)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn calix-agent");
        *self.child() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.calixctl(&["endpoints"]).status.success() {
                return;
            }
            let exited = self.child().as_mut().map(|c| c.try_wait());
            if let Some(Ok(Some(st))) = exited {
                panic!("calix-agent exited ({st}) at start:\n{}", self.agent_log());
            }
            assert!(
                Instant::now() < deadline,
                "calix-agent did not come up:\n{}",
                self.agent_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// This node's bpffs pin root (unique per test node, removed on drop).
    pub fn pin_root(&self) -> PathBuf {
        PathBuf::from("/sys/fs/bpf").join(&self.ns.name)
    }

    /// Kills the agent with SIGKILL (a crash) and reaps it.
    pub fn kill_agent(&self) {
        let taken = self.child().take();
        if let Some(mut c) = taken {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the agent with SIGTERM and waits for it.
    pub fn stop_agent(&self) {
        let taken = self.child().take();
        if let Some(mut c) = taken {
            // The agent is exec'd directly (setns in pre_exec): the child pid is the agent's.
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn agent_pid(&self) -> Option<u32> {
        self.child().as_ref().map(Child::id)
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.agent.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// A calix network config (JSON) pointing at this node's agent.
    pub fn conf(&self, extra: Value) -> Value {
        let mut c = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "calix-test",
            "type": "calix",
            "agent_socket": self.socket.display().to_string(),
        });
        if let (Some(c), Some(e)) = (c.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                c.insert(k.clone(), v.clone());
            }
        }
        c
    }

    /// Execs the real `calix` binary in this node's namespace.
    pub fn cni(
        &self,
        command: &str,
        container_id: &str,
        netns: &str,
        cni_args: &str,
        conf: &Value,
    ) -> CniOutput {
        cni_call(
            &self.ns,
            command,
            container_id,
            netns,
            "eth0",
            cni_args,
            &conf.to_string(),
        )
    }

    pub fn calixctl(&self, args: &[&str]) -> Output {
        let ctl = bin("calixctl").display().to_string();
        let sock = self.socket.display().to_string();
        let mut argv = vec![ctl.as_str(), "--socket", sock.as_str()];
        argv.extend_from_slice(args);
        self.ns.exec(&argv)
    }

    /// `calixctl bpf counters -o json`.
    pub fn drops_json(&self) -> Value {
        let out = self.calixctl(&["bpf", "counters", "-o", "json"]);
        assert!(
            out.status.success(),
            "calixctl bpf counters: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("bpf counters json")
    }

    /// Packets dropped on interface `iface` for `reason` (its name, e.g. "conntrack_full").
    pub fn dropped(&self, iface: &str, reason: &str) -> u64 {
        self.drops_json()["drops"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter(|x| x["interface"] == iface && x["reason"] == reason)
                    .map(|x| x["packets"].as_u64().unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0)
    }

    /// `calixctl endpoints -o json`.
    pub fn endpoints(&self) -> Value {
        endpoints_json(&self.calixctl(&["endpoints", "-o", "json"]))
    }

    /// Number of addresses allocated in the datastore (`calixctl ipam show`).
    pub fn allocated(&self) -> usize {
        allocated_from(&self.calixctl(&["ipam", "show", "-o", "json"]))
    }

    /// `cali*` links in the node namespace.
    pub fn cali_links(&self) -> Vec<String> {
        self.ns
            .links()
            .into_iter()
            .filter(|l| l.starts_with("cali"))
            .collect()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_agent();
        if std::thread::panicking() {
            eprintln!(
                "--- agent log of {} ---\n{}",
                self.ns.name,
                self.agent_log()
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(self.pin_root());
    }
}

/// Execs `calix` inside `node_ns` with a CNI environment and `stdin`.
pub fn cni_call(
    node_ns: &Netns,
    command: &str,
    container_id: &str,
    netns: &str,
    ifname: &str,
    cni_args: &str,
    stdin: &str,
) -> CniOutput {
    plugin_call(
        node_ns,
        &bin("calix"),
        command,
        container_id,
        netns,
        ifname,
        cni_args,
        stdin,
    )
}

/// Execs any CNI plugin binary inside `node_ns` the way a runtime does.
#[allow(clippy::too_many_arguments)]
pub fn plugin_call(
    node_ns: &Netns,
    plugin: &Path,
    command: &str,
    container_id: &str,
    netns: &str,
    ifname: &str,
    cni_args: &str,
    stdin: &str,
) -> CniOutput {
    use std::io::Write;
    let plugin = plugin.display().to_string();
    let mut child = node_ns
        .cmd(&[&plugin])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", ifname)
        .env("CNI_ARGS", cni_args)
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn plugin");
    if let Some(mut si) = child.stdin.take() {
        let _ = si.write_all(stdin.as_bytes());
    }
    let out = child.wait_with_output().expect("wait plugin");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    CniOutput {
        success: out.status.success(),
        json: serde_json::from_str(&stdout).ok(),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).to_string(),
    }
}

/// A minimal libcni: runs a conflist's plugins in order for ADD (each gets the previous result
/// as `prevResult`, and the `runtimeConfig` keys its `capabilities` ask for), and in reverse for
/// DEL/CHECK with the cached result. `calix` is the binary under test; every other type comes
/// from Debian's reference plugins in /usr/lib/cni.
pub struct ConfList {
    pub list: Value,
}

impl ConfList {
    fn plugin_conf(&self, i: usize, prev: Option<&Value>, rc: &Value) -> (PathBuf, Value) {
        let mut p = self.list["plugins"][i].clone();
        let ty = p["type"].as_str().unwrap_or_default().to_string();
        let path = if ty == "calix" {
            bin("calix")
        } else {
            PathBuf::from("/usr/lib/cni").join(&ty)
        };
        let caps: Vec<String> = p["capabilities"]
            .as_object()
            .map(|c| {
                c.iter()
                    .filter(|(_, v)| v.as_bool() == Some(true))
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(obj) = p.as_object_mut() {
            obj.insert("name".into(), self.list["name"].clone());
            obj.insert("cniVersion".into(), self.list["cniVersion"].clone());
            if let Some(prev) = prev {
                obj.insert("prevResult".into(), prev.clone());
            }
            let mut runtime = serde_json::Map::new();
            for c in caps {
                if let Some(v) = rc.get(&c) {
                    runtime.insert(c, v.clone());
                }
            }
            if !runtime.is_empty() {
                obj.insert("runtimeConfig".into(), Value::Object(runtime));
            }
        }
        (path, p)
    }

    fn len(&self) -> usize {
        self.list["plugins"].as_array().map_or(0, Vec::len)
    }

    /// ADD through every plugin; returns the final result or the failing call.
    pub fn add(
        &self,
        node: &Node,
        cid: &str,
        netns: &str,
        args: &str,
        rc: &Value,
    ) -> Result<Value, CniOutput> {
        let mut prev: Option<Value> = None;
        for i in 0..self.len() {
            let (path, conf) = self.plugin_conf(i, prev.as_ref(), rc);
            let out = plugin_call(
                &node.ns,
                &path,
                "ADD",
                cid,
                netns,
                "eth0",
                args,
                &conf.to_string(),
            );
            if !out.success {
                return Err(out);
            }
            prev = out.json;
        }
        Ok(prev.unwrap_or(Value::Null))
    }

    /// DEL or CHECK through every plugin in reverse, with the cached ADD result.
    #[allow(clippy::too_many_arguments)]
    pub fn run_reverse(
        &self,
        node: &Node,
        command: &str,
        cid: &str,
        netns: &str,
        args: &str,
        rc: &Value,
        cached: Option<&Value>,
    ) -> Result<(), CniOutput> {
        for i in (0..self.len()).rev() {
            let (path, conf) = self.plugin_conf(i, cached, rc);
            let out = plugin_call(
                &node.ns,
                &path,
                command,
                cid,
                netns,
                "eth0",
                args,
                &conf.to_string(),
            );
            if !out.success {
                return Err(out);
            }
        }
        Ok(())
    }
}

/// A pod: a namespace wired through `calix` ADD on a node. DEL runs on drop if not done.
pub struct Pod<'a> {
    pub ns: Netns,
    pub node: &'a Node,
    pub container_id: String,
    pub cni_args: String,
    /// Extra network-config keys this pod was added with (used again for DEL).
    pub extra: Value,
    pub result: CniOutput,
    deleted: bool,
}

impl<'a> Pod<'a> {
    /// ADDs a pod named `name` in k8s namespace `default`; panics if ADD fails.
    pub fn add(node: &'a Node, name: &str) -> Self {
        Self::add_with(node, name, Value::Null)
    }

    /// ADDs with extra network-config keys; panics if ADD fails.
    pub fn add_with(node: &'a Node, name: &str, extra: Value) -> Self {
        let pod = Self::try_add(node, name, extra);
        assert!(
            pod.result.success,
            "ADD of {name} failed: {}\n{}\nagent log:\n{}",
            pod.result.stdout,
            pod.result.stderr,
            node.agent_log()
        );
        pod
    }

    /// ADDs with extra network-config keys; the result may be a failure.
    pub fn try_add(node: &'a Node, name: &str, extra: Value) -> Self {
        let ns = Netns::new("p");
        let container_id = format!("{}{}", ns.name, "0123456789abcdef");
        let cni_args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}-{}",
            ns.name
        );
        let result = node.cni(
            "ADD",
            &container_id,
            &ns.path(),
            &cni_args,
            &node.conf(extra.clone()),
        );
        let deleted = !result.success;
        Self {
            ns,
            node,
            container_id,
            cni_args,
            extra,
            result,
            deleted,
        }
    }

    pub fn ip(&self) -> String {
        self.result.ip()
    }

    /// Every address of the ADD result, without prefix.
    pub fn ips(&self) -> Vec<String> {
        self.result
            .json
            .as_ref()
            .and_then(|j| j["ips"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|i| i["address"].as_str())
            .map(|a| a.split('/').next().unwrap_or(a).to_string())
            .collect()
    }

    pub fn host_ifname(&self) -> String {
        self.result
            .json
            .as_ref()
            .and_then(|j| j["interfaces"][0]["name"].as_str().map(String::from))
            .expect("host ifname")
    }

    /// Runs a verb for this pod with its config (plus `more` keys, e.g. prevResult).
    pub fn call(&self, command: &str, more: Value) -> CniOutput {
        let mut conf = self.node.conf(self.extra.clone());
        if let (Some(c), Some(m)) = (conf.as_object_mut(), more.as_object()) {
            for (k, v) in m {
                c.insert(k.clone(), v.clone());
            }
        }
        self.node.cni(
            command,
            &self.container_id,
            &self.ns.path(),
            &self.cni_args,
            &conf,
        )
    }

    /// CHECK with the ADD result as prevResult.
    pub fn check(&self) -> CniOutput {
        let prev = self.result.json.clone().unwrap_or(Value::Null);
        self.call("CHECK", serde_json::json!({ "prevResult": prev }))
    }

    /// DELs the pod; panics if DEL fails.
    pub fn del(&mut self) {
        let out = self.call("DEL", Value::Null);
        assert!(out.success, "DEL failed: {} {}", out.stdout, out.stderr);
        self.deleted = true;
    }
}

impl Drop for Pod<'_> {
    fn drop(&mut self) {
        if !self.deleted {
            let _ = self.call("DEL", Value::Null);
        }
    }
}

/// A child process killed and reaped on drop (a server a test started).
pub struct Guarded(pub Child);

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Node {
    /// Wires the node's uplink: veth `uplink` in the node namespace, addressed `node_cidr` and
    /// up, whose peer is `eth0` (up, unaddressed: the test gives it its addresses) in
    /// `outside`.
    pub fn uplink_to(&self, outside: &Netns, uplink: &str, node_cidr: &str) {
        let n = |argv: &[&str]| self.ns.exec_ok(argv);
        n(&[
            "ip",
            "link",
            "add",
            uplink,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &outside.name,
        ]);
        n(&["ip", "addr", "add", node_cidr, "dev", uplink]);
        n(&["ip", "link", "set", uplink, "up"]);
        outside.exec_ok(&["ip", "link", "set", "eth0", "up"]);
    }
}

/// The ids of the BPF maps named `name` that process `pid` holds: its `bpf-map` fds'
/// `map_id` from /proc/<pid>/fdinfo, matched by name through bpftool.
pub fn bpf_maps_of(pid: u32, name: &str) -> Vec<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut ids: Vec<u64> = fds
        .filter_map(Result::ok)
        .filter(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|t| t.to_string_lossy() == "anon_inode:bpf-map")
        })
        .filter_map(|fd| {
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .ok()?;
            info.lines()
                .find_map(|l| l.strip_prefix("map_id:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .filter(|id: &u64| {
            let out =
                run(Command::new("bpftool").args(["-j", "map", "show", "id", &id.to_string()]));
            serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|m| m["name"] == name)
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The keys (u32, little-endian) of a BPF hash map, via bpftool.
pub fn bpf_map_u32_keys(id: u64) -> Vec<u32> {
    let out = run_ok(Command::new("bpftool").args(["-j", "map", "dump", "id", &id.to_string()]));
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool dump json");
    v.as_array()
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| {
                    let key = e["key"].as_array()?;
                    let bytes: Vec<u8> = key
                        .iter()
                        .filter_map(|b| {
                            b.as_str().and_then(|s| {
                                u8::from_str_radix(s.trim_start_matches("0x"), 16).ok()
                            })
                        })
                        .collect();
                    let arr: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
                    Some(u32::from_le_bytes(arr))
                })
                .collect()
        })
        .unwrap_or_default()
}
/// Held by the one [`RootAgent`] a test process may run at a time.
static ROOT_AGENT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
    child: Option<Child>,
    saved_sysctls: Vec<(&'static str, String)>,
    _lock: std::sync::MutexGuard<'static, ()>,
}

/// The forwarding sysctls the agent writes.
const FORWARDING_SYSCTLS: [&str; 2] = [
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/net/ipv6/conf/all/forwarding",
];

impl RootAgent {
    /// Starts an eBPF-dataplane agent on `pool` (e.g. `10.251.10.0/24`) and waits until its
    /// socket answers. Blocks while another `RootAgent` of this process runs.
    pub fn start(tag: &str, pool: &str) -> Self {
        require_root();
        let lock = ROOT_AGENT_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let saved_sysctls = FORWARDING_SYSCTLS
            .iter()
            .filter_map(|p| {
                std::fs::read_to_string(p)
                    .ok()
                    .map(|v| (*p, v.trim().to_string()))
            })
            .collect();
        let name = unique(tag);
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("root agent dir");
        // Built before the agent starts, so that drop restores the sysctls even if start fails.
        let mut agent = Self {
            socket: dir.join("agent.sock"),
            node_name: format!("cxt-rt-{}-{tag}", std::process::id()),
            pool: pool.to_string(),
            dir,
            child: None,
            saved_sysctls,
            _lock: lock,
        };
        let log = std::fs::File::create(agent.dir.join("agent.log")).expect("agent log");
        let child = Command::new(bin("calix-agent"))
            .arg("--node-name")
            .arg(&agent.node_name)
            .arg("--socket")
            .arg(&agent.socket)
            .arg("--datastore-path")
            .arg(agent.dir.join("store.json"))
            .args(["--dataplane", "ebpf", "--log-level", "info", "--pool", pool])
            .arg("--bpf-pin-root")
            .arg(Path::new("/sys/fs/bpf").join(&agent.node_name))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn calix-agent");
        agent.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if agent.calixctl(&["endpoints"]).status.success() {
                return agent;
            }
            if let Some(Ok(Some(st))) = agent.child.as_mut().map(Child::try_wait) {
                panic!("calix-agent exited ({st}) at start:\n{}", agent.agent_log());
            }
            assert!(
                Instant::now() < deadline,
                "calix-agent did not come up:\n{}",
                agent.agent_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// Runs `calixctl --socket <this agent's socket> <args>`.
    pub fn calixctl(&self, args: &[&str]) -> Output {
        run(Command::new(bin("calixctl"))
            .arg("--socket")
            .arg(&self.socket)
            .args(args))
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
        let out = run_ok(Command::new("ip").args(["-j", "link", "show"]));
        let v: Value = serde_json::from_slice(&out.stdout).expect("ip -j link");
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|l| l["ifname"].as_str())
                    .filter(|n| n.starts_with("cali"))
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Root-namespace routes (main table) to addresses inside this agent's pool.
    pub fn pool_routes(&self) -> Vec<Value> {
        let out = run_ok(Command::new("ip").args(["-j", "route", "show", "root", &self.pool]));
        serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
    }
}

impl Drop for RootAgent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                if Instant::now() >= deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        for (path, value) in &self.saved_sysctls {
            let _ = std::fs::write(path, value);
        }
        let _ = std::fs::remove_dir_all(Path::new("/sys/fs/bpf").join(&self.node_name));
        if std::thread::panicking() {
            eprintln!(
                "--- agent log of {} ---\n{}",
                self.node_name,
                self.agent_log()
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A real etcd server in a network namespace of its own, reachable from node namespaces over
/// veth pairs (10.98.<i>.1 ↔ 10.98.<i>.2/30). Killed (and its namespace removed) on drop.
pub struct EtcdNs {
    pub ns: Netns,
    dir: PathBuf,
    child: std::sync::Mutex<Option<Child>>,
    links: AtomicU32,
}

impl EtcdNs {
    pub fn start() -> Self {
        require_root();
        let ns = Netns::new("e");
        let dir = std::env::temp_dir().join(&ns.name);
        std::fs::create_dir_all(&dir).expect("etcd dir");
        let etcd = Self {
            ns,
            dir,
            child: std::sync::Mutex::new(None),
            links: AtomicU32::new(0),
        };
        etcd.spawn();
        etcd
    }

    /// (Re)starts etcd on its data directory and waits until it answers.
    pub fn spawn(&self) {
        let data = self.dir.join("data");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("etcd log");
        let child = self
            .ns
            .cmd(&[
                "etcd",
                "--name",
                "default",
                "--data-dir",
                &data.display().to_string(),
                "--listen-client-urls",
                "http://0.0.0.0:2379",
                "--advertise-client-urls",
                "http://127.0.0.1:2379",
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "default=http://127.0.0.1:2380",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd (apt-get install etcd-server; cargo xtask setup does)");
        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self
            .ns
            .exec(&["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/2379"])
            .status
            .success()
        {
            assert!(
                Instant::now() < deadline,
                "etcd did not come up:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills etcd (SIGKILL).
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// Connects `node` to etcd; returns the client URL the node uses.
    pub fn wire(&self, node: &Netns) -> String {
        let i = self.links.fetch_add(1, Ordering::Relaxed) + 1;
        let host = format!("e{i}");
        run_ok(Command::new("ip").args([
            "-n",
            &self.ns.name,
            "link",
            "add",
            &host,
            "type",
            "veth",
            "peer",
            "name",
            "etcd0",
            "netns",
            &node.name,
        ]));
        self.ns.exec_ok(&[
            "ip",
            "addr",
            "add",
            &format!("10.98.{i}.1/30"),
            "dev",
            &host,
        ]);
        self.ns.exec_ok(&["ip", "link", "set", &host, "up"]);
        node.exec_ok(&[
            "ip",
            "addr",
            "add",
            &format!("10.98.{i}.2/30"),
            "dev",
            "etcd0",
        ]);
        node.exec_ok(&["ip", "link", "set", "etcd0", "up"]);
        format!("http://10.98.{i}.1:2379")
    }
}

impl Drop for EtcdNs {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
