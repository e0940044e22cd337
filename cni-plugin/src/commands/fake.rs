//! Fakes of the plugin's three sides ([`Kernel`], [`Agent`], [`Delegate`]) over one in-memory
//! [`World`]: what the node's kernel, the agent and a delegated IPAM plugin hold, a journal of
//! every call in order, and the one call that is made to fail.
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::rc::Rc;

use calix_kernel::netlink::{Family, LinkDetails, NetlinkError};
use calix_kernel::pod::{PodRouting, VethPair};
use calix_proto::v1 as pb;
use ipnet::IpNet;
use serde_json::{json, Value};
use tonic::Status;

use crate::args::CniEnv;
use crate::client::Agent;
use crate::error::{code, CniError};
use crate::ipam::Delegate;
use crate::kernel::Kernel;

/// A host veth and what hangs off it: all of it goes when the link is deleted, as in the
/// kernel (the peer, its addresses and routes, the host routes through it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub alias: Option<String>,
    pub pod_ifname: String,
    pub pod_index: u32,
    pub pod_mac: [u8; 6],
    pub up: bool,
    /// Addresses on the pod side.
    pub pod_addresses: Vec<IpAddr>,
    /// Host routes through this link.
    pub host_routes: Vec<IpAddr>,
}

/// What the fakes hold.
#[derive(Debug, Default)]
pub struct World {
    /// Every call, in order: `create_veth caliX`, `allocate`, `delete_host_link caliX`, ...
    pub journal: Vec<String>,
    /// The call (the first word of its journal entry) that fails, and how an agent call fails.
    pub fail: Option<(String, tonic::Code)>,
    // The kernel.
    pub links: BTreeMap<String, Link>,
    /// Default routes of the pod that are not calix's (another network's): (v4, v6).
    pub foreign_default: (bool, bool),
    /// Source rules of secondary attachments in the pod's namespace: they outlive links.
    pub source_rules: Vec<IpAddr>,
    pub pod_sysctls: BTreeMap<String, String>,
    next_index: u32,
    // The agent.
    /// (handle, ifname) -> addresses.
    pub allocations: BTreeMap<(String, String), Vec<IpNet>>,
    /// (container ID, ifname) -> endpoint.
    pub endpoints: BTreeMap<(String, String), pb::Endpoint>,
    /// Free IPv6 addresses the agent has left (the v4 pool never runs out).
    pub free_v6: usize,
    next_host: u8,
    // A delegated IPAM plugin: container ID -> address.
    pub delegated: BTreeMap<String, IpNet>,
}

impl World {
    pub fn new() -> Rc<RefCell<World>> {
        Rc::new(RefCell::new(World {
            next_index: 10,
            free_v6: 100,
            next_host: 2,
            ..World::default()
        }))
    }

    /// Records `call`; fails when it is the call that was made to fail.
    fn enter(&mut self, call: String) -> Option<tonic::Code> {
        let failing = self
            .fail
            .as_ref()
            .filter(|(step, _)| call.split(' ').next() == Some(step.as_str()))
            .map(|(_, c)| *c);
        self.journal.push(call);
        if failing.is_some() {
            // One failure per run: a retry or a rollback of the same call succeeds.
            self.fail = None;
        }
        failing
    }

    /// What anything still holds: empty when nothing was left behind.
    pub fn leftovers(&self) -> Vec<String> {
        let mut out: Vec<String> = self.links.keys().map(|l| format!("link {l}")).collect();
        out.extend(self.source_rules.iter().map(|a| format!("rule from {a}")));
        out.extend(
            self.allocations
                .iter()
                .flat_map(|(k, v)| v.iter().map(move |a| format!("allocation {k:?} {a}"))),
        );
        out.extend(self.endpoints.keys().map(|k| format!("endpoint {k:?}")));
        out.extend(self.delegated.values().map(|a| format!("delegated {a}")));
        out
    }

    fn held(&self) -> impl Iterator<Item = &IpNet> {
        self.allocations
            .values()
            .flatten()
            .chain(self.delegated.values())
    }

    fn next_v4(&mut self) -> IpNet {
        self.next_host += 1;
        IpNet::from(IpAddr::V4(Ipv4Addr::new(10, 244, 0, self.next_host)))
    }
}

fn netlink_failure(call: &str) -> NetlinkError {
    NetlinkError::Netlink {
        op: "do (injected failure)",
        target: call.to_string(),
        source: rtnetlink::Error::RequestFailed,
    }
}

/// The fake kernel.
pub struct FakeKernel(pub Rc<RefCell<World>>);

impl FakeKernel {
    fn enter(&self, call: String) -> Result<std::cell::RefMut<'_, World>, NetlinkError> {
        let mut w = self.0.borrow_mut();
        match w.enter(call.clone()) {
            Some(_) => Err(netlink_failure(&call)),
            None => Ok(w),
        }
    }

    fn link_mut(w: &mut World, ifindex: u32) -> Result<&mut Link, NetlinkError> {
        w.links
            .values_mut()
            .find(|l| l.index == ifindex || l.pod_index == ifindex)
            .ok_or(NetlinkError::IndexNotFound { index: ifindex })
    }
}

impl Kernel for FakeKernel {
    async fn create_veth(
        &mut self,
        host_ifname: &str,
        pod_ifname: &str,
        _mtu: Option<u32>,
    ) -> Result<VethPair, NetlinkError> {
        let mut w = self.enter(format!("create_veth {host_ifname}"))?;
        if w.links.contains_key(host_ifname) {
            return Err(NetlinkError::Exists {
                name: host_ifname.to_string(),
            });
        }
        let index = w.next_index;
        w.next_index += 2;
        let pod_mac = [2, 0, 0, 0, 0, index as u8];
        w.links.insert(
            host_ifname.to_string(),
            Link {
                index,
                alias: None,
                pod_ifname: pod_ifname.to_string(),
                pod_index: index + 1,
                pod_mac,
                up: false,
                pod_addresses: Vec::new(),
                host_routes: Vec::new(),
            },
        );
        Ok(VethPair {
            host_ifindex: index,
            pod_ifindex: index + 1,
            pod_mac,
        })
    }

    async fn host_link(&mut self, name: &str) -> Result<Option<LinkDetails>, NetlinkError> {
        let w = self.enter(format!("host_link {name}"))?;
        Ok(w.links.get(name).map(|l| LinkDetails {
            index: l.index,
            name: name.to_string(),
            mac: Some(calix_kernel::pod::HOST_VETH_MAC),
            mtu: None,
            up: l.up,
            kind: Some("veth".into()),
            peer_index: Some(l.pod_index),
            alias: l.alias.clone(),
        }))
    }

    async fn delete_host_link(&mut self, name: &str) -> Result<bool, NetlinkError> {
        let mut w = self.enter(format!("delete_host_link {name}"))?;
        Ok(w.links.remove(name).is_some())
    }

    async fn set_host_alias(&mut self, ifindex: u32, alias: &str) -> Result<(), NetlinkError> {
        let mut w = self.enter(format!("set_host_alias {alias}"))?;
        Self::link_mut(&mut w, ifindex)?.alias = Some(alias.to_string());
        Ok(())
    }

    async fn set_pod_mac(&mut self, ifindex: u32, mac: [u8; 6]) -> Result<(), NetlinkError> {
        let mut w = self.enter("set_pod_mac".into())?;
        Self::link_mut(&mut w, ifindex)?.pod_mac = mac;
        Ok(())
    }

    async fn pod_has_default_route(&mut self, family: Family) -> Result<bool, NetlinkError> {
        let w = self.enter(format!("pod_has_default_route {family:?}"))?;
        let (v4, v6) = w.foreign_default;
        Ok(match family {
            Family::V4 => v4,
            Family::V6 => v6,
        })
    }

    async fn configure_pod(
        &mut self,
        ifindex: u32,
        v4: Option<Ipv4Addr>,
        v6: Option<Ipv6Addr>,
        routing: PodRouting,
        _mtu: Option<u32>,
    ) -> Result<(), NetlinkError> {
        let call = "configure_pod".to_string();
        let mut w = self.0.borrow_mut();
        let failing = w.enter(call.clone()).is_some();
        let secondary = routing != PodRouting::Main;
        // A failure comes after the IPv4 half when there are both, as in pod::configure_pod.
        let halves: Vec<IpAddr> = match (v4, v6, failing) {
            (Some(a), Some(_), true) => vec![a.into()],
            (_, _, true) => vec![],
            (a, b, false) => a
                .map(IpAddr::from)
                .into_iter()
                .chain(b.map(IpAddr::from))
                .collect(),
        };
        for a in halves {
            Self::link_mut(&mut w, ifindex)?.pod_addresses.push(a);
            if secondary {
                w.source_rules.push(a);
            }
        }
        if failing {
            return Err(netlink_failure(&call));
        }
        Ok(())
    }

    fn set_pod_sysctl(&mut self, path: &str, value: &str) -> Result<(), NetlinkError> {
        let mut w = self.enter(format!("set_pod_sysctl {path}"))?;
        w.pod_sysctls.insert(path.to_string(), value.to_string());
        Ok(())
    }

    async fn configure_host(
        &mut self,
        ifname: &str,
        ifindex: u32,
        v4: Option<Ipv4Addr>,
        v6: Option<Ipv6Addr>,
        _mtu: Option<u32>,
    ) -> Result<(), NetlinkError> {
        let mut w = self.enter(format!("configure_host {ifname}"))?;
        let link = Self::link_mut(&mut w, ifindex)?;
        link.up = true;
        link.host_routes
            .extend(v4.map(IpAddr::from).into_iter().chain(v6.map(IpAddr::from)));
        Ok(())
    }

    async fn wait_operational(
        &mut self,
        pod_ifindex: u32,
        host_ifindex: u32,
        _limit: std::time::Duration,
    ) -> Result<bool, NetlinkError> {
        let mut w = self.enter(format!("wait_operational {host_ifindex}"))?;
        let up = Self::link_mut(&mut w, host_ifindex)?.up;
        Ok(up && pod_ifindex != 0)
    }

    async fn forget_source_rules(&mut self, netns: &str, addrs: &[IpAddr]) {
        let mut w = self.0.borrow_mut();
        w.enter(format!("forget_source_rules {netns}"));
        w.source_rules.retain(|a| !addrs.contains(a));
    }
}

/// The fake agent.
pub struct FakeAgent(pub Rc<RefCell<World>>);

impl FakeAgent {
    fn enter(&self, call: &str) -> Result<std::cell::RefMut<'_, World>, Status> {
        let mut w = self.0.borrow_mut();
        match w.enter(call.to_string()) {
            Some(c) => Err(Status::new(c, format!("{call} failed (injected)"))),
            None => Ok(w),
        }
    }
}

fn release(w: &mut World, handle: &str, ifname: &str) -> Vec<IpNet> {
    let gone = w
        .allocations
        .remove(&(handle.to_string(), ifname.to_string()))
        .unwrap_or_default();
    w.free_v6 += gone.iter().filter(|a| a.addr().is_ipv6()).count();
    gone
}

impl Agent for FakeAgent {
    async fn allocate(&mut self, r: pb::AllocateRequest) -> Result<pb::AllocateResponse, Status> {
        let mut w = self.enter("allocate")?;
        let key = (r.handle.clone(), r.ifname.clone());
        let respond = |addresses: &[IpNet], already| pb::AllocateResponse {
            addresses: addresses
                .iter()
                .map(|a| pb::AllocatedAddress {
                    address: a.to_string(),
                    pool: String::new(),
                })
                .collect(),
            already_allocated: already,
            mtu: 0,
        };
        if let Some(held) = w.allocations.get(&key) {
            return Ok(respond(held, true));
        }
        let mut got = Vec::new();
        for wanted in &r.requested {
            let a: IpAddr = wanted
                .parse()
                .map_err(|_| Status::invalid_argument(format!("bad address {wanted}")))?;
            if w.held().any(|h| h.addr() == a) {
                return Err(Status::already_exists(format!(
                    "requested address {a} is already in use"
                )));
            }
            got.push(IpNet::from(a));
        }
        if got.is_empty() {
            if r.ipv4 {
                let a = w.next_v4();
                got.push(a);
            }
            if r.ipv6 {
                // All or nothing: no IPv6 address, no IPv4 address either.
                if w.free_v6 == 0 {
                    return Err(Status::resource_exhausted("no free IPv6 address"));
                }
                w.free_v6 -= 1;
                w.next_host += 1;
                let host = u16::from(w.next_host);
                got.push(IpNet::from(IpAddr::V6(Ipv6Addr::new(
                    0xfd00, 0, 0, 0, 0, 0, 0, host,
                ))));
            }
        }
        w.allocations.insert(key, got.clone());
        Ok(respond(&got, false))
    }

    async fn release(&mut self, r: pb::ReleaseRequest) -> Result<pb::ReleaseResponse, Status> {
        let mut w = self.enter("release")?;
        let n = release(&mut w, &r.handle, &r.ifname).len();
        Ok(pb::ReleaseResponse { released: n as u32 })
    }

    async fn lookup(&mut self, r: pb::LookupRequest) -> Result<pb::LookupResponse, Status> {
        let w = self.enter("lookup")?;
        let held = w.allocations.get(&(r.handle, r.ifname));
        Ok(pb::LookupResponse {
            addresses: held
                .into_iter()
                .flatten()
                .map(|a| pb::AllocatedAddress {
                    address: a.to_string(),
                    pool: String::new(),
                })
                .collect(),
        })
    }

    async fn register(&mut self, r: pb::RegisterRequest) -> Result<pb::RegisterResponse, Status> {
        let mut w = self.enter("register")?;
        let ep = r
            .endpoint
            .ok_or_else(|| Status::invalid_argument("no endpoint"))?;
        let host_ifindex = ep.host_ifindex;
        w.endpoints
            .insert((ep.container_id.clone(), ep.ifname.clone()), ep);
        Ok(pb::RegisterResponse {
            host_ifindex,
            bpf_attached: false,
        })
    }

    async fn unregister(
        &mut self,
        r: pb::UnregisterRequest,
    ) -> Result<pb::UnregisterResponse, Status> {
        let mut w = self.enter("unregister")?;
        let existed = w
            .endpoints
            .remove(&(r.container_id, r.ifname.clone()))
            .is_some();
        let released = if r.release_handle.is_empty() {
            Vec::new()
        } else {
            release(&mut w, &r.release_handle, &r.ifname)
        };
        Ok(pb::UnregisterResponse {
            existed,
            released: released.iter().map(|a| a.addr().to_string()).collect(),
        })
    }
}

/// A fake delegated IPAM plugin: one IPv4 address per container.
pub struct FakeDelegate(pub Rc<RefCell<World>>);

impl Delegate for FakeDelegate {
    fn call(
        &mut self,
        env: &CniEnv,
        plugin: &str,
        command: &str,
        _stdin: &[u8],
    ) -> Result<Option<Value>, CniError> {
        let mut w = self.0.borrow_mut();
        if w.enter(format!("delegate {command}")).is_some() {
            return Err(CniError::new(
                code::IO_FAILURE,
                format!("IPAM plugin {plugin} {command} failed (injected)"),
                "",
            ));
        }
        match command {
            "ADD" => {
                let a = match w.delegated.get(&env.container_id) {
                    Some(a) => *a,
                    None => {
                        let a = w.next_v4();
                        w.delegated.insert(env.container_id.clone(), a);
                        a
                    }
                };
                Ok(Some(
                    json!({"cniVersion": "1.0.0", "ips": [{"address": a.to_string()}]}),
                ))
            }
            "DEL" => {
                w.delegated.remove(&env.container_id);
                Ok(None)
            }
            _ => Ok(None),
        }
    }
}
