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

/// The Kubernetes version check.py validates against (the test cluster runs v1.36.2).
pub const KUBE_VERSION: &str = "1.36.0";

/// The chart rendered with some values, as `helm install` would send it.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// Every object, CRDs first, then the templates' (in template order; hooks included:
    /// see [`hook`]).
    pub objects: Vec<serde_json::Value>,
    /// NOTES.txt.
    pub notes: String,
}

/// The chart at `root` rendered with `values` (JSON, as `--set-json`/`-f` would give), linted
/// (strict), checked against values.schema.json and every object validated against the
/// Kubernetes schemas: any finding is an error.
pub fn render(root: &Path, values: &serde_json::Value) -> crate::Result<Rendered> {
    use crate::Error;
    let venv = venv_dir(root).map_err(Error::io(format!("read {REQUIREMENTS}")))?;
    if !is_complete(&venv) {
        return Err(Error::Missing {
            field: "the chart tools (run `cargo xtask setup`)".into(),
            value: venv.display().to_string(),
        });
    }
    let dir = std::env::temp_dir().join(crate::unique("chart"));
    std::fs::create_dir_all(&dir).map_err(Error::io(format!("create {}", dir.display())))?;
    let cases = dir.join("cases.json");
    let written = std::fs::write(
        &cases,
        serde_json::json!([{"name": "render", "values": values}]).to_string(),
    );
    let out = written
        .map_err(Error::io("write the values"))
        .and_then(|()| {
            crate::process::checked(
                std::process::Command::new(python(&venv))
                    .arg(root.join(CHECK_SCRIPT))
                    .arg(root.join(CHART))
                    .arg(&cases)
                    .arg(KUBE_VERSION),
            )
        });
    let _ = std::fs::remove_dir_all(&dir);
    let out = out?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|_| Error::NotJson {
        what: CHECK_SCRIPT.into(),
        text: String::from_utf8_lossy(&out.stdout).into_owned(),
    })?;
    let r = &v["results"][0];
    let mut findings: Vec<String> = Vec::new();
    for m in r["lint"].as_array().into_iter().flatten() {
        if m["severity"] == "error" || m["severity"] == "warning" {
            findings.push(format!("lint: {} {}", m["path"], m["error"]));
        }
    }
    for k in ["schema_error", "render_error"] {
        if let Some(e) = r[k].as_str() {
            findings.push(format!("{k}: {e}"));
        }
    }
    for k in ["problems", "unchecked"] {
        for p in r[k].as_array().into_iter().flatten() {
            findings.push(format!("{k}: {p}"));
        }
    }
    if !findings.is_empty() {
        return Err(Error::Unexpected {
            what: "the chart rendered with the e2e values".into(),
            found: findings.join("\n"),
            expected: "no lint, schema or validation finding".into(),
        });
    }
    let mut rendered = Rendered {
        objects: Vec::new(),
        notes: String::new(),
    };
    for o in r["objects"].as_array().into_iter().flatten() {
        match o["object"]["notes"].as_str() {
            Some(notes) => rendered.notes = notes.to_string(),
            None => rendered.objects.push(o["object"].clone()),
        }
    }
    Ok(rendered)
}

/// The Helm hook an object is (`helm.sh/hook`: `test`, `pre-delete`...), if any.
pub fn hook(object: &serde_json::Value) -> Option<&str> {
    object["metadata"]["annotations"]["helm.sh/hook"].as_str()
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
