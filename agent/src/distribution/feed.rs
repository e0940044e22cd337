//! What this agent serves to its watchers: a set of routes with a generation number. Each
//! change is one delta (routes added or changed, prefixes withdrawn) whose generation is the
//! previous + 1; a new watcher gets a snapshot of the current set and generation, then every
//! delta after it. A watcher that falls behind the broadcast buffer starts again from a
//! snapshot. A feed never published is not ready: its (empty) set is not the truth yet, and
//! [`Feed::ready`] holds watchers until it is.
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ipnet::IpNet;
use tokio::sync::broadcast;

use calix_core::routes::report::Served;
use calix_core::update::{Delta, Snapshot};
use calix_core::Route;

/// Deltas a slow watcher may be behind before it is sent a snapshot instead.
const BUFFER: usize = 1024;

struct Inner {
    generation: u64,
    routes: BTreeMap<IpNet, Route>,
    /// When each route took its current value.
    since: HashMap<IpNet, Instant>,
}

/// A served set of routes.
pub struct Feed {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Delta>>,
    /// Published at least once.
    ready: tokio::sync::watch::Sender<bool>,
}

impl Default for Feed {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                generation: 1,
                routes: BTreeMap::new(),
                since: HashMap::new(),
            }),
            tx: broadcast::channel(BUFFER).0,
            ready: tokio::sync::watch::channel(false).0,
        }
    }
}

impl Feed {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `routes` the set (and the feed ready); returns the delta sent to watchers, if
    /// anything changed.
    pub fn publish(&self, routes: &BTreeMap<IpNet, Route>, now: Instant) -> Option<Arc<Delta>> {
        let delta = self.replace(routes, now);
        self.ready.send_replace(true);
        delta
    }

    /// Waits until the feed has been published, at most `timeout`; returns whether it was.
    pub async fn ready(&self, timeout: std::time::Duration) -> bool {
        let mut rx = self.ready.subscribe();
        let ready = tokio::time::timeout(timeout, rx.wait_for(|r| *r))
            .await
            .is_ok_and(|r| r.is_ok());
        ready
    }

    fn replace(&self, routes: &BTreeMap<IpNet, Route>, now: Instant) -> Option<Arc<Delta>> {
        let mut inner = self.lock();
        let changed: Vec<Route> = routes
            .values()
            .filter(|r| inner.routes.get(&r.prefix) != Some(r))
            .cloned()
            .collect();
        let withdrawn: Vec<IpNet> = inner
            .routes
            .keys()
            .filter(|p| !routes.contains_key(p))
            .copied()
            .collect();
        if changed.is_empty() && withdrawn.is_empty() {
            return None;
        }
        inner.generation += 1;
        for p in &withdrawn {
            inner.routes.remove(p);
            inner.since.remove(p);
        }
        for r in &changed {
            inner.routes.insert(r.prefix, r.clone());
            inner.since.insert(r.prefix, now);
        }
        let delta = Arc::new(Delta {
            generation: inner.generation,
            routes: changed,
            withdrawn,
        });
        // No watcher is fine.
        let _ = self.tx.send(delta.clone());
        Some(delta)
    }

    /// The current set, and every delta after it.
    pub fn subscribe(&self) -> (Snapshot, broadcast::Receiver<Arc<Delta>>) {
        let inner = self.lock();
        // Under the lock: no delta can fall between the snapshot and the receiver.
        let rx = self.tx.subscribe();
        (snapshot(&inner), rx)
    }

    pub fn snapshot(&self) -> Snapshot {
        snapshot(&self.lock())
    }

    /// Each route with when it took its current value.
    pub fn with_ages(&self) -> Vec<(Route, Instant)> {
        let inner = self.lock();
        inner
            .routes
            .values()
            .map(|r| {
                (
                    r.clone(),
                    inner
                        .since
                        .get(&r.prefix)
                        .copied()
                        .unwrap_or(Instant::now()),
                )
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.lock().routes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Watchers subscribed now.
    pub fn watchers(&self) -> usize {
        self.tx.receiver_count()
    }
}

impl Served for Feed {
    fn with_ages(&self) -> Vec<(Route, Instant)> {
        Feed::with_ages(self)
    }

    fn routes(&self) -> usize {
        self.len()
    }

    fn watchers(&self) -> usize {
        Feed::watchers(self)
    }
}

fn snapshot(inner: &Inner) -> Snapshot {
    Snapshot {
        generation: inner.generation,
        routes: inner.routes.values().cloned().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(p: &str, hop: &str) -> Route {
        Route {
            prefix: p.parse().expect("net"),
            node: "a".into(),
            next_hop: hop.parse().expect("ip"),
        }
    }

    fn set(routes: &[Route]) -> BTreeMap<IpNet, Route> {
        routes.iter().map(|r| (r.prefix, r.clone())).collect()
    }

    #[test]
    fn snapshot_then_deltas_with_consecutive_generations() {
        let feed = Feed::default();
        let now = Instant::now();
        let (snap, mut rx) = feed.subscribe();
        assert_eq!((snap.generation, snap.routes.len()), (1, 0));
        let a = route("10.0.0.0/26", "192.0.2.1");
        let b = route("10.0.0.64/26", "192.0.2.1");
        let d = feed
            .publish(&set(&[a.clone(), b.clone()]), now)
            .expect("a change");
        assert_eq!((d.generation, d.routes.len()), (2, 2));
        assert!(
            feed.publish(&set(&[a.clone(), b.clone()]), now).is_none(),
            "no change, no delta"
        );
        // b withdrawn, a's next hop changed: one delta.
        let a2 = route("10.0.0.0/26", "192.0.2.2");
        let d = feed
            .publish(&set(std::slice::from_ref(&a2)), now)
            .expect("a change");
        assert_eq!(d.generation, 3);
        assert_eq!(d.routes, vec![a2.clone()]);
        assert_eq!(d.withdrawn, vec![b.prefix]);
        assert_eq!(rx.try_recv().expect("delta").generation, 2);
        assert_eq!(rx.try_recv().expect("delta").generation, 3);
        assert!(rx.try_recv().is_err());
        // A late watcher: the snapshot at generation 3.
        let (snap, _rx) = feed.subscribe();
        assert_eq!((snap.generation, snap.routes), (3, vec![a2]));
        assert_eq!(feed.watchers(), 2);
    }
}
