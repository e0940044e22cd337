//! Root-only: nftables tables written and read over netlink (`calix_kernel::nft`) in
//! throwaway namespaces (`cxt-nft-<pid>-<n>`, deleted on drop, also when a test fails),
//! checked with the `nft` command (tests may run it; calix's binaries do not) and with
//! traffic.

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use calix_kernel::netns::{self, NetNs};
use calix_kernel::nft::{self, Family, Table};

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the nft_root tests need root (network namespaces, nftables): run them as root"
    );
}

/// A throwaway namespace, deleted on drop. Fields drop in order: the fd first.
pub struct TestNs {
    ns: NetNs,
    pub name: String,
}

impl TestNs {
    #[allow(clippy::new_without_default)] // makes a namespace: not a default value
    pub fn new() -> TestNs {
        require_root();
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "cxt-nft-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip netns add");
        assert!(status.success(), "ip netns add {name} failed");
        let ns = NetNs::open(format!("/run/netns/{name}")).expect("open the new netns");
        TestNs { ns, name }
    }

    /// Runs `f` on a thread inside the namespace (the socket is made there).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        netns::run_in(&self.ns, f).expect("run in the test namespace")
    }

    pub fn apply(&self, t: &Table) -> Result<(), nft::NftError> {
        let t = t.clone();
        self.run(move || nft::apply(&t))
    }

    fn read(&self, family: Family, name: &str) -> Option<Table> {
        let name = name.to_string();
        self.run(move || nft::read(family, &name))
            .expect("read the table back")
    }

    fn exec(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .output()
            .expect("run ip netns exec")
    }

    /// Runs a command in the namespace; panics with its stderr when it fails.
    pub fn exec_ok(&self, args: &[&str]) -> String {
        let out = self.exec(args);
        assert!(
            out.status.success(),
            "{args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `nft -f` of a script.
    fn nft_script(&self, script: &str) {
        let path = std::env::temp_dir().join(format!("{}.nft", self.name));
        std::fs::write(&path, script).expect("write the script");
        self.exec_ok(&["nft", "-f", &path.display().to_string()]);
        let _ = std::fs::remove_file(path);
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        match Command::new("ip")
            .args(["netns", "del", &self.name])
            .status()
        {
            Ok(s) if s.success() => {}
            other => eprintln!("cannot delete netns {}: {other:?}", self.name),
        }
    }
}

/// The `nft` listing of a table without counters' counts.
fn listing(ns: &TestNs, family: Family, name: &str) -> String {
    ns.exec_ok(&["nft", "-s", "list", "table", family.as_str(), name])
}

/// `script` (made by `nft -f`) and `table` (written by the module) are the same table: each
/// reads back as `table`, and `nft` lists both alike (the same expressions, sets and
/// elements: the same meaning).
fn assert_same_as_script(script: &str, table: &Table) {
    let by_nft = TestNs::new();
    by_nft.nft_script(script);
    let by_us = TestNs::new();
    by_us.apply(table).expect("apply the table");
    let want = table.canonical();
    let read_nft = by_nft
        .read(table.family, &table.name)
        .expect("nft's table is there");
    assert_eq!(read_nft.canonical(), want, "nft's table read back");
    let read_us = by_us
        .read(table.family, &table.name)
        .expect("our table is there");
    assert_eq!(read_us.canonical(), want, "our table read back");
    assert_eq!(
        listing(&by_us, table.family, &table.name),
        listing(&by_nft, table.family, &table.name),
        "nft lists our table as its own"
    );
}

#[test]
fn the_calix_tables_are_what_their_nft_scripts_made() {
    for (script, table) in [
        (fixtures::ANTISPOOF, fixtures::antispoof()),
        (fixtures::MASQUERADE, fixtures::masquerade()),
        (fixtures::DOORS, fixtures::doors()),
    ] {
        assert_same_as_script(script, &table);
    }
}

#[test]
fn chains_jumps_maps_and_interval_sets_are_what_nft_makes_of_them() {
    assert_same_as_script(fixtures::EVERYTHING, &fixtures::everything());
}

#[test]
fn applying_replaces_the_whole_table_in_one_transaction() {
    let ns = TestNs::new();
    let v1 = fixtures::doors();
    ns.apply(&v1).expect("apply v1");
    // v2: other elements, one chain less; nothing of v1 stays.
    let mut v2 = fixtures::doors();
    v2.sets[0].elements.truncate(1);
    v2.chains.retain(|c| c.name == "input");
    ns.apply(&v2).expect("apply v2");
    let read = ns.read(v2.family, &v2.name).expect("v2 is there");
    assert_eq!(read.canonical(), v2.canonical());
    // A batch the kernel refuses changes nothing: v2 stays whole.
    let mut bad = fixtures::doors();
    bad.chains[0]
        .rules
        .push(nft::Rule::builder(Family::Inet).verdict(nft::Verdict::Jump("nowhere".into())));
    let err = ns.apply(&bad).expect_err("a jump to no chain");
    assert_eq!(err.errno(), Some(nix::errno::Errno::ENOENT), "{err}");
    let read = ns.read(v2.family, &v2.name).expect("v2 is still there");
    assert_eq!(
        read.canonical(),
        v2.canonical(),
        "untouched by the refused batch"
    );
    // Applying again is idempotent.
    ns.apply(&v2).expect("apply v2 again");
    assert_eq!(
        ns.read(v2.family, &v2.name).expect("v2").canonical(),
        v2.canonical()
    );
}

#[test]
fn deleting_removes_the_table_and_is_quiet_when_there_is_none() {
    let ns = TestNs::new();
    ns.run(|| nft::delete(Family::Ip, "calix"))
        .expect("delete nothing");
    ns.apply(&fixtures::masquerade()).expect("apply");
    ns.run(|| nft::delete(Family::Ip, "calix")).expect("delete");
    assert_eq!(ns.read(Family::Ip, "calix"), None);
    // Another family's table of the same name is another table.
    ns.apply(&fixtures::masquerade()).expect("apply");
    ns.run(|| nft::delete(Family::Inet, "calix"))
        .expect("delete inet");
    assert!(ns.read(Family::Ip, "calix").is_some());
}

/// What another tool does to the table is seen in what reads back: deleted, flushed, a rule
/// added, edited or removed, an element added, a policy changed. Counts are not changes.
#[test]
fn drift_by_another_tool_is_seen() {
    let ns = TestNs::new();
    let t = fixtures::doors();
    let id = t.id();
    let fresh = || {
        ns.apply(&t).expect("apply");
        let r = ns.read(t.family, &t.name).expect("there").canonical();
        assert_eq!(r, t.canonical());
        r
    };
    let handle_of_last_rule = |chain: &str| -> String {
        let out = ns.exec_ok(&["nft", "-a", "list", "chain", "inet", &t.name, chain]);
        let line = out
            .lines()
            .rfind(|l| l.contains("# handle"))
            .expect("a rule with a handle");
        line.rsplit(' ').next().expect("handle").to_string()
    };
    type Edit<'a> = (&'a str, Box<dyn Fn() + 'a>);
    let edits: Vec<Edit> = vec![
        (
            "deleted",
            Box::new(|| {
                ns.exec_ok(&["nft", "delete", "table", "inet", &t.name]);
            }),
        ),
        (
            "flushed",
            Box::new(|| {
                ns.exec_ok(&["nft", "flush", "table", "inet", &t.name]);
            }),
        ),
        (
            "ruleset flushed",
            Box::new(|| {
                ns.exec_ok(&["nft", "flush", "ruleset"]);
            }),
        ),
        (
            "rule added",
            Box::new(|| {
                ns.exec_ok(&["nft", "insert", "rule", "inet", &t.name, "input", "accept"]);
            }),
        ),
        (
            "rule with an unknown expression added",
            Box::new(|| {
                ns.exec_ok(&["nft", "add", "rule", "inet", &t.name, "input", "log"]);
            }),
        ),
        (
            "rule deleted",
            Box::new(|| {
                let h = handle_of_last_rule("forward");
                ns.exec_ok(&[
                    "nft", "delete", "rule", "inet", &t.name, "forward", "handle", &h,
                ]);
            }),
        ),
        (
            "rule replaced",
            Box::new(|| {
                let h = handle_of_last_rule("input");
                ns.exec_ok(&[
                    "nft", "replace", "rule", "inet", &t.name, "input", "handle", &h, "counter",
                    "accept",
                ]);
            }),
        ),
        (
            "element added",
            Box::new(|| {
                ns.exec_ok(&[
                    "nft",
                    "add",
                    "element",
                    "inet",
                    &t.name,
                    "peers_v4",
                    "{ 10.9.9.9 }",
                ]);
            }),
        ),
        (
            "policy changed",
            Box::new(|| {
                ns.exec_ok(&[
                    "nft",
                    "add",
                    "chain",
                    "inet",
                    &t.name,
                    "input",
                    "{ policy drop ; }",
                ]);
            }),
        ),
        (
            "chain added",
            Box::new(|| {
                ns.exec_ok(&["nft", "add", "chain", "inet", &t.name, "extra"]);
            }),
        ),
        (
            "table made dormant",
            Box::new(|| {
                ns.exec_ok(&[
                    "nft",
                    "add",
                    "table",
                    "inet",
                    &t.name,
                    "{ flags dormant ; }",
                ]);
            }),
        ),
    ];
    for (what, edit) in edits {
        let before = fresh();
        edit();
        let after = ns.read(t.family, &t.name).map(|t| t.canonical());
        assert_ne!(after.as_ref(), Some(&before), "{id}: {what} is not seen");
    }
    // Traffic through a counter changes its counts, not the table.
    let counted = Table::new(Family::Inet, "counted").with_chain(
        nft::Chain::base(
            "input",
            nft::ChainType::Filter,
            nft::Hook::Input,
            nft::priority::FILTER,
            nft::Verdict::Accept,
        )
        .with_rule(nft::Rule::builder(Family::Inet).counter().build()),
    );
    ns.apply(&counted).expect("apply");
    let before = ns.read(Family::Inet, "counted").expect("there");
    ns.exec_ok(&["ip", "link", "set", "lo", "up"]);
    ns.exec_ok(&["ping", "-c", "2", "-i", "0.2", "127.0.0.1"]);
    let listed = ns.exec_ok(&["nft", "list", "table", "inet", "counted"]);
    assert!(!listed.contains("counter packets 0 "), "{listed}");
    assert_eq!(ns.read(Family::Inet, "counted"), Some(before));
}

#[test]
fn bad_input_is_a_clear_error() {
    let ns = TestNs::new();
    let long = "x".repeat(256);
    let err = ns
        .apply(&Table::new(Family::Inet, long.clone()))
        .expect_err("a name too long");
    assert!(matches!(err, nft::NftError::Invalid { .. }), "{err:?}");
    assert!(err.to_string().contains("longer than"), "{err}");
    // 255 bytes is the longest the kernel takes.
    ns.apply(&Table::new(Family::Inet, "x".repeat(255)))
        .expect("a name of 255 bytes");
    let err = ns
        .run(move || nft::delete(Family::Inet, &long))
        .expect_err("delete: a name too long");
    assert!(err.to_string().contains("longer than"), "{err}");

    let mut t = fixtures::doors();
    t.sets[0].elements.push(nft::Element::key(vec![1, 2, 3]));
    let err = ns.apply(&t).expect_err("a key of the wrong length");
    assert!(err.to_string().contains("set peers_v4"), "{err}");
    assert!(err.to_string().contains("key length"), "{err}");

    // What only the kernel refuses names the message and the errno.
    let mut t = fixtures::doors();
    t.chains[1].rules.push(
        nft::Rule::builder(Family::Inet)
            .addr_in_set(false, nft::Addr::Source, "no_such_set", false)
            .drop(),
    );
    let err = ns.apply(&t).expect_err("a lookup in no set");
    let text = err.to_string();
    assert!(
        text.contains("inet calix_doors") && text.contains("adding rule 7 of chain forward"),
        "{text}"
    );
    assert!(text.contains("ENOENT"), "{text}");
    assert_eq!(
        ns.read(Family::Inet, "calix_doors"),
        None,
        "nothing applied"
    );
}

#[path = "nft_root/fixtures.rs"]
mod fixtures;
#[path = "nft_root/traffic.rs"]
mod traffic;
