//! The key layout, in one place. Every key is relative to the backend's root (etcd: a
//! configurable prefix, default `/calix/`).
//!
//! | key | value |
//! |---|---|
//! | `ipam/blocks/<block>` | [`crate::ipam::Block`]: its affine node and its allocations; the truth, and the one object an IPAM write commits. A released block stays, affine to nobody, with its next sequence number |
//! | `ipam/retired/<block>` | [`crate::ipam::Retired`]: written by the previous version when it released a block; read, and folded into a released block object |
//! | `ipam/affinities/<node>/<block>` | [`crate::ipam::AffinityRecord`]: block `<block>` is affine to `<node>`; an index that follows the blocks (a node's blocks listed without reading every block) and is repaired from them |
//! | `ipam/handles/<handle>/<ifname>` | [`crate::ipam::HandleRecord`]: the addresses it holds; an index that follows the blocks and is repaired from them |
//! | `nodes/<node>` | [`crate::model::NodeRecord`] |
//! | `endpoints/<node>/<containerID>/<ifname>` | [`crate::model::EndpointRecord`] |
//!
//! A block's key is its CIDR with `/` written `-` (`10.244.0.64-26`, `fd00--40-122`). A handle
//! is `calix_proto::handle`'s `<network>:<containerID>` (no `/`; the agent refuses handles and
//! ifnames with one), so `<handle>/<ifname>` splits at the last `/`.
use ipnet::IpNet;

pub const BLOCKS: &str = "ipam/blocks/";
pub const RETIRED: &str = "ipam/retired/";
pub const HANDLES: &str = "ipam/handles/";
pub const AFFINITIES: &str = "ipam/affinities/";
pub const NODES: &str = "nodes/";
pub const ENDPOINTS: &str = "endpoints/";

pub fn block(cidr: &IpNet) -> String {
    format!("{BLOCKS}{}", flat(cidr))
}

/// What is left of block `cidr` once released to its pool.
pub fn retired(cidr: &IpNet) -> String {
    format!("{RETIRED}{}", flat(cidr))
}

/// The CIDR whose block key `key` is (the inverse of [`block`]): `None` for any other key,
/// and for one that is not exactly how [`block`] writes its CIDR.
pub fn block_cidr(key: &str) -> Option<IpNet> {
    let (address, len) = key.strip_prefix(BLOCKS)?.rsplit_once('-')?;
    let cidr = IpNet::new(address.replace('-', ":").parse().ok()?, len.parse().ok()?).ok()?;
    (block(&cidr) == key).then_some(cidr)
}

fn flat(cidr: &IpNet) -> String {
    cidr.to_string().replace(['/', ':'], "-")
}

/// The affinity record of block `cidr` to `node`.
pub fn affinity(node: &str, cidr: &IpNet) -> String {
    format!("{AFFINITIES}{node}/{}", flat(cidr))
}

/// The prefix of `node`'s affinity records.
pub fn affinities_of(node: &str) -> String {
    format!("{AFFINITIES}{node}/")
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
    fn a_block_key_gives_back_its_cidr_and_nothing_else_does() {
        for cidr in [
            "10.244.0.64/26",
            "fd00::40/122",
            "0.0.0.0/0",
            "::/0",
            "10.0.0.1/32",
        ] {
            let cidr: IpNet = cidr.parse().expect("cidr");
            assert_eq!(block_cidr(&block(&cidr)), Some(cidr), "{cidr}");
        }
        for key in [
            "ipam/blocks/10.244.0.64",
            "ipam/blocks/10.244.0.64-33",
            "ipam/blocks/010.244.0.64-26",
            "ipam/blocks/10.244.0.64-026",
            "ipam/blocks/fd00:0:0:0:0:0:0:40-122",
            "ipam/blocks/10.244.0.64-26-",
            "ipam/retired/10.244.0.64-26",
            "nodes/10.244.0.64-26",
            "ipam/blocks/",
        ] {
            assert_eq!(block_cidr(key), None, "{key}");
        }
    }

    #[test]
    fn block_keys_are_flat_and_distinct() {
        let a = block(&"10.244.0.64/26".parse().expect("cidr"));
        let b = block(&"fd00::40/122".parse().expect("cidr"));
        assert_eq!(a, "ipam/blocks/10.244.0.64-26");
        assert_eq!(b, "ipam/blocks/fd00--40-122");
        assert_eq!(a.matches('/').count(), 2);
        assert_eq!(b.matches('/').count(), 2);
        assert_eq!(
            retired(&"10.244.0.64/26".parse().expect("cidr")),
            "ipam/retired/10.244.0.64-26"
        );
    }

    #[test]
    fn handle_keys_split_at_the_last_slash() {
        let h = calix_proto::handle::encode("k8s-pod-network", "ab.c");
        let key = handle(&h, "eth0");
        assert_eq!(key, "ipam/handles/k8s-pod-network:ab.c/eth0");
        assert_eq!(
            key.strip_prefix(HANDLES).and_then(|r| r.rsplit_once('/')),
            Some((h.as_str(), "eth0"))
        );
    }
}
