//! SNAT for `natOutgoing` pools (eBPF dataplane): the settings map, the no-SNAT destinations,
//! the conntrack table's size, and the cleaner that removes expired flows. The programs
//! (`ebpf/programs/src/{nat,conntrack}.rs`) do the translation; see docs/decisions.md.
use std::collections::{BTreeSet, HashMap as StdHashMap};
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData, MapError, MapInfo};
use aya::Ebpf;
use calix_common::{
    CtEntry, CtKey, NatConfig, CT_DIR_REPLY, CT_FREED_MAP, CT_F_ACK, CT_F_FIN, CT_F_RST, CT_F_SEEN,
    CT_MAP, CT_OWNED_MAP, IPPROTO_TCP, IPPROTO_UDP, MAX_NAT_UPLINKS, MAX_NO_SNAT_CIDRS,
    NAT_CONFIG_MAP, NO_SNAT_V4_MAP,
};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::Serialize;

pub use super::bpf::monotonic_ns;
use super::bpf::{map_err, open_hash, take};
use super::{ifindex, DataplaneError};

/// What SNAT does on this node (from `[nat]` and the pools).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatSettings {
    /// IPv4 pools with `natOutgoing`: their pods' traffic is translated.
    pub nat_pools: Vec<Ipv4Net>,
    /// Destinations never translated: every pool and `non_masquerade_cidrs`.
    pub no_snat: Vec<Ipv4Net>,
    /// IPv4 `service_cidrs`: the host stack NATs them, so the programs leave them to it.
    pub service: Vec<Ipv4Net>,
    /// IPv6 `service_cidrs` (NetworkPolicy judges egress to every Service range after the
    /// stack's DNAT).
    pub service_v6: Vec<Ipv6Net>,
    /// Size of the conntrack map (entries; two per flow).
    pub conntrack_entries: u32,
    /// Flows one endpoint may hold (0: no limit).
    pub ct_budget: u32,
    /// Under pressure, how long an unanswered flow may stay idle.
    pub pressure_unanswered: Duration,
    pub timeouts: Timeouts,
    /// NAT ports, inclusive.
    pub port_min: u16,
    pub port_max: u16,
    /// The VXLAN device's UDP port (`[vxlan] port`; 0: none): its packets to the node skip
    /// the programs' NAT and Service lookups ([`NatConfig::tunnel_port`]).
    pub tunnel_port: u16,
    /// How often the cleaner runs.
    pub cleaner_interval: Duration,
}

/// Per-protocol idle timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp_established: Duration,
    pub tcp_syn: Duration,
    pub tcp_closing: Duration,
    pub udp: Duration,
    pub icmp: Duration,
}

impl NatSettings {
    /// Whether `addr` belongs to a `natOutgoing` pool.
    pub fn translates(&self, addr: Ipv4Addr) -> bool {
        self.nat_pools.iter().any(|p| p.contains(&addr))
    }

    /// The programs' view, with the uplinks' ifindexes (SNAT is off without a `natOutgoing`
    /// pool or an uplink).
    pub fn program_config(&self, uplinks: &[u32]) -> NatConfig {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let mut up = [0u32; MAX_NAT_UPLINKS];
        for (slot, idx) in up.iter_mut().zip(uplinks) {
            *slot = *idx;
        }
        NatConfig {
            tcp_established_ns: ns(self.timeouts.tcp_established),
            tcp_syn_ns: ns(self.timeouts.tcp_syn),
            tcp_closing_ns: ns(self.timeouts.tcp_closing),
            udp_ns: ns(self.timeouts.udp),
            icmp_ns: ns(self.timeouts.icmp),
            uplinks: up,
            port_min: self.port_min,
            port_max: self.port_max,
            enabled: u32::from(!self.nat_pools.is_empty() && up[0] != 0),
            ct_budget: self.ct_budget,
            tunnel_port: self.program_tunnel_port().to_be(),
            _pad: 0,
        }
    }

    /// The tunnel port the programs may pass to the stack unlooked at: 0 when it is one of
    /// the NAT ports (SNAT's replies come to those).
    fn program_tunnel_port(&self) -> u16 {
        if (self.port_min..=self.port_max).contains(&self.tunnel_port) {
            0
        } else {
            self.tunnel_port
        }
    }

    /// Every `service_cidrs` range, both families.
    pub fn services(&self) -> Vec<IpNet> {
        let v4 = self.service.iter().copied().map(IpNet::V4);
        v4.chain(self.service_v6.iter().copied().map(IpNet::V6))
            .collect()
    }

    /// Destinations the programs never translate (they go to the host stack): every pool,
    /// `non_masquerade_cidrs` and the IPv4 `service_cidrs`.
    pub fn untranslated(&self) -> Vec<Ipv4Net> {
        let mut v = self.no_snat.clone();
        v.extend(self.service.iter().filter(|n| !self.no_snat.contains(n)));
        v
    }

    /// The ports the host's own masquerade (of what the programs leave to the stack) uses
    /// in eBPF mode: the larger side of 1024–65535 outside `port_min..=port_max`, so a
    /// stack-translated flow never takes a tuple the programs could hand out.
    pub fn stack_masquerade_ports(&self) -> Option<(u16, u16)> {
        let above = (self.port_max < u16::MAX).then(|| (self.port_max + 1, u16::MAX));
        let below = (self.port_min > 1024).then(|| (1024, self.port_min - 1));
        let size = |r: Option<(u16, u16)>| r.map_or(0, |(a, b)| u32::from(b - a) + 1);
        if size(above) >= size(below) {
            above
        } else {
            below
        }
    }
}

/// The SNAT maps the agent writes.
pub struct NatMaps {
    config: Array<MapData, NatConfig>,
    no_snat: LpmTrie<MapData, [u8; 4], u32>,
}

impl NatMaps {
    /// Takes the maps out of the loaded object.
    pub fn open(bpf: &mut Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            config: take(bpf, NAT_CONFIG_MAP, Array::try_from)?,
            no_snat: take(bpf, NO_SNAT_V4_MAP, LpmTrie::try_from)?,
        })
    }

    /// Writes the settings: the no-SNAT destinations first (additions, then removals), then
    /// the config entry that turns SNAT on.
    pub fn apply(&mut self, s: &NatSettings, uplinks: &[String]) -> Result<(), DataplaneError> {
        self.set_no_snat(&s.untranslated())?;
        let mut idx = Vec::new();
        for u in uplinks.iter().take(MAX_NAT_UPLINKS) {
            idx.push(ifindex(u)?);
        }
        let cfg = s.program_config(&idx);
        self.config
            .set(0, cfg, 0)
            .map_err(map_err(NAT_CONFIG_MAP, "set"))?;
        tracing::info!(
            enabled = cfg.enabled != 0,
            nat_pools = ?s.nat_pools.iter().map(ToString::to_string).collect::<Vec<_>>(),
            no_snat = ?s.no_snat.iter().map(ToString::to_string).collect::<Vec<_>>(),
            services = ?s.service.iter().map(ToString::to_string).collect::<Vec<_>>(),
            budget = s.ct_budget,
            ports = %format!("{}-{}", s.port_min, s.port_max),
            "SNAT configured"
        );
        Ok(())
    }

    /// Brings the no-SNAT trie to `want` ([`NatSettings::untranslated`]; SIGHUP reloads it
    /// this way).
    pub fn set_no_snat(&mut self, want: &[Ipv4Net]) -> Result<(), DataplaneError> {
        let want: BTreeSet<(u32, [u8; 4])> = want
            .iter()
            .map(|n| (u32::from(n.prefix_len()), n.network().octets()))
            .collect();
        if want.len() > MAX_NO_SNAT_CIDRS as usize {
            return Err(map_err(NO_SNAT_V4_MAP, "fill")(MapError::OutOfBounds {
                index: want.len() as u32,
                max_entries: MAX_NO_SNAT_CIDRS,
            }));
        }
        let have: BTreeSet<(u32, [u8; 4])> = self
            .no_snat
            .keys()
            .filter_map(Result::ok)
            .map(|k| (k.prefix_len(), k.data()))
            .collect();
        for (len, addr) in want.difference(&have) {
            self.no_snat
                .insert(&Key::new(*len, *addr), 1, 0)
                .map_err(map_err(NO_SNAT_V4_MAP, "insert"))?;
        }
        for (len, addr) in have.difference(&want) {
            self.no_snat
                .remove(&Key::new(*len, *addr))
                .map_err(map_err(NO_SNAT_V4_MAP, "remove"))?;
        }
        Ok(())
    }
}

/// The pinned conntrack table, opened by path (the cleaner and `calixctl bpf conntrack` use
/// it beside the running programs), with the budget maps: the programs count the flows each
/// endpoint opened (`CALIX_CT_OWNED`), the agent the ones it removed (`CALIX_CT_FREED`).
pub struct Conntrack {
    map: HashMap<MapData, CtKey, CtEntry>,
    max_entries: u32,
    owned: HashMap<MapData, u32, u32>,
    freed: HashMap<MapData, u32, u32>,
}

/// Serialises the agent's read-modify-writes of `CALIX_CT_FREED` (the cleaner and
/// `calixctl bpf conntrack --flush` each hold a [`Conntrack`]).
static FREED_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The table is under pressure from this share of its entries on (three quarters): then
/// unanswered flows expire after `pressure_unanswered_secs`.
pub const PRESSURE_PERCENT: u64 = 75;

/// What a cleaner pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanPass {
    /// Entries in the table when the pass began.
    pub entries: usize,
    /// Entries removed.
    pub removed: usize,
    /// Whether the table was under pressure (unanswered flows went early).
    pub pressure: bool,
}

/// One translated flow, as `calixctl bpf conntrack` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlowView {
    pub proto: String,
    pub pod: String,
    pub pod_port: u16,
    pub dst: String,
    pub dst_port: u16,
    pub nat: String,
    pub nat_port: u16,
    /// syn_sent | syn_recv (answered, not yet acknowledged by the pod) | established |
    /// fin_pod (the pod's FIN seen, not the peer's) | fin_peer (the other way round) |
    /// fin_both | reset (a RST either way) | udp | icmp
    pub state: String,
    /// Seconds since the last packet either way.
    pub idle_secs: u64,
    /// Seconds until the cleaner removes it (0: expired).
    pub expires_in_secs: u64,
}

fn proto_name(p: u8) -> String {
    match p {
        IPPROTO_TCP => "tcp".into(),
        IPPROTO_UDP => "udp".into(),
        1 => "icmp".into(),
        other => other.to_string(),
    }
}

/// A flow: its reply entry and, when it still points back, its original entry.
struct Flow {
    rkey: CtKey,
    r: CtEntry,
    out: Option<(CtKey, CtEntry)>,
}

impl Flow {
    fn last(&self) -> u64 {
        let o = self.out.map_or(0, |(_, o)| o.last_seen_ns);
        o.max(self.r.last_seen_ns)
    }

    fn timeout(&self, cfg: &NatConfig) -> u64 {
        let of = self.out.map_or(0, |(_, o)| o.flags);
        cfg.timeout_ns(self.rkey.proto, of, Some(self.r.flags))
    }

    fn answered(&self) -> bool {
        let of = self.out.map_or(0, |(_, o)| o.flags);
        NatConfig::answered(self.rkey.proto, of, self.r.flags) && !self.closed()
    }

    fn closed(&self) -> bool {
        let of = self.out.map_or(0, |(_, o)| o.flags);
        self.rkey.proto == IPPROTO_TCP && NatConfig::tcp_closed(of, self.r.flags)
    }

    fn state(&self) -> &'static str {
        let of = self.out.map_or(0, |(_, o)| o.flags);
        match self.rkey.proto {
            IPPROTO_TCP if (of | self.r.flags) & CT_F_RST != 0 => "reset",
            IPPROTO_TCP if of & self.r.flags & CT_F_FIN != 0 => "fin_both",
            IPPROTO_TCP if of & CT_F_FIN != 0 => "fin_pod",
            IPPROTO_TCP if self.r.flags & CT_F_FIN != 0 => "fin_peer",
            IPPROTO_TCP if self.r.flags & CT_F_SEEN == 0 => "syn_sent",
            IPPROTO_TCP if of & CT_F_ACK == 0 => "syn_recv",
            IPPROTO_TCP => "established",
            IPPROTO_UDP => "udp",
            _ => "icmp",
        }
    }

    fn view(&self, cfg: &NatConfig, now: u64) -> FlowView {
        let idle = now.saturating_sub(self.last());
        let left = self.timeout(cfg).saturating_sub(idle);
        FlowView {
            proto: proto_name(self.rkey.proto),
            pod: Ipv4Addr::from(self.r.addr).to_string(),
            pod_port: u16::from_be(self.r.port),
            dst: Ipv4Addr::from(self.rkey.src).to_string(),
            dst_port: u16::from_be(self.rkey.sport),
            nat: Ipv4Addr::from(self.rkey.dst).to_string(),
            nat_port: u16::from_be(self.rkey.dport),
            state: self.state().into(),
            idle_secs: idle / 1_000_000_000,
            expires_in_secs: if self.closed() && left == 0 {
                0
            } else {
                left / 1_000_000_000
            },
        }
    }
}

/// Pairs reply entries with the original entries that point back at them; original entries
/// left over have lost their reply entry.
fn pair(entries: Vec<(CtKey, CtEntry)>) -> (Vec<Flow>, Vec<(CtKey, CtEntry)>) {
    let mut outs: StdHashMap<CtKey, CtEntry> = StdHashMap::new();
    let mut replies = Vec::new();
    for (k, v) in entries {
        if k.dir == CT_DIR_REPLY {
            replies.push((k, v));
        } else {
            outs.insert(k, v);
        }
    }
    let mut flows = Vec::new();
    for (rkey, r) in replies {
        let okey = rkey.original(r.addr, r.port);
        let out = match outs.get(&okey) {
            Some(o) if o.addr == rkey.dst && o.port == rkey.dport => {
                let o = *o;
                outs.remove(&okey);
                Some((okey, o))
            }
            _ => None,
        };
        flows.push(Flow { rkey, r, out });
    }
    (flows, outs.into_iter().collect())
}

/// Which keys of `entries` have expired at `now`: both entries of an expired flow, and
/// original entries without their reply entry once idle past their timeout. Under pressure
/// (`pressure`: how long an unanswered flow may idle then), unanswered flows (TCP: no
/// completed handshake; UDP, ICMP: no reply) and orphans go after that shorter time, so
/// answered flows keep the room.
pub fn expired(
    entries: Vec<(CtKey, CtEntry)>,
    cfg: &NatConfig,
    now: u64,
    pressure: Option<u64>,
) -> Vec<CtKey> {
    let (flows, orphans) = pair(entries);
    let early = |t: u64| pressure.map_or(t, |p| t.min(p));
    let mut out = Vec::new();
    for f in flows {
        let timeout = if f.answered() {
            f.timeout(cfg)
        } else {
            early(f.timeout(cfg))
        };
        if now.saturating_sub(f.last()) > timeout {
            out.push(f.rkey);
            if let Some((k, _)) = f.out {
                out.push(k);
            }
        }
    }
    for (k, o) in orphans {
        if now.saturating_sub(o.last_seen_ns) > early(cfg.timeout_ns(k.proto, o.flags, None)) {
            out.push(k);
        }
    }
    out
}

/// Filters for `calixctl bpf conntrack`.
#[derive(Debug, Clone, Default)]
pub struct FlowFilter {
    /// Matches the pod, destination or NAT address.
    pub ip: Option<Ipv4Addr>,
    pub proto: Option<u8>,
    /// Matches the pod, destination or NAT port.
    pub port: Option<u16>,
}

impl FlowFilter {
    fn matches(&self, f: &FlowView, proto: u8) -> bool {
        let ip_ok = self.ip.is_none_or(|ip| {
            let s = ip.to_string();
            f.pod == s || f.dst == s || f.nat == s
        });
        let port_ok = self
            .port
            .is_none_or(|p| f.pod_port == p || f.dst_port == p || f.nat_port == p);
        ip_ok && port_ok && self.proto.is_none_or(|p| p == proto)
    }
}

impl Conntrack {
    /// Opens the table pinned in `pin_dir` (the layout directory).
    pub fn open(pin_dir: &Path) -> Result<Self, DataplaneError> {
        let map: HashMap<MapData, CtKey, CtEntry> = open_hash(pin_dir, CT_MAP)?;
        let info = MapInfo::from_pin(pin_dir.join(CT_MAP)).map_err(map_err(CT_MAP, "info"))?;
        Ok(Self {
            map,
            max_entries: info.max_entries(),
            owned: open_hash(pin_dir, CT_OWNED_MAP)?,
            freed: open_hash(pin_dir, CT_FREED_MAP)?,
        })
    }

    fn entries(&self) -> Vec<(CtKey, CtEntry)> {
        // Entries removed while iterating end the walk early at worst; the next pass sees
        // the rest.
        self.map.iter().filter_map(Result::ok).collect()
    }

    /// Removes the entry `k` if it still holds `was` (a flow the programs replaced meanwhile
    /// stays); a reply entry's removal settles its owner's budget (into `freed`).
    fn remove_if(&mut self, k: &CtKey, was: &CtEntry, freed: &mut StdHashMap<u32, u32>) -> bool {
        match self.map.get(k, 0) {
            Ok(now) if now.addr == was.addr && now.port == was.port => {}
            _ => return false,
        }
        if self.map.remove(k).is_err() {
            return false;
        }
        if k.dir == CT_DIR_REPLY && was.owner != 0 {
            *freed.entry(was.owner).or_default() += 1;
        }
        true
    }

    /// Adds `freed` to the endpoints' counts of flows the agent removed (endpoints the
    /// programs still count only: a gone endpoint's entries went with it).
    fn settle(&mut self, freed: StdHashMap<u32, u32>) {
        let _guard = FREED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        for (owner, n) in freed {
            if self.owned.get(&owner, 0).is_err() {
                continue;
            }
            let was = self.freed.get(&owner, 0).unwrap_or(0);
            if let Err(e) = self.freed.insert(owner, was.wrapping_add(n), 0) {
                tracing::warn!(owner, error = %e, "cannot record freed conntrack flows");
            }
        }
    }

    /// Removes expired flows (under pressure, from [`PRESSURE_PERCENT`] of the table on,
    /// unanswered ones after `pressure_unanswered`).
    pub fn clean(&mut self, cfg: &NatConfig, pressure_unanswered: Duration) -> CleanPass {
        let now = monotonic_ns();
        let entries = self.entries();
        let n = entries.len();
        let pressure = n as u64 * 100 >= u64::from(self.max_entries) * PRESSURE_PERCENT;
        let early = pressure.then(|| u64::try_from(pressure_unanswered.as_nanos()).unwrap_or(0));
        let snapshot: StdHashMap<CtKey, CtEntry> = entries.iter().copied().collect();
        let gone = expired(entries, cfg, now, early);
        let mut freed = StdHashMap::new();
        let mut removed = 0;
        for k in &gone {
            if let Some(was) = snapshot.get(k) {
                if self.remove_if(k, was, &mut freed) {
                    removed += 1;
                }
            }
        }
        self.settle(freed);
        CleanPass {
            entries: n,
            removed,
            pressure,
        }
    }

    /// The flows matching `filter`, sorted.
    pub fn flows(&self, cfg: &NatConfig, filter: &FlowFilter) -> Vec<FlowView> {
        let now = monotonic_ns();
        let (flows, _) = pair(self.entries());
        let mut v: Vec<FlowView> = flows
            .iter()
            .map(|f| (f.view(cfg, now), f.rkey.proto))
            .filter(|(v, p)| filter.matches(v, *p))
            .map(|(v, _)| v)
            .collect();
        v.sort_by(|a, b| {
            (&a.pod, a.pod_port, &a.dst, a.dst_port, &a.proto)
                .cmp(&(&b.pod, b.pod_port, &b.dst, b.dst_port, &b.proto))
        });
        v
    }

    /// Removes the flows matching `filter` (both entries; original entries without a reply
    /// entry too when the filter is empty). Returns how many flows went.
    pub fn flush(&mut self, cfg: &NatConfig, filter: &FlowFilter) -> usize {
        let now = monotonic_ns();
        let (flows, orphans) = pair(self.entries());
        let mut n = 0;
        let mut freed = StdHashMap::new();
        for f in flows {
            if filter.matches(&f.view(cfg, now), f.rkey.proto) {
                self.remove_if(&f.rkey, &f.r, &mut freed);
                if let Some((k, o)) = f.out {
                    self.remove_if(&k, &o, &mut freed);
                }
                n += 1;
            }
        }
        if filter.ip.is_none() && filter.port.is_none() && filter.proto.is_none() {
            for (k, o) in orphans {
                self.remove_if(&k, &o, &mut freed);
            }
        }
        self.settle(freed);
        n
    }
}

#[cfg(test)]
mod tests;
