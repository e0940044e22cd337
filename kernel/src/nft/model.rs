//! What a table is: the typed model the batch writes and the reader gives back. Plain data,
//! compared with `==` after [`Table::canonical`] (the reader's order and the writer's may
//! differ where order means nothing: chains, named sets, set elements).

use std::fmt;

use super::data::{Set, Verdict};
use super::expr::{Expr, SetRef};
use super::wire::{NAME_MAX, USERDATA_MAX};
use super::NftError;

/// An nftables address family (`NFPROTO_*`): which packets a table's base chains see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4 and IPv6.
    Inet,
    Ip,
    Ip6,
    Arp,
    Bridge,
    Netdev,
}

impl Family {
    pub const fn nfproto(self) -> u8 {
        match self {
            Family::Inet => 1,
            Family::Ip => 2,
            Family::Arp => 3,
            Family::Netdev => 5,
            Family::Bridge => 7,
            Family::Ip6 => 10,
        }
    }

    pub const fn from_nfproto(v: u8) -> Option<Family> {
        Some(match v {
            1 => Family::Inet,
            2 => Family::Ip,
            3 => Family::Arp,
            5 => Family::Netdev,
            7 => Family::Bridge,
            10 => Family::Ip6,
            _ => return None,
        })
    }

    /// As `nft` spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Family::Inet => "inet",
            Family::Ip => "ip",
            Family::Ip6 => "ip6",
            Family::Arp => "arp",
            Family::Bridge => "bridge",
            Family::Netdev => "netdev",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A table: its named sets and its chains. Anonymous sets live inside the rules that use
/// them ([`SetRef::Anonymous`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub family: Family,
    pub name: String,
    /// Stored as the table's user data, as `nft` stores `comment "..."` (so `nft list` shows
    /// it): how an operator tells calix's tables from others.
    pub comment: Option<String>,
    /// `NFT_TABLE_F_*` (e.g. 1: dormant, its chains see no packet). calix writes 0; read back,
    /// another value is drift.
    pub flags: u32,
    pub sets: Vec<Set>,
    pub chains: Vec<Chain>,
}

impl Table {
    pub fn new(family: Family, name: impl Into<String>) -> Self {
        Self {
            family,
            name: name.into(),
            comment: None,
            flags: 0,
            sets: Vec::new(),
            chains: Vec::new(),
        }
    }

    /// `family name`, as `nft list table` takes it.
    pub fn id(&self) -> String {
        format!("{} {}", self.family, self.name)
    }

    pub fn with_comment(mut self, comment: impl Into<String>) -> Self {
        self.comment = Some(comment.into());
        self
    }

    pub fn with_set(mut self, set: Set) -> Self {
        self.sets.push(set);
        self
    }

    pub fn with_chain(mut self, chain: Chain) -> Self {
        self.chains.push(chain);
        self
    }

    pub fn chain(&self, name: &str) -> Option<&Chain> {
        self.chains.iter().find(|c| c.name == name)
    }

    pub fn set(&self, name: &str) -> Option<&Set> {
        self.sets.iter().find(|s| s.name == name)
    }

    /// The same table in the one order two equal tables share: chains and named sets by
    /// name, every set's elements sorted, anonymous sets without their (kernel-given) names.
    /// Rules keep their order: it is their meaning.
    pub fn canonical(&self) -> Table {
        let mut t = self.clone();
        t.chains.sort_by(|a, b| a.name.cmp(&b.name));
        t.sets.sort_by(|a, b| a.name.cmp(&b.name));
        for s in &mut t.sets {
            s.elements.sort();
        }
        for c in &mut t.chains {
            for r in &mut c.rules {
                for e in &mut r.exprs {
                    if let Expr::Lookup {
                        set: SetRef::Anonymous(s),
                        ..
                    } = e
                    {
                        s.name.clear();
                        s.elements.sort();
                    }
                }
            }
        }
        t
    }

    /// Checks what the kernel would refuse less clearly: names (empty, too long, with a NUL),
    /// comments too long, elements whose key is not the set's key length.
    pub fn validate(&self) -> Result<(), NftError> {
        let bad = |what: String, why: &'static str| NftError::Invalid {
            table: self.id(),
            what,
            why,
        };
        check_name(&self.name).map_err(|why| bad(format!("table name {:?}", self.name), why))?;
        check_comment(self.comment.as_deref()).map_err(|why| bad("the comment".into(), why))?;
        for s in &self.sets {
            check_name(&s.name).map_err(|why| bad(format!("set name {:?}", s.name), why))?;
            s.validate()
                .map_err(|why| bad(format!("set {}", s.name), why))?;
        }
        for c in &self.chains {
            check_name(&c.name).map_err(|why| bad(format!("chain name {:?}", c.name), why))?;
            for (i, r) in c.rules.iter().enumerate() {
                let what = || format!("rule {} of chain {}", i + 1, c.name);
                check_comment(r.comment.as_deref()).map_err(|why| bad(what(), why))?;
                for e in &r.exprs {
                    if let Expr::Lookup {
                        set: SetRef::Anonymous(s),
                        ..
                    } = e
                    {
                        s.validate().map_err(|why| bad(what(), why))?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        Err("is empty")
    } else if name.len() > NAME_MAX {
        Err("is longer than the kernel's 255 bytes")
    } else if name.contains('\0') {
        Err("holds a NUL byte")
    } else {
        Ok(())
    }
}

fn check_comment(c: Option<&str>) -> Result<(), &'static str> {
    match c {
        // Type, length, the text and its NUL: one TLV of the user data.
        Some(c) if c.len() + 3 > USERDATA_MAX.min(255 + 2) => {
            Err("has a comment longer than the kernel's user data holds")
        }
        Some(c) if c.contains('\0') => Err("has a comment with a NUL byte"),
        _ => Ok(()),
    }
}

/// A chain: a base chain (hooked into the stack) or a regular one (reached by jump/goto).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    pub base: Option<BaseChain>,
    pub rules: Vec<Rule>,
}

impl Chain {
    /// A regular chain.
    pub fn regular(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            base: None,
            rules: Vec::new(),
        }
    }

    /// A base chain: `type <kind> hook <hook> priority <priority>; policy <policy>;`.
    pub fn base(
        name: impl Into<String>,
        kind: ChainType,
        hook: Hook,
        priority: i32,
        policy: Verdict,
    ) -> Self {
        Self {
            name: name.into(),
            base: Some(BaseChain {
                kind,
                hook,
                priority,
                policy,
            }),
            rules: Vec::new(),
        }
    }

    /// A filter base chain at the filter priority that accepts what no rule decides: `type
    /// filter hook <hook> priority filter; policy accept;`.
    pub fn filter(name: impl Into<String>, hook: Hook) -> Self {
        Self::base(
            name,
            ChainType::Filter,
            hook,
            priority::FILTER,
            Verdict::Accept,
        )
    }

    pub fn with_rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseChain {
    pub kind: ChainType,
    pub hook: Hook,
    pub priority: i32,
    /// [`Verdict::Accept`] or [`Verdict::Drop`].
    pub policy: Verdict,
}

/// The standard priorities, as `nft` names them.
pub mod priority {
    pub const RAW: i32 = -300;
    pub const MANGLE: i32 = -150;
    pub const DSTNAT: i32 = -100;
    pub const FILTER: i32 = 0;
    pub const SECURITY: i32 = 50;
    pub const SRCNAT: i32 = 100;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainType {
    Filter,
    Nat,
    Route,
    /// As read back: a type this module does not write.
    Other(String),
}

impl ChainType {
    pub fn as_str(&self) -> &str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
            ChainType::Route => "route",
            ChainType::Other(s) => s,
        }
    }

    pub fn parse(s: &str) -> Self {
        match s {
            "filter" => ChainType::Filter,
            "nat" => ChainType::Nat,
            "route" => ChainType::Route,
            other => ChainType::Other(other.to_string()),
        }
    }
}

/// The netfilter hooks of the ip, ip6 and inet families (`NF_INET_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
    /// As read back: another hook number.
    Other(u32),
}

impl Hook {
    pub const fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Input => 1,
            Hook::Forward => 2,
            Hook::Output => 3,
            Hook::Postrouting => 4,
            Hook::Other(n) => n,
        }
    }

    pub const fn from_number(n: u32) -> Self {
        match n {
            0 => Hook::Prerouting,
            1 => Hook::Input,
            2 => Hook::Forward,
            3 => Hook::Output,
            4 => Hook::Postrouting,
            n => Hook::Other(n),
        }
    }
}

/// A rule: expressions run in order; a comment (user data, as `nft` stores it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rule {
    pub exprs: Vec<Expr>,
    pub comment: Option<String>,
}
