//! The kernel side of an attachment, as the verbs use it: [`Kernel`], one method per side
//! effect, so ADD's sequence and its rollback, and DEL, are unit-tested against a fake.
//! [`NodeKernel`] is the real one: calix-kernel's netlink, namespaces and sysctls, called
//! exactly as the verbs called them before the seam.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use calix_kernel::netlink::{self, Family, LinkDetails, NetlinkError};
use calix_kernel::netns::{self, NetNs, NetnsError};
use calix_kernel::pod::{self, PodNetlink, PodRouting, VethPair};
use rtnetlink::Handle;

/// What the verbs do to the node's and the pod's network namespaces. "Host" acts in the node's
/// namespace; "pod" in the container's, the one the veth's peer was created in.
///
/// `async fn` in a public trait cannot promise `Send` futures; the plugin runs on a
/// current-thread runtime and never needs them to be.
#[allow(async_fn_in_trait)]
pub trait Kernel {
    /// [`pod::create_veth`]: the host side `host_ifname` here, the peer `pod_ifname` born in
    /// the pod's namespace. A taken name is [`NetlinkError::Exists`] and creates nothing.
    async fn create_veth(
        &mut self,
        host_ifname: &str,
        pod_ifname: &str,
        mtu: Option<u32>,
    ) -> Result<VethPair, NetlinkError>;
    /// The host link `name`, if there is one.
    async fn host_link(&mut self, name: &str) -> Result<Option<LinkDetails>, NetlinkError>;
    /// Deletes the host link `name` (its peer and every route through it go with it); whether
    /// there was one.
    async fn delete_host_link(&mut self, name: &str) -> Result<bool, NetlinkError>;
    /// Sets the alias of host link `ifindex` (its owner mark, [`pod::owner_alias`]).
    async fn set_host_alias(&mut self, ifindex: u32, alias: &str) -> Result<(), NetlinkError>;
    /// Sets the MAC of the pod's interface `ifindex`.
    async fn set_pod_mac(&mut self, ifindex: u32, mac: [u8; 6]) -> Result<(), NetlinkError>;
    /// [`pod::has_default_route`] in the pod's namespace.
    async fn pod_has_default_route(&mut self, family: Family) -> Result<bool, NetlinkError>;
    /// [`pod::configure_pod`].
    async fn configure_pod(
        &mut self,
        ifindex: u32,
        v4: Option<Ipv4Addr>,
        v6: Option<Ipv6Addr>,
        routing: PodRouting,
        mtu: Option<u32>,
    ) -> Result<(), NetlinkError>;
    /// Writes sysctl `path` (a /proc/sys file) in the pod's namespace.
    fn set_pod_sysctl(&mut self, path: &str, value: &str) -> Result<(), NetlinkError>;
    /// [`pod::configure_host`].
    async fn configure_host(
        &mut self,
        ifname: &str,
        ifindex: u32,
        v4: Option<Ipv4Addr>,
        v6: Option<Ipv6Addr>,
        mtu: Option<u32>,
    ) -> Result<(), NetlinkError>;
    /// [`pod::wait_operational`]: whether both ends of the veth carry traffic within `limit`.
    async fn wait_operational(
        &mut self,
        pod_ifindex: u32,
        host_ifindex: u32,
        limit: std::time::Duration,
    ) -> Result<bool, NetlinkError>;
    /// Removes calix's source rules for `addrs` (of a secondary attachment,
    /// [`PodRouting::Secondary`]) in the namespace at `netns`. Best effort, failures logged:
    /// a namespace that is gone took its rules with it.
    async fn forget_source_rules(&mut self, netns: &str, addrs: &[IpAddr]);
}

/// The real [`Kernel`]: a netlink handle in the node's namespace, and the pod's namespace.
pub struct NodeKernel {
    host: Handle,
    /// The pod's namespace, when the verb opened it (ADD does, DEL need not).
    pod_ns: Option<NetNs>,
    /// A netlink connection in `pod_ns`: the one [`pod::create_veth_with_handle`] made on the
    /// thread that turned DAD off (hearing the pod's links), so an ADD enters the pod's
    /// namespace once; else opened when first needed (hearing nothing).
    pod: Option<PodNetlink>,
}

impl NodeKernel {
    pub fn new(host: Handle, pod_ns: Option<NetNs>) -> Self {
        Self {
            host,
            pod_ns,
            pod: None,
        }
    }

    fn pod_ns(&self) -> Result<&NetNs, NetlinkError> {
        self.pod_ns.as_ref().ok_or_else(|| {
            NetlinkError::Netns(NetnsError::NotFound {
                path: "(the pod's network namespace was not opened)".into(),
            })
        })
    }

    async fn pod(&mut self) -> Result<&mut PodNetlink, NetlinkError> {
        let pod = match self.pod.take() {
            Some(pod) => pod,
            None => {
                let (handle, links, ()) =
                    netns::netlink_hearing_in_with(self.pod_ns()?, &[], || ()).await?;
                PodNetlink { handle, links }
            }
        };
        Ok(self.pod.insert(pod))
    }
}

impl Kernel for NodeKernel {
    async fn create_veth(
        &mut self,
        host_ifname: &str,
        pod_ifname: &str,
        mtu: Option<u32>,
    ) -> Result<VethPair, NetlinkError> {
        let pod_ns = self.pod_ns()?;
        let (pair, pod) =
            pod::create_veth_with_handle(&self.host, pod_ns, host_ifname, pod_ifname, mtu).await?;
        self.pod = Some(pod);
        Ok(pair)
    }

    async fn host_link(&mut self, name: &str) -> Result<Option<LinkDetails>, NetlinkError> {
        netlink::link_details(&self.host, name).await
    }

    async fn delete_host_link(&mut self, name: &str) -> Result<bool, NetlinkError> {
        netlink::delete_link(&self.host, name).await
    }

    async fn set_host_alias(&mut self, ifindex: u32, alias: &str) -> Result<(), NetlinkError> {
        netlink::set_alias(&self.host, ifindex, alias).await
    }

    async fn set_pod_mac(&mut self, ifindex: u32, mac: [u8; 6]) -> Result<(), NetlinkError> {
        netlink::set_mac(&self.pod().await?.handle, ifindex, mac).await
    }

    async fn pod_has_default_route(&mut self, family: Family) -> Result<bool, NetlinkError> {
        pod::has_default_route(&self.pod().await?.handle, family).await
    }

    async fn configure_pod(
        &mut self,
        ifindex: u32,
        v4: Option<Ipv4Addr>,
        v6: Option<Ipv6Addr>,
        routing: PodRouting,
        mtu: Option<u32>,
    ) -> Result<(), NetlinkError> {
        pod::configure_pod(&self.pod().await?.handle, ifindex, v4, v6, routing, mtu).await
    }

    fn set_pod_sysctl(&mut self, path: &str, value: &str) -> Result<(), NetlinkError> {
        Ok(netns::write_sysctl_in(self.pod_ns()?, path, value)?)
    }

    async fn configure_host(
        &mut self,
        ifname: &str,
        ifindex: u32,
        v4: Option<Ipv4Addr>,
        v6: Option<Ipv6Addr>,
        mtu: Option<u32>,
    ) -> Result<(), NetlinkError> {
        pod::configure_host(&self.host, ifname, ifindex, v4, v6, mtu).await
    }

    async fn wait_operational(
        &mut self,
        pod_ifindex: u32,
        host_ifindex: u32,
        limit: std::time::Duration,
    ) -> Result<bool, NetlinkError> {
        let host = self.host.clone();
        pod::wait_operational(self.pod().await?, pod_ifindex, &host, host_ifindex, limit).await
    }

    async fn forget_source_rules(&mut self, netns: &str, addrs: &[IpAddr]) {
        if self.pod_ns.is_none() {
            match NetNs::open(netns) {
                Ok(ns) => self.pod_ns = Some(ns),
                Err(_) => return,
            }
        }
        match self.pod().await {
            Ok(pod) => {
                if let Err(e) = pod::delete_source_rules(&pod.handle, addrs).await {
                    tracing::warn!(error = %calix_log::ErrorChain(&e), "cannot remove the attachment's source rules");
                }
            }
            Err(e) => {
                tracing::warn!(error = %calix_log::ErrorChain(&e), "cannot enter the pod to remove its source rules")
            }
        }
    }
}
