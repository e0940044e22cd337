//! One endpoint against the kernel: its host veth (present, the same link, calix's, up), its
//! settings, its host routes, then the dataplane's filters and map entries; repaired where
//! it drifted, and each pass's bookkeeping of health, failures and retries.
use std::time::Instant;

use calix_kernel::host::HostKernel;
use calix_kernel::netlink::NetlinkError;
use calix_kernel::pod::{host_settings, HostRoute};

use super::{kernel_err, sync_settings, Health, Pass, ReconcileError, Reconciler, Repair, State};
use calix_dataplane::{Attached, EndpointSpec};

impl<K: HostKernel> Reconciler<K> {
    pub(super) fn check_all(&mut self, keys: &[String], now: Instant) -> Pass {
        let mut pass = Pass::default();
        // One dump of calix's routes for the whole pass.
        let routes = match self.kernel.routes() {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the host routes; route checks skipped this pass");
                None
            }
        };
        for key in keys {
            let Some(spec) = self.desired.get(key).cloned() else {
                continue;
            };
            pass.checked += 1;
            let outcome = self.check(&spec, routes.as_deref());
            let state = self.state.entry(key.clone()).or_insert(State {
                health: Health::Ok,
                attached: None,
                failures: 0,
                retry_at: None,
            });
            match outcome {
                Ok((health, repairs, attached)) => {
                    if health != state.health && health != Health::Ok {
                        tracing::warn!(endpoint = %key, host_ifname = %spec.host_ifname,
                            state = %health, "endpoint not in its desired state");
                    }
                    if let Some(a) = attached {
                        state.attached = Some(a);
                    }
                    if health == Health::Ok {
                        state.failures = 0;
                        state.retry_at = None;
                    } else {
                        // Watched for its interface coming back, with backoff.
                        state.failures += 1;
                        state.retry_at = Some(now + self.backoff.after(state.failures));
                        state.attached = None;
                    }
                    state.health = health;
                    for r in repairs {
                        tracing::warn!(endpoint = %key, host_ifname = %spec.host_ifname,
                            kind = r.kind, what = %r.what, "repaired");
                        *self.repairs.entry(r.kind).or_default() += 1;
                        pass.repairs.push((key.clone(), r));
                    }
                }
                Err(e) => {
                    state.failures += 1;
                    let wait = self.backoff.after(state.failures);
                    state.retry_at = Some(now + wait);
                    let error = calix_log::error_chain(&e);
                    tracing::warn!(endpoint = %key, host_ifname = %spec.host_ifname,
                        %error, attempts = state.failures, retry_in = ?wait, "cannot apply endpoint");
                    state.health = Health::Failing { error };
                }
            }
            if self.state.get(key).is_some_and(|s| s.health != Health::Ok) {
                pass.unhealthy += 1;
            }
        }
        pass
    }

    /// One endpoint: its health, the repairs made, and the attach result when it was
    /// (re)programmed.
    pub(super) fn check(
        &mut self,
        spec: &EndpointSpec,
        routes: Option<&[HostRoute]>,
    ) -> Result<(Health, Vec<Repair>, Option<Attached>), ReconcileError> {
        let ifname = spec.host_ifname.as_str();
        let Some(link) = self
            .kernel
            .link(ifname)
            .map_err(kernel_err(format!("reading link {ifname}")))?
        else {
            return Ok((Health::InterfaceMissing, Vec::new(), None));
        };
        if let Some(want) = spec.host_ifindex {
            if want != link.index {
                return Ok((Health::Replaced { found: link.index }, Vec::new(), None));
            }
        }
        if let Some(found) = not_its_veth(spec, &link) {
            return Ok((Health::NotCalix { found }, Vec::new(), None));
        }
        let mut repairs = Vec::new();
        if !link.up {
            self.kernel
                .set_up(link.index)
                .map_err(kernel_err(format!("setting {ifname} up")))?;
            repairs.push(Repair {
                kind: "link_up",
                what: format!("{ifname} was down"),
            });
        }
        sync_settings(
            &mut self.kernel,
            host_settings(ifname, spec.ipv4.is_some(), spec.ipv6.is_some()),
            &mut repairs,
        )?;
        if let Some(routes) = routes {
            for want in HostRoute::of_pod(link.index, spec.ipv4, spec.ipv6) {
                if routes.contains(&want) {
                    continue;
                }
                // calix's route to this address through another interface is stale (its
                // interface was replaced); ours takes its place.
                for stale in routes.iter().filter(|r| r.dst == want.dst) {
                    self.kernel.delete_route(stale).map_err(kernel_err(format!(
                        "deleting {} dev {}",
                        stale.dst, stale.oif
                    )))?;
                }
                match self.kernel.add_route(&want) {
                    Ok(()) => repairs.push(Repair {
                        kind: "route",
                        what: format!("{} dev {ifname} was missing", want.dst),
                    }),
                    // Added meanwhile (by a concurrent ADD of the plugin): nothing to repair.
                    Err(NetlinkError::RouteExists { .. }) => {}
                    Err(e) => {
                        return Err(kernel_err(format!("adding {} dev {ifname}", want.dst))(e));
                    }
                }
            }
        }
        let drift = self.dataplane.verify(spec, &mut self.kernel)?;
        let mut attached = None;
        if !drift.is_empty() {
            attached = Some(self.dataplane.attach(spec)?);
            repairs.extend(drift.iter().map(|d| Repair {
                kind: d.kind(),
                what: d.to_string(),
            }));
        } else if self
            .state
            .get(&spec.key)
            .is_none_or(|s| s.attached.is_none())
        {
            // Adopted at start, or back after a failure: program it.
            attached = Some(self.dataplane.attach(spec)?);
        }
        Ok((Health::Ok, repairs, attached))
    }
}

/// Why `link` (named as `spec` says) is not the host veth calix made for `spec`'s endpoint;
/// `None` when it is ([`calix_kernel::pod::is_host_veth_of`]).
pub(super) fn not_its_veth(spec: &EndpointSpec, link: &calix_kernel::host::Link) -> Option<String> {
    let (container_id, ifname) = spec.key.split_once('/').unwrap_or((spec.key.as_str(), ""));
    let name = spec.host_ifname.as_str();
    let alias = link.alias.as_deref();
    if calix_kernel::pod::is_host_veth_of(name, alias, container_id, ifname) {
        return None;
    }
    Some(if !name.starts_with(calix_kernel::pod::HOST_VETH_PREFIX) {
        format!("not a {}… link", calix_kernel::pod::HOST_VETH_PREFIX)
    } else {
        match alias {
            Some(a) => format!("its owner alias is {a:?}"),
            None => "it has no owner alias".to_string(),
        }
    })
}
