//! How the tc programs attach: tcx (Linux ≥ 6.6, the default) or cls_bpf filters on a clsact
//! qdisc (`tc_attach`).
//!
//! tcx runs the programs straight from the device's ingress and egress hooks, without the
//! qdisc and classifier layers: measured here, the same program costs ~25 ns less per packet
//! than as a cls_bpf filter (docs/decisions.md). Each attachment is a bpf_link per interface
//! and direction, pinned at `<node pin dir>/tcx/<ifname>@<ingress|egress>` (outside the
//! map-layout directory, like the XDP links) so that it outlives the agent; a new agent swaps
//! its program into the pinned link (`BPF_LINK_UPDATE`: never a moment without one). A pinned
//! link whose interface went away is defunct: it is replaced by a new one.
//!
//! cls_bpf filters have calix's fixed priority and handle, and a new agent replaces their
//! program in place (one netlink request). Either way, attaching moves an interface off the
//! other kind once the new attachment runs (an upgrade from a build that attached by netlink,
//! or a change of `tc_attach`): calix's tcx programs never answer "next", so while both are
//! there the tcx one alone decides.
use std::path::{Path, PathBuf};

use aya::programs::links::{FdLink, Link, LinkOrder, PinnedLink};
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcAttachType, TcError};
use aya::programs::{ProgramError, SchedClassifier};
use serde::{Deserialize, Serialize};

use super::bpf::{link_detach, link_pin, prog_err};
use super::DataplaneError;

/// tc priority and handle of every calix cls_bpf filter: fixed, so a new agent can replace
/// them.
pub const TC_PRIORITY: u16 = 1;
pub const TC_HANDLE: u32 = 0xca11;

/// `[dataplane] tc_attach`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TcAttach {
    /// tcx where the kernel has it (6.6 and later), else cls_bpf.
    #[default]
    Auto,
    /// tcx links.
    Tcx,
    /// cls_bpf filters on a clsact qdisc.
    Tc,
}

/// How this agent attaches: [`TcAttach`] resolved for the running kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attachment {
    Tcx,
    ClsBpf,
}

impl TcAttach {
    pub fn resolve(self) -> Attachment {
        match self {
            Self::Tcx => Attachment::Tcx,
            Self::Tc => Attachment::ClsBpf,
            Self::Auto => {
                let tcx = aya::util::KernelVersion::current()
                    .is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0));
                if tcx {
                    Attachment::Tcx
                } else {
                    Attachment::ClsBpf
                }
            }
        }
    }
}

/// Where the tcx links are pinned, below the node's pin directory.
pub fn links_dir(node_dir: &Path) -> PathBuf {
    node_dir.join("tcx")
}

fn direction(at: TcAttachType) -> &'static str {
    match at {
        TcAttachType::Ingress => "ingress",
        _ => "egress",
    }
}

/// `<dir>/<ifname>@<direction>` ([`link_pin`]).
fn pin_path(dir: &Path, ifname: &str, at: TcAttachType) -> PathBuf {
    link_pin(dir, ifname, direction(at))
}

/// Attaches `prog` (`name`) at `at` on `ifname` as `how` says, replacing (atomically) what a
/// calix attachment of that kind runs there now; then removes calix's attachment of the other
/// kind, if any.
pub fn attach(
    prog: &mut SchedClassifier,
    name: &'static str,
    ifname: &str,
    at: TcAttachType,
    how: Attachment,
    dir: &Path,
) -> Result<(), DataplaneError> {
    match how {
        Attachment::Tcx => {
            attach_link(prog, name, ifname, at, dir)?;
            detach_filter(ifname, at);
        }
        Attachment::ClsBpf => {
            attach_filter(prog, name, ifname, at)?;
            detach_pin(&pin_path(dir, ifname, at));
        }
    }
    Ok(())
}

fn attach_link(
    prog: &mut SchedClassifier,
    name: &'static str,
    ifname: &str,
    at: TcAttachType,
    dir: &Path,
) -> Result<(), DataplaneError> {
    let pin = pin_path(dir, ifname, at);
    if pin.exists() {
        match replace(prog, &pin) {
            Ok(()) => return Ok(()),
            // The interface was deleted (and maybe created again), or the link detached by
            // hand: the pinned link is defunct.
            Err(e) => {
                tracing::debug!(%ifname, error = %e, "pinned tcx link not updated; attaching anew");
                detach_pin(&pin);
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| DataplaneError::Pin {
        path: dir.to_path_buf(),
        op: "create",
        source,
    })?;
    let opts = TcAttachOptions::TcxOrder(LinkOrder::first());
    let id = prog
        .attach_with_options(ifname, at, opts)
        .map_err(prog_err(name, "attach (tcx)"))?;
    let link = prog.take_link(id).map_err(prog_err(name, "take link"))?;
    let fd_link = FdLink::try_from(link)
        .map_err(|e| prog_err(name, "tcx link")(ProgramError::IOError(std::io::Error::other(e))))?;
    let pinned = fd_link.pin(&pin).map_err(|e| DataplaneError::Pin {
        path: pin.clone(),
        op: "pin tcx link",
        source: std::io::Error::other(e.to_string()),
    })?;
    // The pin holds the link; this process's descriptor can go.
    drop(pinned);
    Ok(())
}

/// Swaps `prog` into the link pinned at `pin` (`BPF_LINK_UPDATE`).
fn replace(
    prog: &mut SchedClassifier,
    pin: &Path,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let pinned = PinnedLink::from_pin(pin)?;
    let link = SchedClassifierLink::try_from(FdLink::from(pinned))?;
    let id = prog.attach_to_link(link)?;
    drop(prog.take_link(id)?);
    Ok(())
}

fn attach_filter(
    prog: &mut SchedClassifier,
    name: &'static str,
    ifname: &str,
    at: TcAttachType,
) -> Result<(), DataplaneError> {
    match aya::programs::tc::qdisc_add_clsact(ifname) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => return Err(prog_err(name, "add clsact qdisc")(ProgramError::IOError(e))),
    }
    let opts = TcAttachOptions::Netlink(NlOptions {
        priority: TC_PRIORITY,
        handle: TC_HANDLE,
    });
    let id = match prog.attach_with_options(ifname, at, opts) {
        Ok(id) => id,
        Err(ProgramError::TcError(TcError::NetlinkError { io_error }))
            if io_error.raw_os_error() == Some(libc::EEXIST) =>
        {
            let link = SchedClassifierLink::attached(ifname, at, TC_PRIORITY, TC_HANDLE)
                .map_err(|e| prog_err(name, "find filter")(ProgramError::IOError(e)))?;
            prog.attach_to_link(link)
                .map_err(prog_err(name, "replace"))?
        }
        Err(e) => return Err(prog_err(name, "attach")(e)),
    };
    let link = prog.take_link(id).map_err(prog_err(name, "take link"))?;
    // The filter outlives this process: detaching is explicit.
    std::mem::forget(link);
    Ok(())
}

/// Removes calix's cls_bpf filter at `at` on `ifname` (missing is fine).
fn detach_filter(ifname: &str, at: TcAttachType) {
    if let Ok(link) = SchedClassifierLink::attached(ifname, at, TC_PRIORITY, TC_HANDLE) {
        let _ = link.detach();
    }
}

/// Detaches the link pinned at `pin` now and removes the pin (missing is fine).
fn detach_pin(pin: &Path) {
    if !pin.exists() {
        return;
    }
    if let Err(e) = link_detach(pin) {
        tracing::debug!(pin = %pin.display(), error = %e, "BPF_LINK_DETACH");
    }
    if let Err(e) = std::fs::remove_file(pin) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(pin = %pin.display(), error = %e, "cannot remove the tcx link pin");
        }
    }
}

/// Removes calix's programs from `ifname`, both directions and both kinds (missing is fine).
pub fn detach(ifname: &str, dir: &Path) {
    for at in [TcAttachType::Ingress, TcAttachType::Egress] {
        detach_pin(&pin_path(dir, ifname, at));
        detach_filter(ifname, at);
    }
}

/// Detaches every pinned tcx link in `dir` (the uninstall).
pub fn detach_all(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten().map(|e| detach_pin(&e.path())).count()
}

/// The ids of the programs tcx runs at `at` on `ifname`, in order.
pub fn programs(ifname: &str, at: TcAttachType) -> Result<Vec<u32>, ProgramError> {
    let (_, progs) = SchedClassifier::query_tcx(ifname, at)?;
    Ok(progs.iter().map(|p| p.id()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_are_named_by_interface_and_direction() {
        let dir = Path::new("/sys/fs/bpf/calix/n1/tcx");
        assert_eq!(
            pin_path(dir, "cali0123456789a", TcAttachType::Egress),
            dir.join("cali0123456789a@egress")
        );
        assert_eq!(
            pin_path(dir, "vxlan.calix", TcAttachType::Ingress),
            dir.join("vxlan:calix@ingress"),
            "bpffs refuses dots"
        );
    }

    #[test]
    fn explicit_choices_resolve_as_named() {
        assert_eq!(TcAttach::Tcx.resolve(), Attachment::Tcx);
        assert_eq!(TcAttach::Tc.resolve(), Attachment::ClsBpf);
    }
}
