//! Every map the programs use, each defined once. Names and sizes come from `calix_common`.

use aya_ebpf::{macros::map, maps::PerCpuHashMap};
use calix_common::{EndpointCounters, COUNTERS_MAP, MAX_ENDPOINTS};

/// Host-side veth ifindex → that endpoint's counters. The agent creates and deletes the entries.
#[map(name = "CALIX_COUNTERS")]
pub static CALIX_COUNTERS: PerCpuHashMap<u32, EndpointCounters> =
    PerCpuHashMap::with_max_entries(MAX_ENDPOINTS, 0);

// `#[map(name = ...)]` takes a literal only; keep it in step with the const the agent uses.
const _: () = assert!(crate::str_eq(COUNTERS_MAP, "CALIX_COUNTERS"));
