//! A crate's module graph, read from its source with syn, and the cycles between sibling
//! modules at every level of its module tree.
//!
//! A module refers to another through paths: `use crate::a::b`, `super::c::f()`, a type
//! `self::d::T`, a path inside a macro's tokens (`info!("{}", crate::a::x())`), or a name it
//! imported (`use crate::a; a::b::f()`); names are followed through re-exports (`pub use`) and
//! glob imports. A reference from module `x::y::z` to `x::w::v` is an edge `y -> w` among the
//! children of `x` (the level where the two paths part). Test code (`#[cfg(test)]` items,
//! modules named `tests`, files named `tests.rs` or `*_tests.rs`) is left out.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use syn::visit::Visit;

use super::refs::{is_cfg_test, item_attrs, item_name, use_leaves, Binding, Ref, RefVisitor};

/// A module path from the crate root (the root is empty).
pub type ModPath = Vec<String>;

#[derive(Default, Debug)]
struct Module {
    children: BTreeSet<String>,
    /// Names of the items defined here (not modules).
    items: BTreeSet<String>,
    /// Names imported here (`use`), with the path they name, as written.
    uses: BTreeMap<String, Vec<String>>,
    /// Glob imports (`use x::*`), the path as written.
    globs: Vec<Vec<String>>,
    refs: Vec<Ref>,
}

/// A crate's module tree, with what each module refers to.
#[derive(Default, Debug)]
pub struct ModuleTree {
    modules: BTreeMap<ModPath, Module>,
    /// `mod x;` declarations whose file was not found (e.g. generated, or under a cfg).
    pub missing: Vec<String>,
}

/// An edge between two sibling modules, with one place that makes it.
#[derive(Clone, Debug)]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub file: PathBuf,
    pub line: usize,
    pub path: String,
}

/// A cycle among the children of `parent`.
#[derive(Debug)]
pub struct Cycle {
    pub parent: ModPath,
    pub members: Vec<String>,
    pub edges: Vec<Edge>,
}

/// Whether a file holds tests only, by its name (`tests.rs`, `*_tests.rs`).
pub fn is_test_file_name(name: &str) -> bool {
    name == "tests.rs" || name.ends_with("_tests.rs")
}

/// Reads the module tree whose root is `root_file`, reading files with `read` (the file system,
/// or a fixture).
pub fn load(root_file: &Path, read: &dyn Fn(&Path) -> Option<String>) -> Result<ModuleTree> {
    let mut tree = ModuleTree::default();
    tree.modules.insert(Vec::new(), Module::default());
    let dir = root_file.parent().unwrap_or(Path::new("")).to_path_buf();
    load_file(&mut tree, &[], root_file, &dir, read)?;
    Ok(tree)
}

fn load_file(
    tree: &mut ModuleTree,
    module: &[String],
    file: &Path,
    child_dir: &Path,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Result<()> {
    let src = read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let parsed =
        syn::parse_file(&src).with_context(|| format!("cannot parse {}", file.display()))?;
    add_items(tree, module, &parsed.items, file, child_dir, read)
}

fn add_items(
    tree: &mut ModuleTree,
    module: &[String],
    items: &[syn::Item],
    file: &Path,
    child_dir: &Path,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Result<()> {
    for item in items {
        if is_cfg_test(item_attrs(item)) {
            continue;
        }
        let mut refs = Vec::new();
        match item {
            syn::Item::Mod(m) => {
                let name = m.ident.to_string();
                if name == "tests" {
                    continue;
                }
                let (sub_file, sub_dir) = match &m.content {
                    Some(_) => (file.to_path_buf(), child_dir.join(&name)),
                    None => match module_file(m, file, child_dir, read) {
                        Some(found) => found,
                        None => {
                            tree.missing
                                .push(format!("{}: mod {name}: no file", file.display()));
                            continue;
                        }
                    },
                };
                if sub_file != file
                    && sub_file
                        .file_name()
                        .is_some_and(|n| is_test_file_name(&n.to_string_lossy()))
                {
                    continue;
                }
                let mut sub: ModPath = module.to_vec();
                sub.push(name.clone());
                tree.module(module).children.insert(name);
                tree.modules.insert(sub.clone(), Module::default());
                match &m.content {
                    Some((_, inner)) => add_items(tree, &sub, inner, file, &sub_dir, read)?,
                    None => load_file(tree, &sub, &sub_file, &sub_dir, read)?,
                }
                continue;
            }
            syn::Item::Use(u) => {
                if u.leading_colon.is_none() {
                    let mut leaves = Vec::new();
                    use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                    let here = tree.module(module);
                    for leaf in leaves {
                        match leaf.binding {
                            Binding::Name(n) => {
                                here.uses.insert(n, leaf.segs.clone());
                            }
                            Binding::Glob => here.globs.push(leaf.segs.clone()),
                            Binding::None => {}
                        }
                        refs.push(Ref {
                            segs: leaf.segs,
                            file: file.to_path_buf(),
                            line: leaf.line,
                        });
                    }
                }
            }
            other => {
                if let Some(name) = item_name(other) {
                    tree.module(module).items.insert(name);
                }
                let mut v = RefVisitor {
                    file,
                    refs: &mut refs,
                };
                v.visit_item(other);
            }
        }
        tree.module(module).refs.extend(refs);
    }
    Ok(())
}

/// The file of `mod m;` declared in `file` (its children's directory `child_dir`), and the
/// directory of that file's own children.
fn module_file(
    m: &syn::ItemMod,
    file: &Path,
    child_dir: &Path,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<(PathBuf, PathBuf)> {
    let name = m.ident.to_string();
    let explicit = m.attrs.iter().find_map(|a| match &a.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    });
    let candidates = match explicit {
        Some(p) => vec![file.parent().unwrap_or(Path::new("")).join(p)],
        None => vec![
            child_dir.join(format!("{name}.rs")),
            child_dir.join(&name).join("mod.rs"),
        ],
    };
    let found = candidates.into_iter().find(|c| read(c).is_some())?;
    let dir = if found.file_name().is_some_and(|n| n == "mod.rs") {
        found.parent()?.to_path_buf()
    } else {
        found.with_extension("")
    };
    Some((found, dir))
}

impl ModuleTree {
    fn module(&mut self, path: &[String]) -> &mut Module {
        self.modules.entry(path.to_vec()).or_default()
    }

    /// The modules, by path.
    #[cfg(test)]
    pub fn module_paths(&self) -> impl Iterator<Item = &ModPath> {
        self.modules.keys()
    }

    /// The module a path written in module `m` leads to (the deepest module it names: for
    /// `crate::a::b::T`, `a::b`); `None` for a path out of the crate.
    pub fn resolve(&self, m: &[String], segs: &[String]) -> Option<ModPath> {
        self.resolve_at(m, segs, 0)
    }

    fn resolve_at(&self, m: &[String], segs: &[String], depth: usize) -> Option<ModPath> {
        if depth > 8 || segs.is_empty() {
            return None;
        }
        let mut cur: ModPath = m.to_vec();
        let mut i = 0;
        if segs[0] == "crate" {
            cur.clear();
            i = 1;
        } else if segs[0] == "self" || segs[0] == "super" {
            while i < segs.len() && (segs[i] == "self" || segs[i] == "super") {
                if segs[i] == "super" {
                    cur.pop()?;
                }
                i += 1;
            }
        } else {
            match self.name_in(m, &segs[0], depth)? {
                Name::Module(p) => {
                    cur = p;
                    i = 1;
                }
                Name::Item => return Some(cur),
                Name::Alias(decl, target) => {
                    let mut next = target;
                    next.extend_from_slice(&segs[1..]);
                    return self.resolve_at(&decl, &next, depth + 1);
                }
            }
        }
        for k in i..segs.len() {
            match self.name_in(&cur, &segs[k], depth) {
                Some(Name::Module(p)) => cur = p,
                Some(Name::Alias(decl, target)) => {
                    let mut next = target;
                    next.extend_from_slice(&segs[k + 1..]);
                    return self.resolve_at(&decl, &next, depth + 1).or(Some(cur));
                }
                Some(Name::Item) | None => break,
            }
        }
        Some(cur)
    }

    /// What `name` is in module `m`'s namespace.
    fn name_in(&self, m: &[String], name: &str, depth: usize) -> Option<Name> {
        let module = self.modules.get(m)?;
        if module.children.contains(name) {
            let mut p = m.to_vec();
            p.push(name.to_string());
            return Some(Name::Module(p));
        }
        if module.items.contains(name) {
            return Some(Name::Item);
        }
        if let Some(target) = module.uses.get(name) {
            return Some(Name::Alias(m.to_vec(), target.clone()));
        }
        if depth > 8 {
            return None;
        }
        for g in &module.globs {
            match self.resolve_at(m, g, depth + 1) {
                Some(gm) if gm != m => {
                    if let Some(n) = self.name_in(&gm, name, depth + 1) {
                        return Some(n);
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// The edges between sibling modules, by parent (one place for each edge).
    pub fn sibling_edges(&self) -> BTreeMap<ModPath, BTreeMap<(String, String), Edge>> {
        let mut out: BTreeMap<ModPath, BTreeMap<(String, String), Edge>> = BTreeMap::new();
        for (path, module) in &self.modules {
            for r in &module.refs {
                let Some(target) = self.resolve(path, &r.segs) else {
                    continue;
                };
                let k = path.iter().zip(&target).take_while(|(a, b)| a == b).count();
                if k < path.len() && k < target.len() {
                    let key = (path[k].clone(), target[k].clone());
                    out.entry(path[..k].to_vec())
                        .or_default()
                        .entry(key)
                        .or_insert_with(|| Edge {
                            from: path[k].clone(),
                            to: target[k].clone(),
                            file: r.file.clone(),
                            line: r.line,
                            path: r.segs.join("::"),
                        });
                }
            }
        }
        out
    }

    /// The cycles between sibling modules, at every level.
    pub fn cycles(&self) -> Vec<Cycle> {
        let mut cycles = Vec::new();
        for (parent, edges) in self.sibling_edges() {
            let graph: BTreeMap<&str, Vec<&str>> =
                edges.keys().fold(BTreeMap::new(), |mut g, (a, b)| {
                    g.entry(a.as_str()).or_default().push(b.as_str());
                    g.entry(b.as_str()).or_default();
                    g
                });
            for scc in strongly_connected(&graph) {
                if scc.len() < 2 {
                    continue;
                }
                let set: BTreeSet<&str> = scc.iter().copied().collect();
                let inner = edges
                    .values()
                    .filter(|e| set.contains(e.from.as_str()) && set.contains(e.to.as_str()))
                    .cloned()
                    .collect();
                let mut members: Vec<String> = scc.into_iter().map(String::from).collect();
                members.sort();
                cycles.push(Cycle {
                    parent: parent.clone(),
                    members,
                    edges: inner,
                });
            }
        }
        cycles
    }
}

enum Name {
    Module(ModPath),
    Item,
    /// An imported name: the module that imports it, and the path as written there.
    Alias(ModPath, Vec<String>),
}

/// Tarjan's strongly connected components.
pub fn strongly_connected<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>) -> Vec<Vec<&'a str>> {
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(v: &'a str, g: &BTreeMap<&'a str, Vec<&'a str>>, s: &mut State<'a>) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in g.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(w, g, s);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                scc.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(scc);
        }
    }
    let mut s = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(v, graph, &mut s);
        }
    }
    s.out
}

/// A cycle as the report prints it: the crate and target, the modules, and each edge with the
/// place that makes it (file paths relative to `root`).
pub fn describe(krate: &str, cycle: &Cycle, root: &Path) -> String {
    let parent = if cycle.parent.is_empty() {
        "the crate root".to_string()
    } else {
        cycle.parent.join("::")
    };
    let prefix = if cycle.parent.is_empty() {
        String::new()
    } else {
        format!("{}::", cycle.parent.join("::"))
    };
    let mut s = format!(
        "{krate}: a cycle between {prefix}{{{}}} (under {parent})",
        cycle.members.join(", ")
    );
    for e in &cycle.edges {
        let file = e.file.strip_prefix(root).unwrap_or(&e.file);
        s.push_str(&format!(
            "\n      {} -> {}: {}:{} `{}`",
            e.from,
            e.to,
            file.display(),
            e.line,
            e.path
        ));
    }
    s
}
