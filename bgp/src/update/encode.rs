//! UPDATE encoded: one message from an [`Update`], or as many as a family's routes need
//! ([`UpdateBuilder`]).
use std::net::{IpAddr, Ipv6Addr};

use ipnet::IpNet;

use super::*;
use crate::limits::{HEADER_LEN, MAX_LEN};
use crate::prefix;
use crate::Family;

impl Update {
    pub(crate) fn encode_body(&self, out: &mut Vec<u8>, four_octet_as: bool) {
        let (w4, w6): (Vec<IpNet>, Vec<IpNet>) = self
            .withdrawn
            .iter()
            .partition(|n| matches!(n, IpNet::V4(_)));
        let (a4, a6): (Vec<_>, Vec<_>) = self
            .announced
            .iter()
            .partition(|(n, _)| matches!(n, IpNet::V4(_)));
        let mut withdrawn = Vec::new();
        for n in &w4 {
            prefix::encode(n, &mut withdrawn);
        }
        let mut attrs = Vec::new();
        if let Some(&(_, nh)) = a6.first() {
            let nlri: Vec<IpNet> = a6.iter().map(|(n, _)| *n).collect();
            encode_mp_reach(
                &mut attrs,
                Family::IPV6_UNICAST,
                nh,
                self.link_local_next_hop,
                &nlri,
            );
        }
        if !w6.is_empty() || self.end_of_rib == Some(Family::IPV6_UNICAST) {
            encode_mp_unreach(&mut attrs, Family::IPV6_UNICAST, &w6);
        }
        if !self.announced.is_empty() {
            let mut attributes = self.attributes.clone();
            if let Some(&(_, IpAddr::V4(nh))) = a4.first() {
                attributes.next_hop = Some(nh);
            }
            encode_attributes(&mut attrs, &attributes, four_octet_as);
        }
        out.extend_from_slice(&(withdrawn.len() as u16).to_be_bytes());
        out.extend_from_slice(&withdrawn);
        out.extend_from_slice(&(attrs.len() as u16).to_be_bytes());
        out.extend_from_slice(&attrs);
        for (n, _) in &a4 {
            prefix::encode(n, out);
        }
    }
}

fn put_attr(out: &mut Vec<u8>, flags: u8, code: u8, value: &[u8]) {
    if value.len() > 255 {
        out.push(flags | FLAG_EXTENDED);
        out.push(code);
        out.extend_from_slice(&(value.len() as u16).to_be_bytes());
    } else {
        out.push(flags);
        out.push(code);
        out.push(value.len() as u8);
    }
    out.extend_from_slice(value);
}

fn encode_as_path(path: &[AsSegment], width: usize) -> Vec<u8> {
    let mut v = Vec::new();
    for s in path {
        for chunk in s.asns.chunks(255) {
            v.push(if s.set { AS_SET } else { AS_SEQUENCE });
            v.push(chunk.len() as u8);
            for asn in chunk {
                if width == 4 {
                    v.extend_from_slice(&asn.to_be_bytes());
                } else {
                    let short = u16::try_from(*asn).unwrap_or(AS_TRANS as u16);
                    v.extend_from_slice(&short.to_be_bytes());
                }
            }
        }
    }
    v
}

/// ORIGIN, AS_PATH (and AS4_PATH on a 2-octet session whose path needs it), NEXT_HOP when
/// set, MULTI_EXIT_DISC, LOCAL_PREF, COMMUNITIES, LARGE_COMMUNITY.
fn encode_attributes(out: &mut Vec<u8>, a: &PathAttributes, four_octet_as: bool) {
    put_attr(out, FLAG_TRANSITIVE, ATTR_ORIGIN, &[a.origin as u8]);
    put_attr(
        out,
        FLAG_TRANSITIVE,
        ATTR_AS_PATH,
        &encode_as_path(&a.as_path, if four_octet_as { 4 } else { 2 }),
    );
    if !four_octet_as && a.asns().any(|n| n > u32::from(u16::MAX)) {
        put_attr(
            out,
            FLAG_OPTIONAL | FLAG_TRANSITIVE,
            ATTR_AS4_PATH,
            &encode_as_path(&a.as_path, 4),
        );
    }
    if let Some(nh) = a.next_hop {
        put_attr(out, FLAG_TRANSITIVE, ATTR_NEXT_HOP, &nh.octets());
    }
    if let Some(med) = a.med {
        put_attr(out, FLAG_OPTIONAL, ATTR_MED, &med.to_be_bytes());
    }
    if let Some(lp) = a.local_pref {
        put_attr(out, FLAG_TRANSITIVE, ATTR_LOCAL_PREF, &lp.to_be_bytes());
    }
    if !a.communities.is_empty() {
        let v: Vec<u8> = a.communities.iter().flat_map(|c| c.to_be_bytes()).collect();
        put_attr(out, FLAG_OPTIONAL | FLAG_TRANSITIVE, ATTR_COMMUNITIES, &v);
    }
    if !a.large_communities.is_empty() {
        let v: Vec<u8> = a
            .large_communities
            .iter()
            .flat_map(|c| c.iter().flat_map(|w| w.to_be_bytes()))
            .collect();
        put_attr(
            out,
            FLAG_OPTIONAL | FLAG_TRANSITIVE,
            ATTR_LARGE_COMMUNITIES,
            &v,
        );
    }
}

fn encode_mp_reach(
    out: &mut Vec<u8>,
    family: Family,
    next_hop: IpAddr,
    link_local: Option<Ipv6Addr>,
    nlri: &[IpNet],
) {
    let mut v = Vec::new();
    v.extend_from_slice(&family.afi.to_be_bytes());
    v.push(family.safi);
    match (next_hop, link_local) {
        (IpAddr::V4(a), _) => {
            v.push(4);
            v.extend_from_slice(&a.octets());
        }
        (IpAddr::V6(g), Some(l)) => {
            v.push(32);
            v.extend_from_slice(&g.octets());
            v.extend_from_slice(&l.octets());
        }
        (IpAddr::V6(g), None) => {
            v.push(16);
            v.extend_from_slice(&g.octets());
        }
    }
    v.push(0);
    for n in nlri {
        prefix::encode(n, &mut v);
    }
    put_attr(out, FLAG_OPTIONAL, ATTR_MP_REACH, &v);
}

fn encode_mp_unreach(out: &mut Vec<u8>, family: Family, nlri: &[IpNet]) {
    let mut v = Vec::new();
    v.extend_from_slice(&family.afi.to_be_bytes());
    v.push(family.safi);
    for n in nlri {
        prefix::encode(n, &mut v);
    }
    put_attr(out, FLAG_OPTIONAL, ATTR_MP_UNREACH, &v);
}

/// Builds the UPDATE messages that announce or withdraw routes of one family, as many
/// prefixes to a message as fit in 4,096 bytes.
#[derive(Clone, Debug)]
pub struct UpdateBuilder {
    pub four_octet_as: bool,
    /// The announced routes' attributes (NEXT_HOP is set from the next hop given).
    pub attributes: PathAttributes,
}

impl UpdateBuilder {
    /// Messages announcing `prefixes` (all of `family`) via `next_hop` (and, for IPv6, the
    /// link-local next hop when given).
    pub fn announce(
        &self,
        family: Family,
        next_hop: IpAddr,
        link_local: Option<Ipv6Addr>,
        prefixes: &[IpNet],
    ) -> Vec<Vec<u8>> {
        let mut attributes = self.attributes.clone();
        let ipv4_body = family == Family::IPV4_UNICAST;
        if let (true, IpAddr::V4(nh)) = (ipv4_body, next_hop) {
            attributes.next_hop = Some(nh);
        } else {
            attributes.next_hop = None;
        }
        let mut attrs = Vec::new();
        encode_attributes(&mut attrs, &attributes, self.four_octet_as);
        // Room for prefixes: the message, less the header, the two lengths, the attributes
        // and (IPv6) MP_REACH_NLRI's own header (flags, code, 2-byte length, AFI, SAFI, next
        // hop length and up to 32 bytes, reserved).
        let fixed = HEADER_LEN + 4 + attrs.len() + if ipv4_body { 0 } else { 4 + 4 + 33 };
        let room = MAX_LEN.saturating_sub(fixed);
        chunks(prefixes, room)
            .into_iter()
            .map(|chunk| {
                let mut body = Vec::with_capacity(MAX_LEN);
                body.extend_from_slice(&[0, 0]);
                let mut all = Vec::with_capacity(attrs.len() + room);
                if !ipv4_body {
                    encode_mp_reach(&mut all, family, next_hop, link_local, chunk);
                }
                all.extend_from_slice(&attrs);
                body.extend_from_slice(&(all.len() as u16).to_be_bytes());
                body.extend_from_slice(&all);
                if ipv4_body {
                    for n in chunk {
                        prefix::encode(n, &mut body);
                    }
                }
                frame(body)
            })
            .collect()
    }

    /// Messages withdrawing `prefixes` (all of `family`).
    pub fn withdraw(&self, family: Family, prefixes: &[IpNet]) -> Vec<Vec<u8>> {
        let ipv4_body = family == Family::IPV4_UNICAST;
        let room = MAX_LEN - HEADER_LEN - 4 - if ipv4_body { 0 } else { 4 + 3 };
        chunks(prefixes, room)
            .into_iter()
            .map(|chunk| {
                let mut body = Vec::with_capacity(MAX_LEN);
                if ipv4_body {
                    let mut w = Vec::new();
                    for n in chunk {
                        prefix::encode(n, &mut w);
                    }
                    body.extend_from_slice(&(w.len() as u16).to_be_bytes());
                    body.extend_from_slice(&w);
                    body.extend_from_slice(&[0, 0]);
                } else {
                    let mut a = Vec::new();
                    encode_mp_unreach(&mut a, family, chunk);
                    body.extend_from_slice(&[0, 0]);
                    body.extend_from_slice(&(a.len() as u16).to_be_bytes());
                    body.extend_from_slice(&a);
                }
                frame(body)
            })
            .collect()
    }

    /// The End-of-RIB marker of `family` (RFC 4724 §2).
    pub fn end_of_rib(family: Family) -> Vec<u8> {
        if family == Family::IPV4_UNICAST {
            return frame(vec![0, 0, 0, 0]);
        }
        let mut a = Vec::new();
        encode_mp_unreach(&mut a, family, &[]);
        let mut body = vec![0, 0];
        body.extend_from_slice(&(a.len() as u16).to_be_bytes());
        body.extend_from_slice(&a);
        frame(body)
    }
}

/// Splits `prefixes` into runs of at most `room` encoded bytes (at least one prefix each).
fn chunks(prefixes: &[IpNet], room: usize) -> Vec<&[IpNet]> {
    let mut out = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (i, n) in prefixes.iter().enumerate() {
        let len = prefix::encoded_len(n);
        if used + len > room && i > start {
            out.push(&prefixes[start..i]);
            start = i;
            used = 0;
        }
        used += len;
    }
    if start < prefixes.len() {
        out.push(&prefixes[start..]);
    }
    out
}

/// An UPDATE body framed as a message.
fn frame(body: Vec<u8>) -> Vec<u8> {
    let mut m = Vec::with_capacity(HEADER_LEN + body.len());
    m.extend_from_slice(&[0xff; 16]);
    m.extend_from_slice(&((HEADER_LEN + body.len()) as u16).to_be_bytes());
    m.push(crate::limits::TYPE_UPDATE);
    m.extend_from_slice(&body);
    m
}
