//! The host stack's SNAT for `natOutgoing` pools: one nftables table, `ip calix`, with a
//! masquerade rule in its postrouting hook. In kernel mode it translates everything; in eBPF
//! mode it translates what the programs leave to the stack (flows to `service_cidrs` that
//! the stack DNATs out of the node, fragments, other protocols), on ports outside the
//! programs' NAT range so the two never hand out one tuple. The table is replaced whole in
//! one netlink transaction (start, SIGHUP), left in place when the agent exits (traffic
//! keeps flowing) and deleted by `--uninstall` or when no pool needs it.

use calix_kernel::nft::rule::{IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};
use calix_kernel::nft::{priority, Addr, Chain, ChainType, Family, Hook, Rule, Table, Verdict};

use super::nat::NatSettings;
use super::DataplaneError;

/// The nftables table the agent owns.
pub const TABLE: &str = "calix";
pub const FAMILY: Family = Family::Ip;

/// The table `s` asks for, written in one transaction (created if missing, else deleted and
/// recreated: no packet ever sees half a table); `None` with no `natOutgoing` pool (the
/// table is only deleted then).
/// `ports`: the source ports masquerade may use (TCP, UDP, ICMP ids); `None`: any.
pub fn table(s: &NatSettings, ports: Option<(u16, u16)>) -> Option<Table> {
    if s.nat_pools.is_empty() {
        return None;
    }
    // ip saddr { pools } [ip daddr != { no_snat }]
    let matched = || {
        let r = Rule::builder(FAMILY).ipv4_in(Addr::Source, &s.nat_pools, false);
        if s.no_snat.is_empty() {
            r
        } else {
            r.ipv4_in(Addr::Destination, &s.no_snat, true)
        }
    };
    let mut chain = Chain::base(
        "postrouting",
        ChainType::Nat,
        Hook::Postrouting,
        priority::SRCNAT,
        Verdict::Accept,
    );
    if let Some(range) = ports {
        // ... meta l4proto { tcp, udp, icmp } masquerade to :lo-hi
        chain = chain.with_rule(
            matched()
                .l4proto_in(&[IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMP], false)
                .masquerade(Some(range)),
        );
    }
    // ... masquerade
    chain = chain.with_rule(matched().masquerade(None));
    Some(Table::new(FAMILY, TABLE).with_chain(chain))
}

fn write(t: Option<Table>) -> Result<(), DataplaneError> {
    match t {
        Some(t) => super::nft::apply(&t),
        None => remove(),
    }
}

/// Kernel mode: applies [`table`] (any port) in the agent's network namespace.
pub fn apply(s: &NatSettings) -> Result<(), DataplaneError> {
    write(table(s, None))?;
    if s.nat_pools.is_empty() {
        tracing::debug!("no natOutgoing pool: nftables table ip {TABLE} removed");
    } else {
        tracing::info!(pools = ?s.nat_pools, "kernel mode: natOutgoing masquerade in nftables table ip {TABLE}");
    }
    Ok(())
}

/// eBPF mode: applies [`table`] on [`NatSettings::stack_masquerade_ports`], for what the
/// programs leave to the host stack.
pub fn apply_stack(s: &NatSettings) -> Result<(), DataplaneError> {
    let ports = s.stack_masquerade_ports();
    write(table(s, ports))?;
    if !s.nat_pools.is_empty() {
        tracing::info!(pools = ?s.nat_pools, ?ports,
            "natOutgoing masquerade of what the programs leave to the host stack, in nftables table ip {TABLE}");
    }
    Ok(())
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    super::nft::remove(FAMILY, TABLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(nat: &[&str], no: &[&str]) -> NatSettings {
        let nets = |v: &[&str]| v.iter().map(|s| s.parse().expect("cidr")).collect();
        let mut s = NatSettings::example();
        s.nat_pools = nets(nat);
        s.no_snat = nets(no);
        s
    }

    fn lines(r: &Rule) -> Vec<String> {
        r.exprs.iter().map(ToString::to_string).collect()
    }

    fn rules(t: &Table) -> Vec<Vec<String>> {
        let [chain] = t.chains.as_slice() else {
            panic!("one chain: {t:?}")
        };
        let base = chain.base.as_ref().expect("a base chain");
        assert_eq!(
            (&base.kind, base.hook, base.priority, &base.policy),
            (&ChainType::Nat, Hook::Postrouting, 100, &Verdict::Accept),
            "type nat hook postrouting priority srcnat; policy accept;"
        );
        chain.rules.iter().map(lines).collect()
    }

    /// The ranges of the `ip daddr != { ... }` set, as (first, last) addresses.
    fn excluded(r: &Rule) -> Vec<(String, String)> {
        let set = r
            .exprs
            .iter()
            .find_map(|e| match e {
                calix_kernel::nft::Expr::Lookup {
                    set: calix_kernel::nft::SetRef::Anonymous(s),
                    invert: true,
                    ..
                } => Some(s),
                _ => None,
            })
            .expect("a negated set");
        let ip =
            |b: &[u8]| std::net::Ipv4Addr::from(<[u8; 4]>::try_from(b).expect("v4")).to_string();
        set.elements
            .iter()
            .map(|e| (ip(&e.key), ip(e.last.as_deref().expect("a range"))))
            .collect()
    }

    /// The rules are what `nft` compiled the old script's lines to (`nft --debug=netlink`).
    #[test]
    fn masquerades_natoutgoing_pools_except_to_pools_and_exceptions() {
        let t = table(
            &settings(
                &["10.244.0.0/16"],
                &["10.244.0.0/16", "10.245.0.0/16", "172.16.0.0/12"],
            ),
            None,
        )
        .expect("a table");
        assert_eq!(t.id(), "ip calix");
        let rules = rules(&t);
        // ip saddr { 10.244.0.0/16 } ip daddr != { 10.244.0.0/16, 10.245.0.0/16,
        // 172.16.0.0/12 } masquerade
        assert_eq!(
            rules,
            [[
                "[ payload load 2b @ network header + 12 => reg 1 ]",
                "[ cmp eq reg 1 0x0000f40a ]",
                "[ payload load 4b @ network header + 16 => reg 1 ]",
                "[ lookup reg 1 set __set%d 0x1 ]",
                "[ masq ]"
            ]]
        );
        assert_eq!(
            excluded(&t.chains[0].rules[0]),
            [
                ("10.244.0.0".into(), "10.245.255.255".into()),
                ("172.16.0.0".into(), "172.31.255.255".into())
            ]
        );
    }

    /// eBPF mode: the stack's masquerade keeps off the programs' NAT ports (16384–32767 by
    /// default), for every protocol with ports or echo identifiers.
    #[test]
    fn the_stack_masquerade_keeps_off_the_programs_ports() {
        let s = settings(&["10.244.0.0/16"], &["10.244.0.0/16"]);
        assert_eq!(s.stack_masquerade_ports(), Some((32768, 65535)));
        let t = table(&s, s.stack_masquerade_ports()).expect("a table");
        // ip saddr { 10.244.0.0/16 } ip daddr != { 10.244.0.0/16 } meta l4proto { tcp, udp,
        // icmp } masquerade to :32768-65535, then the same without ports.
        let rules = rules(&t);
        assert_eq!(
            rules[0],
            [
                "[ payload load 2b @ network header + 12 => reg 1 ]",
                "[ cmp eq reg 1 0x0000f40a ]",
                "[ payload load 2b @ network header + 16 => reg 1 ]",
                "[ cmp neq reg 1 0x0000f40a ]",
                "[ meta load l4proto => reg 1 ]",
                "[ lookup reg 1 set __set%d ]",
                "[ immediate reg 1 0x00000080 ]",
                "[ immediate reg 2 0x0000ffff ]",
                "[ masq proto_min reg 1 proto_max reg 2 flags 0x2 ]"
            ]
        );
        assert_eq!(rules[1][..4], rules[0][..4]);
        assert_eq!(rules[1][4..], ["[ masq ]"]);
        let mut high = s.clone();
        (high.port_min, high.port_max) = (40000, 65535);
        assert_eq!(high.stack_masquerade_ports(), Some((1024, 39999)));
    }

    #[test]
    fn no_natoutgoing_pool_only_removes_the_table() {
        assert_eq!(
            table(&settings(&[], &["10.244.0.0/16"]), Some((32768, 65535))),
            None
        );
    }
}
