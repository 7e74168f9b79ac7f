//! The host service's wire protocol, version 2 (byte by byte in `docs/service.md`). Version 2 adds
//! the operator ops (`Namespaces`, `Verify`, `Trim`); a version-1 Hello is still served.
//!
//! A Unix stream socket carries frames: `u32 LE length` of the body, then the body. A request body is
//! `u8 op` + payload; a reply body is `u8 status` (0 ok, 1 error) + payload (for an error, a UTF-8
//! message that names the fix). One request and one reply at a time per connection. Integers are
//! little-endian; a key list is `u32 count` + `count * 32` bytes.

use crate::key::BlockKey;

pub const PROTOCOL_VERSION: u16 = 2;
/// The oldest version whose Hello the service still accepts (its ops are unchanged in version 2).
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// Bounds every frame (a request of about two million keys): a larger one closes the connection.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
pub const STATUS_OK: u8 = 0;
pub const STATUS_ERROR: u8 = 1;
/// `Acquire` reply slot of a miss; `Reserve` slot of a block that needs no fill.
pub const NO_SLOT: u32 = u32::MAX;

/// Request opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// `u16 version, u32 tp_size, u32 rank, u64 slice_bytes, u32 len, description` ->
    /// `u64 slot_bytes, u64 slot_count, u64 value_offset, u64 pool_bytes, u64 object_bytes, u32 len, pool path`
    Hello = 1,
    /// keys -> `count * u8` tier (`Tier::wire_code`: 0 none, 1 DRAM, 2 NVMe, 3 shared filesystem, 4 bucket)
    Locate = 2,
    /// keys -> `u32 count` + `count * u8` (1: pinned, 0: present in the shared tier only, no pin)
    Pin = 3,
    /// keys -> (empty); releases this connection's pins only
    Unpin = 4,
    /// keys -> `count * (u8 kind, u32 slot)`; kind (`ReserveKind`) 0 fill, 1 present, 2 dropped,
    /// 3 no room now (commit what you hold, then reserve these again)
    Reserve = 5,
    /// keys -> `count * u8` (1: this rank's slice is accepted; 0 for a fill the service gave up,
    /// past `reservation_timeout_ms` or aborted by another rank: never visible)
    Commit = 6,
    /// keys -> (empty). A key this connection reserved: the fill is given up. Any other key: a
    /// store this rank gives up without a reservation (no room came): counted as dropped, and
    /// given up by every rank of the namespace
    Abort = 7,
    /// keys -> `count * u32` slot (`NO_SLOT`: miss); each slot stays pinned until `Release`
    Acquire = 8,
    /// keys -> (empty)
    Release = 9,
    /// (empty) -> `u32 count` + `count * (u16 len, name, u64 value)`
    Stats = 10,
    /// (empty) -> (empty) once every accepted store is on NVMe
    Flush = 11,
    /// (version 2; no Hello needed) (empty) -> `u16 version`, `u32 count`, per namespace:
    /// `32 digest`, `bytes description`, `u32 tp_size`, `u64 slice_bytes`, `u64 object_bytes`, pairs
    Namespaces = 12,
    /// (version 2; no Hello needed) `32 digest`, `u64 after`, `u32 max_blocks`, `u64 max_bytes_per_s`
    /// -> `u64 next_after`, `u8 done`, pairs, `u32 count` * (`32 key`, `u8 tier`, `u8 quarantined`, `bytes reason`)
    Verify = 13,
    /// (version 2; no Hello needed) `32 digest`, `u8 mode` (0 all, 1 older than `value` ms, 2 NVMe to
    /// `value` bytes), `u64 value` -> pairs
    Trim = 14,
    /// (version 2, after Hello) `bytes label` (UTF-8, 1 to `MAX_ENGINE_LABEL_BYTES`) -> (empty):
    /// names the engine this connection works for in the per-engine counters (`Engines`)
    Label = 15,
    /// (version 2; no Hello needed) `32 digest` -> `u32 count` * (`bytes label`, pairs): the
    /// namespace's per-engine counters, one entry per label
    Engines = 16,
    /// (version 2, after Hello) `u64 cursor`, `u32 max` -> `u8 reset`, `u64 next`, `u32 count` *
    /// (`32 key`, `u8 tier` (1 DRAM, 2 NVMe, 4 shared tier), `u8 removed`): the namespace's change
    /// log from `cursor` (`service::changes`; KV events for routers)
    Changes = 17,
    /// (version 2, after Hello) keys -> `count * u8` (1: resident in DRAM afterwards): reads blocks
    /// from NVMe, the shared or the object tier into DRAM ahead of their load, pinning nothing
    /// (`Store::read_ahead`; each read counts at its tier, the later load's DRAM copy counts once)
    ReadAhead = 18,
    /// (version 2, after Hello) keys, `16 tenant` -> (empty): the blocks are the tenant's
    /// (`Store::assign_tenant`; the tenant id is hashed from a request's `cache_salt`)
    Tenant = 19,
    /// (version 2, after Hello and Label) pairs -> (empty): what the engine counted itself since its
    /// last report (`ENGINE_REPORTED`: service calls that failed, outages, jobs given up or skipped
    /// while the service did not answer, loads held for a reattach), added to its per-engine
    /// counters; other names are ignored
    Report = 20,
    /// (version 2, after Hello) keys -> (empty): the caller says these blocks will be read again (a
    /// request's retention hint): evidence of reuse for writes below DRAM (`Store::note_retained`)
    Retain = 21,
}

/// `Op::Reserve`'s answer for one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReserveKind {
    /// Copy this rank's slice into the slot, then Commit (or Abort) the key.
    Fill = 0,
    /// Stored already, or being filled by an engine of another TP size.
    Present = 1,
    /// Not taken (a dropped store, counted by the service).
    Dropped = 2,
    /// No room now: commit what this connection holds, then reserve the block again.
    Retry = 3,
}

impl ReserveKind {
    pub fn from_u8(byte: u8) -> Option<ReserveKind> {
        Some(match byte {
            0 => ReserveKind::Fill,
            1 => ReserveKind::Present,
            2 => ReserveKind::Dropped,
            3 => ReserveKind::Retry,
            _ => return None,
        })
    }
}

/// The longest engine label (`Op::Label`).
pub const MAX_ENGINE_LABEL_BYTES: usize = 128;

impl Op {
    pub fn from_u8(byte: u8) -> Option<Op> {
        Some(match byte {
            1 => Op::Hello,
            2 => Op::Locate,
            3 => Op::Pin,
            4 => Op::Unpin,
            5 => Op::Reserve,
            6 => Op::Commit,
            7 => Op::Abort,
            8 => Op::Acquire,
            9 => Op::Release,
            10 => Op::Stats,
            11 => Op::Flush,
            12 => Op::Namespaces,
            13 => Op::Verify,
            14 => Op::Trim,
            15 => Op::Label,
            16 => Op::Engines,
            17 => Op::Changes,
            18 => Op::ReadAhead,
            19 => Op::Tenant,
            20 => Op::Report,
            21 => Op::Retain,
            _ => return None,
        })
    }
}

/// A malformed frame: the peer does not speak this protocol (or this version of it).
#[derive(Debug, thiserror::Error)]
#[error("malformed kvtier service frame: {0}")]
pub struct ProtocolError(pub &'static str);

/// Builds a frame body.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn new(first: u8) -> Self {
        Writer(vec![first])
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        debug_assert!(v.len() <= u32::MAX as usize, "a field of {} bytes overflows its length", v.len());
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    /// `u32 count` + `count * (u16 len, name, u64 value)`: named values, extensible without a version.
    pub fn pairs<S: AsRef<str>>(&mut self, pairs: &[(S, u64)]) -> &mut Self {
        debug_assert!(pairs.len() <= u32::MAX as usize);
        self.u32(pairs.len() as u32);
        for (name, value) in pairs {
            let name = name.as_ref().as_bytes();
            debug_assert!(name.len() <= u16::MAX as usize, "a pair's name of {} bytes", name.len());
            self.u16(name.len() as u16);
            self.0.extend_from_slice(name);
            self.u64(*value);
        }
        self
    }
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }
    pub fn keys(&mut self, keys: &[BlockKey]) -> &mut Self {
        debug_assert!(keys.len() <= u32::MAX as usize);
        let start = self.0.len();
        self.u32(keys.len() as u32);
        for key in keys {
            self.0.extend_from_slice(&key.0);
        }
        debug_assert_eq!(self.0.len() - start, 4 + keys.len() * 32, "a key list is its count, then 32 bytes a key");
        self
    }
}

/// Reads a frame body; every read is bounds-checked.
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.bytes.len() < n {
            return Err(ProtocolError("truncated"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], ProtocolError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn keys(&mut self) -> Result<Vec<BlockKey>, ProtocolError> {
        let n = self.u32()? as usize;
        let raw = self.take(n.checked_mul(32).ok_or(ProtocolError("key count overflows"))?)?;
        debug_assert_eq!(raw.len(), n * 32);
        Ok(raw.chunks_exact(32).map(|k| BlockKey(k.try_into().unwrap())).collect())
    }
    pub fn pairs(&mut self) -> Result<Vec<(String, u64)>, ProtocolError> {
        let n = self.u32()?;
        (0..n)
            .map(|_| {
                let len = self.u16()? as usize;
                let name = String::from_utf8_lossy(self.take(len)?).into_owned();
                Ok((name, self.u64()?))
            })
            .collect()
    }
    pub fn array32(&mut self) -> Result<[u8; 32], ProtocolError> {
        Ok(self.take(32)?.try_into().unwrap())
    }
    pub fn array16(&mut self) -> Result<[u8; 16], ProtocolError> {
        Ok(self.take(16)?.try_into().unwrap())
    }
    pub fn rest(&self) -> &'a [u8] {
        self.bytes
    }
}

/// Writes one frame (length prefix + body).
pub fn write_frame(stream: &mut impl std::io::Write, body: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)
}

/// Reads one frame body; `Ok(None)` at a clean end of stream.
pub fn read_frame(stream: &mut impl std::io::Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME_BYTES {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "kvtier service frame of a bad length"));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_kinds_round_trip_and_unknown_ones_are_none() {
        for kind in [ReserveKind::Fill, ReserveKind::Present, ReserveKind::Dropped, ReserveKind::Retry] {
            assert_eq!(ReserveKind::from_u8(kind as u8), Some(kind));
        }
        assert_eq!(ReserveKind::from_u8(4), None);
    }

    #[test]
    fn frames_round_trip_and_truncation_is_an_error() {
        let keys = vec![BlockKey([1; 32]), BlockKey([2; 32])];
        let mut w = Writer::new(Op::Pin as u8);
        w.keys(&keys).u64(7).bytes(b"abc");
        let mut wire = Vec::new();
        write_frame(&mut wire, &w.0).unwrap();
        let body = read_frame(&mut wire.as_slice()).unwrap().unwrap();
        let mut r = Reader::new(&body);
        assert_eq!(Op::from_u8(r.u8().unwrap()), Some(Op::Pin));
        assert_eq!(r.keys().unwrap(), keys);
        assert_eq!(r.u64().unwrap(), 7);
        assert_eq!(r.bytes().unwrap(), b"abc");
        assert!(r.u8().is_err());
        assert!(read_frame(&mut &wire[..wire.len() - 1]).is_err());
        assert!(read_frame(&mut &[][..]).unwrap().is_none());
        let mut huge = Vec::new();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_frame(&mut huge.as_slice()).is_err());
    }
}
