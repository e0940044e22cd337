//! No source file outside tests is over [`MAX_LINES`] lines.
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::modules::is_test_file_name;

/// The most lines a source file may have.
pub const MAX_LINES: usize = 700;

/// Whether a file (its path relative to the workspace root) holds tests: under a `tests/`
/// directory, or named `tests.rs` or `*_tests.rs`. Everything else is source, the test bed,
/// xtask and the e2e included.
pub fn is_test_file(rel: &Path) -> bool {
    let under_tests = rel
        .parent()
        .is_some_and(|p| p.components().any(|c| c.as_os_str() == "tests"));
    let name = rel
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    under_tests || is_test_file_name(&name)
}

/// Every `.rs` file under `root` (paths relative to it) with its line count, leaving out
/// `target/` directories and hidden ones (`.git`).
pub fn rust_files(root: &Path) -> Result<Vec<(PathBuf, usize)>> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let rd = std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?;
        for e in rd {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            let ty = e.file_type()?;
            if ty.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    dirs.push(path);
                }
            } else if ty.is_file() && name.ends_with(".rs") {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let rel = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
                out.push((rel, text.lines().count()));
            }
        }
    }
    Ok(out)
}

/// The source files (not tests) over [`MAX_LINES`], longest first, each as `path: N lines`.
pub fn over_limit(files: &[(PathBuf, usize)]) -> Vec<String> {
    let mut long: Vec<&(PathBuf, usize)> = files
        .iter()
        .filter(|(p, n)| *n > MAX_LINES && !is_test_file(p))
        .collect();
    long.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    long.into_iter()
        .map(|(p, n)| format!("{}: {n} lines (at most {MAX_LINES})", p.display()))
        .collect()
}
