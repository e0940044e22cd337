//! The DaemonSet that runs this agent (`--owner-daemonset <namespace>/<name>`, the chart sets
//! it): when the agent is told to stop, was it restarted (a rolling update, `kubectl rollout
//! restart`, a node drain) or is calix being uninstalled (`helm uninstall` deletes the
//! DaemonSet, then the garbage collector its pods)?
//!
//! A restart keeps everything: the pinned programs carry every flow until the next agent takes
//! over. An uninstall takes calix off the node (`crate::uninstall`). The two look the same from
//! inside the pod (SIGTERM), so the agent follows its DaemonSet from the start: `helm
//! uninstall` deletes the DaemonSet before its RBAC objects and ServiceAccount, so by the time
//! the agent's SIGTERM comes the watch has seen the deletion even if the agent may no longer
//! ask. At SIGTERM it also asks once: a DaemonSet that is there and not being deleted means a
//! restart, whatever the watch saw.
//!
//! Only a deletion seen after the DaemonSet was seen present counts: an agent started by hand
//! with a wrong name never uninstalls itself.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};

/// How long the agent asks for its DaemonSet at SIGTERM.
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

impl std::str::FromStr for OwnerRef {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (ns, name) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: expected <namespace>/<daemonset name>"))?;
        let valid = |v: &str| {
            !v.is_empty()
                && v.len() <= 253
                && v.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        };
        if !valid(ns) || !valid(name) {
            return Err(format!(
                "{s:?}: a namespace and a name of lowercase letters, digits, '-' and '.'"
            ));
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

/// What the agent knows of its DaemonSet from the watch.
#[derive(Debug, Default)]
struct Seen {
    present: AtomicBool,
    deleted: AtomicBool,
}

/// The verdict at SIGTERM from what the watch saw and the probe's answer; `None`: ask the
/// watch again (after [`WATCH_WAIT`], `deleted` decides).
pub fn verdict(ever_present: bool, deleted: bool, probe: Probe) -> Option<Stop> {
    match probe {
        Probe::Present { deleting: true } => Some(Stop::Uninstall),
        Probe::Present { deleting: false } => Some(Stop::Restart),
        Probe::NotFound if ever_present => Some(Stop::Uninstall),
        Probe::NotFound => Some(Stop::Restart),
        Probe::Failed if deleted => Some(Stop::Uninstall),
        Probe::Failed => None,
    }
}

/// The DaemonSet followed. See the module doc.
pub struct Owner {
    owner: OwnerRef,
    api: Api<DaemonSet>,
    seen: Arc<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl Owner {
    /// Follows `owner` from now on (a task of its own).
    pub fn spawn(client: kube::Client, owner: OwnerRef) -> Self {
        let api: Api<DaemonSet> = Api::namespaced(client, &owner.namespace);
        let seen = Arc::new(Seen::default());
        let task = tokio::spawn(follow(api.clone(), owner.name.clone(), seen.clone()));
        Self {
            owner,
            api,
            seen,
            task,
        }
    }

    /// Called at SIGTERM: restart or uninstall.
    pub async fn on_stop(&self) -> Stop {
        let probe = match tokio::time::timeout(PROBE_TIMEOUT, self.api.get_opt(&self.owner.name))
            .await
        {
            Ok(Ok(Some(ds))) => Probe::Present {
                deleting: ds.metadata.deletion_timestamp.is_some(),
            },
            Ok(Ok(None)) => Probe::NotFound,
            Ok(Err(e)) => {
                tracing::info!(error = %e, daemonset = %self.owner.name, "cannot ask for the agent's DaemonSet at stop");
                Probe::Failed
            }
            Err(_) => Probe::Failed,
        };
        let present = || self.seen.present.load(Ordering::SeqCst);
        let deleted = || self.seen.deleted.load(Ordering::SeqCst);
        if let Some(stop) = verdict(present(), deleted(), probe) {
            self.log(stop, probe);
            return stop;
        }
        let deadline = tokio::time::Instant::now() + WATCH_WAIT;
        while tokio::time::Instant::now() < deadline && !deleted() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let stop = if deleted() {
            Stop::Uninstall
        } else {
            tracing::warn!(daemonset = %self.owner.name,
                "cannot tell whether the agent's DaemonSet is being deleted: treated as a restart (nothing removed; `calix-agent --uninstall --all` cleans a node by hand)");
            Stop::Restart
        };
        self.log(stop, probe);
        stop
    }

    fn log(&self, stop: Stop, probe: Probe) {
        tracing::info!(daemonset = %format!("{}/{}", self.owner.namespace, self.owner.name),
        ?probe, watch_saw_deletion = self.seen.deleted.load(Ordering::SeqCst),
        "stopping: {}", match stop {
            Stop::Restart => "a restart (everything stays for the next agent)",
            Stop::Uninstall => "the DaemonSet is deleted: calix is being uninstalled from this node",
        });
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Lists then watches the DaemonSet named `name`, again after every end or failure.
async fn follow(api: Api<DaemonSet>, name: String, seen: Arc<Seen>) {
    let fields = format!("metadata.name={name}");
    loop {
        if let Err(e) = follow_once(&api, &fields, &seen).await {
            tracing::debug!(error = %e, daemonset = %name, "the agent's DaemonSet: watching again");
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn follow_once(api: &Api<DaemonSet>, fields: &str, seen: &Seen) -> Result<(), kube::Error> {
    let list = api.list(&ListParams::default().fields(fields)).await?;
    let present = !list.items.is_empty();
    note(seen, present, list.items.iter().any(deleting));
    let rv = list.metadata.resource_version.unwrap_or_default();
    let params = WatchParams::default().fields(fields).timeout(290);
    let mut events = api.watch(&params, &rv).await?.boxed();
    while let Some(event) = events.try_next().await? {
        match event {
            WatchEvent::Added(ds) | WatchEvent::Modified(ds) => note(seen, true, deleting(&ds)),
            WatchEvent::Deleted(_) => note(seen, false, false),
            WatchEvent::Bookmark(_) => {}
            WatchEvent::Error(e) => return Err(kube::Error::Api(e)),
        }
    }
    Ok(())
}

fn deleting(ds: &DaemonSet) -> bool {
    ds.metadata.deletion_timestamp.is_some()
}

/// Records a sighting: present (and maybe being deleted), or absent.
fn note(seen: &Seen, present: bool, deleting: bool) {
    if present && !deleting {
        seen.present.store(true, Ordering::SeqCst);
    } else if seen.present.load(Ordering::SeqCst) || deleting {
        // Gone (or going) after it was seen: a deletion.
        seen.deleted.store(true, Ordering::SeqCst);
    }
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
            let e = bad.parse::<OwnerRef>().expect_err(bad);
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn a_daemonset_that_is_there_means_a_restart_and_one_gone_after_it_was_seen_an_uninstall() {
        use Probe::*;
        use Stop::*;
        // A rolling update: the DaemonSet is there.
        assert_eq!(
            verdict(true, false, Present { deleting: false }),
            Some(Restart)
        );
        // Even if an old watch event said otherwise, what is there now wins.
        assert_eq!(
            verdict(true, true, Present { deleting: false }),
            Some(Restart)
        );
        // Foreground deletion: there, but being deleted.
        assert_eq!(
            verdict(true, false, Present { deleting: true }),
            Some(Uninstall)
        );
        // Background deletion (helm's default): gone.
        assert_eq!(verdict(true, true, NotFound), Some(Uninstall));
        assert_eq!(verdict(true, false, NotFound), Some(Uninstall));
        // Never seen (a wrong name, an agent started by hand): never an uninstall by absence.
        assert_eq!(verdict(false, false, NotFound), Some(Restart));
        // Asking failed (the RBAC objects went first): the watch decides...
        assert_eq!(verdict(true, true, Failed), Some(Uninstall));
        // ...after waiting for it.
        assert_eq!(verdict(true, false, Failed), None);
    }

    #[test]
    fn only_a_deletion_seen_after_a_sighting_counts() {
        let seen = Seen::default();
        note(&seen, false, false);
        assert!(
            !seen.deleted.load(Ordering::SeqCst),
            "absent from the start"
        );
        note(&seen, true, false);
        assert!(!seen.deleted.load(Ordering::SeqCst));
        note(&seen, false, false);
        assert!(
            seen.deleted.load(Ordering::SeqCst),
            "deleted after it was seen"
        );
        let seen = Seen::default();
        note(&seen, true, true);
        assert!(seen.deleted.load(Ordering::SeqCst), "seen being deleted");
    }
}
