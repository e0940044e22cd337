//! Frame and packet builders shared by the program tests (dataplane/tests, BPF_PROG_TEST_RUN), the
//! namespace integration tests (frames a pod writes with a raw socket) and the benches (the
//! flood's frame): one copy of each contract. Plain bytes.

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_LLDP: u16 = 0x88cc;
pub const ICMP: u8 = 1;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMPV6: u8 = 58;

pub fn v6(last: u8) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(&[0xfd, 0x00, 0x02, 0x44]);
    a[15] = last;
    a
}

pub fn eth(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    [&dst[..], &src, &ethertype.to_be_bytes(), payload].concat()
}

/// The one's complement checksum of RFC 1071: the value of a header's checksum field computed
/// with the field zero; 0 over a header whose checksum is right.
pub fn ipv4_checksum(bytes: &[u8]) -> u16 {
    let word = |w: &[u8]| u32::from(u16::from_be_bytes([w[0], w.get(1).copied().unwrap_or(0)]));
    let mut sum: u32 = bytes.chunks(2).map(word).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet; `bytes` gives it a right header checksum.
#[derive(Clone)]
pub struct Ip4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub proto: u8,
    pub ttl: u8,
    /// Flags and fragment offset (DF 0x4000, MF 0x2000, offset in 8-byte units).
    pub frag: u16,
    pub options: Vec<u8>,
    pub payload: Vec<u8>,
}

impl Ip4 {
    pub fn new(src: [u8; 4], dst: [u8; 4], proto: u8, payload: Vec<u8>) -> Self {
        let (ttl, frag, options) = (64, 0x4000, Vec::new());
        Ip4 {
            src,
            dst,
            proto,
            ttl,
            frag,
            options,
            payload,
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let hlen = 20 + self.options.len();
        assert!(
            hlen.is_multiple_of(4) && hlen <= 60,
            "options: 40 bytes in words at most"
        );
        let tot = u16::try_from(hlen + self.payload.len()).expect("total length");
        let mut h = vec![0x40 | (hlen / 4) as u8, 0];
        h.extend(tot.to_be_bytes());
        h.extend([0x12, 0x34]); // identification
        h.extend(self.frag.to_be_bytes());
        h.extend([self.ttl, self.proto, 0, 0]);
        h.extend(self.src);
        h.extend(self.dst);
        h.extend(&self.options);
        let csum = ipv4_checksum(&h);
        h[10..12].copy_from_slice(&csum.to_be_bytes());
        h.extend(&self.payload);
        h
    }

    pub fn ttl(self, ttl: u8) -> Self {
        Ip4 { ttl, ..self }
    }

    pub fn frag(self, frag: u16) -> Self {
        Ip4 { frag, ..self }
    }

    pub fn to(self, dst: [u8; 4]) -> Self {
        Ip4 { dst, ..self }
    }
}

/// An IPv6 packet, hop limit 64.
pub fn ip6(src: [u8; 16], dst: [u8; 16], next: u8, payload: &[u8]) -> Vec<u8> {
    let len = u16::try_from(payload.len()).expect("payload length");
    [
        &[0x60, 0, 0, 0][..],
        &len.to_be_bytes(),
        &[next, 64],
        &src,
        &dst,
        payload,
    ]
    .concat()
}

// Transport headers keep a zero checksum: the programs neither check it nor change what it
// covers.
pub fn tcp_syn(sport: u16, dport: u16) -> Vec<u8> {
    let flags = [0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0];
    [&sport.to_be_bytes()[..], &dport.to_be_bytes(), &flags].concat()
}

pub fn udp(sport: u16, dport: u16) -> Vec<u8> {
    let (sport, dport, len) = (
        sport.to_be_bytes(),
        dport.to_be_bytes(),
        12u16.to_be_bytes(),
    );
    [&sport[..], &dport, &len, &[0, 0], b"ping"].concat()
}

/// ICMP or ICMPv6 message `ty` with identifier `id` (meaningful for echo), sequence 1.
pub fn icmp(ty: u8, id: u16) -> Vec<u8> {
    [&[ty, 0, 0, 0][..], &id.to_be_bytes(), &[0, 1]].concat()
}

/// An IPv4-over-Ethernet ARP request.
pub fn arp(sha: [u8; 6], spa: [u8; 4], tpa: [u8; 4]) -> Vec<u8> {
    [
        &[0, 1, 0x08, 0x00, 6, 4, 0, 1][..],
        &sha,
        &spa,
        &[0; 6],
        &tpa,
    ]
    .concat()
}

/// `frame` with byte `at` replaced by `value`.
pub fn with_byte(frame: &[u8], at: usize, value: u8) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[at] = value;
    f
}

// ---- What a hostile pod writes ----

/// VLAN tag protocol identifiers: 802.1Q and 802.1ad (the outer tag of QinQ).
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
/// An EtherType nothing in calix speaks: IEEE 802 "local experimental 1".
pub const ETH_P_LOCAL_EXP: u16 = 0x88b5;
/// IPv6 extension headers (next-header values).
pub const IPV6_HOPOPTS: u8 = 0;
pub const IPV6_DSTOPTS: u8 = 60;
pub const IPV6_FRAGMENT: u8 = 44;
/// ICMPv6 types a pod's kernel sends from link-local or unspecified sources.
pub const ND_ROUTER_SOLICIT: u8 = 133;
pub const ND_NEIGHBOR_SOLICIT: u8 = 135;
pub const ND_NEIGHBOR_ADVERT: u8 = 136;
pub const MLD_REPORT: u8 = 131;
pub const MLD_DONE: u8 = 132;
pub const MLD2_REPORT: u8 = 143;

/// `frame` with a VLAN tag (`tpid`, `tci`) inserted after its MAC addresses.
pub fn vlan_tagged(frame: &[u8], tpid: u16, tci: u16) -> Vec<u8> {
    let tag = [&tpid.to_be_bytes()[..], &tci.to_be_bytes()].concat();
    [&frame[..12], &tag, &frame[12..]].concat()
}

/// fe80::`last`.
pub fn link_local(last: u8) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..2].copy_from_slice(&[0xfe, 0x80]);
    a[15] = last;
    a
}

/// ff02::1, all nodes on the link.
pub const ALL_NODES: [u8; 16] = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
/// ff02::16, all MLDv2-capable routers.
pub const ALL_MLD2_ROUTERS: [u8; 16] = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x16];

/// UDP from `sport` to `dport` carrying `payload` (checksum left zero).
pub fn udp_with(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let len = u16::try_from(8 + payload.len()).expect("UDP length");
    [
        &sport.to_be_bytes()[..],
        &dport.to_be_bytes(),
        &len.to_be_bytes(),
        &[0, 0],
        payload,
    ]
    .concat()
}

/// An ICMPv6 neighbour solicitation or advertisement (`ty`) for `target`, without options;
/// an advertisement carries the solicited and override flags.
pub fn nd(ty: u8, target: [u8; 16]) -> Vec<u8> {
    let flags: u8 = if ty == ND_NEIGHBOR_ADVERT { 0x60 } else { 0 };
    [&[ty, 0, 0, 0, flags, 0, 0, 0][..], &target].concat()
}

/// An MLDv2 listener report with no records.
pub fn mld2_report() -> Vec<u8> {
    vec![MLD2_REPORT, 0, 0, 0, 0, 0, 0, 0]
}

/// An 8-byte hop-by-hop or destination-options header (one PadN option) in front of `payload`,
/// whose protocol is `next`.
pub fn ext_header(next: u8, payload: &[u8]) -> Vec<u8> {
    [&[next, 0, 1, 4, 0, 0, 0, 0][..], payload].concat()
}

/// A fragment header in front of `payload` (`next` its protocol): offset in 8-byte units,
/// `more` fragments to come.
pub fn fragment_header(next: u8, offset: u16, more: bool, payload: &[u8]) -> Vec<u8> {
    let off = (offset << 3) | u16::from(more);
    [&[next, 0][..], &off.to_be_bytes(), &[0, 0, 0, 7], payload].concat()
}
