//! Fuzzes calix's BGP speaker with what a peer sends: a byte stream cut into messages by
//! `frame_len`, each decoded (`Message::decode`) and fed to a session and the peer's routes
//! (calix-bgp's `Session` and `PeerRib`), as the agent's connection does.
//!
//! Input layout: one byte of settings (bit 0: the session reads 2-octet AS numbers; bit 1:
//! the prefix limit refuses instead of resetting), then the stream. A first OPEN from the
//! fuzzer is needed to reach Established; the seeds start with one.
//!
//! Checked besides "no panic": a framed message is at most 4,096 bytes; what decodes encodes
//! again into a message that frames; the peer never holds more routes than its limit; every
//! route it reports installed is one it holds as accepted; once the session is closed it says
//! nothing more.
#![no_main]

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use calix_bgp::peer::{Change, LimitAction, PeerRib};
use calix_bgp::session::{LocalConfig, Output, Session, State};
use calix_bgp::wire::{frame_len, MAX_LEN};
use calix_bgp::{Family, Message};
use libfuzzer_sys::fuzz_target;

const LIMIT: usize = 64;

fuzz_target!(|data: &[u8]| {
    let Some((&settings, mut stream)) = data.split_first() else {
        return;
    };
    let two_octet = settings & 1 != 0;
    let action = if settings & 2 != 0 {
        LimitAction::Refuse
    } else {
        LimitAction::Reset
    };
    let config = LocalConfig {
        asn: 65001,
        router_id: Ipv4Addr::new(10, 0, 0, 1),
        peer_asn: 65002,
        hold_time: 90,
        families: vec![Family::IPV4_UNICAST, Family::IPV6_UNICAST],
        graceful_restart: None,
    };
    let mut now = Instant::now();
    let (mut session, _) = Session::start(config, now);
    let mut rib = PeerRib::new(LIMIT, action);
    let mut installed = std::collections::BTreeSet::new();
    while let Ok(Some(len)) = frame_len(stream) {
        assert!(len <= MAX_LEN);
        let Some(msg) = stream.get(..len) else {
            break;
        };
        stream = &stream[len..];
        let four = session.four_octet_as() && !two_octet;
        let decoded = Message::decode(msg, four);
        if let Ok(m) = &decoded {
            let again = m.encode(four);
            assert!(again.len() <= MAX_LEN);
            assert!(frame_len(&again).is_ok());
        }
        let was_closed = session.state() == State::Closed;
        let outputs = session.on_message(now, decoded);
        if was_closed {
            assert!(outputs.is_empty(), "a closed session spoke");
        }
        for o in outputs {
            if let Output::Update(u) = o {
                let applied = rib.apply(&u, |n, _, _| n.prefix_len() >= 8);
                for c in applied.changes {
                    match c {
                        Change::Add(n, _) => {
                            installed.insert(n);
                        }
                        Change::Remove(n) => {
                            installed.remove(&n);
                        }
                    }
                }
                if let Some(n) = applied.reset {
                    let _ = session.close_with(n, "over the limit");
                }
            }
        }
        assert!(rib.routes().len() <= LIMIT);
        for n in &installed {
            assert!(
                rib.routes().get(n).is_some_and(|r| r.accepted),
                "{n} installed, not held"
            );
        }
        now += Duration::from_millis(10);
        let _ = session.tick(now);
    }
});
