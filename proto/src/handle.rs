//! The IPAM handle of a CNI attachment, written by the plugin and read by the agent: one
//! contract, here.
//!
//! A handle is `<network>:<containerID>`. CNI allows letters, digits, `_`, `.` and `-` in both
//! network names and container IDs (the plugin refuses anything else), so `:` can end only the
//! network name: the encoding is unambiguous. It is also safe in datastore keys
//! (`ipam/handles/<handle>/<ifname>`: no `/`).
//!
//! Plugins before this one wrote `<network>.<containerID>`, which is ambiguous (network `a` +
//! container `b.c` and network `a.b` + container `c` are both `a.b.c`). Such a [legacy]
//! handle is read with the container ID stored beside it (the allocation's `containerID`
//! attribute, the endpoint record's container ID), which says where the network name ends.

/// Ends the network name in a handle.
pub const SEPARATOR: char = ':';

/// The allocation attribute in which the plugin stores the container ID (every plugin version
/// has): what tells where the network name of a [legacy] handle ends.
pub const CONTAINER_ID_ATTRIBUTE: &str = "containerID";

/// Whether `s` is a valid CNI network name or container ID: a letter or digit, then letters,
/// digits, `_`, `.` and `-` (CNI spec 1.1, "name" and "Container ID").
pub fn is_cni_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// The handle of the attachments of `container_id` in `network`.
pub fn encode(network: &str, container_id: &str) -> String {
    format!("{network}{SEPARATOR}{container_id}")
}

/// The handle the plugin wrote before the encoding was made unambiguous.
pub fn legacy(network: &str, container_id: &str) -> String {
    format!("{network}.{container_id}")
}

/// (network, container ID) of a handle [`encode`] made; `None` for anything else.
pub fn decode(handle: &str) -> Option<(&str, &str)> {
    let (network, container_id) = handle.split_once(SEPARATOR)?;
    (!network.is_empty() && !container_id.is_empty()).then_some((network, container_id))
}

/// (network, container ID) of an attachment's handle: decoded when [`encode`] made it, else
/// read as a [legacy] handle of `legacy_container_id` (the container ID stored with it); `None`
/// when neither fits.
pub fn attachment<'a>(
    handle: &'a str,
    legacy_container_id: Option<&'a str>,
) -> Option<(&'a str, &'a str)> {
    if handle.contains(SEPARATOR) {
        return decode(handle);
    }
    let container_id = legacy_container_id.filter(|c| !c.is_empty())?;
    let network = handle.strip_suffix(container_id)?.strip_suffix('.')?;
    (!network.is_empty()).then_some((network, container_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unambiguous_and_reversible() {
        assert_ne!(encode("a", "b.c"), encode("a.b", "c"));
        assert_eq!(decode(&encode("a", "b.c")), Some(("a", "b.c")));
        assert_eq!(decode(&encode("a.b", "c")), Some(("a.b", "c")));
        assert_eq!(decode("a.b.c"), None);
        assert_eq!(decode(":c"), None);
        assert_eq!(decode("a:"), None);
        assert!(!encode("k8s-pod-network", "0123abc").contains('/'));
    }

    #[test]
    fn legacy_handles_are_read_with_their_container_id() {
        let h = legacy("a", "b.c");
        assert_eq!(attachment(&h, Some("b.c")), Some(("a", "b.c")));
        assert_eq!(attachment(&h, Some("c")), Some(("a.b", "c")));
        assert_eq!(attachment(&h, Some("x")), None);
        assert_eq!(attachment(&h, None), None);
        assert_eq!(attachment("b.c", Some("b.c")), None);
        // A new handle is decoded whatever the hint says.
        assert_eq!(
            attachment(&encode("a", "b.c"), Some("c")),
            Some(("a", "b.c"))
        );
    }

    #[test]
    fn cni_names() {
        for ok in ["k8s-pod-network", "a", "a.b_c-d", "0x"] {
            assert!(is_cni_name(ok), "{ok}");
        }
        for bad in ["", ".a", "-a", "a:b", "a/b", "a b", "ü"] {
            assert!(!is_cni_name(bad), "{bad:?}");
        }
    }
}
