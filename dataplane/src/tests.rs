//! The dataplane trait's pure helpers.
use super::*;

#[test]
fn specs_from_records() {
    let r = EndpointRecord {
        container_id: "c".into(),
        ifname: "eth0".into(),
        host_ifname: "cali1".into(),
        netns: String::new(),
        pod_namespace: String::new(),
        pod_name: String::new(),
        pod_uid: String::new(),
        addresses: vec!["10.1.0.5/32".into(), "fd00::5/128".into()],
        handle: "h".into(),
        mac: "02:00:0a:ff:00:01".into(),
        host_ifindex: 0,
    };
    let s = EndpointSpec::from_record(&r);
    assert_eq!(s.key, "c/eth0");
    assert_eq!(s.host_ifindex, None);
    assert_eq!(s.ipv4, Some(Ipv4Addr::new(10, 1, 0, 5)));
    assert_eq!(s.ipv6, Some("fd00::5".parse().expect("v6")));
    assert_eq!(s.mac, Some([2, 0, 0x0a, 0xff, 0, 1]));
}
