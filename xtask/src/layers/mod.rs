//! `cargo xtask layers`: the structure issue 21 asks for, checked.
//! - Each workspace crate has a layer, and depends only on crates of lower layers
//!   ([`crates::LAYERS`]).
//! - the pure crates' (calix-core's, calix-pki's) dependency closures hold no tokio, aya,
//!   kube, tonic or netlink.
//! - No crate's modules form a cycle (between sibling modules, at every level).
//! - No source file outside tests is over [`files::MAX_LINES`] lines.
//!
//! `cargo xtask test` runs it first and fails on any problem; with `--report` it prints what it
//! finds without failing.
mod crates;
mod files;
mod modules;
mod refs;
#[cfg(test)]
mod tests;

use std::path::Path;

use anyhow::{bail, Result};

use crate::util;

/// Runs every check on the workspace; fails on any problem unless `report_only`.
pub fn run(report_only: bool) -> Result<()> {
    let root = util::workspace_root();
    let problems = check(&root)?;
    if problems == 0 {
        println!("layers: ok");
        return Ok(());
    }
    if report_only {
        println!("layers: {problems} problems (report only: not failing)");
        return Ok(());
    }
    bail!("layers: {problems} problems (see above)");
}

/// Runs and prints every check; returns how many problems they found.
fn check(root: &Path) -> Result<usize> {
    let packages = crates::load(root)?;
    let mut total = 0;
    total += section("crate layers", &crates::check_layers(&packages));
    for pure in crates::PURE {
        if packages.iter().any(|p| p.name == *pure) {
            total += section(
                &format!(
                    "{pure}'s dependency closure (none of {})",
                    crates::CORE_BANNED.join(", ")
                ),
                &crates::check_pure_closure(root, pure)?,
            );
        }
    }
    let mut cycles = Vec::new();
    let mut notes = Vec::new();
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    for p in &packages {
        for t in &p.targets {
            let krate = format!("{} ({})", p.name, t.label);
            match modules::load(&t.src_path, &read) {
                Ok(tree) => {
                    notes.extend(tree.missing.iter().map(|m| format!("{krate}: {m}")));
                    cycles.extend(
                        tree.cycles()
                            .iter()
                            .map(|c| modules::describe(&krate, c, root)),
                    );
                }
                Err(e) => cycles.push(format!("{krate}: {e:#}")),
            }
        }
    }
    total += section("module cycles", &cycles);
    for n in notes {
        println!("      note: {n} (not checked)");
    }
    let files = files::rust_files(root)?;
    total += section(
        &format!(
            "source files over {} lines (tests excepted)",
            files::MAX_LINES
        ),
        &files::over_limit(&files),
    );
    Ok(total)
}

/// Prints a check's name and its problems; returns how many.
fn section(what: &str, problems: &[String]) -> usize {
    if problems.is_empty() {
        println!("  {what}: ok");
    } else {
        println!("  {what}: {}", problems.len());
        for p in problems {
            println!("    {p}");
        }
    }
    problems.len()
}
