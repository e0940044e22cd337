//! The nftables tables the eBPF dataplane keeps in the host stack: the masquerade of what the
//! programs leave to the stack, the Services' masquerade (flows from outside to a backend on
//! another node), the doors, and the pending verdicts of Service traffic.
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
        if self.services.is_some() {
            // The host stack's masquerade ports, when they lie above the NodePorts.
            let ports = self
                .stack_nat
                .as_ref()
                .and_then(crate::nat::NatSettings::stack_masquerade_ports)
                .filter(|(lo, _)| *lo > crate::svc_masquerade::NODEPORTS_LAST)
                .unwrap_or(crate::svc_masquerade::DEFAULT_PORTS);
            crate::svc_masquerade::apply(ports)?;
            for family in crate::svc_masquerade::FAMILIES {
                self.tables.push(crate::nft::OwnedTable::record(
                    family,
                    crate::svc_masquerade::TABLE,
                )?);
            }
        } else {
            // Services no longer translated here (a run before had them): its table goes.
            crate::svc_masquerade::remove()?;
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
