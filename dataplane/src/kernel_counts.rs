//! Kernel mode's NetworkPolicy counts: the counters of `inet calix_policy`'s rules
//! ([`crate::kernel_policy`]), by endpoint: each entry rule's (comment `rule <n>`) in the
//! chains that judge the packets opening a connection (`<if>_ing`, `<if>_eg`), and each
//! entry chain's closing drop (comment `deny`, replies' chains included).
//!
//! Every change rewrites the table, and a rewritten rule's counter starts from zero; so before
//! each rewrite the counts of the table in force are added to a tally kept here, and a count
//! is the tally plus what the table holds now. The table an agent before left behind names
//! rules by that agent's numbers: its counts are dropped, not added.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use calix_core::policy::tables::RuleId;
use calix_kernel::nft::RuleCount;

use crate::{DataplaneError, PolicyCounts};

/// The comment of an entry rule for rule `n`.
pub fn rule_comment(n: RuleId) -> String {
    format!("rule {n}")
}

/// The comment of an entry chain's closing drop.
pub const DENY_COMMENT: &str = "deny";

/// What one counter counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Hit(RuleId),
    DeniedIngress,
    DeniedEgress,
}

/// The endpoint (its host veth) and what a rule's counter counts; `None` for the other rules.
fn classify(c: &RuleCount) -> Option<(String, Kind)> {
    let (ifname, ingress, reply) = [
        ("_ing_r", true, true),
        ("_eg_r", false, true),
        ("_ing", true, false),
        ("_eg", false, false),
    ]
    .into_iter()
    .find_map(|(suffix, ingress, reply)| Some((c.chain.strip_suffix(suffix)?, ingress, reply)))?;
    let comment = c.comment.as_deref()?;
    let kind = if comment == DENY_COMMENT {
        if ingress {
            Kind::DeniedIngress
        } else {
            Kind::DeniedEgress
        }
    } else if reply {
        return None;
    } else {
        Kind::Hit(comment.strip_prefix("rule ")?.parse().ok()?)
    };
    Some((ifname.to_string(), kind))
}

fn tally_of(counts: &[RuleCount]) -> BTreeMap<(String, Kind), u64> {
    let mut out = BTreeMap::new();
    for c in counts {
        if let Some(k) = classify(c) {
            *out.entry(k).or_insert(0) += c.packets;
        }
    }
    out
}

#[derive(Debug, Default)]
struct Tally {
    /// The counts of the tables rewritten since the agent started.
    base: BTreeMap<(String, Kind), u64>,
    /// Whether this agent has written the table (before: it is an agent before's).
    written: bool,
}

/// The tally, shared by the dataplane (which rewrites the table) and its stats reader.
#[derive(Debug, Clone, Default)]
pub struct KernelCounts(Arc<Mutex<Tally>>);

impl KernelCounts {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rewrites the table with `write`, the counts of the table in force (`read`) kept:
    /// added to the tally once the write succeeded, for the endpoints in `endpoints` (the
    /// others' go with them). No reader sees the counts between the two.
    pub fn rewrite<T>(
        &self,
        read: impl FnOnce() -> Result<Vec<RuleCount>, DataplaneError>,
        endpoints: &BTreeSet<String>,
        write: impl FnOnce() -> Result<T, DataplaneError>,
    ) -> Result<T, DataplaneError> {
        let mut tally = self.lock();
        // A table that cannot be read: its counts are lost, the write goes on.
        let now = if tally.written {
            read().map(|c| tally_of(&c)).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cannot read the policy table's counters");
                BTreeMap::new()
            })
        } else {
            BTreeMap::new()
        };
        let out = write()?;
        tally.written = true;
        for (k, n) in now {
            *tally.base.entry(k).or_insert(0) += n;
        }
        tally
            .base
            .retain(|(ifname, _), _| endpoints.contains(ifname));
        Ok(out)
    }

    /// The counts of the endpoint on `ifname`: the tally plus the table's counters now
    /// (`read`); `None` before this agent wrote the table.
    pub fn of(
        &self,
        ifname: &str,
        read: impl FnOnce() -> Result<Vec<RuleCount>, DataplaneError>,
    ) -> Result<Option<PolicyCounts>, DataplaneError> {
        let tally = self.lock();
        if !tally.written {
            return Ok(None);
        }
        let now = tally_of(&read()?);
        let mut out = PolicyCounts::default();
        let mine = |((i, _), _): &(&(String, Kind), &u64)| i == ifname;
        for ((_, kind), n) in tally.base.iter().chain(now.iter()).filter(mine) {
            match kind {
                Kind::Hit(r) => *out.hits.entry(*r).or_insert(0) += n,
                Kind::DeniedIngress => out.denied_ingress += n,
                Kind::DeniedEgress => out.denied_egress += n,
            }
        }
        Ok(Some(out))
    }
}

impl KernelCounts {
    /// Packets denied (to the pod, from it) for each endpoint of `ifnames`, in order: the
    /// tally plus one read of the table's counters (`read`).
    pub fn denied(
        &self,
        ifnames: &[&str],
        read: impl FnOnce() -> Result<Vec<RuleCount>, DataplaneError>,
    ) -> Result<Vec<(u64, u64)>, DataplaneError> {
        let tally = self.lock();
        if !tally.written {
            return Ok(vec![(0, 0); ifnames.len()]);
        }
        let now = tally_of(&read()?);
        let mut by: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for ((ifname, kind), n) in tally.base.iter().chain(now.iter()) {
            let e = by.entry(ifname.as_str()).or_default();
            match kind {
                Kind::DeniedIngress => e.0 += n,
                Kind::DeniedEgress => e.1 += n,
                Kind::Hit(_) => {}
            }
        }
        Ok(ifnames
            .iter()
            .map(|i| by.get(i).copied().unwrap_or_default())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(chain: &str, comment: Option<&str>, packets: u64) -> RuleCount {
        RuleCount {
            chain: chain.into(),
            comment: comment.map(String::from),
            packets,
            bytes: packets * 100,
        }
    }

    #[test]
    fn counts_survive_rewrites_and_an_agent_befores_are_dropped() {
        let counts = KernelCounts::default();
        let eps: BTreeSet<String> = ["cali1".to_string()].into();
        let table = |a: u64, d: u64| {
            vec![
                count("cali1_ing", Some("rule 4"), a),
                // Replies: judged, but not a hit of the rule.
                count("cali1_ing_r", Some("rule 4"), 50),
                count("cali1_ing_r", Some(DENY_COMMENT), 1),
                count("cali1_eg", Some(DENY_COMMENT), d),
                count("cali2_ing", Some("rule 4"), 9),
                count("from_pods", None, 3),
            ]
        };
        assert_eq!(counts.of("cali1", || Ok(table(1, 1))).expect("of"), None);
        // The first write: what the table held (an agent before's) is not added.
        counts
            .rewrite(|| Ok(table(100, 100)), &eps, || Ok(()))
            .expect("write");
        let c = counts
            .of("cali1", || Ok(table(2, 3)))
            .expect("of")
            .expect("some");
        assert_eq!(c.hits, [(4, 2)].into());
        assert_eq!((c.denied_ingress, c.denied_egress), (1, 3));
        // A rewrite keeps what the table counted; a failed one adds nothing.
        counts
            .rewrite(|| Ok(table(2, 3)), &eps, || Ok(()))
            .expect("write");
        let failed: Result<(), _> = counts.rewrite(
            || Ok(table(5, 5)),
            &eps,
            || Err(DataplaneError::Driver("refused".into())),
        );
        assert!(failed.is_err());
        let c = counts
            .of("cali1", || Ok(table(1, 0)))
            .expect("of")
            .expect("some");
        assert_eq!(c.hits, [(4, 3)].into());
        assert_eq!((c.denied_ingress, c.denied_egress), (2, 3));
        assert_eq!(
            counts
                .denied(&["cali1", "cali9"], || Ok(table(1, 0)))
                .expect("denied"),
            vec![(2, 3), (0, 0)]
        );
        // An endpoint that goes takes its counts with it.
        counts
            .rewrite(|| Ok(table(1, 0)), &BTreeSet::new(), || Ok(()))
            .expect("write");
        let c = counts
            .of("cali1", || Ok(Vec::new()))
            .expect("of")
            .expect("some");
        assert_eq!(c, PolicyCounts::default());
    }
}
