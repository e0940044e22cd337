//! Pinned maps are checked before the object reuses them. aya reuses a map pinned under the
//! name it wants without looking at it; a map of another type, key or value size, size or
//! flags then either fails the verifier or, worse, is read with the wrong layout by the
//! programs. Before the object loads, every map it pins is compared with what is pinned
//! (`BPF_OBJ_GET_INFO_BY_FD`): a match is reused as is; a mismatch is unpinned, so the loader
//! creates the map anew, and its entries are carried into the new map where a conversion
//! exists (the conntrack table, the stack flows: translated and stack-NATed flows survive an
//! upgrade; the NetworkPolicy entries and flows: a resized policy map goes on enforcing what it
//! did) — otherwise it starts empty (the agent repopulates what it owns) and the log says which
//! map and what differed. Maps of an older layout directory (`v<N>`) are carried into
//! this layout's the same way. After the agent has re-attached every endpoint, entries the
//! old programs added meanwhile are copied too ([`Carried::catch_up`]). The stack-flow marks of
//! layouts 1 and 2 (keyed by ifindex) cannot be written until the endpoints have their slots:
//! they are kept aside ([`OldMarks`]) for the dataplane to write as it programs each endpoint.
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, Map, MapData, MapError, MapInfo};
use aya::Pod;
use aya_obj::maps::PinningType;
use calix_common::{
    CtEntry, CtKey, FlowKey, PolicyFlow, PolicyFlowKeyV4, PolicyKey, StackFlow, BPF_MAP_TYPE_ARRAY,
    BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_LPM_TRIE, BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_PERCPU_HASH,
    CT_DIR_OUT, CT_DIR_REPLY, CT_F_ACK, CT_F_SEEN, CT_MAP, IPPROTO_TCP, LAYOUT_VERSION,
    POLICY_FLOWS_MAP, POLICY_FLOWS_V4_MAP, POLICY_MAP, STACK_CLEARED_MAP, STACK_EPS_MAP,
    STACK_FLOWS_MAP,
};

use super::bpf::monotonic_ns;
use super::DataplaneError;

/// What a pinned map must be: the object's definition, with the loader's `max_entries`
/// overrides applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapSpec {
    pub name: String,
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

impl MapSpec {
    /// The spec of the map `info` describes (a pinned one).
    pub fn of(name: &str, info: &MapInfo) -> Self {
        let map_type = info.map_type().map_or(u32::MAX, |t| t as u32);
        Self {
            name: name.to_string(),
            map_type,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
            flags: info.map_flags(),
        }
    }

    /// This spec as one of `calix_common::LAYOUTS`' rows says it (the agent recreates an
    /// older layout's maps from them in the upgrade tests).
    pub fn from_layout(m: &calix_common::MapLayout) -> Self {
        Self {
            name: m.name.to_string(),
            map_type: m.map_type,
            key_size: m.key_size,
            value_size: m.value_size,
            max_entries: m.max_entries,
            flags: m.flags,
        }
    }

    /// Creates a map of this spec and pins it at `path`.
    pub fn create_pinned(&self, path: &Path) -> Result<MapData, MapError> {
        let def = aya_obj::maps::bpf_map_def {
            map_type: self.map_type,
            key_size: self.key_size,
            value_size: self.value_size,
            max_entries: self.max_entries,
            map_flags: self.flags,
            id: 0,
            pinning: PinningType::None,
        };
        let obj = aya_obj::Map::Legacy(aya_obj::maps::LegacyMap {
            def,
            section_index: 0,
            section_kind: aya_obj::EbpfSectionKind::Maps,
            symbol_index: None,
            data: Vec::new(),
        });
        let data = MapData::create(obj, &self.name, None)?;
        data.pin(path).map_err(|error| MapError::PinError {
            name: Some(self.name.clone()),
            error,
        })?;
        Ok(data)
    }

    /// What differs from `want`, in words (empty: the map matches).
    pub fn differences(&self, want: &MapSpec) -> Vec<String> {
        let mut d = Vec::new();
        if self.map_type != want.map_type {
            d.push(format!(
                "type {} (want {})",
                type_name(self.map_type),
                type_name(want.map_type)
            ));
        }
        let mut num = |what: &str, have: u32, want: u32| {
            if have != want {
                d.push(format!("{what} {have} (want {want})"));
            }
        };
        num("key size", self.key_size, want.key_size);
        num("value size", self.value_size, want.value_size);
        num("max_entries", self.max_entries, want.max_entries);
        num("flags", self.flags, want.flags);
        d
    }
}

fn type_name(t: u32) -> String {
    match t {
        BPF_MAP_TYPE_HASH => "hash".into(),
        BPF_MAP_TYPE_ARRAY => "array".into(),
        BPF_MAP_TYPE_PERCPU_HASH => "percpu_hash".into(),
        BPF_MAP_TYPE_LRU_HASH => "lru_hash".into(),
        BPF_MAP_TYPE_LPM_TRIE => "lpm_trie".into(),
        other => format!("#{other}"),
    }
}

/// The specs of every map `object` pins, with `max_entries` overridden as the loader will.
pub fn object_specs(object: &[u8], sizes: &[(&str, u32)]) -> Result<Vec<MapSpec>, DataplaneError> {
    let obj = aya_obj::Object::parse(object)
        .map_err(|e| DataplaneError::Load(Box::new(aya::EbpfError::ParseError(e))))?;
    let mut specs: Vec<MapSpec> = obj
        .maps
        .iter()
        .filter(|(_, m)| m.pinning() == PinningType::ByName)
        .map(|(name, m)| MapSpec {
            name: name.clone(),
            map_type: m.map_type(),
            key_size: m.key_size(),
            value_size: m.value_size(),
            max_entries: sizes
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(m.max_entries(), |(_, s)| *s),
            flags: m.map_flags(),
        })
        .collect();
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(specs)
}

// ---- The layouts entries are carried from ----

/// `CtEntry` as layout 1's first builds had it (16 bytes, no route cache).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CtEntryV1Early {
    pub last_seen_ns: u64,
    pub addr: [u8; 4],
    pub port: u16,
    pub flags: u16,
}

/// `CtEntry` as layout 1 published it (40 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CtEntryV1 {
    pub last_seen_ns: u64,
    pub addr: [u8; 4],
    pub port: u16,
    pub flags: u16,
    pub route_ns: u64,
    pub route_ifindex: u32,
    pub route_macs: [u8; 12],
}

// SAFETY: plain old data, `#[repr(C)]`, no padding, every bit pattern valid.
unsafe impl Pod for CtEntryV1Early {}
// SAFETY: as above.
unsafe impl Pod for CtEntryV1 {}

impl From<CtEntryV1Early> for CtEntry {
    fn from(e: CtEntryV1Early) -> Self {
        CtEntry {
            last_seen_ns: e.last_seen_ns,
            addr: e.addr,
            port: e.port,
            flags: e.flags,
            ..CtEntry::default()
        }
    }
}

impl From<CtEntryV1> for CtEntry {
    fn from(e: CtEntryV1) -> Self {
        CtEntry {
            last_seen_ns: e.last_seen_ns,
            addr: e.addr,
            port: e.port,
            flags: e.flags,
            route_ns: e.route_ns,
            route_ifindex: e.route_ifindex,
            route_macs: e.route_macs,
            ..CtEntry::default()
        }
    }
}

/// Layout 1's flags have no `CT_F_ACK`, which this layout's timeouts read as "the pod
/// completed the handshake": an answered TCP flow gets it, so an idle established
/// connection keeps its established timeout.
fn mark_answered(entries: &mut [(CtKey, CtEntry)]) {
    let answered: std::collections::HashSet<CtKey> = entries
        .iter()
        .filter(|(k, r)| {
            k.dir == CT_DIR_REPLY && k.proto == IPPROTO_TCP && r.flags & CT_F_SEEN != 0
        })
        .map(|(k, r)| CtKey {
            src: r.addr,
            dst: k.src,
            sport: r.port,
            dport: k.sport,
            proto: k.proto,
            dir: CT_DIR_OUT,
            _pad: [0; 2],
        })
        .collect();
    for (k, o) in entries.iter_mut() {
        if k.dir == CT_DIR_OUT && answered.contains(k) {
            o.flags |= CT_F_ACK;
        }
    }
}

/// Entries read from a pinned map, in this build's layout.
enum Entries {
    Conntrack(Vec<(CtKey, CtEntry)>),
    StackFlows(Vec<(FlowKey, StackFlow)>),
    /// The NetworkPolicy allow entries (written by the agent only).
    Policy(Vec<(Key<PolicyKey>, u32)>),
    PolicyFlows(Vec<(FlowKey, PolicyFlow)>),
    PolicyFlowsV4(Vec<(PolicyFlowKeyV4, PolicyFlow)>),
    Marks(Vec<(u32, u32)>),
}

impl Entries {
    fn len(&self) -> usize {
        match self {
            Entries::Conntrack(v) => v.len(),
            Entries::StackFlows(v) => v.len(),
            Entries::Policy(v) => v.len(),
            Entries::PolicyFlows(v) => v.len(),
            Entries::PolicyFlowsV4(v) => v.len(),
            Entries::Marks(v) => v.len(),
        }
    }
}

/// The entries of an LPM trie.
fn read_trie<K: Pod, V: Pod>(data: MapData) -> Result<Vec<(Key<K>, V)>, MapError> {
    let trie: LpmTrie<MapData, K, V> = LpmTrie::try_from(Map::LpmTrie(data))?;
    Ok(trie.iter().filter_map(Result::ok).collect())
}

fn read<K: Pod, V: Pod>(data: MapData, lru: bool) -> Result<Vec<(K, V)>, MapError> {
    let map = if lru {
        Map::LruHashMap(data)
    } else {
        Map::HashMap(data)
    };
    let map: HashMap<MapData, K, V> = HashMap::try_from(map)?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// Whether entries of map `name` with layout `have` can be carried into this build's.
fn convertible(name: &str, have: &MapSpec) -> bool {
    let hash = matches!(have.map_type, BPF_MAP_TYPE_HASH | BPF_MAP_TYPE_LRU_HASH);
    let key_value = (name, have.key_size, have.value_size);
    let hashes = hash
        && matches!(
            key_value,
            (CT_MAP, 16, 16 | 40 | 64)
                | (STACK_FLOWS_MAP, 40, 8 | 16)
                | (STACK_EPS_MAP, 4, 4)
                | (STACK_CLEARED_MAP, 4, 4)
                | (POLICY_FLOWS_MAP, 40, 16)
                | (POLICY_FLOWS_V4_MAP, 16 | 40, 16)
        );
    let tries = have.map_type == BPF_MAP_TYPE_LPM_TRIE && key_value == (POLICY_MAP, 16, 4);
    hashes || tries
}

/// Reads the entries of map `name` (layout `have`) in this build's layout.
fn read_converted(name: &str, have: &MapSpec, data: MapData) -> Result<Entries, MapError> {
    let lru = have.map_type == BPF_MAP_TYPE_LRU_HASH;
    Ok(match (name, have.value_size) {
        (CT_MAP, 16) => {
            let mut v: Vec<(CtKey, CtEntry)> = read::<CtKey, CtEntryV1Early>(data, lru)?
                .into_iter()
                .map(|(k, e)| (k, e.into()))
                .collect();
            mark_answered(&mut v);
            Entries::Conntrack(v)
        }
        (CT_MAP, 40) => {
            let mut v: Vec<(CtKey, CtEntry)> = read::<CtKey, CtEntryV1>(data, lru)?
                .into_iter()
                .map(|(k, e)| (k, e.into()))
                .collect();
            mark_answered(&mut v);
            Entries::Conntrack(v)
        }
        (CT_MAP, _) => Entries::Conntrack(read(data, lru)?),
        (STACK_FLOWS_MAP, 8) => {
            // Layout 1 kept no time: the flows count as seen now.
            let now = monotonic_ns();
            let v = read::<FlowKey, u64>(data, lru)?
                .into_iter()
                .map(|(k, _)| {
                    let f = StackFlow {
                        last_seen_ns: now,
                        ..StackFlow::default()
                    };
                    (k, f)
                })
                .collect();
            Entries::StackFlows(v)
        }
        (STACK_FLOWS_MAP, _) => Entries::StackFlows(read(data, lru)?),
        (POLICY_MAP, _) => Entries::Policy(read_trie(data)?),
        // Since the IPv4 flows have a table of their own, this one keeps the IPv6 ones (the
        // first builds of layout 4, and layout 3, kept both).
        (POLICY_FLOWS_MAP, _) => Entries::PolicyFlows(
            read::<FlowKey, PolicyFlow>(data, lru)?
                .into_iter()
                .filter(|(k, _)| k.family != 4)
                .collect(),
        ),
        // The IPv4 flows of a table of both families (see [`v4_flows_source`]).
        (POLICY_FLOWS_V4_MAP, _) if have.key_size == 40 => Entries::PolicyFlowsV4(
            read::<FlowKey, PolicyFlow>(data, lru)?
                .into_iter()
                .filter_map(|(k, f)| Some((PolicyFlowKeyV4::of(&k)?, f)))
                .collect(),
        ),
        (POLICY_FLOWS_V4_MAP, _) => Entries::PolicyFlowsV4(read(data, lru)?),
        _ => Entries::Marks(read(data, lru)?),
    })
}

/// Inserts `entries` into the map pinned at `pin` where their keys are missing
/// (`BPF_NOEXIST`: what the new programs wrote wins). (inserted, did not fit).
fn write<K: Pod, V: Pod>(pin: &Path, entries: &[(K, V)]) -> Result<(usize, usize), MapError> {
    let data = MapData::from_pin(pin)?;
    let mut map: HashMap<MapData, K, V> = HashMap::try_from(Map::HashMap(data))?;
    Ok(insert_missing(entries, |k, v| {
        map.insert(k, v, 1 /* BPF_NOEXIST */)
    }))
}

/// As [`write`], into the LPM trie pinned at `pin`.
fn write_trie<K: Pod, V: Pod>(
    pin: &Path,
    entries: &[(Key<K>, V)],
) -> Result<(usize, usize), MapError> {
    let data = MapData::from_pin(pin)?;
    let mut trie: LpmTrie<MapData, K, V> = LpmTrie::try_from(Map::LpmTrie(data))?;
    Ok(insert_missing(entries, |k, v| {
        trie.insert(k, v, 1 /* BPF_NOEXIST */)
    }))
}

/// Inserts each entry with `insert` (a `BPF_NOEXIST` insert: a key present already is
/// skipped): (inserted, did not fit).
fn insert_missing<K, V>(
    entries: &[(K, V)],
    mut insert: impl FnMut(&K, &V) -> Result<(), MapError>,
) -> (usize, usize) {
    let (mut inserted, mut failed) = (0, 0);
    for (k, v) in entries {
        match insert(k, v) {
            Ok(()) => inserted += 1,
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
            Err(_) => failed += 1,
        }
    }
    (inserted, failed)
}

/// Writes carried entries into the new map; marks are not written (see [`OldMarks`]):
/// `None`.
fn write_entries(pin: &Path, entries: &Entries) -> Option<Result<(usize, usize), MapError>> {
    match entries {
        Entries::Conntrack(v) => Some(write(pin, v)),
        Entries::StackFlows(v) => Some(write(pin, v)),
        Entries::Policy(v) => Some(write_trie(pin, v)),
        Entries::PolicyFlows(v) => Some(write(pin, v)),
        Entries::PolicyFlowsV4(v) => Some(write(pin, v)),
        Entries::Marks(_) => None,
    }
}

/// The stack-flow marks of an older layout, by host veth ifindex (layouts 1 and 2: 0 for a
/// plain mark, else an overflow mark), without the overflow marks its agent had cleared. The
/// dataplane writes them into this layout's arrays as it gives each endpoint its slot, and
/// once more after the old programs are gone ([`Carried::catch_up`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OldMarks(std::collections::HashMap<u32, u32>);

impl OldMarks {
    /// From an old mark map's and cleared map's entries.
    pub fn new(marks: &[(u32, u32)], cleared: &[(u32, u32)]) -> Self {
        let cleared: std::collections::HashMap<u32, u32> = cleared.iter().copied().collect();
        Self(
            marks
                .iter()
                .map(|&(i, m)| (i, if cleared.get(&i) == Some(&m) { 0 } else { m }))
                .collect(),
        )
    }

    /// `Some(overflow mark, 0 for none)` when the endpoint behind `ifindex` was marked.
    pub fn get(&self, ifindex: u32) -> Option<u32> {
        self.0.get(&ifindex).copied()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.0.iter().map(|(i, m)| (*i, *m))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One map whose entries are carried into a new map.
struct Carry {
    name: String,
    /// Where the entries came from (for the log and the catch-up).
    from: PathBuf,
    have: MapSpec,
    /// The source map, kept open: the old programs may still write it until they are
    /// replaced.
    source: MapData,
    entries: Entries,
}

/// What [`prepare`] found and did; [`Carried::restore`] finishes it after the load.
pub struct Carried {
    pin_dir: PathBuf,
    carries: Vec<Carry>,
    /// Maps recreated empty: (name, what differed).
    pub recreated: Vec<(String, Vec<String>)>,
}

impl Carried {
    /// Maps whose entries are carried: (name, entries, where from).
    pub fn carrying(&self) -> Vec<(String, usize, PathBuf)> {
        self.carries
            .iter()
            .map(|c| (c.name.clone(), c.entries.len(), c.from.clone()))
            .collect()
    }

    /// After the object loaded (the new maps exist, pinned): inserts the carried entries.
    pub fn restore(&mut self) {
        for c in &self.carries {
            let pin = self.pin_dir.join(&c.name);
            match write_entries(&pin, &c.entries) {
                None => tracing::info!(map = %c.name, from = %c.from.display(),
                    entries = c.entries.len(), "marks kept for the endpoints' new slots"),
                Some(Ok((inserted, failed))) if failed > 0 => tracing::warn!(map = %c.name,
                    from = %c.from.display(), inserted, failed,
                    "entries carried into the new map; some did not fit (the new map is smaller)"),
                Some(Ok((inserted, _))) => tracing::info!(map = %c.name,
                    from = %c.from.display(), inserted, "entries carried into the new map"),
                Some(Err(e)) => tracing::error!(map = %c.name, error = %super::error_chain(&e),
                    "cannot carry entries into the new map; it starts empty"),
            }
        }
    }

    /// The marks of `name` as [`prepare`] read them.
    fn marks_of(&self, name: &str) -> &[(u32, u32)] {
        self.carries
            .iter()
            .find_map(|c| match &c.entries {
                Entries::Marks(v) if c.name == name => Some(v.as_slice()),
                _ => None,
            })
            .unwrap_or(&[])
    }

    /// The older layout's stack-flow marks (empty when none was carried).
    pub fn old_marks(&self) -> OldMarks {
        OldMarks::new(
            self.marks_of(STACK_EPS_MAP),
            self.marks_of(STACK_CLEARED_MAP),
        )
    }

    /// Once every interface runs the new programs: copies what the old ones added to the
    /// old maps since [`prepare`] read them (keys the new map lacks only), then lets go of
    /// the old maps. Returns the old marks as they are now, for the dataplane to write.
    pub fn catch_up(self) -> OldMarks {
        let cleared = self.marks_of(STACK_CLEARED_MAP).to_vec();
        let mut marks = Vec::new();
        for c in self.carries {
            if c.name == POLICY_MAP {
                // Only the agent writes it, and it may have revoked an entry in the new map
                // since: copying the old one's would bring it back.
                continue;
            }
            let pin = self.pin_dir.join(&c.name);
            let entries = read_converted(&c.name, &c.have, c.source);
            let added = match &entries {
                Ok(Entries::Marks(m)) if c.name == STACK_EPS_MAP => {
                    marks.clone_from(m);
                    continue;
                }
                Ok(e) => write_entries(&pin, e),
                Err(_) => None,
            };
            match (added, entries) {
                (Some(Ok((0, _))), _) | (None, Ok(_)) => {}
                (Some(Ok((inserted, _))), _) => tracing::info!(map = %c.name, inserted,
                    "entries the old programs added meanwhile carried over"),
                (Some(Err(e)), _) | (None, Err(e)) => tracing::warn!(map = %c.name,
                    error = %super::error_chain(&e), "cannot catch up with the old map"),
            }
            let both = self.pin_dir.join(POLICY_FLOWS_MAP);
            if c.name == POLICY_FLOWS_V4_MAP && c.from == both {
                // This directory's table of both families is this build's IPv6 table now.
                match forget_v4_flows(&both) {
                    Ok(0) => {}
                    Ok(removed) => tracing::info!(
                        map = POLICY_FLOWS_MAP,
                        removed,
                        "IPv4 flows left in the IPv6 table (they are in their own now) removed"
                    ),
                    Err(e) => tracing::warn!(map = POLICY_FLOWS_MAP,
                        error = %super::error_chain(&e),
                        "cannot remove the IPv4 flows left in the IPv6 table (they age out)"),
                }
            }
        }
        OldMarks::new(&marks, &cleared)
    }
}

/// Removes the IPv4 flows from the policy flow table pinned at `pin` (the programs no longer
/// look there for them): how many were removed.
fn forget_v4_flows(pin: &Path) -> Result<usize, MapError> {
    let data = MapData::from_pin(pin)?;
    let mut map: HashMap<MapData, FlowKey, PolicyFlow> = HashMap::try_from(Map::LruHashMap(data))?;
    let v4: Vec<FlowKey> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.family == 4)
        .collect();
    Ok(v4.iter().filter(|k| map.remove(k).is_ok()).count())
}

/// Where the IPv4 policy flows were kept before they had a table of their own (a new
/// `CALIX_POL_FLOWS_V4` is filled from it): the table of both families, `CALIX_POL_FLOWS`, of
/// this layout's first builds (in `pin_dir`) or of an older layout.
fn v4_flows_source(pin_dir: &Path, node_dir: &Path) -> Option<PathBuf> {
    let here = pin_dir.join(POLICY_FLOWS_MAP);
    if here.exists() {
        Some(here)
    } else {
        older_pin(node_dir, POLICY_FLOWS_MAP)
    }
}

/// The pin of map `name` in the newest older layout directory of `node_dir` that has one.
fn older_pin(node_dir: &Path, name: &str) -> Option<PathBuf> {
    let mut versions: Vec<u32> = std::fs::read_dir(node_dir)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix('v')?.parse().ok())
        .filter(|v| *v < LAYOUT_VERSION)
        .collect();
    versions.sort_unstable();
    versions
        .into_iter()
        .rev()
        .map(|v| node_dir.join(format!("v{v}")).join(name))
        .find(|p| p.exists())
}

fn pin_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(MapError) -> DataplaneError + 'a {
    move |e| DataplaneError::Pin {
        path: path.to_path_buf(),
        op,
        source: std::io::Error::other(super::error_chain(&e)),
    }
}

/// Before the object loads: checks each map of `specs` pinned in `pin_dir` (this layout's
/// directory under `node_dir`). A match stays; a mismatch is unpinned (the loader creates
/// the map anew), its entries read for [`Carried::restore`] where they convert. A map not
/// pinned here is carried from an older layout directory where one has it; the IPv4 policy
/// flows' table from the table of both families that came before it ([`v4_flows_source`]).
pub fn prepare(
    pin_dir: &Path,
    node_dir: &Path,
    specs: &[MapSpec],
) -> Result<Carried, DataplaneError> {
    let mut carried = Carried {
        pin_dir: pin_dir.to_path_buf(),
        carries: Vec::new(),
        recreated: Vec::new(),
    };
    // The IPv4 flows' table first: its source may be a mismatched table of both families
    // in this directory, which is unpinned when its turn comes.
    let v4_first = specs
        .iter()
        .filter(|s| s.name == POLICY_FLOWS_V4_MAP)
        .chain(specs.iter().filter(|s| s.name != POLICY_FLOWS_V4_MAP));
    for want in v4_first {
        let here = pin_dir.join(&want.name);
        let source = if here.exists() {
            Some((here.clone(), false))
        } else if want.name == POLICY_FLOWS_V4_MAP {
            v4_flows_source(pin_dir, node_dir).map(|p| (p, true))
        } else {
            older_pin(node_dir, &want.name).map(|p| (p, true))
        };
        let Some((from, older)) = source else {
            continue;
        };
        let info = MapInfo::from_pin(&from).map_err(pin_err(&from, "read pinned map info"))?;
        let have = MapSpec::of(&want.name, &info);
        let diffs = have.differences(want);
        if !older && diffs.is_empty() {
            continue;
        }
        if convertible(&want.name, &have) {
            let data = MapData::from_pin(&from).map_err(pin_err(&from, "open pinned map"))?;
            let entries = read_converted(&want.name, &have, data)
                .map_err(pin_err(&from, "read pinned map"))?;
            let source = MapData::from_pin(&from).map_err(pin_err(&from, "open pinned map"))?;
            if older {
                tracing::info!(map = %want.name, from = %from.display(), entries = entries.len(),
                    differences = ?diffs, "an older layout's (or build's) map: carrying its entries into this layout's");
            } else {
                tracing::warn!(map = %want.name, from = %from.display(), entries = entries.len(),
                    differences = ?diffs, "pinned map does not match this build: carrying its entries into a new one");
            }
            carried.carries.push(Carry {
                name: want.name.clone(),
                from: from.clone(),
                have,
                source,
                entries,
            });
        } else if older {
            // The agent repopulates what it owns; nothing to say per map.
            continue;
        } else {
            tracing::warn!(map = %want.name, pin = %from.display(), differences = ?diffs,
                "pinned map does not match this build and its entries cannot be converted: recreating it empty");
            carried.recreated.push((want.name.clone(), diffs));
        }
        if !older {
            std::fs::remove_file(&here).map_err(|source| DataplaneError::Pin {
                path: here.clone(),
                op: "remove a mismatched pin",
                source,
            })?;
        }
    }
    Ok(carried)
}

#[cfg(test)]
#[path = "pins_tests.rs"]
mod tests;
