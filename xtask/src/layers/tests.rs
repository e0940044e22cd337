//! The checks on small fixtures: in-memory source trees and metadata.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{crates, files, modules};

/// A module tree read from in-memory files (`src/...`).
fn tree(files: &[(&str, &str)]) -> modules::ModuleTree {
    let map: BTreeMap<PathBuf, String> = files
        .iter()
        .map(|(p, s)| (PathBuf::from(p), s.to_string()))
        .collect();
    let read = move |p: &Path| map.get(p).cloned();
    modules::load(Path::new("src/lib.rs"), &read).expect("fixture parses")
}

fn cycle_sets(t: &modules::ModuleTree) -> Vec<String> {
    t.cycles()
        .iter()
        .map(|c| {
            let mut s = c.parent.join("::");
            s.push_str(&format!("{{{}}}", c.members.join(",")));
            s
        })
        .collect()
}

#[test]
fn a_cycle_between_top_level_modules_is_found() {
    let t = tree(&[
        ("src/lib.rs", "mod config;\nmod datastore;\nmod ipam;\n"),
        (
            "src/config.rs",
            "use crate::datastore::Kind;\npub struct Config;\n",
        ),
        ("src/datastore/mod.rs", "mod etcd;\npub enum Kind { A }\n"),
        // The cycle's other half is a child's, and written inside a macro.
        (
            "src/datastore/etcd.rs",
            "fn f() { let _ = format!(\"{:?}\", crate::config::Config); }\n",
        ),
        ("src/ipam.rs", "use crate::config::Config;\n"),
    ]);
    assert_eq!(cycle_sets(&t), vec!["{config,datastore}"]);
    let c = &t.cycles()[0];
    let back = c.edges.iter().find(|e| e.from == "datastore").unwrap();
    assert_eq!(back.file, PathBuf::from("src/datastore/etcd.rs"));
    assert_eq!(back.line, 1);
    assert_eq!(back.path, "crate::config::Config");
    let text = modules::describe("calix-x (lib)", c, Path::new(""));
    assert!(
        text.contains("a cycle between {config, datastore}"),
        "{text}"
    );
    assert!(
        text.contains("datastore -> config: src/datastore/etcd.rs:1"),
        "{text}"
    );
}

#[test]
fn a_cycle_one_level_down_through_super_groups_and_reexports_is_found() {
    let t = tree(&[
        ("src/lib.rs", "pub mod routes;\n"),
        (
            "src/routes/mod.rs",
            "mod conn;\nmod listener;\nmod server;\npub use self::server::Server;\n",
        ),
        ("src/routes/conn.rs", "use super::{listener::{self}};\n"),
        (
            "src/routes/listener.rs",
            "fn f(_: super::Server) {}\n", // through the re-export, to server
        ),
        (
            "src/routes/server.rs",
            "use crate::routes::*;\npub struct Server;\nfn g() { conn::x(); }\n", // through the glob
        ),
    ]);
    assert_eq!(cycle_sets(&t), vec!["routes{conn,listener,server}"]);
}

#[test]
fn tests_and_one_way_references_make_no_cycle() {
    let t = tree(&[
        (
            "src/lib.rs",
            "mod a;\nmod b;\n#[cfg(test)]\nmod fixtures;\npub(crate) use a::A;\n",
        ),
        (
            "src/a.rs",
            "pub(crate) struct A;\nuse crate::b::B;\n#[cfg(test)]\nmod tests { use crate::b; }\n",
        ),
        // b refers back only from tests: its tests.rs file and a #[cfg(test)] function.
        (
            "src/b.rs",
            "pub struct B;\nmod tests;\n#[cfg(test)]\nfn t() { crate::a::A; }\nfn f(_: self::B) {}\n",
        ),
        ("src/b/tests.rs", "use crate::a::A;\n"),
        ("src/fixtures.rs", "use crate::a::A;\nuse crate::b::B;\n"),
    ]);
    assert!(t.cycles().is_empty(), "{:?}", t.cycles());
    // The reference a -> b is there, one way.
    let edges = t.sibling_edges();
    assert!(edges[&Vec::<String>::new()].contains_key(&("a".into(), "b".into())));
    assert!(t.module_paths().all(|p| !p.contains(&"tests".to_string())));
}

#[test]
fn paths_resolve_through_imports_and_stop_outside_the_crate() {
    let t = tree(&[
        ("src/lib.rs", "mod a;\nmod b;\n"),
        ("src/a.rs", "pub mod inner { pub struct X; }\n"),
        (
            "src/b.rs",
            "use crate::a;\nuse std::collections::HashMap;\nfn f() { a::inner::X; }\n",
        ),
    ]);
    let b = vec!["b".to_string()];
    let p = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    assert_eq!(
        t.resolve(&b, &p("a::inner::X")),
        Some(vec!["a".to_string(), "inner".to_string()])
    );
    assert_eq!(t.resolve(&b, &p("HashMap::new")), None);
    assert_eq!(t.resolve(&b, &p("super::super::x")), None);
}

fn package(name: &str, deps: &[(&str, crates::DepKind)]) -> crates::Package {
    crates::Package {
        name: name.into(),
        deps: deps
            .iter()
            .map(|(n, k)| crates::Dep {
                name: n.to_string(),
                kind: *k,
            })
            .collect(),
        targets: Vec::new(),
    }
}

#[test]
fn an_upward_or_sideways_dependency_is_found() {
    use crates::DepKind::*;
    let packages = vec![
        // calix-core (1) on calix-kernel (1): sideways; on calix-agent (3): upward.
        package(
            "calix-core",
            &[("calix-kernel", Normal), ("calix-agent", Build)],
        ),
        package(
            "calix-kernel",
            &[("calix-common", Normal), ("calix-testbed", Dev)],
        ),
        package("calix-common", &[("serde", Normal)]),
        // Dev-dependencies may go to the test crates, not to a program.
        package(
            "calix-agent",
            &[("calix-kernel", Normal), ("calix-install-cni", Normal)],
        ),
        package("calix-install-cni", &[("calix-cni", Normal)]),
        package("calix-cni", &[("calix-agent", Dev)]),
        package("calix-testbed", &[("calix-routesim", Normal)]),
        package("calix-routesim", &[("calix-agent", Normal)]),
        package("calix-newcomer", &[]),
    ];
    let problems = crates::check_layers(&packages);
    assert_eq!(problems.len(), 4, "{problems:#?}");
    assert!(problems[0]
        .starts_with("calix-core (layer 1) depends on calix-kernel (layer 1), the same layer"));
    assert!(problems[1].starts_with(
        "calix-core (layer 1) has a build-dependency on calix-agent (layer 3), a higher layer"
    ));
    assert!(problems[2]
        .starts_with("calix-cni (layer 3) has a dev-dependency on calix-agent (layer 3)"));
    assert!(problems[3].starts_with("calix-newcomer is a workspace crate with no layer"));
}

#[test]
fn a_clean_workspace_passes() {
    use crates::DepKind::*;
    let packages = vec![
        package("calix-core", &[("calix-proto", Normal), ("ipnet", Normal)]),
        package("calix-proto", &[("prost", Normal)]),
        package(
            "calix-agent",
            &[("calix-core", Normal), ("calix-testbed", Dev)],
        ),
        package("xtask", &[("calix-testbed", Normal)]),
        package("calix-testbed", &[]),
    ];
    assert!(crates::check_layers(&packages).is_empty());
    let t = tree(&[
        ("src/lib.rs", "mod a;\nmod b;\n"),
        ("src/a.rs", "use crate::b::B;\n"),
        ("src/b.rs", "pub struct B;\n"),
    ]);
    assert!(t.cycles().is_empty());
    assert!(files::over_limit(&[(PathBuf::from("core/src/lib.rs"), 700)]).is_empty());
    let tree_out = "0calix-core v0.1.0 (/w/core)\n1calix-proto v0.1.0 (/w/proto)\n2prost v0.14.6\n";
    assert!(crates::banned_in_tree(tree_out, crates::CORE_BANNED).is_empty());
}

#[test]
fn metadata_is_read_into_members_deps_and_targets() {
    let json = r#"{
        "workspace_members": ["path+file:///w/core#calix-core@0.1.0"],
        "packages": [{
            "id": "path+file:///w/core#calix-core@0.1.0",
            "name": "calix-core",
            "dependencies": [
                {"name": "calix-proto", "kind": null},
                {"name": "tempfile", "kind": "dev"},
                {"name": "prost-build", "kind": "build"}
            ],
            "targets": [
                {"kind": ["lib"], "name": "calix_core", "src_path": "/w/core/src/lib.rs"},
                {"kind": ["bin"], "name": "tool", "src_path": "/w/core/src/main.rs"},
                {"kind": ["test"], "name": "t", "src_path": "/w/core/tests/t.rs"}
            ]
        }]
    }"#;
    let p = crates::parse_metadata(json).unwrap();
    assert_eq!(p.len(), 1);
    let kinds: Vec<_> = p[0].deps.iter().map(|d| d.kind).collect();
    use crates::DepKind::*;
    assert_eq!(kinds, vec![Normal, Dev, Build]);
    let labels: Vec<_> = p[0].targets.iter().map(|t| t.label.as_str()).collect();
    assert_eq!(labels, vec!["lib", "bin tool"]);
}

#[test]
fn a_banned_crate_in_core_closure_is_found_with_its_path() {
    let tree_out = "\
0calix-core v0.1.0 (/w/core)
1calix-proto v0.1.0 (/w/proto)
2prost v0.14.6
2tonic v0.14.0
3tokio v1.0.0
1netlink-packet-core v0.9.0
1tokio v1.0.0
";
    let problems = crates::banned_in_tree(tree_out, crates::CORE_BANNED);
    assert_eq!(
        problems,
        vec![
            "calix-core pulls in tonic: calix-core -> calix-proto -> tonic",
            "calix-core pulls in tokio: calix-core -> calix-proto -> tonic -> tokio",
            "calix-core pulls in netlink-packet-core: calix-core -> netlink-packet-core",
        ]
    );
}

#[test]
fn a_long_source_file_is_found_and_tests_are_excepted() {
    let f = |p: &str, n| (PathBuf::from(p), n);
    let problems = files::over_limit(&[
        f("agent/src/config.rs", 2000),
        f("core/src/ok.rs", 700),
        f("xtask/src/bench/snat.rs", 1142),
        f("agent/src/node/tests.rs", 1735),
        f("agent/src/routes/engine_tests.rs", 900),
        f("dataplane/tests/programs.rs", 1579),
        f("tests/tests/chart.rs", 1533),
    ]);
    assert_eq!(
        problems,
        vec![
            "agent/src/config.rs: 2000 lines (at most 700)",
            "xtask/src/bench/snat.rs: 1142 lines (at most 700)",
        ]
    );
}

#[test]
fn the_file_walk_counts_lines_and_skips_target() {
    let dir = std::env::temp_dir().join(format!("xtask-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("a/src")).unwrap();
    std::fs::create_dir_all(dir.join("target/debug")).unwrap();
    std::fs::write(dir.join("a/src/long.rs"), "x\n".repeat(701)).unwrap();
    std::fs::write(dir.join("target/debug/gen.rs"), "x\n".repeat(900)).unwrap();
    let found = files::rust_files(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found, vec![(PathBuf::from("a/src/long.rs"), 701)]);
    assert_eq!(files::over_limit(&found).len(), 1);
}

#[test]
fn every_listed_layer_is_in_range_and_names_are_unique() {
    let mut names: Vec<_> = crates::LAYERS.iter().map(|(n, _)| *n).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), crates::LAYERS.len());
    assert!(crates::LAYERS.iter().all(|(_, l)| *l <= crates::TEST_LAYER));
    for (from, to, _) in crates::SAME_LAYER_ALLOWED {
        assert_eq!(crates::layer_of(from), crates::layer_of(to));
    }
}
