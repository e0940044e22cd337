//! The agent's periodic upkeep of the eBPF dataplane's tables: expired SNAT conntrack
//! flows (`nat::Conntrack`, with the pressure rule) and stack flows the host's conntrack has
//! forgotten (`stack_flows`).
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::nat::{monotonic_ns, Conntrack, NatSettings};
use super::stack_flows::{HostTimeouts, StackFlows, NETFILTER_SYSCTLS};
use super::DataplaneError;

/// Every `cleaner_interval` (every second while the table is under pressure): removes
/// expired SNAT conntrack entries, and the stack flows the host's conntrack has forgotten.
pub fn spawn(pin_dir: PathBuf, settings: NatSettings) {
    tokio::spawn(async move {
        let cfg = settings.program_config(&[]);
        let mut ct: Option<Conntrack> = None;
        let mut stack: Option<StackFlows> = None;
        let mut was_pressed = false;
        let mut overflowing: Vec<u32> = Vec::new();
        let mut wait = Duration::ZERO;
        loop {
            tokio::time::sleep(wait).await;
            if ct.is_none() {
                ct = open_logged("conntrack", || Conntrack::open(&pin_dir));
            }
            if stack.is_none() {
                stack = open_logged("stack flows", || StackFlows::open(&pin_dir));
            }
            let (ct_in, stack_in) = (ct.take(), stack.take());
            let unanswered = settings.pressure_unanswered;
            let pass = tokio::task::spawn_blocking(move || {
                let mut ct_in = ct_in;
                let mut stack_in = stack_in;
                let c = ct_in.as_mut().map(|t| t.clean(&cfg, unanswered));
                let timeouts = HostTimeouts::read(Path::new(NETFILTER_SYSCTLS));
                let now = monotonic_ns();
                let s = stack_in.as_mut().map(|t| t.clean(&timeouts, now));
                (ct_in, stack_in, c, s)
            })
            .await;
            let Ok((ct_out, stack_out, c, s)) = pass else {
                tracing::error!("cleaner pass failed");
                continue;
            };
            (ct, stack) = (ct_out, stack_out);
            let pressed = c.is_some_and(|c| c.pressure);
            if let Some(c) = c {
                if pressed && !was_pressed {
                    tracing::warn!(entries = c.entries, removed = c.removed,
                        "conntrack table under pressure: unanswered flows expire after pressure_unanswered_secs");
                } else if !pressed && was_pressed {
                    tracing::info!(
                        entries = c.entries,
                        "conntrack table no longer under pressure"
                    );
                } else if c.removed > 0 {
                    tracing::debug!(
                        removed = c.removed,
                        entries = c.entries,
                        "conntrack cleaner pass"
                    );
                }
            }
            was_pressed = pressed;
            if let Some(s) = s {
                if s.overflowing != overflowing {
                    if !s.overflowing.is_empty() {
                        tracing::warn!(endpoints = ?s.overflowing,
                            "stack-flow table was full: these endpoints' traffic takes the host stack until their marks expire");
                    }
                    overflowing = s.overflowing.clone();
                }
                if s.removed > 0 || s.cleared > 0 {
                    tracing::debug!(
                        removed = s.removed,
                        marks_cleared = s.cleared,
                        "stack flows cleaned"
                    );
                }
            }
            wait = if pressed {
                settings.cleaner_interval.min(Duration::from_secs(1))
            } else {
                settings.cleaner_interval
            };
        }
    });
}

/// Opens a pinned table with `open`, logging a failure (the next pass tries again).
fn open_logged<T>(what: &str, open: impl FnOnce() -> Result<T, DataplaneError>) -> Option<T> {
    match open() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(table = what, error = %super::error_chain(&e), "cleaner: cannot open the table");
            None
        }
    }
}
