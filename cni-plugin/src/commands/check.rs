//! CHECK: really checks. The host veth, the pod interface with its addresses and default route,
//! the host route to each address, the endpoint in the agent and the addresses in IPAM must all
//! match the `prevResult` the runtime cached from ADD.
use std::net::IpAddr;

use calix_proto::v1 as pb;
use ipnet::IpNet;

use super::{wiring, Invocation};
use crate::client::{call_error, AgentClient};
use crate::error::{code, CniError};
use crate::ipam;
use crate::result::AddResult;
use calix_kernel::netlink::{self, Family};
use calix_kernel::netns;
use calix_kernel::pod;

fn failed(msg: String) -> CniError {
    CniError::new(
        code::WIRING_FAILED,
        msg,
        "the pod's network is not as ADD left it: recreate the pod",
    )
}

pub async fn run(inv: &Invocation<'_>) -> Result<(), CniError> {
    let (env, conf) = (inv.env, inv.conf);
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        CniError::new(
            code::INVALID_CONFIG,
            "CHECK needs prevResult",
            "the runtime must pass the cached ADD result as prevResult",
        )
    })?;
    let prev = AddResult::from_json(prev)?;
    let host_if = prev
        .interfaces
        .iter()
        .find(|i| i.sandbox.is_none() && i.name.starts_with("cali"))
        .ok_or_else(|| failed("prevResult names no calix host interface".into()))?;
    let pod_idx = prev
        .interfaces
        .iter()
        .position(|i| i.sandbox.is_some() && i.name == env.ifname)
        .ok_or_else(|| failed(format!("prevResult has no {} in the container", env.ifname)))?;
    let ours: Vec<(IpNet, IpAddr)> = prev
        .ips
        .iter()
        .filter(|(_, _, i)| *i == pod_idx)
        .map(|(a, g, _)| (*a, *g))
        .collect();

    let host = netns::netlink_here()
        .await
        .map_err(|e| wiring("cannot open netlink in the host namespace".into(), &e))?;
    let link = netlink::link_details(&host, &host_if.name)
        .await
        .map_err(|e| wiring("cannot read host links".into(), &e))?
        .ok_or_else(|| failed(format!("host interface {} is missing", host_if.name)))?;
    if link.mac != Some(pod::HOST_VETH_MAC) || !link.up {
        return Err(failed(format!(
            "host interface {} is down or has a foreign MAC",
            host_if.name
        )));
    }
    for (addr, _) in &ours {
        let dst = IpNet::from(addr.addr());
        let routes = netlink::routes_to(&host, dst)
            .await
            .map_err(|e| wiring("cannot read host routes".into(), &e))?;
        if !routes.iter().any(|r| r.oif == Some(link.index)) {
            return Err(failed(format!(
                "host route {dst} dev {} is missing",
                host_if.name
            )));
        }
    }

    let pod_ns = super::open_pod_ns(env)?;
    let pod = netns::netlink_in(&pod_ns).await.map_err(|e| {
        wiring(
            "cannot open netlink in the container's namespace".into(),
            &e,
        )
    })?;
    let pod_link = netlink::link_details(&pod, &env.ifname)
        .await
        .map_err(|e| wiring("cannot read the container's links".into(), &e))?
        .ok_or_else(|| failed(format!("{} is missing in the container", env.ifname)))?;
    let have = netlink::addresses(&pod, pod_link.index)
        .await
        .map_err(|e| wiring("cannot read the container's addresses".into(), &e))?;
    for (addr, gw) in &ours {
        if !have.iter().any(|h| h.address == *addr) {
            return Err(failed(format!(
                "{addr} is missing on {} in the container",
                env.ifname
            )));
        }
        let fam = if addr.addr().is_ipv4() {
            Family::V4
        } else {
            Family::V6
        };
        let routes = netlink::routes(&pod, fam)
            .await
            .map_err(|e| wiring("cannot read the container's routes".into(), &e))?;
        if !routes.iter().any(|r| {
            r.dst.prefix_len() == 0 && r.gateway == Some(*gw) && r.oif == Some(pod_link.index)
        }) {
            return Err(failed(format!(
                "default route via {gw} is missing in the container"
            )));
        }
    }

    let mut agent = AgentClient::connect(&conf.agent_socket()).await?;
    let eps = agent
        .endpoints
        .list(pb::ListRequest {})
        .await
        .map_err(|s| call_error("listing endpoints", s))?
        .into_inner();
    let registered = eps.endpoints.iter().any(|s| {
        s.endpoint.as_ref().is_some_and(|e| {
            e.container_id == env.container_id
                && e.ifname == env.ifname
                && e.host_ifname == host_if.name
        })
    });
    if !registered {
        return Err(failed(format!(
            "calix-agent has no endpoint for {}/{}",
            env.container_id, env.ifname
        )));
    }
    let addrs: Vec<IpAddr> = ours.iter().map(|(a, _)| a.addr()).collect();
    ipam::check(
        env,
        conf,
        inv.raw,
        &mut agent,
        &mut ipam::ExecPlugin,
        &addrs,
    )
    .await
}
