//! nf_tables expressions: the kernel's instruction set, one variant each, with their netlink
//! encoding and decoding. [`super::rule`] builds the sequences `nft` would emit for a match.

use super::data::{Data, Set, Verdict};
use super::wire::{be32, be64, malformed, string, u8_of, Attrs, Malformed, Writer};

/// A register: [`Reg::VERDICT`], the 16-byte `NFT_REG_1..4`, or the 4-byte `NFT_REG32_00..15`
/// (8..23), which overlap them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Reg(pub u32);

impl Reg {
    pub const VERDICT: Reg = Reg(0);
    pub const R1: Reg = Reg(1);
    pub const R2: Reg = Reg(2);
    /// `NFT_REG32_01`: the second 4 bytes of `R1` (a concatenation's second part).
    pub const R32_01: Reg = Reg(9);
}

/// Where a payload load starts (`NFT_PAYLOAD_*_HEADER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadBase {
    Link,
    Network,
    Transport,
    Other(u32),
}

impl PayloadBase {
    fn number(self) -> u32 {
        match self {
            PayloadBase::Link => 0,
            PayloadBase::Network => 1,
            PayloadBase::Transport => 2,
            PayloadBase::Other(n) => n,
        }
    }

    fn from_number(n: u32) -> Self {
        match n {
            0 => PayloadBase::Link,
            1 => PayloadBase::Network,
            2 => PayloadBase::Transport,
            n => PayloadBase::Other(n),
        }
    }
}

/// `NFT_META_*` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaKey(pub u32);

impl MetaKey {
    pub const LEN: MetaKey = MetaKey(0);
    pub const PROTOCOL: MetaKey = MetaKey(1);
    pub const MARK: MetaKey = MetaKey(3);
    pub const IIF: MetaKey = MetaKey(4);
    pub const OIF: MetaKey = MetaKey(5);
    pub const IIFNAME: MetaKey = MetaKey(6);
    pub const OIFNAME: MetaKey = MetaKey(7);
    pub const NFPROTO: MetaKey = MetaKey(15);
    pub const L4PROTO: MetaKey = MetaKey(16);
}

/// `NFT_CT_*` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtKey(pub u32);

impl CtKey {
    pub const STATE: CtKey = CtKey(0);
    pub const DIRECTION: CtKey = CtKey(1);
    pub const STATUS: CtKey = CtKey(2);
    pub const MARK: CtKey = CtKey(3);
}

/// `NFT_CMP_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Neq,
    Lt,
    Lte,
    Gt,
    Gte,
}

impl CmpOp {
    fn number(self) -> u32 {
        self as u32
    }

    fn from_number(n: u32) -> Option<Self> {
        [
            CmpOp::Eq,
            CmpOp::Neq,
            CmpOp::Lt,
            CmpOp::Lte,
            CmpOp::Gt,
            CmpOp::Gte,
        ]
        .get(n as usize)
        .copied()
    }
}

/// What a lookup looks in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetRef {
    /// A set of the table ([`super::Table::sets`]).
    Named(String),
    /// A set made for this rule alone (`{ a, b }` in `nft`), written just before it.
    Anonymous(Box<Set>),
}

/// `fib` flags (`NFTA_FIB_F_*`) and results (`NFT_FIB_RESULT_*`).
pub mod fib {
    pub const F_SADDR: u32 = 1 << 0;
    pub const F_DADDR: u32 = 1 << 1;
    pub const F_MARK: u32 = 1 << 2;
    pub const F_IIF: u32 = 1 << 3;
    pub const F_OIF: u32 = 1 << 4;
    pub const F_PRESENT: u32 = 1 << 5;
    pub const RESULT_OIF: u32 = 1;
    pub const RESULT_OIFNAME: u32 = 2;
    pub const RESULT_ADDRTYPE: u32 = 3;
}

/// NAT range flags (`NF_NAT_RANGE_*`).
pub mod nat {
    pub const MAP_IPS: u32 = 1 << 0;
    pub const PROTO_SPECIFIED: u32 = 1 << 1;
    pub const PROTO_RANDOM: u32 = 1 << 2;
    pub const PERSISTENT: u32 = 1 << 3;
    pub const PROTO_RANDOM_FULLY: u32 = 1 << 4;
}

/// One expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    /// Loads `len` bytes at `offset` from `base` into `dreg`.
    Payload {
        base: PayloadBase,
        offset: u32,
        len: u32,
        dreg: Reg,
    },
    Meta {
        key: MetaKey,
        dreg: Reg,
    },
    /// `dir`: the tuple's direction, for keys that have one (addresses, ports).
    Ct {
        key: CtKey,
        dir: Option<u8>,
        dreg: Reg,
    },
    /// `ct <key> set <sreg>` (`ct mark set ...`).
    CtSet {
        key: CtKey,
        sreg: Reg,
    },
    Cmp {
        sreg: Reg,
        op: CmpOp,
        data: Vec<u8>,
    },
    /// `dreg = (sreg & mask) ^ xor`.
    Bitwise {
        sreg: Reg,
        dreg: Reg,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    /// Whether `sreg` is in the set (not in it, `invert`); with `dreg`, a map's value.
    Lookup {
        sreg: Reg,
        set: SetRef,
        dreg: Option<Reg>,
        invert: bool,
    },
    Fib {
        flags: u32,
        result: u32,
        dreg: Reg,
    },
    /// Masquerade; with `proto`, the port range's registers (min, max).
    Masquerade {
        flags: u32,
        proto: Option<(Reg, Reg)>,
    },
    Immediate {
        dreg: Reg,
        data: Data,
    },
    /// Counts packets and bytes; the counts are not part of the model (they change).
    Counter,
    /// `limit rate <rate>/<unit> burst <burst> packets`: matches while within the rate (the
    /// rule goes on), else ends the rule; `unit` in seconds.
    Limit {
        rate: u64,
        unit: u64,
        burst: u32,
    },
    /// `log group <group> prefix <prefix> snaplen <snaplen>`: the packet's first `snaplen`
    /// bytes to `nfnetlink_log`'s group (a listener reads them: [`super::log`]).
    Log {
        group: u16,
        prefix: String,
        snaplen: u32,
    },
    /// As read back: an expression this module does not decode, kept as its name and
    /// attributes (so that a rule another tool wrote still compares unequal).
    Other {
        name: String,
        data: Vec<u8>,
    },
}

impl Expr {
    /// `immediate reg 0 <verdict>`.
    pub fn verdict(v: Verdict) -> Expr {
        Expr::Immediate {
            dreg: Reg::VERDICT,
            data: Data::Verdict(v),
        }
    }

    pub(crate) fn name(&self) -> &str {
        match self {
            Expr::Payload { .. } => "payload",
            Expr::Meta { .. } => "meta",
            Expr::Ct { .. } | Expr::CtSet { .. } => "ct",
            Expr::Cmp { .. } => "cmp",
            Expr::Bitwise { .. } => "bitwise",
            Expr::Lookup { .. } => "lookup",
            Expr::Fib { .. } => "fib",
            Expr::Masquerade { .. } => "masq",
            Expr::Immediate { .. } => "immediate",
            Expr::Counter => "counter",
            Expr::Limit { .. } => "limit",
            Expr::Log { .. } => "log",
            Expr::Other { name, .. } => name,
        }
    }
}

// NFTA_LIST_ELEM, NFTA_EXPR_NAME, NFTA_EXPR_DATA.
pub(crate) const LIST_ELEM: u16 = 1;
const EXPR_NAME: u16 = 1;
const EXPR_DATA: u16 = 2;
// NFTA_DATA_VALUE, NFTA_DATA_VERDICT; NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN.
const DATA_VALUE: u16 = 1;
const DATA_VERDICT: u16 = 2;
const VERDICT_CODE: u16 = 1;
const VERDICT_CHAIN: u16 = 2;

/// Writes `data` as an `NFTA_DATA_*` nest of type `ty`.
pub(crate) fn put_data(w: &mut Writer, ty: u16, data: &Data) {
    w.nest(ty);
    match data {
        Data::Value(v) => w.put(DATA_VALUE, v),
        Data::Verdict(v) => {
            w.nest(DATA_VERDICT);
            w.put_be32(VERDICT_CODE, v.code() as u32);
            if let Some(chain) = v.chain() {
                w.put_str(VERDICT_CHAIN, chain);
            }
            w.end_nest();
        }
    }
    w.end_nest();
}

/// Reads an `NFTA_DATA_*` nest.
pub(crate) fn data_of(v: &[u8]) -> Result<Data, Malformed> {
    for a in Attrs::new(v) {
        let (ty, v) = a?;
        match ty {
            DATA_VALUE => return Ok(Data::Value(v.to_vec())),
            DATA_VERDICT => {
                let (mut code, mut chain) = (None, None);
                for a in Attrs::new(v) {
                    match a? {
                        (VERDICT_CODE, v) => code = Some(be32(v)? as i32),
                        (VERDICT_CHAIN, v) => chain = Some(string(v)?),
                        _ => {}
                    }
                }
                let code = code.ok_or(malformed("a verdict without its code"))?;
                return Verdict::from_code(code, chain)
                    .map(Data::Verdict)
                    .ok_or(malformed("an unknown verdict"));
            }
            _ => {}
        }
    }
    Err(malformed("a data attribute with neither value nor verdict"))
}

/// Writes one expression as an `NFTA_LIST_ELEM`. `anon`: the name and batch id of the
/// anonymous set a lookup refers to (written just before the rule).
pub(crate) fn encode(w: &mut Writer, e: &Expr, anon: &mut dyn FnMut() -> (String, u32)) {
    w.nest(LIST_ELEM);
    w.put_str(EXPR_NAME, e.name());
    w.nest(EXPR_DATA);
    match e {
        Expr::Payload {
            base,
            offset,
            len,
            dreg,
        } => {
            w.put_be32(1, dreg.0);
            w.put_be32(2, base.number());
            w.put_be32(3, *offset);
            w.put_be32(4, *len);
        }
        Expr::Meta { key, dreg } => {
            w.put_be32(2, key.0);
            w.put_be32(1, dreg.0);
        }
        Expr::Ct { key, dir, dreg } => {
            w.put_be32(2, key.0);
            if let Some(d) = dir {
                w.put_u8(3, *d);
            }
            w.put_be32(1, dreg.0);
        }
        Expr::CtSet { key, sreg } => {
            // NFTA_CT_KEY, NFTA_CT_SREG.
            w.put_be32(2, key.0);
            w.put_be32(4, sreg.0);
        }
        Expr::Cmp { sreg, op, data } => {
            w.put_be32(1, sreg.0);
            w.put_be32(2, op.number());
            put_data(w, 3, &Data::Value(data.clone()));
        }
        Expr::Bitwise {
            sreg,
            dreg,
            mask,
            xor,
        } => {
            w.put_be32(1, sreg.0);
            w.put_be32(2, dreg.0);
            w.put_be32(3, mask.len() as u32);
            put_data(w, 4, &Data::Value(mask.clone()));
            put_data(w, 5, &Data::Value(xor.clone()));
        }
        Expr::Lookup {
            sreg,
            set,
            dreg,
            invert,
        } => {
            match set {
                SetRef::Named(name) => w.put_str(1, name),
                SetRef::Anonymous(_) => {
                    let (name, id) = anon();
                    w.put_str(1, &name);
                    w.put_be32(4, id);
                }
            }
            w.put_be32(2, sreg.0);
            if let Some(d) = dreg {
                w.put_be32(3, d.0);
            }
            if *invert {
                w.put_be32(5, 1);
            }
        }
        Expr::Fib {
            flags,
            result,
            dreg,
        } => {
            w.put_be32(1, dreg.0);
            w.put_be32(2, *result);
            w.put_be32(3, *flags);
        }
        Expr::Masquerade { flags, proto } => {
            if *flags != 0 {
                w.put_be32(1, *flags);
            }
            if let Some((min, max)) = proto {
                w.put_be32(2, min.0);
                w.put_be32(3, max.0);
            }
        }
        Expr::Immediate { dreg, data } => {
            w.put_be32(1, dreg.0);
            put_data(w, 2, data);
        }
        Expr::Counter => {
            w.put_be64(1, 0);
            w.put_be64(2, 0);
        }
        Expr::Limit { rate, unit, burst } => {
            // NFTA_LIMIT_RATE, _UNIT, _BURST, _TYPE (packets), _FLAGS.
            w.put_be64(1, *rate);
            w.put_be64(2, *unit);
            w.put_be32(3, *burst);
            w.put_be32(4, 0);
            w.put_be32(5, 0);
        }
        Expr::Log {
            group,
            prefix,
            snaplen,
        } => {
            // NFTA_LOG_GROUP, _PREFIX, _SNAPLEN.
            w.put(1, &group.to_be_bytes());
            w.put_str(2, prefix);
            w.put_be32(3, *snaplen);
        }
        Expr::Other { .. } => unreachable!("the writer refuses Expr::Other before encoding"),
    }
    w.end_nest();
    w.end_nest();
}

/// The name and the data of one `NFTA_LIST_ELEM` of a rule's expressions.
fn name_and_data(elem: &[u8]) -> Result<(Option<String>, Option<&[u8]>), Malformed> {
    let (mut name, mut data) = (None, None);
    for a in Attrs::new(elem) {
        match a? {
            (EXPR_NAME, v) => name = Some(string(v)?),
            (EXPR_DATA, v) => data = Some(v),
            _ => {}
        }
    }
    Ok((name, data))
}

/// The counts of one `NFTA_LIST_ELEM` of a rule's expressions when it is a counter: (packets,
/// bytes).
pub(crate) fn counts(elem: &[u8]) -> Result<Option<(u64, u64)>, Malformed> {
    let (name, data) = name_and_data(elem)?;
    if name.as_deref() != Some("counter") {
        return Ok(None);
    }
    let (mut packets, mut bytes) = (0, 0);
    for a in Attrs::new(data.unwrap_or_default()) {
        match a? {
            // NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS.
            (1, v) => bytes = be64(v)?,
            (2, v) => packets = be64(v)?,
            _ => {}
        }
    }
    Ok(Some((packets, bytes)))
}

/// Reads one `NFTA_LIST_ELEM` of a rule's expressions. Lookups come back as
/// [`SetRef::Named`], also for anonymous sets (the reader swaps those in).
pub(crate) fn decode(elem: &[u8]) -> Result<Expr, Malformed> {
    let (name, data) = name_and_data(elem)?;
    let name = name.ok_or(malformed("an expression without a name"))?;
    let data = data.unwrap_or_default();
    let attrs: Vec<(u16, &[u8])> = Attrs::new(data).collect_all()?;
    let get = |ty: u16| attrs.iter().find(|(t, _)| *t == ty).map(|(_, v)| *v);
    let need = |ty: u16| get(ty).ok_or(malformed("an expression without a required attribute"));
    let reg = |ty: u16| need(ty).and_then(be32).map(Reg);
    let value = |ty: u16| match data_of(need(ty)?)? {
        Data::Value(v) => Ok(v),
        Data::Verdict(_) => Err(malformed("a verdict where a value belongs")),
    };
    Ok(match name.as_str() {
        "payload" if get(5).is_none() => Expr::Payload {
            dreg: reg(1)?,
            base: PayloadBase::from_number(be32(need(2)?)?),
            offset: be32(need(3)?)?,
            len: be32(need(4)?)?,
        },
        "meta" if get(3).is_none() => Expr::Meta {
            key: MetaKey(be32(need(2)?)?),
            dreg: reg(1)?,
        },
        "ct" if get(4).is_none() => Expr::Ct {
            key: CtKey(be32(need(2)?)?),
            dir: get(3).map(u8_of).transpose()?,
            dreg: reg(1)?,
        },
        "ct" if get(1).is_none() && get(3).is_none() => Expr::CtSet {
            key: CtKey(be32(need(2)?)?),
            sreg: reg(4)?,
        },
        "cmp" => Expr::Cmp {
            sreg: reg(1)?,
            op: CmpOp::from_number(be32(need(2)?)?).ok_or(malformed("an unknown cmp op"))?,
            data: value(3)?,
        },
        // Only the mask-and-xor form (op 0, NFT_BITWISE_BOOL); shifts stay Other.
        "bitwise" if get(6).is_none_or(|v| be32(v) == Ok(0)) => Expr::Bitwise {
            sreg: reg(1)?,
            dreg: reg(2)?,
            mask: value(4)?,
            xor: value(5)?,
        },
        "lookup" => Expr::Lookup {
            set: SetRef::Named(string(need(1)?)?),
            sreg: reg(2)?,
            dreg: get(3).map(be32).transpose()?.map(Reg),
            invert: get(5).map(be32).transpose()?.unwrap_or(0) & 1 != 0,
        },
        "fib" => Expr::Fib {
            dreg: reg(1)?,
            result: be32(need(2)?)?,
            flags: be32(need(3)?)?,
        },
        "masq" => Expr::Masquerade {
            flags: get(1).map(be32).transpose()?.unwrap_or(0),
            proto: match (get(2), get(3)) {
                (Some(min), Some(max)) => Some((Reg(be32(min)?), Reg(be32(max)?))),
                _ => None,
            },
        },
        "immediate" => Expr::Immediate {
            dreg: reg(1)?,
            data: data_of(need(2)?)?,
        },
        "counter" => {
            // The counts are state, not configuration.
            let _ = get(1).map(be64).transpose()?;
            Expr::Counter
        }
        // Packets only, no inversion: anything else stays Other.
        "limit"
            if get(4).is_none_or(|v| be32(v) == Ok(0))
                && get(5).is_none_or(|v| be32(v) == Ok(0)) =>
        {
            Expr::Limit {
                rate: be64(need(1)?)?,
                unit: be64(need(2)?)?,
                burst: get(3).map(be32).transpose()?.unwrap_or(0),
            }
        }
        // To a group, with nothing but a prefix and a snap length.
        "log" if attrs.iter().all(|(t, _)| matches!(t, 1..=3)) => Expr::Log {
            group: match need(1)? {
                [a, b] => u16::from_be_bytes([*a, *b]),
                _ => return Err(malformed("a log group that is not 16 bits")),
            },
            prefix: get(2).map(string).transpose()?.unwrap_or_default(),
            snaplen: get(3).map(be32).transpose()?.unwrap_or(0),
        },
        _ => Expr::Other {
            name,
            data: data.to_vec(),
        },
    })
}
