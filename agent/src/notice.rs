//! What an operator must see beyond the agent's log: IPAM exhausted, a pool change refused, a
//! gone pod's endpoint cleaned up. Every notice is logged; with the `kubernetes` datastore it
//! also becomes a Kubernetes Event (`crate::kubernetes::events`), so `kubectl get events` and
//! `kubectl describe node|pod` show it.
use std::sync::{Arc, RwLock};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Normal,
    Warning,
}

/// What a notice is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Subject {
    /// This node.
    Node,
    Pod {
        namespace: String,
        name: String,
    },
    /// A Service: the same on every node, so its Event is the cluster's one (every agent
    /// posts it under the same name; the first one's stays).
    Service {
        namespace: String,
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub severity: Severity,
    /// CamelCase, e.g. `IPAMExhausted`.
    pub reason: &'static str,
    pub subject: Subject,
    pub message: String,
}

/// Where notices go (besides the log).
pub trait Notices: Send + Sync {
    /// Must not block: called from request paths.
    fn notice(&self, n: Notice);
}

/// Notices as a test sees them.
#[cfg(test)]
#[derive(Default)]
pub struct Recorded(pub std::sync::Mutex<Vec<Notice>>);

#[cfg(test)]
impl Notices for Recorded {
    fn notice(&self, n: Notice) {
        self.0.lock().expect("lock").push(n);
    }
}

/// Notices go to the log only.
pub struct LogOnly;

impl Notices for LogOnly {
    fn notice(&self, _n: Notice) {}
}

/// The agent's notices: logged, then handed to the sink (set once the cluster is known).
pub struct Notifier(RwLock<Arc<dyn Notices>>);

impl Default for Notifier {
    fn default() -> Self {
        Self(RwLock::new(Arc::new(LogOnly)))
    }
}

impl Notifier {
    pub fn set(&self, sink: Arc<dyn Notices>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = sink;
    }

    pub fn notice(&self, n: Notice) {
        match n.severity {
            Severity::Warning => {
                tracing::warn!(reason = n.reason, subject = ?n.subject, message = %n.message, "notice")
            }
            Severity::Normal => {
                tracing::info!(reason = n.reason, subject = ?n.subject, message = %n.message, "notice")
            }
        }
        let sink = self.0.read().unwrap_or_else(|p| p.into_inner()).clone();
        sink.notice(n);
    }

    pub fn warning(&self, reason: &'static str, subject: Subject, message: String) {
        self.notice(Notice {
            severity: Severity::Warning,
            reason,
            subject,
            message,
        });
    }

    pub fn normal(&self, reason: &'static str, subject: Subject, message: String) {
        self.notice(Notice {
            severity: Severity::Normal,
            reason,
            subject,
            message,
        });
    }
}
