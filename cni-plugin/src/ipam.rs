//! Where addresses come from: the agent (`ipam.type: calix-ipam`, the default) or any CNI IPAM
//! plugin, delegated the standard way — exec'd from CNI_PATH with our environment and the same
//! network configuration on stdin. Both behind traits ([`Agent`], [`Delegate`]), so the verbs
//! are unit-tested against fakes.
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use calix_proto::v1 as pb;
use ipnet::IpNet;
use serde_json::Value;

use crate::args::CniEnv;
use crate::client::{allocation_error, call_error, Agent};
use crate::config::NetConf;
use crate::error::{code, CniError};

/// Addresses an ADD got, and whether they were already held before it (so rollback keeps them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assigned {
    pub addresses: Vec<IpAddr>,
    pub already: bool,
    /// The MTU the agent wants for this pod when the network config sets none (a VXLAN
    /// tunnel may carry it); `None` from a delegated IPAM plugin or when the agent has no
    /// opinion.
    pub mtu: Option<u32>,
}

/// A delegated CNI IPAM plugin. [`ExecPlugin`] is the real one.
pub trait Delegate {
    /// Calls IPAM plugin `plugin` with `command` and the network configuration `stdin`:
    /// its parsed stdout, or its error.
    fn call(
        &mut self,
        env: &CniEnv,
        plugin: &str,
        command: &str,
        stdin: &[u8],
    ) -> Result<Option<Value>, CniError>;
}

/// The real [`Delegate`]: [`exec_plugin`].
pub struct ExecPlugin;

impl Delegate for ExecPlugin {
    fn call(
        &mut self,
        env: &CniEnv,
        plugin: &str,
        command: &str,
        stdin: &[u8],
    ) -> Result<Option<Value>, CniError> {
        exec_plugin(env, plugin, command, stdin)
    }
}

/// Finds `plugin` in CNI_PATH.
pub fn find_plugin(env: &CniEnv, plugin: &str) -> Result<PathBuf, CniError> {
    env.path
        .iter()
        .map(|d| PathBuf::from(d).join(plugin))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            CniError::new(
                code::INVALID_CONFIG,
                format!("IPAM plugin {plugin:?} not found in CNI_PATH"),
                format!("searched: {}", env.path.join(":")),
            )
        })
}

/// Execs a delegated plugin with `command`, returning its parsed stdout (or its error).
pub fn exec_plugin(
    env: &CniEnv,
    plugin: &str,
    command: &str,
    stdin: &[u8],
) -> Result<Option<Value>, CniError> {
    let path = find_plugin(env, plugin)?;
    let mut child = Command::new(&path)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", &env.container_id)
        .env("CNI_NETNS", &env.netns)
        .env("CNI_IFNAME", &env.ifname)
        .env("CNI_PATH", env.path.join(":"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            CniError::new(
                code::IO_FAILURE,
                format!("cannot exec IPAM plugin {}: {e}", path.display()),
                "",
            )
        })?;
    if let Some(mut si) = child.stdin.take() {
        // A plugin that exits without reading stdin is not our failure to report here.
        let _ = si.write_all(stdin);
    }
    let out = child.wait_with_output().map_err(|e| {
        CniError::new(
            code::IO_FAILURE,
            format!("IPAM plugin {plugin} failed: {e}"),
            "",
        )
    })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let parsed: Option<Value> = serde_json::from_str(stdout.trim()).ok();
    if !out.status.success() {
        // Pass the delegate's own CNI error on, as the spec expects.
        if let Some(v) = &parsed {
            if let (Some(c), Some(msg)) = (v["code"].as_u64(), v["msg"].as_str()) {
                return Err(CniError::new(
                    u32::try_from(c).unwrap_or(code::IO_FAILURE),
                    format!("IPAM plugin {plugin}: {msg}"),
                    v["details"].as_str().unwrap_or_default(),
                ));
            }
        }
        return Err(CniError::new(
            code::IO_FAILURE,
            format!("IPAM plugin {plugin} {command} failed ({})", out.status),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(parsed)
}

fn addresses_of(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .map(|ips| {
            ips.iter()
                .filter_map(|ip| ip["address"].as_str())
                .filter_map(|a| a.parse::<IpNet>().ok().map(|n| n.addr()))
                .collect()
        })
        .unwrap_or_default()
}

/// ADD: gets the pod's addresses.
pub async fn add(
    env: &CniEnv,
    conf: &NetConf,
    raw: &[u8],
    agent: &mut impl Agent,
    delegate: &mut impl Delegate,
) -> Result<Assigned, CniError> {
    let (v4, v6) = conf.ipam.families()?;
    if !conf.agent_ipam() {
        let res = delegate
            .call(env, &conf.ipam.ipam_type, "ADD", raw)?
            .unwrap_or(Value::Null);
        let addresses = addresses_of(&res);
        if addresses.is_empty() {
            return Err(CniError::new(
                code::IO_FAILURE,
                format!("IPAM plugin {} returned no addresses", conf.ipam.ipam_type),
                res.to_string(),
            ));
        }
        return Ok(Assigned {
            addresses,
            already: false,
            mtu: None,
        });
    }
    let rc = conf.runtime()?;
    let mut attributes = std::collections::HashMap::new();
    attributes.insert(
        calix_proto::handle::CONTAINER_ID_ATTRIBUTE.to_string(),
        env.container_id.clone(),
    );
    if let Some(ns) = &env.args.pod_namespace {
        attributes.insert("namespace".to_string(), ns.clone());
    }
    if let Some(p) = &env.args.pod_name {
        attributes.insert("pod".to_string(), p.clone());
    }
    if let Some(n) = &conf.nodename {
        attributes.insert("node".to_string(), n.clone());
    }
    let resp = agent
        .allocate(pb::AllocateRequest {
            handle: conf.handle(&env.container_id),
            ifname: env.ifname.clone(),
            ipv4: v4,
            ipv6: v6,
            attributes,
            requested: rc.ips.iter().map(ToString::to_string).collect(),
        })
        .await
        .map_err(allocation_error)?;
    let mut addresses = Vec::new();
    for a in &resp.addresses {
        let net: IpNet = a.address.parse().map_err(|_| {
            CniError::new(
                code::AGENT_REFUSED,
                format!("agent returned a bad address {:?}", a.address),
                "",
            )
        })?;
        addresses.push(net.addr());
    }
    Ok(Assigned {
        addresses,
        already: resp.already_allocated,
        // The same bounds as the conflist's `mtu`; anything else is ignored.
        mtu: Some(resp.mtu).filter(|m| (68..=65535).contains(m)),
    })
}

/// DEL (and ADD rollback): releases the pod's addresses. Idempotent.
pub async fn del(
    env: &CniEnv,
    conf: &NetConf,
    raw: &[u8],
    agent: &mut impl Agent,
    delegate: &mut impl Delegate,
) -> Result<(), CniError> {
    if !conf.agent_ipam() {
        return delegate
            .call(env, &conf.ipam.ipam_type, "DEL", raw)
            .map(|_| ());
    }
    agent
        .release(pb::ReleaseRequest {
            handle: conf.handle(&env.container_id),
            ifname: env.ifname.clone(),
        })
        .await
        .map_err(|s| call_error("releasing the addresses", s))?;
    Ok(())
}

/// CHECK: the IPAM still holds exactly `expected` for this attachment.
pub async fn check(
    env: &CniEnv,
    conf: &NetConf,
    raw: &[u8],
    agent: &mut impl Agent,
    delegate: &mut impl Delegate,
    expected: &[IpAddr],
) -> Result<(), CniError> {
    if !conf.agent_ipam() {
        return delegate
            .call(env, &conf.ipam.ipam_type, "CHECK", raw)
            .map(|_| ());
    }
    let held = agent
        .lookup(pb::LookupRequest {
            handle: conf.handle(&env.container_id),
            ifname: env.ifname.clone(),
        })
        .await
        .map_err(|s| call_error("looking up the addresses", s))?;
    let mut held: Vec<IpAddr> = held
        .addresses
        .iter()
        .filter_map(|a| a.address.parse::<IpNet>().ok().map(|n| n.addr()))
        .collect();
    let mut want = expected.to_vec();
    held.sort();
    want.sort();
    if held != want {
        return Err(CniError::new(
            code::WIRING_FAILED,
            format!(
                "IPAM holds {:?} for {}/{}, the pod has {:?}",
                held, env.container_id, env.ifname, want
            ),
            "the pod's addresses are not (or no longer) allocated to it: recreate the pod",
        ));
    }
    Ok(())
}
