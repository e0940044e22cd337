//! The pools of a `kubernetes` datastore: `IPPool` objects (keys `pools/<name>`, each one's
//! spec a [`PoolConfig`]) instead of the config file's `[[pools]]`. Read when the agent starts,
//! then followed ([`crate::datastore::follow`]): every change asks the agent to apply the pools
//! again, with the rules of a SIGHUP reload (the whole set is validated like a config file;
//! a pool cannot shrink or go under live addresses — such a change waits until it is safe).
use std::sync::{Arc, Mutex};

use crate::config::PoolConfig;
use crate::datastore::follow::Follower;
use crate::datastore::{Datastore, DatastoreError, KeyValue};

/// The prefix of every IPPool's key.
pub const PREFIX: &str = "pools/";

/// The IPPools as last seen, shared with the config reader.
#[derive(Clone, Default)]
pub struct IpPools(Arc<Mutex<Vec<PoolConfig>>>);

impl IpPools {
    /// The pools now, in the order of their names.
    pub fn current(&self) -> Vec<PoolConfig> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, pools: Vec<PoolConfig>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = pools;
    }

    /// Reads every IPPool: the pools, and the follower that keeps them current.
    pub async fn load(store: Arc<dyn Datastore>) -> Result<(Self, Follower), DatastoreError> {
        let follower = Follower::start(store, PREFIX).await?;
        let pools = Self::default();
        pools.set(decode(follower.known().values()));
        Ok((pools, follower))
    }

    /// Follows the IPPools for as long as the agent runs; after each change `changed` is told.
    pub fn spawn_follow(
        &self,
        mut follower: Follower,
        changed: tokio::sync::mpsc::UnboundedSender<()>,
    ) {
        let pools = self.clone();
        tokio::spawn(async move {
            loop {
                let event = follower.next().await;
                tracing::info!(key = %event.key(), revision = event.revision(), "IPPool changed");
                pools.set(decode(follower.known().values()));
                if changed.send(()).is_err() {
                    return;
                }
            }
        });
    }
}

/// The pools of `kvs`; an object whose spec is not a pool is left out, logged.
pub fn decode<'a>(kvs: impl Iterator<Item = &'a KeyValue>) -> Vec<PoolConfig> {
    kvs.filter_map(|kv| match kv.decode::<PoolConfig>() {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::error!(key = %kv.key, error = %e, "IPPool ignored: its spec is not a pool");
            None
        }
    })
    .collect()
}
