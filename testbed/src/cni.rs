//! CNI calls the way a runtime makes them: the plugin exec'd in the node's network namespace
//! (fork, `setns`, exec) with a clean CNI environment and the network config on stdin; a
//! timed calls for the benches. A minimal libcni for conflists is in `conflist.rs`.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::Instant;

use serde_json::Value;

use crate::netns::Netns;
use crate::process::command_in;
use crate::{bin, Error, Result};

/// Where Debian's containernetworking-plugins live (also CNI_PATH).
pub const CNI_DIR: &str = "/usr/lib/cni";
/// PATH of every exec'd plugin.
const PATH_ENV: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// One CNI call's environment.
pub struct Call<'a> {
    pub command: &'a str,
    pub container_id: String,
    /// CNI_NETNS.
    pub netns: String,
    /// CNI_ARGS.
    pub args: String,
    pub ifname: &'a str,
}

impl<'a> Call<'a> {
    /// A call on `eth0`.
    pub fn new(command: &'a str, container_id: String, netns: String, args: String) -> Self {
        Self {
            command,
            container_id,
            netns,
            args,
            ifname: "eth0",
        }
    }
}

/// Starts `binary` for `call` in network namespace `node` (the caller's without one).
fn spawn(binary: &Path, node: Option<&Path>, call: &Call) -> Result<Child> {
    command_in(node, binary, None, false)?
        .env_clear()
        .env("PATH", PATH_ENV)
        .env("CNI_COMMAND", call.command)
        .env("CNI_CONTAINERID", &call.container_id)
        .env("CNI_NETNS", &call.netns)
        .env("CNI_IFNAME", call.ifname)
        .env("CNI_ARGS", &call.args)
        .env("CNI_PATH", CNI_DIR)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            cmd: binary.display().to_string(),
            source,
        })
}

/// Writes `conf` to the plugin's stdin and waits for it.
fn finish(mut child: Child, conf: &str) -> Result<Output> {
    if let Some(mut si) = child.stdin.take() {
        // A plugin that exits without reading its config is judged by its exit status.
        let _ = si.write_all(conf.as_bytes());
    }
    child
        .wait_with_output()
        .map_err(Error::io("wait for a CNI plugin"))
}

/// The outcome of one CNI call.
#[derive(Debug, Default)]
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
    let call = Call {
        command,
        container_id: container_id.to_string(),
        netns: netns.to_string(),
        args: cni_args.to_string(),
        ifname,
    };
    let out = spawn(plugin, Some(node_ns.path().as_ref()), &call)
        .and_then(|child| finish(child, stdin))
        .unwrap_or_else(|e| panic!("{e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    CniOutput {
        success: out.status.success(),
        json: serde_json::from_str(&stdout).ok(),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).to_string(),
    }
}

/// One CNI plugin under measurement, exec'd the way a runtime does, in network namespace
/// `node` or, without one, in the caller's.
pub struct Plugin {
    pub label: String,
    pub binary: PathBuf,
    /// The node's namespace path.
    pub node: Option<PathBuf>,
    /// The network config, written to the plugin's stdin.
    pub conf: String,
}

impl Plugin {
    /// `binary` with network config `conf`, exec'd in `node`'s namespace.
    pub fn new(label: &str, binary: PathBuf, node: Option<&Netns>, conf: &Value) -> Self {
        Self {
            label: label.to_string(),
            binary,
            node: node.map(|n| n.path().into()),
            conf: conf.to_string(),
        }
    }

    fn spawn(&self, call: &Call) -> Result<Child> {
        spawn(&self.binary, self.node.as_deref(), call)
    }

    /// Writes the config to the child's stdin and waits for it; fails unless it succeeded.
    fn finish(&self, call: &Call, child: Child) -> Result<Output> {
        let out = finish(child, &self.conf)?;
        if !out.status.success() {
            return Err(Error::Cni {
                call: format!("{} {} of {}", self.label, call.command, call.container_id),
                status: out.status,
                stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(out)
    }

    /// One call, timed fork-to-exit (ms).
    pub fn timed(&self, call: &Call) -> Result<f64> {
        let t0 = Instant::now();
        let child = self.spawn(call)?;
        let out = self.finish(call, child)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.result(call, &out)?;
        Ok(ms)
    }

    /// One call, untimed: its result (an ADD's, checked to hold an address; Null otherwise).
    pub fn call(&self, call: &Call) -> Result<Value> {
        let child = self.spawn(call)?;
        let out = self.finish(call, child)?;
        self.result(call, &out)
    }

    fn result(&self, call: &Call, out: &Output) -> Result<Value> {
        if call.command != "ADD" {
            return Ok(Value::Null);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(&text).map_err(|_| Error::NotJson {
            what: format!("{} ADD", self.label),
            text: text.to_string(),
        })?;
        if v["ips"][0]["address"].as_str().is_none() {
            return Err(Error::Missing {
                field: "ips[0].address".into(),
                value: v.to_string(),
            });
        }
        Ok(v)
    }

    /// ADDs pod `name` (Kubernetes namespace `bench`) in `pod_ns`: its IPv4 address.
    pub fn add_pod(&self, pod_ns: &Netns, name: &str) -> Result<std::net::Ipv4Addr> {
        let id = format!("{}0123456789abcdef", pod_ns.name.replace('-', ""));
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={name};\
             K8S_POD_INFRA_CONTAINER_ID={id}"
        );
        let v = self.call(&Call::new("ADD", id, pod_ns.path(), args))?;
        let a = v["ips"][0]["address"].as_str().unwrap_or_default();
        a.split('/')
            .next()
            .and_then(|ip| ip.parse().ok())
            .ok_or_else(|| Error::Missing {
                field: "an IPv4 address".into(),
                value: v.to_string(),
            })
    }

    /// `calls` all at once: wall time (ms) from the first fork to the last exit.
    pub fn concurrent(&self, calls: &[Call]) -> Result<f64> {
        let t0 = Instant::now();
        let mut children = Vec::with_capacity(calls.len());
        for c in calls {
            children.push(self.spawn(c)?);
        }
        let mut first_err = None;
        for (c, child) in calls.iter().zip(children) {
            if let Err(e) = self.finish(c, child) {
                first_err.get_or_insert(e);
            }
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        first_err.map_or(Ok(ms), Err)
    }
}
