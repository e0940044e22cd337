//! The key layout, in one place. Every key is relative to the backend's root (etcd: a
//! configurable prefix, default `/calix/`).
//!
//! | key | value |
//! |---|---|
//! | `ipam/blocks/<block>` | [`crate::ipam::Block`]: its affine node and its allocations |
//! | `ipam/handles/<handle>/<ifname>` | [`crate::ipam::HandleRecord`]: the addresses it holds |
//! | `nodes/<node>` | [`crate::model::NodeRecord`] |
//! | `endpoints/<node>/<containerID>/<ifname>` | [`crate::model::EndpointRecord`] |
//!
//! A block's key is its CIDR with `/` written `-` (`10.244.0.64-26`, `fd00--40-122`).
use ipnet::IpNet;

pub const BLOCKS: &str = "ipam/blocks/";
pub const HANDLES: &str = "ipam/handles/";
pub const NODES: &str = "nodes/";
pub const ENDPOINTS: &str = "endpoints/";

pub fn block(cidr: &IpNet) -> String {
    format!("{BLOCKS}{}", cidr.to_string().replace(['/', ':'], "-"))
}

pub fn handle(handle: &str, ifname: &str) -> String {
    format!("{HANDLES}{handle}/{ifname}")
}

pub fn node(name: &str) -> String {
    format!("{NODES}{name}")
}

pub fn endpoints_of(node: &str) -> String {
    format!("{ENDPOINTS}{node}/")
}

pub fn endpoint(node: &str, container_id: &str, ifname: &str) -> String {
    format!("{ENDPOINTS}{node}/{container_id}/{ifname}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_keys_are_flat_and_distinct() {
        let a = block(&"10.244.0.64/26".parse().expect("cidr"));
        let b = block(&"fd00::40/122".parse().expect("cidr"));
        assert_eq!(a, "ipam/blocks/10.244.0.64-26");
        assert_eq!(b, "ipam/blocks/fd00--40-122");
        assert_eq!(a.matches('/').count(), 2);
        assert_eq!(b.matches('/').count(), 2);
    }
}
