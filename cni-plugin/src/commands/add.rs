//! ADD: address, veth (peer created straight in the pod's namespace), pod and host config,
//! endpoint registration. Every completed step is recorded and undone in reverse on failure,
//! so a failed ADD leaves no veth, route, endpoint or address behind.
use std::net::IpAddr;

use calix_proto::v1 as pb;
use ipnet::IpNet;
use serde_json::Value;

use super::{wiring, Invocation};
use crate::args::{host_veth_name, pod_identity};
use crate::client::{call_error, AgentClient};
use crate::error::{code, CniError};
use crate::ipam;
use crate::result::{AddResult, Interface};
use calix_kernel::netns::{self, NetNs};
use calix_kernel::{
    netlink::{self, NetlinkError},
    pod,
};

/// What ADD has done so far.
#[derive(Default)]
struct Undo {
    allocated: bool,
    veth: Option<String>,
    registered: bool,
}

impl Undo {
    async fn run(
        self,
        inv: &Invocation<'_>,
        agent: &mut AgentClient,
        host: Option<&rtnetlink::Handle>,
    ) {
        if self.registered {
            if let Err(e) = agent
                .endpoints
                .unregister(pb::UnregisterRequest {
                    container_id: inv.env.container_id.clone(),
                    ifname: inv.env.ifname.clone(),
                    release_handle: String::new(),
                })
                .await
            {
                tracing::error!(error = %e, "rollback: unregister failed");
            }
        }
        if let (Some(name), Some(h)) = (self.veth, host) {
            if let Err(e) = netlink::delete_link(h, &name).await {
                tracing::error!(error = %e, %name, "rollback: deleting veth failed");
            }
        }
        if self.allocated {
            if let Err(e) = ipam::del(inv.env, inv.conf, inv.raw, agent).await {
                tracing::error!(error = %e, "rollback: releasing addresses failed");
            }
        }
    }
}

/// Logs how long each ADD phase took (debug level), so slow steps show in the log file.
struct Phases(std::time::Instant);

impl Phases {
    fn mark(&self, phase: &str) {
        tracing::debug!(
            phase,
            elapsed_us = self.0.elapsed().as_micros() as u64,
            "ADD phase done"
        );
    }
}

pub async fn run(inv: &Invocation<'_>) -> Result<Value, CniError> {
    let (env, conf) = (inv.env, inv.conf);
    let t = Phases(std::time::Instant::now());
    let pod_ns = super::open_pod_ns(env)?;
    let mut agent = AgentClient::connect(&conf.agent_socket()).await?;
    let host = netns::netlink_here()
        .await
        .map_err(|e| wiring("cannot open netlink in the host namespace".into(), &e))?;
    t.mark("connect");
    let host_ifname = host_veth_name(&env.args, &env.container_id, &env.ifname);
    // The address and the veth don't depend on each other: get both at once.
    let create = create_veth(inv, &host, &pod_ns, &host_ifname);
    let (assigned, pair) = tokio::join!(
        async {
            let r = ipam::add(env, conf, inv.raw, &mut agent).await;
            t.mark("ipam");
            r
        },
        async {
            let r = create.await;
            t.mark("veth");
            r
        }
    );
    let mut undo = Undo {
        allocated: assigned.as_ref().is_ok_and(|a| !a.already),
        veth: pair.as_ref().ok().map(|_| host_ifname.clone()),
        registered: false,
    };
    t.mark("ipam and veth");
    let (assigned, (pair, pod)) = match (assigned, pair) {
        (Ok(a), Ok(p)) => (a, p),
        (Err(e), _) | (_, Err(e)) => {
            undo.run(inv, &mut agent, Some(&host)).await;
            return Err(e);
        }
    };
    // The veth was made with the conflist's MTU; without one, the agent's (set with the
    // links going up: no extra request).
    let mtu = conf.mtu.is_none().then_some(assigned.mtu).flatten();
    match wire(
        inv,
        &pod_ns,
        &pod,
        &host,
        &host_ifname,
        &pair,
        (&assigned.addresses, mtu),
        &mut agent,
        &mut undo,
        &t,
    )
    .await
    {
        Ok(v) => Ok(v),
        Err(e) => {
            undo.run(inv, &mut agent, Some(&host)).await;
            Err(e)
        }
    }
}

/// Creates the veth. Its host-side name is the pod's: when a veth of that name exists already,
/// it is either an older sandbox of the same Kubernetes pod (its alias names another owner;
/// the pod was recreated while the old sandbox still exists), which is retired — its veth
/// deleted, its addresses kept until its own DEL releases them, its endpoint retired by the
/// agent when this one registers — or it is an error that says whose it is.
async fn create_veth(
    inv: &Invocation<'_>,
    host: &rtnetlink::Handle,
    pod_ns: &NetNs,
    host_ifname: &str,
) -> Result<(pod::VethPair, rtnetlink::Handle), CniError> {
    let (env, conf) = (inv.env, inv.conf);
    let create = || pod::create_veth_with_handle(host, pod_ns, host_ifname, &env.ifname, conf.mtu);
    let exists = match create().await {
        Err(NetlinkError::Exists { name }) if name == host_ifname => name,
        Err(NetlinkError::Exists { name }) => {
            return Err(CniError::new(
                code::WIRING_FAILED,
                format!("interface {name} already exists in the container's network namespace",),
                format!("CNI_IFNAME {name} is taken in {}", env.netns),
            ))
        }
        other => return other.map_err(|e| wiring(format!("cannot create veth {host_ifname}"), &e)),
    };
    let ours = pod::owner_alias(&env.container_id, &env.ifname);
    let alias = netlink::link_details(host, &exists)
        .await
        .map_err(|e| wiring(format!("cannot inspect the existing {exists}"), &e))?
        .and_then(|l| l.alias);
    match alias {
        Some(alias) if alias == ours => Err(CniError::new(
            code::WIRING_FAILED,
            format!(
                "interface {exists} already exists for container {} {}: DEL it first",
                env.container_id, env.ifname
            ),
            format!("{exists} has alias {alias}"),
        )),
        Some(alias) if pod::is_owner_alias(&alias) && pod_identity(&env.args).is_some() => {
            tracing::info!(%host_ifname, old_owner = %alias, new_owner = %ours,
                "replacing the veth of an older sandbox of this pod");
            super::delete_owned_link(host, host_ifname, &alias)
                .await
                .map_err(|e| {
                    wiring(
                        format!("cannot delete the older sandbox's {host_ifname}"),
                        &e,
                    )
                })?;
            create()
                .await
                .map_err(|e| wiring(format!("cannot create veth {host_ifname}"), &e))
        }
        alias => Err(CniError::new(
            code::WIRING_FAILED,
            format!(
                "interface {exists} already exists and belongs to {}: remove it or rename the pod",
                alias.as_deref().unwrap_or("something that is not calix")
            ),
            format!("alias {alias:?}"),
        )),
    }
}

/// The pod's first attachment takes the main table; when the pod has a default route already
/// (another calix attachment, or another network's), this one is secondary.
async fn pod_routing(
    pod: &rtnetlink::Handle,
    pod_ifindex: u32,
    v4: bool,
    v6: bool,
) -> Result<pod::PodRouting, CniError> {
    let read = |e: NetlinkError| wiring("cannot read the container's routes".into(), &e);
    let taken = (v4
        && pod::has_default_route(pod, netlink::Family::V4)
            .await
            .map_err(read)?)
        || (v6
            && pod::has_default_route(pod, netlink::Family::V6)
                .await
                .map_err(read)?);
    Ok(if taken {
        pod::PodRouting::secondary(pod_ifindex)
    } else {
        pod::PodRouting::Main
    })
}

#[allow(clippy::too_many_arguments)]
async fn wire(
    inv: &Invocation<'_>,
    pod_ns: &NetNs,
    pod: &rtnetlink::Handle,
    host: &rtnetlink::Handle,
    host_ifname: &str,
    pair: &pod::VethPair,
    (addresses, mtu): (&[IpAddr], Option<u32>),
    agent: &mut AgentClient,
    undo: &mut Undo,
    t: &Phases,
) -> Result<Value, CniError> {
    let (env, conf) = (inv.env, inv.conf);
    let host_ifname = host_ifname.to_string();
    let v4 = addresses.iter().find_map(|a| match a {
        IpAddr::V4(v) => Some(*v),
        IpAddr::V6(_) => None,
    });
    let v6 = addresses.iter().find_map(|a| match a {
        IpAddr::V6(v) => Some(*v),
        IpAddr::V4(_) => None,
    });
    netlink::set_alias(
        host,
        pair.host_ifindex,
        &pod::owner_alias(&env.container_id, &env.ifname),
    )
    .await
    .map_err(|e| wiring(format!("cannot mark {host_ifname} as ours"), &e))?;

    let mut pod_mac = pair.pod_mac;
    if let Some(mac) = conf.runtime()?.mac {
        netlink::set_mac(pod, pair.pod_ifindex, mac)
            .await
            .map_err(|e| wiring(format!("cannot set MAC of {}", env.ifname), &e))?;
        pod_mac = mac;
    }
    let routing = pod_routing(pod, pair.pod_ifindex, v4.is_some(), v6.is_some()).await?;
    pod::configure_pod(pod, pair.pod_ifindex, v4, v6, routing, mtu)
        .await
        .map_err(|e| {
            wiring(
                format!("cannot configure {} in the container", env.ifname),
                &e,
            )
        })?;
    t.mark("pod side");
    if conf.container_settings.allow_ip_forwarding {
        let mut knobs = vec![];
        if v4.is_some() {
            knobs.push("/proc/sys/net/ipv4/ip_forward");
        }
        if v6.is_some() {
            knobs.push("/proc/sys/net/ipv6/conf/all/forwarding");
        }
        for k in knobs {
            netns::write_sysctl_in(pod_ns, k, "1")
                .map_err(|e| wiring(format!("cannot set {k} in the container"), &e))?;
        }
    }
    pod::configure_host(host, &host_ifname, pair.host_ifindex, v4, v6, mtu)
        .await
        .map_err(|e| wiring(format!("cannot configure host side {host_ifname}"), &e))?;
    t.mark("host side");

    let nets: Vec<IpNet> = addresses.iter().map(|a| IpNet::from(*a)).collect();
    agent
        .endpoints
        .register(pb::RegisterRequest {
            endpoint: Some(pb::Endpoint {
                container_id: env.container_id.clone(),
                ifname: env.ifname.clone(),
                host_ifname: host_ifname.clone(),
                netns: env.netns.clone(),
                pod_namespace: env.args.pod_namespace.clone().unwrap_or_default(),
                pod_name: env.args.pod_name.clone().unwrap_or_default(),
                pod_uid: env.args.pod_uid.clone().unwrap_or_default(),
                addresses: nets.iter().map(ToString::to_string).collect(),
                handle: conf.handle(&env.container_id),
                mac: calix_kernel::mac::format(&pod_mac),
                host_ifindex: pair.host_ifindex,
            }),
        })
        .await
        .map_err(|s| call_error("registering the endpoint", s))?;
    undo.registered = true;
    t.mark("register");
    // Not before both ends transmit: the pod's first answers would be dropped.
    let ready = pod::wait_operational(
        pod,
        pair.pod_ifindex,
        host,
        pair.host_ifindex,
        pod::OPERATIONAL_WITHIN,
    )
    .await
    .map_err(|e| wiring(format!("cannot read the state of {host_ifname}"), &e))?;
    if !ready {
        tracing::warn!(host_ifname = %host_ifname, within = ?pod::OPERATIONAL_WITHIN,
            "the veth is not operational yet; its first packets may be dropped");
    }
    t.mark("operational");

    let mut result = AddResult {
        interfaces: vec![
            Interface {
                name: host_ifname,
                mac: pod::HOST_VETH_MAC,
                sandbox: None,
            },
            Interface {
                name: env.ifname.clone(),
                mac: pod_mac,
                sandbox: Some(env.netns.clone()),
            },
        ],
        ips: Vec::new(),
        routes: Vec::new(),
    };
    for net in &nets {
        let (gw, default): (IpAddr, IpNet) = match net {
            IpNet::V4(_) => (IpAddr::V4(pod::GATEWAY_V4), IpNet::V4(Default::default())),
            IpNet::V6(_) => (IpAddr::V6(pod::GATEWAY_V6), IpNet::V6(Default::default())),
        };
        result.ips.push((*net, gw, 1));
        result.routes.push((default, gw));
    }
    // Chained after another plugin: pass its result on with ours appended.
    if let Some(prev) = &conf.prev_result {
        result = result.after(AddResult::from_json(prev)?);
    }
    Ok(result.to_json(&conf.cni_version))
}
