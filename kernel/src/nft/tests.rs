//! Unit tests (no root): the builder emits what `nft` compiles the same syntax to (the
//! expected lines are `nft --debug=netlink` output, nftables 1.0.6), the batch is framed as
//! the kernel wants it, interval sets go to the kernel's form and back.

use std::net::Ipv6Addr;

use ipnet::Ipv4Net;

use super::batch::{self, msg_type, raw_elements, RawElement};
use super::data::{Element, KeyType, Set, Verdict};
use super::expr::{Expr, SetRef};
use super::model::{Chain, ChainType, Family, Hook, Rule, Table};
use super::rule::{self, ct_state, icmpv6, merge, Addr, CtDirection, IPPROTO_TCP};
use super::wire::{self, Attrs, NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NLM_F_ACK};
use super::{priority, CmpOp};

fn lines(r: &Rule) -> Vec<String> {
    r.exprs.iter().map(ToString::to_string).collect()
}

fn nets(v: &[&str]) -> Vec<Ipv4Net> {
    v.iter().map(|s| s.parse().expect("net")).collect()
}

fn anonymous(r: &Rule) -> Vec<&Set> {
    r.exprs
        .iter()
        .filter_map(|e| match e {
            Expr::Lookup {
                set: SetRef::Anonymous(s),
                ..
            } => Some(s.as_ref()),
            _ => None,
        })
        .collect()
}

#[test]
fn interface_names_and_protocols_compile_as_nft_compiles_them() {
    let r = Rule::builder(Family::Inet)
        .iifname(CmpOp::Neq, "cali*")
        .accept();
    assert_eq!(
        lines(&r),
        [
            "[ meta load iifname => reg 1 ]",
            "[ cmp neq reg 1 0x696c6163 ]",
            "[ immediate reg 0 accept ]"
        ]
    );
    let r = Rule::builder(Family::Ip)
        .iifname(CmpOp::Eq, "eth0")
        .oifname(CmpOp::Neq, "veth*")
        .ct_state_in(ct_state::ESTABLISHED | ct_state::RELATED)
        .accept();
    assert_eq!(
        lines(&r),
        [
            "[ meta load iifname => reg 1 ]",
            "[ cmp eq reg 1 0x30687465 0x00000000 0x00000000 0x00000000 ]",
            "[ meta load oifname => reg 1 ]",
            "[ cmp neq reg 1 0x68746576 ]",
            "[ ct load state => reg 1 ]",
            "[ bitwise reg 1 = ( reg 1 & 0x00000006 ) ^ 0x00000000 ]",
            "[ cmp neq reg 1 0x00000000 ]",
            "[ immediate reg 0 accept ]"
        ]
    );
    let r = Rule::builder(Family::Inet)
        .dport_in(IPPROTO_TCP, &[5474, 9091], true)
        .accept();
    assert_eq!(
        lines(&r),
        [
            "[ meta load l4proto => reg 1 ]",
            "[ cmp eq reg 1 0x00000006 ]",
            "[ payload load 2b @ transport header + 2 => reg 1 ]",
            "[ lookup reg 1 set __set%d 0x1 ]",
            "[ immediate reg 0 accept ]"
        ]
    );
    let ports = anonymous(&r)[0];
    assert_eq!(ports.key, KeyType::INET_SERVICE);
    assert_eq!(
        ports.elements,
        [Element::key([0x15, 0x62]), Element::key([0x23, 0x83])]
    );
    // One port: a compare; the protocol's dependency once.
    let r = Rule::builder(Family::Inet)
        .l4proto(CmpOp::Eq, IPPROTO_TCP)
        .dport_in(IPPROTO_TCP, &[80], true)
        .ct_direction(CmpOp::Eq, CtDirection::Reply)
        .build();
    assert_eq!(
        lines(&r),
        [
            "[ meta load l4proto => reg 1 ]",
            "[ cmp eq reg 1 0x00000006 ]",
            "[ payload load 2b @ transport header + 2 => reg 1 ]",
            "[ cmp neq reg 1 0x00005000 ]",
            "[ ct load direction => reg 1 ]",
            "[ cmp eq reg 1 0x00000001 ]"
        ]
    );
    // `tcp flags & (syn | ack) != syn`, as nft compiles it.
    let r = Rule::builder(Family::Inet)
        .l4proto(CmpOp::Eq, IPPROTO_TCP)
        .tcp_syn(CmpOp::Neq)
        .build();
    assert_eq!(
        lines(&r),
        [
            "[ meta load l4proto => reg 1 ]",
            "[ cmp eq reg 1 0x00000006 ]",
            "[ payload load 1b @ transport header + 13 => reg 1 ]",
            "[ bitwise reg 1 = ( reg 1 & 0x00000012 ) ^ 0x00000000 ]",
            "[ cmp neq reg 1 0x00000002 ]"
        ]
    );
}

#[test]
fn addresses_compile_as_nft_compiles_them() {
    // A /16: two bytes compared; several nets: an interval set, adjacent ones merged.
    let r = Rule::builder(Family::Ip)
        .ipv4_in(Addr::Source, &nets(&["10.244.0.0/16"]), false)
        .ipv4_in(
            Addr::Destination,
            &nets(&["10.244.0.0/16", "10.245.0.0/16", "172.16.0.0/12"]),
            true,
        )
        .masquerade(None);
    assert_eq!(
        lines(&r),
        [
            "[ payload load 2b @ network header + 12 => reg 1 ]",
            "[ cmp eq reg 1 0x0000f40a ]",
            "[ payload load 4b @ network header + 16 => reg 1 ]",
            "[ lookup reg 1 set __set%d 0x1 ]",
            "[ masq ]"
        ]
    );
    let set = anonymous(&r)[0];
    assert!(set.interval && set.constant);
    assert_eq!(
        raw_elements(set),
        [
            ([0, 0, 0, 0], true),
            ([10, 244, 0, 0], false),
            ([10, 246, 0, 0], true),
            ([172, 16, 0, 0], false),
            ([172, 32, 0, 0], true)
        ]
        .map(|(key, end)| RawElement {
            key: key.to_vec(),
            end,
            data: None
        })
    );
    // Not byte-aligned: a mask; /0 too; /32: the whole address.
    let r = Rule::builder(Family::Ip)
        .ipv4_in(Addr::Source, &nets(&["172.16.0.0/12"]), false)
        .ipv4_in(Addr::Destination, &nets(&["0.0.0.0/0"]), false)
        .ipv4_in(Addr::Source, &nets(&["10.1.2.3/32"]), false)
        .build();
    assert_eq!(
        lines(&r),
        [
            "[ payload load 4b @ network header + 12 => reg 1 ]",
            "[ bitwise reg 1 = ( reg 1 & 0x0000f0ff ) ^ 0x00000000 ]",
            "[ cmp eq reg 1 0x000010ac ]",
            "[ payload load 4b @ network header + 16 => reg 1 ]",
            "[ bitwise reg 1 = ( reg 1 & 0x00000000 ) ^ 0x00000000 ]",
            "[ cmp eq reg 1 0x00000000 ]",
            "[ payload load 4b @ network header + 12 => reg 1 ]",
            "[ cmp eq reg 1 0x0302010a ]"
        ]
    );
    // In an inet table, the network protocol first (once); ICMPv6 types in a set.
    let r = Rule::builder(Family::Inet)
        .ipv6_is(Addr::Source, Ipv6Addr::UNSPECIFIED, false)
        .icmpv6_type_in(&[icmpv6::ND_ROUTER_SOLICIT, icmpv6::ND_NEIGHBOR_SOLICIT])
        .addr_in_set(true, Addr::Destination, "peers_v6", false)
        .fib_saddr_iif_oif_missing()
        .counter()
        .drop();
    assert_eq!(
        lines(&r),
        [
            "[ meta load nfproto => reg 1 ]",
            "[ cmp eq reg 1 0x0000000a ]",
            "[ payload load 16b @ network header + 8 => reg 1 ]",
            "[ cmp eq reg 1 0x00000000 0x00000000 0x00000000 0x00000000 ]",
            "[ meta load l4proto => reg 1 ]",
            "[ cmp eq reg 1 0x0000003a ]",
            "[ payload load 1b @ transport header + 0 => reg 1 ]",
            "[ lookup reg 1 set __set%d ]",
            "[ payload load 16b @ network header + 24 => reg 1 ]",
            "[ lookup reg 1 set peers_v6 ]",
            "[ fib saddr . iif oif present => reg 1 ]",
            "[ cmp eq reg 1 0x00000000 ]",
            "[ counter pkts 0 bytes 0 ]",
            "[ immediate reg 0 drop ]"
        ]
    );
    let r = Rule::builder(Family::Ip)
        .l4proto_in(&[6, 17, 1], false)
        .masquerade(Some((32768, 65535)));
    assert_eq!(
        lines(&r),
        [
            "[ meta load l4proto => reg 1 ]",
            "[ lookup reg 1 set __set%d ]",
            "[ immediate reg 1 0x00000080 ]",
            "[ immediate reg 2 0x0000ffff ]",
            "[ masq proto_min reg 1 proto_max reg 2 flags 0x2 ]"
        ]
    );
}

#[test]
fn ranges_merge_and_interval_sets_read_back_as_written() {
    let r = |a: [u8; 1], b: [u8; 1]| (a.to_vec(), b.to_vec());
    assert_eq!(
        merge(
            [
                r([5], [9]),
                r([1], [2]),
                r([3], [4]),
                r([8], [12]),
                r([20], [20])
            ]
            .into_iter()
        ),
        [r([1], [12]), r([20], [20])]
    );
    assert_eq!(rule::successor(&[0, 255]), Some(vec![1, 0]));
    assert_eq!(rule::successor(&[255, 255]), None);
    assert_eq!(rule::predecessor(&[1, 0]), Some(vec![0, 255]));
    // A range from zero has no leading end; one to the largest key no end of its own.
    let mut set = Set::new("s", KeyType::INET_SERVICE);
    set.interval = true;
    set.elements = vec![
        Element::range([0, 0], [0, 21]),
        Element::range([0, 80], [0, 80]),
        Element::range([0x80, 0], [0xff, 0xff]),
    ];
    let raw = raw_elements(&set);
    assert_eq!(
        raw.iter()
            .map(|e| (e.key.clone(), e.end))
            .collect::<Vec<_>>(),
        [
            (vec![0, 0], false),
            (vec![0, 22], true),
            (vec![0, 80], false),
            (vec![0, 81], true),
            (vec![0x80, 0], false)
        ]
    );
    let back = super::read::elements_of(raw.into_iter().rev().collect(), true, 2);
    assert_eq!(back, set.elements);
}

fn doors_like() -> Table {
    let mut peers = Set::new("peers_v4", KeyType::IPV4_ADDR);
    peers.elements = vec![Element::key([10, 0, 0, 1])];
    Table::new(Family::Inet, "t")
        .with_comment("calix")
        .with_set(peers)
        .with_chain(
            Chain::base(
                "input",
                ChainType::Filter,
                Hook::Input,
                priority::FILTER,
                Verdict::Accept,
            )
            .with_rule(
                Rule::builder(Family::Inet)
                    .dport_in(IPPROTO_TCP, &[1, 2], false)
                    .drop(),
            ),
        )
}

#[test]
fn a_table_is_one_batch_that_deletes_and_recreates_it() {
    let b = batch::replace(&doors_like(), 100);
    let msgs = wire::messages(&b.bytes).expect("parse");
    let types: Vec<u16> = msgs.iter().map(|m| m.ty).collect();
    let nft = |m| msg_type(m);
    assert_eq!(
        types,
        [
            NFNL_MSG_BATCH_BEGIN,
            nft(batch::NEWTABLE),
            nft(2), // DELTABLE
            nft(batch::NEWTABLE),
            nft(batch::NEWCHAIN),
            nft(batch::NEWSET),
            nft(batch::NEWSETELEM),
            nft(batch::NEWSET), // the rule's anonymous set, just before it
            nft(batch::NEWSETELEM),
            nft(batch::NEWRULE),
            NFNL_MSG_BATCH_END
        ]
    );
    let seqs: Vec<u32> = msgs.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, (100..111).collect::<Vec<_>>());
    // Every message but the delimiters asks for an ack; each has a description.
    assert_eq!(b.acked, (101..110).collect::<Vec<_>>());
    assert!(msgs[1..10].iter().all(|m| m.flags & NLM_F_ACK != 0));
    assert_eq!(msgs[0].flags & NLM_F_ACK, 0);
    assert_eq!(b.what[9], (109, "adding rule 1 of chain input".to_string()));
    // The delimiters address the nf_tables subsystem.
    assert_eq!(&msgs[0].payload[..4], &[0, 0, 0, 10]);
    // The recreated table carries the comment as nft stores it.
    let (family, attrs) = wire::nf(msgs[3].payload).expect("nfgenmsg");
    assert_eq!(family, Family::Inet.nfproto());
    let attrs = attrs.collect_all().expect("attrs");
    let udata = attrs.iter().find(|(t, _)| *t == 6).expect("user data").1;
    assert_eq!(udata, b"\x00\x06calix\x00");
    // The lookup names the anonymous set by the id it was given in this batch.
    let (_, rule) = wire::nf(msgs[9].payload).expect("rule");
    let exprs = rule.collect_all().expect("attrs");
    let list = exprs.iter().find(|(t, _)| *t == 4).expect("expressions").1;
    let decoded: Vec<Expr> = Attrs::new(list)
        .map(|e| super::expr::decode(e.expect("elem").1).expect("decode"))
        .collect();
    assert!(decoded.iter().any(|e| matches!(
        e,
        Expr::Lookup { set: SetRef::Named(n), .. } if n == "__set%d"
    )));
    // Deleting: add, then delete, in one batch.
    let d = batch::delete(Family::Ip, "calix", 1);
    let types: Vec<u16> = wire::messages(&d.bytes)
        .expect("parse")
        .iter()
        .map(|m| m.ty)
        .collect();
    assert_eq!(
        types,
        [
            NFNL_MSG_BATCH_BEGIN,
            nft(batch::NEWTABLE),
            nft(2),
            NFNL_MSG_BATCH_END
        ]
    );
}

#[test]
fn a_large_set_is_split_over_messages_that_fit_an_attribute() {
    let mut set = Set::new("big", KeyType::IPV6_ADDR);
    set.elements = (0..5000u32)
        .map(|i| {
            let mut a = [0u8; 16];
            a[12..].copy_from_slice(&i.to_be_bytes());
            Element::key(a)
        })
        .collect();
    let b = batch::replace(&Table::new(Family::Ip6, "t").with_set(set), 1);
    let msgs = wire::messages(&b.bytes).expect("parse");
    let elems: Vec<_> = msgs
        .iter()
        .filter(|m| m.ty == msg_type(batch::NEWSETELEM))
        .collect();
    assert!(elems.len() > 1, "{} messages", elems.len());
    assert!(elems.iter().all(|m| m.payload.len() < 65_000));
    let total: usize = elems
        .iter()
        .map(|m| {
            let (_, attrs) = wire::nf(m.payload).expect("nf");
            let attrs = attrs.collect_all().expect("attrs");
            let list = attrs.iter().find(|(t, _)| *t == 3).expect("elements").1;
            Attrs::new(list).count()
        })
        .sum();
    assert_eq!(total, 5000);
}

#[test]
fn what_the_kernel_would_refuse_is_refused_before_sending() {
    let err = |t: &Table| t.validate().expect_err("invalid").to_string();
    let long = "x".repeat(256);
    assert!(err(&Table::new(Family::Inet, long.clone())).contains("longer than"));
    assert!(err(&Table::new(Family::Inet, "")).contains("is empty"));
    let t = doors_like().with_chain(Chain::regular(long));
    assert!(err(&t).contains("chain name"));
    let mut t = doors_like();
    t.sets[0].elements.push(Element::key([1, 2]));
    assert!(
        err(&t).contains("set peers_v4 has an element whose key"),
        "{}",
        err(&t)
    );
    let t = doors_like().with_comment("c".repeat(300));
    assert!(err(&t).contains("comment"));
    doors_like().validate().expect("valid");
}

#[test]
fn canonical_tables_ignore_order_where_it_means_nothing() {
    let a = doors_like().with_chain(Chain::regular("b"));
    let mut b = a.clone();
    b.chains.reverse();
    b.sets[0].elements.insert(0, Element::key([10, 0, 0, 0]));
    let mut a2 = a.clone();
    a2.sets[0].elements.push(Element::key([10, 0, 0, 0]));
    assert_ne!(a2, b);
    assert_eq!(a2.canonical(), b.canonical());
    // Rule order is meaning.
    let mut c = a.clone();
    c.chains[0]
        .rules
        .insert(0, Rule::builder(Family::Inet).accept());
    assert_ne!(c.canonical(), a.canonical());
}
