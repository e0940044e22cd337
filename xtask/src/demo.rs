//! `cargo xtask demo`: one node, two pods, on the embedded datastore, through the real `calix`
//! CNI binary and a real conflist. Prints what it does; removes everything it made.
//! `cargo xtask demo --nodes 3`: a cluster on one machine ([`cluster`]).
//!
//! Everything a demo creates is named `calix-demo-<pid>…`; Ctrl-C or SIGTERM stops it at the
//! next step and it removes what it made on the way out; what a demo killed outright left is
//! removed when the next one starts.
mod cluster;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::util::{self, output, run};
use crate::{interrupt, leftovers};

/// The dataplane the demo's agents run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// eBPF programs on every pod's veth (and the uplinks): the default.
    Ebpf,
    /// Plain kernel routing (routes, proxy ARP, IP forwarding), no BPF.
    Kernel,
}

impl Mode {
    fn dataplane(self) -> calix_testbed::Dataplane {
        match self {
            Self::Ebpf => calix_testbed::Dataplane::Ebpf,
            Self::Kernel => calix_testbed::Dataplane::Kernel,
        }
    }

    fn as_str(self) -> &'static str {
        self.dataplane().as_str()
    }

    /// How the step lines name it.
    fn label(self) -> &'static str {
        match self {
            Self::Ebpf => "eBPF",
            Self::Kernel => "kernel",
        }
    }
}

/// Prefix of everything a demo creates: `calix-demo-<pid>…` namespaces, directories, pin roots.
const PREFIX: &str = "calix-demo";

/// `cargo xtask demo [--nodes N] [--mode M]`.
pub fn run_demo(nodes: usize, mode: Mode) -> Result<()> {
    match nodes {
        // Ctrl-C also kills the running step's children: name the interrupt, not their failure.
        1 => single_node(mode).or_else(|e| interrupt::check().and(Err(e))),
        3 => cluster::run(mode),
        n => bail!(
            "--nodes {n}: the demo runs 1 node (the default) or 3 (two on one subnet, one on \
             another)"
        ),
    }
}

const NODE_IP: &str = "10.99.0.1";
const POOL: &str = "10.244.0.0/16";

/// Everything the demo created, removed on drop (even on error or panic).
struct Demo {
    prefix: String,
    dir: PathBuf,
    namespaces: Vec<String>,
    agent: Option<Child>,
}

impl Demo {
    fn ns(&mut self, role: &str) -> Result<String> {
        let name = format!("{}-{role}", self.prefix);
        run(Command::new("ip").args(["netns", "add", &name]))?;
        self.namespaces.push(name.clone());
        run(Command::new("ip").args(["-n", &name, "link", "set", "lo", "up"]))?;
        Ok(name)
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            // SIGTERM first so the agent detaches and removes its socket.
            let _ = Command::new("kill")
                .args(["-TERM", &a.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && matches!(a.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = a.kill();
            let _ = a.wait();
        }
        for ns in self.namespaces.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        // The agent leaves its programs and pins in place on exit (restarts keep traffic
        // flowing); the demo's namespaces are gone, so its pins go too.
        let _ = std::fs::remove_dir_all(DEMO_PIN_ROOT);
    }
}

/// bpffs directory of the demo agent's pins.
const DEMO_PIN_ROOT: &str = "/sys/fs/bpf/calix-demo";

/// Prints step `n`'s line; fails if the demo was interrupted (Ctrl-C, SIGTERM) meanwhile.
fn step(n: u32, total: u32, what: &str) -> Result<()> {
    interrupt::check()?;
    println!("\n[{n}/{total}] {what}");
    Ok(())
}

/// Execs the calix plugin the way a runtime does: CNI_* env, the plugin's config on stdin.
fn cni(
    calix: &Path,
    node_ns: &str,
    command: &str,
    container_id: &str,
    netns: &str,
    cni_args: &str,
    conf: &Value,
) -> Result<Value> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", node_ns])
        .arg(calix)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_ARGS", cni_args)
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot exec calix")?;
    if let Some(mut si) = child.stdin.take() {
        si.write_all(conf.to_string().as_bytes())?;
    }
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        bail!("calix {command} failed: {stdout}");
    }
    if stdout.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&stdout).with_context(|| format!("calix printed non-JSON: {stdout}"))
}

/// The plugin config libcni would derive from a conflist: the list's name and cniVersion
/// injected into the first plugin's object.
fn plugin_conf(conflist: &Value) -> Result<Value> {
    let mut p = conflist["plugins"][0].clone();
    let obj = p.as_object_mut().context("conflist has no plugins")?;
    obj.insert("name".into(), conflist["name"].clone());
    obj.insert("cniVersion".into(), conflist["cniVersion"].clone());
    Ok(p)
}

fn ping(from_ns: &str, to: &str) -> Result<()> {
    let out = output(Command::new("ip").args([
        "netns", "exec", from_ns, "ping", "-c", "3", "-i", "0.2", "-W", "2", to,
    ]))?;
    let summary = out
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or("")
        .trim()
        .to_string();
    println!("      {summary}");
    Ok(())
}

fn single_node(mode: Mode) -> Result<()> {
    util::require_root("the demo")?;
    const TOTAL: u32 = 8;
    step(1, TOTAL, "Installing prerequisites (cargo xtask setup)")?;
    crate::setup::run()?;
    util::ensure_bpffs()?;
    step(
        2,
        TOTAL,
        "Building calix (CNI plugin), calix-agent and calixctl",
    )?;
    let bins = util::build_bins()?;
    interrupt::catch();
    leftovers::remove_stale(PREFIX)?;
    let (calix, agent_bin, ctl) = (
        bins.join("calix"),
        bins.join("calix-agent"),
        bins.join("calixctl"),
    );

    let prefix = format!("{PREFIX}-{}", std::process::id());
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    let mut demo = Demo {
        prefix,
        dir: dir.clone(),
        namespaces: Vec::new(),
        agent: None,
    };

    step(
        3,
        TOTAL,
        "Creating a node (a network namespace) and two pod namespaces",
    )?;
    let node = demo.ns("node")?;
    run(Command::new("ip").args([
        "-n",
        &node,
        "addr",
        "add",
        &format!("{NODE_IP}/32"),
        "dev",
        "lo",
    ]))?;
    let pod_a = demo.ns("pod-a")?;
    let pod_b = demo.ns("pod-b")?;
    println!("      node  {node}  (node address {NODE_IP})");
    println!("      pods  {pod_a}, {pod_b}");

    step(
        4,
        TOTAL,
        &format!(
            "Starting calix-agent in the node (embedded datastore, {} dataplane)",
            mode.label()
        ),
    )?;
    let socket = dir.join("agent.sock");
    let log = std::fs::File::create(dir.join("agent.log"))?;
    let agent = Command::new("ip")
        .args(["netns", "exec", &node])
        .arg(&agent_bin)
        .args([
            "--node-name",
            "demo-node",
            "--pool",
            POOL,
            "--dataplane",
            mode.as_str(),
        ])
        .arg("--socket")
        .arg(&socket)
        .arg("--datastore-path")
        .arg(dir.join("store.json"))
        .arg("--bpf-pin-root")
        .arg(DEMO_PIN_ROOT)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("cannot start calix-agent")?;
    demo.agent = Some(agent);
    let ctl_cmd = |args: &[&str]| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &node])
            .arg(&ctl)
            .arg("--socket")
            .arg(&socket)
            .args(args);
        c
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while output(&mut ctl_cmd(&["endpoints"])).is_err() {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
            bail!("calix-agent did not come up:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("      agent up, gRPC on {} (pool {POOL})", socket.display());

    step(
        5,
        TOTAL,
        "ADDing both pods through the calix CNI plugin (10-calix.conflist)",
    )?;
    let conflist = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "plugins": [{
            "type": "calix",
            "mtu": 1500,
            "ipam": { "type": "calix-ipam" },
            "agent_socket": socket.display().to_string(),
        }]
    });
    let conflist_path = dir.join("10-calix.conflist");
    std::fs::write(&conflist_path, serde_json::to_string_pretty(&conflist)?)?;
    println!("      conflist {}", conflist_path.display());
    let conf = plugin_conf(&conflist)?;
    let mut ips = Vec::new();
    for (ns, pod) in [(&pod_a, "pod-a"), (&pod_b, "pod-b")] {
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME={pod}");
        let res = cni(
            &calix,
            &node,
            "ADD",
            &format!("{ns}-c"),
            &format!("/run/netns/{ns}"),
            &args,
            &conf,
        )?;
        let ip = res["ips"][0]["address"].as_str().unwrap_or("?").to_string();
        let host_if = res["interfaces"][0]["name"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        println!("      {pod}: eth0 {ip}  (host side {host_if}, gateway 169.254.1.1)");
        ips.push(ip.split('/').next().unwrap_or_default().to_string());
    }

    step(6, TOTAL, "Pinging pod to pod and pod to node")?;
    println!("      pod-a -> pod-b ({})", ips[1]);
    ping(&pod_a, &ips[1])?;
    println!("      pod-b -> pod-a ({})", ips[0]);
    ping(&pod_b, &ips[0])?;
    println!("      pod-a -> node ({NODE_IP})");
    ping(&pod_a, NODE_IP)?;

    step(
        7,
        TOTAL,
        match mode {
            Mode::Ebpf => {
                "calixctl endpoints (counters come from the eBPF programs on each cali* veth)"
            }
            Mode::Kernel => "calixctl endpoints",
        },
    )?;
    let table = output(&mut ctl_cmd(&["endpoints"]))?;
    for l in table.lines() {
        println!("      {l}");
    }

    step(8, TOTAL, "DELeting both pods and removing everything")?;
    for (ns, pod) in [(&pod_a, "pod-a"), (&pod_b, "pod-b")] {
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME={pod}");
        cni(
            &calix,
            &node,
            "DEL",
            &format!("{ns}-c"),
            &format!("/run/netns/{ns}"),
            &args,
            &conf,
        )?;
        println!("      {pod} deleted");
    }
    let left = output(&mut ctl_cmd(&["endpoints", "-o", "json"]))?;
    let left: Value = serde_json::from_str(&left)?;
    let n = left["endpoints"].as_array().map_or(0, Vec::len);
    if n != 0 {
        bail!("{n} endpoint(s) left after DEL");
    }
    drop(demo);
    println!("\ndemo finished: 2 pods wired, pinged and removed; nothing left behind.");
    Ok(())
}
