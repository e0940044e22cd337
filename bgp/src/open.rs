//! OPEN (RFC 4271 §4.2) and its capabilities (RFC 5492): multiprotocol (RFC 4760), route
//! refresh (RFC 2918, enhanced RFC 7313), graceful restart (RFC 4724), 4-octet AS numbers
//! (RFC 6793). Extended optional parameters (RFC 9072) are read.
use std::net::Ipv4Addr;

use crate::notification::{self, open, DecodeError, Notification};
use crate::Family;

pub use crate::limits::AS_TRANS;

const CAP_MULTIPROTOCOL: u8 = 1;
const CAP_ROUTE_REFRESH: u8 = 2;
const CAP_GRACEFUL_RESTART: u8 = 64;
const CAP_FOUR_OCTET_AS: u8 = 65;
const CAP_ENHANCED_ROUTE_REFRESH: u8 = 70;
const PARAM_CAPABILITIES: u8 = 2;

/// An OPEN message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Open {
    /// The speaker's AS: the 4-octet capability's when present, else the 2-octet field's.
    pub asn: u32,
    /// Seconds; 0 (no keepalives) or at least 3.
    pub hold_time: u16,
    /// The BGP identifier.
    pub router_id: Ipv4Addr,
    pub capabilities: Capabilities,
}

/// The capabilities an OPEN announces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Multiprotocol: the families the speaker takes. None announced means IPv4 unicast only
    /// (RFC 4760 §8).
    pub families: Vec<Family>,
    pub route_refresh: bool,
    pub enhanced_route_refresh: bool,
    /// The 4-octet AS capability's number.
    pub four_octet_as: Option<u32>,
    pub graceful_restart: Option<GracefulRestart>,
    /// The codes of capabilities calix does not know (ignored, RFC 5492 §4).
    pub other: Vec<u8>,
}

/// The graceful restart capability (RFC 4724 §3).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GracefulRestart {
    /// The R bit: the speaker has restarted, and its peer must not wait for its EoR before
    /// sending its own routes.
    pub restarting: bool,
    /// The N bit (RFC 8538): the speaker keeps routes across a NOTIFICATION too.
    pub notification: bool,
    /// Seconds the peer keeps this speaker's routes after the session goes (12 bits).
    pub restart_time: u16,
    /// The families whose routes it keeps across a restart, and whether it kept forwarding
    /// for each this time (the F bit).
    pub families: Vec<(Family, bool)>,
}

fn open_error(subcode: u8, what: &'static str) -> DecodeError {
    DecodeError::new(Notification::new(notification::OPEN_ERROR, subcode), what)
}

impl Open {
    /// The body (after the header).
    pub(crate) fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let [version, a0, a1, h0, h1, i0, i1, i2, i3, opt_len, rest @ ..] = body else {
            return Err(DecodeError::new(
                Notification::new(notification::HEADER_ERROR, notification::header::BAD_LENGTH),
                "an OPEN shorter than its fixed fields",
            ));
        };
        if *version != 4 {
            return Err(DecodeError::new(
                Notification::with_data(
                    notification::OPEN_ERROR,
                    open::UNSUPPORTED_VERSION,
                    &[0, 4],
                ),
                "a BGP version other than 4",
            ));
        }
        let hold_time = u16::from_be_bytes([*h0, *h1]);
        if hold_time == 1 || hold_time == 2 {
            return Err(open_error(
                open::UNACCEPTABLE_HOLD_TIME,
                "a hold time of 1 or 2 seconds",
            ));
        }
        let router_id = Ipv4Addr::new(*i0, *i1, *i2, *i3);
        if router_id.is_unspecified() {
            return Err(open_error(open::BAD_IDENTIFIER, "a BGP identifier of 0"));
        }
        let params = read_params(*opt_len, rest)?;
        let mut capabilities = Capabilities::default();
        for (kind, value) in params {
            if kind != PARAM_CAPABILITIES {
                return Err(open_error(
                    open::UNSUPPORTED_PARAMETER,
                    "an optional parameter other than capabilities",
                ));
            }
            capabilities.read(value)?;
        }
        let short = u32::from(u16::from_be_bytes([*a0, *a1]));
        let asn = capabilities.four_octet_as.unwrap_or(short);
        if asn == 0
            || (capabilities.four_octet_as.is_some()
                && short != u32::from(AS_TRANS)
                && short != asn)
        {
            return Err(open_error(
                open::BAD_PEER_AS,
                "an AS number of 0, or two that disagree",
            ));
        }
        Ok(Self {
            asn,
            hold_time,
            router_id,
            capabilities,
        })
    }

    pub(crate) fn encode_body(&self, out: &mut Vec<u8>) {
        out.push(4);
        let short = u16::try_from(self.asn).unwrap_or(AS_TRANS);
        out.extend_from_slice(&short.to_be_bytes());
        out.extend_from_slice(&self.hold_time.to_be_bytes());
        out.extend_from_slice(&self.router_id.octets());
        let mut caps = Vec::new();
        self.capabilities.encode(&mut caps);
        // One capabilities parameter; calix's own never needs RFC 9072's longer form.
        let caps = &caps[..caps.len().min(253)];
        if caps.is_empty() {
            out.push(0);
        } else {
            out.push(caps.len() as u8 + 2);
            out.push(PARAM_CAPABILITIES);
            out.push(caps.len() as u8);
            out.extend_from_slice(caps);
        }
    }
}

/// The optional parameters: (type, value) each; RFC 9072's extended form when the length and
/// the first type are both 255.
fn read_params(opt_len: u8, rest: &[u8]) -> Result<Vec<(u8, &[u8])>, DecodeError> {
    let malformed = || open_error(0, "optional parameters whose lengths do not add up");
    let is_extended = opt_len == 255 && rest.first() == Some(&255);
    let mut params = if is_extended {
        let [_, l0, l1, tail @ ..] = rest else {
            return Err(malformed());
        };
        if usize::from(u16::from_be_bytes([*l0, *l1])) != tail.len() {
            return Err(malformed());
        }
        tail
    } else {
        if usize::from(opt_len) != rest.len() {
            return Err(malformed());
        }
        rest
    };
    let mut out = Vec::new();
    while let [kind, tail @ ..] = params {
        let (len, tail) = if is_extended {
            match tail {
                [l0, l1, t @ ..] => (usize::from(u16::from_be_bytes([*l0, *l1])), t),
                _ => return Err(malformed()),
            }
        } else {
            match tail {
                [l, t @ ..] => (usize::from(*l), t),
                _ => return Err(malformed()),
            }
        };
        let Some(value) = tail.get(..len) else {
            return Err(malformed());
        };
        out.push((*kind, value));
        params = &tail[len..];
    }
    Ok(out)
}

impl Capabilities {
    /// Reads one capabilities parameter's value: (code, length, value) each.
    fn read(&mut self, mut value: &[u8]) -> Result<(), DecodeError> {
        let malformed = |what| open_error(0, what);
        while let [code, len, tail @ ..] = value {
            let len = usize::from(*len);
            let Some(v) = tail.get(..len) else {
                return Err(malformed("a capability longer than its parameter"));
            };
            match *code {
                CAP_MULTIPROTOCOL => match v {
                    [a0, a1, _, safi] => {
                        let f = Family::from_wire(u16::from_be_bytes([*a0, *a1]), *safi);
                        if !self.families.contains(&f) {
                            self.families.push(f);
                        }
                    }
                    _ => return Err(malformed("a multiprotocol capability of the wrong length")),
                },
                CAP_ROUTE_REFRESH => self.route_refresh = true,
                CAP_ENHANCED_ROUTE_REFRESH => self.enhanced_route_refresh = true,
                CAP_FOUR_OCTET_AS => match v {
                    [a, b, c, d] => self.four_octet_as = Some(u32::from_be_bytes([*a, *b, *c, *d])),
                    _ => return Err(malformed("a 4-octet AS capability of the wrong length")),
                },
                CAP_GRACEFUL_RESTART => {
                    let [f0, f1, fams @ ..] = v else {
                        return Err(malformed("a graceful restart capability too short"));
                    };
                    if !fams.len().is_multiple_of(4) {
                        return Err(malformed(
                            "a graceful restart capability of the wrong length",
                        ));
                    }
                    let families = fams
                        .chunks_exact(4)
                        .map(|c| {
                            (
                                Family::from_wire(u16::from_be_bytes([c[0], c[1]]), c[2]),
                                c[3] & 0x80 != 0,
                            )
                        })
                        .collect();
                    self.graceful_restart = Some(GracefulRestart {
                        restarting: f0 & 0x80 != 0,
                        notification: f0 & 0x40 != 0,
                        restart_time: u16::from_be_bytes([f0 & 0x0f, *f1]),
                        families,
                    });
                }
                other => {
                    if !self.other.contains(&other) {
                        self.other.push(other);
                    }
                }
            }
            value = &tail[len..];
        }
        if !value.is_empty() {
            return Err(malformed("a capability cut short"));
        }
        Ok(())
    }

    fn encode(&self, out: &mut Vec<u8>) {
        for f in &self.families {
            out.extend_from_slice(&[CAP_MULTIPROTOCOL, 4]);
            f.encode(out);
        }
        if self.route_refresh {
            out.extend_from_slice(&[CAP_ROUTE_REFRESH, 0]);
        }
        if self.enhanced_route_refresh {
            out.extend_from_slice(&[CAP_ENHANCED_ROUTE_REFRESH, 0]);
        }
        if let Some(gr) = &self.graceful_restart {
            let len = 2 + 4 * gr.families.len().min(60);
            out.extend_from_slice(&[CAP_GRACEFUL_RESTART, len as u8]);
            let mut flags = (gr.restart_time.min(4095) >> 8) as u8;
            if gr.restarting {
                flags |= 0x80;
            }
            if gr.notification {
                flags |= 0x40;
            }
            out.push(flags);
            out.push(gr.restart_time.min(4095) as u8);
            for (f, forwarding) in gr.families.iter().take(60) {
                out.extend_from_slice(&f.afi.to_be_bytes());
                out.push(f.safi);
                out.push(if *forwarding { 0x80 } else { 0 });
            }
        }
        if let Some(asn) = self.four_octet_as {
            out.extend_from_slice(&[CAP_FOUR_OCTET_AS, 4]);
            out.extend_from_slice(&asn.to_be_bytes());
        }
    }

    /// Whether the speaker takes `family`: announced, or IPv4 unicast when it announced none.
    pub fn takes(&self, family: Family) -> bool {
        if self.families.is_empty() {
            family == Family::IPV4_UNICAST
        } else {
            self.families.contains(&family)
        }
    }
}
