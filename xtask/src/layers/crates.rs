//! The crates' layers (issue 21's plan): which workspace crate may depend on which, read from
//! `cargo metadata`; and what calix-core's dependency closure may not hold, read from
//! `cargo tree`.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::util::{self, output};

/// Each workspace crate's layer, lowest first. A crate may depend (normal and build
/// dependencies) only on crates of lower layers; a dev-dependency may also go to the test and
/// build-support crates of layer 4. Crates listed here that do not exist yet are fine: the
/// table is the plan. A workspace crate missing from it fails the check, so that a new crate
/// is placed.
pub const LAYERS: &[(&str, u8)] = &[
    // 0: shared types, messages, logging.
    ("calix-common", 0),
    ("calix-proto", 0),
    ("calix-log", 0),
    // 1: the pure core, the kernel's primitives, the certificates' crypto. calix-ebpf-build
    // (compiles the eBPF programs) is the agent's build-dependency, so it sits below it.
    ("calix-core", 1),
    ("calix-bgp", 1),
    ("calix-kernel", 1),
    ("calix-pki", 1),
    ("calix-ebpf-build", 1),
    // 2: the datastore and the dataplane.
    ("calix-datastore", 2),
    ("calix-dataplane", 2),
    // 3: the programs.
    ("calix-agent", 3),
    ("calix-signer", 3),
    ("calix-cni", 3),
    ("calix-install-cni", 3),
    ("calix-probe", 3),
    // 4: test and build support, which may use anything (and each other).
    ("calix-testbed", 4),
    ("calix-routesim", 4),
    ("calix-tests", 4),
    ("calix-e2e", 4),
    ("xtask", 4),
    ("calix-fuzz", 4),
];

/// The layer whose crates may depend on each other, and on which any crate's dev-dependencies
/// may go: test and build support.
pub const TEST_LAYER: u8 = 4;

/// Dependencies between two crates of one layer that the plan allows ("as today"), with why.
pub const SAME_LAYER_ALLOWED: &[(&str, &str, &str)] = &[
    (
        "calix-install-cni",
        "calix-cni",
        "the installer checks a conflist with the plugin's own parser",
    ),
    (
        "calix-agent",
        "calix-install-cni",
        "the agent's uninstall removes what the installer wrote, with the installer's code",
    ),
];

/// Crates that calix-core's dependency closure (normal, build and dev: it builds and runs its
/// tests without them) may not hold: a name, or a family (the name and `name-*`).
pub const CORE_BANNED: &[&str] = &["tokio", "aya", "kube", "tonic", "netlink", "rtnetlink"];

/// The pure crates, whose closures are checked: the core, and the PKI (pure crypto).
pub const PURE: &[&str] = &["calix-core", "calix-pki"];

pub fn layer_of(name: &str) -> Option<u8> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DepKind {
    Normal,
    Build,
    Dev,
}

impl DepKind {
    fn word(self) -> &'static str {
        match self {
            DepKind::Normal => "depends on",
            DepKind::Build => "has a build-dependency on",
            DepKind::Dev => "has a dev-dependency on",
        }
    }
}

#[derive(Debug)]
pub struct Dep {
    pub name: String,
    pub kind: DepKind,
}

/// A crate root whose modules are checked: a library or a binary.
#[derive(Debug)]
pub struct Target {
    /// `lib` or `bin NAME`.
    pub label: String,
    pub src_path: PathBuf,
}

/// A workspace crate, as `cargo metadata` says.
#[derive(Debug)]
pub struct Package {
    pub name: String,
    pub deps: Vec<Dep>,
    pub targets: Vec<Target>,
}

/// The workspace's crates: `cargo metadata --no-deps` in `root`.
pub fn load(root: &Path) -> Result<Vec<Package>> {
    let json = output(util::cargo().current_dir(root).args([
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
    ]))?;
    parse_metadata(&json)
}

/// The workspace members of a `cargo metadata --format-version 1 --no-deps` output.
pub fn parse_metadata(json: &str) -> Result<Vec<Package>> {
    let v: serde_json::Value = serde_json::from_str(json).context("cargo metadata's output")?;
    let members: BTreeSet<&str> = v["workspace_members"]
        .as_array()
        .context("cargo metadata: no workspace_members")?
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    let mut packages = Vec::new();
    for p in v["packages"].as_array().into_iter().flatten() {
        if !members.contains(p["id"].as_str().unwrap_or_default()) {
            continue;
        }
        let deps = p["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| Dep {
                name: d["name"].as_str().unwrap_or_default().to_string(),
                kind: match d["kind"].as_str() {
                    Some("dev") => DepKind::Dev,
                    Some("build") => DepKind::Build,
                    _ => DepKind::Normal,
                },
            })
            .collect();
        let targets = p["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| {
                let kinds: Vec<&str> = t["kind"]
                    .as_array()?
                    .iter()
                    .filter_map(|k| k.as_str())
                    .collect();
                let label = if kinds
                    .iter()
                    .any(|k| ["lib", "rlib", "proc-macro"].contains(k))
                {
                    "lib".to_string()
                } else if kinds.contains(&"bin") {
                    format!("bin {}", t["name"].as_str()?)
                } else {
                    return None;
                };
                Some(Target {
                    label,
                    src_path: PathBuf::from(t["src_path"].as_str()?),
                })
            })
            .collect();
        packages.push(Package {
            name: p["name"].as_str().unwrap_or_default().to_string(),
            deps,
            targets,
        });
    }
    if packages.is_empty() {
        bail!("cargo metadata: no workspace crate");
    }
    Ok(packages)
}

/// What breaks the layers: a workspace crate with no layer; a dependency on a crate of the
/// same or a higher layer (same: unless allowed); a dev-dependency on one, unless it is test
/// support.
pub fn check_layers(packages: &[Package]) -> Vec<String> {
    let names: BTreeSet<&str> = packages.iter().map(|p| p.name.as_str()).collect();
    let mut problems = Vec::new();
    for p in packages {
        let Some(layer) = layer_of(&p.name) else {
            problems.push(format!(
                "{} is a workspace crate with no layer: place it in LAYERS (xtask/src/layers/crates.rs)",
                p.name
            ));
            continue;
        };
        for d in p.deps.iter().filter(|d| names.contains(d.name.as_str())) {
            let Some(dep_layer) = layer_of(&d.name) else {
                continue; // reported as a crate of its own
            };
            let ok = (d.kind == DepKind::Dev && dep_layer == TEST_LAYER)
                || dep_layer < layer
                || (dep_layer == layer
                    && (layer == TEST_LAYER
                        || SAME_LAYER_ALLOWED
                            .iter()
                            .any(|(from, to, _)| *from == p.name && *to == d.name)));
            if !ok {
                let how = if dep_layer == layer {
                    "the same layer"
                } else {
                    "a higher layer"
                };
                problems.push(format!(
                    "{} (layer {layer}) {} {} (layer {dep_layer}), {how}: a crate may depend only on lower layers",
                    p.name,
                    d.kind.word(),
                    d.name,
                ));
            }
        }
    }
    problems
}

/// A pure crate's closure: `cargo tree` (which resolves features for this one crate, as
/// building it alone does) checked by [`banned_in_tree`].
pub fn check_pure_closure(root: &Path, krate: &str) -> Result<Vec<String>> {
    let tree = output(util::cargo().current_dir(root).args([
        "tree",
        "-p",
        krate,
        "-e",
        "normal,build,dev",
        "--prefix",
        "depth",
        "--format",
        "{p}",
    ]))?;
    Ok(banned_in_tree(&tree, CORE_BANNED))
}

/// In a `cargo tree --prefix depth --format {p}` output, each banned crate with the path that
/// pulls it in, e.g. `calix-core -> calix-proto -> tokio`.
pub fn banned_in_tree(tree: &str, banned: &[&str]) -> Vec<String> {
    let mut stack: Vec<&str> = Vec::new();
    let mut seen = BTreeSet::new();
    let mut problems = Vec::new();
    for line in tree.lines() {
        let digits = line.chars().take_while(char::is_ascii_digit).count();
        let Ok(depth) = line[..digits].parse::<usize>() else {
            continue;
        };
        let Some(name) = line[digits..].split_whitespace().next() else {
            continue;
        };
        stack.truncate(depth);
        stack.push(name);
        let hit = banned
            .iter()
            .any(|b| name == *b || name.starts_with(&format!("{b}-")));
        if hit && depth > 0 && seen.insert(name) {
            problems.push(format!(
                "{} pulls in {name}: {}",
                stack[0],
                stack.join(" -> ")
            ));
        }
    }
    problems
}
