//! Netlink framing for nfnetlink: a message writer (header, `nfgenmsg`, attributes, nests) and
//! a reader (messages in a receive buffer, attributes in a payload). nf_tables' integers are
//! big-endian on the wire; netlink's own headers are in host order.

/// A reply the decoder cannot read (truncated, out of bounds, of an unexpected size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed netlink reply: {0}")]
pub struct Malformed(pub &'static str);

/// `struct nlmsghdr` (16 bytes) then `struct nfgenmsg` (4 bytes).
pub(crate) const NLMSG_HDRLEN: usize = 16;
pub(crate) const NFGENMSG_LEN: usize = 4;

pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
pub(crate) const NLM_F_CREATE: u16 = 0x400;
pub(crate) const NLM_F_APPEND: u16 = 0x800;
pub(crate) const NLM_F_DUMP: u16 = 0x300;
pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;
/// Marks a nested attribute.
pub(crate) const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// The nfnetlink subsystem of nf_tables, and its batch delimiters.
pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub(crate) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub(crate) const NFNL_MSG_BATCH_END: u16 = 0x11;

/// The longest name (table, chain, set) the kernel takes, without the NUL
/// (`NFT_NAME_MAXLEN - 1`).
pub const NAME_MAX: usize = 255;
/// The longest user data (comments) of a table, chain, set or rule (`NFT_USERDATA_MAXLEN`).
pub const USERDATA_MAX: usize = 256;

const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Builds netlink messages back to back in one buffer (a batch is several messages in one
/// `send`).
#[derive(Debug, Default)]
pub(crate) struct Writer {
    buf: Vec<u8>,
    msg: Option<usize>,
    nests: Vec<usize>,
}

impl Writer {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Starts a message: `nlmsghdr` and `nfgenmsg` (`family`, version 0, `res_id`).
    pub(crate) fn begin(&mut self, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16) {
        debug_assert!(self.msg.is_none() && self.nests.is_empty());
        self.msg = Some(self.buf.len());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.push(family);
        self.buf.push(0);
        self.buf.extend_from_slice(&res_id.to_be_bytes());
    }

    /// Ends the message begun last: writes its length.
    pub(crate) fn end(&mut self) {
        let start = self.msg.take().expect("end without begin");
        debug_assert!(self.nests.is_empty(), "unclosed nest");
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    pub(crate) fn put(&mut self, ty: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// A NUL-terminated string.
    pub(crate) fn put_str(&mut self, ty: u16, s: &str) {
        let mut v = Vec::with_capacity(s.len() + 1);
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        self.put(ty, &v);
    }

    pub(crate) fn put_be32(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_be_bytes());
    }

    pub(crate) fn put_be64(&mut self, ty: u16, v: u64) {
        self.put(ty, &v.to_be_bytes());
    }

    pub(crate) fn put_u8(&mut self, ty: u16, v: u8) {
        self.put(ty, &[v]);
    }

    pub(crate) fn nest(&mut self, ty: u16) {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    }

    pub(crate) fn end_nest(&mut self) {
        let start = self.nests.pop().expect("end_nest without nest");
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }

    pub(crate) fn into_bytes(self) -> Vec<u8> {
        debug_assert!(self.msg.is_none());
        self.buf
    }
}

/// One netlink message of a receive buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Msg<'a> {
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    /// Everything after the `nlmsghdr`.
    pub payload: &'a [u8],
}

impl Msg<'_> {
    /// For `NLMSG_ERROR`: the error number (0: an ack) and the sequence number of the
    /// message it answers.
    pub(crate) fn error(&self) -> Result<(i32, u32), Malformed> {
        // struct nlmsgerr { int error; struct nlmsghdr msg; ... }
        if self.payload.len() < 4 + NLMSG_HDRLEN {
            return Err(malformed("a short NLMSG_ERROR"));
        }
        let code = i32::from_ne_bytes(self.payload[0..4].try_into().expect("4 bytes"));
        let seq = u32::from_ne_bytes(self.payload[12..16].try_into().expect("4 bytes"));
        Ok((code, seq))
    }
}

/// A reply's `nfgenmsg` family and the attributes after it.
pub(crate) fn nf(payload: &[u8]) -> Result<(u8, Attrs<'_>), Malformed> {
    if payload.len() < NFGENMSG_LEN {
        return Err(malformed("a message shorter than its nfgenmsg"));
    }
    Ok((payload[0], Attrs::new(&payload[NFGENMSG_LEN..])))
}

/// Splits a receive buffer into its messages.
pub(crate) fn messages(mut buf: &[u8]) -> Result<Vec<Msg<'_>>, Malformed> {
    let mut out = Vec::new();
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return Err(malformed("a netlink message whose length is out of bounds"));
        }
        out.push(Msg {
            ty: u16::from_ne_bytes(buf[4..6].try_into().expect("2 bytes")),
            flags: u16::from_ne_bytes(buf[6..8].try_into().expect("2 bytes")),
            seq: u32::from_ne_bytes(buf[8..12].try_into().expect("4 bytes")),
            payload: &buf[NLMSG_HDRLEN..len],
        });
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// The attributes of a payload or of a nest, in order: `(type, value)`, the type without its
/// flag bits.
#[derive(Debug, Clone)]
pub(crate) struct Attrs<'a> {
    rest: &'a [u8],
}

impl<'a> Attrs<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Self { rest: data }
    }

    /// All of them, or the first malformed one's error.
    pub(crate) fn collect_all(self) -> Result<Vec<(u16, &'a [u8])>, Malformed> {
        self.collect()
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<(u16, &'a [u8]), Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([self.rest[0], self.rest[1]]) as usize;
        let ty = u16::from_ne_bytes([self.rest[2], self.rest[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > self.rest.len() {
            self.rest = &[];
            return Some(Err(malformed("an attribute whose length is out of bounds")));
        }
        let value = &self.rest[4..len];
        self.rest = &self.rest[align4(len).min(self.rest.len())..];
        Some(Ok((ty, value)))
    }
}

pub(crate) fn malformed(why: &'static str) -> Malformed {
    Malformed(why)
}

pub(crate) fn be32(v: &[u8]) -> Result<u32, Malformed> {
    v.try_into()
        .map(u32::from_be_bytes)
        .map_err(|_| malformed("a 32-bit attribute of another size"))
}

pub(crate) fn be64(v: &[u8]) -> Result<u64, Malformed> {
    v.try_into()
        .map(u64::from_be_bytes)
        .map_err(|_| malformed("a 64-bit attribute of another size"))
}

pub(crate) fn u8_of(v: &[u8]) -> Result<u8, Malformed> {
    v.first()
        .copied()
        .ok_or_else(|| malformed("an empty 8-bit attribute"))
}

/// A NUL-terminated string attribute.
pub(crate) fn string(v: &[u8]) -> Result<String, Malformed> {
    let v = v.split(|b| *b == 0).next().unwrap_or_default();
    String::from_utf8(v.to_vec()).map_err(|_| malformed("a name that is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_with_a_nest_reads_back() {
        let mut w = Writer::new();
        w.begin(0x0a06, NLM_F_REQUEST, 7, 1, 0);
        w.put_str(1, "calix");
        w.nest(4);
        w.put_be32(2, 0xdead_beef);
        w.put_u8(3, 9);
        w.end_nest();
        w.end();
        let bytes = w.into_bytes();
        assert_eq!(bytes.len() % 4, 0);
        let msgs = messages(&bytes).expect("parse");
        assert_eq!(msgs.len(), 1);
        assert_eq!((msgs[0].ty, msgs[0].seq), (0x0a06, 7));
        let (family, attrs) = nf(msgs[0].payload).expect("nfgenmsg");
        assert_eq!(family, 1);
        let attrs = attrs.collect_all().expect("attrs");
        assert_eq!(attrs.len(), 2);
        assert_eq!(
            (attrs[0].0, string(attrs[0].1).expect("str")),
            (1, "calix".into())
        );
        // "calix\0" is 6 bytes: padded to 8.
        assert_eq!(attrs[0].1.len(), 6);
        let nested = Attrs::new(attrs[1].1).collect_all().expect("nest");
        assert_eq!(attrs[1].0, 4, "the nested flag is masked off");
        assert_eq!(be32(nested[0].1).expect("be32"), 0xdead_beef);
        assert_eq!(u8_of(nested[1].1).expect("u8"), 9);
    }

    #[test]
    fn truncated_input_is_malformed_not_a_panic() {
        let mut w = Writer::new();
        w.begin(0x0a00, NLM_F_REQUEST, 1, 1, 0);
        w.put_str(1, "t");
        w.end();
        let bytes = w.into_bytes();
        // The header says more than there is.
        assert!(messages(&bytes[..bytes.len() - 4]).is_err());
        // An attribute claims more than its message holds.
        let bad = [200u8, 0, 1, 0, b'x', 0, 0, 0];
        assert!(Attrs::new(&bad).collect_all().is_err());
        assert!(be32(&[1, 2]).is_err());
    }
}
