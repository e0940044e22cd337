//! The DaemonSet that runs this agent (`--owner-daemonset <namespace>/<name>`, the chart sets
//! it): when the agent is told to stop, was it restarted (a rolling update, `kubectl rollout
//! restart`, a node drain, a topology switch) or is calix being uninstalled (`helm uninstall`
//! deletes the release's DaemonSets, then the garbage collector their pods)?
//!
//! A restart keeps everything: the pinned programs carry every flow until the next agent takes
//! over. An uninstall takes calix off the node (`crate::uninstall`). The two look the same from
//! inside the pod (SIGTERM), so the agent follows its DaemonSet, and the release's other
//! DaemonSets (`--sibling-daemonset`: the route reflectors' and everyone else's), from the
//! start: `helm uninstall` deletes the DaemonSets before their RBAC objects and ServiceAccount,
//! so by the time the agent's SIGTERM comes the watch has seen the deletion even if the agent
//! may no longer ask. At SIGTERM it also asks once: a DaemonSet that is there and not being
//! deleted means a restart, whatever the watch saw.
//!
//! An uninstall needs all of:
//! - the agent's own DaemonSet gone (or being deleted), after it was seen present (an agent
//!   started by hand with a wrong name never uninstalls itself);
//! - no sibling DaemonSet there and staying: switching `routes.topology` from reflectors to mesh
//!   deletes the reflectors' DaemonSet while the other one takes their nodes over;
//! - each of those facts asked at SIGTERM, or known from a watch that has not lost the API
//!   server since: what the watch saw before it lost contact is forgotten ([`Known::Unknown`]),
//!   and a DaemonSet seen again (an orphan delete, then a re-create) is present again. An
//!   unreachable API server is never read as a deletion.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};

/// How long the agent asks for each DaemonSet at SIGTERM.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long it then waits for the watch when asking failed (no longer allowed: the RBAC
/// objects may go right after the DaemonSet).
const WATCH_WAIT: Duration = Duration::from_secs(3);
/// Between two watches after a failure.
const RETRY: Duration = Duration::from_secs(1);

/// `<namespace>/<name>` of a DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for OwnerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// An owner reference that is not `<namespace>/<name>` of Kubernetes names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadOwnerRef {
    #[error("{0:?}: expected <namespace>/<daemonset name>")]
    NoSlash(String),
    #[error("{0:?}: a namespace and a name of lowercase letters, digits, '-' and '.'")]
    Characters(String),
}

impl std::str::FromStr for OwnerRef {
    type Err = BadOwnerRef;
    fn from_str(s: &str) -> Result<Self, BadOwnerRef> {
        let (ns, name) = s
            .split_once('/')
            .ok_or_else(|| BadOwnerRef::NoSlash(s.into()))?;
        let valid = |v: &str| {
            !v.is_empty()
                && v.len() <= 253
                && v.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        };
        if !valid(ns) || !valid(name) {
            return Err(BadOwnerRef::Characters(s.into()));
        }
        Ok(Self {
            namespace: ns.into(),
            name: name.into(),
        })
    }
}

/// What stopping means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Another agent takes over: leave everything in place.
    Restart,
    /// calix is being removed from the node.
    Uninstall,
}

/// The answer to the question asked at SIGTERM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    Present {
        deleting: bool,
    },
    NotFound,
    /// Refused (RBAC gone), unreachable or late.
    Failed,
}

/// What the watch of one DaemonSet knows now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Known {
    /// Not listed yet, or the watch lost the API server since it last knew.
    #[default]
    Unknown,
    Present,
    /// There, with a deletion timestamp.
    Deleting,
    Absent,
}

/// One DaemonSet as its watch has seen it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen {
    pub now: Known,
    /// Seen present (not being deleted) at least once.
    pub ever_present: bool,
}

impl Seen {
    /// A listing or watch event: `present` (and maybe being deleted), or absent. Returns
    /// whether what is known changed.
    pub fn note(&mut self, present: bool, deleting: bool) -> bool {
        let was = self.now;
        self.now = match (present, deleting) {
            (true, false) => {
                self.ever_present = true;
                Known::Present
            }
            (true, true) => Known::Deleting,
            (false, _) => Known::Absent,
        };
        self.now != was
    }

    /// The watch lost the API server (a list or watch failed): what it knew may be old.
    /// Returns whether something was known.
    pub fn lost(&mut self) -> bool {
        std::mem::replace(&mut self.now, Known::Unknown) != Known::Unknown
    }

    /// Whether the watch knows the DaemonSet is gone or going.
    fn gone(&self) -> bool {
        matches!(self.now, Known::Absent | Known::Deleting)
    }
}

/// Whether this agent's own DaemonSet is deleted, from the probe and (when asking failed)
/// what its watch knows; `None`: the watch does not know (yet): wait for it, then treat it as
/// `Some(false)`.
pub fn own_deleted(seen: Seen, probe: Probe) -> Option<bool> {
    match probe {
        Probe::Present { deleting } => Some(deleting),
        // Never seen (a wrong name, an agent started by hand): never an uninstall by absence.
        Probe::NotFound => Some(seen.ever_present),
        Probe::Failed if seen.gone() => Some(seen.ever_present),
        Probe::Failed if seen.now == Known::Present => Some(false),
        Probe::Failed => None,
    }
}

/// Whether sibling DaemonSet stays (and so takes this node over, or keeps serving the
/// cluster): what is there now wins; when asking failed, only a watch in contact that knows it
/// gone says it does not stay.
pub fn sibling_stays(seen: Seen, probe: Probe) -> bool {
    match probe {
        Probe::Present { deleting } => !deleting,
        Probe::NotFound => false,
        Probe::Failed => !seen.gone(),
    }
}

/// One followed DaemonSet.
struct Followed {
    r: OwnerRef,
    api: Api<DaemonSet>,
    seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl Followed {
    fn spawn(client: kube::Client, r: OwnerRef) -> Self {
        let api: Api<DaemonSet> = Api::namespaced(client, &r.namespace);
        let seen = Arc::new(Mutex::new(Seen::default()));
        let task = tokio::spawn(follow(api.clone(), r.clone(), seen.clone()));
        Self { r, api, seen, task }
    }

    fn seen(&self) -> Seen {
        *self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn probe(&self) -> Probe {
        match tokio::time::timeout(PROBE_TIMEOUT, self.api.get_opt(&self.r.name)).await {
            Ok(Ok(Some(ds))) => Probe::Present {
                deleting: ds.metadata.deletion_timestamp.is_some(),
            },
            Ok(Ok(None)) => Probe::NotFound,
            Ok(Err(e)) => {
                tracing::info!(error = %e, daemonset = %self.r, "cannot ask for a DaemonSet of calix at stop");
                Probe::Failed
            }
            Err(_) => Probe::Failed,
        }
    }
}

impl Drop for Followed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The DaemonSets followed. See the module doc.
pub struct Owner {
    own: Followed,
    siblings: Vec<Followed>,
}

impl Owner {
    /// Follows `owner` and `siblings` from now on (a task each).
    pub fn spawn(client: kube::Client, owner: OwnerRef, siblings: Vec<OwnerRef>) -> Self {
        Self {
            own: Followed::spawn(client.clone(), owner),
            siblings: siblings
                .into_iter()
                .map(|s| Followed::spawn(client.clone(), s))
                .collect(),
        }
    }

    /// Called at SIGTERM: restart or uninstall.
    pub async fn on_stop(&self) -> Stop {
        let probe = self.own.probe().await;
        let deleted = match own_deleted(self.own.seen(), probe) {
            Some(d) => d,
            None => {
                let deadline = tokio::time::Instant::now() + WATCH_WAIT;
                loop {
                    if let Some(d) = own_deleted(self.own.seen(), probe) {
                        break d;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        tracing::warn!(daemonset = %self.own.r,
                            "cannot tell whether the agent's DaemonSet is being deleted: treated as a restart (nothing removed; `calix-agent --uninstall --all` cleans a node by hand)");
                        break false;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let seen = self.own.seen();
        if !deleted {
            self.log(Stop::Restart, probe, seen, "the DaemonSet is there");
            return Stop::Restart;
        }
        for s in &self.siblings {
            let sibling_probe = s.probe().await;
            if sibling_stays(s.seen(), sibling_probe) {
                let why = format!(
                    "the agent's DaemonSet is deleted, but {} stays (a topology switch: it takes the node over){}",
                    s.r,
                    if sibling_probe == Probe::Failed { ", or cannot be asked for" } else { "" }
                );
                self.log(Stop::Restart, probe, seen, &why);
                return Stop::Restart;
            }
        }
        self.log(
            Stop::Uninstall,
            probe,
            seen,
            "the release's DaemonSets are deleted: calix is being uninstalled from this node",
        );
        Stop::Uninstall
    }

    fn log(&self, stop: Stop, probe: Probe, seen: Seen, why: &str) {
        tracing::info!(daemonset = %self.own.r, ?probe, watch = ?seen.now,
            "stopping: {} ({why})", match stop {
            Stop::Restart => "a restart: everything stays for the next agent",
            Stop::Uninstall => "an uninstall",
        });
    }
}

/// Lists then watches DaemonSet `r`, again after every end or failure; a failure forgets
/// what was known. Each change of what is known is logged.
async fn follow(api: Api<DaemonSet>, r: OwnerRef, seen: Arc<Mutex<Seen>>) {
    let fields = format!("metadata.name={}", r.name);
    loop {
        if let Err(e) = follow_once(&api, &r, &fields, &seen).await {
            if lock(&seen).lost() {
                tracing::info!(daemonset = %r, error = %e, "lost sight of a DaemonSet of calix: what was known of it is forgotten until it is listed again");
            }
        }
        tokio::time::sleep(RETRY).await;
    }
}

fn lock(seen: &Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    seen.lock().unwrap_or_else(|p| p.into_inner())
}

fn note(r: &OwnerRef, seen: &Mutex<Seen>, present: bool, deleting: bool) {
    let mut s = lock(seen);
    if s.note(present, deleting) {
        tracing::info!(daemonset = %r, state = ?s.now, "a DaemonSet of calix");
    }
}

async fn follow_once(
    api: &Api<DaemonSet>,
    r: &OwnerRef,
    fields: &str,
    seen: &Mutex<Seen>,
) -> Result<(), kube::Error> {
    let list = api.list(&ListParams::default().fields(fields)).await?;
    note(
        r,
        seen,
        !list.items.is_empty(),
        list.items.iter().any(deleting),
    );
    let rv = list.metadata.resource_version.unwrap_or_default();
    let params = WatchParams::default().fields(fields).timeout(290);
    let mut events = api.watch(&params, &rv).await?.boxed();
    while let Some(event) = events.try_next().await? {
        match event {
            WatchEvent::Added(ds) | WatchEvent::Modified(ds) => note(r, seen, true, deleting(&ds)),
            WatchEvent::Deleted(_) => note(r, seen, false, false),
            WatchEvent::Bookmark(_) => {}
            WatchEvent::Error(e) => return Err(kube::Error::Api(e)),
        }
    }
    Ok(())
}

fn deleting(ds: &DaemonSet) -> bool {
    ds.metadata.deletion_timestamp.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_is_a_namespace_and_a_name() {
        let o: OwnerRef = "kube-system/calix".parse().expect("valid");
        assert_eq!(o.namespace, "kube-system");
        assert_eq!(o.name, "calix");
        for bad in [
            "calix",
            "/calix",
            "kube-system/",
            "Kube/calix",
            "a/b/c",
            "a/b c",
            "",
        ] {
            let e = bad.parse::<OwnerRef>().expect_err(bad).to_string();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    fn seen(now: Known, ever_present: bool) -> Seen {
        Seen { now, ever_present }
    }

    #[test]
    fn a_daemonset_that_is_there_means_a_restart_and_one_gone_after_it_was_seen_an_uninstall() {
        use Known::{Absent, Deleting, Unknown};
        use Probe::{Failed, NotFound, Present};
        // A rolling update: the DaemonSet is there.
        assert_eq!(
            own_deleted(seen(Known::Present, true), Present { deleting: false }),
            Some(false)
        );
        // Even if the watch said otherwise, what is there now wins.
        assert_eq!(
            own_deleted(seen(Absent, true), Present { deleting: false }),
            Some(false)
        );
        // Foreground deletion: there, but being deleted.
        assert_eq!(
            own_deleted(seen(Known::Present, true), Present { deleting: true }),
            Some(true)
        );
        // Background deletion (helm's default): gone.
        assert_eq!(own_deleted(seen(Absent, true), NotFound), Some(true));
        assert_eq!(own_deleted(seen(Unknown, true), NotFound), Some(true));
        // Never seen (a wrong name, an agent started by hand): never an uninstall by absence.
        assert_eq!(own_deleted(seen(Absent, false), NotFound), Some(false));
        // Asking failed (the RBAC objects went first): the watch decides...
        assert_eq!(own_deleted(seen(Absent, true), Failed), Some(true));
        assert_eq!(own_deleted(seen(Deleting, true), Failed), Some(true));
        assert_eq!(own_deleted(seen(Known::Present, true), Failed), Some(false));
        // ...and a watch that lost the API server knows nothing: wait, then a restart.
        assert_eq!(own_deleted(seen(Unknown, true), Failed), None);
    }

    #[test]
    fn a_daemonset_seen_again_is_present_and_a_lost_watch_forgets() {
        // An orphan delete, then a re-create: present again.
        let mut s = Seen::default();
        s.note(true, false);
        s.note(false, false);
        assert_eq!(own_deleted(s, Probe::Failed), Some(true));
        s.note(true, false);
        assert_eq!(own_deleted(s, Probe::Failed), Some(false), "{s:?}");
        // Deleted, then the API server went away: the deletion is no longer known.
        s.note(false, false);
        s.lost();
        assert_eq!(own_deleted(s, Probe::Failed), None, "{s:?}");
        // Absent from the start: never an uninstall.
        let mut s = Seen::default();
        s.note(false, false);
        assert_eq!(own_deleted(s, Probe::Failed), Some(false));
        assert_eq!(own_deleted(s, Probe::NotFound), Some(false));
    }

    #[test]
    fn a_sibling_that_stays_means_a_topology_switch() {
        use Known::{Absent, Deleting, Unknown};
        use Probe::{Failed, NotFound, Present};
        assert!(sibling_stays(
            seen(Absent, false),
            Present { deleting: false }
        ));
        assert!(!sibling_stays(
            seen(Known::Present, true),
            Present { deleting: true }
        ));
        assert!(!sibling_stays(seen(Known::Present, true), NotFound));
        // Asking failed: only a watch in contact that knows it gone lets the uninstall go on.
        assert!(!sibling_stays(seen(Absent, false), Failed));
        assert!(!sibling_stays(seen(Deleting, true), Failed));
        assert!(sibling_stays(seen(Known::Present, true), Failed));
        assert!(sibling_stays(seen(Unknown, true), Failed));
        assert!(sibling_stays(seen(Unknown, false), Failed));
    }
}
