//! Rules from the matches calix writes, as the same expressions `nft` compiles its syntax
//! into (so `nft list` prints them back as that syntax): a match adds its protocol's
//! dependency once (`meta nfproto` in an inet table, `meta l4proto` before a port), a single
//! address or port is a compare, several are an anonymous set.

use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::data::{Data, Element, KeyType, Set, Verdict};
use super::expr::{fib, nat, CmpOp, CtKey, Expr, MetaKey, PayloadBase, Reg, SetRef};
use super::model::{Family, Rule};

/// `IFNAMSIZ`: an interface name compared whole is this long, NUL-padded.
const IFNAMSIZ: usize = 16;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMPV6: u8 = 58;
/// TCP header flags (`tcp flags`).
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;

/// ICMPv6 types (`icmpv6 type ...`).
pub mod icmpv6 {
    pub const MLD_LISTENER_QUERY: u8 = 130;
    pub const MLD_LISTENER_REPORT: u8 = 131;
    pub const MLD_LISTENER_DONE: u8 = 132;
    pub const ND_ROUTER_SOLICIT: u8 = 133;
    pub const ND_ROUTER_ADVERT: u8 = 134;
    pub const ND_NEIGHBOR_SOLICIT: u8 = 135;
    pub const ND_NEIGHBOR_ADVERT: u8 = 136;
    pub const MLD2_LISTENER_REPORT: u8 = 143;
}

/// A connection's direction (`ct direction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtDirection {
    Original = 0,
    Reply = 1,
}

/// `ct state` bits.
pub mod ct_state {
    pub const INVALID: u32 = 1;
    pub const ESTABLISHED: u32 = 2;
    pub const RELATED: u32 = 4;
    pub const NEW: u32 = 8;
    pub const UNTRACKED: u32 = 64;
}

/// Which address of the network header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addr {
    Source,
    Destination,
}

/// Builds one rule, match by match, for a table of `family`.
#[derive(Debug, Clone)]
pub struct RuleBuilder {
    family: Family,
    exprs: Vec<Expr>,
    comment: Option<String>,
    /// The network protocol already checked (4 or 6), and the transport protocol.
    l3: Option<u8>,
    l4: Option<u8>,
}

impl Rule {
    /// A rule for a table of `family`, built match by match.
    pub fn builder(family: Family) -> RuleBuilder {
        RuleBuilder {
            family,
            exprs: Vec::new(),
            comment: None,
            l3: None,
            l4: None,
        }
    }
}

impl RuleBuilder {
    /// Any expression, as is.
    pub fn expr(mut self, e: Expr) -> Self {
        self.exprs.push(e);
        self
    }

    pub fn comment(mut self, c: impl Into<String>) -> Self {
        self.comment = Some(c.into());
        self
    }

    fn load_cmp(self, load: Expr, op: CmpOp, data: Vec<u8>) -> Self {
        self.expr(load).expr(Expr::Cmp {
            sreg: Reg::R1,
            op,
            data,
        })
    }

    fn meta(key: MetaKey) -> Expr {
        Expr::Meta { key, dreg: Reg::R1 }
    }

    /// `iifname [!=] "pattern"`: a trailing `*` matches every name that starts with the rest.
    pub fn iifname(self, op: CmpOp, pattern: &str) -> Self {
        self.load_cmp(Self::meta(MetaKey::IIFNAME), op, ifname(pattern))
    }

    /// `oifname [!=] "pattern"`, as [`RuleBuilder::iifname`].
    pub fn oifname(self, op: CmpOp, pattern: &str) -> Self {
        self.load_cmp(Self::meta(MetaKey::OIFNAME), op, ifname(pattern))
    }

    /// `meta mark & mask [!=] value`.
    pub fn mark_masked(self, mask: u32, op: CmpOp, value: u32) -> Self {
        self.masked_cmp(Self::meta(MetaKey::MARK), mask, op, value)
    }

    /// `ct mark & mask [!=] value`.
    pub fn ct_mark_masked(self, mask: u32, op: CmpOp, value: u32) -> Self {
        self.masked_cmp(Self::ct_load(CtKey::MARK), mask, op, value)
    }

    fn ct_load(key: CtKey) -> Expr {
        Expr::Ct {
            key,
            dir: None,
            dreg: Reg::R1,
        }
    }

    /// `<load> & mask <op> value` (4-byte host-order values: marks, ct state bits).
    fn masked_cmp(self, load: Expr, mask: u32, op: CmpOp, value: u32) -> Self {
        self.expr(load)
            .expr(Expr::Bitwise {
                sreg: Reg::R1,
                dreg: Reg::R1,
                mask: mask.to_ne_bytes().to_vec(),
                xor: vec![0; 4],
            })
            .expr(Expr::Cmp {
                sreg: Reg::R1,
                op,
                data: value.to_ne_bytes().to_vec(),
            })
    }

    /// `ct mark set ct mark & !mask | value` (`value` within `mask`): the bits of `mask` set to
    /// `value`, the others kept.
    pub fn ct_mark_set_masked(self, mask: u32, value: u32) -> Self {
        self.expr(Self::ct_load(CtKey::MARK))
            .expr(Expr::Bitwise {
                sreg: Reg::R1,
                dreg: Reg::R1,
                mask: (!mask).to_ne_bytes().to_vec(),
                xor: (value & mask).to_ne_bytes().to_vec(),
            })
            .expr(Expr::CtSet {
                key: CtKey::MARK,
                sreg: Reg::R1,
            })
    }

    /// `meta l4proto [!=] proto`.
    pub fn l4proto(mut self, op: CmpOp, proto: u8) -> Self {
        if op == CmpOp::Eq {
            self.l4 = Some(proto);
        }
        self.load_cmp(Self::meta(MetaKey::L4PROTO), op, vec![proto])
    }

    /// `meta l4proto [!=] { protos }` (one: a compare).
    pub fn l4proto_in(self, protos: &[u8], invert: bool) -> Self {
        let keys = dedup(protos.iter().map(|p| vec![*p]));
        self.key_in(
            Self::meta(MetaKey::L4PROTO),
            KeyType::INET_PROTO,
            keys,
            invert,
        )
    }

    /// The network protocol's dependency, once per rule: `meta nfproto` in an inet table,
    /// the ethertype in bridge and netdev tables, nothing in ip and ip6 ones.
    fn need_l3(mut self, v: u8) -> Self {
        if self.l3 == Some(v) {
            return self;
        }
        self.l3 = Some(v);
        match self.family {
            Family::Ip | Family::Ip6 | Family::Arp => self,
            Family::Inet => {
                let nfproto = if v == 4 { 2 } else { 10 };
                self.load_cmp(Self::meta(MetaKey::NFPROTO), CmpOp::Eq, vec![nfproto])
            }
            Family::Bridge | Family::Netdev => {
                let ethertype: u16 = if v == 4 { 0x0800 } else { 0x86dd };
                let data = ethertype.to_be_bytes().to_vec();
                self.load_cmp(Self::meta(MetaKey::PROTOCOL), CmpOp::Eq, data)
            }
        }
    }

    /// The transport protocol's dependency, once per rule (`meta l4proto proto`).
    fn need_l4(self, proto: u8) -> Self {
        if self.l4 == Some(proto) {
            return self;
        }
        self.l4proto(CmpOp::Eq, proto)
    }

    fn addr_load(v6: bool, which: Addr, len: u32) -> Expr {
        let offset = match (v6, which) {
            (false, Addr::Source) => 12,
            (false, Addr::Destination) => 16,
            (true, Addr::Source) => 8,
            (true, Addr::Destination) => 24,
        };
        Expr::Payload {
            base: PayloadBase::Network,
            offset,
            len,
            dreg: Reg::R1,
        }
    }

    /// `ip saddr|daddr [!=] { nets }`: one net is a prefix compare, several an interval set
    /// (overlapping and adjacent nets merged).
    pub fn ipv4_in(self, which: Addr, nets: &[Ipv4Net], invert: bool) -> Self {
        let nets: Vec<IpNet> = nets.iter().map(|n| IpNet::V4(*n)).collect();
        self.need_l3(4).addr_in(false, which, &nets, invert)
    }

    /// `ip6 saddr|daddr [!=] { nets }`, as [`RuleBuilder::ipv4_in`].
    pub fn ipv6_in(self, which: Addr, nets: &[Ipv6Net], invert: bool) -> Self {
        let nets: Vec<IpNet> = nets.iter().map(|n| IpNet::V6(*n)).collect();
        self.need_l3(6).addr_in(true, which, &nets, invert)
    }

    /// `ip6 saddr|daddr [!=] addr`.
    pub fn ipv6_is(self, which: Addr, addr: Ipv6Addr, invert: bool) -> Self {
        let net = Ipv6Net::new(addr, 128).expect("/128 is a valid prefix");
        self.ipv6_in(which, &[net], invert)
    }

    fn addr_in(self, v6: bool, which: Addr, nets: &[IpNet], invert: bool) -> Self {
        let op = if invert { CmpOp::Neq } else { CmpOp::Eq };
        let full = if v6 { 16 } else { 4 };
        if let [net] = nets {
            let net = net.trunc();
            let bytes = addr_bytes(net.addr());
            let prefix = net.prefix_len() as usize;
            if prefix == full * 8 || (prefix.is_multiple_of(8) && prefix > 0) {
                let n = prefix / 8;
                return self.load_cmp(
                    Self::addr_load(v6, which, n as u32),
                    op,
                    bytes[..n].to_vec(),
                );
            }
            let mask = addr_bytes(net.netmask());
            return self
                .expr(Self::addr_load(v6, which, full as u32))
                .expr(Expr::Bitwise {
                    sreg: Reg::R1,
                    dreg: Reg::R1,
                    mask,
                    xor: vec![0; full],
                })
                .expr(Expr::Cmp {
                    sreg: Reg::R1,
                    op,
                    data: bytes,
                });
        }
        let key = if v6 {
            KeyType::IPV6_ADDR
        } else {
            KeyType::IPV4_ADDR
        };
        let load = Self::addr_load(v6, which, full as u32);
        if nets.iter().all(|n| n.prefix_len() as usize == full * 8) {
            let keys = dedup(nets.iter().map(|n| addr_bytes(n.addr())));
            return self.key_in(load, key, keys, invert);
        }
        let mut set = Set::anonymous(key);
        set.interval = true;
        set.elements = merge(nets.iter().map(|n| {
            let n = n.trunc();
            (addr_bytes(n.network()), addr_bytes(n.broadcast()))
        }))
        .into_iter()
        .map(|(first, last)| Element::range(first, last))
        .collect();
        self.expr(load).lookup(set, invert)
    }

    /// `ip daddr @set` (`ip6` with `v6`): a lookup in a named set of the table.
    pub fn addr_in_set(self, v6: bool, which: Addr, set: &str, invert: bool) -> Self {
        let full = if v6 { 16 } else { 4 };
        self.need_l3(if v6 { 6 } else { 4 })
            .expr(Self::addr_load(v6, which, full))
            .expr(Expr::Lookup {
                sreg: Reg::R1,
                set: SetRef::Named(set.to_string()),
                dreg: None,
                invert,
            })
    }

    /// `<proto> dport [!=] { ports }` (`tcp dport`, `udp dport`).
    pub fn dport_in(self, proto: u8, ports: &[u16], invert: bool) -> Self {
        let keys = dedup(ports.iter().map(|p| p.to_be_bytes().to_vec()));
        let load = Expr::Payload {
            base: PayloadBase::Transport,
            offset: 2,
            len: 2,
            dreg: Reg::R1,
        };
        self.need_l4(proto)
            .key_in(load, KeyType::INET_SERVICE, keys, invert)
    }

    /// `th sport|dport lo-hi` (`source`: the source port; one port: a compare), for a
    /// transport protocol with ports checked before (TCP, UDP, SCTP).
    pub fn th_port_range(self, source: bool, lo: u16, hi: u16) -> Self {
        let load = Expr::Payload {
            base: PayloadBase::Transport,
            offset: if source { 0 } else { 2 },
            len: 2,
            dreg: Reg::R1,
        };
        if lo == hi {
            return self.load_cmp(load, CmpOp::Eq, lo.to_be_bytes().to_vec());
        }
        self.load_cmp(load, CmpOp::Gte, lo.to_be_bytes().to_vec())
            .expr(Expr::Cmp {
                sreg: Reg::R1,
                op: CmpOp::Lte,
                data: hi.to_be_bytes().to_vec(),
            })
    }

    /// `icmpv6 type { types }`.
    pub fn icmpv6_type_in(self, types: &[u8]) -> Self {
        let keys = dedup(types.iter().map(|t| vec![*t]));
        let load = Expr::Payload {
            base: PayloadBase::Transport,
            offset: 0,
            len: 1,
            dreg: Reg::R1,
        };
        self.need_l4(IPPROTO_ICMPV6)
            .key_in(load, KeyType::ICMPV6_TYPE, keys, false)
    }

    /// Loads with `load`, then compares with the one key or looks it up in an anonymous set
    /// of the keys (in the order given: `nft` keeps it).
    fn key_in(self, load: Expr, key: KeyType, keys: Vec<Vec<u8>>, invert: bool) -> Self {
        let op = if invert { CmpOp::Neq } else { CmpOp::Eq };
        if let [one] = keys.as_slice() {
            return self.load_cmp(load, op, one.clone());
        }
        let mut set = Set::anonymous(key);
        set.elements = keys.into_iter().map(Element::key).collect();
        self.expr(load).lookup(set, invert)
    }

    fn lookup(self, set: Set, invert: bool) -> Self {
        self.expr(Expr::Lookup {
            sreg: Reg::R1,
            set: SetRef::Anonymous(Box::new(set)),
            dreg: None,
            invert,
        })
    }

    /// `tcp flags & (syn | ack) [!=] syn`: the segment opens a connection (a SYN without an
    /// ACK). Stateless: unlike a `ct` match it needs no connection tracking in the namespace.
    pub fn tcp_syn(self, op: CmpOp) -> Self {
        self.need_l4(IPPROTO_TCP)
            .expr(Expr::Payload {
                base: PayloadBase::Transport,
                offset: 13,
                len: 1,
                dreg: Reg::R1,
            })
            .expr(Expr::Bitwise {
                sreg: Reg::R1,
                dreg: Reg::R1,
                mask: vec![TCP_SYN | TCP_ACK],
                xor: vec![0],
            })
            .expr(Expr::Cmp {
                sreg: Reg::R1,
                op,
                data: vec![TCP_SYN],
            })
    }

    /// `ct direction [!=] dir`.
    pub fn ct_direction(self, op: CmpOp, dir: CtDirection) -> Self {
        let load = Expr::Ct {
            key: CtKey::DIRECTION,
            dir: None,
            dreg: Reg::R1,
        };
        self.load_cmp(load, op, vec![dir as u8])
    }

    /// `ct state { states }` ([`ct_state`] bits): the state is one of them.
    pub fn ct_state_in(self, states: u32) -> Self {
        self.masked_cmp(Self::ct_load(CtKey::STATE), states, CmpOp::Neq, 0)
    }

    /// `fib saddr . iif oif missing`: the source does not route back out of the interface
    /// the packet came in on (strict reverse-path check).
    pub fn fib_saddr_iif_oif_missing(self) -> Self {
        self.expr(Expr::Fib {
            flags: fib::F_SADDR | fib::F_IIF | fib::F_PRESENT,
            result: fib::RESULT_OIF,
            dreg: Reg::R1,
        })
        .expr(Expr::Cmp {
            sreg: Reg::R1,
            op: CmpOp::Eq,
            data: vec![0; 4],
        })
    }

    pub fn counter(self) -> Self {
        self.expr(Expr::Counter)
    }

    /// `limit rate <per_second>/second burst <burst> packets`: the rest of the rule only
    /// while within the rate.
    pub fn limit(self, per_second: u64, burst: u32) -> Self {
        self.expr(Expr::Limit {
            rate: per_second,
            unit: 1,
            burst,
        })
    }

    /// `log group <group> prefix <prefix> snaplen <snaplen>`: the packet to an
    /// `nfnetlink_log` listener ([`crate::nft::log`]).
    pub fn log_group(self, group: u16, prefix: impl Into<String>, snaplen: u32) -> Self {
        self.expr(Expr::Log {
            group,
            prefix: prefix.into(),
            snaplen,
        })
    }

    /// `masquerade` (with `ports`: `masquerade to :lo-hi`).
    pub fn masquerade(self, ports: Option<(u16, u16)>) -> Rule {
        let Some((lo, hi)) = ports else {
            return self
                .expr(Expr::Masquerade {
                    flags: 0,
                    proto: None,
                })
                .build();
        };
        let imm = |dreg, port: u16| Expr::Immediate {
            dreg,
            data: Data::Value(port.to_be_bytes().to_vec()),
        };
        self.expr(imm(Reg::R1, lo))
            .expr(imm(Reg::R2, hi))
            .expr(Expr::Masquerade {
                flags: nat::PROTO_SPECIFIED,
                proto: Some((Reg::R1, Reg::R2)),
            })
            .build()
    }

    pub fn verdict(self, v: Verdict) -> Rule {
        self.expr(Expr::verdict(v)).build()
    }

    pub fn accept(self) -> Rule {
        self.verdict(Verdict::Accept)
    }

    pub fn drop(self) -> Rule {
        self.verdict(Verdict::Drop)
    }

    /// The rule as built, with no verdict of its own (it falls through).
    pub fn build(self) -> Rule {
        Rule {
            exprs: self.exprs,
            comment: self.comment,
        }
    }
}

/// An interface name as `meta iifname` compares it: up to `*` only, else NUL-padded whole.
fn ifname(pattern: &str) -> Vec<u8> {
    match pattern.strip_suffix('*') {
        Some(prefix) => prefix.as_bytes().to_vec(),
        None => {
            let mut v = pattern.as_bytes().to_vec();
            v.resize(IFNAMSIZ.max(v.len()), 0);
            v
        }
    }
}

fn addr_bytes(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Keys in their first order, each once.
fn dedup(keys: impl Iterator<Item = Vec<u8>>) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for k in keys {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// Inclusive ranges, sorted, with overlapping and adjacent ones merged (as `nft` merges an
/// interval set's elements).
pub(crate) fn merge(ranges: impl Iterator<Item = (Vec<u8>, Vec<u8>)>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut v: Vec<(Vec<u8>, Vec<u8>)> = ranges.collect();
    v.sort();
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    for (first, last) in v {
        if let Some(prev) = out.last_mut() {
            let touches = match successor(&prev.1) {
                Some(next) => first <= next,
                None => true,
            };
            if touches {
                if last > prev.1 {
                    prev.1 = last;
                }
                continue;
            }
        }
        out.push((first, last));
    }
    out
}

/// `key + 1` as a big-endian number; `None` past the largest.
pub(crate) fn successor(key: &[u8]) -> Option<Vec<u8>> {
    let mut v = key.to_vec();
    for b in v.iter_mut().rev() {
        if *b == 0xff {
            *b = 0;
        } else {
            *b += 1;
            return Some(v);
        }
    }
    None
}

/// `key - 1` as a big-endian number; `None` below zero.
pub(crate) fn predecessor(key: &[u8]) -> Option<Vec<u8>> {
    let mut v = key.to_vec();
    for b in v.iter_mut().rev() {
        if *b == 0 {
            *b = 0xff;
        } else {
            *b -= 1;
            return Some(v);
        }
    }
    None
}
