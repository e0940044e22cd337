//! What flows from a route stream: a served set's updates ([`Snapshot`], [`Delta`]) and what a
//! follower makes of a peer's stream ([`PeerEvent`], with what it did not use: [`Unused`], and
//! how it broke: [`WireError`]).
use ipnet::IpNet;

use crate::Route;

/// Malformed entries of one update whose text is kept (the rest are counted).
pub const MALFORMED_EXAMPLES: usize = 4;

/// One change of the set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    pub generation: u64,
    pub routes: Vec<Route>,
    pub withdrawn: Vec<IpNet>,
}

/// The whole set at one generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub generation: u64,
    pub routes: Vec<Route>,
}

/// What a followed peer's stream delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerEvent {
    Snapshot {
        generation: u64,
        routes: Vec<Route>,
        unused: Unused,
    },
    Delta {
        generation: u64,
        routes: Vec<Route>,
        /// Prefixes the peer held (see [`Unused::unknown_withdrawals`] for the others).
        withdrawn: Vec<IpNet>,
        unused: Unused,
    },
    /// The stream ended, or could not be opened.
    Down {
        reason: String,
        /// The peer broke the protocol or a bound: why its stream was dropped.
        broke: Option<WireError>,
    },
}

/// What an update carried that is not used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unused {
    /// Entries that do not parse (routes, withdrawn prefixes).
    pub malformed: u64,
    /// The text of the first few ([`MALFORMED_EXAMPLES`], cut short).
    pub examples: Vec<String>,
    /// Withdrawals of prefixes the peer does not hold (never announced, or gone already):
    /// ignored.
    pub unknown_withdrawals: u64,
}

impl Unused {
    /// One more malformed entry, whose text `text` makes (only while examples are wanted).
    pub fn add_malformed(&mut self, text: impl FnOnce() -> String) {
        self.malformed += 1;
        if self.examples.len() < MALFORMED_EXAMPLES {
            self.examples.push(text());
        }
    }
}

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
    #[error("the peer would hold more than {limit} routes")]
    TooMany { limit: usize },
    #[error("the peer's routes would take more than {limit} bytes")]
    HeldBytes { limit: usize },
    #[error("an update of more than {limit} bytes")]
    UpdateBytes { limit: usize },
    #[error("an update of more than {limit} messages")]
    UpdateParts { limit: usize },
    #[error("a message of more than {limit} bytes")]
    MessageTooLarge { limit: usize },
    #[error("a message that does not decode")]
    Undecodable,
}

impl WireError {
    /// Every cause's name, in [`WireError::name`]'s terms (for `/metrics`).
    pub const NAMES: [&'static str; 10] = [
        "no_snapshot",
        "generation",
        "broken_update",
        "kind",
        "too_many_routes",
        "held_bytes",
        "update_bytes",
        "update_parts",
        "message_too_large",
        "undecodable",
    ];

    /// A stable name (metrics, calixctl).
    pub fn name(&self) -> &'static str {
        match self {
            WireError::NoSnapshot => "no_snapshot",
            WireError::Generation { .. } => "generation",
            WireError::BrokenUpdate => "broken_update",
            WireError::Kind(_) => "kind",
            WireError::TooMany { .. } => "too_many_routes",
            WireError::HeldBytes { .. } => "held_bytes",
            WireError::UpdateBytes { .. } => "update_bytes",
            WireError::UpdateParts { .. } => "update_parts",
            WireError::MessageTooLarge { .. } => "message_too_large",
            WireError::Undecodable => "undecodable",
        }
    }
}
