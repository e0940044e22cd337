//! The tables of the tests: each as the `nft` script the agent wrote before it had this
//! module (for the inputs of its unit tests), and as the module's model.

use std::net::Ipv6Addr;

use calix_kernel::nft::expr::{PayloadBase, Reg, SetRef};
use calix_kernel::nft::rule::{ct_state, icmpv6, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};
use calix_kernel::nft::{
    priority, Addr, Chain, ChainType, CmpOp, Data, Element, Expr, Family, Hook, KeyType, MapData,
    Rule, Set, Table, Verdict,
};

pub const ANTISPOOF: &str = include_str!("scripts/antispoof.nft");

pub const MASQUERADE: &str = include_str!("scripts/masquerade.nft");

pub const DOORS: &str = include_str!("scripts/doors.nft");

/// Everything else the module writes: a named interval set, a verdict map, regular chains,
/// jump, goto, return, ct state, an IPv6 interval set, a comment, a prefix that is not
/// byte-aligned, an interface-name prefix, a rate limit and a log to a group.
pub const EVERYTHING: &str = r#"table inet e {
	comment "every feature"
	set nets4 {
		type ipv4_addr
		flags interval
		elements = { 10.0.0.0/8, 192.168.1.0/24 }
	}
	map ports {
		type inet_service : verdict
		elements = { 22 : jump ssh, 80 : accept }
	}
	chain input {
		type filter hook input priority filter; policy drop;
		ct state established,related accept
		iifname "lo" accept
		ip saddr @nets4 tcp dport vmap @ports
		ip6 saddr { fd00::/64, fd01::1 } udp dport 53 accept comment "dns"
		ip saddr 172.16.0.0/12 oifname != "veth*" goto other
		ip daddr { 10.1.0.1, 10.1.0.2 } counter
	}
	chain ssh {
		ip saddr != 10.0.0.1 drop
		return
	}
	chain other {
		limit rate 100/second burst 20 packets log prefix "calix-policy cali1_ing" group 2240 snaplen 128
	}
}
"#;

fn nets<T: std::str::FromStr>(v: &[&str]) -> Vec<T>
where
    T::Err: std::fmt::Debug,
{
    v.iter().map(|s| s.parse().expect("a net")).collect()
}

pub fn antispoof() -> Table {
    let r = || Rule::builder(Family::Inet);
    Table::new(Family::Inet, "calix_antispoof")
        .with_comment("calix: pods send only from their own addresses (kernel dataplane); calix-agent --uninstall removes it")
        .with_chain(
            Chain::base("prerouting", ChainType::Filter, Hook::Prerouting, priority::RAW, Verdict::Accept)
                .with_rule(r().iifname(CmpOp::Neq, "cali*").accept())
                .with_rule(
                    r().ipv6_is(Addr::Source, Ipv6Addr::UNSPECIFIED, false)
                        .icmpv6_type_in(&[
                            icmpv6::ND_ROUTER_SOLICIT,
                            icmpv6::ND_NEIGHBOR_SOLICIT,
                            icmpv6::MLD_LISTENER_REPORT,
                            icmpv6::MLD_LISTENER_DONE,
                            icmpv6::MLD2_LISTENER_REPORT,
                        ])
                        .accept(),
                )
                .with_rule(r().fib_saddr_iif_oif_missing().counter().drop()),
        )
}

pub fn masquerade() -> Table {
    let pools = nets(&["10.244.0.0/16"]);
    let no_snat = nets(&["10.244.0.0/16", "10.245.0.0/16", "172.16.0.0/12"]);
    let matched = || {
        Rule::builder(Family::Ip)
            .ipv4_in(Addr::Source, &pools, false)
            .ipv4_in(Addr::Destination, &no_snat, true)
    };
    Table::new(Family::Ip, "calix").with_chain(
        Chain::base(
            "postrouting",
            ChainType::Nat,
            Hook::Postrouting,
            priority::SRCNAT,
            Verdict::Accept,
        )
        .with_rule(
            matched()
                .l4proto_in(&[IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMP], false)
                .masquerade(Some((32768, 65535))),
        )
        .with_rule(matched().masquerade(None)),
    )
}

pub fn doors() -> Table {
    let r = || Rule::builder(Family::Inet);
    let head = |c: Chain| {
        c.with_rule(r().iifname(CmpOp::Neq, "cali*").accept())
            .with_rule(r().l4proto(CmpOp::Neq, IPPROTO_TCP).accept())
            .with_rule(r().dport_in(IPPROTO_TCP, &[5474, 9091], true).accept())
            .with_rule(r().tcp_syn(CmpOp::Neq).accept())
    };
    let mut v4 = Set::new("peers_v4", KeyType::IPV4_ADDR);
    v4.elements = vec![Element::key([172, 31, 1, 2]), Element::key([172, 31, 2, 3])];
    let mut v6 = Set::new("peers_v6", KeyType::IPV6_ADDR);
    let fd31: Ipv6Addr = "fd31:1::2".parse().expect("v6");
    v6.elements = vec![Element::key(fd31.octets())];
    let base = |name: &str, hook| {
        Chain::base(
            name,
            ChainType::Filter,
            hook,
            priority::FILTER,
            Verdict::Accept,
        )
    };
    Table::new(Family::Inet, "calix_doors")
        .with_comment("calix: pods do not reach the calix agents' ports on the nodes' addresses; calix-agent --uninstall removes it")
        .with_set(v4)
        .with_set(v6)
        .with_chain(head(base("input", Hook::Input)).with_rule(r().counter().drop()))
        .with_chain(
            head(base("forward", Hook::Forward))
                .with_rule(r().addr_in_set(false, Addr::Destination, "peers_v4", false).counter().drop())
                .with_rule(r().addr_in_set(true, Addr::Destination, "peers_v6", false).counter().drop()),
        )
}

pub fn everything() -> Table {
    let r = || Rule::builder(Family::Inet);
    let mut nets4 = Set::new("nets4", KeyType::IPV4_ADDR);
    nets4.interval = true;
    nets4.elements = vec![
        Element::range([10, 0, 0, 0], [10, 255, 255, 255]),
        Element::range([192, 168, 1, 0], [192, 168, 1, 255]),
    ];
    let mut ports = Set::new("ports", KeyType::INET_SERVICE);
    ports.map = Some(MapData::Verdict);
    ports.elements = vec![
        Element::key(22u16.to_be_bytes()).with_data(Data::Verdict(Verdict::Jump("ssh".into()))),
        Element::key(80u16.to_be_bytes()).with_data(Data::Verdict(Verdict::Accept)),
    ];
    let input = Chain::base(
        "input",
        ChainType::Filter,
        Hook::Input,
        priority::FILTER,
        Verdict::Drop,
    )
    .with_rule(
        r().ct_state_in(ct_state::ESTABLISHED | ct_state::RELATED)
            .accept(),
    )
    .with_rule(r().iifname(CmpOp::Eq, "lo").accept())
    .with_rule(
        r().addr_in_set(false, Addr::Source, "nets4", false)
            .l4proto(CmpOp::Eq, IPPROTO_TCP)
            .expr(Expr::Payload {
                base: PayloadBase::Transport,
                offset: 2,
                len: 2,
                dreg: Reg::R1,
            })
            .expr(Expr::Lookup {
                sreg: Reg::R1,
                set: SetRef::Named("ports".into()),
                dreg: Some(Reg::VERDICT),
                invert: false,
            })
            .build(),
    )
    .with_rule(
        r().ipv6_in(Addr::Source, &nets(&["fd00::/64", "fd01::1/128"]), false)
            .dport_in(IPPROTO_UDP, &[53], false)
            .comment("dns")
            .accept(),
    )
    .with_rule(
        r().ipv4_in(Addr::Source, &nets(&["172.16.0.0/12"]), false)
            .oifname(CmpOp::Neq, "veth*")
            .verdict(Verdict::Goto("other".into())),
    )
    .with_rule(
        r().ipv4_in(
            Addr::Destination,
            &nets(&["10.1.0.1/32", "10.1.0.2/32"]),
            false,
        )
        .counter()
        .build(),
    );
    let ssh = Chain::regular("ssh")
        .with_rule(
            r().ipv4_in(Addr::Source, &nets(&["10.0.0.1/32"]), true)
                .drop(),
        )
        .with_rule(r().verdict(Verdict::Return));
    Table::new(Family::Inet, "e")
        .with_comment("every feature")
        .with_set(nets4)
        .with_set(ports)
        .with_chain(input)
        .with_chain(ssh)
        .with_chain(
            Chain::regular("other").with_rule(
                r().limit(100, 20)
                    .log_group(2240, "calix-policy cali1_ing", 128)
                    .build(),
            ),
        )
}
