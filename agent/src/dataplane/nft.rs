//! `nft -f -`: how the agent installs its nftables tables (kernel mode's masquerade and
//! anti-spoofing, eBPF mode's stack masquerade, both modes' doors), and how the periodic
//! resync finds them changed by something else. A leaf.
use std::cell::Cell;
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

/// What a drift check reads of nftables.
pub(super) trait Reads {
    /// The namespace's ruleset generation ([`calix_kernel::nftables`]); `None` when it cannot
    /// be read (then every check lists the tables).
    fn generation(&self) -> Option<u32>;
    /// Table `family name` as the kernel holds it; `None` when there is no such table.
    fn list(&self, family: &str, name: &str) -> Result<Option<String>, DataplaneError>;
}

/// The kernel's: one netlink request for the generation, `nft -s list table` for a table.
pub(super) struct Kernel;

impl Reads for Kernel {
    fn generation(&self) -> Option<u32> {
        calix_kernel::nftables::generation()
            .inspect_err(|e| {
                tracing::debug!(error = %e, "cannot read the nftables generation; listing the tables")
            })
            .ok()
    }

    fn list(&self, family: &str, name: &str) -> Result<Option<String>, DataplaneError> {
        list_table(family, name)
    }
}

/// A table the agent owns, as the kernel held it right after the agent wrote it (`None`: the
/// agent removed it). The periodic resync compares it with what is there now: a table
/// deleted, flushed or edited by another tool (`nft flush ruleset`, a firewall's restart) is
/// drift, and the agent writes it again. No writes; and no `nft list` while the ruleset
/// generation has not moved since the table was last found as written: every nftables change
/// moves it, and listing is a process per table (tens of milliseconds on a busy node, seconds
/// at worst, on the reconciler's thread: a route to a new pod waited behind it).
#[derive(Debug, Clone)]
pub(super) struct OwnedTable {
    family: &'static str,
    name: &'static str,
    want: Option<String>,
    /// The generation read just before the table was last listed and found as `want`.
    checked: Cell<Option<u32>>,
}

impl OwnedTable {
    /// Reads table `family name` as it is now (just after the agent applied it).
    pub(super) fn record(family: &'static str, name: &'static str) -> Result<Self, DataplaneError> {
        Self::record_with(&Kernel, family, name)
    }

    fn record_with(
        reads: &impl Reads,
        family: &'static str,
        name: &'static str,
    ) -> Result<Self, DataplaneError> {
        // Read before the listing: a change in between moves it past what is recorded.
        let generation = reads.generation();
        Ok(Self {
            family,
            name,
            want: reads.list(family, name)?,
            checked: Cell::new(generation),
        })
    }

    /// Whether this is table `family name`.
    pub(super) fn is(&self, family: &str, name: &str) -> bool {
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
        let now = reads.list(self.family, self.name)?;
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
        tables: Mutex<BTreeMap<String, String>>,
        generation: Mutex<Option<u32>>,
        listed: Mutex<Vec<String>>,
    }

    impl Fake {
        fn new() -> Self {
            let f = Self::default();
            *f.generation.lock().expect("lock") = Some(1);
            f
        }

        /// A committed change (any table, by anyone): the generation moves.
        fn write(&self, table: &str, text: Option<&str>) {
            let mut tables = self.tables.lock().expect("lock");
            match text {
                Some(t) => tables.insert(table.into(), t.into()),
                None => tables.remove(table),
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

        fn list(&self, family: &str, name: &str) -> Result<Option<String>, DataplaneError> {
            let key = format!("{family} {name}");
            self.listed.lock().expect("lock").push(key.clone());
            Ok(self.tables.lock().expect("lock").get(&key).cloned())
        }
    }

    fn recorded(nft: &Fake) -> Vec<OwnedTable> {
        nft.write(
            "inet calix-antispoof",
            Some("table inet calix-antispoof {}"),
        );
        let a = OwnedTable::record_with(nft, "inet", "calix-antispoof").expect("record");
        nft.write("inet calix-doors", Some("table inet calix-doors {}"));
        let d = OwnedTable::record_with(nft, "inet", "calix-doors").expect("record");
        nft.listings();
        vec![a, d]
    }

    fn kinds(d: &[crate::dataplane::Drift]) -> Vec<String> {
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
        nft.write("ip kube-proxy", Some("table ip kube-proxy {}"));
        assert!(drift_with(&nft, &tables).expect("drift").is_empty());
        assert_eq!(nft.listings(), 2);
        assert!(drift_with(&nft, &tables).expect("drift").is_empty());
        assert_eq!(nft.listings(), 0);
        // One of ours flushed, the other deleted: drift at every pass until written again.
        nft.write(
            "inet calix-antispoof",
            Some("table inet calix-antispoof { flushed }"),
        );
        nft.write("inet calix-doors", None);
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
        nft.write("inet calix-doors", None);
        assert_eq!(
            kinds(&drift_with(&nft, &tables).expect("drift")),
            ["nftables table inet calix-doors is missing"]
        );
    }
}
