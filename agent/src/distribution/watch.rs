//! The datastore side of route distribution: each part (blocks, nodes) listed, then followed.
use std::sync::Arc;
use std::time::Duration;

use calix_core::routes::view::Part;
use calix_core::store::{KeyValue, WatchEvent};
use futures::StreamExt;
use tokio::sync::mpsc;

use super::nodes::NodeSource;
use calix_datastore::{Datastore, DatastoreError};

pub(crate) enum ViewInput {
    Listed(Part, Vec<KeyValue>),
    Event(WatchEvent),
}

/// Lists one part of the datastore, then follows it: a compacted watch lists again, an
/// ended one resumes from the last revision seen. The nodes come from `nodes`.
pub(crate) async fn watch_part(
    store: Arc<dyn Datastore>,
    part: Part,
    nodes: Arc<dyn NodeSource>,
    tx: mpsc::Sender<ViewInput>,
) {
    let prefix = match part {
        Part::Blocks => part.prefix(),
        Part::Nodes => nodes.prefix(),
    };
    let mut backoff = Duration::from_millis(100);
    'list: loop {
        let (kvs, revision) = match store.list_with_revision(prefix).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(prefix, error = %e, "routes: cannot list the datastore; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if tx
            .send(ViewInput::Listed(part, nodes.listed(kvs)))
            .await
            .is_err()
        {
            return;
        }
        let mut after = revision;
        loop {
            let mut stream = match store.watch(prefix, after).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(prefix, error = %e, "routes: cannot watch the datastore; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            while let Some(item) = stream.next().await {
                match item {
                    Ok(ev) => {
                        after = ev.revision();
                        let Some(ev) = nodes.event(ev) else {
                            continue;
                        };
                        if tx.send(ViewInput::Event(ev)).await.is_err() {
                            return;
                        }
                    }
                    Err(DatastoreError::Compacted { .. }) => continue 'list,
                    Err(e) => {
                        tracing::debug!(prefix, error = %e, "routes: datastore watch ended; resuming");
                        break;
                    }
                }
            }
            tokio::time::sleep(backoff).await;
        }
    }
}
