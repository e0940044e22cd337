//! Taking calix off a node: `calix-agent --uninstall [--all]`, and what an agent does when it
//! stops because its DaemonSet was deleted (`crate::k8s::owner`).
//!
//! - Always: the eBPF programs off every `cali*` interface and the uplinks, XDP off the
//!   uplinks, the node's pins, both modes' nftables tables (`crate::dataplane::uninstall`),
//!   and calix's VXLAN devices (with the routes through them).
//! - [`Scope::all`]: also every route calix added (protocol
//!   [`netlink::ROUTE_PROTO`]: pods' host routes, routes to other nodes' blocks)
//!   and the CNI network config ([`Scope::cni_conf`]), so the runtime stops calling calix.
//!   Pods still running lose their network: uninstalling a CNI means their sandboxes must be
//!   recreated by the next one.
use std::path::PathBuf;

use calix_kernel::netlink;

use crate::dataplane::{self, ebpf::EbpfConfig};

/// What to remove besides the dataplane.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// Every route of calix's protocol, in the main table.
    pub all: bool,
    /// The conflist calix's install-cni wrote (removed when `all`).
    pub cni_conf: Option<PathBuf>,
}

/// What was removed.
#[derive(Debug, Default)]
pub struct Removed {
    pub interfaces: usize,
    pub vxlan: Vec<&'static str>,
    pub routes: usize,
    pub cni_conf: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error(transparent)]
    Dataplane(#[from] dataplane::DataplaneError),
    #[error(transparent)]
    Netlink(#[from] netlink::NetlinkError),
    #[error(transparent)]
    Netns(#[from] calix_kernel::netns::NetnsError),
    #[error("cannot remove the CNI config {path}")]
    CniConf {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Removes calix from this node (this network namespace) as `scope` says.
pub async fn node(cfg: &EbpfConfig, scope: &Scope) -> Result<Removed, UninstallError> {
    let mut removed = Removed::default();
    // The config first: from now on the runtime starts no pod through calix.
    if scope.all {
        if let Some(path) = &scope.cni_conf {
            removed.cni_conf = match std::fs::remove_file(path) {
                Ok(()) => true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                Err(source) => {
                    return Err(UninstallError::CniConf {
                        path: path.clone(),
                        source,
                    })
                }
            };
        }
    }
    removed.interfaces = dataplane::uninstall(cfg)?;
    let handle = calix_kernel::netns::netlink_here().await?;
    removed.vxlan = calix_kernel::vxlan::delete_all(&handle).await?;
    if scope.all {
        removed.routes = netlink::delete_all_calix_routes(&handle).await?;
    }
    tracing::info!(interfaces = removed.interfaces, vxlan = ?removed.vxlan, routes = removed.routes,
        cni_conf = removed.cni_conf, all = scope.all, "calix uninstalled from this node");
    Ok(removed)
}
