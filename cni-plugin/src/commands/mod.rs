//! The CNI verbs, one file each.
pub mod add;
pub mod check;
pub mod del;
pub mod gc;
pub mod status;

use crate::args::CniEnv;
use crate::config::NetConf;
use crate::error::{code, CniError};

/// One invocation: the environment, the parsed config and the raw stdin (for delegation).
pub struct Invocation<'a> {
    pub env: &'a CniEnv,
    pub conf: &'a NetConf,
    pub raw: &'a [u8],
}

/// A wiring failure with the whole error chain in `details`.
pub(crate) fn wiring(msg: String, e: &dyn std::error::Error) -> CniError {
    let mut details = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        details.push_str(": ");
        details.push_str(&c.to_string());
        cur = c.source();
    }
    CniError::new(code::WIRING_FAILED, msg, details)
}
