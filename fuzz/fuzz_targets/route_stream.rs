//! Fuzzes the decoder of a peer's route stream (calix-core's `wire::Assembler`): what a
//! follower does with every `calix.v1.RouteUpdate` a peer sends, from protobuf bytes on.
//!
//! Input layout: one byte of limits (even: small ones, so that the fuzzer reaches every bound;
//! odd: the defaults), then messages, each a little-endian `u16` length and that many bytes of
//! protobuf. A message that does not decode, or that the assembler refuses, ends the stream:
//! the next message starts a new one (the follower reconnects), with a new assembler.
//!
//! Checked besides "no panic", after every message: the routes the peer holds never exceed the
//! bound, their bytes neither; an update under way is within its messages and bytes; what the
//! assembler says the peer holds is exactly what applying its updates gives (a model applies
//! them the way the session does: a withdrawal names a held prefix, an announcement in a delta
//! is not also withdrawn in it, a snapshot's and a delta's prefixes are distinct); malformed
//! entries keep a few short examples only; and a snapshot re-encoded by the agent's encoder
//! is reassembled into the same routes.
#![no_main]

use std::collections::{BTreeMap, HashSet};

use calix_core::update::{PeerEvent, Snapshot, Unused, MALFORMED_EXAMPLES};
use calix_core::wire::{self, pb, Assembler, Limits};
use calix_core::Route;
use ipnet::IpNet;
use libfuzzer_sys::fuzz_target;
use prost::Message;

const SMALL: Limits = Limits {
    routes: 8,
    held_bytes: 512,
    update_bytes: 2048,
    parts: 6,
};

fuzz_target!(|data: &[u8]| {
    let Some((&choice, mut rest)) = data.split_first() else {
        return;
    };
    let limits = if choice % 2 == 0 {
        SMALL
    } else {
        Limits::default()
    };
    let mut stream = Stream::new(limits);
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        let body = &rest[2..];
        let (m, tail) = body.split_at(len.min(body.len()));
        rest = tail;
        match pb::RouteUpdate::decode(m) {
            Ok(m) => stream.push(m),
            // tonic ends the stream on a message that does not decode.
            Err(_) => stream = Stream::new(limits),
        }
    }
});

/// One stream: the assembler and what applying its updates gives.
struct Stream {
    limits: Limits,
    a: Assembler,
    model: BTreeMap<IpNet, Route>,
}

impl Stream {
    fn new(limits: Limits) -> Self {
        Self {
            limits,
            a: Assembler::with_limits(limits),
            model: BTreeMap::new(),
        }
    }

    fn push(&mut self, m: pb::RouteUpdate) {
        match self.a.push(m) {
            Err(_) => *self = Stream::new(self.limits),
            Ok(None) => {
                let (parts, bytes) = self.a.pending().expect("an update under way");
                assert!(parts <= self.limits.parts, "{parts} messages in one update");
                assert!(
                    bytes <= self.limits.update_bytes,
                    "{bytes} bytes in one update"
                );
            }
            Ok(Some(event)) => {
                assert!(self.a.pending().is_none(), "the update completed");
                self.apply(event);
            }
        }
        let held = self.a.held();
        assert_eq!(held, self.model.len(), "held is what the updates gave");
        assert!(held <= self.limits.routes, "{held} routes held");
        let bytes = self.a.held_bytes();
        assert!(bytes <= self.limits.held_bytes, "{bytes} bytes held");
        assert_eq!(held == 0, bytes == 0, "{held} routes in {bytes} bytes");
    }

    fn apply(&mut self, event: PeerEvent) {
        match event {
            PeerEvent::Snapshot {
                generation,
                routes,
                unused,
            } => {
                check_unused(&unused);
                distinct(&routes);
                self.model = routes.iter().map(|r| (r.prefix, r.clone())).collect();
                reencoded_whole(generation, routes);
            }
            PeerEvent::Delta {
                routes,
                withdrawn,
                unused,
                ..
            } => {
                check_unused(&unused);
                distinct(&routes);
                let announced: HashSet<IpNet> = routes.iter().map(|r| r.prefix).collect();
                let mut seen = HashSet::new();
                for w in &withdrawn {
                    assert!(seen.insert(*w), "{w} withdrawn twice");
                    assert!(!announced.contains(w), "{w} withdrawn and announced");
                    assert!(self.model.remove(w).is_some(), "{w} withdrawn, not held");
                }
                for r in routes {
                    self.model.insert(r.prefix, r);
                }
            }
            PeerEvent::Down { .. } => panic!("the assembler never says down"),
        }
    }
}

fn distinct(routes: &[Route]) {
    let mut seen = HashSet::new();
    for r in routes {
        assert!(seen.insert(r.prefix), "{} twice in one update", r.prefix);
    }
}

fn check_unused(u: &Unused) {
    assert!(u.examples.len() <= MALFORMED_EXAMPLES);
    assert!(u.examples.len() as u64 <= u.malformed);
    // Three fields of at most EXAMPLE_CHARS characters (4 bytes each) and "…".
    let most = 3 * (wire::EXAMPLE_CHARS * 4 + 3) + 16;
    for e in &u.examples {
        assert!(e.len() <= most, "an example of {} bytes", e.len());
    }
}

/// The agent's encoder and a fresh assembler give the snapshot's routes back.
fn reencoded_whole(generation: u64, routes: Vec<Route>) {
    let snap = Snapshot { generation, routes };
    let mut a = Assembler::default();
    let mut got = None;
    for m in wire::encode_snapshot(&snap) {
        got = a.push(m).expect("the encoder's messages are valid");
    }
    match got {
        Some(PeerEvent::Snapshot {
            generation: g,
            routes,
            unused,
        }) => {
            assert_eq!(g, generation);
            assert_eq!(routes, snap.routes);
            assert_eq!(unused, Unused::default());
        }
        other => panic!("{other:?}"),
    }
}
