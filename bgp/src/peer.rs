//! What a peer has told this speaker, across its connections: the routes it announced (its
//! Adj-RIB-In), which of them the import rule took, graceful restart's stale routes (RFC 4724
//! §4.2, this speaker as the helper), and the prefix limit.
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipnet::IpNet;

use crate::notification::{self, cease, Notification};
use crate::session::Negotiated;
use crate::update::{PathAttributes, Update};
use crate::Family;

/// What happens when a peer announces more prefixes than its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitAction {
    /// The routes past the limit are not taken (counted); the session stays up.
    Refuse,
    /// The session ends with Cease "maximum number of prefixes reached" (RFC 4486) and its
    /// routes go; the caller connects again after its back-off.
    Reset,
}

/// A route the peer announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Learned {
    pub next_hop: IpAddr,
    pub as_path: Vec<u32>,
    pub communities: Vec<u32>,
    /// The import rule took it: it is (or will be) installed.
    pub accepted: bool,
    /// Kept from a connection that went down (graceful restart), until the peer announces it
    /// again, sends its End-of-RIB, or its restart time runs out.
    pub stale: bool,
}

/// A change of the routes to install.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Add(IpNet, IpAddr),
    Remove(IpNet),
}

/// What applying an UPDATE did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub changes: Vec<Change>,
    /// Routes not taken because the limit was reached (`Refuse`).
    pub refused: usize,
    /// The limit was passed with `Reset`: the caller ends the session with this.
    pub reset: Option<Notification>,
    /// An End-of-RIB for this family came in.
    pub end_of_rib: Option<Family>,
}

/// One peer's routes.
#[derive(Debug)]
pub struct PeerRib {
    routes: BTreeMap<IpNet, Learned>,
    max_prefixes: usize,
    action: LimitAction,
    /// While stale routes are kept: when they go.
    stale_deadline: Option<Instant>,
    /// UPDATEs with a malformed attribute (RFC 7606), routes refused over the limit.
    pub malformed_updates: u64,
    pub refused_over_limit: u64,
}

impl PeerRib {
    pub fn new(max_prefixes: usize, action: LimitAction) -> Self {
        Self {
            routes: BTreeMap::new(),
            max_prefixes,
            action,
            stale_deadline: None,
            malformed_updates: 0,
            refused_over_limit: 0,
        }
    }

    /// The routes the peer announced, accepted or not.
    pub fn routes(&self) -> &BTreeMap<IpNet, Learned> {
        &self.routes
    }

    /// How many routes it holds, and how many of them the import rule took.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.routes.len(),
            self.routes.values().filter(|r| r.accepted).count(),
        )
    }

    pub fn stale_count(&self) -> usize {
        self.routes.values().filter(|r| r.stale).count()
    }

    /// Applies an UPDATE; `accept` is the import rule.
    pub fn apply(
        &mut self,
        u: &Update,
        accept: impl Fn(&IpNet, &IpAddr, &PathAttributes) -> bool,
    ) -> Applied {
        let mut applied = Applied {
            end_of_rib: u.end_of_rib,
            ..Applied::default()
        };
        if !u.issues.is_empty() {
            self.malformed_updates += 1;
        }
        for n in &u.withdrawn {
            if let Some(old) = self.routes.remove(n) {
                if old.accepted {
                    applied.changes.push(Change::Remove(*n));
                }
            }
        }
        let as_path: Vec<u32> = u.attributes.asns().collect();
        for (n, nh) in &u.announced {
            if !self.routes.contains_key(n) && self.routes.len() >= self.max_prefixes {
                match self.action {
                    LimitAction::Refuse => {
                        applied.refused += 1;
                        self.refused_over_limit += 1;
                        continue;
                    }
                    LimitAction::Reset => {
                        let f = Family::of(n);
                        let mut data = Vec::with_capacity(7);
                        data.extend_from_slice(&f.afi.to_be_bytes());
                        data.push(f.safi);
                        data.extend_from_slice(&(self.max_prefixes as u32).to_be_bytes());
                        applied.reset = Some(Notification::with_data(
                            notification::CEASE,
                            cease::MAX_PREFIXES,
                            &data,
                        ));
                        return applied;
                    }
                }
            }
            let accepted = accept(n, nh, &u.attributes);
            let new = Learned {
                next_hop: *nh,
                as_path: as_path.clone(),
                communities: u.attributes.communities.clone(),
                accepted,
                stale: false,
            };
            let old = self.routes.insert(*n, new);
            match (old.map(|o| (o.accepted, o.next_hop)), accepted) {
                (Some((true, old_nh)), true) if old_nh == *nh => {}
                (_, true) => applied.changes.push(Change::Add(*n, *nh)),
                (Some((true, _)), false) => applied.changes.push(Change::Remove(*n)),
                (_, false) => {}
            }
        }
        if let Some(f) = u.end_of_rib {
            applied.changes.extend(self.end_of_rib(f));
        }
        applied
    }

    /// The connection went down. Routes of the families the peer's graceful restart
    /// capability covers are kept as stale for its restart time; the others go (and all of
    /// them when the session ended with a NOTIFICATION, `graceful` false: RFC 4724 §4).
    pub fn session_down(
        &mut self,
        now: Instant,
        negotiated: Option<&Negotiated>,
        graceful: bool,
    ) -> Vec<Change> {
        let kept: Vec<Family> = match (graceful, negotiated.and_then(|n| n.peer_restart.as_ref())) {
            (true, Some(gr)) if gr.restart_time > 0 => {
                self.stale_deadline = Some(now + Duration::from_secs(u64::from(gr.restart_time)));
                gr.families.iter().map(|(f, _)| *f).collect()
            }
            _ => Vec::new(),
        };
        let mut changes = Vec::new();
        self.routes.retain(|n, r| {
            if kept.contains(&Family::of(n)) {
                r.stale = true;
                true
            } else {
                if r.accepted {
                    changes.push(Change::Remove(*n));
                }
                false
            }
        });
        if self.stale_count() == 0 {
            self.stale_deadline = None;
        }
        changes
    }

    /// The session is up again: families whose forwarding the peer did not keep (no F bit),
    /// or that its new capability no longer covers, lose their stale routes now (§4.2).
    pub fn session_up(&mut self, negotiated: &Negotiated) -> Vec<Change> {
        let kept: Vec<Family> = negotiated
            .peer_restart
            .as_ref()
            .map(|gr| {
                gr.families
                    .iter()
                    .filter(|(_, fwd)| *fwd)
                    .map(|(f, _)| *f)
                    .collect()
            })
            .unwrap_or_default();
        self.drop_stale(|f| !kept.contains(&f))
    }

    /// The peer's End-of-RIB for `family`: what it did not announce again goes.
    pub fn end_of_rib(&mut self, family: Family) -> Vec<Change> {
        self.drop_stale(|f| f == family)
    }

    /// When the stale routes go, if any are kept.
    pub fn stale_deadline(&self) -> Option<Instant> {
        self.stale_deadline
    }

    /// The restart time ran out: every stale route goes.
    pub fn expire(&mut self, now: Instant) -> Vec<Change> {
        match self.stale_deadline {
            Some(d) if now >= d => self.drop_stale(|_| true),
            _ => Vec::new(),
        }
    }

    /// Every route goes (the peer is removed from the configuration).
    pub fn clear(&mut self) -> Vec<Change> {
        self.stale_deadline = None;
        let out = self
            .routes
            .iter()
            .filter(|(_, r)| r.accepted)
            .map(|(n, _)| Change::Remove(*n))
            .collect();
        self.routes.clear();
        out
    }

    /// The import rule changed: each route judged again.
    pub fn reimport(&mut self, accept: impl Fn(&IpNet, &IpAddr, &[u32]) -> bool) -> Vec<Change> {
        let mut changes = Vec::new();
        for (n, r) in &mut self.routes {
            let now = accept(n, &r.next_hop, &r.as_path);
            if now != r.accepted {
                r.accepted = now;
                changes.push(if now {
                    Change::Add(*n, r.next_hop)
                } else {
                    Change::Remove(*n)
                });
            }
        }
        changes
    }

    fn drop_stale(&mut self, family: impl Fn(Family) -> bool) -> Vec<Change> {
        let mut changes = Vec::new();
        self.routes.retain(|n, r| {
            if r.stale && family(Family::of(n)) {
                if r.accepted {
                    changes.push(Change::Remove(*n));
                }
                false
            } else {
                true
            }
        });
        if self.stale_count() == 0 {
            self.stale_deadline = None;
        }
        changes
    }
}
