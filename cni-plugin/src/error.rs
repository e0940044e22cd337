//! CNI errors: the spec's JSON on stdout with a well-known code, a message saying what is
//! wrong, and details saying what to do.
use serde::Serialize;

/// Error codes from the CNI spec (plus the STATUS codes of 1.1).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN: u32 = 11;
    pub const PLUGIN_NOT_AVAILABLE: u32 = 50;
    pub const PLUGIN_NOT_AVAILABLE_LIMITED: u32 = 51;
    /// Plugin-specific (>= 100): the agent refused the request.
    pub const AGENT_REFUSED: u32 = 100;
    /// Plugin-specific: wiring the pod's interfaces failed.
    pub const WIRING_FAILED: u32 = 101;
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CniError {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub code: u32,
    pub msg: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            cni_version: crate::version::LATEST.to_string(),
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    /// A config whose `cniVersion` calix does not speak (code 1).
    pub fn unsupported_version(v: &str) -> Self {
        Self::new(
            code::INCOMPATIBLE_VERSION,
            format!("CNI version {v:?} is not supported"),
            format!("calix supports {}", crate::version::SUPPORTED.join(", ")),
        )
        .with_version(v)
    }

    pub fn with_version(mut self, v: &str) -> Self {
        if !v.is_empty() {
            self.cni_version = v.to_string();
        }
        self
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| {
            format!(
                "{{\"cniVersion\":\"{}\",\"code\":{},\"msg\":\"internal error\"}}",
                crate::version::LATEST,
                self.code
            )
        })
    }
}

impl std::fmt::Display for CniError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CNI error {}: {}", self.code, self.msg)?;
        if !self.details.is_empty() {
            write!(f, " ({})", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_shape_matches_spec() {
        let e = CniError::new(code::INVALID_CONFIG, "bad mtu", "").with_version("1.0.0");
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).expect("json");
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["code"], 7);
        assert_eq!(v["msg"], "bad mtu");
        assert!(v.get("details").is_none());
    }
}
