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
//! The table is replaced whole in one `nft -f` transaction (at start and on SIGHUP, which also
//! heals an `nft flush ruleset`), stays when the agent exits, carries a comment naming calix,
//! and goes with `--uninstall` or when an eBPF-mode agent starts (`from_pod` guards then).
//! Not covered in kernel mode: ARP claiming another address (it only poisons the host's
//! neighbour entry on that pod's own veth, which nothing routes through) and neighbour
//! advertisements for another pod's address (same), VLAN-tagged frames (the stack drops them
//! for want of a VLAN device, or strips priority tags and then checks the inner packet here).
use super::nft::nft;
use super::DataplaneError;

/// The nftables table (family `inet`) the agent owns in kernel mode.
pub const TABLE: &str = "calix_antispoof";

/// The `nft -f` script that (re)creates the table in one transaction.
pub fn ruleset() -> String {
    format!(
        "add table inet {TABLE}\n\
         delete table inet {TABLE}\n\
         table inet {TABLE} {{\n\
         \tcomment \"calix: pods send only from their own addresses (kernel dataplane); calix-agent --uninstall removes it\"\n\
         \tchain prerouting {{\n\
         \t\ttype filter hook prerouting priority raw; policy accept;\n\
         \t\tiifname != \"cali*\" accept\n\
         \t\tip6 saddr :: icmpv6 type {{ nd-router-solicit, nd-neighbor-solicit, mld-listener-report, mld-listener-done, mld2-listener-report }} accept\n\
         \t\tfib saddr . iif oif missing counter drop\n\
         \t}}\n\
         }}\n"
    )
}

/// Installs (or replaces) the table in the agent's network namespace.
pub fn apply() -> Result<(), DataplaneError> {
    nft(&ruleset())?;
    tracing::info!("kernel mode: pod anti-spoofing in nftables table inet {TABLE}");
    Ok(())
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    nft(&format!(
        "add table inet {TABLE}\ndelete table inet {TABLE}\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_drops_what_does_not_route_back_out_of_the_pods_veth() {
        let r = ruleset();
        assert!(
            r.starts_with("add table inet calix_antispoof\ndelete table inet calix_antispoof\n"),
            "{r}"
        );
        assert!(r.contains("comment \"calix: "), "{r}");
        assert!(
            r.contains("type filter hook prerouting priority raw;"),
            "{r}"
        );
        let (head, rule) = r
            .split_once("fib saddr . iif oif missing counter drop")
            .expect("{r}");
        assert!(head.contains("iifname != \"cali*\" accept"), "{r}");
        assert!(head.contains("ip6 saddr :: icmpv6 type {"), "{r}");
        assert!(rule.starts_with("\n\t}\n}\n"), "{r}");
    }
}
