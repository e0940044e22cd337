//! How the tc programs attach: tcx links (Linux ≥ 6.6, the default) or cls_bpf filters on a
//! clsact qdisc (`tc_attach`).
//!
//! tcx runs the programs straight from the device's ingress and egress hooks, without the
//! qdisc and classifier layers: measured here, the same program costs 15–25 ns less per packet
//! than as a cls_bpf filter. But creating a tcx link waits for an RCU grace period (8–16 ms
//! here, against 0.1 ms for a filter) holding the kernel's RTNL lock, and two per pod would
//! make CNI ADD ten times slower. So a hook first gets a cls_bpf filter (ADD returns at once)
//! and a background thread, the `Mover`, puts the program on a tcx link once the pods' comings
//! and goings pause (`MOVE_AFTER`) and removes the filter: calix's programs never answer "next", so while
//! both are there the tcx one alone decides, and the hook is never without a program.
//! Updating a link in place is as fast as a filter (~10 µs). The `Mover` stops when the agent
//! releases the dataplane (`Attacher::release`): what it has not moved keeps its filter.
//!
//! A tcx link is pinned at `<node pin dir>/tcx/<ifname>@<ingress|egress>` (outside the
//! map-layout directory, like the XDP links) so that it outlives the agent; a new agent swaps
//! its program into the pinned link (`BPF_LINK_UPDATE`: never a moment without one). A pinned
//! link whose interface went away (or that was detached by hand) is defunct: the hook gets a
//! filter and a new link again. cls_bpf filters have calix's fixed priority and handle, and a
//! new agent replaces their program in place (one netlink request). With `tc_attach = "tc"`
//! the hooks keep their filters, and tcx links an earlier agent pinned are removed.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

/// `tc_attach`.
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

/// The attachments of one agent: how they are made, where tcx links are pinned, and the
/// `Mover` that puts new hooks on tcx links.
pub struct Attacher {
    how: Attachment,
    dir: PathBuf,
    mover: Option<Mover>,
}

impl Attacher {
    pub fn new(how: Attachment, dir: PathBuf) -> Self {
        let mover = (how == Attachment::Tcx).then(|| Mover::start(dir.clone()));
        Self { how, dir, mover }
    }

    pub fn how(&self) -> Attachment {
        self.how
    }

    /// The agent lets the dataplane go: the `Mover` stops (a move under way finishes first) and
    /// moves nothing more; hooks not moved yet keep their filters for the next agent.
    pub fn release(&mut self) {
        self.mover = None;
    }

    /// The lock every change of an interface's attachments holds (see `Mover`).
    fn lock(&self) -> Option<MutexGuard<'_, Generations>> {
        let m = self.mover.as_ref()?;
        Some(m.generations.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Attaches `prog` (`name`, pinned at `prog_pin`) at `at` on `ifname`, replacing
    /// (atomically) what calix runs there now. With tcx: into the hook's pinned link when
    /// there is one; else as a filter, which the `Mover` then moves to a new link.
    pub fn attach(
        &self,
        prog: &mut SchedClassifier,
        name: &'static str,
        prog_pin: &Path,
        ifname: &str,
        at: TcAttachType,
    ) -> Result<(), DataplaneError> {
        let mut locked = self.lock();
        let generation = locked.as_mut().map(|g| g.bump(ifname, at));
        let pin = pin_path(&self.dir, ifname, at);
        if self.how == Attachment::ClsBpf {
            attach_filter(prog, name, ifname, at)?;
            detach_pin(&pin);
            return Ok(());
        }
        if pin.exists() {
            match replace(prog, &pin) {
                Ok(()) => {
                    detach_filter(ifname, at);
                    return Ok(());
                }
                // The interface was deleted (and maybe created again), or the link detached
                // by hand: the pinned link is defunct.
                Err(e) => {
                    tracing::debug!(%ifname, error = %e, "pinned tcx link not updated; attaching anew");
                    detach_pin(&pin);
                }
            }
        }
        attach_filter(prog, name, ifname, at)?;
        if let (Some(m), Some(generation)) = (&self.mover, generation) {
            let index = super::ifindex(ifname)?;
            m.queue(Move {
                ifname: ifname.to_string(),
                index,
                at,
                name,
                prog_pin: prog_pin.to_path_buf(),
                generation,
                due: Instant::now() + MOVE_AFTER,
            });
        }
        Ok(())
    }

    /// Removes calix's programs from `ifname`, both directions and both kinds (missing is
    /// fine); a move under way is called off.
    pub fn detach(&self, ifname: &str) {
        let mut locked = self.lock();
        detach(ifname, &self.dir);
        if let Some(g) = locked.as_mut() {
            g.forget(ifname);
        }
    }
}

/// Each hook's generation: a new one at every attach, none after a detach, so a move queued
/// before either knows it is stale; and when the last of them happened.
struct Generations {
    next: u64,
    of: HashMap<(String, &'static str), u64>,
    changed: Instant,
}

impl Default for Generations {
    fn default() -> Self {
        Self {
            next: 0,
            of: HashMap::new(),
            changed: Instant::now(),
        }
    }
}

impl Generations {
    fn bump(&mut self, ifname: &str, at: TcAttachType) -> u64 {
        self.next += 1;
        self.changed = Instant::now();
        self.of
            .insert((ifname.to_string(), direction(at)), self.next);
        self.next
    }

    fn current(&self, ifname: &str, at: TcAttachType) -> Option<u64> {
        self.of.get(&(ifname.to_string(), direction(at))).copied()
    }

    fn forget(&mut self, ifname: &str) {
        self.changed = Instant::now();
        self.of.retain(|(i, _), _| i != ifname);
    }

    /// How much longer `m` waits: until it is due, and until no hook has changed for
    /// `MOVE_AFTER`.
    fn wait_for(&self, m: &Move, now: Instant) -> Duration {
        let quiet = (self.changed + MOVE_AFTER).saturating_duration_since(now);
        m.due.saturating_duration_since(now).max(quiet)
    }
}

/// How long a new hook keeps its filter before the `Mover` moves it, and how long no hook may
/// have been attached or detached before it does: creating a tcx link holds the kernel's RTNL
/// lock through an RCU grace period, so other netlink work (the next pod's veth, a deleted
/// pod's) would wait for it. Moves wait for a pause in the pods' comings and goings, and a pod
/// that lived less long never pays for a link.
const MOVE_AFTER: Duration = Duration::from_secs(2);

/// One hook to move from its filter to a tcx link.
struct Move {
    ifname: String,
    /// The interface's ifindex when it was queued (a recreated interface is another).
    index: u32,
    at: TcAttachType,
    name: &'static str,
    prog_pin: PathBuf,
    generation: u64,
    /// Not before this.
    due: Instant,
}

/// A thread that moves hooks from their cls_bpf filter to a tcx link: it creates the link
/// (the slow part: an RCU grace period) without any lock, then, holding the generations' lock,
/// pins it and removes the filter — unless the interface was attached or detached again
/// meanwhile, or is another link now: then the new link is dropped (its last descriptor
/// closes, it detaches) and the filter stays as the newer call left it.
struct Mover {
    tx: Option<mpsc::Sender<Move>>,
    generations: Arc<Mutex<Generations>>,
    /// Dropped to stop the thread, even while it waits for a move to be due.
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Mover {
    fn start(dir: PathBuf) -> Self {
        let (tx, rx) = mpsc::channel::<Move>();
        let (stop, stopped) = mpsc::channel::<()>();
        let generations = Arc::new(Mutex::new(Generations::default()));
        let g = Arc::clone(&generations);
        let spawned = std::thread::Builder::new()
            .name("tcx-mover".into())
            .spawn(move || {
                // Moves still queued when the mover stops are dropped with it.
                for m in rx {
                    loop {
                        let wait = g
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .wait_for(&m, Instant::now());
                        if wait.is_zero() {
                            break;
                        }
                        if stopped.recv_timeout(wait) != Err(mpsc::RecvTimeoutError::Timeout) {
                            return;
                        }
                    }
                    if stopped.try_recv() != Err(mpsc::TryRecvError::Empty) {
                        return;
                    }
                    if let Err(e) = move_to_link(&m, &dir, &g) {
                        tracing::warn!(ifname = %m.ifname, direction = direction(m.at),
                            error = %super::error_chain(&e),
                            "cannot move the program to a tcx link; it stays a cls_bpf filter");
                    }
                }
            });
        let thread = match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the tcx mover: programs stay cls_bpf filters");
                None
            }
        };
        Self {
            tx: Some(tx),
            generations,
            stop: Some(stop),
            thread,
        }
    }

    fn queue(&self, m: Move) {
        // A failed send (no thread) leaves the filter, which works.
        if let Some(tx) = &self.tx {
            let _ = tx.send(m);
        }
    }
}

impl Drop for Mover {
    /// Stops the thread and waits for it: a move under way (one link's creation, ~10 ms)
    /// finishes, nothing after it starts.
    fn drop(&mut self) {
        drop((self.stop.take(), self.tx.take()));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn move_to_link(
    m: &Move,
    dir: &Path,
    generations: &Mutex<Generations>,
) -> Result<(), DataplaneError> {
    let lock = || generations.lock().unwrap_or_else(|p| p.into_inner());
    let stale = |g: &Generations| {
        g.current(&m.ifname, m.at) != Some(m.generation)
            || super::ifindex(&m.ifname).ok() != Some(m.index)
    };
    if stale(&lock()) {
        return Ok(());
    }
    let mut prog = SchedClassifier::from_pin(&m.prog_pin).map_err(prog_err(m.name, "open pin"))?;
    std::fs::create_dir_all(dir).map_err(|source| DataplaneError::Pin {
        path: dir.to_path_buf(),
        op: "create",
        source,
    })?;
    let opts = TcAttachOptions::TcxOrder(LinkOrder::first());
    let id = prog
        .attach_with_options(&m.ifname, m.at, opts)
        .map_err(prog_err(m.name, "attach (tcx)"))?;
    let link = prog.take_link(id).map_err(prog_err(m.name, "take link"))?;
    let link = FdLink::try_from(link).map_err(|e| {
        prog_err(m.name, "tcx link")(ProgramError::IOError(std::io::Error::other(e)))
    })?;
    let g = lock();
    if stale(&g) {
        // Dropped unpinned: it detaches.
        return Ok(());
    }
    let pin = pin_path(dir, &m.ifname, m.at);
    detach_pin(&pin);
    let pinned = link.pin(&pin).map_err(|e| DataplaneError::Pin {
        path: pin.clone(),
        op: "pin tcx link",
        source: std::io::Error::other(e.to_string()),
    })?;
    // The pin holds the link; this descriptor can go.
    drop(pinned);
    detach_filter(&m.ifname, m.at);
    drop(g);
    tracing::debug!(ifname = %m.ifname, direction = direction(m.at), "program moved to a tcx link");
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

/// Removes calix's programs from `ifname` (links pinned in `dir`, filters), both directions
/// (missing is fine). Without an [`Attacher`]: the uninstall.
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

    /// A move queued before a later attach of its hook, or a detach of its interface, is
    /// stale; the other direction's is not.
    #[test]
    fn every_attach_and_detach_makes_earlier_moves_stale() {
        let (i, e) = (TcAttachType::Ingress, TcAttachType::Egress);
        let mut g = Generations::default();
        let first = g.bump("cali1", i);
        let egress = g.bump("cali1", e);
        let other = g.bump("cali2", i);
        assert_eq!(g.current("cali1", i), Some(first), "egress is another hook");
        let again = g.bump("cali1", i);
        assert_eq!(g.current("cali1", i), Some(again));
        assert_eq!(g.current("cali1", e), Some(egress));
        g.forget("cali1");
        assert_eq!((g.current("cali1", i), g.current("cali1", e)), (None, None));
        assert_eq!(g.current("cali2", i), Some(other));
    }

    /// A move waits until it is due and until attachments have paused for `MOVE_AFTER`.
    #[test]
    fn moves_wait_for_a_pause() {
        let mut g = Generations::default();
        let t0 = Instant::now();
        g.changed = t0;
        let m = Move {
            ifname: "cali1".into(),
            index: 7,
            at: TcAttachType::Ingress,
            name: "from_pod",
            prog_pin: PathBuf::new(),
            generation: 1,
            due: t0 + Duration::from_secs(1),
        };
        assert_eq!(g.wait_for(&m, t0), MOVE_AFTER, "no pause yet");
        g.changed = t0.checked_sub(MOVE_AFTER).expect("up for 2 s");
        assert_eq!(g.wait_for(&m, t0), Duration::from_secs(1), "not due yet");
        assert!(g.wait_for(&m, t0 + Duration::from_secs(1)).is_zero());
    }
}
