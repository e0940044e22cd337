//! The host stack's SNAT for `natOutgoing` pools: one nftables table, `ip calix`, with a
//! masquerade rule in its postrouting hook. In kernel mode it translates everything; in eBPF
//! mode it translates what the programs leave to the stack (flows to `service_cidrs` that
//! the stack DNATs out of the node, fragments, other protocols), on ports outside the
//! programs' NAT range so the two never hand out one tuple. The table is replaced whole in
//! one `nft -f` transaction (start, SIGHUP), left in place when the agent exits (traffic
//! keeps flowing) and deleted by `--uninstall` or when no pool needs it.

use ipnet::Ipv4Net;

use super::nat::NatSettings;
use super::nft::nft;
use super::DataplaneError;

/// The nftables table (family `ip`) the agent owns.
pub const TABLE: &str = "calix";

/// The `nft -f` script that makes the table what `s` says: created if missing, then deleted
/// and recreated in the same transaction, so no packet ever sees half a table. With no
/// `natOutgoing` pool the table is only deleted.
/// `ports`: the source ports masquerade may use (TCP, UDP, ICMP ids); `None`: any.
pub fn ruleset(s: &NatSettings, ports: Option<(u16, u16)>) -> String {
    let set = |nets: &[Ipv4Net]| {
        nets.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = format!("add table ip {TABLE}\ndelete table ip {TABLE}\n");
    if s.nat_pools.is_empty() {
        return out;
    }
    out.push_str(&format!(
        "table ip {TABLE} {{\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n"
    ));
    let mut matched = format!("ip saddr {{ {} }}", set(&s.nat_pools));
    if !s.no_snat.is_empty() {
        matched.push_str(&format!(" ip daddr != {{ {} }}", set(&s.no_snat)));
    }
    if let Some((lo, hi)) = ports {
        out.push_str(&format!(
            "\t\t{matched} meta l4proto {{ tcp, udp, icmp }} masquerade to :{lo}-{hi}\n"
        ));
    }
    out.push_str(&format!("\t\t{matched} masquerade\n"));
    out.push_str("\t}\n}\n");
    out
}

/// Kernel mode: applies [`ruleset`] (any port) in the agent's network namespace.
pub fn apply(s: &NatSettings) -> Result<(), DataplaneError> {
    nft(&ruleset(s, None))?;
    if s.nat_pools.is_empty() {
        tracing::debug!("no natOutgoing pool: nftables table ip {TABLE} removed");
    } else {
        tracing::info!(pools = ?s.nat_pools, "kernel mode: natOutgoing masquerade in nftables table ip {TABLE}");
    }
    Ok(())
}

/// eBPF mode: applies [`ruleset`] on [`NatSettings::stack_masquerade_ports`], for what the
/// programs leave to the host stack.
pub fn apply_stack(s: &NatSettings) -> Result<(), DataplaneError> {
    let ports = s.stack_masquerade_ports();
    nft(&ruleset(s, ports))?;
    if !s.nat_pools.is_empty() {
        tracing::info!(pools = ?s.nat_pools, ?ports,
            "natOutgoing masquerade of what the programs leave to the host stack, in nftables table ip {TABLE}");
    }
    Ok(())
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    nft(&format!("add table ip {TABLE}\ndelete table ip {TABLE}\n"))
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

    #[test]
    fn masquerades_natoutgoing_pools_except_to_pools_and_exceptions() {
        let r = ruleset(
            &settings(
                &["10.244.0.0/16"],
                &["10.244.0.0/16", "10.245.0.0/16", "172.16.0.0/12"],
            ),
            None,
        );
        assert!(
            r.starts_with("add table ip calix\ndelete table ip calix\n"),
            "{r}"
        );
        assert!(
            r.contains("type nat hook postrouting priority srcnat; policy accept;"),
            "{r}"
        );
        assert!(
            r.contains(
                "ip saddr { 10.244.0.0/16 } ip daddr != { 10.244.0.0/16, 10.245.0.0/16, \
                 172.16.0.0/12 } masquerade"
            ),
            "{r}"
        );
    }

    /// eBPF mode: the stack's masquerade keeps off the programs' NAT ports (16384–32767 by
    /// default), for every protocol with ports or echo identifiers.
    #[test]
    fn the_stack_masquerade_keeps_off_the_programs_ports() {
        let s = settings(&["10.244.0.0/16"], &["10.244.0.0/16"]);
        assert_eq!(s.stack_masquerade_ports(), Some((32768, 65535)));
        let r = ruleset(&s, s.stack_masquerade_ports());
        assert!(
            r.contains(
                "ip saddr { 10.244.0.0/16 } ip daddr != { 10.244.0.0/16 } meta l4proto { tcp, \
                 udp, icmp } masquerade to :32768-65535\n"
            ),
            "{r}"
        );
        let mut high = s.clone();
        (high.port_min, high.port_max) = (40000, 65535);
        assert_eq!(high.stack_masquerade_ports(), Some((1024, 39999)));
    }

    #[test]
    fn no_natoutgoing_pool_only_removes_the_table() {
        assert_eq!(
            ruleset(&settings(&[], &["10.244.0.0/16"]), Some((32768, 65535))),
            "add table ip calix\ndelete table ip calix\n"
        );
    }
}
