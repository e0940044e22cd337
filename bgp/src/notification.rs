//! NOTIFICATION (RFC 4271 §4.5, §6): its codes, and [`DecodeError`], what a decoder returns
//! when the session must end (the NOTIFICATION to send, and why).
use std::fmt;

/// Message Header Error.
pub const HEADER_ERROR: u8 = 1;
/// OPEN Message Error.
pub const OPEN_ERROR: u8 = 2;
/// UPDATE Message Error.
pub const UPDATE_ERROR: u8 = 3;
/// Hold Timer Expired.
pub const HOLD_TIMER_EXPIRED: u8 = 4;
/// Finite State Machine Error.
pub const FSM_ERROR: u8 = 5;
/// Cease (RFC 4486's subcodes).
pub const CEASE: u8 = 6;
/// ROUTE-REFRESH Message Error (RFC 7313).
pub const ROUTE_REFRESH_ERROR: u8 = 7;

/// Message Header Error subcodes.
pub mod header {
    pub const NOT_SYNCHRONIZED: u8 = 1;
    pub const BAD_LENGTH: u8 = 2;
    pub const BAD_TYPE: u8 = 3;
}

/// OPEN Message Error subcodes.
pub mod open {
    pub const UNSUPPORTED_VERSION: u8 = 1;
    pub const BAD_PEER_AS: u8 = 2;
    pub const BAD_IDENTIFIER: u8 = 3;
    pub const UNSUPPORTED_PARAMETER: u8 = 4;
    pub const UNACCEPTABLE_HOLD_TIME: u8 = 6;
    pub const UNSUPPORTED_CAPABILITY: u8 = 7;
}

/// UPDATE Message Error subcodes.
pub mod update {
    pub const MALFORMED_ATTRIBUTE_LIST: u8 = 1;
    pub const UNRECOGNIZED_WELL_KNOWN: u8 = 2;
    pub const MISSING_WELL_KNOWN: u8 = 3;
    pub const ATTRIBUTE_FLAGS: u8 = 4;
    pub const ATTRIBUTE_LENGTH: u8 = 5;
    pub const INVALID_ORIGIN: u8 = 6;
    pub const INVALID_NEXT_HOP: u8 = 8;
    pub const OPTIONAL_ATTRIBUTE: u8 = 9;
    pub const INVALID_NETWORK_FIELD: u8 = 10;
    pub const MALFORMED_AS_PATH: u8 = 11;
}

/// Cease subcodes (RFC 4486, RFC 8538).
pub mod cease {
    pub const MAX_PREFIXES: u8 = 1;
    pub const ADMIN_SHUTDOWN: u8 = 2;
    pub const PEER_DECONFIGURED: u8 = 3;
    pub const ADMIN_RESET: u8 = 4;
    pub const CONNECTION_REJECTED: u8 = 5;
    pub const CONFIG_CHANGE: u8 = 6;
    pub const COLLISION: u8 = 7;
    pub const OUT_OF_RESOURCES: u8 = 8;
    pub const HARD_RESET: u8 = 9;
}

/// A NOTIFICATION message: the error's code and subcode, and its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    pub code: u8,
    pub subcode: u8,
    pub data: Vec<u8>,
}

impl Notification {
    pub fn new(code: u8, subcode: u8) -> Self {
        Self {
            code,
            subcode,
            data: Vec::new(),
        }
    }

    pub fn with_data(code: u8, subcode: u8, data: &[u8]) -> Self {
        Self {
            code,
            subcode,
            data: data.to_vec(),
        }
    }

    /// The body (after the header): code, subcode, data.
    pub(crate) fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        match body {
            [code, subcode, data @ ..] => Ok(Self {
                code: *code,
                subcode: *subcode,
                data: data.to_vec(),
            }),
            _ => Err(DecodeError::new(
                Notification::new(HEADER_ERROR, header::BAD_LENGTH),
                "a NOTIFICATION shorter than its code and subcode",
            )),
        }
    }

    pub(crate) fn encode_body(&self, out: &mut Vec<u8>) {
        out.push(self.code);
        out.push(self.subcode);
        // The message's length bounds the data: what does not fit is cut.
        let room = crate::limits::MAX_LEN - crate::limits::HEADER_LEN - 2;
        out.extend_from_slice(&self.data[..self.data.len().min(room)]);
    }

    /// The error's name, as RFC 4271 and its successors word it.
    pub fn describe(&self) -> String {
        let code = match self.code {
            HEADER_ERROR => "message header error",
            OPEN_ERROR => "OPEN message error",
            UPDATE_ERROR => "UPDATE message error",
            HOLD_TIMER_EXPIRED => "hold timer expired",
            FSM_ERROR => "finite state machine error",
            CEASE => "cease",
            ROUTE_REFRESH_ERROR => "ROUTE-REFRESH message error",
            _ => "unknown error code",
        };
        let sub = match (self.code, self.subcode) {
            (HEADER_ERROR, header::NOT_SYNCHRONIZED) => "connection not synchronized",
            (HEADER_ERROR, header::BAD_LENGTH) => "bad message length",
            (HEADER_ERROR, header::BAD_TYPE) => "bad message type",
            (OPEN_ERROR, open::UNSUPPORTED_VERSION) => "unsupported version number",
            (OPEN_ERROR, open::BAD_PEER_AS) => "bad peer AS",
            (OPEN_ERROR, open::BAD_IDENTIFIER) => "bad BGP identifier",
            (OPEN_ERROR, open::UNSUPPORTED_PARAMETER) => "unsupported optional parameter",
            (OPEN_ERROR, open::UNACCEPTABLE_HOLD_TIME) => "unacceptable hold time",
            (OPEN_ERROR, open::UNSUPPORTED_CAPABILITY) => "unsupported capability",
            (UPDATE_ERROR, update::MALFORMED_ATTRIBUTE_LIST) => "malformed attribute list",
            (UPDATE_ERROR, update::UNRECOGNIZED_WELL_KNOWN) => "unrecognized well-known attribute",
            (UPDATE_ERROR, update::MISSING_WELL_KNOWN) => "missing well-known attribute",
            (UPDATE_ERROR, update::ATTRIBUTE_FLAGS) => "attribute flags error",
            (UPDATE_ERROR, update::ATTRIBUTE_LENGTH) => "attribute length error",
            (UPDATE_ERROR, update::INVALID_ORIGIN) => "invalid ORIGIN attribute",
            (UPDATE_ERROR, update::INVALID_NEXT_HOP) => "invalid NEXT_HOP attribute",
            (UPDATE_ERROR, update::OPTIONAL_ATTRIBUTE) => "optional attribute error",
            (UPDATE_ERROR, update::INVALID_NETWORK_FIELD) => "invalid network field",
            (UPDATE_ERROR, update::MALFORMED_AS_PATH) => "malformed AS_PATH",
            (CEASE, cease::MAX_PREFIXES) => "maximum number of prefixes reached",
            (CEASE, cease::ADMIN_SHUTDOWN) => "administrative shutdown",
            (CEASE, cease::PEER_DECONFIGURED) => "peer de-configured",
            (CEASE, cease::ADMIN_RESET) => "administrative reset",
            (CEASE, cease::CONNECTION_REJECTED) => "connection rejected",
            (CEASE, cease::CONFIG_CHANGE) => "other configuration change",
            (CEASE, cease::COLLISION) => "connection collision resolution",
            (CEASE, cease::OUT_OF_RESOURCES) => "out of resources",
            (CEASE, cease::HARD_RESET) => "hard reset",
            _ => "",
        };
        if sub.is_empty() {
            format!("{code} ({}/{})", self.code, self.subcode)
        } else {
            format!("{code}: {sub} ({}/{})", self.code, self.subcode)
        }
    }
}

impl fmt::Display for Notification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// What a peer sent that ends the session: the NOTIFICATION to answer with, and what was
/// wrong, for the log.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} ({notification})")]
pub struct DecodeError {
    pub notification: Notification,
    pub what: &'static str,
}

impl DecodeError {
    pub fn new(notification: Notification, what: &'static str) -> Self {
        Self { notification, what }
    }
}
