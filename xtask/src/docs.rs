//! `cargo xtask docs`: every relative link in README.md and docs/**/*.md resolves — the file
//! or directory, and the heading its `#anchor` names — and the README fits on a screen
//! ([`README_MAX_LINES`]). The same check is a unit test, so `cargo test --workspace` (and so
//! `cargo xtask test`) fails on a broken link.
//!
//! Anchors are GitHub's: a heading's text lowercased, every character but letters, digits,
//! `-`, `_` and spaces dropped, spaces made `-`, and `-1`, `-2`… after repeats. Links inside
//! code (fenced blocks, inline spans) are text, not links.
use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The README's length limit (issue 21: a README a newcomer reads in two minutes).
pub const README_MAX_LINES: usize = 200;

pub fn run() -> Result<()> {
    let root = crate::util::workspace_root();
    let problems = check(&root)?;
    if !problems.is_empty() {
        bail!(
            "the docs have {} problem(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    println!(
        "README.md and docs/: every relative link resolves; README within {README_MAX_LINES} lines"
    );
    Ok(())
}

/// Every problem of README.md and docs/ under `root`, one line each (empty: none).
pub fn check(root: &Path) -> Result<Vec<String>> {
    let mut pages = vec![root.join("README.md")];
    markdown_files(&root.join("docs"), &mut pages)?;
    let mut problems = Vec::new();
    let mut anchors: HashMap<PathBuf, HashSet<String>> = HashMap::new();
    for page in &pages {
        let text =
            std::fs::read_to_string(page).with_context(|| format!("reading {}", page.display()))?;
        let name = page
            .strip_prefix(root)
            .unwrap_or(page)
            .display()
            .to_string();
        if name == "README.md" && text.lines().count() > README_MAX_LINES {
            problems.push(format!(
                "README.md: {} lines, more than {README_MAX_LINES}",
                text.lines().count()
            ));
        }
        for (line, target) in links(&text) {
            if let Some(why) = broken(page, &target, &mut anchors)? {
                problems.push(format!("{name}:{line}: ({target}) {why}"));
            }
        }
    }
    Ok(problems)
}

/// The .md files under `dir`, recursively, sorted.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            markdown_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    Ok(())
}

/// Why `target`, linked from `page`, does not resolve; `None` when it does or is not relative.
fn broken(
    page: &Path,
    target: &str,
    anchors: &mut HashMap<PathBuf, HashSet<String>>,
) -> Result<Option<String>> {
    if target.contains("://") || target.starts_with("mailto:") || target.starts_with('/') {
        return Ok(None);
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        page.to_path_buf()
    } else {
        normalize(&page.parent().unwrap_or(Path::new(".")).join(path))
    };
    if !file.exists() {
        return Ok(Some(format!("{} does not exist", file.display())));
    }
    let Some(anchor) = anchor else {
        return Ok(None);
    };
    if file.extension().is_none_or(|e| e != "md") {
        return Ok(Some("an anchor into a file that is not markdown".into()));
    }
    if !anchors.contains_key(&file) {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        anchors.insert(file.clone(), headings(&text));
    }
    Ok((!anchors[&file].contains(anchor)).then(|| format!("no heading #{anchor} there")))
}

/// `a/b/../c` as `a/c` (without touching the filesystem).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// `md` with every line of a fenced code block blanked (so line numbers stay).
fn prose(md: &str) -> String {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for line in md.lines() {
        let t = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| t.starts_with(m));
        let keep = match (fence, marker) {
            (None, Some(m)) => {
                fence = Some(m);
                false
            }
            (Some(f), Some(m)) if f == m => {
                fence = None;
                false
            }
            (Some(_), _) => false,
            (None, None) => true,
        };
        out.push(if keep { line } else { "" });
    }
    out.join("\n")
}

/// `text` without its inline code spans (which may run over lines of a paragraph, not past a
/// blank line); the newlines inside them stay, so line numbers do too.
fn without_code(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let run = rest[start..].len() - rest[start..].trim_start_matches('`').len();
        let after = &rest[start + run..];
        // The closing run: the next run of exactly as many backticks, in the same paragraph.
        let mut at = 0;
        let close = loop {
            let Some(i) = after[at..].find('`') else {
                break None;
            };
            let i = at + i;
            let len = after[i..].len() - after[i..].trim_start_matches('`').len();
            if after[..i].contains("\n\n") {
                break None;
            }
            if len == run {
                break Some(i);
            }
            at = i + len;
        };
        match close {
            Some(end) => {
                out.extend(after[..end].chars().filter(|c| *c == '\n'));
                rest = &after[end + run..];
            }
            None => {
                out.push_str(&rest[start..start + run]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Every link target of `md` (inline links, images, reference definitions) with its line.
fn links(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let text = without_code(&prose(md));
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let t = line.trim_start();
        if let Some(def) = t.strip_prefix('[').and_then(|r| r.split_once("]:")) {
            if let Some(target) = def.1.split_whitespace().next() {
                out.push((n, target.trim_matches(['<', '>']).to_string()));
            }
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((n, target.trim_matches(['<', '>']).to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// The anchors of `md`'s headings, as GitHub makes them.
fn headings(md: &str) -> HashSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = HashSet::new();
    for line in prose(md).lines() {
        let hashes = line.len() - line.trim_start_matches('#').len();
        let Some(text) = line[hashes..]
            .strip_prefix(' ')
            .filter(|_| (1..=6).contains(&hashes))
        else {
            continue;
        };
        let base = slug(text.trim().trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_default();
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// GitHub's anchor for a heading's text: link text kept, link targets dropped.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    while let Some(i) = rest.find("](") {
        text.push_str(&rest[..i]);
        rest = rest[i..].find(')').map_or("", |end| &rest[i + end + 1..]);
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_and_docs_links_resolve_and_the_readme_fits() {
        let problems = check(&crate::util::workspace_root()).expect("reading the docs");
        assert!(problems.is_empty(), "\n{}", problems.join("\n"));
    }

    #[test]
    fn slugs_are_githubs() {
        assert_eq!(
            slug("A cluster on one machine: `cargo xtask demo --nodes 3`"),
            "a-cluster-on-one-machine-cargo-xtask-demo---nodes-3"
        );
        assert_eq!(
            slug("The agent's memory: 100 peers in a full mesh (issue 13's ≤ 32 MiB)"),
            "the-agents-memory-100-peers-in-a-full-mesh-issue-13s--32-mib"
        );
        assert_eq!(slug("Pod → outside: SNAT"), "pod--outside-snat");
        assert_eq!(slug("See [the page](x.md#y) now"), "see-the-page-now");
        let h = headings("# A\n## A\n```\n# B\n```\n#NotAHeading\n### C ###\n");
        let want: HashSet<String> = ["a", "a-1", "c"].map(String::from).into();
        assert_eq!(h, want);
    }

    #[test]
    fn links_in_code_are_text() {
        let md = "[a](x.md) `[b](y.md)` ![c](z.svg \"t\")\n```\n[d](w.md)\n```\n[e]: v.md\n\
                  a `span\nover [f](u.md) lines` and ``[g](t.md)`` [h](s.md)\n\
                  an unclosed ` [i](r.md)\n\n[j](q.md) `\n";
        let got: Vec<(usize, String)> = links(md);
        let want = [
            (1, "x.md"),
            (1, "z.svg"),
            (5, "v.md"),
            (7, "s.md"),
            (8, "r.md"),
            (10, "q.md"),
        ];
        assert_eq!(got, want.map(|(n, t)| (n, t.to_string())));
    }

    #[test]
    fn a_broken_link_or_a_long_readme_fails() {
        let dir = std::env::temp_dir().join(format!("xtask-docs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("docs/sub")).expect("temp dir");
        let write = |p: &str, s: &str| std::fs::write(dir.join(p), s).expect("write");
        write(
            "README.md",
            "# Top\n[ok](docs/a.md#part-one) [ok](#top) [web](https://x.y/z#q)\n",
        );
        write(
            "docs/a.md",
            "## Part one\n[ok](../README.md) [ok](sub/) [bad](sub/b.md) [bad](#nope) \
             [bad](../README.md#top-1)\n",
        );
        let problems = check(&dir).expect("check");
        assert_eq!(problems.len(), 3, "{problems:#?}");
        assert!(
            problems[0].starts_with("docs/a.md:2: (sub/b.md)"),
            "{problems:#?}"
        );
        assert!(problems[1].contains("no heading #nope"), "{problems:#?}");
        write("README.md", &"line\n".repeat(README_MAX_LINES + 1));
        let problems = check(&dir).expect("check");
        assert!(
            problems.iter().any(|p| p.contains("more than 200")),
            "{problems:#?}"
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
