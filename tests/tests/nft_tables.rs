//! The agent's three nftables tables, written over netlink (`calix_kernel::nft`), are the
//! tables its `nft -f` scripts made before: for the inputs of the modules' unit tests, each
//! old script goes into one namespace with `nft -f`, the agent's table into another through
//! the module, and `nft` lists both alike (the same rules, sets and elements: the same
//! meaning), and the table reads back as it was written. Run as root.
use std::collections::BTreeSet;
use std::net::IpAddr;

use calix_agent::dataplane::{antispoof, doors, masquerade};
use calix_kernel::nft::{self, Table};
use calix_testbed::Netns;

/// `antispoof::ruleset()` before issue 21.
const ANTISPOOF: &str = r#"add table inet calix_antispoof
delete table inet calix_antispoof
table inet calix_antispoof {
	comment "calix: pods send only from their own addresses (kernel dataplane); calix-agent --uninstall removes it"
	chain prerouting {
		type filter hook prerouting priority raw; policy accept;
		iifname != "cali*" accept
		ip6 saddr :: icmpv6 type { nd-router-solicit, nd-neighbor-solicit, mld-listener-report, mld-listener-done, mld2-listener-report } accept
		fib saddr . iif oif missing counter drop
	}
}
"#;

/// `masquerade::ruleset(10.244.0.0/16 except 10.244.0.0/16, 10.245.0.0/16, 172.16.0.0/12,
/// ports 32768-65535)` before issue 21.
const MASQUERADE: &str = r#"add table ip calix
delete table ip calix
table ip calix {
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr { 10.244.0.0/16 } ip daddr != { 10.244.0.0/16, 10.245.0.0/16, 172.16.0.0/12 } meta l4proto { tcp, udp, icmp } masquerade to :32768-65535
		ip saddr { 10.244.0.0/16 } ip daddr != { 10.244.0.0/16, 10.245.0.0/16, 172.16.0.0/12 } masquerade
	}
}
"#;

/// `doors::ruleset(ports 5474, 9091; peers 172.31.1.2, 172.31.2.3, fd31:1::2)` before issue 21.
const DOORS: &str = r#"add table inet calix_doors
delete table inet calix_doors
table inet calix_doors {
	comment "calix: pods do not reach the calix agents' ports on the nodes' addresses; calix-agent --uninstall removes it"
	set peers_v4 {
		type ipv4_addr
		elements = { 172.31.1.2, 172.31.2.3 }
	}
	set peers_v6 {
		type ipv6_addr
		elements = { fd31:1::2 }
	}
	chain input {
		type filter hook input priority filter; policy accept;
		iifname != "cali*" accept
		meta l4proto != tcp accept
		tcp dport != { 5474, 9091 } accept
		ct direction reply accept
		counter drop
	}
	chain forward {
		type filter hook forward priority filter; policy accept;
		iifname != "cali*" accept
		meta l4proto != tcp accept
		tcp dport != { 5474, 9091 } accept
		ct direction reply accept
		ip daddr @peers_v4 counter drop
		ip6 daddr @peers_v6 counter drop
	}
}
"#;

fn assert_same_as_script(script: &str, table: Table) {
    let by_nft = Netns::new("nftold");
    let path = std::env::temp_dir().join(format!("{}.nft", by_nft.name));
    std::fs::write(&path, script).expect("write the script");
    by_nft.exec_ok(&["nft", "-f", &path.display().to_string()]);
    let _ = std::fs::remove_file(&path);
    let by_agent = Netns::new("nftnew");
    let t = table.clone();
    by_agent
        .run(move || nft::apply(&t))
        .unwrap_or_else(|e| panic!("apply {}: {e}", table.id()));
    let list = |ns: &Netns| {
        let out = ns.exec_ok(&[
            "nft",
            "-s",
            "list",
            "table",
            table.family.as_str(),
            &table.name,
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(list(&by_agent), list(&by_nft), "{}", table.id());
    let (family, name) = (table.family, table.name.clone());
    let back = by_agent
        .run(move || nft::read(family, &name))
        .expect("read back")
        .expect("the table is there");
    assert_eq!(
        back.canonical(),
        table.canonical(),
        "{} read back",
        table.id()
    );
}

#[test]
fn the_agents_tables_are_what_its_nft_scripts_made() {
    assert_same_as_script(ANTISPOOF, antispoof::table());

    let mut nat = calix_agent::config::AgentConfig::default()
        .nat_settings()
        .expect("default [nat]");
    let nets = |v: &[&str]| v.iter().map(|s| s.parse().expect("cidr")).collect();
    nat.nat_pools = nets(&["10.244.0.0/16"]);
    nat.no_snat = nets(&["10.244.0.0/16", "10.245.0.0/16", "172.16.0.0/12"]);
    let ports = Some((32768, 65535));
    assert_same_as_script(MASQUERADE, masquerade::table(&nat, ports).expect("a table"));

    let peers: BTreeSet<IpAddr> = ["172.31.1.2", "172.31.2.3", "fd31:1::2"]
        .iter()
        .map(|a| a.parse().expect("ip"))
        .collect();
    let d = doors::Doors {
        ports: [5474, 9091].into(),
        peers,
    };
    assert_same_as_script(DOORS, doors::table(&d).expect("a table"));
}
