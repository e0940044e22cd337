//! NetworkPolicy in the eBPF maps: calix-core's tables (`calix_core::policy::tables`) written
//! into the identity tries, the entry trie and the per-slot state, step by step in the order
//! of their plan, so that a flow allowed before and after a change never meets a denial.
//!
//! The tables name endpoints by their pod; the maps by slot (a pod's endpoints on this node). What the maps hold is
//! kept by slot ([`PolicyProgrammer::applied`]), read back from the pins at start: after an
//! agent restart the pinned policy stays in force, untouched, until the new agent has
//! computed its own and the first [`PolicyProgrammer::set`] moves the maps to it. An
//! endpoint attached later gets its entries and isolation before its programs run
//! ([`PolicyProgrammer::attached`]); one that goes takes its entries with it.
use std::collections::BTreeMap;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData, PerCpuHashMap};
use calix_common::{
    PolicyHitKey, PolicyKey, PolicyOpeners, PolicyState, POLICY_ANY_PEER, POLICY_HITS_MAP,
    POLICY_IDS_V4_MAP, POLICY_IDS_V6_MAP, POLICY_KEY_PEER_BITS, POLICY_KEY_PROTO_BITS, POLICY_MAP,
    POLICY_OPENERS_MAP, POLICY_SERVICE, POLICY_STATE_MAP, POLICY_WORLD, POL_DIR_EGRESS,
    POL_DIR_INGRESS, POL_ISOLATED_EGRESS, POL_ISOLATED_INGRESS, POL_KEEP_ESTABLISHED,
};
use calix_core::policy::endpoint::Direction;
use calix_core::policy::model::PodKey;
use calix_core::policy::tables::{
    plan, with_services, EndpointTables, Entries, EntryKey, EntryRef, Plan, RuleId, Tables,
};
use ipnet::IpNet;

use crate::bpf::{map_err, take};
use crate::DataplaneError;

// The calculation's reserved identities are the programs'.
const _: () = assert!(
    calix_core::policy::tables::WORLD == POLICY_WORLD
        && calix_core::policy::tables::ANY_PEER == POLICY_ANY_PEER
        && calix_core::policy::tables::SERVICE == POLICY_SERVICE
);

/// The map operations policy programming does: implemented by the pinned maps here, and by
/// an in-memory fake in the unit tests.
pub trait PolicyMaps: Send {
    fn set_prefix(&mut self, net: IpNet, identity: u32) -> Result<(), DataplaneError>;
    fn remove_prefix(&mut self, net: &IpNet);
    fn set_entry(
        &mut self,
        slot: u32,
        d: Direction,
        e: &EntryKey,
        rule: RuleId,
    ) -> Result<(), DataplaneError>;
    fn remove_entry(&mut self, slot: u32, d: Direction, e: &EntryKey);
    fn set_state(&mut self, slot: u32, s: PolicyState) -> Result<(), DataplaneError>;
    /// Forgets the hit count of rule `rule` for the endpoint in `slot`.
    fn remove_hits(&mut self, slot: u32, rule: RuleId);
    /// Forgets every hit count (the rules' numbers start over).
    fn clear_hits(&mut self);
    /// Forgets the records of which connections the endpoint in each of `slots` and another
    /// opened to each other (`CALIX_POL_OPENERS`), in one walk of them: the endpoints are
    /// gone, and whoever gets their slots next starts without them.
    fn forget_openers(&mut self, slots: &[u32]);
    /// What the maps hold: prefixes, entries by slot, and the states that are not zero.
    fn read_back(&self) -> (Tables<u32>, BTreeMap<u32, PolicyState>);
}

fn dir_byte(d: Direction) -> u8 {
    match d {
        Direction::Ingress => POL_DIR_INGRESS,
        Direction::Egress => POL_DIR_EGRESS,
    }
}

/// The trie key of entry `e` of `slot` in direction `d`.
pub fn trie_key(slot: u32, d: Direction, e: &EntryKey) -> Key<PolicyKey> {
    match e.proto {
        None => Key::new(
            POLICY_KEY_PEER_BITS,
            PolicyKey::new(slot, dir_byte(d), e.identity, 0, [0; 2]),
        ),
        Some(p) => Key::new(
            POLICY_KEY_PROTO_BITS + u32::from(e.port_bits),
            PolicyKey::new(slot, dir_byte(d), e.identity, p, e.port.to_be_bytes()),
        ),
    }
}

/// The entry a trie key stands for: (slot, direction, entry); `None` for a key no entry makes.
pub fn entry_of(k: &Key<PolicyKey>) -> Option<(u32, Direction, EntryKey)> {
    let (len, data) = (k.prefix_len(), k.data());
    let d = match data.dir {
        POL_DIR_INGRESS => Direction::Ingress,
        POL_DIR_EGRESS => Direction::Egress,
        _ => return None,
    };
    let slot = u32::from_be_bytes(data.slot);
    let identity = u32::from_be_bytes(data.identity);
    let e = if len == POLICY_KEY_PEER_BITS {
        EntryKey {
            identity,
            proto: None,
            port: 0,
            port_bits: 0,
        }
    } else {
        let bits = len.checked_sub(POLICY_KEY_PROTO_BITS)?;
        if bits > 16 {
            return None;
        }
        EntryKey {
            identity,
            proto: Some(data.proto),
            port: u16::from_be_bytes(data.port),
            port_bits: bits as u8,
        }
    };
    Some((slot, d, e))
}

/// The pinned maps.
pub struct PinnedPolicyMaps {
    ids_v4: LpmTrie<MapData, [u8; 4], u32>,
    ids_v6: LpmTrie<MapData, [u8; 16], u32>,
    entries: LpmTrie<MapData, PolicyKey, u32>,
    state: Array<MapData, PolicyState>,
    hits: PerCpuHashMap<MapData, PolicyHitKey, u64>,
    openers: HashMap<MapData, u32, PolicyOpeners>,
}

impl PinnedPolicyMaps {
    pub fn open(bpf: &mut aya::Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            ids_v4: take(bpf, POLICY_IDS_V4_MAP, LpmTrie::try_from)?,
            ids_v6: take(bpf, POLICY_IDS_V6_MAP, LpmTrie::try_from)?,
            entries: take(bpf, POLICY_MAP, LpmTrie::try_from)?,
            state: take(bpf, POLICY_STATE_MAP, Array::try_from)?,
            hits: take(bpf, POLICY_HITS_MAP, PerCpuHashMap::try_from)?,
            openers: take(bpf, POLICY_OPENERS_MAP, HashMap::try_from)?,
        })
    }
}

impl PolicyMaps for PinnedPolicyMaps {
    fn set_prefix(&mut self, net: IpNet, identity: u32) -> Result<(), DataplaneError> {
        let len = u32::from(net.prefix_len());
        match net {
            IpNet::V4(n) => self
                .ids_v4
                .insert(&Key::new(len, n.addr().octets()), identity, 0)
                .map_err(map_err(POLICY_IDS_V4_MAP, "insert")),
            IpNet::V6(n) => self
                .ids_v6
                .insert(&Key::new(len, n.addr().octets()), identity, 0)
                .map_err(map_err(POLICY_IDS_V6_MAP, "insert")),
        }
    }

    fn remove_prefix(&mut self, net: &IpNet) {
        let len = u32::from(net.prefix_len());
        let _ = match net {
            IpNet::V4(n) => self.ids_v4.remove(&Key::new(len, n.addr().octets())),
            IpNet::V6(n) => self.ids_v6.remove(&Key::new(len, n.addr().octets())),
        };
    }

    fn set_entry(
        &mut self,
        slot: u32,
        d: Direction,
        e: &EntryKey,
        rule: RuleId,
    ) -> Result<(), DataplaneError> {
        self.entries
            .insert(&trie_key(slot, d, e), rule, 0)
            .map_err(map_err(POLICY_MAP, "insert"))
    }

    fn remove_entry(&mut self, slot: u32, d: Direction, e: &EntryKey) {
        let _ = self.entries.remove(&trie_key(slot, d, e));
    }

    fn set_state(&mut self, slot: u32, s: PolicyState) -> Result<(), DataplaneError> {
        self.state
            .set(slot, s, 0)
            .map_err(map_err(POLICY_STATE_MAP, "set"))
    }

    fn remove_hits(&mut self, slot: u32, rule: RuleId) {
        let _ = self.hits.remove(&PolicyHitKey { slot, rule });
    }

    fn clear_hits(&mut self) {
        let keys: Vec<PolicyHitKey> = self.hits.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = self.hits.remove(&k);
        }
    }

    fn forget_openers(&mut self, slots: &[u32]) {
        let keys: Vec<u32> = self
            .openers
            .keys()
            .filter_map(Result::ok)
            .filter(|k| slots.contains(&(k >> 16)) || slots.contains(&(k & 0xffff)))
            .collect();
        for k in keys {
            let _ = self.openers.remove(&k);
        }
    }

    fn read_back(&self) -> (Tables<u32>, BTreeMap<u32, PolicyState>) {
        let mut t = Tables::default();
        for (k, id) in self.ids_v4.iter().filter_map(Result::ok) {
            if let Ok(n) = ipnet::Ipv4Net::new(k.data().into(), k.prefix_len() as u8) {
                t.prefixes.insert(IpNet::V4(n), id);
            }
        }
        for (k, id) in self.ids_v6.iter().filter_map(Result::ok) {
            if let Ok(n) = ipnet::Ipv6Net::new(k.data().into(), k.prefix_len() as u8) {
                t.prefixes.insert(IpNet::V6(n), id);
            }
        }
        let states: BTreeMap<u32, PolicyState> = (0..self.state.len())
            .filter_map(|i| Some((i, self.state.get(&i, 0).ok()?)))
            .filter(|(_, s)| *s != PolicyState::default())
            .collect();
        for (slot, s) in &states {
            let e: &mut EndpointTables = t.endpoints.entry(*slot).or_default();
            if s.flags & POL_ISOLATED_INGRESS != 0 {
                e.ingress = Some(BTreeMap::new());
            }
            if s.flags & POL_ISOLATED_EGRESS != 0 {
                e.egress = Some(BTreeMap::new());
            }
        }
        for (k, rule) in self.entries.iter().filter_map(Result::ok) {
            let Some((slot, d, e)) = entry_of(&k) else {
                continue;
            };
            let t = t.endpoints.entry(slot).or_default();
            let m = match d {
                Direction::Ingress => &mut t.ingress,
                Direction::Egress => &mut t.egress,
            };
            // Entries of a direction that is not isolated: the plan removes them.
            m.get_or_insert_with(BTreeMap::new).insert(e, rule);
        }
        (t, states)
    }
}

fn flags(t: (bool, bool)) -> u32 {
    (if t.0 { POL_ISOLATED_INGRESS } else { 0 }) | (if t.1 { POL_ISOLATED_EGRESS } else { 0 })
}

/// Keeps the maps as the desired tables say, for the endpoints attached.
pub struct PolicyProgrammer {
    maps: Box<dyn PolicyMaps>,
    /// What the agent last asked for; None until it first does (the pins stay as they are).
    desired: Option<Tables>,
    /// What the maps hold, by slot.
    applied: Tables<u32>,
    /// Each slot's state as written.
    states: BTreeMap<u32, PolicyState>,
    /// The last generation handed out (node-wide; never reused while the pins live).
    generation: u32,
    /// `POL_KEEP_ESTABLISHED` or 0: in the flags of every isolated endpoint's state.
    keep: u32,
    /// Added to every identity the agent's tables name: above every identity the pins held
    /// at start. A restarted agent numbers its identities afresh; without the offset its
    /// first entries could land on an identity the maps still give addresses of another
    /// meaning, and let them through while the prefixes move.
    offset: u32,
    /// The Service ranges ([`Self::set_services`]).
    services: Vec<IpNet>,
}

impl PolicyProgrammer {
    /// Over `maps` as they are pinned.
    pub fn restore(maps: Box<dyn PolicyMaps>) -> Self {
        let (applied, states) = maps.read_back();
        let generation = states.values().map(|s| s.generation).max().unwrap_or(0);
        let entries = applied
            .endpoints
            .values()
            .flat_map(|t| [&t.ingress, &t.egress])
            .flatten()
            .flat_map(|m| m.keys().map(|k| k.identity));
        let offset = applied
            .prefixes
            .values()
            .copied()
            .chain(entries)
            .filter(|i| *i != POLICY_ANY_PEER && *i != POLICY_SERVICE)
            .max()
            .unwrap_or(0);
        Self {
            maps,
            desired: None,
            applied,
            states,
            generation,
            offset,
            keep: 0,
            services: Vec::new(),
        }
    }

    /// The Service ranges (`service_cidrs`): identity [`POLICY_SERVICE`] in the tries, so
    /// that `from_pod` leaves its egress verdict on them to after the host stack's DNAT. The
    /// maps follow at once when the agent has said what it wants (`slots`: each attached
    /// endpoint's pod and slot).
    pub fn set_services(
        &mut self,
        services: &[IpNet],
        slots: &[(PodKey, u32)],
    ) -> Result<(), DataplaneError> {
        if self.services == services {
            return Ok(());
        }
        self.services = services.to_vec();
        self.attached(slots)
    }

    /// Whether isolated endpoints keep the flows they let through after a change that would
    /// refuse them (until they go idle). A change of this setting rewrites every isolated
    /// endpoint's state with a new generation, so that their flows are checked again under
    /// it.
    pub fn set_keep_established(&mut self, keep: bool) -> Result<(), DataplaneError> {
        self.keep = if keep { POL_KEEP_ESTABLISHED } else { 0 };
        let isolated = POL_ISOLATED_INGRESS | POL_ISOLATED_EGRESS;
        let stale: Vec<(u32, u32)> = self
            .states
            .iter()
            .filter(|(_, s)| s.flags & isolated != 0 && s.flags & POL_KEEP_ESTABLISHED != self.keep)
            .map(|(slot, s)| (*slot, (s.flags & !POL_KEEP_ESTABLISHED) | self.keep))
            .collect();
        for (slot, flags) in stale {
            let generation = self.next_generation();
            self.write_state(slot, PolicyState { flags, generation })?;
        }
        Ok(())
    }

    /// The state flags of an endpoint isolated as `iso` says (ingress, egress).
    fn flags(&self, iso: (bool, bool)) -> u32 {
        match flags(iso) {
            0 => 0,
            f => f | self.keep,
        }
    }

    /// An identity of the agent's tables as the maps hold it.
    fn shifted(&self, identity: u32) -> u32 {
        match identity {
            POLICY_WORLD | POLICY_ANY_PEER | POLICY_SERVICE => identity,
            i => i.saturating_add(self.offset).min(POLICY_SERVICE - 1),
        }
    }

    /// The tables the maps should hold for `desired` with the pods' endpoints in the slots
    /// `slots` says.
    fn target(&self, desired: &Tables, slots: &[(PodKey, u32)]) -> Tables<u32> {
        let shift_entries = |e: &Entries| {
            e.as_ref().map(|m| {
                m.iter()
                    .map(|(k, r)| {
                        let k = EntryKey {
                            identity: self.shifted(k.identity),
                            ..*k
                        };
                        (k, *r)
                    })
                    .collect()
            })
        };
        Tables {
            prefixes: with_services(&desired.prefixes, &self.services)
                .iter()
                .map(|(n, i)| (*n, self.shifted(*i)))
                .collect(),
            endpoints: slots
                .iter()
                .map(|(pod, slot)| {
                    let t = match desired.endpoints.get(pod) {
                        Some(t) => EndpointTables {
                            ingress: shift_entries(&t.ingress),
                            egress: shift_entries(&t.egress),
                        },
                        // A pod the calculation does not know (yet: its Pod object not seen
                        // when its CNI ADD came, or gone already): isolated both ways with no
                        // rule. Fail closed; its node still reaches it.
                        None => EndpointTables {
                            ingress: Some(Default::default()),
                            egress: Some(Default::default()),
                        },
                    };
                    (*slot, t)
                })
                .collect(),
            rules: desired.rules.clone(),
        }
    }

    /// Moves the maps to `desired`, for the endpoints attached (`slots`: each one's pod and
    /// slot). A failed write stops there; the next call plans again from what the maps hold.
    pub fn set(&mut self, desired: Tables, slots: &[(PodKey, u32)]) -> Result<(), DataplaneError> {
        if self.desired.is_none() {
            // The pins' entries name the rules by an agent before's numbers.
            self.maps.clear_hits();
        }
        let target = self.target(&desired, slots);
        self.desired = Some(desired);
        self.move_to(target).map_err(|e| name_pods(e, slots))
    }

    /// The endpoints attached changed (`slots`: each one's pod and slot; one attached, or its
    /// pod known): their entries and isolation as desired. Nothing until the agent has said
    /// what it wants (the pins stay as they are).
    pub fn attached(&mut self, slots: &[(PodKey, u32)]) -> Result<(), DataplaneError> {
        let Some(desired) = &self.desired else {
            return Ok(());
        };
        let target = self.target(desired, slots);
        self.move_to(target).map_err(|e| name_pods(e, slots))
    }

    /// The endpoint in `slot` is gone: its entries go, its state opens (under a new
    /// generation), its records of openers are forgotten.
    pub fn detached(&mut self, slot: u32) {
        let mut target = self.applied.clone();
        target.endpoints.remove(&slot);
        // A slot with a state opens with it (`move_to`); one without may have been isolated
        // before, and records stay until forgotten: it opens here.
        let stated = self.states.contains_key(&slot);
        let opened = match self.move_to(target) {
            Ok(()) if stated => Ok(()),
            Ok(()) => self.open(&[slot]),
            Err(e) => {
                tracing::warn!(slot, error = %e, "policy entries of a removed endpoint");
                self.open(&[slot])
            }
        };
        if let Err(e) = opened {
            tracing::warn!(slot, error = %e, "policy state of a removed endpoint");
        }
    }

    /// Opens `slots`, which no endpoint holds any more, for whoever gets them next: no records
    /// of openers, and a generation of its own rather than zero. The pins then keep the
    /// highest generation ever handed out, and a restarted agent starts above it
    /// ([`Self::restore`]); and whatever the programs keep by generation and pair of slots
    /// (the SYN memo's rules and records, flows not to be checked again) is the last
    /// endpoint's, never the next one's, also across a restart.
    /// (One walk of the records for all of them.)
    fn open(&mut self, slots: &[u32]) -> Result<(), DataplaneError> {
        let mut opened = Vec::with_capacity(slots.len());
        let mut result = Ok(());
        for &slot in slots {
            let open = PolicyState {
                flags: 0,
                generation: self.next_generation(),
            };
            if let Err(e) = self.maps.set_state(slot, open) {
                result = Err(e);
                break;
            }
            self.states.remove(&slot);
            opened.push(slot);
        }
        if !opened.is_empty() {
            self.maps.forget_openers(&opened);
        }
        result
    }

    fn next_generation(&mut self) -> u32 {
        self.generation = self.generation.wrapping_add(1).max(1);
        self.generation
    }

    fn write_state(&mut self, slot: u32, s: PolicyState) -> Result<(), DataplaneError> {
        if self.states.get(&slot).copied().unwrap_or_default() == s {
            return Ok(());
        }
        self.maps.set_state(slot, s)?;
        if s == PolicyState::default() {
            self.states.remove(&slot);
        } else {
            self.states.insert(slot, s);
        }
        Ok(())
    }

    fn move_to(&mut self, target: Tables<u32>) -> Result<(), DataplaneError> {
        let p = plan(&self.applied, &target);
        let state = |me: &Self, slot: u32| me.states.get(&slot).copied().unwrap_or_default();
        for (slot, iso) in &p.open {
            let s = PolicyState {
                flags: self.flags(*iso),
                ..state(self, *slot)
            };
            self.write_state(*slot, s)?;
        }
        // An entry that cannot be written (a full map) is left out, and the endpoint still
        // becomes isolated: it denies what it cannot check. The other endpoints carry on.
        let mut failed: BTreeMap<(u32, Direction), Vec<EntryKey>> = BTreeMap::new();
        let mut first_error = None;
        for (e, rule) in &p.add_entries {
            if let Err(err) = self.maps.set_entry(e.endpoint, e.direction, &e.key, *rule) {
                failed
                    .entry((e.endpoint, e.direction))
                    .or_default()
                    .push(e.key);
                first_error.get_or_insert(err);
            }
        }
        for (net, id) in &p.set_prefixes {
            self.maps.set_prefix(*net, *id)?;
        }
        for net in &p.remove_prefixes {
            self.maps.remove_prefix(net);
        }
        for (slot, iso) in &p.isolation {
            // A slot with no state yet is isolated under a new generation at once, never
            // under zero, which every slot before it had had too.
            let generation = match self.states.get(slot) {
                Some(s) => s.generation,
                None => self.next_generation(),
            };
            let s = PolicyState {
                flags: self.flags(*iso),
                generation,
            };
            self.write_state(*slot, s)?;
        }
        for e in &p.remove_entries {
            self.maps.remove_entry(e.endpoint, e.direction, &e.key);
        }
        for slot in &p.recheck {
            let s = PolicyState {
                flags: state(self, *slot).flags,
                generation: self.next_generation(),
            };
            self.write_state(*slot, s)?;
        }
        // Slots no endpoint holds any more (detached, or deleted while no agent ran).
        let gone: Vec<u32> = self
            .states
            .keys()
            .filter(|s| !target.endpoints.contains_key(s))
            .copied()
            .collect();
        self.open(&gone)?;
        // What the maps hold: the target less what could not be written (the next call
        // tries those again).
        let mut target = target;
        for ((slot, d), keys) in &failed {
            let held = target.endpoints.get_mut(slot).and_then(|t| match d {
                Direction::Ingress => t.ingress.as_mut(),
                Direction::Egress => t.egress.as_mut(),
            });
            if let Some(m) = held {
                for k in keys {
                    m.remove(k);
                }
            }
        }
        for (slot, rule) in stale_hits(&self.applied, &target, &p) {
            self.maps.remove_hits(slot, rule);
        }
        self.applied = target;
        match first_error {
            None => Ok(()),
            Some(e) => Err(DataplaneError::PolicyIncomplete {
                pods: Vec::new(),
                slots: failed
                    .keys()
                    .map(|(s, _)| *s)
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect(),
                source: Box::new(e),
            }),
        }
    }

    /// What the maps hold now, by slot (for `calixctl` and tests).
    pub fn applied(&self) -> &Tables<u32> {
        &self.applied
    }
}

/// The (slot, rule) pairs `before` has entries of and `after` none: their hit counts go, so
/// that a rule's number handed out again (or a slot) starts from zero. Only the entries `p`
/// touches, and the endpoints that went, are looked at.
fn stale_hits(
    before: &Tables<u32>,
    after: &Tables<u32>,
    p: &Plan<u32>,
) -> std::collections::BTreeSet<(u32, RuleId)> {
    let rule_of = |t: &Tables<u32>, e: &EntryRef<u32>| {
        t.endpoints
            .get(&e.endpoint)
            .and_then(|x| x.direction(e.direction).as_ref())
            .and_then(|m| m.get(&e.key))
            .copied()
    };
    let rules = |t: &EndpointTables| -> Vec<RuleId> {
        [&t.ingress, &t.egress]
            .into_iter()
            .flatten()
            .flat_map(|m| m.values().copied())
            .collect()
    };
    let mut stale: std::collections::BTreeSet<(u32, RuleId)> = p
        .remove_entries
        .iter()
        .chain(p.add_entries.iter().map(|(e, _)| e))
        .filter_map(|e| Some((e.endpoint, rule_of(before, e)?)))
        .collect();
    for (slot, t) in &before.endpoints {
        if !after.endpoints.contains_key(slot) {
            stale.extend(rules(t).into_iter().map(|r| (*slot, r)));
        }
    }
    stale.retain(|(slot, rule)| {
        !after
            .endpoints
            .get(slot)
            .is_some_and(|t| rules(t).contains(rule))
    });
    stale
}

/// `e` with the pods of the slots it names (`slots`: each endpoint's pod and slot).
fn name_pods(e: DataplaneError, slots: &[(PodKey, u32)]) -> DataplaneError {
    match e {
        DataplaneError::PolicyIncomplete {
            slots: failed,
            source,
            ..
        } => DataplaneError::PolicyIncomplete {
            pods: slots
                .iter()
                .filter(|(_, s)| failed.contains(s))
                .map(|(p, _)| p.clone())
                .collect(),
            slots: failed,
            source,
        },
        other => other,
    }
}

/// NetworkPolicy in the eBPF dataplane (`[policy]`). The configured size is always the size in
/// effect: a pinned map of another size is replaced at start by one of this size, its entries
/// carried over (what does not fit is left out, and the agent's next programming reports the
/// endpoints it could not finish, which deny what is missing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicySettings {
    /// Allow entries of every endpoint of the node together (`CALIX_POLICY`, allocated as
    /// used).
    pub entries: u32,
    /// Flows of isolated endpoints remembered so that replies pass, per family
    /// (`CALIX_POL_FLOWS_V4`, `CALIX_POL_FLOWS`: LRUs allocated in full when created).
    pub flows: u32,
    /// A flow a change would refuse goes on until it goes idle (new flows meet the new
    /// rules); off: it is refused from its next packet.
    pub keep_established: bool,
}

impl Default for PolicySettings {
    fn default() -> Self {
        Self {
            entries: calix_common::DEFAULT_POLICY_ENTRIES,
            flows: calix_common::DEFAULT_POLICY_FLOWS,
            keep_established: false,
        }
    }
}
