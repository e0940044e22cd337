//! UPDATE decoded: the attributes read one by one, each malformed one given RFC 7606's
//! disposition.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use super::*;
use crate::notification::{self, update as sub, DecodeError, Notification};
use crate::prefix::{self, PrefixError};
use crate::Family;

fn reset(subcode: u8, what: &'static str) -> DecodeError {
    DecodeError::new(Notification::new(notification::UPDATE_ERROR, subcode), what)
}

/// MP_REACH_NLRI, read.
struct MpReach {
    next_hop: Option<IpAddr>,
    link_local: Option<Ipv6Addr>,
    nlri: Vec<IpNet>,
}

impl Update {
    pub(crate) fn decode(body: &[u8], four_octet_as: bool) -> Result<Self, DecodeError> {
        let list = |what| reset(sub::MALFORMED_ATTRIBUTE_LIST, what);
        let [w0, w1, rest @ ..] = body else {
            return Err(list("an UPDATE shorter than its withdrawn routes' length"));
        };
        let wlen = usize::from(u16::from_be_bytes([*w0, *w1]));
        let (Some(withdrawn), Some(rest)) = (rest.get(..wlen), rest.get(wlen..)) else {
            return Err(list("withdrawn routes longer than the message"));
        };
        let [a0, a1, rest @ ..] = rest else {
            return Err(list("an UPDATE without its attributes' length"));
        };
        let alen = usize::from(u16::from_be_bytes([*a0, *a1]));
        let (Some(attrs), Some(nlri)) = (rest.get(..alen), rest.get(alen..)) else {
            return Err(list("path attributes longer than the message"));
        };
        let network = |e: PrefixError| {
            reset(
                sub::INVALID_NETWORK_FIELD,
                match e {
                    PrefixError::TooLong => "a prefix longer than 32 bits",
                    PrefixError::Truncated => "a prefix cut short",
                },
            )
        };
        let mut update = Update {
            withdrawn: prefix::decode(withdrawn, 4).map_err(network)?,
            ..Update::default()
        };
        let body_nlri = prefix::decode(nlri, 4).map_err(network)?;

        let mut reader = Attributes::new(four_octet_as);
        let outcome = reader.read(attrs);
        let (mp_reach, mp_unreach) = (reader.mp_reach.take(), reader.mp_unreach.take());
        match outcome {
            Ok(()) => {}
            Err(ReadError::Fatal(e)) => return Err(e),
            Err(ReadError::Framing(e)) => {
                // The framing broke: what came after is lost. When routes were found before
                // the break (RFC 7606 §4), they are withdrawn; else what the break hid
                // cannot be known, and the session ends.
                let announced_found =
                    !body_nlri.is_empty() || mp_reach.is_some() || mp_unreach.is_some();
                if !announced_found {
                    return Err(e);
                }
                reader.withdraw(ATTR_MP_REACH, "path attributes whose framing breaks");
            }
        }
        update.issues = std::mem::take(&mut reader.issues);
        let attributes = reader.finish();

        if let Some(un) = mp_unreach {
            if un.nlri.is_empty() && body.len() == 4 + alen && mp_reach.is_none() && alen > 0 {
                update.end_of_rib = Some(un.family);
            }
            update.withdrawn.extend(un.nlri);
        }
        if withdrawn.is_empty() && attrs.is_empty() && nlri.is_empty() {
            update.end_of_rib = Some(Family::IPV4_UNICAST);
        }

        let mut announced = Vec::new();
        if !body_nlri.is_empty() {
            match attributes.attrs.next_hop {
                Some(nh) => announced.extend(body_nlri.iter().map(|n| (*n, IpAddr::V4(nh)))),
                None => {
                    reader.withdraw(ATTR_NEXT_HOP, "IPv4 routes without NEXT_HOP");
                    update.withdrawn.extend(body_nlri.iter().copied());
                }
            }
        }
        if let Some(r) = mp_reach {
            match r.next_hop {
                Some(nh) => announced.extend(r.nlri.iter().map(|n| (*n, nh))),
                None => update.withdrawn.extend(r.nlri.iter().copied()),
            }
            update.link_local_next_hop = r.link_local;
        }
        if !announced.is_empty() && (attributes.as_path_missing || attributes.origin_missing) {
            reader.withdraw(ATTR_AS_PATH, "a well-known mandatory attribute missing");
        }
        update.issues.append(&mut reader.issues);
        if update
            .issues
            .iter()
            .any(|i| i.disposition == Disposition::TreatAsWithdraw)
        {
            update
                .withdrawn
                .extend(announced.into_iter().map(|(n, _)| n));
        } else {
            update.announced = announced;
        }
        update.attributes = attributes.attrs;
        Ok(update)
    }
}

/// The attributes as read, before the mandatory ones are checked.
struct Read {
    attrs: PathAttributes,
    origin_missing: bool,
    as_path_missing: bool,
}

/// The attribute reader: what it found, and what was wrong.
struct Attributes {
    four_octet_as: bool,
    seen: [bool; 256],
    attrs: PathAttributes,
    as4_path: Option<Vec<AsSegment>>,
    mp_reach: Option<MpReach>,
    mp_unreach: Option<MpUnreach>,
    issues: Vec<AttributeIssue>,
}

/// Why the attributes could not all be read.
enum ReadError {
    /// Their framing broke: the attributes after the break are lost.
    Framing(DecodeError),
    /// An MP attribute malformed or repeated: the message cannot be taken.
    Fatal(DecodeError),
}

struct MpUnreach {
    family: Family,
    nlri: Vec<IpNet>,
}

impl Attributes {
    fn new(four_octet_as: bool) -> Self {
        Self {
            four_octet_as,
            seen: [false; 256],
            attrs: PathAttributes::default(),
            as4_path: None,
            mp_reach: None,
            mp_unreach: None,
            issues: Vec::new(),
        }
    }

    fn withdraw(&mut self, type_code: u8, what: &'static str) {
        self.issues.push(AttributeIssue {
            type_code,
            disposition: Disposition::TreatAsWithdraw,
            what,
        });
    }

    fn discard(&mut self, type_code: u8, what: &'static str) {
        self.issues.push(AttributeIssue {
            type_code,
            disposition: Disposition::Discard,
            what,
        });
    }

    /// Reads every attribute; an error when the framing breaks (what was read is kept) or
    /// an MP attribute is malformed or repeated.
    fn read(&mut self, mut attrs: &[u8]) -> Result<(), ReadError> {
        let framing = || {
            ReadError::Framing(reset(
                sub::MALFORMED_ATTRIBUTE_LIST,
                "path attributes whose framing breaks",
            ))
        };
        while !attrs.is_empty() {
            let [flags, code, rest @ ..] = attrs else {
                return Err(framing());
            };
            let (len, rest) = if flags & FLAG_EXTENDED != 0 {
                match rest {
                    [l0, l1, r @ ..] => (usize::from(u16::from_be_bytes([*l0, *l1])), r),
                    _ => return Err(framing()),
                }
            } else {
                match rest {
                    [l, r @ ..] => (usize::from(*l), r),
                    _ => return Err(framing()),
                }
            };
            let Some(value) = rest.get(..len) else {
                return Err(framing());
            };
            attrs = &rest[len..];
            self.one(*flags, *code, value).map_err(ReadError::Fatal)?;
        }
        Ok(())
    }

    fn one(&mut self, flags: u8, code: u8, v: &[u8]) -> Result<(), DecodeError> {
        let first = !self.seen[usize::from(code)];
        self.seen[usize::from(code)] = true;
        if matches!(code, ATTR_MP_REACH | ATTR_MP_UNREACH) {
            if !first {
                return Err(reset(
                    sub::MALFORMED_ATTRIBUTE_LIST,
                    "MP_REACH_NLRI or MP_UNREACH_NLRI twice",
                ));
            }
            if flags & (FLAG_OPTIONAL | FLAG_TRANSITIVE) != FLAG_OPTIONAL {
                return Err(reset(
                    sub::ATTRIBUTE_FLAGS,
                    "MP_REACH_NLRI or MP_UNREACH_NLRI flagged wrong",
                ));
            }
            return if code == ATTR_MP_REACH {
                self.mp_reach = Some(mp_reach(v)?);
                Ok(())
            } else {
                self.mp_unreach = Some(mp_unreach(v)?);
                Ok(())
            };
        }
        if !first {
            self.discard(code, "an attribute repeated");
            return Ok(());
        }
        // The optional and transitive bits each known attribute must carry (§3 c).
        let expected = match code {
            ATTR_ORIGIN
            | ATTR_AS_PATH
            | ATTR_NEXT_HOP
            | ATTR_LOCAL_PREF
            | ATTR_ATOMIC_AGGREGATE => Some(FLAG_TRANSITIVE),
            ATTR_MED | ATTR_ORIGINATOR_ID | ATTR_CLUSTER_LIST => Some(FLAG_OPTIONAL),
            ATTR_AGGREGATOR
            | ATTR_COMMUNITIES
            | ATTR_EXT_COMMUNITIES
            | ATTR_AS4_PATH
            | ATTR_AS4_AGGREGATOR
            | ATTR_LARGE_COMMUNITIES => Some(FLAG_OPTIONAL | FLAG_TRANSITIVE),
            _ => None,
        };
        let Some(expected) = expected else {
            if flags & FLAG_OPTIONAL == 0 {
                self.withdraw(code, "an unrecognized well-known attribute");
            }
            // Optional and unknown: ignored (calix passes no route on).
            return Ok(());
        };
        if flags & (FLAG_OPTIONAL | FLAG_TRANSITIVE) != expected {
            match code {
                ATTR_ATOMIC_AGGREGATE | ATTR_AGGREGATOR | ATTR_AS4_PATH | ATTR_AS4_AGGREGATOR => {
                    self.discard(code, "an attribute flagged wrong")
                }
                _ => self.withdraw(code, "an attribute flagged wrong"),
            }
            return Ok(());
        }
        let u32_of = |v: &[u8]| match v {
            [a, b, c, d] => Some(u32::from_be_bytes([*a, *b, *c, *d])),
            _ => None,
        };
        match code {
            ATTR_ORIGIN => match v {
                [0] => self.attrs.origin = Origin::Igp,
                [1] => self.attrs.origin = Origin::Egp,
                [2] => self.attrs.origin = Origin::Incomplete,
                _ => self.withdraw(code, "a malformed ORIGIN"),
            },
            ATTR_AS_PATH => match as_path(v, if self.four_octet_as { 4 } else { 2 }) {
                Some(p) => self.attrs.as_path = p,
                None => self.withdraw(code, "a malformed AS_PATH"),
            },
            ATTR_NEXT_HOP => match u32_of(v) {
                Some(a) => self.attrs.next_hop = Some(Ipv4Addr::from(a)),
                None => self.withdraw(code, "a NEXT_HOP of the wrong length"),
            },
            ATTR_MED => match u32_of(v) {
                Some(m) => self.attrs.med = Some(m),
                None => self.withdraw(code, "a MULTI_EXIT_DISC of the wrong length"),
            },
            ATTR_LOCAL_PREF => match u32_of(v) {
                Some(p) => self.attrs.local_pref = Some(p),
                None => self.withdraw(code, "a LOCAL_PREF of the wrong length"),
            },
            ATTR_ATOMIC_AGGREGATE if !v.is_empty() => {
                self.discard(code, "an ATOMIC_AGGREGATE with a value")
            }
            ATTR_AGGREGATOR if v.len() != if self.four_octet_as { 8 } else { 6 } => {
                self.discard(code, "an AGGREGATOR of the wrong length")
            }
            ATTR_AS4_AGGREGATOR if v.len() != 8 => {
                self.discard(code, "an AS4_AGGREGATOR of the wrong length")
            }
            ATTR_COMMUNITIES => {
                if v.is_empty() || !v.len().is_multiple_of(4) {
                    self.withdraw(code, "COMMUNITIES of the wrong length");
                } else {
                    self.attrs.communities = v
                        .chunks_exact(4)
                        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                }
            }
            ATTR_LARGE_COMMUNITIES => {
                if v.is_empty() || !v.len().is_multiple_of(12) {
                    self.withdraw(code, "LARGE_COMMUNITY of the wrong length");
                } else {
                    self.attrs.large_communities = v
                        .chunks_exact(12)
                        .map(|c| {
                            let w =
                                |i: usize| u32::from_be_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
                            [w(0), w(4), w(8)]
                        })
                        .collect();
                }
            }
            ATTR_EXT_COMMUNITIES if v.is_empty() || !v.len().is_multiple_of(8) => {
                self.withdraw(code, "EXTENDED_COMMUNITIES of the wrong length")
            }
            ATTR_ORIGINATOR_ID if v.len() != 4 => {
                self.withdraw(code, "an ORIGINATOR_ID of the wrong length")
            }
            ATTR_CLUSTER_LIST if v.is_empty() || !v.len().is_multiple_of(4) => {
                self.withdraw(code, "a CLUSTER_LIST of the wrong length")
            }
            ATTR_AS4_PATH => match as_path(v, 4) {
                // Only read on a 2-octet session (RFC 6793 §4.1: a 4-octet speaker ignores it).
                Some(p) if !self.four_octet_as => self.as4_path = Some(p),
                Some(_) => {}
                None => self.discard(code, "a malformed AS4_PATH"),
            },
            _ => {}
        }
        Ok(())
    }

    /// The attributes, AS4_PATH merged in, and which mandatory ones were missing.
    fn finish(&mut self) -> Read {
        let mut attrs = std::mem::take(&mut self.attrs);
        if let Some(as4) = self.as4_path.take() {
            attrs.as_path = merge_as4(&attrs.as_path, as4);
        }
        Read {
            attrs,
            origin_missing: !self.seen[usize::from(ATTR_ORIGIN)],
            as_path_missing: !self.seen[usize::from(ATTR_AS_PATH)],
        }
    }
}

/// An AS_PATH's segments, each AS `width` bytes; `None` when malformed (an unknown segment
/// type, an empty segment, lengths that do not add up).
fn as_path(mut v: &[u8], width: usize) -> Option<Vec<AsSegment>> {
    let mut out = Vec::new();
    while let [kind, count, rest @ ..] = v {
        let set = match *kind {
            AS_SET => true,
            AS_SEQUENCE => false,
            _ => return None,
        };
        let n = usize::from(*count);
        if n == 0 {
            return None;
        }
        let bytes = rest.get(..n * width)?;
        let asns = bytes
            .chunks_exact(width)
            .map(|c| match c {
                [a, b] => u32::from(u16::from_be_bytes([*a, *b])),
                [a, b, c, d] => u32::from_be_bytes([*a, *b, *c, *d]),
                _ => 0,
            })
            .collect();
        out.push(AsSegment { set, asns });
        v = &rest[n * width..];
    }
    v.is_empty().then_some(out)
}

/// RFC 6793 §4.2.3: AS4_PATH replaces as many trailing ASes of AS_PATH as it holds, unless
/// it holds more (then it is ignored).
fn merge_as4(as_path: &[AsSegment], as4: Vec<AsSegment>) -> Vec<AsSegment> {
    let count =
        |p: &[AsSegment]| -> usize { p.iter().map(|s| if s.set { 1 } else { s.asns.len() }).sum() };
    let (n, m) = (count(as_path), count(&as4));
    if m > n {
        return as_path.to_vec();
    }
    let mut keep = n - m;
    let mut out = Vec::new();
    for s in as_path {
        if keep == 0 {
            break;
        }
        let weight = if s.set { 1 } else { s.asns.len() };
        if weight <= keep {
            out.push(s.clone());
            keep -= weight;
        } else {
            out.push(AsSegment {
                set: false,
                asns: s.asns[..keep].to_vec(),
            });
            keep = 0;
        }
    }
    out.extend(as4);
    out
}

fn mp_family(v: &[u8]) -> Option<(Family, &[u8])> {
    let [a0, a1, safi, rest @ ..] = v else {
        return None;
    };
    Some((
        Family::from_wire(u16::from_be_bytes([*a0, *a1]), *safi),
        rest,
    ))
}

fn mp_error(what: &'static str) -> DecodeError {
    reset(sub::OPTIONAL_ATTRIBUTE, what)
}

fn mp_reach(v: &[u8]) -> Result<MpReach, DecodeError> {
    let (family, rest) = mp_family(v).ok_or_else(|| mp_error("an MP_REACH_NLRI cut short"))?;
    let [nh_len, rest @ ..] = rest else {
        return Err(mp_error("an MP_REACH_NLRI cut short"));
    };
    let nh_len = usize::from(*nh_len);
    let (Some(nh), Some([_reserved, nlri @ ..])) = (rest.get(..nh_len), rest.get(nh_len..)) else {
        return Err(mp_error("an MP_REACH_NLRI cut short"));
    };
    let Some(addr_len) = family.addr_len() else {
        // A family calix did not offer: its routes are not read (nor withdrawn: none were taken).
        return Ok(MpReach {
            next_hop: None,
            link_local: None,
            nlri: Vec::new(),
        });
    };
    let (next_hop, link_local) = match nh {
        [a, b, c, d] => (Some(IpAddr::V4(Ipv4Addr::new(*a, *b, *c, *d))), None),
        _ if nh.len() == 16 || nh.len() == 32 => {
            let mut g = [0u8; 16];
            g.copy_from_slice(&nh[..16]);
            let ll = (nh.len() == 32).then(|| {
                let mut l = [0u8; 16];
                l.copy_from_slice(&nh[16..]);
                Ipv6Addr::from(l)
            });
            (Some(IpAddr::V6(Ipv6Addr::from(g))), ll)
        }
        _ => return Err(mp_error("an MP_REACH_NLRI next hop of the wrong length")),
    };
    let nlri = prefix::decode(nlri, addr_len)
        .map_err(|_| mp_error("an MP_REACH_NLRI whose prefixes do not add up"))?;
    Ok(MpReach {
        next_hop,
        link_local,
        nlri,
    })
}

fn mp_unreach(v: &[u8]) -> Result<MpUnreach, DecodeError> {
    let (family, nlri) = mp_family(v).ok_or_else(|| mp_error("an MP_UNREACH_NLRI cut short"))?;
    let nlri = match family.addr_len() {
        Some(addr_len) => prefix::decode(nlri, addr_len)
            .map_err(|_| mp_error("an MP_UNREACH_NLRI whose prefixes do not add up"))?,
        None => Vec::new(),
    };
    Ok(MpUnreach { family, nlri })
}
