//! One BGP connection's state machine (RFC 4271 §8), without I/O: the caller feeds it the
//! messages it reads and the clock, and does what it says (send, close). What outlives a
//! connection (the routes learned, graceful restart's stale routes) is [`crate::peer`]'s.
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use crate::notification::{self, cease, open as open_sub, DecodeError, Notification};
use crate::open::{Capabilities, GracefulRestart, Open};
use crate::update::Update;
use crate::{Family, Message};

/// The hold time before the OPEN is in (RFC 4271 §8.2.2: "a large value", 4 minutes).
pub const OPEN_HOLD: Duration = Duration::from_secs(240);

/// What this speaker offers a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalConfig {
    pub asn: u32,
    pub router_id: Ipv4Addr,
    /// The peer's AS, as configured: an OPEN with another is refused.
    pub peer_asn: u32,
    /// Proposed hold time, seconds: 0, or 3 and more.
    pub hold_time: u16,
    pub families: Vec<Family>,
    /// Graceful restart: this speaker's restart time (seconds), and whether it restarted
    /// (the R bit) and kept forwarding (the F bit for every family).
    pub graceful_restart: Option<LocalRestart>,
}

/// This speaker's graceful restart capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRestart {
    pub restart_time: u16,
    pub restarting: bool,
    pub forwarding_preserved: bool,
}

/// The connection's state (RFC 4271 §8.2.2; Idle, Connect and Active are the caller's, before
/// a connection exists).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    OpenSent,
    OpenConfirm,
    Established,
    /// Over: nothing more is read or sent.
    Closed,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::OpenSent => "OpenSent",
            State::OpenConfirm => "OpenConfirm",
            State::Established => "Established",
            State::Closed => "Closed",
        }
    }
}

/// What both ends agreed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Seconds; 0: no hold timer, no keepalives.
    pub hold_time: u16,
    pub four_octet_as: bool,
    /// The families both take.
    pub families: Vec<Family>,
    pub peer_router_id: Ipv4Addr,
    /// The peer's graceful restart capability, when it announced one.
    pub peer_restart: Option<GracefulRestart>,
    pub peer_route_refresh: bool,
}

impl Negotiated {
    pub fn keepalive(&self) -> Option<Duration> {
        (self.hold_time > 0).then(|| Duration::from_secs(u64::from(self.hold_time / 3).max(1)))
    }
}

/// What the caller must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Write these bytes (one message).
    Send(Vec<u8>),
    /// The session is up.
    Established(Negotiated),
    /// An UPDATE, decoded (the peer applies it).
    Update(Update),
    /// The peer asks for a family's routes again.
    RouteRefresh(Family),
    /// The connection is over: close it. `sent`: the NOTIFICATION this end sent, if any;
    /// `received`: the peer's.
    Closed {
        reason: String,
        sent: Option<Notification>,
        received: Option<Notification>,
    },
}

/// One connection's state machine.
#[derive(Debug)]
pub struct Session {
    config: LocalConfig,
    state: State,
    negotiated: Option<Negotiated>,
    /// When the hold timer fires, when set.
    hold_deadline: Option<Instant>,
    /// When the next KEEPALIVE is due, when set.
    keepalive_due: Option<Instant>,
}

impl Session {
    /// A connection that just opened: the OPEN goes first.
    pub fn start(config: LocalConfig, now: Instant) -> (Self, Vec<Output>) {
        let open = Message::Open(own_open(&config)).encode(true);
        let s = Self {
            config,
            state: State::OpenSent,
            negotiated: None,
            hold_deadline: Some(now + OPEN_HOLD),
            keepalive_due: None,
        };
        (s, vec![Output::Send(open)])
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }

    /// Whether UPDATEs read on this connection use 4-octet AS numbers (before the OPEN is
    /// in: yes, this speaker's own).
    pub fn four_octet_as(&self) -> bool {
        self.negotiated.as_ref().is_none_or(|n| n.four_octet_as)
    }

    /// When [`Session::tick`] next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        match (self.hold_deadline, self.keepalive_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The timers: a KEEPALIVE when due, the end when the hold timer ran out.
    pub fn tick(&mut self, now: Instant) -> Vec<Output> {
        if self.state == State::Closed {
            return Vec::new();
        }
        if self.hold_deadline.is_some_and(|d| now >= d) {
            return self.close_with(
                Notification::new(notification::HOLD_TIMER_EXPIRED, 0),
                "the hold timer expired",
            );
        }
        let mut out = Vec::new();
        if let (Some(due), Some(every)) = (
            self.keepalive_due,
            self.negotiated.as_ref().and_then(Negotiated::keepalive),
        ) {
            if now >= due {
                out.push(Output::Send(Message::Keepalive.encode(true)));
                self.keepalive_due = Some(now + every);
            }
        }
        out
    }

    /// A message read (or why it could not be read).
    pub fn on_message(&mut self, now: Instant, msg: Result<Message, DecodeError>) -> Vec<Output> {
        if self.state == State::Closed {
            return Vec::new();
        }
        let msg = match msg {
            Ok(m) => m,
            Err(e) => return self.close_with(e.notification, e.what),
        };
        // Any message is a sign of life (RFC 4271 §4.4).
        if let Some(n) = &self.negotiated {
            if n.hold_time > 0 {
                self.hold_deadline = Some(now + Duration::from_secs(u64::from(n.hold_time)));
            }
        }
        match (self.state, msg) {
            (_, Message::Notification(n)) => {
                self.state = State::Closed;
                vec![Output::Closed {
                    reason: format!("the peer sent {n}"),
                    sent: None,
                    received: Some(n),
                }]
            }
            (State::OpenSent, Message::Open(o)) => self.on_open(now, o),
            (State::OpenConfirm, Message::Keepalive) => {
                self.state = State::Established;
                let n = self.negotiated.clone().into_iter().map(Output::Established);
                n.collect()
            }
            (State::Established, Message::Keepalive) => Vec::new(),
            (State::Established, Message::Update(u)) => vec![Output::Update(u)],
            (State::Established, Message::RouteRefresh { family, .. }) => {
                let ours = self
                    .negotiated
                    .as_ref()
                    .is_some_and(|n| n.families.contains(&family));
                if ours {
                    vec![Output::RouteRefresh(family)]
                } else {
                    // RFC 2918 §4: a family not negotiated is ignored.
                    Vec::new()
                }
            }
            (state, _) => {
                // RFC 6608's subcodes: the state the unexpected message came in.
                let subcode = match state {
                    State::OpenSent => 1,
                    State::OpenConfirm => 2,
                    _ => 3,
                };
                self.close_with(
                    Notification::new(notification::FSM_ERROR, subcode),
                    "a message the state does not expect",
                )
            }
        }
    }

    fn on_open(&mut self, now: Instant, o: Open) -> Vec<Output> {
        if o.asn != self.config.peer_asn {
            let data = u16::try_from(o.asn)
                .unwrap_or(crate::open::AS_TRANS)
                .to_be_bytes();
            return self.close_with(
                Notification::with_data(notification::OPEN_ERROR, open_sub::BAD_PEER_AS, &data),
                "an AS number other than the peer's configured one",
            );
        }
        if o.asn == self.config.asn && o.router_id == self.config.router_id {
            return self.close_with(
                Notification::new(notification::OPEN_ERROR, open_sub::BAD_IDENTIFIER),
                "an internal peer with this speaker's own router ID",
            );
        }
        let families: Vec<Family> = self
            .config
            .families
            .iter()
            .copied()
            .filter(|f| o.capabilities.takes(*f))
            .collect();
        if families.is_empty() {
            return self.close_with(
                Notification::new(notification::OPEN_ERROR, open_sub::UNSUPPORTED_CAPABILITY),
                "no address family in common",
            );
        }
        let hold_time = self.config.hold_time.min(o.hold_time);
        let negotiated = Negotiated {
            hold_time,
            four_octet_as: o.capabilities.four_octet_as.is_some(),
            families,
            peer_router_id: o.router_id,
            peer_restart: o.capabilities.graceful_restart.clone(),
            peer_route_refresh: o.capabilities.route_refresh
                || o.capabilities.enhanced_route_refresh,
        };
        self.hold_deadline =
            (hold_time > 0).then(|| now + Duration::from_secs(u64::from(hold_time)));
        self.keepalive_due = negotiated.keepalive().map(|k| now + k);
        self.negotiated = Some(negotiated);
        self.state = State::OpenConfirm;
        vec![Output::Send(Message::Keepalive.encode(true))]
    }

    /// Ends the session with `n` (sent to the peer first).
    pub fn close_with(&mut self, n: Notification, why: &str) -> Vec<Output> {
        if self.state == State::Closed {
            return Vec::new();
        }
        self.state = State::Closed;
        let bytes = Message::Notification(n.clone()).encode(true);
        vec![
            Output::Send(bytes),
            Output::Closed {
                reason: format!("{why}: sent {n}"),
                sent: Some(n),
                received: None,
            },
        ]
    }

    /// Ends the session as an operator would (Cease, administrative shutdown).
    pub fn shutdown(&mut self) -> Vec<Output> {
        self.close_with(
            Notification::new(notification::CEASE, cease::ADMIN_SHUTDOWN),
            "shut down",
        )
    }

    /// The connection broke (read or write failed, the peer closed it).
    pub fn connection_lost(&mut self, why: &str) -> Vec<Output> {
        if self.state == State::Closed {
            return Vec::new();
        }
        self.state = State::Closed;
        vec![Output::Closed {
            reason: format!("the connection was lost: {why}"),
            sent: None,
            received: None,
        }]
    }
}

/// This speaker's OPEN.
fn own_open(c: &LocalConfig) -> Open {
    Open {
        asn: c.asn,
        hold_time: c.hold_time,
        router_id: c.router_id,
        capabilities: Capabilities {
            families: c.families.clone(),
            route_refresh: true,
            enhanced_route_refresh: false,
            four_octet_as: Some(c.asn),
            graceful_restart: c.graceful_restart.map(|g| GracefulRestart {
                restarting: g.restarting,
                notification: false,
                restart_time: g.restart_time,
                families: c
                    .families
                    .iter()
                    .map(|f| (*f, g.forwarding_preserved))
                    .collect(),
            }),
            other: Vec::new(),
        },
    }
}
