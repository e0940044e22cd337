//! `calix.v1.Routes` messages ↔ routes: an update is encoded in messages of at most
//! [`CHUNK`] routes, and a receiver reassembles them, checking what the stream promises (a
//! snapshot first, then deltas whose generations follow one another) and bounding what one
//! peer can make it hold ([`Limits`]): the routes it holds and their bytes, exactly, and each
//! update's bytes and messages. Breaking one drops the stream ([`WireError`]). A route that
//! does not parse, and a withdrawal of a prefix the peer does not hold, are set aside and
//! counted ([`Unused`]: a count and a few examples, never every text), not fatal.
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

pub use calix_proto::v1 as pb;
use ipnet::IpNet;
use prost::Message as _;

use crate::update::{Delta, PeerEvent, Snapshot, Unused, WireError};
use crate::Route;

/// Routes per message.
pub const CHUNK: usize = 2048;
/// Routes one peer may hold; beyond it the stream is dropped (a reflector of 500 nodes × 200
/// blocks is 100k).
pub const MAX_ROUTES: usize = 262_144;
/// Bytes of the routes one peer may hold (each route's encoded size): [`MAX_ROUTES`] routes
/// of 256 bytes (a route of a 20-character node name is ~45).
pub const MAX_HELD_BYTES: usize = 64 * 1024 * 1024;
/// Bytes of one update, over all its messages: a snapshot at both caps above fits.
pub const MAX_UPDATE_BYTES: usize = 80 * 1024 * 1024;
/// Messages of one update: one of [`MAX_ROUTES`] routes and as many withdrawals is 256.
pub const MAX_PARTS: usize = 1024;
/// Largest message a receiver takes (a chunk of routes is ~100 KiB).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Characters kept of each field of a malformed entry's text.
pub const EXAMPLE_CHARS: usize = 64;

/// What one peer's stream may make the receiver hold ([`Assembler::with_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Routes the peer holds.
    pub routes: usize,
    /// Bytes of the routes it holds.
    pub held_bytes: usize,
    /// Bytes of one update, over all its messages.
    pub update_bytes: usize,
    /// Messages of one update.
    pub parts: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            routes: MAX_ROUTES,
            held_bytes: MAX_HELD_BYTES,
            update_bytes: MAX_UPDATE_BYTES,
            parts: MAX_PARTS,
        }
    }
}

pub fn to_proto(r: &Route) -> pb::Route {
    pb::Route {
        prefix: r.prefix.to_string(),
        node: r.node.clone(),
        next_hop: r.next_hop.to_string(),
    }
}

/// A route from the wire: a prefix without host bits, a node name, an address. `None` for
/// anything else ([`example`] says what it was).
pub fn from_proto(r: &pb::Route) -> Option<Route> {
    let prefix: IpNet = r.prefix.parse().ok()?;
    let next_hop: IpAddr = r.next_hop.parse().ok()?;
    if prefix != prefix.trunc() || r.node.is_empty() || r.node.len() > 253 {
        return None;
    }
    Some(Route {
        prefix,
        node: r.node.clone(),
        next_hop,
    })
}

/// What a malformed route looked like, each field cut to [`EXAMPLE_CHARS`].
pub fn example(r: &pb::Route) -> String {
    format!(
        "{} {} via {}",
        cut(&r.prefix),
        cut(&r.node),
        cut(&r.next_hop)
    )
}

/// `s` cut to [`EXAMPLE_CHARS`] characters ("…" marks the cut).
fn cut(s: &str) -> String {
    match s.char_indices().nth(EXAMPLE_CHARS) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

fn chunks(
    kind: pb::route_update::Kind,
    generation: u64,
    routes: &[Route],
    withdrawn: &[IpNet],
) -> Vec<pb::RouteUpdate> {
    let mut out = Vec::new();
    let (mut routes, mut withdrawn) = (routes, withdrawn);
    loop {
        let (r, rest) = routes.split_at(routes.len().min(CHUNK));
        routes = rest;
        let (w, rest) = withdrawn.split_at(withdrawn.len().min(CHUNK - r.len()));
        withdrawn = rest;
        out.push(pb::RouteUpdate {
            kind: kind as i32,
            generation,
            routes: r.iter().map(to_proto).collect(),
            withdrawn: w.iter().map(ToString::to_string).collect(),
            more: false,
        });
        if routes.is_empty() && withdrawn.is_empty() {
            break;
        }
    }
    let n = out.len();
    for m in &mut out[..n - 1] {
        m.more = true;
    }
    out
}

pub fn encode_snapshot(s: &Snapshot) -> Vec<pb::RouteUpdate> {
    chunks(
        pb::route_update::Kind::Snapshot,
        s.generation,
        &s.routes,
        &[],
    )
}

pub fn encode_delta(d: &Delta) -> Vec<pb::RouteUpdate> {
    chunks(
        pb::route_update::Kind::Delta,
        d.generation,
        &d.routes,
        &d.withdrawn,
    )
}

/// Reassembles one stream's messages into updates, within [`Limits`]: it knows which prefixes
/// the peer holds (and the size of each), so what the peer holds is counted exactly — a
/// re-announced prefix is not a new one, a withdrawal of a prefix the peer does not hold is
/// ignored (and counted in [`Unused`]) — and an update is refused as soon as applying it
/// would break a limit, or it grows past its own.
#[derive(Debug, Default)]
pub struct Assembler {
    limits: Limits,
    /// The generation of the last complete update.
    generation: Option<u64>,
    partial: Option<Partial>,
    /// Each prefix the peer holds (snapshot + deltas), with its route's encoded size.
    held: HashMap<IpNet, usize>,
    /// The sum of those sizes.
    held_bytes: usize,
}

/// An update being reassembled.
#[derive(Debug)]
struct Partial {
    snapshot: bool,
    kind: i32,
    generation: u64,
    /// Messages and bytes so far.
    parts: usize,
    bytes: usize,
    /// Routes announced, each prefix once (the last announcement wins), with their sizes.
    routes: Vec<(Route, usize)>,
    index: HashMap<IpNet, usize>,
    /// Held prefixes withdrawn (each once); an announcement in the same update wins.
    withdrawn: Vec<IpNet>,
    withdrawn_set: HashSet<IpNet>,
    unused: Unused,
    /// Routes and bytes the peer holds once this update applies.
    count: usize,
    count_bytes: usize,
}

impl Partial {
    /// The size of `p`'s route once what arrived so far applies (`None`: not held).
    fn state(&self, held: &HashMap<IpNet, usize>, p: &IpNet) -> Option<usize> {
        if let Some(&i) = self.index.get(p) {
            return Some(self.routes[i].1);
        }
        if self.snapshot || self.withdrawn_set.contains(p) {
            return None;
        }
        held.get(p).copied()
    }

    fn became(&mut self, before: Option<usize>, after: Option<usize>) {
        self.count = self.count + usize::from(after.is_some()) - usize::from(before.is_some());
        self.count_bytes = self.count_bytes + after.unwrap_or(0) - before.unwrap_or(0);
    }

    fn announce(&mut self, held: &HashMap<IpNet, usize>, route: Route, size: usize) {
        let before = self.state(held, &route.prefix);
        match self.index.get(&route.prefix) {
            Some(&i) => self.routes[i] = (route, size),
            None => {
                self.index.insert(route.prefix, self.routes.len());
                self.routes.push((route, size));
            }
        }
        self.became(before, Some(size));
    }

    fn withdraw(&mut self, held: &HashMap<IpNet, usize>, p: IpNet) {
        if self.snapshot || !held.contains_key(&p) {
            self.unused.unknown_withdrawals += 1;
            return;
        }
        if !self.withdrawn_set.insert(p) {
            // Withdrawn already in this update.
            self.unused.unknown_withdrawals += 1;
            return;
        }
        self.withdrawn.push(p);
        if !self.index.contains_key(&p) {
            let before = held.get(&p).copied();
            self.became(before, None);
        }
    }
}

impl Assembler {
    pub fn with_limits(limits: Limits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// Routes the peer holds.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Bytes of the routes it holds.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Messages and bytes of the update under way, if one is.
    pub fn pending(&self) -> Option<(usize, usize)> {
        self.partial.as_ref().map(|p| (p.parts, p.bytes))
    }

    /// Takes one message; returns the update it completes, if it does. After an error the
    /// stream is to be dropped (the assembler with it).
    pub fn push(&mut self, m: pb::RouteUpdate) -> Result<Option<PeerEvent>, WireError> {
        use pb::route_update::Kind;
        let kind = Kind::try_from(m.kind).map_err(|_| WireError::Kind(m.kind))?;
        match (kind, self.generation, &self.partial) {
            (Kind::Unspecified, ..) => return Err(WireError::Kind(m.kind)),
            (Kind::Delta, None, None) => return Err(WireError::NoSnapshot),
            (_, _, Some(p)) if p.kind != m.kind || p.generation != m.generation => {
                return Err(WireError::BrokenUpdate)
            }
            (Kind::Delta, Some(had), None) if m.generation != had.wrapping_add(1) => {
                return Err(WireError::Generation {
                    had,
                    got: m.generation,
                })
            }
            _ => {}
        }
        let snapshot = kind == Kind::Snapshot;
        let (held_len, held_bytes) = (self.held.len(), self.held_bytes);
        let p = self.partial.get_or_insert_with(|| Partial {
            snapshot,
            kind: m.kind,
            generation: m.generation,
            parts: 0,
            bytes: 0,
            routes: Vec::new(),
            index: HashMap::new(),
            withdrawn: Vec::new(),
            withdrawn_set: HashSet::new(),
            unused: Unused::default(),
            count: if snapshot { 0 } else { held_len },
            count_bytes: if snapshot { 0 } else { held_bytes },
        });
        p.parts += 1;
        p.bytes = p.bytes.saturating_add(m.encoded_len());
        let limits = self.limits;
        if p.parts > limits.parts {
            return Err(WireError::UpdateParts {
                limit: limits.parts,
            });
        }
        if p.bytes > limits.update_bytes {
            return Err(WireError::UpdateBytes {
                limit: limits.update_bytes,
            });
        }
        for r in &m.routes {
            match from_proto(r) {
                Some(route) => p.announce(&self.held, route, r.encoded_len()),
                None => p.unused.add_malformed(|| example(r)),
            }
        }
        for w in &m.withdrawn {
            match w.parse::<IpNet>() {
                Ok(n) => p.withdraw(&self.held, n),
                Err(_) => p.unused.add_malformed(|| format!("withdrawn {}", cut(w))),
            }
        }
        if p.count > limits.routes {
            return Err(WireError::TooMany {
                limit: limits.routes,
            });
        }
        if p.count_bytes > limits.held_bytes {
            return Err(WireError::HeldBytes {
                limit: limits.held_bytes,
            });
        }
        if m.more {
            return Ok(None);
        }
        let Some(p) = self.partial.take() else {
            return Ok(None);
        };
        self.generation = Some(p.generation);
        self.held_bytes = p.count_bytes;
        if p.snapshot {
            self.held = p.routes.iter().map(|(r, s)| (r.prefix, *s)).collect();
            return Ok(Some(PeerEvent::Snapshot {
                generation: p.generation,
                routes: p.routes.into_iter().map(|(r, _)| r).collect(),
                unused: p.unused,
            }));
        }
        let withdrawn: Vec<IpNet> = p
            .withdrawn
            .into_iter()
            .filter(|w| !p.index.contains_key(w))
            .collect();
        for w in &withdrawn {
            self.held.remove(w);
        }
        for (r, s) in &p.routes {
            self.held.insert(r.prefix, *s);
        }
        debug_assert_eq!(self.held.len(), p.count);
        Ok(Some(PeerEvent::Delta {
            generation: p.generation,
            routes: p.routes.into_iter().map(|(r, _)| r).collect(),
            withdrawn,
            unused: p.unused,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(i: u32) -> Route {
        Route {
            prefix: IpNet::new(
                IpAddr::from([10, (i >> 16) as u8, (i >> 8) as u8, i as u8]),
                32,
            )
            .expect("net"),
            node: "b".into(),
            next_hop: "192.0.2.2".parse().expect("ip"),
        }
    }

    #[test]
    fn a_large_snapshot_spans_messages_and_comes_back_whole() {
        let snap = Snapshot {
            generation: 7,
            routes: (0..5000).map(route).collect(),
        };
        let msgs = encode_snapshot(&snap);
        assert_eq!(msgs.len(), 3);
        assert!(msgs[0].more && msgs[1].more && !msgs[2].more);
        let mut a = Assembler::default();
        assert_eq!(a.push(msgs[0].clone()), Ok(None));
        assert_eq!(a.push(msgs[1].clone()), Ok(None));
        match a.push(msgs[2].clone()) {
            Ok(Some(PeerEvent::Snapshot {
                generation: 7,
                routes,
                unused,
            })) => {
                assert_eq!(routes, snap.routes);
                assert_eq!(unused, Unused::default());
            }
            other => panic!("{other:?}"),
        }
        // An empty snapshot is one message.
        let empty = encode_snapshot(&Snapshot {
            generation: 1,
            routes: vec![],
        });
        assert_eq!(empty.len(), 1);
        assert!(!empty[0].more);
    }

    #[test]
    fn deltas_must_follow_the_snapshot_generation_by_generation() {
        let mut a = Assembler::default();
        let d = |g: u64| {
            encode_delta(&Delta {
                generation: g,
                routes: vec![route(1)],
                withdrawn: vec![route(2).prefix],
            })
        };
        assert_eq!(a.push(d(3)[0].clone()), Err(WireError::NoSnapshot));
        let mut a = Assembler::default();
        let snap = encode_snapshot(&Snapshot {
            generation: 3,
            routes: vec![route(2)],
        });
        assert!(a.push(snap[0].clone()).expect("snapshot").is_some());
        match a.push(d(4)[0].clone()) {
            Ok(Some(PeerEvent::Delta {
                generation: 4,
                routes,
                withdrawn,
                ..
            })) => {
                assert_eq!(routes, vec![route(1)]);
                assert_eq!(withdrawn, vec![route(2).prefix]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            a.push(d(6)[0].clone()),
            Err(WireError::Generation { had: 4, got: 6 })
        );
    }

    #[test]
    fn bad_streams_and_bad_routes() {
        let mut a = Assembler::default();
        let mut m = encode_snapshot(&Snapshot {
            generation: 1,
            routes: vec![route(1)],
        })
        .remove(0);
        m.kind = 0;
        assert_eq!(a.push(m.clone()), Err(WireError::Kind(0)));
        m.kind = 77;
        assert_eq!(a.push(m), Err(WireError::Kind(77)));
        // A continued update that changes generation.
        let mut msgs = encode_snapshot(&Snapshot {
            generation: 1,
            routes: (0..3000).map(route).collect(),
        });
        msgs[1].generation = 2;
        let mut a = Assembler::default();
        a.push(msgs[0].clone()).expect("first part");
        assert_eq!(a.push(msgs[1].clone()), Err(WireError::BrokenUpdate));
        // Malformed routes are set aside.
        let mut a = Assembler::default();
        let bad = pb::RouteUpdate {
            kind: pb::route_update::Kind::Snapshot as i32,
            generation: 1,
            routes: vec![
                to_proto(&route(1)),
                pb::Route {
                    prefix: "10.0.0.1/24".into(), // host bits
                    node: "b".into(),
                    next_hop: "192.0.2.2".into(),
                },
                pb::Route {
                    prefix: "10.0.0.0/24".into(),
                    node: "b".into(),
                    next_hop: "gateway".into(),
                },
                pb::Route {
                    prefix: "10.0.0.0/24".into(),
                    node: String::new(),
                    next_hop: "192.0.2.2".into(),
                },
            ],
            withdrawn: vec![],
            more: false,
        };
        match a.push(bad) {
            Ok(Some(PeerEvent::Snapshot { routes, unused, .. })) => {
                assert_eq!(routes.len(), 1);
                assert_eq!(unused.malformed, 3);
                assert_eq!(
                    unused.examples,
                    [
                        "10.0.0.1/24 b via 192.0.2.2",
                        "10.0.0.0/24 b via gateway",
                        "10.0.0.0/24  via 192.0.2.2"
                    ]
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_peer_cannot_make_this_agent_hold_unbounded_routes() {
        let mut a = Assembler::default();
        let mut m = pb::RouteUpdate {
            kind: pb::route_update::Kind::Snapshot as i32,
            generation: 1,
            routes: (0..CHUNK as u32).map(|i| to_proto(&route(i))).collect(),
            withdrawn: vec![],
            more: true,
        };
        let mut n = 0;
        let err = loop {
            match a.push(m.clone()) {
                Ok(_) => n += 1,
                Err(e) => break e,
            }
            // New routes each time (the same ones again would not be more).
            m.routes = (0..CHUNK as u32)
                .map(|i| to_proto(&route((n + 1) * CHUNK as u32 + i)))
                .collect();
        };
        assert_eq!(err, WireError::TooMany { limit: MAX_ROUTES });
        assert_eq!(n as usize, MAX_ROUTES / CHUNK);
    }
}

#[cfg(test)]
mod bounds {
    //! What one peer can make this agent hold (issue 20, item 4).
    use super::*;

    fn route(i: u32) -> Route {
        Route {
            prefix: IpNet::new(
                IpAddr::from(0x0a00_0000u32.wrapping_add(i).to_be_bytes()),
                32,
            )
            .expect("net"),
            node: "b".into(),
            next_hop: "192.0.2.2".parse().expect("ip"),
        }
    }

    fn msg(kind: pb::route_update::Kind, generation: u64, more: bool) -> pb::RouteUpdate {
        pb::RouteUpdate {
            kind: kind as i32,
            generation,
            routes: vec![],
            withdrawn: vec![],
            more,
        }
    }

    /// An assembler that took a snapshot of `n` routes (route(0)..route(n)) at generation 1.
    fn holding(n: u32) -> Assembler {
        let mut a = Assembler::default();
        let snap = Snapshot {
            generation: 1,
            routes: (0..n).map(route).collect(),
        };
        let mut last = None;
        for m in encode_snapshot(&snap) {
            last = a.push(m).expect("snapshot part");
        }
        assert!(matches!(last, Some(PeerEvent::Snapshot { .. })));
        a
    }

    #[test]
    fn a_withdrawal_of_a_prefix_never_announced_does_not_lower_held() {
        let mut a = holding(MAX_ROUTES as u32);
        // Withdrawals of prefixes the peer never announced...
        let unknown: Vec<IpNet> = (0..CHUNK as u32)
            .map(|i| route(MAX_ROUTES as u32 + 1_000_000 + i).prefix)
            .collect();
        for m in encode_delta(&Delta {
            generation: 2,
            routes: vec![],
            withdrawn: unknown,
        }) {
            a.push(m).expect("unknown withdrawals are not an error");
        }
        // ...leave no room for new routes: the peer still holds MAX_ROUTES.
        let new: Vec<Route> = (0..CHUNK as u32)
            .map(|i| route(MAX_ROUTES as u32 + i))
            .collect();
        let msgs = encode_delta(&Delta {
            generation: 3,
            routes: new,
            withdrawn: vec![],
        });
        let got: Vec<_> = msgs.into_iter().map(|m| a.push(m)).collect();
        assert!(
            got.contains(&Err(WireError::TooMany { limit: MAX_ROUTES })),
            "a peer holding {MAX_ROUTES} routes added {CHUNK} more after withdrawing prefixes it never announced"
        );
        assert_eq!(a.held(), MAX_ROUTES);
    }

    #[test]
    fn a_re_announced_prefix_does_not_raise_held() {
        let mut a = holding(MAX_ROUTES as u32);
        for g in 2..5u64 {
            let mut r = route(7);
            r.next_hop = IpAddr::from([192, 0, 2, g as u8]);
            let m = encode_delta(&Delta {
                generation: g,
                routes: vec![r],
                withdrawn: vec![],
            });
            assert!(
                matches!(a.push(m[0].clone()), Ok(Some(PeerEvent::Delta { .. }))),
                "re-announcing a held prefix (generation {g}) counted as a new route"
            );
        }
        assert_eq!(a.held(), MAX_ROUTES);
    }

    #[test]
    fn malformed_entries_are_counted_not_kept() {
        let mut a = holding(1);
        let bad = pb::Route {
            prefix: "10.0.0.1/24".into(),
            node: "b".into(),
            next_hop: "192.0.2.2".into(),
        };
        let mut m = msg(pb::route_update::Kind::Delta, 2, true);
        m.routes = vec![bad; CHUNK];
        for _ in 0..99 {
            assert_eq!(a.push(m.clone()), Ok(None));
        }
        m.more = false;
        match a.push(m) {
            Ok(Some(PeerEvent::Delta { unused, .. })) => {
                assert_eq!(unused.malformed, 100 * CHUNK as u64);
                assert_eq!(unused.examples.len(), crate::update::MALFORMED_EXAMPLES);
            }
            other => panic!("{other:?}"),
        }
        // An example is cut short, whatever the entry's size.
        let mut a = holding(1);
        let mut m = msg(pb::route_update::Kind::Delta, 2, false);
        m.routes = vec![pb::Route {
            prefix: "p".repeat(1 << 20),
            node: "é".repeat(1 << 19),
            next_hop: String::new(),
        }];
        m.withdrawn = vec!["w".repeat(1 << 20)];
        match a.push(m) {
            Ok(Some(PeerEvent::Delta { unused, .. })) => {
                assert_eq!(unused.malformed, 2);
                assert!(
                    unused
                        .examples
                        .iter()
                        .all(|e| e.chars().count() < 4 * EXAMPLE_CHARS),
                    "{:?}",
                    unused.examples
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_update_is_bounded_in_bytes_across_its_messages() {
        let mut a = holding(1);
        // A message of 1 MiB (under the per-message limit), again and again, never finished.
        let mut m = msg(pb::route_update::Kind::Delta, 2, true);
        m.withdrawn = vec!["x".repeat(1 << 20)];
        let n = (0..100).take_while(|_| a.push(m.clone()).is_ok()).count();
        assert!(n < 100, "{n} MiB of one update taken without an error");
        assert_eq!(
            n,
            MAX_UPDATE_BYTES / (1 << 20) - 1,
            "the last MiB holds the headers"
        );
        assert_eq!(
            a.push(m),
            Err(WireError::UpdateBytes {
                limit: MAX_UPDATE_BYTES
            })
        );
    }

    #[test]
    fn an_update_is_bounded_in_messages() {
        let mut a = holding(1);
        let m = msg(pb::route_update::Kind::Delta, 2, true);
        let n = (0..100_000)
            .take_while(|_| a.push(m.clone()).is_ok())
            .count();
        assert!(n < 100_000, "{n} empty messages of one update taken");
        assert_eq!(n, MAX_PARTS);
        assert_eq!(a.push(m), Err(WireError::UpdateParts { limit: MAX_PARTS }));
    }

    #[test]
    fn withdrawals_of_prefixes_not_held_are_ignored() {
        let mut a = holding(2);
        let m = encode_delta(&Delta {
            generation: 2,
            routes: vec![],
            withdrawn: vec![route(1).prefix, route(99).prefix, route(1).prefix],
        });
        match a.push(m[0].clone()) {
            Ok(Some(PeerEvent::Delta {
                withdrawn, unused, ..
            })) => {
                assert_eq!(withdrawn, vec![route(1).prefix], "only what the peer holds");
                assert_eq!(
                    unused.unknown_withdrawals, 2,
                    "never announced, and already withdrawn"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.held(), 1);
        // A snapshot holds nothing before it: its withdrawals are all unknown.
        let mut m = msg(pb::route_update::Kind::Snapshot, 9, false);
        m.withdrawn = vec![route(0).prefix.to_string()];
        match a.push(m) {
            Ok(Some(PeerEvent::Snapshot { routes, unused, .. })) => {
                assert!(routes.is_empty());
                assert_eq!(unused.unknown_withdrawals, 1);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.held(), 0);
    }

    /// What the peer holds is counted exactly, bytes too, whatever the order of announcements
    /// and withdrawals within an update; an announcement wins over a withdrawal of the same
    /// prefix in one delta (as the session applies it).
    #[test]
    fn held_routes_and_bytes_are_exact() {
        let limits = Limits {
            routes: 3,
            held_bytes: 1 << 20,
            ..Limits::default()
        };
        let mut a = Assembler::with_limits(limits);
        let size = |r: &Route| to_proto(r).encoded_len();
        let snap = encode_snapshot(&Snapshot {
            generation: 1,
            routes: vec![route(0), route(1), route(2)],
        });
        a.push(snap[0].clone()).expect("snapshot");
        assert_eq!(a.held(), 3);
        assert_eq!(a.held_bytes(), 3 * size(&route(0)));
        // One message withdraws 0 and re-announces it, withdraws 1 and announces 3.
        let mut m = msg(pb::route_update::Kind::Delta, 2, false);
        m.withdrawn = [0, 1].map(|i| route(i).prefix.to_string()).to_vec();
        let mut longer = route(0);
        longer.node = "a-longer-name".into();
        m.routes = vec![to_proto(&longer), to_proto(&route(3))];
        match a.push(m) {
            Ok(Some(PeerEvent::Delta {
                routes, withdrawn, ..
            })) => {
                assert_eq!(routes, vec![longer.clone(), route(3)]);
                assert_eq!(withdrawn, vec![route(1).prefix]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.held(), 3);
        assert_eq!(a.held_bytes(), size(&longer) + 2 * size(&route(0)));
        // A fourth route breaks the limit, even announced twice within one update.
        let m = encode_delta(&Delta {
            generation: 3,
            routes: vec![route(4), route(4)],
            withdrawn: vec![],
        });
        assert_eq!(a.push(m[0].clone()), Err(WireError::TooMany { limit: 3 }));
        // Bytes: a peer holding few routes of long names breaks the bytes limit.
        let mut a = Assembler::with_limits(Limits {
            held_bytes: 1000,
            ..Limits::default()
        });
        let mut big = route(0);
        big.node = "n".repeat(253);
        let m = encode_snapshot(&Snapshot {
            generation: 1,
            routes: (0..4)
                .map(|i| Route {
                    prefix: route(i).prefix,
                    ..big.clone()
                })
                .collect(),
        });
        assert_eq!(
            a.push(m[0].clone()),
            Err(WireError::HeldBytes { limit: 1000 })
        );
    }
}
