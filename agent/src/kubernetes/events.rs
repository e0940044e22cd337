//! Notices as Kubernetes Events (core/v1), posted by a task of their own so a request path
//! never waits for the API server. A node's notices are Events on its Node (namespace
//! `default`, as the kubelet's), a pod's on the Pod. The same notice (reason, subject and
//! message) is posted at most once per [`EVERY`]; the next one says how many were held back.
//! At most [`BURST`] Events go out per [`EVERY`] in all, and a queue that is full drops
//! (logged: every notice is logged anyway), so a storm of failures cannot flood the API
//! server.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, PostParams};
use tokio::sync::mpsc;

use crate::notice::{Notice, Notices, Severity, Subject};

/// At most one Event per notice this often.
pub const EVERY: Duration = Duration::from_secs(60);
/// At most this many Events per [`EVERY`] in all.
pub const BURST: usize = 60;
/// The component Events name as their source.
pub const COMPONENT: &str = "calix-agent";
/// Longest message posted (the API server refuses more than 1 KiB in a core Event's note).
const MAX_MESSAGE: usize = 1000;

/// Posts notices as Events.
pub struct EventRecorder {
    tx: mpsc::Sender<Notice>,
}

impl EventRecorder {
    /// Starts the posting task for node `node`.
    pub fn spawn(client: kube::Client, node: String) -> Self {
        let (tx, mut rx) = mpsc::channel::<Notice>(256);
        tokio::spawn(async move {
            let mut last: HashMap<(&'static str, Subject, String), (Instant, u32)> = HashMap::new();
            let mut posted: std::collections::VecDeque<Instant> = Default::default();
            while let Some(n) = rx.recv().await {
                let now = Instant::now();
                last.retain(|_, (at, held)| now.duration_since(*at) < EVERY || *held > 0);
                while posted
                    .front()
                    .is_some_and(|t| now.duration_since(*t) >= EVERY)
                {
                    posted.pop_front();
                }
                let key = (n.reason, n.subject.clone(), n.message.clone());
                let held = match last.get_mut(&key) {
                    Some((at, held)) if now.duration_since(*at) < EVERY => {
                        *held += 1;
                        continue;
                    }
                    Some((_, held)) => std::mem::take(held),
                    None => 0,
                };
                if posted.len() >= BURST {
                    tracing::warn!(
                        reason = n.reason,
                        "Event not posted: {BURST} in the last {EVERY:?}"
                    );
                    continue;
                }
                last.insert(key, (now, 0));
                posted.push_back(now);
                post(&client, &node, &n, held).await;
            }
        });
        Self { tx }
    }
}

impl Notices for EventRecorder {
    fn notice(&self, n: Notice) {
        if let Err(e) = self.tx.try_send(n) {
            tracing::warn!(error = %e, "Event not posted: the queue is full");
        }
    }
}

/// The Event for notice `n` of node `node` (`held`: how many of the same were held back).
pub fn event(node: &str, n: &Notice, held: u32) -> Result<Event, serde_json::Error> {
    let (namespace, involved) = match &n.subject {
        Subject::Node => (
            "default".to_string(),
            // (The kubelet's Node events carry the node's name as its UID; kubectl describe
            // node finds them by it.)
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}),
        ),
        Subject::Pod { namespace, name } => (
            namespace.clone(),
            serde_json::json!({"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name}),
        ),
        Subject::Service { namespace, name } => (
            namespace.clone(),
            serde_json::json!({"apiVersion": "v1", "kind": "Service", "namespace": namespace, "name": name}),
        ),
    };
    // A Service's Event is named by what it says: every node computes the same, and the
    // first agent's post is the one Event (the others meet AlreadyExists).
    let metadata = match &n.subject {
        Subject::Service { name, .. } => {
            serde_json::json!({"name": shared_name(name, n), "namespace": namespace})
        }
        _ => serde_json::json!({"generateName": format!("{node}.calix."), "namespace": namespace}),
    };
    let mut message = n.message.clone();
    if held > 0 {
        message.push_str(&format!(" ({held} more since the last Event)"));
    }
    if message.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    serde_json::from_value(serde_json::json!({
        "metadata": metadata,
        "involvedObject": involved,
        "reason": n.reason,
        "message": message,
        "type": match n.severity { Severity::Warning => "Warning", Severity::Normal => "Normal" },
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": "calix.dev/agent",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1 + held,
    }))
}

/// `<service>.calix.<hash of reason and message>`: the same on every node (FNV-1a, fixed
/// across builds and machines).
fn shared_name(service: &str, n: &Notice) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in n.reason.bytes().chain([0]).chain(n.message.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{service}.calix.{h:016x}")
}

async fn post(client: &kube::Client, node: &str, n: &Notice, held: u32) {
    let ev = match event(node, n, held) {
        Ok(ev) => ev,
        Err(e) => {
            tracing::warn!(error = %e, reason = n.reason, "Event not built");
            return;
        }
    };
    let ns = ev.metadata.namespace.clone().unwrap_or_default();
    let api: Api<Event> = Api::namespaced(client.clone(), &ns);
    let posted = tokio::time::timeout(
        Duration::from_secs(10),
        api.create(&PostParams::default(), &ev),
    )
    .await;
    match posted {
        Ok(Ok(_)) => tracing::debug!(reason = n.reason, "Event posted"),
        Ok(Err(kube::Error::Api(e))) if e.code == 409 => {
            tracing::debug!(reason = n.reason, "Event posted already (by another node)")
        }
        Ok(Err(e)) => tracing::warn!(error = %e, reason = n.reason, "Event not posted"),
        Err(_) => tracing::warn!(reason = n.reason, "Event not posted: no answer within 10 s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_become_events_on_their_subject() {
        let n = Notice {
            severity: Severity::Warning,
            reason: "IPAMExhausted",
            subject: Subject::Pod {
                namespace: "shop".into(),
                name: "web-0".into(),
            },
            message: "x".repeat(5000),
        };
        let ev = event("node-a", &n, 3).expect("event");
        assert_eq!(ev.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(ev.involved_object.kind.as_deref(), Some("Pod"));
        assert_eq!(ev.involved_object.name.as_deref(), Some("web-0"));
        assert_eq!(ev.type_.as_deref(), Some("Warning"));
        assert_eq!(ev.count, Some(4));
        assert!(ev
            .message
            .as_deref()
            .is_some_and(|m| m.len() <= MAX_MESSAGE));
        let node = Notice {
            subject: Subject::Node,
            severity: Severity::Normal,
            ..n
        };
        let svc = Notice {
            subject: Subject::Service {
                namespace: "shop".into(),
                name: "web".into(),
            },
            message: "External address 192.0.2.9 is not programmed".into(),
            ..node.clone()
        };
        let (a, b) = (
            event("node-a", &svc, 0).expect("event"),
            event("node-b", &svc, 0).expect("event"),
        );
        assert_eq!(a.involved_object.kind.as_deref(), Some("Service"));
        assert_eq!(a.metadata.namespace.as_deref(), Some("shop"));
        assert!(a.metadata.generate_name.is_none());
        let name = a.metadata.name.clone().expect("a fixed name");
        assert!(name.starts_with("web.calix."), "{name}");
        assert_eq!(
            b.metadata.name,
            Some(name.clone()),
            "every node the same name"
        );
        let other = Notice {
            message: "another complaint".into(),
            ..svc
        };
        assert_ne!(
            event("node-a", &other, 0).expect("event").metadata.name,
            Some(name)
        );
        let ev = event("node-a", &node, 0).expect("event");
        assert_eq!(ev.metadata.namespace.as_deref(), Some("default"));
        assert_eq!(ev.involved_object.kind.as_deref(), Some("Node"));
        assert_eq!(ev.type_.as_deref(), Some("Normal"));
    }
}
