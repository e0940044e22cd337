//! MAC addresses as text: one parser and one printer for the plugin (runtimeConfig `mac`,
//! results of other plugins) and the agent (the endpoint records the plugin writes).

/// `"aa:bb:cc:dd:ee:ff"` (or with `-`) → bytes; exactly six two-digit hex groups, case-free.
pub fn parse(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split([':', '-']);
    for b in &mut mac {
        let p = parts.next()?;
        // from_str_radix alone would take "+e" as a hex number.
        if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Bytes → `"aa:bb:cc:dd:ee:ff"`.
pub fn format(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_exactly_six_hex_pairs_and_prints_them_back() {
        let m = [0xee, 0xee, 0xee, 0xee, 0xee, 0x01];
        assert_eq!(parse("ee:EE:ee:ee:ee:01"), Some(m));
        assert_eq!(parse("ee-ee-ee-ee-ee-01"), Some(m));
        assert_eq!(format(&m), "ee:ee:ee:ee:ee:01");
        for bad in [
            "ee:ee:ee:ee:ee",
            "ee:ee:ee:ee:ee:ee:ee",
            "+e:ee:ee:ee:ee:ee",
            "ee:ee:ee:ee:ee:eee",
            "e:ee:ee:ee:ee:ee",
            "zz:00:0a:ff:00:01",
            "",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
