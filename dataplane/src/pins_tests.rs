//! pins.rs's unit tests (a file of their own: pins.rs stays under 700 lines).
use super::*;
use calix_common::{layout, CT_F_RST};

/// The built object's maps are exactly this layout's rows in `calix_common::LAYOUTS`:
/// changing a map (type, sizes, `max_entries`, flags) without a new `LAYOUT_VERSION` fails
/// here.
#[test]
fn the_object_matches_its_layout_version() {
    let specs = object_specs(crate::ebpf::OBJECT, &[]).expect("parse the object");
    let current = layout(LAYOUT_VERSION).expect("this layout's row");
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let mut rows: Vec<&str> = current.maps.iter().map(|m| m.name).collect();
    rows.sort_unstable();
    assert_eq!(
        names, rows,
        "the object pins exactly the maps of layout {LAYOUT_VERSION}"
    );
    for s in &specs {
        let want = MapSpec::from_layout(current.map(&s.name).expect("a row"));
        assert!(
            s.differences(&want).is_empty(),
            "{}: {:?}; bump LAYOUT_VERSION and add a row to LAYOUTS",
            s.name,
            s.differences(&want)
        );
    }
}

#[test]
fn legacy_entries_have_layout_1s_sizes() {
    let v1 = layout(1).expect("layout 1");
    let ct = v1.map(CT_MAP).expect("CT in layout 1");
    assert_eq!(std::mem::size_of::<CtEntryV1>() as u32, ct.value_size);
    assert_eq!(std::mem::size_of::<CtEntryV1Early>(), 16);
    for m in v1.maps {
        let have = MapSpec::from_layout(m);
        let carried = [CT_MAP, STACK_FLOWS_MAP, STACK_EPS_MAP].contains(&m.name);
        assert_eq!(convertible(m.name, &have), carried, "{}", m.name);
    }
    // Layout 2's marks and cleared marks (hashes by ifindex) are read for the new slots;
    // this layout's arrays are never "converted".
    let v2 = layout(2).expect("layout 2");
    for name in [STACK_EPS_MAP, STACK_CLEARED_MAP] {
        let have = MapSpec::from_layout(v2.map(name).expect("in layout 2"));
        assert!(convertible(name, &have), "{name}");
        let now = MapSpec::from_layout(
            layout(LAYOUT_VERSION)
                .expect("this")
                .map(name)
                .expect("a row"),
        );
        assert!(!convertible(name, &now), "{name}");
    }
}

/// An old overflow mark its agent had cleared is a plain mark now; the others stand.
#[test]
fn old_marks_drop_the_cleared_overflow_marks() {
    let m = OldMarks::new(&[(3, 0), (4, 17), (5, 20)], &[(4, 17), (5, 19)]);
    assert_eq!(
        (m.get(3), m.get(4), m.get(5), m.get(6)),
        (Some(0), Some(0), Some(20), None)
    );
}

#[test]
fn differences_name_what_differs() {
    let a = MapSpec {
        name: "M".into(),
        map_type: BPF_MAP_TYPE_LRU_HASH,
        key_size: 16,
        value_size: 40,
        max_entries: 100,
        flags: 0,
    };
    let b = MapSpec {
        map_type: BPF_MAP_TYPE_HASH,
        value_size: 56,
        flags: 1,
        ..a.clone()
    };
    assert_eq!(
        a.differences(&b),
        [
            "type lru_hash (want hash)",
            "value size 40 (want 56)",
            "flags 0 (want 1)"
        ]
    );
    assert!(a.differences(&a).is_empty());
}

/// Layout 1's answered TCP flows get `CT_F_ACK` on their original entry.
#[test]
fn carried_tcp_flows_keep_their_state() {
    let out = CtKey {
        src: [10, 0, 0, 1],
        dst: [192, 0, 2, 9],
        sport: 5000u16.to_be(),
        dport: 80u16.to_be(),
        proto: IPPROTO_TCP,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
    };
    let reply = CtKey {
        src: out.dst,
        dst: [192, 0, 2, 1],
        sport: out.dport,
        dport: 20001u16.to_be(),
        proto: IPPROTO_TCP,
        dir: CT_DIR_REPLY,
        _pad: [0; 2],
    };
    let mut v: Vec<(CtKey, CtEntry)> = vec![
        (
            out,
            CtEntryV1 {
                last_seen_ns: 7,
                addr: reply.dst,
                port: reply.dport,
                flags: CT_F_SEEN,
                route_ifindex: 3,
                ..CtEntryV1::default()
            }
            .into(),
        ),
        (
            reply,
            CtEntryV1Early {
                last_seen_ns: 8,
                addr: out.src,
                port: out.sport,
                flags: CT_F_SEEN | CT_F_RST,
            }
            .into(),
        ),
    ];
    mark_answered(&mut v);
    assert_eq!(v[0].1.flags, CT_F_SEEN | CT_F_ACK);
    assert_eq!(
        (v[0].1.route_ifindex, v[0].1.owner, v[0].1.seq_end),
        (3, 0, 0)
    );
    assert_eq!(v[1].1.flags, CT_F_SEEN | CT_F_RST);
    assert_eq!(v[1].1.last_seen_ns, 8);
}
