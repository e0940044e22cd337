//! `calixctl trace` on the live maps: what the programs' policy verdict would find for one
//! packet, read with the same lookups (longest match on the peer's identity, then an entry of
//! that identity or of any peer). Read-only; the pins are opened per question.
use std::net::IpAddr;
use std::path::Path;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, Map, MapData, MapError};
use calix_common::{
    PolicyKey, PolicyState, POLICY_ANY_PEER, POLICY_IDS_V4_MAP, POLICY_IDS_V6_MAP, POLICY_KEY_BITS,
    POLICY_MAP, POLICY_STATE_MAP, POLICY_WORLD, POL_DIR_EGRESS, POL_DIR_INGRESS,
    POL_ISOLATED_EGRESS, POL_ISOLATED_INGRESS,
};

use crate::bpf::map_err;
use crate::{DataplaneError, LiveVerdict};

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_SCTP: u8 = 132;

fn open(pin_dir: &Path, name: &'static str) -> Result<MapData, DataplaneError> {
    MapData::from_pin(pin_dir.join(name)).map_err(map_err(name, "open pin"))
}

fn found<V>(r: Result<V, MapError>, name: &'static str) -> Result<Option<V>, DataplaneError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(map_err(name, "lookup")(e)),
    }
}

/// The verdict of the endpoint in `slot` (see `DataplaneStats::policy_verdict`).
pub(super) fn verdict(
    pin_dir: &Path,
    slot: u32,
    ingress: bool,
    peer: IpAddr,
    proto: u8,
    port: u16,
) -> Result<LiveVerdict, DataplaneError> {
    let state: Array<MapData, PolicyState> =
        Array::try_from(Map::Array(open(pin_dir, POLICY_STATE_MAP)?))
            .map_err(map_err(POLICY_STATE_MAP, "open"))?;
    let st = found(state.get(&slot, 0), POLICY_STATE_MAP)?.unwrap_or_default();
    let bit = if ingress {
        POL_ISOLATED_INGRESS
    } else {
        POL_ISOLATED_EGRESS
    };
    let identity = match peer {
        IpAddr::V4(a) => {
            let t: LpmTrie<MapData, [u8; 4], u32> =
                LpmTrie::try_from(Map::LpmTrie(open(pin_dir, POLICY_IDS_V4_MAP)?))
                    .map_err(map_err(POLICY_IDS_V4_MAP, "open"))?;
            found(t.get(&Key::new(32, a.octets()), 0), POLICY_IDS_V4_MAP)?
        }
        IpAddr::V6(a) => {
            let t: LpmTrie<MapData, [u8; 16], u32> =
                LpmTrie::try_from(Map::LpmTrie(open(pin_dir, POLICY_IDS_V6_MAP)?))
                    .map_err(map_err(POLICY_IDS_V6_MAP, "open"))?;
            found(t.get(&Key::new(128, a.octets()), 0), POLICY_IDS_V6_MAP)?
        }
    }
    .unwrap_or(POLICY_WORLD);
    let isolated = st.flags & bit != 0;
    if !isolated {
        return Ok(LiveVerdict {
            isolated,
            identity,
            rule: None,
        });
    }
    let entries: LpmTrie<MapData, PolicyKey, u32> =
        LpmTrie::try_from(Map::LpmTrie(open(pin_dir, POLICY_MAP)?))
            .map_err(map_err(POLICY_MAP, "open"))?;
    let dir = if ingress {
        POL_DIR_INGRESS
    } else {
        POL_DIR_EGRESS
    };
    let port = if matches!(proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
        port.to_be_bytes()
    } else {
        [0; 2]
    };
    let mut rule = None;
    for who in [identity, POLICY_ANY_PEER] {
        let k = Key::new(POLICY_KEY_BITS, PolicyKey::new(slot, dir, who, proto, port));
        if let Some(r) = found(entries.get(&k, 0), POLICY_MAP)? {
            rule = Some(r);
            break;
        }
    }
    Ok(LiveVerdict {
        isolated,
        identity,
        rule,
    })
}
