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
mod bounds_tests;
#[cfg(test)]
mod tests;
