//! Reading a table back: the table, then dumps of its chains, sets (with their elements) and
//! rules, decoded into the model, between two reads of the ruleset's generation: when
//! something changed the ruleset meanwhile, the read starts over. Anonymous sets are put back
//! inside the lookups that use them, interval sets' start and end elements become ranges,
//! counters' counts are dropped: the result compares with what was written.

use super::batch::{
    msg_type, RawElement, DATA_VERDICT, ELEM_INTERVAL_END, GETCHAIN, GETGEN, GETRULE, GETSET,
    GETSETELEM, GETTABLE, NEWCHAIN, NEWGEN, NEWRULE, NEWSET, NEWSETELEM, NEWTABLE, SET_ANONYMOUS,
    SET_CONSTANT, SET_INTERVAL, SET_MAP, UDATA_COMMENT,
};
use super::data::{Data, Element, KeyType, MapData, Set, Verdict};
use super::expr::{self, data_of, Expr, SetRef, LIST_ELEM};
use super::model::{BaseChain, Chain, ChainType, Family, Hook, Rule, Table};
use super::rule::predecessor;
use super::socket::Socket;
use super::wire::{
    be32, malformed, nf, string, Attrs, Malformed, Writer, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};
use super::NetlinkError;

/// `NLM_F_DUMP_INTR`: the dump saw the ruleset change.
const NLM_F_DUMP_INTR: u16 = 0x10;

/// What one read gives: the table (`None`: there is none), or `Unsettled` when the ruleset
/// changed during the read.
pub(crate) enum Read {
    Done(Option<Table>),
    Unsettled,
}

/// One request (a dump, or a get with an ack) and its replies' payloads of type `want`.
fn request(
    sock: &mut Socket,
    m: u16,
    want: u16,
    flags: u16,
    family: Family,
    attrs: &dyn Fn(&mut Writer),
) -> Result<(Vec<Vec<u8>>, bool), NetlinkError> {
    let seq = sock.seqs(1);
    let mut w = Writer::new();
    w.begin(msg_type(m), NLM_F_REQUEST | flags, seq, family.nfproto(), 0);
    attrs(&mut w);
    w.end();
    let bytes = w.into_bytes();
    let mut out = Vec::new();
    let mut interrupted = false;
    sock.dump(&bytes, seq, &mut |msg| {
        interrupted |= msg.flags & NLM_F_DUMP_INTR != 0;
        if msg.ty == msg_type(want) {
            out.push(msg.payload.to_vec());
        }
        Ok(())
    })?;
    Ok((out, interrupted))
}

/// The ruleset's generation: every committed batch increments it.
pub(super) fn generation(sock: &mut Socket) -> Result<u32, NetlinkError> {
    let (replies, _) = request(sock, GETGEN, NEWGEN, NLM_F_ACK, Family::Inet, &|_| {})?;
    for p in &replies {
        for a in nf(p)?.1 {
            if let (1, v) = a? {
                return Ok(be32(v)?);
            }
        }
    }
    Err(malformed("a generation reply without its id").into())
}

/// The attributes of a reply (after its `nfgenmsg`).
fn attrs_of(payload: &[u8]) -> Result<Vec<(u16, &[u8])>, Malformed> {
    let (_family, attrs) = nf(payload)?;
    attrs.collect_all()
}

fn get<'a>(attrs: &[(u16, &'a [u8])], ty: u16) -> Option<&'a [u8]> {
    attrs.iter().find(|(t, _)| *t == ty).map(|(_, v)| *v)
}

fn need<'a>(attrs: &[(u16, &'a [u8])], ty: u16) -> Result<&'a [u8], Malformed> {
    get(attrs, ty).ok_or(malformed("a reply without a required attribute"))
}

/// The comment in user data (`nft`'s TLVs).
fn comment_of(udata: Option<&[u8]>) -> Option<String> {
    let mut rest = udata?;
    while rest.len() >= 2 {
        let (ty, len) = (rest[0], rest[1] as usize);
        let value = rest.get(2..2 + len)?;
        if ty == UDATA_COMMENT {
            return string(value).ok();
        }
        rest = &rest[2 + len..];
    }
    None
}

/// Reads table `family name` once.
pub(crate) fn read_once(
    sock: &mut Socket,
    family: Family,
    name: &str,
) -> Result<Read, NetlinkError> {
    let gen = generation(sock)?;
    let table = match request(sock, GETTABLE, NEWTABLE, NLM_F_ACK, family, &|w| {
        w.put_str(1, name)
    }) {
        Ok((replies, _)) => replies,
        Err(NetlinkError::Errno(nix::errno::Errno::ENOENT)) => {
            return Ok(if generation(sock)? == gen {
                Read::Done(None)
            } else {
                Read::Unsettled
            });
        }
        Err(e) => return Err(e),
    };
    let mut t = Table::new(family, name);
    for p in &table {
        let a = attrs_of(p)?;
        t.comment = comment_of(get(&a, 6));
        t.flags = get(&a, 2).map(be32).transpose()?.unwrap_or(0);
    }
    let mut interrupted = false;
    let ours = |a: &[(u16, &[u8])]| -> Result<bool, Malformed> { Ok(string(need(a, 1)?)? == name) };

    let (chains, intr) = request(sock, GETCHAIN, NEWCHAIN, NLM_F_DUMP, family, &|_| {})?;
    interrupted |= intr;
    for p in &chains {
        let a = attrs_of(p)?;
        if ours(&a)? {
            t.chains.push(chain_of(&a)?);
        }
    }

    let (sets, intr) = request(sock, GETSET, NEWSET, NLM_F_DUMP, family, &|w| {
        w.put_str(1, name)
    })?;
    interrupted |= intr;
    let mut anonymous = Vec::new();
    for p in &sets {
        let a = attrs_of(p)?;
        if !ours(&a)? {
            continue;
        }
        let (mut set, flags) = set_of(&a)?;
        let (elems, intr) = request(sock, GETSETELEM, NEWSETELEM, NLM_F_DUMP, family, &|w| {
            w.put_str(1, name);
            w.put_str(2, &set.name);
        })?;
        interrupted |= intr;
        let mut raw = Vec::new();
        for p in &elems {
            raw.extend(raw_elements_of(&attrs_of(p)?)?);
        }
        set.elements = elements_of(raw, set.interval, set.key.len as usize);
        if flags & SET_ANONYMOUS != 0 {
            anonymous.push(set);
        } else {
            t.sets.push(set);
        }
    }

    let (rules, intr) = request(sock, GETRULE, NEWRULE, NLM_F_DUMP, family, &|w| {
        w.put_str(1, name)
    })?;
    interrupted |= intr;
    for p in &rules {
        let a = attrs_of(p)?;
        if !ours(&a)? {
            continue;
        }
        let chain = string(need(&a, 2)?)?;
        let mut rule = Rule {
            exprs: Vec::new(),
            comment: comment_of(get(&a, 7)),
        };
        if let Some(list) = get(&a, 4) {
            for e in Attrs::new(list) {
                let (ty, v) = e?;
                if ty == LIST_ELEM {
                    rule.exprs.push(anonymous_in(expr::decode(v)?, &anonymous));
                }
            }
        }
        match t.chains.iter_mut().find(|c| c.name == chain) {
            Some(c) => c.rules.push(rule),
            // A chain made after the chain dump: read again.
            None => interrupted = true,
        }
    }

    if interrupted || generation(sock)? != gen {
        return Ok(Read::Unsettled);
    }
    Ok(Read::Done(Some(t)))
}

/// The counts of one rule with a counter ([`counters`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleCount {
    pub chain: String,
    pub comment: Option<String>,
    pub packets: u64,
    pub bytes: u64,
}

/// The counters of table `family name`'s rules, in the kernel's order (empty when there is no
/// such table). A rule with several counters gives its first's counts.
pub(crate) fn counters(
    sock: &mut Socket,
    family: Family,
    name: &str,
) -> Result<Vec<RuleCount>, NetlinkError> {
    let rules = match request(sock, GETRULE, NEWRULE, NLM_F_DUMP, family, &|w| {
        w.put_str(1, name)
    }) {
        Ok((rules, _)) => rules,
        Err(NetlinkError::Errno(nix::errno::Errno::ENOENT)) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for p in &rules {
        let a = attrs_of(p)?;
        if string(need(&a, 1)?)? != name {
            continue;
        }
        let mut found = None;
        for e in Attrs::new(get(&a, 4).unwrap_or_default()) {
            let (ty, v) = e?;
            if ty == LIST_ELEM {
                if let Some(c) = expr::counts(v)? {
                    found = Some(c);
                    break;
                }
            }
        }
        if let Some((packets, bytes)) = found {
            out.push(RuleCount {
                chain: string(need(&a, 2)?)?,
                comment: comment_of(get(&a, 7)),
                packets,
                bytes,
            });
        }
    }
    Ok(out)
}

/// A lookup in an anonymous set holds the set itself.
fn anonymous_in(e: Expr, anonymous: &[Set]) -> Expr {
    match e {
        Expr::Lookup {
            sreg,
            set: SetRef::Named(n),
            dreg,
            invert,
        } => {
            let set = match anonymous.iter().find(|s| s.name == n) {
                Some(s) => SetRef::Anonymous(Box::new(s.clone())),
                None => SetRef::Named(n),
            };
            Expr::Lookup {
                sreg,
                set,
                dreg,
                invert,
            }
        }
        e => e,
    }
}

fn chain_of(a: &[(u16, &[u8])]) -> Result<Chain, Malformed> {
    let mut c = Chain::regular(string(need(a, 3)?)?);
    if let Some(hook) = get(a, 4) {
        let h = Attrs::new(hook).collect_all()?;
        let policy = match get(a, 5).map(be32).transpose()? {
            Some(0) => Verdict::Drop,
            _ => Verdict::Accept,
        };
        c.base = Some(BaseChain {
            kind: ChainType::parse(&string(need(a, 7)?)?),
            hook: Hook::from_number(be32(need(&h, 1)?)?),
            priority: be32(need(&h, 2)?)? as i32,
            policy,
        });
    }
    Ok(c)
}

/// The set, and its flags as the kernel holds them.
fn set_of(a: &[(u16, &[u8])]) -> Result<(Set, u32), Malformed> {
    let flags = get(a, 3).map(be32).transpose()?.unwrap_or(0);
    let key = KeyType {
        id: get(a, 4).map(be32).transpose()?.unwrap_or(0),
        len: be32(need(a, 5)?)?,
    };
    let mut set = Set::new(string(need(a, 2)?)?, key);
    set.interval = flags & SET_INTERVAL != 0;
    set.constant = flags & SET_CONSTANT != 0;
    if flags & SET_MAP != 0 {
        let ty = get(a, 6).map(be32).transpose()?.unwrap_or(0);
        set.map = Some(if ty == DATA_VERDICT {
            MapData::Verdict
        } else {
            MapData::Value(KeyType {
                id: ty,
                len: get(a, 7).map(be32).transpose()?.unwrap_or(0),
            })
        });
    }
    Ok((set, flags))
}

fn raw_elements_of(a: &[(u16, &[u8])]) -> Result<Vec<RawElement>, Malformed> {
    let mut out = Vec::new();
    let Some(list) = get(a, 3) else {
        return Ok(out);
    };
    for e in Attrs::new(list) {
        let (ty, v) = e?;
        if ty != LIST_ELEM {
            continue;
        }
        let ea = Attrs::new(v).collect_all()?;
        let key = match data_of(need(&ea, 1)?)? {
            Data::Value(k) => k,
            Data::Verdict(_) => return Err(malformed("a set element whose key is a verdict")),
        };
        let end = get(&ea, 3).map(be32).transpose()?.unwrap_or(0) & ELEM_INTERVAL_END != 0;
        let data = get(&ea, 2).map(data_of).transpose()?;
        out.push(RawElement { key, end, data });
    }
    Ok(out)
}

/// The model's elements: as they are, or for interval sets each start with the end after it
/// as one range (a start with no end runs to the largest key; a lone end is dropped).
pub(crate) fn elements_of(
    mut raw: Vec<RawElement>,
    interval: bool,
    key_len: usize,
) -> Vec<Element> {
    if !interval {
        let mut out: Vec<Element> = raw
            .into_iter()
            .map(|e| Element {
                key: e.key,
                last: None,
                data: e.data,
            })
            .collect();
        out.sort();
        return out;
    }
    // Ends before starts at the same key: a range ending where the next starts.
    raw.sort_by(|a, b| a.key.cmp(&b.key).then(b.end.cmp(&a.end)));
    let mut out = Vec::new();
    for (i, e) in raw.iter().enumerate() {
        if e.end {
            continue;
        }
        let last = match raw.get(i + 1) {
            Some(next) if next.end => predecessor(&next.key).unwrap_or_else(|| vec![0; key_len]),
            _ => vec![0xff; key_len],
        };
        out.push(Element {
            key: e.key.clone(),
            last: Some(last),
            data: e.data.clone(),
        });
    }
    out
}
