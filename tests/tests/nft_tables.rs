//! The agent's three nftables tables, written over netlink (`calix_kernel::nft`), are the
//! tables its `nft -f` scripts made before: for the inputs of the modules' unit tests, each
//! old script goes into one namespace with `nft -f`, the agent's table into another through
//! the module, and `nft` lists both alike (the same rules, sets and elements: the same
//! meaning), and the table reads back as it was written. Run as root.
use std::collections::BTreeSet;
use std::net::IpAddr;

use calix_dataplane::{antispoof, doors, masquerade};
use calix_kernel::nft::{self, Table};
use calix_testbed::Netns;

/// `antispoof::ruleset()` before issue 21.
const ANTISPOOF: &str = include_str!("../../kernel/tests/nft_root/scripts/antispoof.nft");

/// `masquerade::ruleset(10.244.0.0/16 except 10.244.0.0/16, 10.245.0.0/16, 172.16.0.0/12,
/// ports 32768-65535)` before issue 21.
const MASQUERADE: &str = include_str!("../../kernel/tests/nft_root/scripts/masquerade.nft");

/// `doors::ruleset(ports 5474, 9091; peers 172.31.1.2, 172.31.2.3, fd31:1::2)` before issue 21.
const DOORS: &str = include_str!("../../kernel/tests/nft_root/scripts/doors.nft");

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
