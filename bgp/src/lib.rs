//! calix's BGP speaker, without I/O: what goes on the wire and what a session does with it.
//!
//! - [`wire`]: the messages' framing (RFC 4271 §4.1) and [`Message`], decoded and encoded;
//! - [`open`]: OPEN and its capabilities (multiprotocol RFC 4760, route refresh RFC 2918,
//!   4-octet AS numbers RFC 6793, graceful restart RFC 4724);
//! - [`update`]: UPDATE, decoded with RFC 7606's revised error handling (a malformed
//!   attribute withdraws the message's routes or is discarded; only what leaves the message
//!   unreadable resets the session) and built into messages that fit 4,096 bytes;
//! - [`notification`]: NOTIFICATION's codes, and the error every decoder returns when the
//!   session must end;
//! - [`session`]: one connection's state machine (OPEN, KEEPALIVE, the hold timer), fed
//!   messages and the clock by the caller;
//! - [`peer`]: what a peer announced, across its connections: the import rule's verdicts,
//!   the prefix limit, graceful restart's stale routes;
//! - [`advertise`]: what a session announced, and the UPDATEs a new set of routes takes;
//! - [`import`]: which announced routes are installed (the pools', never this node's own).
//!
//! Why a codec of our own, and not a crate's: docs/decisions.md, "BGP: a speaker of our own".
//! Everything here works on byte slices bounded by one message (4,096 bytes): what a peer
//! sends cannot make it allocate more than a few times that, and nothing panics on input
//! (the fuzz target `bgp_message` holds it to that).

pub mod advertise;
pub mod import;
pub mod notification;
pub mod open;
pub mod peer;
pub mod session;
pub mod update;
pub mod wire;

mod family;
mod limits;
mod prefix;

pub use family::Family;
pub use notification::{DecodeError, Notification};
pub use open::{Capabilities, GracefulRestart, Open};
pub use update::{Origin, PathAttributes, Update, UpdateBuilder};
pub use wire::{Message, MessageType};

#[cfg(test)]
mod session_tests;
#[cfg(test)]
mod tests;
