//! What flows from a route stream: a served set's updates ([`Snapshot`], [`Delta`]) and what a
//! follower makes of a peer's stream ([`PeerEvent`], with what it did not use: [`Unused`]).
use ipnet::IpNet;

use crate::wire::WireError;
use crate::Route;

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
    /// The text of the first few ([`crate::crate::wire::MALFORMED_EXAMPLES`], cut short).
    pub examples: Vec<String>,
    /// Withdrawals of prefixes the peer does not hold (never announced, or gone already):
    /// ignored.
    pub unknown_withdrawals: u64,
}

impl Unused {
    /// One more malformed entry, whose text `text` makes (only while examples are wanted).
    pub fn add_malformed(&mut self, text: impl FnOnce() -> String) {
        self.malformed += 1;
        if self.examples.len() < crate::wire::MALFORMED_EXAMPLES {
            self.examples.push(text());
        }
    }
}
