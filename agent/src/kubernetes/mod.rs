//! The agent in Kubernetes (`[datastore] type = "kubernetes"`): what it takes from the cluster
//! besides its own records. Everything is read through the store's read-only keys
//! (`datastore::kubernetes::views`), so each watch survives API server restarts, 410 Gone and
//! bookmarks the way the store's own do.
//!
//! - [`cluster`]: the config's part that comes from the cluster (IPPools, this node's Node,
//!   ServiceCIDRs);
//! - [`pods`]: the Pods bound to this node, and the cleanup of endpoints whose pod is gone;
//! - [`directory`]: the node's pod directory (who a pod is, what its annotations allow);
//! - [`podipam`]: a pod's IPAM annotations (pools, a fixed address; read by
//!   `calix_core::ipam::annotations`), read at its allocation;
//! - [`policy`]: NetworkPolicies, Pods and Namespaces read for the policy calculation;
//! - [`services`]: Services and EndpointSlices read for the Services calculation (issue 24);
//! - [`peers`]: route distribution's peers from the Node objects;
//! - [`events`]: Kubernetes Events for what an operator must see;
//! - [`owner`]: the agent's DaemonSet: is a stop a restart or an uninstall;
//! - [`source`]: a value followed from the store;
//! - [`fan_in`]: several followers read into one stream of changes;
//! - [`certificates`]: this node's route-distribution certificate, asked of the API server
//!   (a CertificateSigningRequest) and renewed, and the CA bundle from its ConfigMap (with
//!   any datastore: read with the agent's own client, not the store).
pub mod certificates;
pub mod cluster;
pub mod directory;
pub mod events;
pub mod fan_in;
pub mod owner;
pub mod peers;
pub mod podipam;
pub mod pods;
pub mod policy;
pub mod services;
pub mod source;

/// Environment variables that name the node, in order (a DaemonSet sets one from the downward
/// API: `valueFrom: {fieldRef: {fieldPath: spec.nodeName}}`).
pub const NODE_NAME_ENV: [&str; 2] = ["CALIX_NODE_NAME", "NODE_NAME"];

/// This node's name: `--node-name`, else the first of [`NODE_NAME_ENV`] that is set and not
/// empty, else the config's `node_name`, else the host name.
pub fn node_name(
    flag: Option<String>,
    env: impl Fn(&str) -> Option<String>,
    configured: &str,
    hostname: impl FnOnce() -> Option<String>,
) -> String {
    let set = |v: &String| !v.trim().is_empty();
    flag.filter(set)
        .or_else(|| NODE_NAME_ENV.iter().find_map(|k| env(k).filter(set)))
        .or_else(|| Some(configured.to_string()).filter(set))
        .or_else(hostname)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_name_comes_from_the_flag_then_the_downward_api_then_the_config() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let host = || Some("host".to_string());
        let both = env(&[("CALIX_NODE_NAME", "a"), ("NODE_NAME", "b")]);
        assert_eq!(node_name(Some("f".into()), both, "c", host), "f");
        assert_eq!(node_name(None, both, "c", host), "a");
        assert_eq!(node_name(None, env(&[("NODE_NAME", "b")]), "c", host), "b");
        assert_eq!(
            node_name(None, env(&[("CALIX_NODE_NAME", "")]), "c", host),
            "c"
        );
        assert_eq!(node_name(None, env(&[]), "", host), "host");
        assert_eq!(node_name(None, env(&[]), "", || None), "");
    }
}
