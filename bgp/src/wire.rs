//! The messages' framing (RFC 4271 §4.1): a 16-byte marker of ones, a length, a type; and
//! [`Message`], one message decoded or to encode.
use crate::notification::{self, header, DecodeError, Notification};
use crate::open::Open;
use crate::update::Update;
use crate::Family;

pub use crate::limits::{HEADER_LEN, MAX_LEN};

/// The message types calix reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum MessageType {
    Open = 1,
    Update = crate::limits::TYPE_UPDATE,
    Notification = 3,
    Keepalive = 4,
    RouteRefresh = 5,
}

impl MessageType {
    fn from_wire(t: u8) -> Option<Self> {
        Some(match t {
            1 => Self::Open,
            2 => Self::Update,
            3 => Self::Notification,
            4 => Self::Keepalive,
            5 => Self::RouteRefresh,
            _ => return None,
        })
    }

    /// The shortest message of the type, header included, and the longest.
    fn lengths(self) -> (usize, usize) {
        match self {
            Self::Open => (29, MAX_LEN),
            Self::Update => (23, MAX_LEN),
            Self::Notification => (21, MAX_LEN),
            Self::Keepalive => (19, 19),
            Self::RouteRefresh => (23, 23),
        }
    }
}

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Open(Open),
    Update(Update),
    Notification(Notification),
    Keepalive,
    /// A request to send a family's routes again (RFC 2918; `subtype` RFC 7313's, 0 for a
    /// plain request).
    RouteRefresh {
        family: Family,
        subtype: u8,
    },
}

/// How long the message at the start of `buf` is, once its header is there: `Ok(None)` while
/// fewer than [`HEADER_LEN`] bytes are. A header that is not one (the marker, a length out
/// of bounds for its type, an unknown type) ends the session.
pub fn frame_len(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    if h[..16].iter().any(|b| *b != 0xff) {
        return Err(DecodeError::new(
            Notification::new(notification::HEADER_ERROR, header::NOT_SYNCHRONIZED),
            "a header without the marker",
        ));
    }
    let len = usize::from(u16::from_be_bytes([h[16], h[17]]));
    let Some(t) = MessageType::from_wire(h[18]) else {
        return Err(DecodeError::new(
            Notification::with_data(notification::HEADER_ERROR, header::BAD_TYPE, &[h[18]]),
            "an unknown message type",
        ));
    };
    let (min, max) = t.lengths();
    if len < min || len > max {
        return Err(DecodeError::new(
            Notification::with_data(notification::HEADER_ERROR, header::BAD_LENGTH, &h[16..18]),
            "a message length out of bounds for its type",
        ));
    }
    Ok(Some(len))
}

impl Message {
    /// Decodes one whole message (`msg`: header included, as long as [`frame_len`] said).
    /// `four_octet_as`: whether both speakers announced 4-octet AS numbers (it decides how
    /// an UPDATE's AS_PATH reads).
    pub fn decode(msg: &[u8], four_octet_as: bool) -> Result<Message, DecodeError> {
        let len = frame_len(msg)?.ok_or_else(|| {
            DecodeError::new(
                Notification::new(notification::HEADER_ERROR, header::BAD_LENGTH),
                "a message shorter than its header",
            )
        })?;
        if len != msg.len() {
            return Err(DecodeError::new(
                Notification::new(notification::HEADER_ERROR, header::BAD_LENGTH),
                "a message whose length is not its header's",
            ));
        }
        let body = &msg[HEADER_LEN..];
        // `frame_len` accepted the type.
        Ok(match MessageType::from_wire(msg[18]) {
            Some(MessageType::Open) => Message::Open(Open::decode(body)?),
            Some(MessageType::Update) => Message::Update(Update::decode(body, four_octet_as)?),
            Some(MessageType::Notification) => Message::Notification(Notification::decode(body)?),
            Some(MessageType::Keepalive) => Message::Keepalive,
            Some(MessageType::RouteRefresh) | None => {
                let (afi, subtype, safi) = match body {
                    [a, b, s, f] => (u16::from_be_bytes([*a, *b]), *s, *f),
                    _ => {
                        return Err(DecodeError::new(
                            Notification::new(notification::HEADER_ERROR, header::BAD_LENGTH),
                            "a ROUTE-REFRESH of the wrong length",
                        ))
                    }
                };
                Message::RouteRefresh {
                    family: Family::from_wire(afi, safi),
                    subtype,
                }
            }
        })
    }

    /// The message on the wire. An UPDATE too long for one message is cut at 4,096 bytes;
    /// [`crate::UpdateBuilder`] never builds one.
    pub fn encode(&self, four_octet_as: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&[0xff; 16]);
        out.extend_from_slice(&[0, 0]);
        let t = match self {
            Message::Open(_) => MessageType::Open,
            Message::Update(_) => MessageType::Update,
            Message::Notification(_) => MessageType::Notification,
            Message::Keepalive => MessageType::Keepalive,
            Message::RouteRefresh { .. } => MessageType::RouteRefresh,
        };
        out.push(t as u8);
        match self {
            Message::Open(o) => o.encode_body(&mut out),
            Message::Update(u) => u.encode_body(&mut out, four_octet_as),
            Message::Notification(n) => n.encode_body(&mut out),
            Message::Keepalive => {}
            Message::RouteRefresh { family, subtype } => {
                out.extend_from_slice(&family.afi.to_be_bytes());
                out.push(*subtype);
                out.push(family.safi);
            }
        }
        out.truncate(MAX_LEN);
        let len = out.len() as u16;
        out[16..18].copy_from_slice(&len.to_be_bytes());
        out
    }
}
