//! SNAT for `natOutgoing` pools in kernel mode: no BPF there, so the agent keeps one nftables
//! table, `ip calix`, with a masquerade rule in its postrouting hook. The table is replaced
//! whole in one `nft -f` transaction (start, SIGHUP), left in place when the agent exits
//! (traffic keeps flowing) and deleted by `--uninstall` or when no pool needs it.
use std::io::Write;
use std::process::{Command, Stdio};

use ipnet::Ipv4Net;

use super::nat::NatSettings;
use super::DataplaneError;

/// The nftables table (family `ip`) the agent owns.
pub const TABLE: &str = "calix";

/// The `nft -f` script that makes the table what `s` says: created if missing, then deleted
/// and recreated in the same transaction, so no packet ever sees half a table. With no
/// `natOutgoing` pool the table is only deleted.
pub fn ruleset(s: &NatSettings) -> String {
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
    let from = set(&s.nat_pools);
    if s.no_snat.is_empty() {
        out.push_str(&format!("\t\tip saddr {{ {from} }} masquerade\n"));
    } else {
        out.push_str(&format!(
            "\t\tip saddr {{ {from} }} ip daddr != {{ {} }} masquerade\n",
            set(&s.no_snat)
        ));
    }
    out.push_str("\t}\n}\n");
    out
}

/// Applies [`ruleset`] in the agent's network namespace.
pub fn apply(s: &NatSettings) -> Result<(), DataplaneError> {
    nft(&ruleset(s))?;
    if s.nat_pools.is_empty() {
        tracing::debug!("no natOutgoing pool: nftables table ip {TABLE} removed");
    } else {
        tracing::info!(pools = ?s.nat_pools, "kernel mode: natOutgoing masquerade in nftables table ip {TABLE}");
    }
    Ok(())
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    nft(&format!("add table ip {TABLE}\ndelete table ip {TABLE}\n"))
}

/// Runs `nft -f -` on `script`.
pub(super) fn nft(script: &str) -> Result<(), DataplaneError> {
    let fail = |why: String| DataplaneError::Nftables(why);
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run nft (install nftables): {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| fail(format!("writing to nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| fail(format!("waiting for nft: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(fail(format!(
            "nft -f failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(nat: &[&str], no: &[&str]) -> NatSettings {
        let nets = |v: &[&str]| v.iter().map(|s| s.parse().expect("cidr")).collect();
        let mut s = crate::config::AgentConfig::default()
            .nat_settings()
            .expect("default [nat]");
        s.nat_pools = nets(nat);
        s.no_snat = nets(no);
        s
    }

    #[test]
    fn masquerades_natoutgoing_pools_except_to_pools_and_exceptions() {
        let r = ruleset(&settings(
            &["10.244.0.0/16"],
            &["10.244.0.0/16", "10.245.0.0/16", "172.16.0.0/12"],
        ));
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

    #[test]
    fn no_natoutgoing_pool_only_removes_the_table() {
        assert_eq!(
            ruleset(&settings(&[], &["10.244.0.0/16"])),
            "add table ip calix\ndelete table ip calix\n"
        );
    }
}
