//! `nft -f -`: how the agent installs its nftables tables (kernel mode's masquerade and
//! anti-spoofing, eBPF mode's stack masquerade, both modes' doors). A leaf.
use std::io::Write;
use std::process::{Command, Stdio};

use super::DataplaneError;

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

/// `nft -s list table <family> <name>`: the table as the kernel holds it, without counters
/// (stateless, so traffic does not change it); `None` when there is no such table.
fn list_table(family: &str, name: &str) -> Result<Option<String>, DataplaneError> {
    let fail = |why: String| DataplaneError::Nftables(why);
    let out = Command::new("nft")
        .args(["-s", "list", "table", family, name])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| fail(format!("cannot run nft (install nftables): {e}")))?;
    if out.status.success() {
        return Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()));
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No such file or directory") {
        return Ok(None);
    }
    Err(fail(format!(
        "nft list table {family} {name} failed ({}): {}",
        out.status,
        stderr.trim()
    )))
}

/// A table the agent owns, as the kernel held it right after the agent wrote it (`None`: the
/// agent removed it). The periodic resync compares it with what is there now: a table
/// deleted, flushed or edited by another tool (`nft flush ruleset`, a firewall's restart) is
/// drift, and the agent writes it again. One `nft list` per table per pass; no writes.
#[derive(Debug, Clone)]
pub(super) struct OwnedTable {
    family: &'static str,
    name: &'static str,
    want: Option<String>,
}

impl OwnedTable {
    /// Reads table `family name` as it is now (just after the agent applied it).
    pub(super) fn record(family: &'static str, name: &'static str) -> Result<Self, DataplaneError> {
        Ok(Self {
            family,
            name,
            want: list_table(family, name)?,
        })
    }

    /// Whether this is table `family name`.
    pub(super) fn is(&self, family: &str, name: &str) -> bool {
        self.family == family && self.name == name
    }

    /// How the table differs from what the agent left; `None` when it does not.
    pub(super) fn drift(&self) -> Result<Option<super::Drift>, DataplaneError> {
        let now = list_table(self.family, self.name)?;
        if now == self.want {
            return Ok(None);
        }
        let what = match (&self.want, &now) {
            (Some(_), None) => "is missing",
            (None, Some(_)) => "is there, but calix removed it",
            _ => "was changed by something else",
        };
        Ok(Some(super::Drift::NftTable {
            table: format!("{} {}", self.family, self.name),
            what,
        }))
    }
}

/// The drift of every table in `tables`.
pub(super) fn drift_of(tables: &[OwnedTable]) -> Result<Vec<super::Drift>, DataplaneError> {
    let mut out = Vec::new();
    for t in tables {
        out.extend(t.drift()?);
    }
    Ok(out)
}
