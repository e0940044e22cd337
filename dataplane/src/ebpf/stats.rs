//! [`DataplaneStats`] over the pinned maps.
use std::path::Path;

use aya::maps::{HashMap, MapData, MapError, PerCpuArray, PerCpuHashMap};
use calix_common::{
    DropCount, DropKey, DropReason, EndpointCounters, EndpointInfo, PolicyHitKey, SvcCounters,
    SvcKey, COUNTERS_MAP, DROPS_MAP, ENDPOINTS_MAP, POLICY_HITS_MAP, SVC_COUNTERS_MAP,
};

use crate::bpf::{map_err, open_hash, open_per_cpu_array};
use crate::{DataplaneError, DataplaneStats, LiveVerdict, PolicyCounts};

/// [`DataplaneStats`] for readers that must not wait for (or hold up) the dataplane.
pub struct EbpfStats {
    pin_dir: std::path::PathBuf,
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    counters: PerCpuArray<MapData, EndpointCounters>,
    drops: PerCpuHashMap<MapData, DropKey, DropCount>,
    hits: PerCpuHashMap<MapData, PolicyHitKey, u64>,
    services: PerCpuHashMap<MapData, SvcKey, SvcCounters>,
}

/// The per-CPU hash pinned at `pin_dir/name`.
fn open_per_cpu_hash<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &'static str,
) -> Result<PerCpuHashMap<MapData, K, V>, DataplaneError> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(map_err(name, "open pin"))?;
    PerCpuHashMap::try_from(aya::maps::Map::PerCpuHashMap(data)).map_err(map_err(name, "open"))
}

impl EbpfStats {
    pub fn open(pin_dir: &Path) -> Result<Self, DataplaneError> {
        Ok(Self {
            pin_dir: pin_dir.to_path_buf(),
            endpoints: open_hash(pin_dir, ENDPOINTS_MAP)?,
            counters: open_per_cpu_array(pin_dir, COUNTERS_MAP)?,
            drops: open_per_cpu_hash(pin_dir, DROPS_MAP)?,
            hits: open_per_cpu_hash(pin_dir, POLICY_HITS_MAP)?,
            services: open_per_cpu_hash(pin_dir, SVC_COUNTERS_MAP)?,
        })
    }
}

impl DataplaneStats for EbpfStats {
    fn counters(&self, ifindex: u32) -> Result<Option<EndpointCounters>, DataplaneError> {
        let slot = match self.endpoints.get(&ifindex, 0) {
            Ok(info) => info.slot,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(map_err(ENDPOINTS_MAP, "lookup")(e)),
        };
        let per_cpu = self
            .counters
            .get(&slot, 0)
            .map_err(map_err(COUNTERS_MAP, "lookup"))?;
        let mut sum = EndpointCounters::default();
        per_cpu.iter().for_each(|c| sum.accumulate(c));
        Ok(Some(sum))
    }

    fn drops(&self) -> Result<Vec<(DropKey, DropCount)>, DataplaneError> {
        let mut out = Vec::new();
        for item in self.drops.iter() {
            let (k, per_cpu) = item.map_err(map_err(DROPS_MAP, "iterate"))?;
            let mut sum = DropCount::default();
            per_cpu.iter().for_each(|c| sum.accumulate(c));
            out.push((k, sum));
        }
        out.sort_by_key(|(k, _)| *k);
        Ok(out)
    }

    fn service_counters(&self) -> Result<Vec<(SvcKey, SvcCounters)>, DataplaneError> {
        let mut out = Vec::new();
        for item in self.services.iter() {
            let (k, per_cpu) = match item {
                Ok(kv) => kv,
                // Evicted by the LRU, or its frontend removed, between the key and the read.
                Err(MapError::KeyNotFound) => continue,
                Err(e) => return Err(map_err(SVC_COUNTERS_MAP, "iterate")(e)),
            };
            let mut sum = SvcCounters::default();
            per_cpu.iter().for_each(|c| sum.accumulate(c));
            out.push((k, sum));
        }
        Ok(out)
    }

    fn slots(&self) -> Result<std::collections::BTreeMap<u32, u32>, DataplaneError> {
        let mut out = std::collections::BTreeMap::new();
        for item in self.endpoints.iter() {
            let (ifindex, info) = item.map_err(map_err(ENDPOINTS_MAP, "iterate"))?;
            out.insert(info.slot, ifindex);
        }
        Ok(out)
    }

    fn policy_denied(
        &self,
        endpoints: &[(u32, String)],
    ) -> Result<Vec<(u64, u64)>, DataplaneError> {
        let denied = |ifindex: u32, reason: DropReason| -> Result<u64, DataplaneError> {
            let key = DropKey {
                ifindex,
                reason: reason as u32,
            };
            match self.drops.get(&key, 0) {
                Ok(per_cpu) => Ok(per_cpu.iter().map(|c| c.packets).sum()),
                Err(MapError::KeyNotFound) => Ok(0),
                Err(e) => Err(map_err(DROPS_MAP, "lookup")(e)),
            }
        };
        endpoints
            .iter()
            .map(|(i, _)| {
                Ok((
                    denied(*i, DropReason::PolicyIngress)?,
                    denied(*i, DropReason::PolicyEgress)?,
                ))
            })
            .collect()
    }

    fn policy_verdict(
        &self,
        ifindex: u32,
        ingress: bool,
        peer: std::net::IpAddr,
        proto: u8,
        port: u16,
    ) -> Result<Option<LiveVerdict>, DataplaneError> {
        let slot = match self.endpoints.get(&ifindex, 0) {
            Ok(info) => info.slot,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(map_err(ENDPOINTS_MAP, "lookup")(e)),
        };
        super::trace::verdict(&self.pin_dir, slot, ingress, peer, proto, port).map(Some)
    }

    fn policy_counts(
        &self,
        ifindex: u32,
        _host_ifname: &str,
    ) -> Result<Option<PolicyCounts>, DataplaneError> {
        let slot = match self.endpoints.get(&ifindex, 0) {
            Ok(info) => info.slot,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(map_err(ENDPOINTS_MAP, "lookup")(e)),
        };
        let mut counts = PolicyCounts::default();
        for item in self.hits.iter() {
            let (k, per_cpu) = item.map_err(map_err(POLICY_HITS_MAP, "iterate"))?;
            if k.slot == slot {
                let n = per_cpu.iter().fold(0u64, |a, c| a.wrapping_add(*c));
                counts.hits.insert(k.rule, n);
            }
        }
        let ifname = String::new();
        let [(ingress, egress)] = self.policy_denied(&[(ifindex, ifname)])?[..] else {
            return Ok(Some(counts));
        };
        counts.denied_ingress = ingress;
        counts.denied_egress = egress;
        Ok(Some(counts))
    }
}
