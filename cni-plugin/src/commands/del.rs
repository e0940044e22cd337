//! DEL: idempotent and best-effort. A missing netns, link, endpoint or address is success;
//! the address is released even when the pod's namespace is already gone.
use calix_proto::v1 as pb;

use super::{wiring, Invocation};
use crate::args::host_veth_name;
use crate::client::{call_error, AgentClient};
use crate::error::CniError;
use crate::{ipam, netns, veth};

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
    let owner = veth::owner_alias(&env.container_id, &env.ifname);
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
    agent
        .endpoints
        .unregister(pb::UnregisterRequest {
            container_id: env.container_id.clone(),
            ifname: env.ifname.clone(),
            release_handle,
        })
        .await
        .map_err(|s| call_error("removing the endpoint", s))?;
    mark("unregister");
    if inv.conf.agent_ipam() {
        return Ok(());
    }
    ipam::del(env, inv.conf, inv.raw, &mut agent).await
}
