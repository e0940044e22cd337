//! Ctrl-C and SIGTERM during a demo or a bench: from [`catch`] on they only set a flag, turned
//! into an error at the next [`check`], so the run stops on its ordinary error path and the test
//! bed's values remove what it created as they drop. (Ctrl-C at a terminal also reaches the
//! children — agents, etcd, a ping — which die and fail the running step: [`check`] then names
//! the interrupt rather than that failure.)
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Result};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// From now on SIGINT and SIGTERM only set the flag [`check`] reads.
pub fn catch() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_interrupt as *const () as libc::sighandler_t) };
    }
}

/// Fails when SIGINT or SIGTERM arrived since [`catch`].
pub fn check() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted (SIGINT or SIGTERM)");
    }
    Ok(())
}
