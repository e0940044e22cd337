//! The veth pair of a pod attachment, made in one request with the peer born in the pod's
//! namespace.
use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use futures::TryStreamExt;

use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkInfo, LinkMessage,
};
use rtnetlink::{Handle, MulticastGroup};

use super::HOST_VETH_MAC;
use crate::netlink::{
    delete_link, errno, link_details, link_index, netlink_err, validate_ifname, NetlinkError,
};
use crate::netns::{self, NetNs, NetlinkEvents, NetnsError};

/// The two ends of a freshly created veth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VethPair {
    /// Index of the host side, in the caller's namespace.
    pub host_ifindex: u32,
    /// Index of the pod side, in the pod's namespace.
    pub pod_ifindex: u32,
    /// MAC of the pod side (the CNI result reports it).
    pub pod_mac: [u8; 6],
}

/// Creates the veth in ONE `RTM_NEWLINK` request (NLM_F_CREATE|NLM_F_EXCL): the host side
/// `host_ifname` in `host`'s namespace with MAC [`HOST_VETH_MAC`], the peer `pod_ifname` born
/// directly in `pod_ns` (never moved: moving links between namespaces serialises concurrent
/// ADDs in the kernel). `mtu`, when given, is set on both sides. A taken name is
/// [`NetlinkError::Exists`]; nothing is reused. Both sides are left down.
///
/// While the pod side has never been up, this also sets its `accept_dad=0` (written from inside
/// `pod_ns`), so none of its IPv6 addresses, link-local included, ever waits for DAD: the only
/// other node on the link is the host side, whose MAC is fixed and different. Skipped when the
/// kernel has no IPv6. If anything after the RTM_NEWLINK fails, the veth is deleted again.
pub async fn create_veth(
    host: &Handle,
    pod_ns: &NetNs,
    host_ifname: &str,
    pod_ifname: &str,
    mtu: Option<u32>,
) -> Result<VethPair, NetlinkError> {
    create_veth_with_handle(host, pod_ns, host_ifname, pod_ifname, mtu)
        .await
        .map(|(pair, _pod)| pair)
}

/// A netlink connection in a pod's namespace that hears its links change (for
/// [`wait_operational`]).
pub struct PodNetlink {
    pub handle: Handle,
    /// The pod namespace's link changes since the connection was made.
    pub links: NetlinkEvents,
}

/// [`create_veth`], also returning a netlink connection in `pod_ns` (for
/// [`configure_pod`](super::configure_pod) and [`wait_operational`]): made on the thread that
/// turned DAD off, so an ADD enters the pod's namespace once.
pub async fn create_veth_with_handle(
    host: &Handle,
    pod_ns: &NetNs,
    host_ifname: &str,
    pod_ifname: &str,
    mtu: Option<u32>,
) -> Result<(VethPair, PodNetlink), NetlinkError> {
    validate_ifname(host_ifname)?;
    validate_ifname(pod_ifname)?;

    let mut peer = LinkMessage::default();
    peer.attributes
        .push(LinkAttribute::IfName(pod_ifname.to_string()));
    // The fd is only read while the request is sent; `pod_ns` outlives this function.
    peer.attributes
        .push(LinkAttribute::NetNsFd(pod_ns.as_raw_fd()));
    let mut message = LinkMessage::default();
    message
        .attributes
        .push(LinkAttribute::IfName(host_ifname.to_string()));
    message
        .attributes
        .push(LinkAttribute::Address(HOST_VETH_MAC.to_vec()));
    if let Some(mtu) = mtu {
        peer.attributes.push(LinkAttribute::Mtu(mtu));
        message.attributes.push(LinkAttribute::Mtu(mtu));
    }
    message.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Veth),
        LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
    ]));

    // `add` sends NLM_F_REQUEST|NLM_F_ACK|NLM_F_CREATE|NLM_F_EXCL.
    if let Err(source) = host.link().add(message).execute().await {
        if errno(&source) == Some(libc::EEXIST) {
            // The request is atomic: nothing was created. Say which name clashed.
            let name = if link_index(host, host_ifname).await?.is_some() {
                host_ifname
            } else {
                pod_ifname
            };
            return Err(NetlinkError::Exists {
                name: name.to_string(),
            });
        }
        return Err(NetlinkError::Netlink {
            op: "create veth",
            target: format!(
                "{host_ifname} <-> {pod_ifname} in {}",
                pod_ns.path().display()
            ),
            source,
        });
    }

    match finish_pod_side(host, pod_ns, host_ifname, pod_ifname).await {
        Ok(pair) => Ok(pair),
        Err(e) => {
            // We created it (EXCL succeeded), so we remove it again.
            if let Err(cleanup) = delete_link(host, host_ifname).await {
                tracing::warn!(
                    link = host_ifname,
                    error = %cleanup,
                    "cannot remove the veth after a failed create"
                );
            }
            Err(e)
        }
    }
}

async fn finish_pod_side(
    host: &Handle,
    pod_ns: &NetNs,
    host_ifname: &str,
    pod_ifname: &str,
) -> Result<(VethPair, PodNetlink), NetlinkError> {
    // One thread in the pod's namespace: DAD off, then the netlink socket (hearing the links:
    // the pod's namespace has few, and they change only while the plugin wires them).
    let path = format!("/proc/sys/net/ipv6/conf/{pod_ifname}/accept_dad");
    let (pod, links, dad) =
        netns::netlink_hearing_in_with(pod_ns, &[MulticastGroup::Link], move || {
            netns::write_sysctl(&path, "0")
        })
        .await?;
    match dad {
        Ok(()) => {}
        // No IPv6 in this kernel (ipv6.disable=1): nothing to disable.
        Err(NetnsError::WriteSysctl { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
        }
        Err(e) => return Err(e.into()),
    }
    let host_ifindex =
        link_index(host, host_ifname)
            .await?
            .ok_or_else(|| NetlinkError::LinkNotFound {
                name: host_ifname.to_string(),
            })?;
    let pod_link =
        link_details(&pod, pod_ifname)
            .await?
            .ok_or_else(|| NetlinkError::LinkNotFound {
                name: pod_ifname.to_string(),
            })?;
    let pod_mac = pod_link.mac.ok_or_else(|| NetlinkError::BadMac {
        name: pod_ifname.to_string(),
        address: Vec::new(),
    })?;
    Ok((
        VethPair {
            host_ifindex,
            pod_ifindex: pod_link.index,
            pod_mac,
        },
        PodNetlink { handle: pod, links },
    ))
}

/// How long [`wait_operational`] waits for the kernel to take a new veth into service.
pub const OPERATIONAL_WITHIN: Duration = Duration::from_secs(2);

/// Waits until both ends of a new veth are operational (`IFLA_OPERSTATE` up), at most
/// `limit`; returns whether they are. Bringing the second end up gives both their carrier,
/// but the end brought up first starts transmitting only once the kernel's link watch (a
/// deferred work item that needs the RTNL lock) has run for it: until then its queue is the
/// noop qdisc, which drops every packet (`QDISC_DROP`). The link watch sets the operational
/// state just before it starts the queue. Returning from ADD before then let the pod drop its
/// first ARP reply to the node on a busy machine, and the node asked again only a second
/// later (`retrans_time_ms`): a new pod unreachable for a second (issue 20, item 9).
///
/// The pod's end (brought up first) is waited for on its namespace's link changes
/// (`pod.links`), not by polling: twenty ADDs at once polling every millisecond took a CPU's
/// worth from the ADDs that hold the lock the link watch needs. The host's end, up last and
/// served by the same run of the link watch, is then read, and polled only if it lags.
pub async fn wait_operational(
    pod: &mut PodNetlink,
    pod_ifindex: u32,
    host: &Handle,
    host_ifindex: u32,
    limit: Duration,
) -> Result<bool, NetlinkError> {
    use futures::StreamExt;
    let deadline = Instant::now() + limit;
    loop {
        // What was heard before the read below is older than it: drop it.
        while pod.links.try_recv().is_ok() {}
        if operational(&pod.handle, pod_ifindex).await? {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        // Any change of a link there is worth a read. A bounded wait all the same: a
        // notification the socket had no room for is lost.
        match tokio::time::timeout(left.min(HEARD_OR_READ), pod.links.next()).await {
            Ok(Some(_)) | Err(_) => {}
            // The connection is gone: no more notifications, read at intervals.
            Ok(None) => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    let mut pause = Duration::from_millis(1);
    loop {
        if operational(host, host_ifindex).await? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(HEARD_OR_READ);
    }
}

/// The longest [`wait_operational`] goes without reading a link's state.
const HEARD_OR_READ: Duration = Duration::from_millis(20);

/// Whether link `index` is operationally up.
async fn operational(handle: &Handle, index: u32) -> Result<bool, NetlinkError> {
    use netlink_packet_route::link::State;
    let message = handle
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
        .map_err(netlink_err("get link", format!("interface {index}")))?;
    Ok(message.is_some_and(|m| {
        m.attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::OperState(State::Up)))
    }))
}
