//! eBPF mode with Services translated: the host stack's masquerade of the Service flows from
//! outside whose backend is on another node. `from_host_dev` translates such a packet to its
//! backend and marks it (`calix_common::SVC_MASQ_MARK`); an nftables table per family, `ip
//! calix-services` and `ip6 calix-services`, masquerades what carries the mark, on ports outside the programs' NAT
//! range and the NodePort range, so the replies come back to this node (where `to_host_dev`
//! translates them back to the frontend) and never look like a NodePort. Written whole in one
//! netlink transaction with the agent's other tables, removed by `--uninstall`.

use calix_common::SVC_MASQ_MARK;
use calix_kernel::nft::rule::{IPPROTO_TCP, IPPROTO_UDP};
use calix_kernel::nft::{priority, Chain, ChainType, CmpOp, Family, Hook, Rule, Table, Verdict};

use super::DataplaneError;

pub const TABLE: &str = "calix-services";
/// The table's families (IPv4 and IPv6 flows from outside).
pub const FAMILIES: [Family; 2] = [Family::Ip, Family::Ip6];

/// The last port of Kubernetes' default NodePort range (30000-32767).
pub const NODEPORTS_LAST: u16 = 32_767;
/// The source ports masquerade uses when the host stack's own (outside the programs' NAT
/// range) do not lie above the NodePorts.
pub const DEFAULT_PORTS: (u16, u16) = (NODEPORTS_LAST + 1, 65_535);

/// The table of `family`: `meta mark & M == M meta l4proto { tcp, udp } masquerade to :lo-hi`.
pub fn table(family: Family, ports: (u16, u16)) -> Table {
    let chain = Chain::base(
        "postrouting",
        ChainType::Nat,
        Hook::Postrouting,
        priority::SRCNAT,
        Verdict::Accept,
    )
    .with_rule(
        Rule::builder(family)
            .mark_masked(SVC_MASQ_MARK, CmpOp::Eq, SVC_MASQ_MARK)
            .l4proto_in(&[IPPROTO_TCP, IPPROTO_UDP], false)
            .masquerade(Some(ports)),
    );
    Table::new(family, TABLE).with_chain(chain)
}

/// Applies [`table`] of each family.
pub fn apply(ports: (u16, u16)) -> Result<(), DataplaneError> {
    for family in FAMILIES {
        super::nft::apply(&table(family, ports))?;
    }
    Ok(())
}

/// Deletes the tables (those there are).
pub fn remove() -> Result<(), DataplaneError> {
    for family in FAMILIES {
        super::nft::remove(family, TABLE)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_marked_tcp_and_udp_are_masqueraded_on_the_given_ports() {
        let t = table(Family::Ip6, (32_768, 65_535));
        assert_eq!(t.family, Family::Ip6);
        let [chain] = t.chains.as_slice() else {
            panic!("one chain: {t:?}")
        };
        let base = chain.base.as_ref().expect("a base chain");
        assert_eq!(
            (&base.kind, base.hook, base.priority),
            (&ChainType::Nat, Hook::Postrouting, 100)
        );
        let [rule] = chain.rules.as_slice() else {
            panic!("one rule: {chain:?}")
        };
        let text: Vec<String> = rule.exprs.iter().map(ToString::to_string).collect();
        let all = text.join(" ");
        // The mark, masked and compared; the ports in network byte order.
        assert!(
            all.starts_with("[ meta load mark => reg 1 ] [ bitwise reg 1 = ( reg 1 & 0x0ca12000 )")
                && all.contains("[ cmp eq reg 1 0x0ca12000 ]"),
            "{all}"
        );
        assert!(all.contains("[ meta load l4proto => reg 1 ]"), "{all}");
        assert!(
            all.ends_with(
                "[ immediate reg 1 0x00000080 ] [ immediate reg 2 0x0000ffff ] \
                 [ masq proto_min reg 1 proto_max reg 2 flags 0x2 ]"
            ),
            "{all}"
        );
    }
}
