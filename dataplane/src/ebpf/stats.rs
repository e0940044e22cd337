//! [`DataplaneStats`] over the pinned maps.
use std::path::Path;

use aya::maps::{HashMap, MapData, MapError, PerCpuArray, PerCpuHashMap};
use calix_common::{
    DropCount, DropKey, EndpointCounters, EndpointInfo, COUNTERS_MAP, DROPS_MAP, ENDPOINTS_MAP,
};

use crate::bpf::{map_err, open_hash, open_per_cpu_array};
use crate::{DataplaneError, DataplaneStats};

/// [`DataplaneStats`] for readers that must not wait for (or hold up) the dataplane.
pub struct EbpfStats {
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    counters: PerCpuArray<MapData, EndpointCounters>,
    drops: PerCpuHashMap<MapData, DropKey, DropCount>,
}

impl EbpfStats {
    pub fn open(pin_dir: &Path) -> Result<Self, DataplaneError> {
        let path = pin_dir.join(DROPS_MAP);
        let drops = MapData::from_pin(&path)
            .map(aya::maps::Map::PerCpuHashMap)
            .map_err(map_err(DROPS_MAP, "open pin"))?;
        Ok(Self {
            endpoints: open_hash(pin_dir, ENDPOINTS_MAP)?,
            counters: open_per_cpu_array(pin_dir, COUNTERS_MAP)?,
            drops: PerCpuHashMap::try_from(drops).map_err(map_err(DROPS_MAP, "open"))?,
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
}
