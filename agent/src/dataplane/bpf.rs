//! Helpers for aya objects and pinned maps that the dataplane's modules share: a leaf (it
//! imports no other dataplane module), so none of them imports another for these.
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray};
use aya::programs::ProgramError;
use aya::Ebpf;

use super::DataplaneError;

pub(super) fn prog_err(
    name: &'static str,
    op: &'static str,
) -> impl FnOnce(ProgramError) -> DataplaneError {
    move |e| DataplaneError::Program {
        name,
        op,
        source: Box::new(e),
    }
}

pub(super) fn map_err(
    name: &'static str,
    op: &'static str,
) -> impl FnOnce(MapError) -> DataplaneError {
    move |e| DataplaneError::Map {
        name,
        op,
        source: Box::new(e),
    }
}

pub(super) fn pin_err<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> DataplaneError + 'a {
    move |source| DataplaneError::Pin {
        path: path.to_path_buf(),
        op,
        source,
    }
}

pub(super) fn take<T>(
    bpf: &mut Ebpf,
    name: &'static str,
    f: impl FnOnce(aya::maps::Map) -> Result<T, MapError>,
) -> Result<T, DataplaneError> {
    let map = bpf.take_map(name).ok_or_else(|| DataplaneError::Map {
        name,
        op: "find",
        source: Box::new(MapError::InvalidName {
            name: name.to_string(),
        }),
    })?;
    f(map).map_err(map_err(name, "open"))
}

/// Opens the hash map pinned at `pin_dir/name`.
pub(super) fn open_hash<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, DataplaneError> {
    let path: PathBuf = pin_dir.join(name);
    let data = MapData::from_pin(&path).map_err(map_err(name, "open pin"))?;
    HashMap::try_from(Map::HashMap(data)).map_err(map_err(name, "open"))
}

/// Opens the array pinned at `pin_dir/name`.
pub(super) fn open_array<V: aya::Pod>(
    pin_dir: &Path,
    name: &'static str,
) -> Result<Array<MapData, V>, DataplaneError> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(map_err(name, "open pin"))?;
    Array::try_from(Map::Array(data)).map_err(map_err(name, "open"))
}

/// Opens the per-CPU array pinned at `pin_dir/name`.
pub(super) fn open_per_cpu_array<V: aya::Pod>(
    pin_dir: &Path,
    name: &'static str,
) -> Result<PerCpuArray<MapData, V>, DataplaneError> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(map_err(name, "open pin"))?;
    PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(map_err(name, "open"))
}

/// CLOCK_MONOTONIC in nanoseconds: `bpf_ktime_get_ns`'s clock.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}
