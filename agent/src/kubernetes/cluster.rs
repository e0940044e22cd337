//! What the agent's config takes from the cluster with the `kubernetes` datastore, merged into
//! the config file's (`crate::config`) every time it is read (at start, SIGHUP, and whenever one of these
//! changes — each change applied by the rules of a SIGHUP reload):
//!
//! - the pools: the `IPPool` objects (`pools/`), instead of `[[pools]]`;
//! - this node's Node (`k8s/nodes/<node>`): its labels over `node_labels` (the Node's win), so
//!   a label change moves the pools' `nodeSelector` choice; its `InternalIP`s as
//!   `routes.node_addresses` when the config sets none (the next hops peers route through);
//!   the label `routes.reflector_label` ` = "true"` makes it a route reflector;
//! - the Service CIDRs: every ServiceCIDR object's (`k8s/servicecidrs/`), added to
//!   `nat.service_cidrs` (never SNATed, always to the host stack);
//! - with `bgp.enabled`: the BGPConfigurations (`default`, `node.<node>`) and the BGPPeers
//!   that select this node, as `[bgp]` (`calix_core::bgp`).
use std::collections::BTreeMap;
use std::sync::Arc;

use calix_core::bgp::{BgpConfigurationSpec, BgpPeerSpec};
use calix_core::ipam::pool::PoolSpec;
use calix_core::store::KeyValue;
use tokio::sync::mpsc::UnboundedSender;

use super::source::{Read, Source};
use calix_datastore::follow::Follower;
use calix_datastore::kubernetes::views::{self, NodeView, ServiceCidrView};
use calix_datastore::{Datastore, DatastoreError};

/// The prefix of every IPPool's key.
pub const POOLS: &str = "pools/";
/// The prefixes of BGPConfigurations' and BGPPeers' keys.
pub const BGP_CONFIGURATIONS: &str = "bgp/configurations/";
pub const BGP_PEERS: &str = "bgp/peers/";

/// BGPConfigurations by name.
pub type BgpConfigurations = BTreeMap<String, BgpConfigurationSpec>;
/// BGPPeers by name.
pub type BgpPeers = Vec<(String, BgpPeerSpec)>;

/// The cluster's part of the config, kept current.
#[derive(Clone)]
pub struct Cluster {
    /// (IPPool name, pool).
    pools: Source<Vec<(String, PoolSpec)>>,
    node: Source<Option<NodeView>>,
    services: Source<Vec<String>>,
    read_node: Read<Option<NodeView>>,
    /// With `bgp.enabled`.
    bgp: Option<(Source<BgpConfigurations>, Source<BgpPeers>)>,
}

/// The followers that keep a [`Cluster`] current, until [`Cluster::spawn_follow`] runs them.
pub struct Followers {
    pools: Follower,
    node: Follower,
    services: Option<Follower>,
    bgp: Option<(Follower, Follower)>,
}

impl Cluster {
    /// Reads the IPPools, this node's Node, the ServiceCIDRs, and with `bgp` the BGP
    /// resources. An API server without
    /// ServiceCIDRs (before Kubernetes 1.33, or the agent not allowed to read them) leaves
    /// the config's `service_cidrs` alone, logged.
    pub async fn load(
        store: Arc<dyn Datastore>,
        node_name: &str,
        bgp: bool,
    ) -> Result<(Self, Followers), DatastoreError> {
        let (bgp, bgp_f) = if bgp {
            let (c, cf) = Source::load(
                store.clone(),
                BGP_CONFIGURATIONS,
                &read(read_configurations),
            )
            .await?;
            let (p, pf) = Source::load(store.clone(), BGP_PEERS, &read(read_peers)).await?;
            (Some((c, p)), Some((cf, pf)))
        } else {
            (None, None)
        };
        let (pools, pools_f) = Source::load(store.clone(), POOLS, &read(read_pools)).await?;
        let key = views::node_key(node_name);
        let read_node: Read<Option<NodeView>> =
            Arc::new(move |kvs| kvs.get(&key).and_then(|kv| kv.decode::<NodeView>().ok()));
        // (Every Node is listed and watched: route distribution needs them all anyway.)
        let (node, node_f) = Source::load(store.clone(), views::NODES, &read_node).await?;
        let (services, services_f) = match Source::load(
            store,
            views::SERVICE_CIDRS,
            &read(read_service_cidrs),
        )
        .await
        {
            Ok((s, f)) => (s, Some(f)),
            Err(e @ DatastoreError::Rejected { .. }) => {
                tracing::warn!(error = %e, "ServiceCIDR objects cannot be read: only nat.service_cidrs of the config file are Service addresses");
                (Source::fixed(Vec::new()), None)
            }
            Err(e) => return Err(e),
        };
        if node.current().is_none() {
            tracing::warn!(node = %node_name, "no Node object of this name (yet): node labels and addresses come from the config until it appears");
        }
        Ok((
            Self {
                pools,
                node,
                services,
                read_node,
                bgp,
            },
            Followers {
                pools: pools_f,
                node: node_f,
                services: services_f,
                bgp: bgp_f,
            },
        ))
    }

    /// The IPPools by name.
    pub fn named_pools(&self) -> Vec<(String, PoolSpec)> {
        self.pools.current()
    }

    /// This node's Node as last seen.
    pub fn node(&self) -> Option<NodeView> {
        self.node.current()
    }

    /// Every ServiceCIDR object's CIDRs, sorted, once each.
    pub fn service_cidrs(&self) -> Vec<String> {
        self.services.current()
    }

    /// The BGPConfigurations and BGPPeers (`None` without `bgp.enabled`).
    pub fn bgp(&self) -> Option<(BgpConfigurations, BgpPeers)> {
        self.bgp.as_ref().map(|(c, p)| (c.current(), p.current()))
    }

    /// Follows them all; `changed` is told what changed ("IPPool change", "Node change",
    /// "ServiceCIDR change", "BGP change").
    pub fn spawn_follow(&self, f: Followers, changed: UnboundedSender<&'static str>) {
        self.pools
            .spawn_follow(f.pools, read(read_pools), "IPPool change", changed.clone());
        self.node.spawn_follow(
            f.node,
            self.read_node.clone(),
            "Node change",
            changed.clone(),
        );
        if let Some(f) = f.services {
            self.services.spawn_follow(
                f,
                read(read_service_cidrs),
                "ServiceCIDR change",
                changed.clone(),
            );
        }
        if let (Some((c, p)), Some((cf, pf))) = (&self.bgp, f.bgp) {
            c.spawn_follow(cf, read(read_configurations), "BGP change", changed.clone());
            p.spawn_follow(pf, read(read_peers), "BGP change", changed);
        }
    }
}

fn read<T>(f: fn(&BTreeMap<String, KeyValue>) -> T) -> Read<T>
where
    T: 'static,
{
    Arc::new(f)
}

/// The pools of the IPPool objects, by name; an object whose spec is not a pool is left out,
/// logged.
fn read_pools(kvs: &BTreeMap<String, KeyValue>) -> Vec<(String, PoolSpec)> {
    kvs.values()
        .filter_map(|kv| match kv.decode::<PoolSpec>() {
            Ok(p) => Some((kv.key.strip_prefix(POOLS).unwrap_or(&kv.key).to_string(), p)),
            Err(e) => {
                tracing::error!(key = %kv.key, error = %e, "IPPool ignored: its spec is not a pool");
                None
            }
        })
        .collect()
}

/// Every ServiceCIDR object's CIDRs, sorted, once each.
fn read_service_cidrs(kvs: &BTreeMap<String, KeyValue>) -> Vec<String> {
    let mut out: Vec<String> = kvs
        .values()
        .filter_map(|kv| kv.decode::<ServiceCidrView>().ok())
        .flat_map(|s| s.cidrs)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The BGPConfigurations by name; one whose spec does not read is left out, logged.
fn read_configurations(kvs: &BTreeMap<String, KeyValue>) -> BgpConfigurations {
    kvs.values()
        .filter_map(|kv| match kv.decode::<BgpConfigurationSpec>() {
            Ok(c) => Some((
                kv.key
                    .strip_prefix(BGP_CONFIGURATIONS)
                    .unwrap_or(&kv.key)
                    .to_string(),
                c,
            )),
            Err(e) => {
                tracing::error!(key = %kv.key, error = %e, "BGPConfiguration ignored: its spec does not read");
                None
            }
        })
        .collect()
}

/// The BGPPeers by name; one whose spec does not read is left out, logged.
fn read_peers(kvs: &BTreeMap<String, KeyValue>) -> BgpPeers {
    kvs.values()
        .filter_map(|kv| match kv.decode::<BgpPeerSpec>() {
            Ok(p) => Some((kv.key.strip_prefix(BGP_PEERS).unwrap_or(&kv.key).to_string(), p)),
            Err(e) => {
                tracing::error!(key = %kv.key, error = %e, "BGPPeer ignored: its spec does not read");
                None
            }
        })
        .collect()
}
