//! The CNI verbs. ADD records every step it completes and undoes them in reverse on failure,
//! so a failed ADD leaves no veth, route, endpoint or address behind. DEL is idempotent.
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use calix_proto::v1 as pb;
use ipnet::IpNet;
use serde_json::Value;

use crate::args::{host_veth_name, CniEnv};
use crate::client::{call_error, AgentClient};
use crate::config::NetConf;
use crate::error::{code, CniError};
use crate::netns::{self, NetNs};
use crate::result::{AddResult, Interface};
use crate::veth;

fn wiring(msg: String, e: &dyn std::error::Error) -> CniError {
    let mut details = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        details.push_str(": ");
        details.push_str(&c.to_string());
        cur = c.source();
    }
    CniError::new(code::WIRING_FAILED, msg, details)
}

/// What ADD has done so far, to undo on failure.
#[derive(Default)]
struct Undo {
    allocated: Option<(String, String)>,
    veth: Option<String>,
    registered: Option<(String, String)>,
}

impl Undo {
    async fn run(self, agent: &mut AgentClient, host: Option<&rtnetlink::Handle>) {
        if let Some((cid, ifname)) = self.registered {
            if let Err(e) = agent
                .endpoints
                .unregister(pb::UnregisterRequest {
                    container_id: cid,
                    ifname,
                })
                .await
            {
                tracing::error!(error = %e, "rollback: unregister failed");
            }
        }
        if let (Some(name), Some(h)) = (self.veth, host) {
            if let Err(e) = veth::delete_link(h, &name).await {
                tracing::error!(error = %e, %name, "rollback: deleting veth failed");
            }
        }
        if let Some((handle, ifname)) = self.allocated {
            if let Err(e) = agent
                .ipam
                .release(pb::ReleaseRequest { handle, ifname })
                .await
            {
                tracing::error!(error = %e, "rollback: releasing addresses failed");
            }
        }
    }
}

struct Addresses {
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
    nets: Vec<IpNet>,
}

fn parse_addresses(resp: &pb::AllocateResponse) -> Result<Addresses, CniError> {
    let mut a = Addresses {
        v4: None,
        v6: None,
        nets: Vec::new(),
    };
    for addr in &resp.addresses {
        let net: IpNet = addr.address.parse().map_err(|_| {
            CniError::new(
                code::AGENT_REFUSED,
                format!("agent returned a bad address {:?}", addr.address),
                "",
            )
        })?;
        match net.addr() {
            IpAddr::V4(v4) => a.v4 = Some(v4),
            IpAddr::V6(v6) => a.v6 = Some(v6),
        }
        a.nets.push(net);
    }
    Ok(a)
}

pub async fn add(env: &CniEnv, conf: &NetConf) -> Result<Value, CniError> {
    let (want_v4, want_v6) = conf.ipam.families()?;
    let pod_ns = NetNs::open(&env.netns).map_err(|e| {
        CniError::new(
            code::INVALID_ENV,
            format!(
                "cannot open the container's network namespace {}",
                env.netns
            ),
            e.to_string(),
        )
    })?;
    let mut agent = AgentClient::connect(&conf.agent_socket()).await?;
    let handle = conf.handle(&env.container_id);
    let host_ifname = host_veth_name(&env.args, &env.container_id);

    let mut attributes = HashMap::new();
    attributes.insert("containerID".to_string(), env.container_id.clone());
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
        .ipam
        .allocate(pb::AllocateRequest {
            handle: handle.clone(),
            ifname: env.ifname.clone(),
            ipv4: want_v4,
            ipv6: want_v6,
            attributes,
        })
        .await
        .map_err(|s| call_error("the address allocation", s))?
        .into_inner();
    let mut undo = Undo::default();
    if !resp.already_allocated {
        undo.allocated = Some((handle.clone(), env.ifname.clone()));
    }

    let host = match netns::netlink_here().await {
        Ok(h) => h,
        Err(e) => {
            let err = wiring("cannot open netlink in the host namespace".into(), &e);
            undo.run(&mut agent, None).await;
            return Err(err);
        }
    };
    match wire(
        env,
        conf,
        &pod_ns,
        &host,
        &host_ifname,
        &handle,
        &resp,
        &mut agent,
        &mut undo,
    )
    .await
    {
        Ok(v) => Ok(v),
        Err(e) => {
            undo.run(&mut agent, Some(&host)).await;
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn wire(
    env: &CniEnv,
    conf: &NetConf,
    pod_ns: &NetNs,
    host: &rtnetlink::Handle,
    host_ifname: &str,
    handle: &str,
    resp: &pb::AllocateResponse,
    agent: &mut AgentClient,
    undo: &mut Undo,
) -> Result<Value, CniError> {
    let addrs = parse_addresses(resp)?;
    let pair = veth::create_veth(host, pod_ns, host_ifname, &env.ifname, conf.mtu)
        .await
        .map_err(|e| wiring(format!("cannot create veth {host_ifname}"), &e))?;
    undo.veth = Some(host_ifname.to_string());

    let pod = netns::netlink_in(pod_ns).await.map_err(|e| {
        wiring(
            "cannot open netlink in the container's namespace".into(),
            &e,
        )
    })?;
    veth::configure_pod(&pod, pair.pod_ifindex, addrs.v4, addrs.v6)
        .await
        .map_err(|e| {
            wiring(
                format!("cannot configure {} in the container", env.ifname),
                &e,
            )
        })?;
    veth::configure_host(host, host_ifname, pair.host_ifindex, addrs.v4, addrs.v6)
        .await
        .map_err(|e| wiring(format!("cannot configure host side {host_ifname}"), &e))?;

    agent
        .endpoints
        .register(pb::RegisterRequest {
            endpoint: Some(pb::Endpoint {
                container_id: env.container_id.clone(),
                ifname: env.ifname.clone(),
                host_ifname: host_ifname.to_string(),
                netns: env.netns.clone(),
                pod_namespace: env.args.pod_namespace.clone().unwrap_or_default(),
                pod_name: env.args.pod_name.clone().unwrap_or_default(),
                addresses: addrs.nets.iter().map(|n| n.to_string()).collect(),
                handle: handle.to_string(),
            }),
        })
        .await
        .map_err(|s| call_error("registering the endpoint", s))?;
    undo.registered = Some((env.container_id.clone(), env.ifname.clone()));

    let mut result = AddResult {
        interfaces: vec![
            Interface {
                name: host_ifname.to_string(),
                mac: veth::HOST_VETH_MAC,
                sandbox: None,
            },
            Interface {
                name: env.ifname.clone(),
                mac: pair.pod_mac,
                sandbox: Some(env.netns.clone()),
            },
        ],
        ips: Vec::new(),
        routes: Vec::new(),
    };
    for net in &addrs.nets {
        let gw: IpAddr = match net {
            IpNet::V4(_) => IpAddr::V4(veth::GATEWAY_V4),
            IpNet::V6(_) => IpAddr::V6(veth::GATEWAY_V6),
        };
        let default: IpNet = match net {
            IpNet::V4(_) => IpNet::V4(ipnet::Ipv4Net::default()),
            IpNet::V6(_) => IpNet::V6(ipnet::Ipv6Net::default()),
        };
        result.ips.push((*net, gw, 1));
        result.routes.push((default, gw));
    }
    Ok(result.to_json(&conf.cni_version))
}

pub async fn del(env: &CniEnv, conf: &NetConf) -> Result<(), CniError> {
    let mut agent = AgentClient::connect(&conf.agent_socket()).await?;
    let host_ifname = host_veth_name(&env.args, &env.container_id);
    agent
        .endpoints
        .unregister(pb::UnregisterRequest {
            container_id: env.container_id.clone(),
            ifname: env.ifname.clone(),
        })
        .await
        .map_err(|s| call_error("removing the endpoint", s))?;
    let host = netns::netlink_here()
        .await
        .map_err(|e| wiring("cannot open netlink in the host namespace".into(), &e))?;
    veth::delete_link(&host, &host_ifname)
        .await
        .map_err(|e| wiring(format!("cannot delete veth {host_ifname}"), &e))?;
    agent
        .ipam
        .release(pb::ReleaseRequest {
            handle: conf.handle(&env.container_id),
            ifname: env.ifname.clone(),
        })
        .await
        .map_err(|s| call_error("releasing the addresses", s))?;
    Ok(())
}
