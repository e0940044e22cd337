//! A node: a network namespace with the node's address on lo and a calix-agent inside it.
use std::path::PathBuf;
use std::process::Output;

use serde_json::Value;

use crate::agent::{allocated_from, endpoints_json, Agent, AgentSpec, Dataplane};
use crate::cni::{cni_call, CniOutput};
use crate::netns::Netns;
use crate::{unique, Result};

/// The address every node has on its loopback.
pub const NODE_IP: &str = "10.99.0.1";

/// A node. Its namespace, node name, directory (`$TMPDIR/<name>`) and pin root
/// (`/sys/fs/bpf/<name>`) share one name; all of it goes on drop, the agent stopped first.
pub struct Node {
    // Declared first: the agent stops before its namespace goes.
    agent: Agent,
    pub ns: Netns,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub node_ip: String,
    pub dataplane: Dataplane,
}

impl Node {
    /// Starts a test node with the default pool.
    pub fn start(dataplane: Dataplane) -> Self {
        Self::start_with_config(dataplane, None)
    }

    /// Starts a test node whose agent reads `config` (TOML) instead of `--pool`.
    pub fn start_with_config(dataplane: Dataplane, config: Option<&str>) -> Self {
        let node = Self::create(dataplane, config);
        node.start_agent();
        node
    }

    /// A test node (named [`unique`]`("n")`, the agent built next to the test), not yet
    /// started.
    pub fn create(dataplane: Dataplane, config: Option<&str>) -> Self {
        crate::require_root();
        let spec = AgentSpec {
            config: config.map(String::from),
            ..AgentSpec::new(crate::bin_dir(), dataplane)
        };
        Self::new(unique("n"), spec).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A node named `name`, its agent as `spec` says, not yet started.
    pub fn new(name: String, spec: AgentSpec) -> Result<Self> {
        let ns = Netns::create(name)?;
        ns.ip(&format!("addr add {NODE_IP}/32 dev lo"))?;
        Self::in_ns(ns, spec, NODE_IP)
    }

    /// A node in `ns` (its addresses are the caller's; `node_ip` is the one tests reach it
    /// at), its agent as `spec` says, not yet started.
    pub fn in_ns(ns: Netns, spec: AgentSpec, node_ip: &str) -> Result<Self> {
        let dataplane = spec.dataplane;
        let agent = Agent::new(
            &ns.name,
            std::env::temp_dir().join(&ns.name),
            Some(&ns),
            spec,
        )?;
        Ok(Self {
            dir: agent.dir.clone(),
            socket: agent.socket.clone(),
            agent,
            ns,
            node_ip: node_ip.into(),
            dataplane,
        })
    }

    /// A node named `name` whose agent runs as `spec` says and answers.
    pub fn launch(name: String, spec: AgentSpec) -> Result<Self> {
        let node = Self::new(name, spec)?;
        node.agent.start(&[])?;
        Ok(node)
    }

    /// The same node with its agent reading `config` (TOML).
    pub fn with_config(mut self, config: &str) -> Self {
        self.agent.spec.config = Some(config.to_string());
        self
    }

    /// The same node with its embedded datastore at `path` (e.g. on a small [`crate::Tmpfs`]).
    pub fn with_store_path(mut self, path: PathBuf) -> Self {
        self.agent.spec.store_path = Some(path);
        self
    }

    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The agent, to change its spec before (re)starting it.
    pub fn agent_mut(&mut self) -> &mut Agent {
        &mut self.agent
    }

    /// (Re)starts the agent and waits until its socket answers.
    pub fn start_agent(&self) {
        self.start_agent_with(&[]);
    }

    /// (Re)starts the agent with `extra` arguments and waits until its socket answers.
    pub fn start_agent_with(&self, extra: &[&str]) {
        self.agent.start(extra).unwrap_or_else(|e| panic!("{e}"));
    }

    /// The agent's command line (the binary, its flags, then `extra`).
    pub fn agent_args(&self, extra: &[&str]) -> Vec<String> {
        self.agent.args(extra).unwrap_or_else(|e| panic!("{e}"))
    }

    /// (Re)starts the agent with `extra` arguments without waiting for it.
    pub fn spawn_agent(&self, extra: &[&str]) {
        self.agent.spawn(extra).unwrap_or_else(|e| panic!("{e}"));
    }

    /// `GET <path>` from the agent's HTTP door (127.0.0.1:9091 in the node): the status code
    /// and the body; `None` when the connection fails or closes without an answer.
    pub fn http_get(&self, path: &str) -> Option<(u16, String)> {
        let script = format!(
            "exec 3<>/dev/tcp/127.0.0.1/9091 && printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' >&3 && timeout 10 cat <&3"
        );
        let out = self.ns.exec(&["bash", "-c", &script]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let code = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
        Some((code, body))
    }

    /// This node's bpffs pin root (unique per node, removed on drop).
    pub fn pin_root(&self) -> PathBuf {
        self.agent.pin_root()
    }

    /// Kills the agent with SIGKILL (a crash) and reaps it.
    pub fn kill_agent(&self) {
        self.agent.kill();
    }

    /// Stops the agent with SIGTERM and waits for it.
    pub fn stop_agent(&self) {
        self.agent.stop();
    }

    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.pid()
    }

    pub fn agent_log(&self) -> String {
        self.agent.log()
    }

    /// A calix network config (JSON) pointing at this node's agent, `extra`'s keys added or
    /// replacing the defaults.
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
        let conf = conf.to_string();
        cni_call(
            &self.ns,
            command,
            container_id,
            netns,
            "eth0",
            cni_args,
            &conf,
        )
    }

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

    /// `cali*` links in the node namespace.
    pub fn cali_links(&self) -> Vec<String> {
        self.ns
            .links()
            .into_iter()
            .filter(|l| l.starts_with("cali"))
            .collect()
    }

    /// Links in the node namespace that stand in for pods' host veths, one veth pair for each
    /// of `owners` (`cali9<i>` / `cxk<i>p`), each carrying that owner alias as the plugin's veth
    /// does (`calix_kernel::pod::owner_alias(containerID, ifname)`: the agent programs only a
    /// `cali…` link carrying its endpoint's alias), for tests that register endpoints without
    /// the plugin. Returns the names; they go with the namespace.
    pub fn stand_in_links(&self, owners: &[String]) -> Vec<String> {
        let names: Vec<String> = (0..owners.len()).map(|i| format!("cali9{i:010}")).collect();
        let script: String = names
            .iter()
            .zip(owners)
            .enumerate()
            .map(|(i, (l, alias))| {
                format!("link add {l} type veth peer name cxk{i}p\nlink set {l} alias {alias}\n")
            })
            .collect();
        self.ns.ip_batch(&script).unwrap_or_else(|e| panic!("{e}"));
        names
    }

    /// `calixctl bpf counters -o json`: every drop counter.
    pub fn drops(&self) -> Value {
        self.agent
            .calixctl_json(&["bpf", "counters"])
            .unwrap_or_else(|e| panic!("calixctl bpf counters: {e}"))
    }

    /// Packets dropped on `iface` for `reason` (0 when never).
    pub fn dropped(&self, iface: &str, reason: &str) -> u64 {
        self.agent
            .dropped(iface, reason)
            .unwrap_or_else(|e| panic!("calixctl bpf counters: {e}"))
    }

    /// Where this node's agent pinned its program `name` (`<pin root>/<node>/v<layout>/progs/`,
    /// the newest layout directory that has it); `None` before the agent loaded it.
    pub fn prog_pin(&self, name: &str) -> Option<PathBuf> {
        let node_dir = self.pin_root().join(&self.agent.name);
        let mut pins: Vec<(u32, PathBuf)> = std::fs::read_dir(&node_dir)
            .ok()?
            .flatten()
            .filter_map(|e| {
                let v = e.file_name().to_str()?.strip_prefix('v')?.parse().ok()?;
                let pin = e.path().join("progs").join(name);
                pin.exists().then_some((v, pin))
            })
            .collect();
        pins.sort();
        pins.pop().map(|(_, p)| p)
    }

    /// The id of the BPF program calix runs on `iface` in direction `dir` (`ingress` or
    /// `egress`): the first tcx program there, else the program of a tc filter; `None` when
    /// there is neither.
    pub fn filter_prog(&self, iface: &str, dir: &str) -> Option<String> {
        let (i, d) = (iface.to_string(), dir.to_string());
        let tcx = self.ns.run(move || crate::bpf::tcx_attachments(&i, &d));
        if let Some((prog, _)) = tcx.ok().and_then(|a| a.first().copied()) {
            return Some(prog.to_string());
        }
        let out = self.ns.exec(&["tc", "filter", "show", "dev", iface, dir]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split_whitespace()
            .skip_while(|w| *w != "id")
            .nth(1)
            .map(String::from)
    }

    /// The id of the program on `iface`'s tcx hook in direction `dir` (calix's once the agent
    /// moved it there from its first cls_bpf filter); `None` without one.
    pub fn tcx_prog(&self, iface: &str, dir: &str) -> Option<String> {
        let (i, d) = (iface.to_string(), dir.to_string());
        let tcx = self.ns.run(move || crate::bpf::tcx_attachments(&i, &d));
        tcx.ok()
            .and_then(|a| a.first().copied())
            .map(|(prog, _)| prog.to_string())
    }

    /// Takes calix's program off `iface` in direction `dir` the way an operator could: detaches
    /// its tcx link (`bpftool link detach`), or deletes its tc filter.
    pub fn detach_prog(&self, iface: &str, dir: &str) {
        let (i, d) = (iface.to_string(), dir.to_string());
        let tcx = self.ns.run(move || crate::bpf::tcx_attachments(&i, &d));
        match tcx.ok().and_then(|a| a.first().copied()) {
            Some((_, link)) => {
                let out = std::process::Command::new("bpftool")
                    .args(["link", "detach", "id", &link.to_string()])
                    .output()
                    .expect("bpftool");
                assert!(
                    out.status.success(),
                    "bpftool link detach id {link}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            None => {
                self.ns.exec_ok(&["tc", "filter", "del", "dev", iface, dir]);
            }
        }
    }

    /// Wires the node's uplink ([`crate::uplink`]): veth `uplink`, addressed `node_cidr`,
    /// whose peer is `eth0` in `outside`.
    pub fn uplink_to(&self, outside: &Netns, uplink: &str, node_cidr: &str) {
        crate::uplink(&self.ns, outside, uplink, node_cidr).unwrap_or_else(|e| panic!("{e}"));
    }
}
