//! NetworkPolicy in kernel mode: one nftables table, `inet calix_policy`, written whole in one
//! transaction from calix-core's tables (the same calculation the eBPF dataplane programs),
//! so that a change is atomic: no packet sees half of it.
//!
//! - **Sets.** Each identity's addresses as interval sets, `id<N>_4` and `id<N>_6`
//!   (`calix_core::policy::ranges`: the longest-prefix table as disjoint ranges).
//! - **Hooks.** `forward` (pod to pod on this node or another, pods and the outside world, a
//!   Service's traffic after kube-proxy's DNAT: the verdict is on the backend), `input` (a pod
//!   to the node) and `output` (the node to a pod: always allowed, as Kubernetes says, so that
//!   probes work; the pod's answers too). A packet from a pod's `cali*` veth goes to its
//!   endpoint's `out` chain, one to a pod's veth to its `in` chain (both, pod to pod).
//! - **Per endpoint and isolated direction**, a chain of the entries that allow: peer set,
//!   protocol, port range, `return`; then `drop`. Each is written twice: for the packets that
//!   open a connection in that direction (`ct direction original`), and for its replies
//!   (`ct direction reply`, the addresses and ports swapped).
//! - **Judged once per table**: a packet that passes every chain marks its connection with the
//!   table's generation (16 bits of the `ct mark`, the rest kept); the connection's later
//!   packets, both ways, go on at the hook's first rule. A new table (any change) has a new
//!   generation, so every connection is judged again on its next packet: a change that revokes
//!   a connection refuses that packet, both ways, not only new connections (the `ct state
//!   established accept` shortcut is how Calico keeps a revoked flow going, calico#6399).
//! - A pod the calculation does not know (yet) is isolated both ways with no rule: fail closed;
//!   its node still reaches it.
//!
//! The table is written once the agent has said what it wants: until then (an agent restart)
//! the table of the agent before stays in force, untouched.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use calix_core::policy::model::PodKey;
use calix_core::policy::ranges::identity_ranges;
use calix_core::policy::tables::{EndpointTables, EntryKey, Identity, RuleId, Tables, ANY_PEER};
use calix_kernel::nft::{
    Addr, Chain, CmpOp, CtDirection, Element, Family, Hook, KeyType, Rule, Set, Table, Verdict,
};

use super::DataplaneError;

pub const TABLE: &str = "calix_policy";
pub const FAMILY: Family = Family::Inet;

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_SCTP: u8 = 132;

/// The bits of a connection's `ct mark` that say under which table it was judged.
pub const MARK_MASK: u32 = 0xffff_0000;

/// The `ct mark` bits of table generation `generation` (never 0: a connection no table judged).
pub fn mark_of(generation: u32) -> u32 {
    ((generation % 0xffff) + 1) << 16
}

fn set_name(id: Identity, v6: bool) -> String {
    format!("id{id}_{}", if v6 { 6 } else { 4 })
}

fn addr_bytes(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The table for `t`, its endpoints named by their host veth; `open`: the host veths of
/// endpoints no pod owns (outside Kubernetes: never policed). A packet of any other `cali*`
/// interface is dropped (fail closed: an endpoint the agent has not attached yet).
/// `mark`: this table's [`mark_of`] its generation.
pub fn table(t: &Tables<String>, open: &[String], mark: u32) -> Table {
    let rule = || Rule::builder(FAMILY);
    let mut table = Table::new(FAMILY, TABLE).with_comment(
        "calix: NetworkPolicy (kernel dataplane); calix-agent --uninstall removes it",
    );
    let mut sets: BTreeSet<(Identity, bool)> = BTreeSet::new();
    for (id, ranges) in identity_ranges(&t.prefixes) {
        for v6 in [false, true] {
            let elements: Vec<Element> = ranges
                .iter()
                .filter(|(a, _)| a.is_ipv6() == v6)
                .map(|(a, b)| Element::range(addr_bytes(*a), addr_bytes(*b)))
                .collect();
            if elements.is_empty() {
                continue;
            }
            let key = if v6 {
                KeyType::IPV6_ADDR
            } else {
                KeyType::IPV4_ADDR
            };
            let mut set = Set::new(set_name(id, v6), key);
            set.interval = true;
            set.elements = elements;
            table = table.with_set(set);
            sets.insert((id, v6));
        }
    }
    let jump = |c: &str| Verdict::Jump(c.to_string());
    // A connection judged under this table already: on at once (`ct mark`, see [`mark_of`]).
    let judged = || rule().ct_mark_masked(MARK_MASK, CmpOp::Eq, mark).accept();
    let mark_if = |from: bool| {
        let r = if from {
            rule().iifname(CmpOp::Eq, "cali*")
        } else {
            rule().oifname(CmpOp::Eq, "cali*")
        };
        r.ct_mark_set_masked(MARK_MASK, mark).build()
    };
    let from = || {
        rule()
            .iifname(CmpOp::Eq, "cali*")
            .verdict(jump("from_pods"))
    };
    let to = || rule().oifname(CmpOp::Eq, "cali*").verdict(jump("to_pods"));
    table = table
        .with_chain(
            Chain::filter("forward", Hook::Forward)
                .with_rule(judged())
                .with_rule(from())
                .with_rule(to())
                .with_rule(mark_if(true))
                .with_rule(mark_if(false)),
        )
        .with_chain(
            Chain::filter("input", Hook::Input)
                // A pod answering the node (a probe): always.
                .with_rule(
                    rule()
                        .iifname(CmpOp::Eq, "cali*")
                        .ct_direction(CmpOp::Eq, CtDirection::Reply)
                        .accept(),
                )
                .with_rule(judged())
                .with_rule(from())
                .with_rule(mark_if(true)),
        )
        .with_chain(
            Chain::filter("output", Hook::Output)
                // The node's own connections to its pods: always.
                .with_rule(
                    rule()
                        .oifname(CmpOp::Eq, "cali*")
                        .ct_direction(CmpOp::Eq, CtDirection::Original)
                        .accept(),
                )
                .with_rule(judged())
                .with_rule(to())
                .with_rule(mark_if(false)),
        );
    let mut from_pods = Chain::regular("from_pods");
    let mut to_pods = Chain::regular("to_pods");
    for (ifname, ep) in &t.endpoints {
        let goto = |c: String| Verdict::Goto(c);
        from_pods = from_pods.with_rule(
            rule()
                .iifname(CmpOp::Eq, ifname)
                .verdict(goto(format!("{ifname}_out"))),
        );
        to_pods = to_pods.with_rule(
            rule()
                .oifname(CmpOp::Eq, ifname)
                .verdict(goto(format!("{ifname}_in"))),
        );
        for chain in endpoint_chains(ifname, ep, &sets) {
            table = table.with_chain(chain);
        }
    }
    for ifname in open {
        from_pods = from_pods.with_rule(rule().iifname(CmpOp::Eq, ifname).verdict(Verdict::Return));
        to_pods = to_pods.with_rule(rule().oifname(CmpOp::Eq, ifname).verdict(Verdict::Return));
    }
    table
        .with_chain(from_pods.with_rule(rule().counter().drop()))
        .with_chain(to_pods.with_rule(rule().counter().drop()))
}

/// One endpoint's chains: `<if>_out` (what the pod sends), `<if>_in` (what it is sent), and
/// per isolated direction its entries, for the packets that open connections that way and
/// for their replies.
fn endpoint_chains(
    ifname: &str,
    ep: &EndpointTables,
    sets: &BTreeSet<(Identity, bool)>,
) -> Vec<Chain> {
    let rule = || Rule::builder(FAMILY);
    let reply = || rule().ct_direction(CmpOp::Eq, CtDirection::Reply);
    let jump = |c: &str| Verdict::Jump(format!("{ifname}_{c}"));
    let mut chains = Vec::new();
    // What the pod sends: a reply meets its ingress (swapped), the rest its egress.
    let mut out = Chain::regular(format!("{ifname}_out"));
    // What it is sent: a reply meets its egress (swapped), the rest its ingress.
    let mut inn = Chain::regular(format!("{ifname}_in"));
    if let Some(entries) = &ep.ingress {
        // Opening, to the pod: the peer is the source, the pod's port the destination.
        chains.push(entry_chain(
            &format!("{ifname}_ing"),
            entries,
            Addr::Source,
            false,
            sets,
        ));
        chains.push(entry_chain(
            &format!("{ifname}_ing_r"),
            entries,
            Addr::Destination,
            true,
            sets,
        ));
        out = out.with_rule(reply().verdict(jump("ing_r")));
    }
    if let Some(entries) = &ep.egress {
        // Opening, from the pod: the peer is the destination, its port the destination.
        chains.push(entry_chain(
            &format!("{ifname}_eg"),
            entries,
            Addr::Destination,
            false,
            sets,
        ));
        chains.push(entry_chain(
            &format!("{ifname}_eg_r"),
            entries,
            Addr::Source,
            true,
            sets,
        ));
        inn = inn.with_rule(reply().verdict(jump("eg_r")));
    }
    out = out.with_rule(reply().verdict(Verdict::Return));
    inn = inn.with_rule(reply().verdict(Verdict::Return));
    if ep.egress.is_some() {
        out = out.with_rule(rule().verdict(jump("eg")));
    }
    if ep.ingress.is_some() {
        inn = inn.with_rule(rule().verdict(jump("ing")));
    }
    chains.push(out);
    chains.push(inn);
    chains
}

/// A chain of `entries`, the peer's address in `peer` and the port that entries name in the
/// source port (`source_port`) or the destination port: each entry `return`s (the packet goes
/// on), and what none allows is dropped.
fn entry_chain(
    name: &str,
    entries: &BTreeMap<EntryKey, RuleId>,
    peer: Addr,
    source_port: bool,
    sets: &BTreeSet<(Identity, bool)>,
) -> Chain {
    let mut chain = Chain::regular(name);
    for (k, rule_id) in entries {
        let families: Vec<Option<bool>> = if k.identity == ANY_PEER {
            vec![None]
        } else {
            [false, true]
                .into_iter()
                .filter(|v6| sets.contains(&(k.identity, *v6)))
                .map(Some)
                .collect()
        };
        for family in families {
            let mut r = Rule::builder(FAMILY);
            if let Some(v6) = family {
                r = r.addr_in_set(v6, peer, &set_name(k.identity, v6), false);
            }
            if let Some(p) = k.proto {
                r = r.l4proto(CmpOp::Eq, p);
                if k.port_bits > 0 && matches!(p, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
                    let size = 1u32 << (16 - u32::from(k.port_bits.min(16)));
                    let hi = (u32::from(k.port) + size - 1).min(u32::from(u16::MAX)) as u16;
                    r = r.th_port_range(source_port, k.port, hi);
                }
            }
            chain = chain.with_rule(
                r.counter()
                    .comment(super::kernel_counts::rule_comment(*rule_id))
                    .verdict(Verdict::Return),
            );
        }
    }
    chain
        .with_rule(
            Rule::builder(FAMILY)
                .limit(LOG_PER_SECOND, LOG_BURST)
                .log_group(LOG_GROUP, format!("{LOG_PREFIX}{name}"), LOG_SNAPLEN)
                .build(),
        )
        .with_rule(
            Rule::builder(FAMILY)
                .counter()
                .comment(super::kernel_counts::DENY_COMMENT)
                .drop(),
        )
}

/// The `nfnetlink_log` group the endpoints' drops are logged to (`calixctl monitor --drops`;
/// Calico's own NFLOG groups are 1 and 2).
pub const LOG_GROUP: u16 = 2240;
/// How much of a dropped packet is logged: its IP and transport headers.
pub const LOG_SNAPLEN: u32 = 128;
/// Drops logged per second and chain (one endpoint's direction), and the burst: the rest are
/// counted (`deny`), not logged.
const LOG_PER_SECOND: u64 = 100;
const LOG_BURST: u32 = 100;
/// What a logged drop's prefix starts with; the chain's name follows.
const LOG_PREFIX: &str = "calix-policy ";

/// Where a logged drop ([`LOG_GROUP`]) was dropped, from its prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedDrop {
    /// The endpoint's host veth.
    pub ifname: String,
    /// Its ingress (else its egress) policy dropped it.
    pub ingress: bool,
    /// The pod sent it (else it was sent to the pod).
    pub pod_is_src: bool,
}

/// The drop a logged packet's prefix names; `None`: not one of this table's.
pub fn logged_drop(prefix: &str) -> Option<LoggedDrop> {
    let chain = prefix.strip_prefix(LOG_PREFIX)?;
    let (ifname, kind) = chain.rsplit_once('_').map(|(i, k)| match k {
        // `<if>_ing_r`, `<if>_eg_r`: the reply chains.
        "r" => i
            .rsplit_once('_')
            .map_or((i, k.to_string()), |(i, k)| (i, format!("{k}_r"))),
        _ => (i, k.to_string()),
    })?;
    let (ingress, pod_is_src) = match kind.as_str() {
        "ing" => (true, false),
        "ing_r" => (true, true),
        "eg" => (false, true),
        "eg_r" => (false, false),
        _ => return None,
    };
    (!ifname.is_empty()).then(|| LoggedDrop {
        ifname: ifname.to_string(),
        ingress,
        pod_is_src,
    })
}

/// Kernel mode's policy state: the endpoints (pod and host veth, by endpoint key) and what the
/// agent wants; [`KernelPolicy::table`] is what to write.
#[derive(Debug)]
pub struct KernelPolicy {
    endpoints: BTreeMap<String, (Option<PodKey>, String)>,
    desired: Option<Tables>,
    /// The generation of the table written last; the first from the clock, so that a
    /// restarted agent's table does not reuse the one before's (whose connections' marks
    /// would let them through unjudged).
    generation: std::cell::Cell<u32>,
    /// The rules' counts, kept across rewrites.
    counts: super::kernel_counts::KernelCounts,
}

impl Default for KernelPolicy {
    fn default() -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() ^ d.as_secs() as u32)
            .unwrap_or(0);
        Self {
            endpoints: BTreeMap::new(),
            desired: None,
            generation: std::cell::Cell::new(now),
            counts: Default::default(),
        }
    }
}

impl KernelPolicy {
    /// An endpoint of `pod` on `host_ifname` (`None`: not a pod's, never policed).
    pub fn attached(&mut self, key: &str, pod: Option<&PodKey>, host_ifname: &str) {
        self.endpoints
            .insert(key.to_string(), (pod.cloned(), host_ifname.to_string()));
    }

    pub fn detached(&mut self, key: &str) -> bool {
        self.endpoints.remove(key).is_some()
    }

    /// Keeps the endpoints on the host veths `known` only; whether any went.
    pub fn retain(&mut self, known: &[String]) -> bool {
        let before = self.endpoints.len();
        self.endpoints
            .retain(|_, (_, ifname)| known.contains(ifname));
        before != self.endpoints.len()
    }

    pub fn set(&mut self, desired: Tables) {
        self.desired = Some(desired);
    }

    /// The table to write, of a new generation; `None` until the agent has said what it
    /// wants.
    pub fn table(&self) -> Option<Table> {
        let desired = self.desired.as_ref()?;
        let endpoints = self
            .endpoints
            .values()
            .filter_map(|(pod, ifname)| {
                // A pod the calculation does not know (yet): isolated both ways, no rule.
                let t = desired
                    .endpoints
                    .get(pod.as_ref()?)
                    .cloned()
                    .unwrap_or(EndpointTables {
                        ingress: Some(Default::default()),
                        egress: Some(Default::default()),
                    });
                Some((ifname.clone(), t))
            })
            .collect();
        let open: Vec<String> = self
            .endpoints
            .values()
            .filter(|(pod, _)| pod.is_none())
            .map(|(_, ifname)| ifname.clone())
            .collect();
        Some(table(
            &Tables {
                prefixes: desired.prefixes.clone(),
                endpoints,
                rules: desired.rules.clone(),
            },
            &open,
            {
                let g = self.generation.get().wrapping_add(1);
                self.generation.set(g);
                mark_of(g)
            },
        ))
    }

    /// Writes the table (if the agent has said what it wants); whether it did. The counts of
    /// the table it replaces are kept ([`Self::counts`]).
    pub fn apply(&self) -> Result<bool, DataplaneError> {
        let Some(t) = self.table() else {
            return Ok(false);
        };
        let endpoints = self.endpoints.values().map(|(_, i)| i.clone()).collect();
        self.counts
            .rewrite(read_counts, &endpoints, || super::nft::apply(&t))
            .map(|()| true)
    }

    /// The rules' counts, for a reader apart from the dataplane.
    pub fn counts(&self) -> super::kernel_counts::KernelCounts {
        self.counts.clone()
    }
}

/// The counters of the table in force.
pub fn read_counts() -> Result<Vec<calix_kernel::nft::RuleCount>, DataplaneError> {
    Ok(calix_kernel::nft::counters(FAMILY, TABLE)?)
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    super::nft::remove(FAMILY, TABLE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_core::policy::tables::RuleRef;

    fn lines(r: &Rule) -> Vec<String> {
        r.exprs.iter().map(ToString::to_string).collect()
    }

    /// One endpoint isolated for ingress, one entry (identity 3, TCP 80–83): its chains, the
    /// identity's set, the entry both ways, and an unknown `cali*` interface dropped.
    #[test]
    fn an_isolated_endpoint_gets_its_entries_both_ways_and_strangers_are_dropped() {
        let key = EntryKey {
            identity: 3,
            proto: Some(IPPROTO_TCP),
            port: 80,
            port_bits: 14,
        };
        let t: Tables<String> = Tables {
            prefixes: [("10.1.0.0/24".parse().expect("net"), 3)].into(),
            endpoints: [(
                "cali1".to_string(),
                EndpointTables {
                    ingress: Some([(key, 1)].into()),
                    egress: None,
                },
            )]
            .into(),
            rules: BTreeMap::<RuleId, RuleRef>::new(),
        };
        let table = table(&t, &["cali9".to_string()], mark_of(7));
        table.validate().expect("valid");
        assert_eq!(table.id(), "inet calix_policy");
        let set = table.set("id3_4").expect("identity 3's IPv4 set");
        assert!(set.interval);
        assert_eq!(
            set.elements,
            [Element::range([10, 1, 0, 0], [10, 1, 0, 255])]
        );
        assert!(table.set("id3_6").is_none(), "no IPv6 address: no set");
        let chain = |n: &str| {
            table
                .chain(n)
                .unwrap_or_else(|| panic!("chain {n}"))
                .rules
                .iter()
                .map(lines)
                .collect::<Vec<_>>()
        };
        // Opening, to the pod: peer = source, the pod's port = destination; then the drop,
        // logged within a rate first.
        let ing = chain("cali1_ing");
        assert_eq!(ing.len(), 3);
        assert!(
            ing[0].contains(&"[ payload load 4b @ network header + 12 => reg 1 ]".to_string()),
            "{ing:?}"
        );
        assert!(
            ing[0].contains(&"[ lookup reg 1 set id3_4 ]".to_string()),
            "{ing:?}"
        );
        assert!(
            ing[0].contains(&"[ payload load 2b @ transport header + 2 => reg 1 ]".to_string()),
            "{ing:?}"
        );
        assert!(
            ing[0].contains(&"[ cmp gte reg 1 0x00005000 ]".to_string()),
            "{ing:?}"
        );
        assert!(
            ing[0].contains(&"[ cmp lte reg 1 0x00005300 ]".to_string()),
            "{ing:?}"
        );
        assert_eq!(
            ing[0].last().map(String::as_str),
            Some("[ immediate reg 0 return ]")
        );
        assert_eq!(
            ing[1],
            [
                "[ limit rate 100/second burst 100 packets ]",
                "[ log prefix \"calix-policy cali1_ing\" group 2240 snaplen 128 ]"
            ],
        );
        assert_eq!(
            ing[2].last().map(String::as_str),
            Some("[ immediate reg 0 drop ]")
        );
        // Its replies, from the pod: peer = destination, port = source.
        let ing_r = chain("cali1_ing_r");
        assert!(
            ing_r[0].contains(&"[ payload load 4b @ network header + 16 => reg 1 ]".to_string()),
            "{ing_r:?}"
        );
        assert!(
            ing_r[0].contains(&"[ payload load 2b @ transport header + 0 => reg 1 ]".to_string()),
            "{ing_r:?}"
        );
        // Not isolated for egress: no egress chains, replies to the pod go on.
        assert!(table.chain("cali1_eg").is_none());
        let inn = chain("cali1_in");
        assert_eq!(
            inn.len(),
            2,
            "reply: return; else the ingress entries: {inn:?}"
        );
        assert_eq!(
            inn[1].last().map(String::as_str),
            Some("[ immediate reg 0 jump -> cali1_ing ]")
        );
        // The dispatch: cali1 to its chains, cali9 (no pod) goes on, any other cali* dropped.
        let from = chain("from_pods");
        assert_eq!(from.len(), 3, "{from:?}");
        assert_eq!(
            from[0].last().map(String::as_str),
            Some("[ immediate reg 0 goto -> cali1_out ]")
        );
        assert_eq!(
            from[1].last().map(String::as_str),
            Some("[ immediate reg 0 return ]")
        );
        assert_eq!(
            from[2].last().map(String::as_str),
            Some("[ immediate reg 0 drop ]")
        );
    }

    /// A logged drop's prefix names its endpoint, its direction, and which way the packet
    /// went; other prefixes are not ours.
    #[test]
    fn a_logged_drop_names_its_endpoint_and_direction() {
        let d = |chain: &str| logged_drop(&format!("{LOG_PREFIX}{chain}"));
        let want = |ingress, pod_is_src| {
            Some(LoggedDrop {
                ifname: "cali0a1b2c3d4e5".into(),
                ingress,
                pod_is_src,
            })
        };
        assert_eq!(d("cali0a1b2c3d4e5_ing"), want(true, false));
        assert_eq!(d("cali0a1b2c3d4e5_ing_r"), want(true, true));
        assert_eq!(d("cali0a1b2c3d4e5_eg"), want(false, true));
        assert_eq!(d("cali0a1b2c3d4e5_eg_r"), want(false, false));
        for other in ["cali1_out", "cali1", "_ing", "_ing_r"] {
            assert_eq!(d(other), None, "{other}");
        }
        assert_eq!(logged_drop("other cali1_ing"), None);
        assert_eq!(logged_drop(""), None);
    }
}
