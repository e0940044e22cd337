//! The environment of the nested cargo: the caller's, minus everything that describes the
//! caller's own build.
//!
//! Inside a build script cargo sets `RUSTC`, `CARGO_ENCODED_RUSTFLAGS`, `TARGET`, `CARGO_CFG_*`,
//! `CARGO_FEATURE_*`, `CARGO_PKG_*`, a jobserver in `CARGO_MAKEFLAGS`…, and rustup sets
//! `RUSTUP_TOOLCHAIN=stable`. Any of these leaking into the nightly BPF build picks the wrong
//! compiler, flags or target, so the nested command starts from an empty environment and gets
//! back only what passes [`inherit`].

use std::process::Command;

/// `CARGO_*` variables that are the user's configuration of cargo itself, not of one build.
const CARGO_KEEP_PREFIXES: &[&str] = &[
    "CARGO_HOME",
    "CARGO_NET_",
    "CARGO_HTTP_",
    "CARGO_REGISTRIES_",
    "CARGO_REGISTRY_",
    "CARGO_TERM_",
];

/// Exact names cargo or rustup set for a build script (or that steer a compile) that do not
/// start with `CARGO_`/`RUSTC_`.
const DROP_EXACT: &[&str] = &[
    "CARGO",
    "RUSTC",
    "RUSTDOC",
    "RUSTFLAGS",
    "RUSTDOCFLAGS",
    "RUSTUP_TOOLCHAIN",
    "RUSTUP_TOOLCHAIN_SOURCE",
    "OUT_DIR",
    "TARGET",
    "HOST",
    "NUM_JOBS",
    "OPT_LEVEL",
    "DEBUG",
    "PROFILE",
    "MAKEFLAGS",
    "MFLAGS",
];

/// Whether the nested cargo gets the caller's variable `name`.
pub(crate) fn inherit(name: &str) -> bool {
    if DROP_EXACT.contains(&name) {
        return false;
    }
    if name.starts_with("CARGO_") {
        return CARGO_KEEP_PREFIXES.iter().any(|p| name.starts_with(p));
    }
    // RUSTC_WRAPPER, RUSTC_WORKSPACE_WRAPPER, RUSTC_LINKER, RUSTC_BOOTSTRAP…; `links`
    // metadata (DEP_*); cargo-internal __CARGO_*.
    !["RUSTC_", "RUSTDOC_", "DEP_", "__CARGO"]
        .iter()
        .any(|p| name.starts_with(p))
}

/// Clears `cmd`'s environment and passes on only the caller's variables that [`inherit`] keeps.
pub(crate) fn clean(cmd: &mut Command) {
    cmd.env_clear();
    for (name, value) in std::env::vars_os() {
        // A name that is not UTF-8 is none of the variables above: keep it.
        if name.to_str().is_none_or(inherit) {
            cmd.env(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::inherit;

    #[test]
    fn drops_what_describes_the_outer_build() {
        for name in [
            "RUSTC",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
            "RUSTC_LINKER",
            "RUSTUP_TOOLCHAIN",
            "CARGO",
            "CARGO_ENCODED_RUSTFLAGS",
            "RUSTFLAGS",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_TARGET",
            "CARGO_BUILD_RUSTFLAGS",
            "CARGO_PROFILE_RELEASE_DEBUG",
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER",
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_NAME",
            "CARGO_CFG_TARGET_ARCH",
            "CARGO_FEATURE_USER",
            "CARGO_MAKEFLAGS",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_INCREMENTAL",
            "OUT_DIR",
            "TARGET",
            "HOST",
            "NUM_JOBS",
            "OPT_LEVEL",
            "DEBUG",
            "PROFILE",
            "DEP_Z_INCLUDE",
            "__CARGO_FIX_PLZ",
        ] {
            assert!(!inherit(name), "{name} must not reach the nested cargo");
        }
    }

    #[test]
    fn keeps_the_users_setup() {
        for name in [
            "PATH",
            "HOME",
            "RUSTUP_HOME",
            "CARGO_HOME",
            "CARGO_NET_OFFLINE",
            "CARGO_HTTP_CAINFO",
            "CARGO_REGISTRIES_CRATES_IO_PROTOCOL",
            "CARGO_TERM_COLOR",
            "RUST_BACKTRACE",
            "http_proxy",
            "LANG",
        ] {
            assert!(inherit(name), "{name} must reach the nested cargo");
        }
    }
}
