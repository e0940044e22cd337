//! Wiring a pod, the Calico way (DESIGN.md §2): every kernel side effect of CNI ADD and DEL,
//! plus the reads CHECK needs.
//!
//! ```text
//!   node namespace                               pod namespace
//!   caliXXXXXXXXXXX  ee:ee:ee:ee:ee:ee  <--veth-->  eth0  <ip>/32, <ip6>/128 (nodad)
//!     proxy_arp=1, proxy_delay=0, forwarding=1,      169.254.1.1/32 scope link
//!     rp_filter=1                                    default via 169.254.1.1
//!     (v6: proxy_ndp=1, accept_ra=0, forwarding=1)   default via fe80::ecee:eeff:feee:eeee
//!   <ip>/32 dev caliX scope link proto 202           permanent neighbours for both gateways,
//!   <ip6>/128 dev caliX proto 202                    accept_dad=0
//! ```
//!
//! Order of an ADD: [`create_veth`], [`configure_pod`], [`configure_host`]. If any step fails,
//! [`delete_link`](crate::netlink::delete_link) on the host side undoes all of them: the peer
//! and every route through the veth go with it. DEL is `delete_link` (idempotent) and, for
//! routes that may outlive the link, [`delete_route`](crate::netlink::delete_route).
//!
//! `veth.rs` creates the pair, `inside.rs` configures the pod's side, `host_side.rs` the node's
//! side and the settings the agent keeps true; who owns a host veth (its alias) is here.

mod host_side;
mod inside;
mod veth;

pub use host_side::{configure_host, host_settings, node_settings, HostRoute, HostSetting, Write};
pub use inside::{
    configure_pod, delete_source_rules, has_default_route, PodRouting, SECONDARY_RULE_PRIORITY,
    SECONDARY_TABLE_BASE,
};
pub use veth::{
    create_veth, create_veth_with_handle, wait_operational, PodNetlink, VethPair,
    OPERATIONAL_WITHIN,
};

use std::net::{Ipv4Addr, Ipv6Addr};

/// MAC address of every host-side veth. Fixed so the pod's IPv6 gateway (its EUI-64 link-local
/// address) is predictable, and so pods can carry a permanent neighbour entry for the gateway.
/// One definition for the programs, the agent and the plugin: calix-common's.
pub use calix_common::HOST_VETH_MAC;

/// The pod's IPv4 gateway: a link-local address nobody owns. The host veth answers ARP for it
/// through proxy ARP, and the pod has a permanent neighbour entry for it anyway.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

/// The pod's IPv6 gateway: the host veth's own link-local address, `fe80::ecee:eeff:feee:eeee`.
pub const GATEWAY_V6: Ipv6Addr =
    Ipv6Addr::from_bits(u128::from_be_bytes(calix_common::HOST_VETH_LINK_LOCAL));

/// The alias calix gives a host veth: which attachment owns it. DEL and GC only delete a link
/// whose alias names their own (containerID, ifname), so a DEL can never take another pod's
/// veth even when two attachments would derive the same name.
pub fn owner_alias(container_id: &str, ifname: &str) -> String {
    format!("{OWNER_ALIAS_PREFIX}{container_id}/{ifname}")
}

const OWNER_ALIAS_PREFIX: &str = "calix:";

/// The name prefix of every host veth calix makes (`cali` + 11 hex characters).
pub const HOST_VETH_PREFIX: &str = "cali";

/// Whether the host link `name` with `alias` carries calix's mark for the attachment
/// (`container_id`, `ifname`): a `cali…` name and that attachment's [`owner_alias`]. Only such
/// a link is ever programmed for an endpoint: a record naming anything else (the uplink, `lo`,
/// another tool's link, another attachment's veth) is not calix's to touch.
pub fn is_host_veth_of(name: &str, alias: Option<&str>, container_id: &str, ifname: &str) -> bool {
    name.starts_with(HOST_VETH_PREFIX) && alias == Some(owner_alias(container_id, ifname).as_str())
}

/// Whether `alias` is an [`owner_alias`] (of any attachment).
pub fn is_owner_alias(alias: &str) -> bool {
    alias
        .strip_prefix(OWNER_ALIAS_PREFIX)
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(cid, ifname)| !cid.is_empty() && !ifname.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_cali_link_with_the_attachments_alias_is_its_host_veth() {
        let ours = owner_alias("c1", "eth0");
        assert!(is_host_veth_of(
            "cali0123456789a",
            Some(&ours),
            "c1",
            "eth0"
        ));
        for (name, alias) in [
            ("eth0", Some(ours.as_str())),
            ("lo", None),
            ("cali0123456789a", None),
            ("cali0123456789a", Some("calix:c2/eth0")),
            ("cali0123456789a", Some("calix:c1/eth1")),
            ("cali0123456789a", Some("something else")),
        ] {
            assert!(
                !is_host_veth_of(name, alias, "c1", "eth0"),
                "{name} {alias:?}"
            );
        }
    }

    #[test]
    fn host_settings_follow_the_families() {
        let names = |v4, v6| -> Vec<(String, &str)> {
            host_settings("cali1", v4, v6)
                .into_iter()
                .map(|s| (s.path, s.value))
                .collect()
        };
        let v4 = names(true, false);
        assert!(v4.contains(&("ipv6/conf/cali1/disable_ipv6".into(), "1")));
        assert!(v4.contains(&("ipv4/conf/cali1/proxy_arp".into(), "1")));
        assert!(v4.contains(&("ipv4/conf/cali1/rp_filter".into(), "1")));
        assert!(!v4.iter().any(|(p, _)| p.contains("proxy_ndp")));
        let v6 = names(false, true);
        assert!(v6.contains(&("ipv6/conf/cali1/disable_ipv6".into(), "0")));
        assert!(v6.contains(&("ipv6/conf/cali1/proxy_ndp".into(), "1")));
        assert!(!v6.iter().any(|(p, _)| p.starts_with("ipv4/")));
        let route = HostRoute::of_pod(7, Some(Ipv4Addr::new(10, 0, 0, 1)), None);
        assert_eq!(route[0].dst.to_string(), "10.0.0.1/32");
    }

    #[test]
    fn gateway_v6_is_the_eui64_link_local_of_the_host_mac() {
        assert_eq!(
            GATEWAY_V6,
            "fe80::ecee:eeff:feee:eeee"
                .parse::<Ipv6Addr>()
                .expect("literal")
        );
    }
}
