//! DEL: idempotent and best-effort. A missing netns, link, endpoint or address is success;
//! the address is released even when the pod's namespace is already gone.
use calix_proto::v1 as pb;

use super::{wiring, Invocation};
use std::net::IpAddr;

use crate::args::{host_veth_name, PRIMARY_IFNAME};
use crate::client::{call_error, AgentClient};
use crate::error::CniError;
use crate::ipam;
use crate::result::AddResult;
use calix_kernel::{netns, pod};

pub async fn run(inv: &Invocation<'_>) -> Result<(), CniError> {
    let env = inv.env;
    let t0 = std::time::Instant::now();
    let mark = |phase: &str| {
        tracing::debug!(
            phase,
            elapsed_us = t0.elapsed().as_micros() as u64,
            "DEL phase done"
        );
    };
    let mut agent = AgentClient::connect(&inv.conf.agent_socket()).await?;
    mark("connect");
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
    let host = netns::netlink_here()
        .await
        .map_err(|e| wiring("cannot open netlink in the host namespace".into(), &e))?;
    let owner = pod::owner_alias(&env.container_id, &env.ifname);
    // Order matters for speed and safety: the veth goes first (the kernel drops its routes and
    // tc filters with it), so the agent only forgets the endpoint instead of detaching filters
    // under the RTNL lock; the address is released last, once no route points at the old veth.
    for name in &names {
        super::delete_owned_link(&host, name, &owner)
            .await
            .map_err(|e| wiring(format!("cannot delete veth {name}"), &e))?;
    }
    mark("veth");
    // With calix-ipam the agent releases the addresses in the same call and datastore write.
    let release_handle = if inv.conf.agent_ipam() {
        inv.conf.handle(&env.container_id)
    } else {
        String::new()
    };
    let released = agent
        .endpoints
        .unregister(pb::UnregisterRequest {
            container_id: env.container_id.clone(),
            ifname: env.ifname.clone(),
            release_handle,
        })
        .await
        .map_err(|s| call_error("removing the endpoint", s))?
        .into_inner()
        .released;
    mark("unregister");
    if env.ifname != PRIMARY_IFNAME {
        forget_source_rules(inv, &released).await;
    }
    if inv.conf.agent_ipam() {
        return Ok(());
    }
    ipam::del(env, inv.conf, inv.raw, &mut agent).await
}

/// A secondary attachment's source rules live in the pod's namespace and outlive its veth:
/// remove those of its addresses (released ones, and the prevResult's) while the pod lives.
/// Best effort: a pod namespace that is gone took them with it.
async fn forget_source_rules(inv: &Invocation<'_>, released: &[String]) {
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
    let Ok(pod_ns) = netns::NetNs::open(&env.netns) else {
        return;
    };
    match netns::netlink_in(&pod_ns).await {
        Ok(pod) => {
            if let Err(e) = pod::delete_source_rules(&pod, &addrs).await {
                tracing::warn!(error = %e, "cannot remove the attachment's source rules");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot enter the pod to remove its source rules"),
    }
}
