//! A table as one nfnetlink batch: `BATCH_BEGIN`, add the table (so that deleting it cannot
//! fail), delete it, create it again with everything in it, `BATCH_END`. The kernel applies
//! a batch as one transaction: every message or none, and no packet sees a half-made table.
//! Each message but the delimiters asks for an ack, and [`Batch::what`] says what each
//! sequence number did, so an error names the message the kernel refused.

use super::data::{Element, MapData, Set};
use super::expr::{self, put_data, Expr, SetRef, LIST_ELEM};
use super::model::{Family, Table};
use super::rule::successor;
use super::wire::{
    Writer, NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFNL_SUBSYS_NFTABLES, NLM_F_ACK,
    NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST,
};

// NFT_MSG_*.
pub(crate) const NEWTABLE: u16 = 0;
pub(crate) const GETTABLE: u16 = 1;
const DELTABLE: u16 = 2;
pub(crate) const NEWCHAIN: u16 = 3;
pub(crate) const GETCHAIN: u16 = 4;
pub(crate) const NEWRULE: u16 = 6;
pub(crate) const GETRULE: u16 = 7;
pub(crate) const NEWSET: u16 = 9;
pub(crate) const GETSET: u16 = 10;
pub(crate) const NEWSETELEM: u16 = 12;
pub(crate) const GETSETELEM: u16 = 13;
pub(crate) const NEWGEN: u16 = 15;
pub(crate) const GETGEN: u16 = 16;

// NFT_SET_* flags.
pub(crate) const SET_ANONYMOUS: u32 = 0x1;
pub(crate) const SET_CONSTANT: u32 = 0x2;
pub(crate) const SET_INTERVAL: u32 = 0x4;
pub(crate) const SET_MAP: u32 = 0x8;
/// `NFT_DATA_VERDICT`: a verdict map's data type.
pub(crate) const DATA_VERDICT: u32 = 0xffff_ff00;
/// `NFT_SET_ELEM_INTERVAL_END`.
pub(crate) const ELEM_INTERVAL_END: u32 = 0x1;
/// `NFTNL_UDATA_*_COMMENT`: a comment in a table's or rule's user data.
pub(crate) const UDATA_COMMENT: u8 = 0;
/// A set-element message stays well below the 64 KiB a netlink attribute can hold.
const ELEMS_PER_MESSAGE_BYTES: usize = 32 * 1024;

/// The netlink message type of nf_tables message `m`.
pub(crate) const fn msg_type(m: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | m
}

/// The bytes to send, and what each sequence number asked for.
#[derive(Debug)]
pub(crate) struct Batch {
    pub bytes: Vec<u8>,
    /// `(seq, what)` of every message, the delimiters included (a failed commit is reported
    /// against `BATCH_BEGIN`).
    pub what: Vec<(u32, String)>,
    /// The sequence numbers that asked for an ack.
    pub acked: Vec<u32>,
}

struct Builder {
    w: Writer,
    family: u8,
    seq: u32,
    what: Vec<(u32, String)>,
    acked: Vec<u32>,
    next_set_id: u32,
}

impl Builder {
    fn new(family: Family, seq: u32) -> Self {
        let mut b = Self {
            w: Writer::new(),
            family: family.nfproto(),
            seq,
            what: Vec::new(),
            acked: Vec::new(),
            next_set_id: 1,
        };
        b.delimiter(NFNL_MSG_BATCH_BEGIN, "the batch (its commit)");
        b
    }

    fn delimiter(&mut self, ty: u16, what: &str) {
        self.w
            .begin(ty, NLM_F_REQUEST, self.seq, 0, NFNL_SUBSYS_NFTABLES);
        self.w.end();
        self.what.push((self.seq, what.to_string()));
        self.seq += 1;
    }

    /// Starts message `m`; the caller writes its attributes and calls `self.w.end()`.
    fn msg(&mut self, m: u16, flags: u16, what: String) {
        self.w.begin(
            msg_type(m),
            NLM_F_REQUEST | NLM_F_ACK | flags,
            self.seq,
            self.family,
            0,
        );
        self.what.push((self.seq, what));
        self.acked.push(self.seq);
        self.seq += 1;
    }

    fn finish(mut self) -> Batch {
        self.delimiter(NFNL_MSG_BATCH_END, "the batch's end");
        Batch {
            bytes: self.w.into_bytes(),
            what: self.what,
            acked: self.acked,
        }
    }

    fn table(&mut self, m: u16, name: &str, new: Option<(u32, Option<&str>)>, what: &str) {
        self.msg(m, if m == NEWTABLE { NLM_F_CREATE } else { 0 }, what.into());
        self.w.put_str(1, name);
        if let Some((flags, comment)) = new {
            self.w.put_be32(2, flags);
            if let Some(c) = comment {
                self.w.put(6, &udata_comment(c));
            }
        }
        self.w.end();
    }

    /// NEWSET and its elements; returns the set's name as written and its batch id.
    fn set(&mut self, table: &str, set: &Set, anonymous: bool) -> (String, u32) {
        let id = self.next_set_id;
        self.next_set_id += 1;
        let name = if !anonymous {
            set.name.clone()
        } else if set.map.is_some() {
            "__map%d".to_string()
        } else {
            "__set%d".to_string()
        };
        let raw = raw_elements(set);
        let what = if anonymous {
            "an anonymous set".to_string()
        } else {
            format!("set {}", set.name)
        };
        self.msg(NEWSET, NLM_F_CREATE, format!("adding {what}"));
        self.w.put_str(1, table);
        self.w.put_str(2, &name);
        let mut flags = 0;
        if anonymous {
            flags |= SET_ANONYMOUS | SET_CONSTANT;
        }
        if set.constant {
            flags |= SET_CONSTANT;
        }
        if set.interval {
            flags |= SET_INTERVAL;
        }
        if set.map.is_some() {
            flags |= SET_MAP;
        }
        self.w.put_be32(3, flags);
        self.w.put_be32(4, set.key.id);
        self.w.put_be32(5, set.key.len);
        match set.map {
            Some(MapData::Verdict) => self.w.put_be32(6, DATA_VERDICT),
            Some(MapData::Value(t)) => {
                self.w.put_be32(6, t.id);
                self.w.put_be32(7, t.len);
            }
            None => {}
        }
        self.w.put_be32(10, id);
        if anonymous {
            // Its size: the kernel picks the backend by it (a bitmap for small keys).
            self.w.nest(9);
            self.w.put_be32(1, raw.len() as u32);
            self.w.end_nest();
        }
        self.w.end();
        for chunk in chunks(&raw) {
            self.msg(
                NEWSETELEM,
                NLM_F_CREATE,
                format!("adding the elements of {what}"),
            );
            self.w.put_str(1, table);
            self.w.put_str(2, &name);
            if anonymous {
                self.w.put_be32(4, id);
            }
            self.w.nest(3);
            for e in chunk {
                self.w.nest(LIST_ELEM);
                self.w.nest(1);
                self.w.put(1, &e.key);
                self.w.end_nest();
                if e.end {
                    self.w.put_be32(3, ELEM_INTERVAL_END);
                }
                if let Some(d) = &e.data {
                    put_data(&mut self.w, 2, d);
                }
                self.w.end_nest();
            }
            self.w.end_nest();
            self.w.end();
        }
        (name, id)
    }
}

/// A table's comment as `nft` stores it: one user-data TLV, the text with its NUL.
pub(crate) fn udata_comment(c: &str) -> Vec<u8> {
    let mut v = vec![UDATA_COMMENT, (c.len() + 1) as u8];
    v.extend_from_slice(c.as_bytes());
    v.push(0);
    v
}

/// An element as the kernel takes it: interval sets hold a start and an end (the first key
/// past the range) per range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawElement {
    pub key: Vec<u8>,
    pub end: bool,
    pub data: Option<super::data::Data>,
}

pub(crate) fn raw_elements(set: &Set) -> Vec<RawElement> {
    if !set.interval {
        return set
            .elements
            .iter()
            .map(|e| RawElement {
                key: e.key.clone(),
                end: false,
                data: e.data.clone(),
            })
            .collect();
    }
    let mut ranges: Vec<&Element> = set.elements.iter().collect();
    ranges.sort();
    let mut out = Vec::new();
    // As `nft` does: an end at zero first when the first range does not start there.
    if ranges
        .first()
        .is_some_and(|e| e.key.iter().any(|b| *b != 0))
    {
        out.push(RawElement {
            key: vec![0; set.key.len as usize],
            end: true,
            data: None,
        });
    }
    for e in ranges {
        out.push(RawElement {
            key: e.key.clone(),
            end: false,
            data: e.data.clone(),
        });
        if let Some(next) = e.last.as_deref().and_then(successor) {
            out.push(RawElement {
                key: next,
                end: true,
                data: None,
            });
        }
    }
    out
}

/// Elements in groups that each fit one message.
fn chunks(raw: &[RawElement]) -> Vec<&[RawElement]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, e) in raw.iter().enumerate() {
        let size = 24 + e.key.len() + if e.data.is_some() { 300 } else { 0 };
        if bytes + size > ELEMS_PER_MESSAGE_BYTES && i > start {
            out.push(&raw[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < raw.len() {
        out.push(&raw[start..]);
    }
    out
}

/// The batch that makes the kernel's table exactly `t` (`t` validated).
pub(crate) fn replace(t: &Table, seq: u32) -> Batch {
    let mut b = Builder::new(t.family, seq);
    b.table(
        NEWTABLE,
        &t.name,
        Some((0, None)),
        "adding the table (so that it exists)",
    );
    b.table(DELTABLE, &t.name, None, "deleting the table");
    b.table(
        NEWTABLE,
        &t.name,
        Some((t.flags, t.comment.as_deref())),
        "creating the table",
    );
    // Every chain before any rule or set: a rule or a verdict map may jump to a chain
    // written after its own.
    for c in &t.chains {
        b.msg(NEWCHAIN, NLM_F_CREATE, format!("adding chain {}", c.name));
        b.w.put_str(1, &t.name);
        b.w.put_str(3, &c.name);
        if let Some(base) = &c.base {
            b.w.nest(4);
            b.w.put_be32(1, base.hook.number());
            b.w.put_be32(2, base.priority as u32);
            b.w.end_nest();
            b.w.put_be32(5, base.policy.code() as u32);
            b.w.put_str(7, base.kind.as_str());
        }
        b.w.end();
    }
    for s in &t.sets {
        b.set(&t.name, s, false);
    }
    for c in &t.chains {
        for (i, r) in c.rules.iter().enumerate() {
            let mut anon = Vec::new();
            for e in &r.exprs {
                if let Expr::Lookup {
                    set: SetRef::Anonymous(s),
                    ..
                } = e
                {
                    anon.push(b.set(&t.name, s, true));
                }
            }
            b.msg(
                NEWRULE,
                NLM_F_CREATE | NLM_F_APPEND,
                format!("adding rule {} of chain {}", i + 1, c.name),
            );
            b.w.put_str(1, &t.name);
            b.w.put_str(2, &c.name);
            b.w.nest(4);
            let mut anon = anon.into_iter();
            for e in &r.exprs {
                expr::encode(&mut b.w, e, &mut || {
                    anon.next().expect("one anonymous set per anonymous lookup")
                });
            }
            b.w.end_nest();
            if let Some(c) = &r.comment {
                b.w.put(7, &udata_comment(c));
            }
            b.w.end();
        }
    }
    b.finish()
}

/// The batch that deletes table `family name` if it exists (adding it first, so that the
/// delete never fails for want of a table).
pub(crate) fn delete(family: Family, name: &str, seq: u32) -> Batch {
    let mut b = Builder::new(family, seq);
    b.table(
        NEWTABLE,
        name,
        Some((0, None)),
        "adding the table (so that it exists)",
    );
    b.table(DELTABLE, name, None, "deleting the table");
    b.finish()
}
