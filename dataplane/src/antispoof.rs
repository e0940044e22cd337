//! Anti-spoofing in kernel mode (`dataplane = "kernel"`: no BPF, so no `from_pod`). Two
//! layers, each where its object lives:
//!
//! - the CNI plugin sets strict `rp_filter=1` on each host veth when it creates it (IPv4; the
//!   kernel applies the maximum of `conf/all` and the interface's value, so `all=2`, systemd's
//!   default, makes it loose);
//! - the agent keeps one nftables table, `inet calix_antispoof`, whose prerouting hook (at raw
//!   priority: before conntrack sees the packet) drops anything arriving on a `cali*`
//!   interface whose source does not route back out of that same interface
//!   (`fib saddr . iif oif missing`, strict reverse-path filtering): for IPv6, which has no
//!   rp_filter, and for IPv4 whatever `conf/all/rp_filter` says. Since every pod address has
//!   its host route via its own veth, only a pod's own addresses (and link-local ones, which
//!   are on-link) pass. Neighbour discovery and MLD from `::` (duplicate address detection,
//!   reports before a link-local address exists) are let through first.
//!
//! The table is replaced whole in one netlink transaction (at start and on SIGHUP, which also
//! heals an `nft flush ruleset`), stays when the agent exits, carries a comment naming calix,
//! and goes with `--uninstall` or when an eBPF-mode agent starts (`from_pod` guards then).
//! Not covered in kernel mode: ARP claiming another address (it only poisons the host's
//! neighbour entry on that pod's own veth, which nothing routes through) and neighbour
//! advertisements for another pod's address (same), VLAN-tagged frames (the stack drops them
//! for want of a VLAN device, or strips priority tags and then checks the inner packet here).
use calix_kernel::nft::rule::icmpv6;
use calix_kernel::nft::{
    priority, Addr, Chain, ChainType, CmpOp, Family, Hook, Rule, Table, Verdict,
};

use super::DataplaneError;

/// The nftables table the agent owns in kernel mode.
pub const TABLE: &str = "calix_antispoof";
pub const FAMILY: Family = Family::Inet;

/// The table, as one transaction writes it.
pub fn table() -> Table {
    let rule = || Rule::builder(FAMILY);
    // Neighbour discovery and MLD from `::` (duplicate address detection, reports before a
    // link-local address exists).
    let from_unspecified = [
        icmpv6::ND_ROUTER_SOLICIT,
        icmpv6::ND_NEIGHBOR_SOLICIT,
        icmpv6::MLD_LISTENER_REPORT,
        icmpv6::MLD_LISTENER_DONE,
        icmpv6::MLD2_LISTENER_REPORT,
    ];
    Table::new(FAMILY, TABLE)
        .with_comment("calix: pods send only from their own addresses (kernel dataplane); calix-agent --uninstall removes it")
        .with_chain(
            Chain::base("prerouting", ChainType::Filter, Hook::Prerouting, priority::RAW, Verdict::Accept)
                // iifname != "cali*" accept
                .with_rule(rule().iifname(CmpOp::Neq, "cali*").accept())
                // ip6 saddr :: icmpv6 type { nd-router-solicit, ... } accept
                .with_rule(
                    rule()
                        .ipv6_is(Addr::Source, std::net::Ipv6Addr::UNSPECIFIED, false)
                        .icmpv6_type_in(&from_unspecified)
                        .accept(),
                )
                // fib saddr . iif oif missing counter drop
                .with_rule(rule().fib_saddr_iif_oif_missing().counter().drop()),
        )
}

/// Installs (or replaces) the table in the agent's network namespace.
pub fn apply() -> Result<(), DataplaneError> {
    super::nft::apply(&table())?;
    tracing::info!("kernel mode: pod anti-spoofing in nftables table inet {TABLE}");
    Ok(())
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    super::nft::remove(FAMILY, TABLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(r: &Rule) -> Vec<String> {
        r.exprs.iter().map(ToString::to_string).collect()
    }

    /// The rules are what `nft` compiled the old script's lines to (`nft --debug=netlink`):
    /// iifname != "cali*" accept; ip6 saddr :: icmpv6 type { ... } accept;
    /// fib saddr . iif oif missing counter drop.
    #[test]
    fn the_table_drops_what_does_not_route_back_out_of_the_pods_veth() {
        let t = table();
        assert_eq!(t.id(), "inet calix_antispoof");
        assert!(t
            .comment
            .as_deref()
            .is_some_and(|c| c.starts_with("calix: ")));
        assert!(t.sets.is_empty());
        let [chain] = t.chains.as_slice() else {
            panic!("one chain: {t:?}")
        };
        let base = chain.base.as_ref().expect("a base chain");
        assert_eq!(
            (&base.kind, base.hook, base.priority, &base.policy),
            (&ChainType::Filter, Hook::Prerouting, -300, &Verdict::Accept),
            "type filter hook prerouting priority raw; policy accept;"
        );
        let rules: Vec<Vec<String>> = chain.rules.iter().map(lines).collect();
        assert_eq!(
            rules,
            [
                vec![
                    "[ meta load iifname => reg 1 ]",
                    "[ cmp neq reg 1 0x696c6163 ]",
                    "[ immediate reg 0 accept ]"
                ],
                vec![
                    "[ meta load nfproto => reg 1 ]",
                    "[ cmp eq reg 1 0x0000000a ]",
                    "[ payload load 16b @ network header + 8 => reg 1 ]",
                    "[ cmp eq reg 1 0x00000000 0x00000000 0x00000000 0x00000000 ]",
                    "[ meta load l4proto => reg 1 ]",
                    "[ cmp eq reg 1 0x0000003a ]",
                    "[ payload load 1b @ transport header + 0 => reg 1 ]",
                    "[ lookup reg 1 set __set%d ]",
                    "[ immediate reg 0 accept ]"
                ],
                vec![
                    "[ fib saddr . iif oif present => reg 1 ]",
                    "[ cmp eq reg 1 0x00000000 ]",
                    "[ counter pkts 0 bytes 0 ]",
                    "[ immediate reg 0 drop ]"
                ],
            ]
        );
        let Some(calix_kernel::nft::Expr::Lookup {
            set: calix_kernel::nft::SetRef::Anonymous(types),
            ..
        }) = chain.rules[1].exprs.get(7)
        else {
            panic!("the ICMPv6 types' set")
        };
        let types: Vec<u8> = types.elements.iter().map(|e| e.key[0]).collect();
        assert_eq!(types, [133, 135, 131, 132, 143]);
    }
}
