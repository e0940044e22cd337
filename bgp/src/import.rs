//! The import rule: which routes a peer announces are installed. The default (issue 23) is
//! the pools' prefixes: a route is taken when it lies inside one of them (a block, or a
//! borrowed /32 or /128), never one that covers more than a pool, never a default route, and
//! never one of this node's own prefixes (a peer cannot take this node's pods away from it).
use ipnet::IpNet;

/// Prefixes a route must lie within, and prefixes it must not touch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportRule {
    /// The pools' CIDRs.
    pub within: Vec<IpNet>,
    /// This node's own prefixes (its blocks, its pods' addresses).
    pub own: Vec<IpNet>,
}

impl ImportRule {
    /// Whether a route to `prefix` is taken.
    pub fn accepts(&self, prefix: &IpNet) -> bool {
        self.within.iter().any(|p| p.contains(prefix))
            && !self
                .own
                .iter()
                .any(|o| o.contains(prefix) || prefix.contains(o))
    }
}
