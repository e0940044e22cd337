//! How the agent writes its nftables tables (kernel mode's masquerade and anti-spoofing, eBPF
//! mode's stack masquerade, both modes' doors) and notices when another tool changed them:
//! over netlink ([`calix_kernel::nft`]), in the agent's network namespace (the node's), no
//! `nft` binary. A leaf.
use std::cell::Cell;

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

/// What a drift check reads of nftables.
pub(super) trait Reads {
    /// The namespace's ruleset generation ([`nft::generation`]); `None` when it cannot be read
    /// (then every check reads the tables).
    fn generation(&self) -> Option<u32>;
    /// Table `family name` as the kernel holds it, in canonical form; `None` when there is
    /// no such table.
    fn read(&self, family: Family, name: &str) -> Result<Option<Table>, DataplaneError>;
}

/// The kernel's, over netlink.
pub(super) struct Kernel;

impl Reads for Kernel {
    fn generation(&self) -> Option<u32> {
        nft::generation()
            .inspect_err(|e| {
                tracing::debug!(error = %e, "cannot read the nftables generation; reading the tables")
            })
            .ok()
    }

    fn read(&self, family: Family, name: &str) -> Result<Option<Table>, DataplaneError> {
        Ok(nft::read(family, name)?.map(|t| t.canonical()))
    }
}

/// A table the agent owns, as the kernel held it right after the agent wrote it (`None`: the
/// agent removed it), read back over netlink and put in canonical form. The periodic resync
/// compares it with what is there now: a table deleted, flushed or edited by another tool
/// (`nft flush ruleset`, a firewall's restart) is drift, and the agent writes it again.
/// Counters' counts are not part of it: traffic is not drift. No writes; and no read while
/// the ruleset generation has not moved since the table was last found as written (every
/// nftables change moves it): an idle node's pass asks one number, not three tables (the
/// reconciler's thread also programs routes; issue 20, item 9).
#[derive(Debug, Clone)]
pub(super) struct OwnedTable {
    family: Family,
    name: &'static str,
    want: Option<Table>,
    /// The generation read just before the table was last read and found as `want`.
    checked: Cell<Option<u32>>,
}

impl OwnedTable {
    /// Reads table `family name` as it is now (just after the agent applied it).
    pub(super) fn record(family: Family, name: &'static str) -> Result<Self, DataplaneError> {
        Self::record_with(&Kernel, family, name)
    }

    fn record_with(
        reads: &impl Reads,
        family: Family,
        name: &'static str,
    ) -> Result<Self, DataplaneError> {
        // Read before the table: a change in between moves it past what is recorded.
        let generation = reads.generation();
        Ok(Self {
            family,
            name,
            want: reads.read(family, name)?,
            checked: Cell::new(generation),
        })
    }

    /// Whether this is table `family name`.
    pub(super) fn is(&self, family: Family, name: &str) -> bool {
        self.family == family && self.name == name
    }

    /// How the table differs from what the agent left, nftables being at `generation`
    /// (read before this check); `None` when it does not.
    fn drift(
        &self,
        reads: &impl Reads,
        generation: Option<u32>,
    ) -> Result<Option<super::Drift>, DataplaneError> {
        if generation.is_some() && generation == self.checked.get() {
            return Ok(None);
        }
        let now = reads.read(self.family, self.name)?;
        if now == self.want {
            self.checked.set(generation);
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
    drift_with(&Kernel, tables)
}

fn drift_with(
    reads: &impl Reads,
    tables: &[OwnedTable],
) -> Result<Vec<super::Drift>, DataplaneError> {
    let generation = reads.generation();
    let mut out = Vec::new();
    for t in tables {
        out.extend(t.drift(reads, generation)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::*;

    /// nftables in memory: the tables' listings, a generation that moves with every change,
    /// and the listings asked for.
    #[derive(Default)]
    struct Fake {
        tables: Mutex<BTreeMap<(Family, String), Table>>,
        generation: Mutex<Option<u32>>,
        listed: Mutex<Vec<String>>,
    }

    impl Fake {
        fn new() -> Self {
            let f = Self::default();
            *f.generation.lock().expect("lock") = Some(1);
            f
        }

        /// A committed change (any table, by anyone): the generation moves. `comment` stands
        /// for the table's content.
        fn write(&self, family: Family, name: &str, comment: Option<&str>) {
            let mut tables = self.tables.lock().expect("lock");
            let key = (family, name.to_string());
            match comment {
                Some(c) => {
                    let mut t = Table::new(family, name);
                    t.comment = Some(c.into());
                    tables.insert(key, t)
                }
                None => tables.remove(&key),
            };
            if let Some(g) = self.generation.lock().expect("lock").as_mut() {
                *g += 1;
            }
        }

        fn listings(&self) -> usize {
            std::mem::take(&mut *self.listed.lock().expect("lock")).len()
        }
    }

    impl Reads for Fake {
        fn generation(&self) -> Option<u32> {
            *self.generation.lock().expect("lock")
        }

        fn read(&self, family: Family, name: &str) -> Result<Option<Table>, DataplaneError> {
            self.listed
                .lock()
                .expect("lock")
                .push(format!("{family} {name}"));
            let key = (family, name.to_string());
            Ok(self.tables.lock().expect("lock").get(&key).cloned())
        }
    }

    fn recorded(nft: &Fake) -> Vec<OwnedTable> {
        nft.write(Family::Inet, "calix-antispoof", Some("as written"));
        let a = OwnedTable::record_with(nft, Family::Inet, "calix-antispoof").expect("record");
        nft.write(Family::Inet, "calix-doors", Some("as written"));
        let d = OwnedTable::record_with(nft, Family::Inet, "calix-doors").expect("record");
        nft.listings();
        vec![a, d]
    }

    fn kinds(d: &[crate::Drift]) -> Vec<String> {
        d.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn while_nothing_changed_in_nftables_no_table_is_listed() {
        let nft = Fake::new();
        let tables = recorded(&nft);
        // The first pass lists the table recorded before the last write, once.
        assert!(drift_with(&nft, &tables).expect("drift").is_empty());
        assert_eq!(nft.listings(), 1);
        for _ in 0..10 {
            assert!(drift_with(&nft, &tables).expect("drift").is_empty());
        }
        assert_eq!(nft.listings(), 0, "ten passes, nothing changed: no listing");
    }

    #[test]
    fn a_change_elsewhere_lists_once_a_change_of_ours_is_drift_until_repaired() {
        let nft = Fake::new();
        let tables = recorded(&nft);
        drift_with(&nft, &tables).expect("drift");
        nft.listings();
        // Another tool's table: both listed once, found as written, then left alone.
        nft.write(Family::Ip, "kube-proxy", Some("theirs"));
        assert!(drift_with(&nft, &tables).expect("drift").is_empty());
        assert_eq!(nft.listings(), 2);
        assert!(drift_with(&nft, &tables).expect("drift").is_empty());
        assert_eq!(nft.listings(), 0);
        // One of ours flushed, the other deleted: drift at every pass until written again.
        nft.write(Family::Inet, "calix-antispoof", Some("flushed"));
        nft.write(Family::Inet, "calix-doors", None);
        for _ in 0..2 {
            assert_eq!(
                kinds(&drift_with(&nft, &tables).expect("drift")),
                [
                    "nftables table inet calix-antispoof was changed by something else",
                    "nftables table inet calix-doors is missing"
                ]
            );
        }
    }

    #[test]
    fn without_a_generation_every_pass_lists_every_table() {
        let nft = Fake::new();
        let tables = recorded(&nft);
        *nft.generation.lock().expect("lock") = None;
        for _ in 0..3 {
            assert!(drift_with(&nft, &tables).expect("drift").is_empty());
        }
        assert_eq!(nft.listings(), 6);
        nft.write(Family::Inet, "calix-doors", None);
        assert_eq!(
            kinds(&drift_with(&nft, &tables).expect("drift")),
            ["nftables table inet calix-doors is missing"]
        );
    }
}
