//! How the agent writes its nftables tables (kernel mode's masquerade and anti-spoofing, eBPF
//! mode's stack masquerade, both modes' doors) and notices when another tool changed them:
//! over netlink ([`calix_kernel::nft`]), in the agent's network namespace (the node's), no
//! `nft` binary. A leaf.
use calix_kernel::nft::{self, Family, Table};

use super::DataplaneError;

/// Makes the kernel's table exactly `t`, in one transaction (created, or deleted and
/// recreated: no packet sees half a table).
pub(super) fn apply(t: &Table) -> Result<(), DataplaneError> {
    Ok(nft::apply(t)?)
}

/// Deletes table `family name`, if there is one.
pub(super) fn remove(family: Family, name: &str) -> Result<(), DataplaneError> {
    Ok(nft::delete(family, name)?)
}

/// A table the agent owns, as the kernel held it right after the agent wrote it (`None`: the
/// agent removed it), read back over netlink and put in canonical form. The periodic resync
/// compares it with what is there now: a table deleted, flushed or edited by another tool
/// (`nft flush ruleset`, a firewall's restart) is drift, and the agent writes it again.
/// Counters' counts are not part of it: traffic is not drift. One read per table per pass;
/// no writes.
#[derive(Debug, Clone)]
pub(super) struct OwnedTable {
    family: Family,
    name: &'static str,
    want: Option<Table>,
}

impl OwnedTable {
    /// Reads table `family name` as it is now (just after the agent applied it).
    pub(super) fn record(family: Family, name: &'static str) -> Result<Self, DataplaneError> {
        Ok(Self {
            family,
            name,
            want: read(family, name)?,
        })
    }

    /// Whether this is table `family name`.
    pub(super) fn is(&self, family: Family, name: &str) -> bool {
        self.family == family && self.name == name
    }

    /// How the table differs from what the agent left; `None` when it does not.
    pub(super) fn drift(&self) -> Result<Option<super::Drift>, DataplaneError> {
        let now = read(self.family, self.name)?;
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

fn read(family: Family, name: &str) -> Result<Option<Table>, DataplaneError> {
    Ok(nft::read(family, name)?.map(|t| t.canonical()))
}

/// The drift of every table in `tables`.
pub(super) fn drift_of(tables: &[OwnedTable]) -> Result<Vec<super::Drift>, DataplaneError> {
    let mut out = Vec::new();
    for t in tables {
        out.extend(t.drift()?);
    }
    Ok(out)
}
