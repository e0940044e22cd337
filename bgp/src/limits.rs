//! The protocol's fixed numbers that every module uses.

/// The header's length: marker, length, type.
pub const HEADER_LEN: usize = 19;
/// The longest message (RFC 4271; RFC 8654's extended messages are not offered).
pub const MAX_LEN: usize = 4096;
/// The AS number a 2-octet field carries for a 4-octet one (RFC 6793).
pub const AS_TRANS: u16 = 23456;
/// UPDATE's message type (RFC 4271 §4.1).
pub const TYPE_UPDATE: u8 = 2;
