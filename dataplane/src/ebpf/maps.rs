//! The seam under the endpoint bookkeeping ([`super::endpoints`]): the map operations it does
//! on the endpoint, direct-mapped, local-delivery and per-endpoint maps ([`Table`]) and on the
//! per-slot arrays ([`SlotArrays`]), implemented by the pinned aya maps here and by in-memory
//! fakes in the unit tests.
use aya::maps::{Array, HashMap, MapData, MapError, PerCpuArray, PerCpuValues};
use aya::Pod;
use calix_common::{
    DirectEndpoint, EndpointCounters, EndpointInfo, LocalEndpoint, COUNTERS_MAP, STACK_CLEARED_MAP,
    STACK_EPS_MAP, STACK_MARKED, STACK_OVERFLOW_MAP,
};

use crate::bpf::map_err;
use crate::DataplaneError;

/// One map as the endpoint bookkeeping uses it.
pub trait Table<K, V>: Send {
    /// The value at `k`; `None` when there is none (an array's entries always exist).
    fn get(&self, k: &K) -> Result<Option<V>, DataplaneError>;
    /// Writes `v` at `k`.
    fn set(&mut self, k: K, v: V) -> Result<(), DataplaneError>;
    /// Removes `k`; a failure is not reported (every caller ignores it: gone is what it
    /// wants).
    fn remove(&mut self, k: &K);
    /// Every key that reads back.
    fn keys(&self) -> Vec<K>;
    /// Every entry that reads back.
    fn entries(&self) -> Vec<(K, V)>;
}

/// The arrays indexed by an endpoint's slot: its counters and its stack-flow marks
/// (`STACK_EPS_MAP`, `STACK_OVERFLOW_MAP`, `STACK_CLEARED_MAP`).
pub trait SlotArrays: Send {
    /// A slot newly handed out: its counters zeroed, its marks set to `marked`, `overflow`
    /// and 0 (cleared).
    fn reset(&mut self, slot: u32, marked: u32, overflow: u32) -> Result<(), DataplaneError>;
    /// Marks `slot` (`STACK_EPS_MAP`): its pod has flows in the stack-flow table.
    fn mark(&mut self, slot: u32) -> Result<(), DataplaneError>;
    /// Sets the overflow mark of `slot` (`STACK_OVERFLOW_MAP`).
    fn set_overflow(&mut self, slot: u32, overflow: u32) -> Result<(), DataplaneError>;
}

/// A pinned aya map and its name (for errors).
pub struct Pinned<M> {
    pub name: &'static str,
    pub map: M,
}

impl<M> Pinned<M> {
    pub fn new(name: &'static str, map: M) -> Self {
        Self { name, map }
    }
}

impl<K: Pod + Send, V: Pod + Send> Table<K, V> for Pinned<HashMap<MapData, K, V>> {
    fn get(&self, k: &K) -> Result<Option<V>, DataplaneError> {
        match self.map.get(k, 0) {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(self.name, "lookup")(e)),
        }
    }
    fn set(&mut self, k: K, v: V) -> Result<(), DataplaneError> {
        self.map
            .insert(k, v, 0)
            .map_err(map_err(self.name, "insert"))
    }
    fn remove(&mut self, k: &K) {
        let _ = self.map.remove(k);
    }
    fn keys(&self) -> Vec<K> {
        self.map.keys().filter_map(Result::ok).collect()
    }
    fn entries(&self) -> Vec<(K, V)> {
        self.map.iter().filter_map(Result::ok).collect()
    }
}

/// An array: every index below its size has an entry; removing one zeroes it.
impl<V: Pod + Default + Send> Table<u32, V> for Pinned<Array<MapData, V>> {
    fn get(&self, k: &u32) -> Result<Option<V>, DataplaneError> {
        self.map
            .get(k, 0)
            .map(Some)
            .map_err(map_err(self.name, "lookup"))
    }
    fn set(&mut self, k: u32, v: V) -> Result<(), DataplaneError> {
        self.map.set(k, v, 0).map_err(map_err(self.name, "set"))
    }
    fn remove(&mut self, k: &u32) {
        let _ = self.map.set(*k, V::default(), 0);
    }
    fn keys(&self) -> Vec<u32> {
        (0..self.map.len()).collect()
    }
    fn entries(&self) -> Vec<(u32, V)> {
        (0..self.map.len())
            .filter_map(|i| self.map.get(&i, 0).ok().map(|v| (i, v)))
            .collect()
    }
}

/// The pinned counters and stack-flow mark arrays.
pub struct PinnedSlotArrays {
    pub counters: PerCpuArray<MapData, EndpointCounters>,
    /// `STACK_EPS_MAP`, `STACK_OVERFLOW_MAP`, `STACK_CLEARED_MAP`.
    pub marks: [Array<MapData, u32>; 3],
}

impl PinnedSlotArrays {
    fn zero_counters() -> Result<PerCpuValues<EndpointCounters>, DataplaneError> {
        let n = aya::util::nr_cpus()
            .map_err(|(_, e)| map_err(COUNTERS_MAP, "count CPUs")(MapError::IoError(e)))?;
        PerCpuValues::try_from(vec![EndpointCounters::default(); n])
            .map_err(|e| map_err(COUNTERS_MAP, "build per-CPU value")(MapError::IoError(e)))
    }
}

impl SlotArrays for PinnedSlotArrays {
    fn reset(&mut self, slot: u32, marked: u32, overflow: u32) -> Result<(), DataplaneError> {
        self.counters
            .set(slot, Self::zero_counters()?, 0)
            .map_err(map_err(COUNTERS_MAP, "zero a slot"))?;
        let names = [STACK_EPS_MAP, STACK_OVERFLOW_MAP, STACK_CLEARED_MAP];
        for ((m, name), v) in self.marks.iter_mut().zip(names).zip([marked, overflow, 0]) {
            m.set(slot, v, 0).map_err(map_err(name, "set a slot"))?;
        }
        Ok(())
    }
    fn mark(&mut self, slot: u32) -> Result<(), DataplaneError> {
        self.marks[0]
            .set(slot, STACK_MARKED, 0)
            .map_err(map_err(STACK_EPS_MAP, "mark"))
    }
    fn set_overflow(&mut self, slot: u32, overflow: u32) -> Result<(), DataplaneError> {
        self.marks[1]
            .set(slot, overflow, 0)
            .map_err(map_err(STACK_OVERFLOW_MAP, "mark"))
    }
}

/// The maps the endpoint bookkeeping writes.
pub struct EndpointMaps {
    /// The endpoint table (`ENDPOINTS_MAP`, by host veth ifindex).
    pub endpoints: Box<dyn Table<u32, EndpointInfo>>,
    /// Its direct-mapped copy the programs look in first (`ENDPOINTS_DIRECT_MAP`, by bucket).
    pub direct: Box<dyn Table<u32, DirectEndpoint>>,
    /// Local delivery by pod address (`LOCAL_V4_MAP`, `LOCAL_V6_MAP`).
    pub local_v4: Box<dyn Table<[u8; 4], LocalEndpoint>>,
    pub local_v6: Box<dyn Table<[u8; 16], LocalEndpoint>>,
    /// Per-endpoint entries removed with the endpoint: the conntrack budget's counts
    /// (`CT_OWNED_MAP`, `CT_FREED_MAP`).
    pub per_endpoint: Vec<Box<dyn Table<u32, u32>>>,
    pub slots: Box<dyn SlotArrays>,
}

/// A pinned map of `bpf` as a [`Table`].
pub(super) fn pinned<M, K, V>(
    bpf: &mut aya::Ebpf,
    name: &'static str,
    convert: impl FnOnce(aya::maps::Map) -> Result<M, MapError>,
) -> Result<Box<dyn Table<K, V>>, DataplaneError>
where
    Pinned<M>: Table<K, V> + 'static,
{
    Ok(Box::new(Pinned::new(
        name,
        crate::bpf::take(bpf, name, convert)?,
    )))
}
