//! The endpoints' map entries: what [`super::EbpfDataplane`] writes for an endpoint (its slot,
//! its endpoint entry and direct-mapped bucket, its local-delivery entries), removes with it,
//! checks against what it wrote, and sweeps after the initial sync. All of it through
//! [`EndpointMaps`], so the unit tests run it on in-memory maps.
use std::collections::HashMap as StdHashMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use calix_common::{
    direct_bucket, DirectEndpoint, EndpointInfo, LocalEndpoint, EP_HAS_V4, EP_HAS_V6,
    MAX_ENDPOINTS, STACK_MARKED,
};

use super::maps::EndpointMaps;
use crate::nat::NatSettings;
use crate::pins;
use crate::slots::Slots;
use crate::{DataplaneError, Drift, EndpointSpec};

/// One endpoint as this process programmed it.
#[derive(Debug, Clone)]
pub struct Programmed {
    /// The host veth's name and the link it named when programmed.
    pub ifname: String,
    pub ifindex: u32,
    pub ipv4: Option<Ipv4Addr>,
    pub ipv6: Option<Ipv6Addr>,
    /// Its pod (NetworkPolicy).
    pub pod: Option<calix_core::policy::model::PodKey>,
}

/// What an endpoint programmed during the initial sync inherits: the stack-flow marks of an
/// older layout (by ifindex, into a new slot), and a mark when a flow in the stack-flow table
/// names one of its addresses (flows recorded by a build from before the marks, or carried
/// from an older layout): the fast path must check those flows.
pub struct Inherited {
    pub marks: pins::OldMarks,
    /// The pod addresses the stack-flow table's keys name (IPv4 in the first 4 bytes).
    pub flow_addrs: std::collections::HashSet<[u8; 16]>,
}

impl Inherited {
    /// (`STACK_EPS_MAP`, `STACK_OVERFLOW_MAP`) values for the endpoint `ep` on `ifindex`.
    fn for_endpoint(&self, ifindex: u32, ep: &EndpointSpec) -> (u32, u32) {
        let old = self.marks.get(ifindex);
        let mut v4 = [0u8; 16];
        let named = ep.ipv4.is_some_and(|a| {
            v4[..4].copy_from_slice(&a.octets());
            self.flow_addrs.contains(&v4)
        }) || ep
            .ipv6
            .is_some_and(|a| self.flow_addrs.contains(&a.octets()));
        let marked = if old.is_some() || named {
            STACK_MARKED
        } else {
            0
        };
        (marked, old.unwrap_or(0))
    }
}

/// The endpoints' entries in the maps, and what this process programmed.
pub struct Endpoints {
    maps: EndpointMaps,
    /// Which slot each endpoint (host veth ifindex) has, as the endpoint map says.
    slots: Slots,
    /// Until the initial sync is over: the marks an endpoint inherits when it gets its slot.
    inherited: Option<Inherited>,
    /// Endpoint key ("containerID/ifname") → what was programmed for it.
    programmed: StdHashMap<String, Programmed>,
    /// SNAT (`None`: off): which endpoints' entries carry `EP_NAT_OUTGOING`.
    nat: Option<NatSettings>,
}

impl Endpoints {
    /// Over `maps` as they are pinned: the slots as the endpoint map has them (an agent restart
    /// keeps them, and the counters with them); an entry whose slot is out of range or taken
    /// twice goes (its endpoint gets a slot again when it is programmed).
    pub fn restore(
        mut maps: EndpointMaps,
        inherited: Option<Inherited>,
        nat: Option<NatSettings>,
    ) -> Self {
        let (slots, rejected) = Slots::restore(
            MAX_ENDPOINTS,
            maps.endpoints
                .entries()
                .into_iter()
                .map(|(i, e)| (i, e.slot)),
        );
        for i in rejected {
            tracing::warn!(ifindex = i, "endpoint entry with a bad slot removed");
            maps.endpoints.remove(&i);
        }
        Self {
            maps,
            slots,
            inherited,
            programmed: StdHashMap::new(),
            nat,
        }
    }

    /// The map part of [`crate::Dataplane::attach`] for `ep` on link `idx`: what was programmed
    /// before on this interface name (an older sandbox of a recreated pod, or this endpoint
    /// before a restart of its veth) is forgotten: entries of another link are stale; on this
    /// very link only the addresses this endpoint doesn't have. Then the entries are written
    /// and `programs` runs (entries before programs: the programs must find the endpoint from
    /// the first packet). When either fails the entries written go again.
    pub fn attach(
        &mut self,
        ep: &EndpointSpec,
        idx: u32,
        programs: impl FnOnce() -> Result<(), DataplaneError>,
    ) -> Result<(), DataplaneError> {
        let ifname = ep.host_ifname.as_str();
        let earlier: Vec<String> = self
            .programmed
            .iter()
            .filter(|(k, p)| *k == &ep.key || p.ifname == ifname)
            .map(|(k, _)| k.clone())
            .collect();
        for k in earlier {
            if let Some(old) = self.programmed.remove(&k) {
                if old.ifindex == idx {
                    self.forget_addresses(&old, ep.ipv4, ep.ipv6);
                } else {
                    self.forget_entries(&old);
                }
            }
        }
        let p = Programmed {
            ifname: ifname.to_string(),
            ifindex: idx,
            ipv4: ep.ipv4,
            ipv6: ep.ipv6,
            pod: ep.pod.clone(),
        };
        if let Err(e) = self.program_entries(idx, ep).and_then(|()| programs()) {
            self.forget_entries(&p);
            return Err(e);
        }
        self.programmed.insert(ep.key.clone(), p);
        Ok(())
    }

    /// The map part of [`crate::Dataplane::detach`]: `Some(what was programmed)` when its
    /// entries went and its programs should too; `None` when the endpoint is unknown, or when
    /// another endpoint runs on its very link now (that one keeps the link's entries and
    /// programs; only this one's own addresses go).
    pub fn detach(&mut self, key: &str) -> Option<Programmed> {
        let p = self.programmed.remove(key)?;
        if let Some(other) = self
            .programmed
            .values()
            .find(|o| o.ifindex == p.ifindex)
            .cloned()
        {
            self.forget_addresses(&p, other.ipv4, other.ipv6);
            return None;
        }
        self.forget_entries(&p);
        Some(p)
    }

    /// How the maps differ from what [`Self::attach`] wrote for `ep` on link `idx`.
    pub fn drift(&self, ep: &EndpointSpec, idx: u32) -> Vec<Drift> {
        let mut drift = Vec::new();
        let slot = self.slots.get(idx);
        let want = slot.map(|s| self.endpoint_info(ep, s));
        // Its bucket holds it, or another live endpoint (then the table alone does).
        let bucket_ok = self.maps.direct.get(&direct_bucket(idx)).is_ok_and(|d| {
            let d = d.unwrap_or_default();
            match d.ifindex {
                i if i == idx => Some(d.info) == want,
                0 => false,
                other => self.slots.get(other).is_some(),
            }
        });
        if want.is_none() || self.maps.endpoints.get(&idx).ok().flatten() != want || !bucket_ok {
            drift.push(Drift::EndpointEntry);
        }
        if ep.mac.is_some() {
            let points_here = |l: Option<LocalEndpoint>| {
                l.is_some_and(|l| l.ifindex == idx && Some(l.slot) == slot && Some(l.mac) == ep.mac)
            };
            if let Some(v4) = ep.ipv4 {
                if !points_here(self.maps.local_v4.get(&v4.octets()).ok().flatten()) {
                    drift.push(Drift::LocalEntry(v4.into()));
                }
            }
            if let Some(v6) = ep.ipv6 {
                if !points_here(self.maps.local_v6.get(&v6.octets()).ok().flatten()) {
                    drift.push(Drift::LocalEntry(v6.into()));
                }
            }
        }
        drift
    }

    /// After the initial sync: removes the entries, buckets, slots, budget counts and
    /// local-delivery entries of interfaces no programmed endpoint owns (a DEL while the agent
    /// was away); an endpoint a stale one kept out of its bucket moves in. Returns how many
    /// went.
    pub fn sweep(&mut self) -> usize {
        let known_idx: std::collections::HashSet<u32> =
            self.programmed.values().map(|p| p.ifindex).collect();
        // Map entries of interfaces no endpoint owns (a DEL while the agent was away).
        let stale: Vec<u32> = self
            .maps
            .endpoints
            .keys()
            .into_iter()
            .filter(|i| !known_idx.contains(i))
            .collect();
        for i in &stale {
            self.maps.endpoints.remove(i);
        }
        // Direct-mapped buckets of interfaces no endpoint owns.
        let mut stale_buckets = 0usize;
        for bucket in 0..MAX_ENDPOINTS {
            let held = self.bucket(bucket).map_or(0, |d| d.ifindex);
            if held != 0 && !known_idx.contains(&held) {
                let _ = self.maps.direct.set(bucket, DirectEndpoint::default());
                stale_buckets += 1;
            }
        }
        // An endpoint a stale one kept out of its bucket moves in.
        for idx in known_idx.iter().copied() {
            let bucket = direct_bucket(idx);
            if self.bucket(bucket).is_ok_and(|d| d.ifindex == 0) {
                if let Ok(Some(info)) = self.maps.endpoints.get(&idx) {
                    let d = DirectEndpoint {
                        ifindex: idx,
                        _pad: 0,
                        info,
                    };
                    let _ = self.maps.direct.set(bucket, d);
                }
            }
        }
        // Slots of interfaces no endpoint owns go back (zeroed when handed out again).
        let stale_slots: Vec<u32> = self
            .slots
            .iter()
            .map(|(i, _)| i)
            .filter(|i| !known_idx.contains(i))
            .collect();
        for i in &stale_slots {
            self.slots.release(*i);
        }
        let mut stale_budget = 0usize;
        for m in &mut self.maps.per_endpoint {
            let stale: Vec<u32> = m
                .keys()
                .into_iter()
                .filter(|i| !known_idx.contains(i))
                .collect();
            for i in &stale {
                m.remove(i);
            }
            stale_budget += stale.len();
        }
        let v4: Vec<[u8; 4]> = self
            .maps
            .local_v4
            .entries()
            .into_iter()
            .filter(|(_, l)| !known_idx.contains(&l.ifindex))
            .map(|(k, _)| k)
            .collect();
        for k in &v4 {
            self.maps.local_v4.remove(k);
        }
        let v6: Vec<[u8; 16]> = self
            .maps
            .local_v6
            .entries()
            .into_iter()
            .filter(|(_, l)| !known_idx.contains(&l.ifindex))
            .map(|(k, _)| k)
            .collect();
        for k in &v6 {
            self.maps.local_v6.remove(k);
        }
        stale.len() + stale_buckets + stale_slots.len() + v4.len() + v6.len() + stale_budget
    }

    /// Each programmed endpoint's pod and slot (those with a pod).
    pub fn pod_slots(&self) -> Vec<(calix_core::policy::model::PodKey, u32)> {
        self.programmed
            .values()
            .filter_map(|p| Some((p.pod.clone()?, self.slots.get(p.ifindex)?)))
            .collect()
    }

    /// The slot of endpoint `key`.
    pub fn slot_of(&self, key: &str) -> Option<u32> {
        self.slots.get(self.programmed.get(key)?.ifindex)
    }

    /// The initial sync is over: from now on a new slot starts unmarked (the programs mark
    /// what they record).
    pub fn end_initial_sync(&mut self) {
        self.inherited = None;
    }

    /// Agent shutdown: forgets what was programmed (the entries stay).
    pub fn release(&mut self) {
        self.programmed.clear();
    }

    /// Marks what an older layout's programs marked until they were replaced (the endpoints
    /// have their slots now). Programs may write overflow marks meanwhile: either value
    /// stands for an overflow, so the race is harmless.
    pub fn write_old_marks(&mut self, marks: &pins::OldMarks) {
        for (ifindex, overflow) in marks.iter() {
            let Some(slot) = self.slots.get(ifindex) else {
                continue;
            };
            let _ = self.maps.slots.mark(slot);
            if overflow != 0 {
                let _ = self.maps.slots.set_overflow(slot, overflow);
            }
        }
    }

    /// The direct-mapped bucket `bucket` (empty when the map has no entry there).
    fn bucket(&self, bucket: u32) -> Result<DirectEndpoint, DataplaneError> {
        Ok(self.maps.direct.get(&bucket)?.unwrap_or_default())
    }

    /// Zeroes the per-endpoint arrays at `slot`, newly handed to the endpoint `ep` on
    /// `ifindex` (marks it inherits during the initial sync excepted).
    fn clear_slot(
        &mut self,
        slot: u32,
        ifindex: u32,
        ep: &EndpointSpec,
    ) -> Result<(), DataplaneError> {
        let (marked, overflow) = self
            .inherited
            .as_ref()
            .map_or((0, 0), |i| i.for_endpoint(ifindex, ep));
        self.maps.slots.reset(slot, marked, overflow)
    }

    /// Writes the endpoint on `idx` into the endpoint table, then into its direct-mapped bucket
    /// when the bucket is free, stale (an interface that has no slot) or its own; a bucket
    /// another live endpoint holds stays as it is, and the programs find this one in the
    /// table.
    fn write_endpoint(&mut self, idx: u32, info: EndpointInfo) -> Result<(), DataplaneError> {
        self.maps.endpoints.set(idx, info)?;
        let bucket = direct_bucket(idx);
        let held = self.bucket(bucket)?.ifindex;
        if held == 0 || held == idx || self.slots.get(held).is_none() {
            let d = DirectEndpoint {
                ifindex: idx,
                _pad: 0,
                info,
            };
            self.maps.direct.set(bucket, d)?;
        }
        Ok(())
    }

    /// Removes the endpoint on `idx` from the table and its bucket; another endpoint that
    /// shares the bucket moves in.
    fn forget_endpoint(&mut self, idx: u32) {
        self.maps.endpoints.remove(&idx);
        let bucket = direct_bucket(idx);
        if self.bucket(bucket).is_ok_and(|d| d.ifindex == idx) {
            let next = self
                .slots
                .iter()
                .map(|(i, _)| i)
                .filter(|i| *i != idx && direct_bucket(*i) == bucket)
                .find_map(|i| Some((i, self.maps.endpoints.get(&i).ok().flatten()?)));
            let d = next.map_or(DirectEndpoint::default(), |(ifindex, info)| {
                DirectEndpoint {
                    ifindex,
                    _pad: 0,
                    info,
                }
            });
            let _ = self.maps.direct.set(bucket, d);
        }
    }

    fn forget_entries(&mut self, p: &Programmed) {
        self.forget_endpoint(p.ifindex);
        self.slots.release(p.ifindex);
        for m in &mut self.maps.per_endpoint {
            m.remove(&p.ifindex);
        }
        self.forget_addresses(p, None, None);
    }

    /// Removes `p`'s local-delivery entries that still point at its ifindex, except for the
    /// addresses `keep_v4` / `keep_v6` (those of an endpoint taking over the same link).
    fn forget_addresses(
        &mut self,
        p: &Programmed,
        keep_v4: Option<Ipv4Addr>,
        keep_v6: Option<Ipv6Addr>,
    ) {
        if let Some(v4) = p.ipv4.filter(|a| Some(*a) != keep_v4) {
            if self
                .maps
                .local_v4
                .get(&v4.octets())
                .ok()
                .flatten()
                .is_some_and(|l| l.ifindex == p.ifindex)
            {
                self.maps.local_v4.remove(&v4.octets());
            }
        }
        if let Some(v6) = p.ipv6.filter(|a| Some(*a) != keep_v6) {
            if self
                .maps
                .local_v6
                .get(&v6.octets())
                .ok()
                .flatten()
                .is_some_and(|l| l.ifindex == p.ifindex)
            {
                self.maps.local_v6.remove(&v6.octets());
            }
        }
    }

    /// The endpoint map's value for `ep` in `slot`.
    fn endpoint_info(&self, ep: &EndpointSpec, slot: u32) -> EndpointInfo {
        let mut info = EndpointInfo {
            slot,
            ..EndpointInfo::default()
        };
        if let Some(v4) = ep.ipv4 {
            info.ipv4 = v4.octets();
            info.flags |= EP_HAS_V4;
            if self.nat.as_ref().is_some_and(|n| n.translates(v4)) {
                info.flags |= calix_common::EP_NAT_OUTGOING;
            }
        }
        if let Some(v6) = ep.ipv6 {
            info.ipv6 = v6.octets();
            info.flags |= EP_HAS_V6;
        }
        info
    }

    fn program_entries(&mut self, idx: u32, ep: &EndpointSpec) -> Result<(), DataplaneError> {
        // An endpoint keeps its slot (and its counters) across an agent restart; a new one
        // gets a zeroed slot before anything points at it.
        let (slot, new) = self.slots.assign(idx)?;
        if new {
            if let Err(e) = self.clear_slot(slot, idx, ep) {
                self.slots.release(idx);
                return Err(e);
            }
        } else if self
            .inherited
            .as_ref()
            .is_some_and(|i| i.for_endpoint(idx, ep).0 != 0)
        {
            // A slot the endpoint kept across the restart, with a stack flow in the table but
            // no mark (a build from before the marks recorded it): marked now. Only ever set
            // (as the programs do), never cleared here.
            self.maps.slots.mark(slot)?;
        }
        let info = self.endpoint_info(ep, slot);
        self.write_endpoint(idx, info)?;
        if let Some(mac) = ep.mac {
            let local = LocalEndpoint {
                ifindex: idx,
                slot,
                mac,
                _pad: [0; 2],
            };
            if let Some(v4) = ep.ipv4 {
                self.maps.local_v4.set(v4.octets(), local)?;
            }
            if let Some(v6) = ep.ipv6 {
                self.maps.local_v6.set(v6.octets(), local)?;
            }
        }
        Ok(())
    }
}
