//! The CNI spec versions calix speaks. A leaf: errors and results both render versions, so
//! this depends on neither.

/// The newest spec version: errors carry it when the config names none.
pub const LATEST: &str = "1.1.0";
/// Every version a config, a prevResult or a result may have.
pub const SUPPORTED: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// Whether a config's `cniVersion` is supported; empty means the oldest supported (as libcni
/// does).
pub fn is_supported(v: &str) -> bool {
    v.is_empty() || SUPPORTED.contains(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_versions() {
        for v in SUPPORTED {
            assert!(is_supported(v), "{v}");
        }
        assert!(is_supported(""), "empty is the default");
        assert!(!is_supported("0.2.0"));
        assert!(!is_supported("2.0.0"));
    }
}
