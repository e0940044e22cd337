//! `calix.v1.Routes` messages ↔ routes: an update is encoded in messages of at most
//! [`CHUNK`] routes, and a receiver reassembles them, checking what the stream promises (a
//! snapshot first, then deltas whose generations follow one another, a bounded number of
//! routes). A route that does not parse is set aside (the engine counts it), not fatal.
use std::net::IpAddr;

use calix_proto::v1 as pb;
use ipnet::IpNet;

use super::engine::PeerEvent;
use super::feed::{Delta, Snapshot};
use super::Route;

/// Routes per message.
pub const CHUNK: usize = 2048;
/// Routes one peer may hold; beyond it the stream is dropped (a reflector of 500 nodes × 200
/// blocks is 100k).
pub const MAX_ROUTES: usize = 262_144;
/// Largest message a receiver takes (a chunk of routes is ~100 KiB).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// A stream that broke its promises: the receiver drops it and reconnects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the stream did not start with a snapshot")]
    NoSnapshot,
    #[error("delta generation {got} does not follow {had}")]
    Generation { had: u64, got: u64 },
    #[error("a continued update changed its kind or generation")]
    BrokenUpdate,
    #[error("update kind {0} is not known")]
    Kind(i32),
    #[error("more than {MAX_ROUTES} routes")]
    TooMany,
}

pub fn to_proto(r: &Route) -> pb::Route {
    pb::Route {
        prefix: r.prefix.to_string(),
        node: r.node.clone(),
        next_hop: r.next_hop.to_string(),
    }
}

/// A route from the wire: a prefix without host bits, a node name, an address.
pub fn from_proto(r: &pb::Route) -> Result<Route, String> {
    let bad = || format!("{} {} via {}", r.prefix, r.node, r.next_hop);
    let prefix: IpNet = r.prefix.parse().map_err(|_| bad())?;
    let next_hop: IpAddr = r.next_hop.parse().map_err(|_| bad())?;
    if prefix != prefix.trunc() || r.node.is_empty() || r.node.len() > 253 {
        return Err(bad());
    }
    Ok(Route {
        prefix,
        node: r.node.clone(),
        next_hop,
    })
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

/// Reassembles one stream's messages into updates.
#[derive(Debug, Default)]
pub struct Assembler {
    /// The generation of the last complete update.
    generation: Option<u64>,
    partial: Option<Partial>,
    /// Routes the peer holds, as far as this stream tells (snapshot + adds − withdrawals).
    held: usize,
}

#[derive(Debug)]
struct Partial {
    kind: i32,
    generation: u64,
    routes: Vec<Route>,
    withdrawn: Vec<IpNet>,
    malformed: Vec<String>,
}

impl Assembler {
    /// Takes one message; returns the update it completes, if it does.
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
        let p = self.partial.get_or_insert_with(|| Partial {
            kind: m.kind,
            generation: m.generation,
            routes: Vec::new(),
            withdrawn: Vec::new(),
            malformed: Vec::new(),
        });
        for r in &m.routes {
            match from_proto(r) {
                Ok(r) => p.routes.push(r),
                Err(text) => p.malformed.push(text),
            }
        }
        for w in &m.withdrawn {
            match w.parse::<IpNet>() {
                Ok(n) => p.withdrawn.push(n),
                Err(_) => p.malformed.push(format!("withdrawn {w}")),
            }
        }
        let base = if kind == Kind::Snapshot { 0 } else { self.held };
        if base + p.routes.len() > MAX_ROUTES {
            return Err(WireError::TooMany);
        }
        if m.more {
            return Ok(None);
        }
        let Some(p) = self.partial.take() else {
            return Ok(None);
        };
        self.generation = Some(p.generation);
        Ok(Some(if kind == Kind::Snapshot {
            self.held = p.routes.len();
            PeerEvent::Snapshot {
                generation: p.generation,
                routes: p.routes,
                malformed: p.malformed,
            }
        } else {
            // An upper bound: changed routes count as added.
            self.held = (self.held + p.routes.len()).saturating_sub(p.withdrawn.len());
            PeerEvent::Delta {
                generation: p.generation,
                routes: p.routes,
                withdrawn: p.withdrawn,
                malformed: p.malformed,
            }
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
                malformed,
            })) => {
                assert_eq!(routes, snap.routes);
                assert!(malformed.is_empty());
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
            Ok(Some(PeerEvent::Snapshot {
                routes, malformed, ..
            })) => {
                assert_eq!(routes.len(), 1);
                assert_eq!(malformed.len(), 3);
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
            m.more = true;
        };
        assert_eq!(err, WireError::TooMany);
        assert_eq!(n, MAX_ROUTES / CHUNK);
    }
}
