//! Taking calix off a node: `calix-agent --uninstall [--all]`, and what an agent does when it
//! stops because its DaemonSet was deleted (`crate::kubernetes::owner`).
//!
//! - Always: the eBPF programs off every `cali*` interface and the uplinks, XDP off the
//!   uplinks, the node's pins, both modes' nftables tables (`calix_dataplane::uninstall`),
//!   and calix's VXLAN devices (with the routes through them).
//! - [`Scope::all`]: also every route calix added (protocol
//!   [`netlink::ROUTE_PROTO`]: pods' host routes, routes to other nodes' blocks)
//!   and the CNI network config ([`Scope::cni_conf`]) when it is calix's (the same check as
//!   `calix-install-cni --uninstall`: another network's file of that name stays), so the
//!   runtime stops calling calix.
//!   Pods still running lose their network: uninstalling a CNI means their sandboxes must be
//!   recreated by the next one.
use std::path::PathBuf;

use calix_kernel::netlink;

use calix_install_cni::Removal;

use calix_dataplane::{self, ebpf::EbpfConfig};

/// What to remove besides the dataplane.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// Every route of calix's protocol, in the main table.
    pub all: bool,
    /// The conflist calix's install-cni wrote (removed when `all`, and only if it is calix's).
    pub cni_conf: Option<PathBuf>,
}

/// What was removed.
#[derive(Debug, Default)]
pub struct Removed {
    pub interfaces: usize,
    pub vxlan: Vec<&'static str>,
    pub routes: usize,
    pub cni_conf: bool,
    /// A file at the conflist's path that is not calix's, left alone.
    pub cni_conf_not_ours: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error(transparent)]
    Dataplane(#[from] calix_dataplane::DataplaneError),
    #[error(transparent)]
    Netlink(#[from] netlink::NetlinkError),
    #[error(transparent)]
    Netns(#[from] calix_kernel::netns::NetnsError),
    #[error("cannot remove the CNI config {path}")]
    CniConf {
        path: PathBuf,
        #[source]
        source: calix_install_cni::InstallError,
    },
}

/// Removes calix from this node (this network namespace) as `scope` says.
pub async fn node(cfg: &EbpfConfig, scope: &Scope) -> Result<Removed, UninstallError> {
    let mut removed = Removed::default();
    // The config first: from now on the runtime starts no pod through calix.
    if scope.all {
        if let Some(path) = &scope.cni_conf {
            let (dir, name) = split_conf(path);
            match calix_install_cni::uninstall(dir, name) {
                Ok(Removal::Removed) => removed.cni_conf = true,
                Ok(Removal::Absent) => {}
                Ok(Removal::NotOurs) => {
                    removed.cni_conf_not_ours = true;
                    tracing::warn!(path = %path.display(), "the CNI config is not calix's (its first plugin is not calix): left as it is");
                }
                Err(source) => {
                    return Err(UninstallError::CniConf {
                        path: path.clone(),
                        source,
                    })
                }
            }
        }
    }
    removed.interfaces = calix_dataplane::uninstall(cfg)?;
    let handle = calix_kernel::netns::netlink_here().await?;
    removed.vxlan = calix_kernel::vxlan::delete_all(&handle).await?;
    if scope.all {
        removed.routes = netlink::delete_all_calix_routes(&handle).await?;
    }
    tracing::info!(interfaces = removed.interfaces, vxlan = ?removed.vxlan, routes = removed.routes,
        cni_conf = removed.cni_conf, cni_conf_not_ours = removed.cni_conf_not_ours, all = scope.all, "calix uninstalled from this node");
    Ok(removed)
}

/// A conflist path as its directory and file name (`calix-install-cni`'s terms).
fn split_conf(path: &std::path::Path) -> (&std::path::Path, &str) {
    let dir = path.parent().unwrap_or_else(|| std::path::Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    (dir, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conf_path_splits_into_its_dir_and_file_name() {
        assert_eq!(
            split_conf(std::path::Path::new(
                "/host/etc/cni/net.d/10-calix.conflist"
            )),
            (
                std::path::Path::new("/host/etc/cni/net.d"),
                "10-calix.conflist"
            )
        );
        assert_eq!(
            split_conf(std::path::Path::new("10-calix.conflist")),
            (std::path::Path::new(""), "10-calix.conflist")
        );
    }
}
