//! DEL: idempotent and best-effort. A missing netns, link, endpoint or address is success;
//! the address is released even when the pod's namespace is already gone.
use std::net::IpAddr;

use calix_proto::v1 as pb;

use super::{wiring, Invocation};
use crate::args::{host_veth_name, PRIMARY_IFNAME};
use crate::client::{call_error, Agent, AgentClient};
use crate::error::CniError;
use crate::ipam::{self, Delegate, ExecPlugin};
use crate::kernel::{Kernel, NodeKernel};
use crate::result::AddResult;
use calix_kernel::{netns, pod};

pub async fn run(inv: &Invocation<'_>) -> Result<(), CniError> {
    let t0 = std::time::Instant::now();
    let mut agent = AgentClient::connect(&inv.conf.agent_socket()).await?;
    mark(t0, "connect");
    let host = netns::netlink_here()
        .await
        .map_err(|e| wiring("cannot open netlink in the host namespace".into(), &e))?;
    let mut kernel = NodeKernel::new(host, None);
    del(inv, &mut kernel, &mut agent, &mut ExecPlugin, t0).await
}

fn mark(t0: std::time::Instant, phase: &str) {
    tracing::debug!(
        phase,
        elapsed_us = t0.elapsed().as_micros() as u64,
        "DEL phase done"
    );
}

/// DEL once the agent and netlink are open: the veth, the endpoint and its addresses, a
/// secondary attachment's source rules, a delegated plugin's addresses.
pub async fn del(
    inv: &Invocation<'_>,
    kernel: &mut impl Kernel,
    agent: &mut impl Agent,
    delegate: &mut impl Delegate,
    t0: std::time::Instant,
) -> Result<(), CniError> {
    let env = inv.env;
    // The host side's name is derived from the same CNI_ARGS ADD saw; a prevResult names it too.
    let mut names = vec![host_veth_name(&env.args, &env.container_id, &env.ifname)];
    if let Some(prev) = &inv.conf.prev_result {
        if let Some(n) = prev["interfaces"]
            .as_array()
            .and_then(|ifs| ifs.iter().find(|i| i["sandbox"].is_null()))
            .and_then(|i| i["name"].as_str())
        {
            if n.starts_with("cali") && !names.iter().any(|x| x == n) {
                names.push(n.to_string());
            }
        }
    }
    let owner = pod::owner_alias(&env.container_id, &env.ifname);
    // Order matters for speed and safety: the veth goes first (the kernel drops its routes and
    // tc filters with it), so the agent only forgets the endpoint instead of detaching filters
    // under the RTNL lock; the address is released last, once no route points at the old veth.
    for name in &names {
        super::delete_owned_link(kernel, name, &owner)
            .await
            .map_err(|e| wiring(format!("cannot delete veth {name}"), &e))?;
    }
    mark(t0, "veth");
    // With calix-ipam the agent releases the addresses in the same call and datastore write.
    let release_handle = if inv.conf.agent_ipam() {
        inv.conf.handle(&env.container_id)
    } else {
        String::new()
    };
    let released = agent
        .unregister(pb::UnregisterRequest {
            container_id: env.container_id.clone(),
            ifname: env.ifname.clone(),
            release_handle,
        })
        .await
        .map_err(|s| call_error("removing the endpoint", s))?
        .released;
    mark(t0, "unregister");
    if env.ifname != PRIMARY_IFNAME {
        forget_source_rules(inv, kernel, &released).await;
    }
    if inv.conf.agent_ipam() {
        return Ok(());
    }
    ipam::del(env, inv.conf, inv.raw, agent, delegate).await
}

/// A secondary attachment's source rules live in the pod's namespace and outlive its veth:
/// remove those of its addresses (released ones, and the prevResult's) while the pod lives.
/// Best effort: a pod namespace that is gone took them with it.
async fn forget_source_rules(inv: &Invocation<'_>, kernel: &mut impl Kernel, released: &[String]) {
    let env = inv.env;
    if env.netns.is_empty() {
        return;
    }
    let mut addrs: Vec<IpAddr> = released.iter().filter_map(|a| a.parse().ok()).collect();
    if let Some(prev) = &inv.conf.prev_result {
        if let Ok(prev) = AddResult::from_json(prev) {
            addrs.extend(prev.ips.iter().map(|(net, _, _)| net.addr()));
        }
    }
    if addrs.is_empty() {
        return;
    }
    kernel.forget_source_rules(&env.netns, &addrs).await;
}
