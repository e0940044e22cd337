//! Expressions as text, in the form `nft --debug=netlink` prints what it sends (libnftnl's):
//! `[ meta load iifname => reg 1 ]`, `[ cmp neq reg 1 0x696c6163 ]`. Unit tests compare a
//! rule with what `nft` compiled the same rule to, without root.

use std::fmt;

use super::data::{Data, Verdict};
use super::expr::{fib, CmpOp, Expr, PayloadBase, SetRef};

/// Bytes as libnftnl prints register data: 32-bit words in host order, `0x%08x` each.
fn words(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        if i > 0 {
            f.write_str(" ")?;
        }
        write!(f, "0x{:08x}", u32::from_ne_bytes(w))?;
    }
    Ok(())
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Accept => f.write_str("accept"),
            Verdict::Drop => f.write_str("drop"),
            Verdict::Continue => f.write_str("continue"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(c) => write!(f, "jump -> {c}"),
            Verdict::Goto(c) => write!(f, "goto -> {c}"),
        }
    }
}

fn meta_key(k: u32) -> Option<&'static str> {
    const NAMES: [&str; 17] = [
        "len",
        "protocol",
        "priority",
        "mark",
        "iif",
        "oif",
        "iifname",
        "oifname",
        "iiftype",
        "oiftype",
        "skuid",
        "skgid",
        "nftrace",
        "rtclassid",
        "secmark",
        "nfproto",
        "l4proto",
    ];
    NAMES.get(k as usize).copied()
}

fn ct_key(k: u32) -> Option<&'static str> {
    const NAMES: [&str; 8] = [
        "state",
        "direction",
        "status",
        "mark",
        "secmark",
        "expiration",
        "helper",
        "l3protocol",
    ];
    NAMES.get(k as usize).copied()
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[ ")?;
        match self {
            Expr::Payload {
                base,
                offset,
                len,
                dreg,
            } => {
                let base = match base {
                    PayloadBase::Link => "link".to_string(),
                    PayloadBase::Network => "network".to_string(),
                    PayloadBase::Transport => "transport".to_string(),
                    PayloadBase::Other(n) => n.to_string(),
                };
                write!(
                    f,
                    "payload load {len}b @ {base} header + {offset} => reg {}",
                    dreg.0
                )?;
            }
            Expr::Meta { key, dreg } => match meta_key(key.0) {
                Some(k) => write!(f, "meta load {k} => reg {}", dreg.0)?,
                None => write!(f, "meta load {} => reg {}", key.0, dreg.0)?,
            },
            Expr::Ct { key, dir, dreg } => {
                match ct_key(key.0) {
                    Some(k) => write!(f, "ct load {k} => reg {}", dreg.0)?,
                    None => write!(f, "ct load {} => reg {}", key.0, dreg.0)?,
                }
                if let Some(d) = dir {
                    write!(f, " , dir {}", if *d == 0 { "original" } else { "reply" })?;
                }
            }
            Expr::CtSet { key, sreg } => match ct_key(key.0) {
                Some(k) => write!(f, "ct set {k} with reg {}", sreg.0)?,
                None => write!(f, "ct set {} with reg {}", key.0, sreg.0)?,
            },
            Expr::Cmp { sreg, op, data } => {
                let op = match op {
                    CmpOp::Eq => "eq",
                    CmpOp::Neq => "neq",
                    CmpOp::Lt => "lt",
                    CmpOp::Lte => "lte",
                    CmpOp::Gt => "gt",
                    CmpOp::Gte => "gte",
                };
                write!(f, "cmp {op} reg {} ", sreg.0)?;
                words(f, data)?;
            }
            Expr::Bitwise {
                sreg,
                dreg,
                mask,
                xor,
            } => {
                write!(f, "bitwise reg {} = ( reg {} & ", dreg.0, sreg.0)?;
                words(f, mask)?;
                f.write_str(" ) ^ ")?;
                words(f, xor)?;
            }
            Expr::Lookup {
                sreg,
                set,
                dreg,
                invert,
            } => {
                let name = match set {
                    SetRef::Named(n) => n.as_str(),
                    SetRef::Anonymous(s) if s.map.is_some() => "__map%d",
                    SetRef::Anonymous(_) => "__set%d",
                };
                write!(f, "lookup reg {} set {name}", sreg.0)?;
                if let Some(d) = dreg {
                    write!(f, " dreg {}", d.0)?;
                }
                if *invert {
                    f.write_str(" 0x1")?;
                }
            }
            Expr::Fib {
                flags,
                result,
                dreg,
            } => {
                let parts: Vec<&str> = [
                    (fib::F_SADDR, "saddr"),
                    (fib::F_DADDR, "daddr"),
                    (fib::F_MARK, "mark"),
                    (fib::F_IIF, "iif"),
                    (fib::F_OIF, "oif"),
                ]
                .iter()
                .filter(|(bit, _)| flags & bit != 0)
                .map(|(_, name)| *name)
                .collect();
                let result = match *result {
                    fib::RESULT_OIF => "oif",
                    fib::RESULT_OIFNAME => "oifname",
                    fib::RESULT_ADDRTYPE => "type",
                    _ => "unknown",
                };
                let present = if flags & fib::F_PRESENT != 0 {
                    " present"
                } else {
                    ""
                };
                write!(
                    f,
                    "fib {} {result}{present} => reg {}",
                    parts.join(" . "),
                    dreg.0
                )?;
            }
            Expr::Masquerade { flags, proto } => {
                f.write_str("masq")?;
                if let Some((min, max)) = proto {
                    write!(f, " proto_min reg {} proto_max reg {}", min.0, max.0)?;
                }
                if *flags != 0 {
                    write!(f, " flags 0x{flags:x}")?;
                }
            }
            Expr::Immediate { dreg, data } => {
                write!(f, "immediate reg {} ", dreg.0)?;
                match data {
                    Data::Value(v) => words(f, v)?,
                    Data::Verdict(v) => write!(f, "{v}")?,
                }
            }
            Expr::Counter => f.write_str("counter pkts 0 bytes 0")?,
            Expr::Limit { rate, unit, burst } => {
                let unit = match unit {
                    1 => "second".to_string(),
                    60 => "minute".to_string(),
                    u => format!("{u} seconds"),
                };
                write!(f, "limit rate {rate}/{unit} burst {burst} packets")?
            }
            Expr::Log {
                group,
                prefix,
                snaplen,
            } => write!(f, "log prefix {prefix:?} group {group} snaplen {snaplen}")?,
            Expr::Other { name, .. } => write!(f, "{name}")?,
        }
        f.write_str(" ]")
    }
}
