//! What expressions and sets hold: verdicts, data (bytes or a verdict), key types, sets and
//! their elements. Below [`super::expr`] (an immediate holds [`Data`], a lookup may hold an
//! anonymous [`Set`]) and [`super::model`] (a table holds named sets).

/// A verdict: of an immediate, a chain's policy, a verdict map's element.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Accept,
    Drop,
    Continue,
    Return,
    Jump(String),
    Goto(String),
}

impl Verdict {
    /// `NF_DROP`, `NF_ACCEPT` and nf_tables' own (negative) codes.
    pub(crate) fn code(&self) -> i32 {
        match self {
            Verdict::Drop => 0,
            Verdict::Accept => 1,
            Verdict::Continue => -1,
            Verdict::Jump(_) => -3,
            Verdict::Goto(_) => -4,
            Verdict::Return => -5,
        }
    }

    pub(crate) fn chain(&self) -> Option<&str> {
        match self {
            Verdict::Jump(c) | Verdict::Goto(c) => Some(c),
            _ => None,
        }
    }

    pub(crate) fn from_code(code: i32, chain: Option<String>) -> Option<Self> {
        Some(match (code, chain) {
            (0, _) => Verdict::Drop,
            (1, _) => Verdict::Accept,
            (-1, _) => Verdict::Continue,
            (-5, _) => Verdict::Return,
            (-3, Some(c)) => Verdict::Jump(c),
            (-4, Some(c)) => Verdict::Goto(c),
            _ => return None,
        })
    }
}

/// The value of an immediate or of a map element: bytes, or a verdict.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Data {
    Value(Vec<u8>),
    Verdict(Verdict),
}

/// What a set's keys (or a map's values) are: nft's datatype number (how `nft list` prints
/// them; the kernel only stores it) and the length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KeyType {
    pub id: u32,
    pub len: u32,
}

impl KeyType {
    pub const IPV4_ADDR: KeyType = KeyType { id: 7, len: 4 };
    pub const IPV6_ADDR: KeyType = KeyType { id: 8, len: 16 };
    pub const INET_PROTO: KeyType = KeyType { id: 12, len: 1 };
    pub const INET_SERVICE: KeyType = KeyType { id: 13, len: 2 };
    pub const ICMP_TYPE: KeyType = KeyType { id: 14, len: 1 };
    pub const MARK: KeyType = KeyType { id: 19, len: 4 };
    pub const ICMPV6_TYPE: KeyType = KeyType { id: 29, len: 1 };
    pub const IFNAME: KeyType = KeyType { id: 41, len: 16 };
}

/// What a map's elements map to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapData {
    /// A verdict map (`vmap`): `NFT_DATA_VERDICT`.
    Verdict,
    Value(KeyType),
}

/// A set (or a map, with [`Set::map`]). Named sets are in [`super::Table::sets`]; anonymous ones
/// inside a lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Set {
    /// Ignored for anonymous sets (the kernel names them `__set<n>`).
    pub name: String,
    pub key: KeyType,
    /// Elements are ranges ([`Element::last`]): CIDRs, port ranges.
    pub interval: bool,
    /// Elements cannot change after the set is made (anonymous sets always are).
    pub constant: bool,
    pub map: Option<MapData>,
    pub elements: Vec<Element>,
}

impl Set {
    pub fn new(name: impl Into<String>, key: KeyType) -> Self {
        Self {
            name: name.into(),
            key,
            interval: false,
            constant: false,
            map: None,
            elements: Vec::new(),
        }
    }

    /// An anonymous set: constant, bound to the rule whose lookup holds it.
    pub fn anonymous(key: KeyType) -> Self {
        Self {
            constant: true,
            ..Self::new("", key)
        }
    }

    pub fn with_element(mut self, e: Element) -> Self {
        self.elements.push(e);
        self
    }

    pub(super) fn validate(&self) -> Result<(), &'static str> {
        if self.key.len == 0 || self.key.len > 64 {
            return Err("has a key length the kernel does not take (1 to 64 bytes)");
        }
        for e in &self.elements {
            if e.key.len() != self.key.len as usize
                || e.last.as_ref().is_some_and(|l| l.len() != e.key.len())
            {
                return Err("has an element whose key is not the set's key length");
            }
            if e.last.is_some() != self.interval {
                return Err("mixes ranges and single keys (ranges need an interval set)");
            }
            if e.last.as_ref().is_some_and(|l| *l < e.key) {
                return Err("has a range that ends before it starts");
            }
            if e.data.is_some() != self.map.is_some() {
                return Err("has elements with data but is no map, or without data in a map");
            }
        }
        Ok(())
    }
}

/// A set element: a key (network byte order), or for interval sets the range `key..=last`;
/// in a map, the data it maps to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Element {
    pub key: Vec<u8>,
    pub last: Option<Vec<u8>>,
    pub data: Option<Data>,
}

impl Element {
    pub fn key(key: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into(),
            last: None,
            data: None,
        }
    }

    pub fn range(first: impl Into<Vec<u8>>, last: impl Into<Vec<u8>>) -> Self {
        Self {
            key: first.into(),
            last: Some(last.into()),
            data: None,
        }
    }

    pub fn with_data(mut self, data: Data) -> Self {
        self.data = Some(data);
        self
    }
}
