//! The XDP prefilter on the node's uplinks (`xdp_host_dev`): a deny list of source CIDRs,
//! malformed IP headers dropped, failsafe ports that always pass.
//!
//! Attachment: an XDP bpf_link per uplink, pinned at `<node pin dir>/xdp/<ifname>@<mode>`.
//! The pin keeps the program attached when the agent exits (SIGTERM, `kill -9`, an upgrade);
//! a new agent opens the pinned link and swaps its program in with `BPF_LINK_UPDATE`, so the
//! uplink is never without a filter. The pins live outside the map-layout directory: a build
//! with another map layout updates the same links. Removing a link (XDP turned off, an uplink
//! dropped from the config, `--uninstall`) detaches it explicitly (`BPF_LINK_DETACH`) before
//! unpinning, so it is gone when the call returns.
//!
//! The deny list and failsafe ports live in pinned maps; [`XdpFilter::set_policy`] brings them
//! to a new policy entry by entry (additions first), which is how SIGHUP reloads them without
//! touching the attachment. A restarted agent diffs against what the maps hold, so a deny entry
//! never disappears while it is still configured.
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, MapData};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::xdp::XdpLink;
use aya::programs::{Xdp, XdpFlags};
use aya::Ebpf;
use calix_common::{
    FailsafePort, DENY_V4_MAP, DENY_V6_MAP, FAILSAFE_MAP, IPPROTO_TCP, IPPROTO_UDP, MAX_DENY_CIDRS,
    MAX_FAILSAFE_PORTS,
};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::bpf::{link_detach, link_pin, link_pin_ifname, map_err, take};
use super::{ifindex, DataplaneError};

/// How the XDP program attaches (`[xdp] mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native (driver) mode where the driver supports it, generic (SKB) mode otherwise.
    #[default]
    Auto,
    /// Driver mode only: attaching fails on a driver without XDP support.
    Native,
    /// Generic (SKB) mode: works on any interface, runs after the skb is allocated.
    Generic,
}

/// The mode an attachment actually runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpAttachMode {
    Native,
    Generic,
}

impl XdpAttachMode {
    const ALL: [XdpAttachMode; 2] = [XdpAttachMode::Native, XdpAttachMode::Generic];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
        }
    }

    fn flags(self) -> XdpFlags {
        match self {
            Self::Native => XdpFlags::DRV_MODE,
            Self::Generic => XdpFlags::SKB_MODE,
        }
    }
}

impl XdpMode {
    /// The modes to try, in order.
    fn candidates(self) -> &'static [XdpAttachMode] {
        match self {
            Self::Auto => &XdpAttachMode::ALL,
            Self::Native => &XdpAttachMode::ALL[..1],
            Self::Generic => &XdpAttachMode::ALL[1..],
        }
    }
}

/// TCP or UDP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum L4Proto {
    Tcp,
    Udp,
}

/// A destination port the prefilter never drops: `tcp:22`, `udp:53`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Failsafe {
    pub proto: L4Proto,
    pub port: u16,
}

impl std::fmt::Display for Failsafe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let proto = match self.proto {
            L4Proto::Tcp => "tcp",
            L4Proto::Udp => "udp",
        };
        write!(f, "{proto}:{}", self.port)
    }
}

impl std::str::FromStr for Failsafe {
    type Err = ();
    /// `tcp:<port>` or `udp:<port>`, port 1–65535.
    fn from_str(s: &str) -> Result<Self, ()> {
        let (proto, port) = s.trim().split_once(':').ok_or(())?;
        let proto = match proto.to_ascii_lowercase().as_str() {
            "tcp" => L4Proto::Tcp,
            "udp" => L4Proto::Udp,
            _ => return Err(()),
        };
        let port: u16 = port.parse().map_err(|_| ())?;
        if port == 0 {
            return Err(());
        }
        Ok(Self { proto, port })
    }
}

impl Failsafe {
    /// The map key: the port as it appears in the packet.
    fn key(self) -> FailsafePort {
        FailsafePort {
            port: self.port.to_be(),
            proto: match self.proto {
                L4Proto::Tcp => IPPROTO_TCP,
                L4Proto::Udp => IPPROTO_UDP,
            },
            _pad: 0,
        }
    }
}

/// Parses one `deny_cidrs` entry: a CIDR (host bits are cleared) or a single address.
pub fn parse_deny(entry: &str) -> Option<IpNet> {
    let entry = entry.trim();
    match entry.parse::<IpNet>() {
        Ok(net) => Some(net.trunc()),
        Err(_) => entry.parse::<IpAddr>().ok().map(IpNet::from),
    }
}

/// What the prefilter enforces: the source CIDRs it drops and the ports it never drops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct XdpPolicy {
    pub deny: Vec<IpNet>,
    pub failsafe: Vec<Failsafe>,
}

impl XdpPolicy {
    /// Deny prefixes per family and failsafe ports the maps can hold.
    pub const MAX_DENY_PER_FAMILY: usize = MAX_DENY_CIDRS as usize;
    pub const MAX_FAILSAFE: usize = MAX_FAILSAFE_PORTS as usize;
}

/// XDP on the uplinks, when enabled: how it attaches and what it enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdpSettings {
    pub mode: XdpMode,
    pub policy: XdpPolicy,
}

/// `<node pin dir>/xdp`: the pinned links, one per uplink.
pub fn links_dir(node_dir: &Path) -> PathBuf {
    node_dir.join("xdp")
}

/// `<dir>/<ifname>@<mode>` ([`link_pin`]).
fn pin_path(dir: &Path, ifname: &str, mode: XdpAttachMode) -> PathBuf {
    link_pin(dir, ifname, mode.as_str())
}

fn xdp_err<'a, E>(ifname: &'a str, op: &'static str) -> impl FnOnce(E) -> DataplaneError + 'a
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |e| DataplaneError::Xdp {
        ifname: ifname.to_string(),
        op,
        source: Box::new(e),
    }
}

/// The prefilter's maps, as the agent last wrote them.
pub struct XdpFilter {
    deny_v4: LpmTrie<MapData, [u8; 4], u32>,
    deny_v6: LpmTrie<MapData, [u8; 16], u32>,
    failsafe: HashMap<MapData, FailsafePort, u32>,
}

impl XdpFilter {
    /// Takes the prefilter's maps out of the loaded object.
    pub fn open(bpf: &mut Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            deny_v4: take(bpf, DENY_V4_MAP, LpmTrie::try_from)?,
            deny_v6: take(bpf, DENY_V6_MAP, LpmTrie::try_from)?,
            failsafe: take(bpf, FAILSAFE_MAP, HashMap::try_from)?,
        })
    }

    /// Brings the maps to `policy`: failsafe ports added, deny entries added, stale deny
    /// entries removed, stale failsafe ports removed — in that order, so a port that stays
    /// failsafe is never dropped meanwhile. Only differences are written.
    pub fn set_policy(&mut self, policy: &XdpPolicy) -> Result<(), DataplaneError> {
        let want_v4: BTreeSet<(u32, [u8; 4])> = policy
            .deny
            .iter()
            .filter_map(|n| match n {
                IpNet::V4(n) => Some((u32::from(n.prefix_len()), n.network().octets())),
                IpNet::V6(_) => None,
            })
            .collect();
        let want_v6: BTreeSet<(u32, [u8; 16])> = policy
            .deny
            .iter()
            .filter_map(|n| match n {
                IpNet::V6(n) => Some((u32::from(n.prefix_len()), n.network().octets())),
                IpNet::V4(_) => None,
            })
            .collect();
        let want_fs: BTreeSet<FailsafePort> = policy.failsafe.iter().map(|f| f.key()).collect();
        let have_v4: BTreeSet<(u32, [u8; 4])> = self
            .deny_v4
            .keys()
            .filter_map(Result::ok)
            .map(|k| (k.prefix_len(), k.data()))
            .collect();
        let have_v6: BTreeSet<(u32, [u8; 16])> = self
            .deny_v6
            .keys()
            .filter_map(Result::ok)
            .map(|k| (k.prefix_len(), k.data()))
            .collect();
        let have_fs: BTreeSet<FailsafePort> = self.failsafe.keys().filter_map(Result::ok).collect();

        for k in want_fs.difference(&have_fs) {
            self.failsafe
                .insert(k, 1, 0)
                .map_err(map_err(FAILSAFE_MAP, "insert"))?;
        }
        for (len, addr) in want_v4.difference(&have_v4) {
            self.deny_v4
                .insert(&Key::new(*len, *addr), 1, 0)
                .map_err(map_err(DENY_V4_MAP, "insert"))?;
        }
        for (len, addr) in want_v6.difference(&have_v6) {
            self.deny_v6
                .insert(&Key::new(*len, *addr), 1, 0)
                .map_err(map_err(DENY_V6_MAP, "insert"))?;
        }
        for (len, addr) in have_v4.difference(&want_v4) {
            self.deny_v4
                .remove(&Key::new(*len, *addr))
                .map_err(map_err(DENY_V4_MAP, "remove"))?;
        }
        for (len, addr) in have_v6.difference(&want_v6) {
            self.deny_v6
                .remove(&Key::new(*len, *addr))
                .map_err(map_err(DENY_V6_MAP, "remove"))?;
        }
        for k in have_fs.difference(&want_fs) {
            self.failsafe
                .remove(k)
                .map_err(map_err(FAILSAFE_MAP, "remove"))?;
        }
        tracing::info!(
            deny = ?policy.deny.iter().map(ToString::to_string).collect::<Vec<_>>(),
            failsafe = ?policy.failsafe.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "XDP prefilter policy set"
        );
        Ok(())
    }
}

/// Attaches `prog` (loaded) to `ifname`: replaces the program of the link a previous agent
/// pinned (atomically) when its mode fits `mode`, else attaches anew — natively first when
/// `mode` is auto — and pins the new link. Returns the mode it runs in.
pub fn attach(
    prog: &mut Xdp,
    ifname: &str,
    mode: XdpMode,
    dir: &Path,
) -> Result<XdpAttachMode, DataplaneError> {
    let idx = ifindex(ifname)?;
    std::fs::create_dir_all(dir).map_err(|source| DataplaneError::Pin {
        path: dir.to_path_buf(),
        op: "create",
        source,
    })?;
    for existing in XdpAttachMode::ALL {
        let pin = pin_path(dir, ifname, existing);
        if !pin.exists() {
            continue;
        }
        if mode.candidates().contains(&existing) {
            match replace(prog, &pin) {
                Ok(()) => {
                    tracing::info!(%ifname, mode = existing.as_str(), "XDP program replaced in place");
                    return Ok(existing);
                }
                // E.g. the interface was deleted and created again: the old link is defunct.
                Err(e) => tracing::warn!(%ifname, error = %e,
                    "cannot update the pinned XDP link; attaching anew"),
            }
        } else {
            tracing::warn!(%ifname, from = existing.as_str(), to = ?mode,
                "XDP mode changed: detaching and attaching anew (briefly unfiltered)");
        }
        detach_pin(&pin);
    }
    let mut failures = Vec::new();
    for &m in mode.candidates() {
        match prog.attach_to_if_index(idx, m.flags()) {
            Ok(id) => {
                let link = prog
                    .take_link(id)
                    .map_err(xdp_err(ifname, "take the link"))?;
                pin_link(link, &pin_path(dir, ifname, m), ifname)?;
                if !failures.is_empty() {
                    tracing::info!(%ifname, native_error = %failures.join("; "),
                        "no native XDP on this interface");
                }
                tracing::info!(%ifname, mode = m.as_str(), "XDP program attached");
                return Ok(m);
            }
            Err(e) => failures.push(format!("{}: {}", m.as_str(), super::error_chain(&e))),
        }
    }
    Err(DataplaneError::Xdp {
        ifname: ifname.to_string(),
        op: "attach",
        source: failures.join("; ").into(),
    })
}

/// Swaps `prog` into the link pinned at `pin` (`BPF_LINK_UPDATE`: no window without one).
fn replace(prog: &mut Xdp, pin: &Path) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let pinned = PinnedLink::from_pin(pin)?;
    let link = XdpLink::try_from(FdLink::from(pinned))?;
    let id = prog.attach_to_link(link)?;
    // The pin holds the link; this process's descriptor can go.
    drop(prog.take_link(id)?);
    Ok(())
}

/// Pins a new link so it outlives this process, then lets go of the descriptor.
fn pin_link(link: XdpLink, pin: &Path, ifname: &str) -> Result<(), DataplaneError> {
    match FdLink::try_from(link) {
        Ok(fd_link) => {
            let pinned = fd_link.pin(pin).map_err(|e| DataplaneError::Pin {
                path: pin.to_path_buf(),
                op: "pin XDP link",
                source: std::io::Error::other(e.to_string()),
            })?;
            drop(pinned);
            Ok(())
        }
        // Kernels before 5.9 attach by netlink, which outlives the process by itself.
        Err(e) => {
            tracing::warn!(%ifname, error = %e, "XDP attached by netlink, not as a link: not pinned");
            Ok(())
        }
    }
}

/// Detaches and unpins every pinned link in `dir` whose interface is not in `keep`.
pub fn detach_except(dir: &Path, keep: &[String]) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let ifname = link_pin_ifname(&e.file_name().to_string_lossy());
        if !keep.contains(&ifname) {
            detach_pin(&e.path());
            tracing::info!(interface = %ifname, "XDP program detached");
            n += 1;
        }
    }
    n
}

/// Detaches the link pinned at `pin` now and removes the pin. Best effort: a link whose
/// interface is gone is already detached.
fn detach_pin(pin: &Path) {
    if let Err(e) = link_detach(pin) {
        tracing::debug!(pin = %pin.display(), error = %e, "BPF_LINK_DETACH");
    }
    if let Err(e) = std::fs::remove_file(pin) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(pin = %pin.display(), error = %e, "cannot remove the XDP link pin");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failsafe_ports_parse_and_print() {
        let f: Failsafe = "tcp:22".parse().expect("tcp:22");
        assert_eq!(
            f,
            Failsafe {
                proto: L4Proto::Tcp,
                port: 22
            }
        );
        assert_eq!(f.to_string(), "tcp:22");
        assert_eq!(f.key().port, 22u16.to_be());
        assert_eq!(f.key().proto, IPPROTO_TCP);
        assert_eq!(
            " UDP:53".parse::<Failsafe>().map(|f| f.to_string()),
            Ok("udp:53".into())
        );
        for bad in ["22", "tcp:", "tcp:0", "tcp:65536", "sctp:22", "tcp:ssh", ""] {
            assert!(bad.parse::<Failsafe>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn deny_entries_parse_as_cidrs_or_addresses() {
        let p = |s| parse_deny(s).map(|n| n.to_string());
        assert_eq!(p("192.0.2.0/24"), Some("192.0.2.0/24".into()));
        assert_eq!(p("192.0.2.7/24"), Some("192.0.2.0/24".into()));
        assert_eq!(p("192.0.2.7"), Some("192.0.2.7/32".into()));
        assert_eq!(p("2001:db8::1"), Some("2001:db8::1/128".into()));
        assert_eq!(p("2001:db8::/32"), Some("2001:db8::/32".into()));
        for bad in ["192.0.2.0/33", "192.0.2", "example.com", ""] {
            assert_eq!(p(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn pin_names_have_no_dots_and_give_the_interface_back() {
        let dir = Path::new("/sys/fs/bpf/calix/n/xdp");
        for ifname in ["eth0", "eth0.100", "bond0.2.3", "a@b"] {
            let pin = pin_path(dir, ifname, XdpAttachMode::Native);
            let name = pin.file_name().expect("a name").to_string_lossy();
            assert!(!name.contains('.'), "{name}");
            assert_eq!(link_pin_ifname(&name), ifname);
        }
    }

    #[test]
    fn modes_try_native_first_only_in_auto() {
        assert_eq!(
            XdpMode::Auto.candidates(),
            &[XdpAttachMode::Native, XdpAttachMode::Generic]
        );
        assert_eq!(XdpMode::Native.candidates(), &[XdpAttachMode::Native]);
        assert_eq!(XdpMode::Generic.candidates(), &[XdpAttachMode::Generic]);
    }
}
