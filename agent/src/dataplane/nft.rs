//! `nft -f -`: how the agent installs its nftables tables (kernel mode's masquerade and
//! anti-spoofing, eBPF mode's stack masquerade). A leaf.
use std::io::Write;
use std::process::{Command, Stdio};

use super::DataplaneError;

/// Runs `nft -f -` on `script`.
pub(super) fn nft(script: &str) -> Result<(), DataplaneError> {
    let fail = |why: String| DataplaneError::Nftables(why);
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run nft (install nftables): {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| fail(format!("writing to nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| fail(format!("waiting for nft: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(fail(format!(
            "nft -f failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}
