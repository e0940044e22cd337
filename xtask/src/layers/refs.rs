//! What a module's code names: the paths of its `use` trees, of its items' code and of its
//! macros' tokens (syn parses the file; the tokens are scanned), with where they are; and what
//! is test code.
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::{self, Visit};

/// One path a module's code names, where it does.
#[derive(Clone, Debug)]
pub struct Ref {
    pub segs: Vec<String>,
    pub file: PathBuf,
    pub line: usize,
}

pub enum Binding {
    Name(String),
    Glob,
    None,
}

pub struct Leaf {
    pub segs: Vec<String>,
    pub binding: Binding,
    pub line: usize,
}

/// The leaves of a use tree: `use crate::{a, b::{c as d, *}}` gives `crate::a` (bound as
/// `a`), `crate::b::c` (bound as `d`) and `crate::b` (a glob).
pub fn use_leaves(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Leaf>) {
    let line_of = |i: &syn::Ident| i.span().start().line;
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let (segs, bound) = leaf(prefix, &n.ident);
            out.push(Leaf {
                segs,
                binding: Binding::Name(bound),
                line: line_of(&n.ident),
            });
        }
        syn::UseTree::Rename(r) => {
            let (segs, _) = leaf(prefix, &r.ident);
            let binding = if r.rename == "_" {
                Binding::None
            } else {
                Binding::Name(r.rename.to_string())
            };
            out.push(Leaf {
                segs,
                binding,
                line: line_of(&r.ident),
            });
        }
        syn::UseTree::Glob(g) => out.push(Leaf {
            segs: prefix.clone(),
            binding: Binding::Glob,
            line: g.star_token.span.start().line,
        }),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_leaves(t, prefix, out);
            }
        }
    }
}

/// `prefix::ident`, and the name it binds (`a::b::{self}` is `a::b`, bound as `b`).
fn leaf(prefix: &[String], ident: &syn::Ident) -> (Vec<String>, String) {
    let mut segs = prefix.to_vec();
    if ident == "self" {
        let bound = segs.last().cloned().unwrap_or_default();
        (segs, bound)
    } else {
        segs.push(ident.to_string());
        (segs, ident.to_string())
    }
}

/// Collects the paths an item's code names (with two segments or more, or from `crate`/`super`).
pub struct RefVisitor<'a> {
    pub file: &'a Path,
    pub refs: &'a mut Vec<Ref>,
}

impl<'ast> Visit<'ast> for RefVisitor<'_> {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.leading_colon.is_none() {
            let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
            if segs.len() >= 2 || segs.first().is_some_and(|s| s == "crate" || s == "super") {
                self.refs.push(Ref {
                    segs,
                    file: self.file.to_path_buf(),
                    line: p.segments[0].ident.span().start().line,
                });
            }
        }
        visit::visit_path(self, p);
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if u.leading_colon.is_some() {
            return;
        }
        let mut leaves = Vec::new();
        use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
        for l in leaves {
            self.refs.push(Ref {
                segs: l.segs,
                file: self.file.to_path_buf(),
                line: l.line,
            });
        }
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        scan_tokens(m.tokens.clone(), self.file, self.refs);
    }

    // A module inside a function: rare, and not part of the tree.
    fn visit_item_mod(&mut self, _: &'ast syn::ItemMod) {}

    // `pub(crate)`, `pub(super)`: not references.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    // `#[cfg(...)]`, `#[derive(...)]`: not references to modules.
    fn visit_attribute(&mut self, _: &'ast syn::Attribute) {}

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_cfg_test(&f.attrs) {
            visit::visit_item_fn(self, f);
        }
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_cfg_test(&f.attrs) {
            visit::visit_impl_item_fn(self, f);
        }
    }
}

/// The `crate::a::b`, `super::x`, `self::y::z` paths in a macro's tokens (not `$crate`).
pub fn scan_tokens(ts: TokenStream, file: &Path, refs: &mut Vec<Ref>) {
    let tokens: Vec<TokenTree> = ts.into_iter().collect();
    let is_colon =
        |t: Option<&TokenTree>| matches!(t, Some(TokenTree::Punct(p)) if p.as_char() == ':');
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            TokenTree::Group(g) => scan_tokens(g.stream(), file, refs),
            TokenTree::Ident(id)
                if (id == "crate" || id == "super" || id == "self")
                    && !matches!(i.checked_sub(1).map(|j| &tokens[j]), Some(TokenTree::Punct(p)) if p.as_char() == '$') =>
            {
                let mut segs = vec![id.to_string()];
                let mut j = i + 1;
                while is_colon(tokens.get(j)) && is_colon(tokens.get(j + 1)) {
                    match tokens.get(j + 2) {
                        Some(TokenTree::Ident(next)) => {
                            segs.push(next.to_string());
                            j += 3;
                        }
                        _ => break,
                    }
                }
                if segs.len() >= 2 {
                    refs.push(Ref {
                        segs,
                        file: file.to_path_buf(),
                        line: id.span().start().line,
                    });
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
}

/// Whether attributes hold `#[cfg(test)]` (or `#[cfg(all(test, ...))]`).
pub fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        let syn::Meta::List(list) = &a.meta else {
            return false;
        };
        if !list.path.is_ident("cfg") {
            return false;
        }
        let text: String = list
            .tokens
            .to_string()
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        text == "test"
            || text
                .strip_prefix("all(")
                .and_then(|t| t.strip_suffix(')'))
                .is_some_and(|inner| inner.split(',').any(|p| p == "test"))
    })
}

pub fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

pub fn item_name(item: &syn::Item) -> Option<String> {
    use syn::Item::*;
    let ident = match item {
        Const(i) => &i.ident,
        Enum(i) => &i.ident,
        ExternCrate(i) => i.rename.as_ref().map(|(_, r)| r).unwrap_or(&i.ident),
        Fn(i) => &i.sig.ident,
        Macro(i) => i.ident.as_ref()?,
        Static(i) => &i.ident,
        Struct(i) => &i.ident,
        Trait(i) => &i.ident,
        TraitAlias(i) => &i.ident,
        Type(i) => &i.ident,
        Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident.to_string())
}
