//! ADD: address, veth (peer created straight in the pod's namespace), pod and host config,
//! endpoint registration. Every completed step is recorded and undone in reverse on failure,
//! so a failed ADD leaves no veth, route, endpoint or address behind.
use std::net::IpAddr;

use calix_proto::v1 as pb;
use ipnet::IpNet;
use serde_json::Value;

use super::{wiring, Invocation};
use crate::args::{host_veth_name, pod_identity};
use crate::client::{call_error, Agent, AgentClient};
use crate::error::{code, CniError};
use crate::ipam::{self, Delegate, ExecPlugin};
use crate::kernel::{Kernel, NodeKernel};
use crate::result::{AddResult, Interface};
use calix_kernel::netns;
use calix_kernel::{
    netlink::{self, NetlinkError},
    pod,
};

/// What ADD has done so far, undone in reverse by [`Undo::run`].
#[derive(Default)]
struct Undo {
    /// Addresses were allocated for this attachment by this ADD (not held before it).
    allocated: bool,
    /// The host side of the veth this ADD created.
    veth: Option<String>,
    /// A secondary attachment's addresses whose source rules ADD may have added in the pod's
    /// namespace: they outlive the veth.
    source_rules: Vec<IpAddr>,
    /// The agent has the endpoint.
    registered: bool,
}

impl Undo {
    async fn run(
        self,
        inv: &Invocation<'_>,
        kernel: &mut impl Kernel,
        agent: &mut impl Agent,
        delegate: &mut impl Delegate,
    ) {
        if self.registered {
            if let Err(e) = agent
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
        if !self.source_rules.is_empty() {
            kernel
                .forget_source_rules(&inv.env.netns, &self.source_rules)
                .await;
        }
        if let Some(name) = self.veth {
            if let Err(e) = kernel.delete_host_link(&name).await {
                tracing::error!(error = %e, %name, "rollback: deleting veth failed");
            }
        }
        if self.allocated {
            if let Err(e) = ipam::del(inv.env, inv.conf, inv.raw, agent, delegate).await {
                tracing::error!(error = %e, "rollback: releasing addresses failed");
            }
        }
    }
}

/// Logs how long each ADD phase took (debug level), so slow steps show in the log file.
pub struct Phases(std::time::Instant);

impl Phases {
    pub fn start() -> Self {
        Self(std::time::Instant::now())
    }

    fn mark(&self, phase: &str) {
        tracing::debug!(
            phase,
            elapsed_us = self.0.elapsed().as_micros() as u64,
            "ADD phase done"
        );
    }
}

pub async fn run(inv: &Invocation<'_>) -> Result<Value, CniError> {
    let t = Phases::start();
    let pod_ns = super::open_pod_ns(inv.env)?;
    let mut agent = AgentClient::connect(&inv.conf.agent_socket()).await?;
    let host = netns::netlink_here()
        .await
        .map_err(|e| wiring("cannot open netlink in the host namespace".into(), &e))?;
    t.mark("connect");
    let mut kernel = NodeKernel::new(host, Some(pod_ns));
    add(inv, &mut kernel, &mut agent, &mut ExecPlugin, &t).await
}

/// ADD once the pod's namespace, the agent and netlink are open: the addresses and the veth
/// (at once), the veth's owner mark, the pod side, the host side, the endpoint, the result.
/// On failure, every step done is undone in reverse.
pub async fn add(
    inv: &Invocation<'_>,
    kernel: &mut impl Kernel,
    agent: &mut impl Agent,
    delegate: &mut impl Delegate,
    t: &Phases,
) -> Result<Value, CniError> {
    let (env, conf) = (inv.env, inv.conf);
    let host_ifname = host_veth_name(&env.args, &env.container_id, &env.ifname);
    // The address and the veth don't depend on each other: get both at once.
    let (assigned, pair) = tokio::join!(
        async {
            let r = ipam::add(env, conf, inv.raw, &mut *agent, &mut *delegate).await;
            t.mark("ipam");
            r
        },
        async {
            let r = create_veth(inv, &mut *kernel, &host_ifname).await;
            t.mark("veth");
            r
        }
    );
    let mut undo = Undo {
        allocated: assigned.as_ref().is_ok_and(|a| !a.already),
        veth: pair.as_ref().ok().map(|_| host_ifname.clone()),
        ..Undo::default()
    };
    t.mark("ipam and veth");
    let (assigned, pair) = match (assigned, pair) {
        (Ok(a), Ok(p)) => (a, p),
        (Err(e), _) | (_, Err(e)) => {
            undo.run(inv, kernel, agent, delegate).await;
            return Err(e);
        }
    };
    // The veth was made with the conflist's MTU; without one, the agent's (set with the
    // links going up: no extra request).
    let mtu = conf.mtu.is_none().then_some(assigned.mtu).flatten();
    match wire(
        inv,
        &mut *kernel,
        &mut *agent,
        &host_ifname,
        &pair,
        (&assigned.addresses, mtu),
        &mut undo,
        t,
    )
    .await
    {
        Ok(v) => Ok(v),
        Err(e) => {
            undo.run(inv, kernel, agent, delegate).await;
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
    kernel: &mut impl Kernel,
    host_ifname: &str,
) -> Result<pod::VethPair, CniError> {
    let (env, conf) = (inv.env, inv.conf);
    let exists = match kernel.create_veth(host_ifname, &env.ifname, conf.mtu).await {
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
    let alias = kernel
        .host_link(&exists)
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
            super::delete_owned_link(kernel, host_ifname, &alias)
                .await
                .map_err(|e| {
                    wiring(
                        format!("cannot delete the older sandbox's {host_ifname}"),
                        &e,
                    )
                })?;
            kernel
                .create_veth(host_ifname, &env.ifname, conf.mtu)
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
    kernel: &mut impl Kernel,
    pod_ifindex: u32,
    v4: bool,
    v6: bool,
) -> Result<pod::PodRouting, CniError> {
    let read = |e: NetlinkError| wiring("cannot read the container's routes".into(), &e);
    let taken = (v4
        && kernel
            .pod_has_default_route(netlink::Family::V4)
            .await
            .map_err(read)?)
        || (v6
            && kernel
                .pod_has_default_route(netlink::Family::V6)
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
    kernel: &mut impl Kernel,
    agent: &mut impl Agent,
    host_ifname: &str,
    pair: &pod::VethPair,
    (addresses, mtu): (&[IpAddr], Option<u32>),
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
    kernel
        .set_host_alias(
            pair.host_ifindex,
            &pod::owner_alias(&env.container_id, &env.ifname),
        )
        .await
        .map_err(|e| wiring(format!("cannot mark {host_ifname} as ours"), &e))?;

    let mut pod_mac = pair.pod_mac;
    if let Some(mac) = conf.runtime()?.mac {
        kernel
            .set_pod_mac(pair.pod_ifindex, mac)
            .await
            .map_err(|e| wiring(format!("cannot set MAC of {}", env.ifname), &e))?;
        pod_mac = mac;
    }
    let routing = pod_routing(kernel, pair.pod_ifindex, v4.is_some(), v6.is_some()).await?;
    if routing != pod::PodRouting::Main {
        // Its source rules outlive the veth: a rollback removes them.
        undo.source_rules = addresses.to_vec();
    }
    kernel
        .configure_pod(pair.pod_ifindex, v4, v6, routing, mtu)
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
            kernel
                .set_pod_sysctl(k, "1")
                .map_err(|e| wiring(format!("cannot set {k} in the container"), &e))?;
        }
    }
    kernel
        .configure_host(&host_ifname, pair.host_ifindex, v4, v6, mtu)
        .await
        .map_err(|e| wiring(format!("cannot configure host side {host_ifname}"), &e))?;
    t.mark("host side");

    let nets: Vec<IpNet> = addresses.iter().map(|a| IpNet::from(*a)).collect();
    agent
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
    let ready = kernel
        .wait_operational(pair.pod_ifindex, pair.host_ifindex, pod::OPERATIONAL_WITHIN)
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
