//! Where the chart's Python tools live (charts/tools: Helm's own library from PyPI
//! `helm-python-sdk` and `kubernetes-validate`): a virtual environment of Debian's python3 named
//! after the hash of charts/tools/requirements.txt, so that two checkouts pinning different
//! versions never share one and a changed pin gets a new one. `cargo xtask setup` creates it
//! (into a temporary directory, renamed into place when complete); the chart test runs it.
use std::path::{Path, PathBuf};

/// The pinned requirements, relative to the workspace root.
pub const REQUIREMENTS: &str = "charts/tools/requirements.txt";
/// The checker the chart test runs, relative to the workspace root.
pub const CHECK_SCRIPT: &str = "charts/tools/check.py";
/// The chart, relative to the workspace root.
pub const CHART: &str = "charts/calix";
/// Every environment goes below this directory (outside the checkout: one per pin set, shared
/// by every checkout on the machine).
pub const VENV_ROOT: &str = "/opt/calix";
/// Written last into a complete environment.
pub const COMPLETE_MARK: &str = ".calix-complete";

/// The workspace root (the parent of testbed/).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// The environment for the requirements in `root`.
pub fn venv_dir(root: &Path) -> std::io::Result<PathBuf> {
    let pins = std::fs::read(root.join(REQUIREMENTS))?;
    Ok(Path::new(VENV_ROOT).join(format!("venv-{:016x}", fnv1a(&pins))))
}

/// Its python.
pub fn python(venv: &Path) -> PathBuf {
    venv.join("bin").join("python")
}

/// Whether `venv` was installed completely.
pub fn is_complete(venv: &Path) -> bool {
    venv.join(COMPLETE_MARK).is_file() && python(venv).exists()
}

/// FNV-1a, 64 bits: a name for a pin set (not a security boundary: pip checks the hashes).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_is_named_after_the_pins() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        let dir = venv_dir(&workspace_root()).expect("requirements readable");
        assert!(dir.starts_with(VENV_ROOT), "{}", dir.display());
    }
}
