//! SNAT for `natOutgoing` pools (eBPF dataplane): the settings map, the no-SNAT destinations,
//! the conntrack table's size, and the cleaner that removes expired flows. The programs
//! (`ebpf/programs/src/{nat,conntrack}.rs`) do the translation; see docs/decisions.md.
use std::collections::{BTreeSet, HashMap as StdHashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, MapError, MapInfo};
use aya::{Ebpf, EbpfLoader};
use calix_common::{
    CtEntry, CtKey, NatConfig, CT_DIR_OUT, CT_DIR_REPLY, CT_F_FIN, CT_F_RST, CT_F_SEEN, CT_MAP,
    IPPROTO_TCP, IPPROTO_UDP, MAX_NAT_UPLINKS, MAX_NO_SNAT_CIDRS, NAT_CONFIG_MAP, NO_SNAT_V4_MAP,
};
use ipnet::Ipv4Net;
use serde::Serialize;

use super::ebpf::{map_err, take};
use super::{ifindex, DataplaneError};

/// What SNAT does on this node (from `[nat]` and the pools).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatSettings {
    /// IPv4 pools with `natOutgoing`: their pods' traffic is translated.
    pub nat_pools: Vec<Ipv4Net>,
    /// Destinations never translated: every pool and `non_masquerade_cidrs`.
    pub no_snat: Vec<Ipv4Net>,
    /// Size of the conntrack map (entries; two per flow).
    pub conntrack_entries: u32,
    pub timeouts: Timeouts,
    /// NAT ports, inclusive.
    pub port_min: u16,
    pub port_max: u16,
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
        }
    }
}

/// Before the object loads: gives the conntrack map its configured size. A pinned map of
/// another size is removed (its flows are lost: logged), so the configured size always holds.
pub fn prepare(loader: &mut EbpfLoader, pin_dir: &Path, entries: u32) {
    let pin = pin_dir.join(CT_MAP);
    if let Ok(info) = MapInfo::from_pin(&pin) {
        if info.max_entries() != entries {
            tracing::warn!(pinned = info.max_entries(), configured = entries,
                "nat.conntrack_entries changed: recreating the conntrack table (translated flows restart)");
            if let Err(e) = std::fs::remove_file(&pin) {
                tracing::warn!(pin = %pin.display(), error = %e, "cannot remove the old conntrack pin");
            }
        }
    }
    loader.set_max_entries(CT_MAP, entries);
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
        self.set_no_snat(&s.no_snat)?;
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
            ports = %format!("{}-{}", s.port_min, s.port_max),
            "SNAT configured"
        );
        Ok(())
    }

    /// Brings the no-SNAT trie to `want` (SIGHUP reloads it this way).
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

/// The pinned conntrack table, opened by path (the cleaner and `calixctl bpf conntrack` use
/// it beside the running programs).
pub struct Conntrack {
    map: HashMap<MapData, CtKey, CtEntry>,
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
    /// syn_sent | established | closing | udp | icmp
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

/// The original key of the flow whose reply entry is (`rkey`, `r`).
fn out_key(rkey: &CtKey, r: &CtEntry) -> CtKey {
    let ported = rkey.proto == IPPROTO_TCP || rkey.proto == IPPROTO_UDP;
    CtKey {
        src: r.addr,
        dst: rkey.src,
        sport: r.port,
        dport: if ported { rkey.sport } else { r.port },
        proto: rkey.proto,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
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

    fn closed(&self) -> bool {
        let of = self.out.map_or(0, |(_, o)| o.flags);
        self.rkey.proto == IPPROTO_TCP && NatConfig::tcp_closed(of, self.r.flags)
    }

    fn state(&self) -> &'static str {
        let of = self.out.map_or(0, |(_, o)| o.flags);
        match self.rkey.proto {
            IPPROTO_TCP if (of | self.r.flags) & (CT_F_FIN | CT_F_RST) != 0 => "closing",
            IPPROTO_TCP if self.r.flags & CT_F_SEEN == 0 => "syn_sent",
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
        let okey = out_key(&rkey, &r);
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
/// original entries without their reply entry once idle past their timeout.
pub fn expired(entries: Vec<(CtKey, CtEntry)>, cfg: &NatConfig, now: u64) -> Vec<CtKey> {
    let (flows, orphans) = pair(entries);
    let mut out = Vec::new();
    for f in flows {
        if now.saturating_sub(f.last()) > f.timeout(cfg) {
            out.push(f.rkey);
            if let Some((k, _)) = f.out {
                out.push(k);
            }
        }
    }
    for (k, o) in orphans {
        if now.saturating_sub(o.last_seen_ns) > cfg.timeout_ns(k.proto, o.flags, None) {
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
        let path: PathBuf = pin_dir.join(CT_MAP);
        let data = MapData::from_pin(&path).map_err(map_err(CT_MAP, "open pin"))?;
        let map = HashMap::try_from(Map::HashMap(data)).map_err(map_err(CT_MAP, "open"))?;
        Ok(Self { map })
    }

    fn entries(&self) -> Vec<(CtKey, CtEntry)> {
        // Entries removed while iterating end the walk early at worst; the next pass sees
        // the rest.
        self.map.iter().filter_map(Result::ok).collect()
    }

    /// Removes expired flows; returns how many entries went.
    pub fn clean(&mut self, cfg: &NatConfig) -> usize {
        let now = monotonic_ns();
        let gone = expired(self.entries(), cfg, now);
        let mut n = 0;
        for k in &gone {
            if self.map.remove(k).is_ok() {
                n += 1;
            }
        }
        n
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
        for f in flows {
            if filter.matches(&f.view(cfg, now), f.rkey.proto) {
                let _ = self.map.remove(&f.rkey);
                if let Some((k, _)) = f.out {
                    let _ = self.map.remove(&k);
                }
                n += 1;
            }
        }
        if filter.ip.is_none() && filter.port.is_none() && filter.proto.is_none() {
            for (k, _) in orphans {
                let _ = self.map.remove(&k);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn cfg() -> NatConfig {
        NatConfig {
            tcp_established_ns: 100 * S,
            tcp_syn_ns: 20 * S,
            tcp_closing_ns: 5 * S,
            udp_ns: 30 * S,
            icmp_ns: 10 * S,
            uplinks: [0; MAX_NAT_UPLINKS],
            port_min: 20000,
            port_max: 20100,
            enabled: 1,
        }
    }

    /// Both entries of a TCP flow pod 10.0.0.1:5000 → 192.0.2.9:80 via 192.0.2.1:20001.
    fn tcp_flow(
        out_flags: u16,
        reply_flags: u16,
        out_t: u64,
        reply_t: u64,
    ) -> Vec<(CtKey, CtEntry)> {
        let (pod, dst, nat) = ([10, 0, 0, 1], [192, 0, 2, 9], [192, 0, 2, 1]);
        let (pp, dp, np) = (5000u16.to_be(), 80u16.to_be(), 20001u16.to_be());
        let okey = CtKey {
            src: pod,
            dst,
            sport: pp,
            dport: dp,
            proto: IPPROTO_TCP,
            dir: CT_DIR_OUT,
            _pad: [0; 2],
        };
        let rkey = CtKey {
            src: dst,
            dst: nat,
            sport: dp,
            dport: np,
            proto: IPPROTO_TCP,
            dir: CT_DIR_REPLY,
            _pad: [0; 2],
        };
        vec![
            (
                okey,
                CtEntry {
                    last_seen_ns: out_t,
                    addr: nat,
                    port: np,
                    flags: out_flags,
                    ..CtEntry::default()
                },
            ),
            (
                rkey,
                CtEntry {
                    last_seen_ns: reply_t,
                    addr: pod,
                    port: pp,
                    flags: reply_flags,
                    ..CtEntry::default()
                },
            ),
        ]
    }

    #[test]
    fn tcp_timeouts_follow_the_flags() {
        let c = cfg();
        // Established, idle 50 s: kept (100 s); SYN only, idle 50 s: gone (20 s).
        assert!(expired(tcp_flow(CT_F_SEEN, CT_F_SEEN, 50 * S, 60 * S), &c, 110 * S).is_empty());
        assert_eq!(
            expired(tcp_flow(CT_F_SEEN, 0, 50 * S, 50 * S), &c, 100 * S).len(),
            2
        );
        // FIN one way only: still established timing; both ways: closing (5 s).
        let fin = CT_F_SEEN | CT_F_FIN;
        assert!(expired(tcp_flow(fin, CT_F_SEEN, 50 * S, 50 * S), &c, 60 * S).is_empty());
        assert_eq!(
            expired(tcp_flow(fin, fin, 50 * S, 50 * S), &c, 60 * S).len(),
            2
        );
        // RST either way closes.
        let rst = CT_F_SEEN | CT_F_RST;
        assert_eq!(
            expired(tcp_flow(CT_F_SEEN, rst, 50 * S, 50 * S), &c, 56 * S).len(),
            2
        );
        // The later of the two directions counts.
        assert!(expired(tcp_flow(CT_F_SEEN, CT_F_SEEN, 0, 90 * S), &c, 150 * S).is_empty());
    }

    #[test]
    fn orphans_expire_and_views_read_back() {
        let c = cfg();
        let flow = tcp_flow(CT_F_SEEN, CT_F_SEEN, 10 * S, 12 * S);
        let only_out = vec![flow[0]];
        assert!(expired(only_out.clone(), &c, 20 * S).is_empty());
        assert_eq!(expired(only_out, &c, 40 * S), vec![flow[0].0]);
        let (flows, orphans) = pair(flow);
        assert!(orphans.is_empty());
        let v = flows[0].view(&c, 15 * S);
        assert_eq!(
            (
                v.pod.as_str(),
                v.pod_port,
                v.dst.as_str(),
                v.dst_port,
                v.nat.as_str(),
                v.nat_port
            ),
            ("10.0.0.1", 5000, "192.0.2.9", 80, "192.0.2.1", 20001)
        );
        assert_eq!(
            (v.state.as_str(), v.idle_secs, v.expires_in_secs),
            ("established", 3, 97)
        );
        let f = FlowFilter {
            port: Some(20001),
            ..Default::default()
        };
        assert!(f.matches(&v, IPPROTO_TCP));
        let f = FlowFilter {
            proto: Some(IPPROTO_UDP),
            ..Default::default()
        };
        assert!(!f.matches(&v, IPPROTO_TCP));
    }

    #[test]
    fn program_config_is_off_without_pools_or_uplinks() {
        let mut s = NatSettings {
            nat_pools: vec!["10.0.0.0/16".parse().expect("cidr")],
            no_snat: vec![],
            conntrack_entries: 1024,
            timeouts: Timeouts {
                tcp_established: Duration::from_secs(1),
                tcp_syn: Duration::from_secs(1),
                tcp_closing: Duration::from_secs(1),
                udp: Duration::from_secs(1),
                icmp: Duration::from_secs(1),
            },
            port_min: 1,
            port_max: 2,
            cleaner_interval: Duration::from_secs(1),
        };
        assert_eq!(s.program_config(&[7]).enabled, 1);
        assert_eq!(s.program_config(&[7]).uplinks[0], 7);
        assert_eq!(s.program_config(&[]).enabled, 0);
        s.nat_pools.clear();
        assert_eq!(s.program_config(&[7]).enabled, 0);
        assert!(!s.translates(Ipv4Addr::new(10, 0, 0, 1)));
    }
}
