//! The host stack's part of NetworkPolicy on Service traffic in the eBPF dataplane: one
//! nftables table, `inet calix_pending`.
//!
//! `from_pod` leaves the egress verdict on a packet to a Service address to after the host
//! stack's DNAT: it marks the packet with the sender's slot (`calix_common::POLICY_PENDING_MARK`)
//! and the first calix hook the packet meets afterwards judges it against the backend the
//! stack chose — `to_pod` on a pod's veth, `to_host_dev` on an uplink or a VXLAN device. A
//! marked packet the stack delivers to the node itself (a Service whose backend is on this
//! node's own addresses), or forwards out of an interface without calix's programs, meets no
//! such hook: this table drops it (fail closed: the pod's policy could not be checked there).
//! Stateless, like the doors' table: no `ct` match.
use calix_common::{POLICY_PENDING_MARK, POLICY_PENDING_MASK};
use calix_kernel::nft::{Chain, CmpOp, Family, Hook, Rule, Table};

use super::DataplaneError;

pub const TABLE: &str = "calix_pending";
pub const FAMILY: Family = Family::Inet;

/// The table, with `judged`: the interfaces whose tc programs judge a marked packet besides
/// the pods' `cali*` veths (the uplinks, the VXLAN devices).
pub fn table(judged: &[String]) -> Table {
    let marked =
        || Rule::builder(FAMILY).mark_masked(POLICY_PENDING_MASK, CmpOp::Eq, POLICY_PENDING_MARK);
    // meta mark & 0xc0000000 == 0x80000000 oifname != "cali*" oifname != "<dev>" … counter drop
    let mut out = marked().oifname(CmpOp::Neq, "cali*");
    for dev in judged {
        out = out.oifname(CmpOp::Neq, dev);
    }
    Table::new(FAMILY, TABLE)
        .with_comment("calix: Service traffic whose NetworkPolicy verdict the eBPF programs cannot take; calix-agent --uninstall removes it")
        // meta mark & 0xc0000000 == 0x80000000 counter drop
        .with_chain(Chain::filter("input", Hook::Input).with_rule(marked().counter().drop()))
        .with_chain(Chain::filter("forward", Hook::Forward).with_rule(out.counter().drop()))
}

/// Installs (or replaces) the table in the agent's network namespace.
pub fn apply(judged: &[String]) -> Result<(), DataplaneError> {
    super::nft::apply(&table(judged))
}

/// Deletes the table (if there is one).
pub fn remove() -> Result<(), DataplaneError> {
    super::nft::remove(FAMILY, TABLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(r: &Rule) -> Vec<String> {
        r.exprs.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn marked_packets_the_programs_cannot_judge_are_dropped() {
        let t = table(&["eth0".into(), "vxlan.calix".into()]);
        assert_eq!(t.id(), "inet calix_pending");
        t.validate().expect("valid");
        let mark = [
            "[ meta load mark => reg 1 ]",
            "[ bitwise reg 1 = ( reg 1 & 0xc0000000 ) ^ 0x00000000 ]",
            "[ cmp eq reg 1 0x80000000 ]",
        ];
        let input = t.chain("input").expect("input");
        assert_eq!(input.base.as_ref().map(|b| b.hook), Some(Hook::Input));
        let want: Vec<&str> = mark
            .iter()
            .copied()
            .chain(["[ counter pkts 0 bytes 0 ]", "[ immediate reg 0 drop ]"])
            .collect();
        assert_eq!(lines(&input.rules[0]), want);
        let forward = t.chain("forward").expect("forward");
        let got = lines(&forward.rules[0]);
        assert_eq!(&got[..3], &mark);
        assert_eq!(
            got.iter()
                .filter(|l| l.contains("meta load oifname"))
                .count(),
            3,
            "cali*, eth0, vxlan.calix: {got:?}"
        );
        assert_eq!(
            got.last().map(String::as_str),
            Some("[ immediate reg 0 drop ]")
        );
    }
}
