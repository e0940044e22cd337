//! The CNI verbs, one file each.
pub mod add;
pub mod check;
pub mod del;
pub mod gc;
pub mod status;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

use crate::args::CniEnv;
use crate::config::NetConf;
use crate::error::{code, CniError};
use crate::kernel::Kernel;

/// One invocation: the environment, the parsed config and the raw stdin (for delegation).
pub struct Invocation<'a> {
    pub env: &'a CniEnv,
    pub conf: &'a NetConf,
    pub raw: &'a [u8],
}

/// Deletes host link `name` only if its alias says `owner` owns it. Returns whether it was
/// deleted; a missing link, or one owned by another attachment, is left alone (and logged).
pub(crate) async fn delete_owned_link(
    kernel: &mut impl Kernel,
    name: &str,
    owner: &str,
) -> Result<bool, calix_kernel::netlink::NetlinkError> {
    match kernel.host_link(name).await? {
        None => Ok(false),
        Some(l) if l.alias.as_deref() == Some(owner) => kernel.delete_host_link(name).await,
        Some(l) => {
            tracing::warn!(
                %name,
                alias = l.alias.as_deref().unwrap_or(""),
                %owner,
                "not deleting a link that belongs to another attachment"
            );
            Ok(false)
        }
    }
}

/// Opens the container's network namespace; failing that is a bad environment (code 4), and
/// so is a "container" namespace that is the node's own (the plugin's): a pod interface there
/// would be a second interface of the node, outside every guarantee calix gives.
pub(crate) fn open_pod_ns(env: &CniEnv) -> Result<calix_kernel::netns::NetNs, CniError> {
    let bad = |msg: String, e: &dyn std::fmt::Display| {
        CniError::new(code::INVALID_ENV, msg, e.to_string())
    };
    let ns = calix_kernel::netns::NetNs::open(&env.netns).map_err(|e| {
        bad(
            format!(
                "cannot open the container's network namespace {}",
                env.netns
            ),
            &e,
        )
    })?;
    let own = calix_kernel::netns::NetNs::current()
        .and_then(|own| ns.is_same(&own))
        .map_err(|e| bad("cannot compare network namespaces".into(), &e))?;
    if own {
        return Err(CniError::new(
            code::INVALID_ENV,
            format!(
                "CNI_NETNS {} is the node's own network namespace, not a container's",
                env.netns
            ),
            "pass the path of the container's network namespace",
        ));
    }
    Ok(ns)
}

/// A wiring failure with the whole error chain in `details`.
pub(crate) fn wiring(msg: String, e: &dyn std::error::Error) -> CniError {
    CniError::new(code::WIRING_FAILED, msg, calix_log::error_chain(e))
}
