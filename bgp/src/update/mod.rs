//! UPDATE (RFC 4271 §4.3, RFC 4760's MP_REACH_NLRI and MP_UNREACH_NLRI), decoded with RFC
//! 7606's revised error handling, and built into messages that fit.
//!
//! What a malformed attribute costs, attribute by attribute (RFC 7606 §7):
//! - **treat-as-withdraw**: ORIGIN, AS_PATH, NEXT_HOP, MULTI_EXIT_DISC, LOCAL_PREF,
//!   COMMUNITIES, ORIGINATOR_ID, CLUSTER_LIST, EXTENDED_COMMUNITIES, LARGE_COMMUNITY, a
//!   known attribute with the wrong optional or transitive flag (§3 c), an unrecognized
//!   well-known attribute, a mandatory one missing (§3 d): every route the message announces
//!   is withdrawn instead, and the session stays up;
//! - **attribute discard**: ATOMIC_AGGREGATE, AGGREGATOR, AS4_PATH, AS4_AGGREGATOR, and a
//!   second copy of any attribute (§3 g);
//! - **session reset**, only where the message cannot be read: lengths that do not add up
//!   (withdrawn routes, the attributes' total, a prefix), a malformed or repeated
//!   MP_REACH_NLRI or MP_UNREACH_NLRI, and attributes whose framing breaks before anything
//!   announced could be found (§4).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::Family;

mod decode;
mod encode;

pub use encode::UpdateBuilder;

pub const ATTR_ORIGIN: u8 = 1;
pub const ATTR_AS_PATH: u8 = 2;
pub const ATTR_NEXT_HOP: u8 = 3;
pub const ATTR_MED: u8 = 4;
pub const ATTR_LOCAL_PREF: u8 = 5;
pub const ATTR_ATOMIC_AGGREGATE: u8 = 6;
pub const ATTR_AGGREGATOR: u8 = 7;
pub const ATTR_COMMUNITIES: u8 = 8;
pub const ATTR_ORIGINATOR_ID: u8 = 9;
pub const ATTR_CLUSTER_LIST: u8 = 10;
pub const ATTR_MP_REACH: u8 = 14;
pub const ATTR_MP_UNREACH: u8 = 15;
pub const ATTR_EXT_COMMUNITIES: u8 = 16;
pub const ATTR_AS4_PATH: u8 = 17;
pub const ATTR_AS4_AGGREGATOR: u8 = 18;
pub const ATTR_LARGE_COMMUNITIES: u8 = 32;

const FLAG_OPTIONAL: u8 = 0x80;
const FLAG_TRANSITIVE: u8 = 0x40;
const FLAG_EXTENDED: u8 = 0x10;

const AS_SET: u8 = 1;
const AS_SEQUENCE: u8 = 2;
const AS_TRANS: u32 = crate::limits::AS_TRANS as u32;

/// ORIGIN's values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Origin {
    #[default]
    Igp = 0,
    Egp = 1,
    Incomplete = 2,
}

/// An AS_PATH segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AsSegment {
    /// An AS_SET (unordered) rather than an AS_SEQUENCE.
    pub set: bool,
    pub asns: Vec<u32>,
}

/// The path attributes calix reads and writes (others are skipped on reading).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PathAttributes {
    pub origin: Origin,
    /// AS4_PATH merged in when the session has 2-octet AS numbers (RFC 6793 §4.2.3).
    pub as_path: Vec<AsSegment>,
    /// NEXT_HOP: the body's IPv4 routes'.
    pub next_hop: Option<Ipv4Addr>,
    pub med: Option<u32>,
    pub local_pref: Option<u32>,
    pub communities: Vec<u32>,
    pub large_communities: Vec<[u32; 3]>,
}

impl PathAttributes {
    /// Every AS number in the path, in order.
    pub fn asns(&self) -> impl Iterator<Item = u32> + '_ {
        self.as_path.iter().flat_map(|s| s.asns.iter().copied())
    }

    /// The path's first AS (the neighbour's, for a route learned over eBGP).
    pub fn first_asn(&self) -> Option<u32> {
        self.as_path
            .first()
            .filter(|s| !s.set)
            .and_then(|s| s.asns.first().copied())
    }
}

/// What RFC 7606 had done with a malformed attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// The message's announced routes were withdrawn instead.
    TreatAsWithdraw,
    /// The attribute was ignored.
    Discard,
}

/// A malformed attribute the message survived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttributeIssue {
    pub type_code: u8,
    pub disposition: Disposition,
    pub what: &'static str,
}

/// An UPDATE message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Update {
    /// Routes withdrawn, every family: the body's, MP_UNREACH_NLRI's, and those RFC 7606 had
    /// withdrawn because an attribute was malformed.
    pub withdrawn: Vec<IpNet>,
    /// Routes announced, each with its next hop: the body's (NEXT_HOP) and MP_REACH_NLRI's.
    pub announced: Vec<(IpNet, IpAddr)>,
    /// MP_REACH_NLRI's IPv6 link-local next hop, when it carried one.
    pub link_local_next_hop: Option<Ipv6Addr>,
    pub attributes: PathAttributes,
    /// Set for an End-of-RIB marker (RFC 4724 §2).
    pub end_of_rib: Option<Family>,
    /// Malformed attributes, and what was done with them.
    pub issues: Vec<AttributeIssue>,
}
