//! The nftables tables the eBPF dataplane keeps in the host stack: the masquerade of what the
//! programs leave to the stack, the doors, and the pending verdicts of Service traffic.
use super::{DataplaneError, Doors, EbpfDataplane};

impl EbpfDataplane {
    /// Writes the host stack's masquerade table as `stack_nat` says, and the doors' table,
    /// and records them.
    pub(super) fn apply_tables(&mut self) -> Result<(), DataplaneError> {
        self.tables.clear();
        if let Some(n) = &self.stack_nat {
            crate::masquerade::apply_stack(n)?;
            self.tables.push(crate::nft::OwnedTable::record(
                crate::masquerade::FAMILY,
                crate::masquerade::TABLE,
            )?);
        }
        self.apply_doors_table()?;
        self.apply_pending_table()
    }

    /// The pending-verdict table ([`crate::pending`]), with the interfaces whose programs
    /// judge: the uplinks and the host devices attached since the start.
    pub(super) fn apply_pending_table(&mut self) -> Result<(), DataplaneError> {
        self.tables
            .retain(|t| !t.is(crate::pending::FAMILY, crate::pending::TABLE));
        let mut judged = self.cfg.uplinks.clone();
        for dev in &self.host_devs {
            if !judged.contains(dev) {
                judged.push(dev.clone());
            }
        }
        crate::pending::apply(&judged)?;
        self.tables.push(crate::nft::OwnedTable::record(
            crate::pending::FAMILY,
            crate::pending::TABLE,
        )?);
        Ok(())
    }

    pub(super) fn apply_doors_table(&mut self) -> Result<(), DataplaneError> {
        self.tables
            .retain(|t| !t.is(crate::doors::FAMILY, crate::doors::TABLE));
        crate::doors::apply(&Doors::of(&self.cfg.doors, &self.peers))?;
        self.tables.push(crate::nft::OwnedTable::record(
            crate::doors::FAMILY,
            crate::doors::TABLE,
        )?);
        Ok(())
    }
}
