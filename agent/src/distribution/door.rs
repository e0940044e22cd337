//! The door's bookkeeping, shared by the listener (which admits connections), the
//! connections (each holds its slot) and the service (which refuses identities): who is known
//! ([`Known`]), the caps per address ([`PerAddress`], [`Slot`]), what the door saw
//! ([`DoorStats`]) and the throttle of its log lines ([`Throttle`]).
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use calix_core::routes::report::DoorCounts;
use tokio::sync::{watch, OwnedSemaphorePermit};

/// The nodes the datastore records, kept current by the routes task: their names (who may
/// watch) and their addresses (who may connect at all: the door refuses any other source
/// before TLS, see [`super::listener`]).
pub struct Known {
    nodes: RwLock<KnownNodes>,
    /// Turns true at the first [`Known::set`]: until then the door accepts nobody (peers
    /// wait in the backlog), since every source would look unknown.
    listed: watch::Sender<bool>,
}

#[derive(Default)]
struct KnownNodes {
    names: HashSet<String>,
    addresses: HashSet<IpAddr>,
}

impl Default for Known {
    fn default() -> Self {
        Self {
            nodes: RwLock::default(),
            listed: watch::Sender::new(false),
        }
    }
}

impl Known {
    /// Replaces the nodes: their names and every address they are recorded with.
    pub fn set(&self, names: HashSet<String>, addresses: HashSet<IpAddr>) {
        let addresses = addresses.into_iter().map(|a| a.to_canonical()).collect();
        *self.nodes.write().unwrap_or_else(|p| p.into_inner()) = KnownNodes { names, addresses };
        self.listed.send_replace(true);
    }

    pub fn contains(&self, name: &str) -> bool {
        self.read().names.contains(name)
    }

    /// Whether `addr` is an address of a known node (an IPv4-mapped IPv6 address as its IPv4
    /// address).
    pub fn has_address(&self, addr: IpAddr) -> bool {
        self.read().addresses.contains(&addr.to_canonical())
    }

    /// Returns once the nodes have been set at least once.
    pub async fn listed(&self) {
        let mut rx = self.listed.subscribe();
        let _ = rx.wait_for(|l| *l).await;
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, KnownNodes> {
        self.nodes.read().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the door saw.
#[derive(Default)]
pub struct DoorStats {
    pub(super) accepted: AtomicU64,
    pub(super) refused_unknown: AtomicU64,
    pub(super) refused_busy: AtomicU64,
    pub(super) refused_tls: AtomicU64,
    pub(super) refused_identity: AtomicU64,
}

impl DoorStats {
    pub fn refused_identity(&self) {
        self.refused_identity.fetch_add(1, Ordering::Relaxed);
    }

    pub fn counts(&self) -> DoorCounts {
        DoorCounts {
            accepted: self.accepted.load(Ordering::Relaxed),
            refused_unknown: self.refused_unknown.load(Ordering::Relaxed),
            refused_busy: self.refused_busy.load(Ordering::Relaxed),
            refused_tls: self.refused_tls.load(Ordering::Relaxed),
            refused_identity: self.refused_identity.load(Ordering::Relaxed),
        }
    }
}

/// At most [`Throttle::PER_WINDOW`] log lines per window: a flood of bad connections cannot
/// flood the log (they are all counted).
pub struct Throttle {
    state: Mutex<(Instant, u32)>,
}

impl Default for Throttle {
    fn default() -> Self {
        Self {
            state: Mutex::new((Instant::now(), 0)),
        }
    }
}

impl Throttle {
    const PER_WINDOW: u32 = 20;
    const WINDOW: Duration = Duration::from_secs(60);

    pub fn allow(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.0.elapsed() > Self::WINDOW {
            *s = (Instant::now(), 0);
        }
        s.1 += 1;
        if s.1 == Self::PER_WINDOW + 1 {
            tracing::warn!("routes: more refused connections this minute are counted (calixctl nodes, /metrics), not logged");
        }
        s.1 <= Self::PER_WINDOW
    }
}

/// Connections per remote address.
#[derive(Default)]
pub struct PerAddress(Mutex<HashMap<IpAddr, usize>>);

impl PerAddress {
    /// A slot for a connection from `addr` under `permit` (the cap on every connection),
    /// unless `addr` has `max` already.
    pub fn slot(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        addr: IpAddr,
        max: usize,
    ) -> Option<Slot> {
        {
            let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
            let n = m.entry(addr).or_default();
            if *n >= max {
                return None;
            }
            *n += 1;
        }
        Some(Slot {
            _permit: permit,
            addr,
            per: self.clone(),
        })
    }
}

/// A connection's place under the caps; freed on drop.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    addr: IpAddr,
    per: Arc<PerAddress>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = self.per.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.addr);
            }
        }
    }
}
