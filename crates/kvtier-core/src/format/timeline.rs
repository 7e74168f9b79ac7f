//! The `TIMELINE` file: when a namespace's sequences were handed out, so that block dates
//! (`kvtier inspect`, `kvtier trim --older-than`) survive a restart.
//!
//! A point `(end, unix_ms)` says: every sequence below `end` was handed out at or before `unix_ms`.
//! Points only bound dates from above, so a reader that loses points (the file is older than the
//! last blocks, or the writer halved its resolution) dates blocks later than they are, never earlier.
//! ```text
//! header (32 bytes)
//!      0    8 magic            b"KVTTIME\0"
//!      8    4 format_version   u32 LE (1)
//!     12    4 point_count      u32 LE (<= MAX_POINTS)
//!     16    8 points_checksum  xxh3-64 of the point array (point_count * 16 bytes)
//!     24    8 header_checksum  xxh3-64 of bytes 0..24
//! points (16 bytes each), from byte 32, `end` and `unix_ms` both non-decreasing
//!      0    8 end              u64 LE
//!      8    8 unix_ms          u64 LE
//! ```

use super::*;

pub const TIMELINE_MAGIC: [u8; 8] = *b"KVTTIME\0";
pub const TIMELINE_VERSION: u32 = 1;
pub const TIMELINE_HEADER_BYTES: usize = 32;
pub const TIMELINE_POINT_BYTES: usize = 16;
/// The most points a timeline keeps (a writer halves its resolution past it): 1 MiB on disk.
pub const MAX_POINTS: usize = 1 << 16;
/// The largest `end` a reader accepts.
pub const MAX_END: u64 = 1 << 62;

pub fn encode(points: &[(u64, u64)]) -> Vec<u8> {
    assert!(points.len() <= MAX_POINTS, "a timeline keeps at most {MAX_POINTS} points");
    let mut out = vec![0u8; TIMELINE_HEADER_BYTES + points.len() * TIMELINE_POINT_BYTES];
    for (i, &(end, unix_ms)) in points.iter().enumerate() {
        let at = TIMELINE_HEADER_BYTES + i * TIMELINE_POINT_BYTES;
        put_u64(&mut out, at, end);
        put_u64(&mut out, at + 8, unix_ms);
    }
    let points_sum = checksum(&out[TIMELINE_HEADER_BYTES..]);
    out[0..8].copy_from_slice(&TIMELINE_MAGIC);
    put_u32(&mut out, 8, TIMELINE_VERSION);
    put_u32(&mut out, 12, points.len() as u32);
    put_u64(&mut out, 16, points_sum);
    let sum = checksum(&out[..24]);
    put_u64(&mut out, 24, sum);
    debug_assert_eq!(out.len(), TIMELINE_HEADER_BYTES + points.len() * TIMELINE_POINT_BYTES);
    out
}

pub fn decode(bytes: &[u8]) -> Result<Vec<(u64, u64)>, ParseError> {
    if bytes.len() < TIMELINE_HEADER_BYTES {
        return Err(ParseError::TooShort(bytes.len()));
    }
    if bytes[0..8] != TIMELINE_MAGIC {
        return Err(ParseError::BadMagic);
    }
    if checksum(&bytes[..24]) != get_u64(bytes, 24) {
        return Err(ParseError::HeaderChecksum);
    }
    let version = get_u32(bytes, 8);
    if version != TIMELINE_VERSION {
        return Err(ParseError::Version(version));
    }
    let count = get_u32(bytes, 12) as usize;
    if count > MAX_POINTS {
        return Err(ParseError::OutOfRange("point_count"));
    }
    let end = TIMELINE_HEADER_BYTES + count * TIMELINE_POINT_BYTES;
    if bytes.len() != end {
        return Err(ParseError::OutOfRange("file length"));
    }
    if checksum(&bytes[TIMELINE_HEADER_BYTES..end]) != get_u64(bytes, 16) {
        return Err(ParseError::BodyChecksum("points"));
    }
    let points: Vec<(u64, u64)> = (0..count)
        .map(|i| {
            let at = TIMELINE_HEADER_BYTES + i * TIMELINE_POINT_BYTES;
            (get_u64(bytes, at), get_u64(bytes, at + 8))
        })
        .collect();
    // No store hands out 2^62 sequences (the catalog drops recovered entries past it): a larger end
    // is forged, and would overflow the sequences handed out after it.
    if points.last().is_some_and(|&(end, _)| end > MAX_END) {
        return Err(ParseError::OutOfRange("end"));
    }
    if points.windows(2).any(|w| w[1].0 < w[0].0 || w[1].1 < w[0].1) {
        return Err(ParseError::OutOfRange("points out of order"));
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_damage() {
        let points = vec![(11, 5_000), (21, 6_000), (31, 8_000)];
        let bytes = encode(&points);
        assert_eq!(decode(&bytes).unwrap(), points);
        assert_eq!(decode(&encode(&[])).unwrap(), vec![]);
        let mut flipped = bytes.clone();
        flipped[TIMELINE_HEADER_BYTES + 3] ^= 1;
        assert_eq!(decode(&flipped), Err(ParseError::BodyChecksum("points")));
        assert_eq!(decode(&bytes[..bytes.len() - 1]), Err(ParseError::OutOfRange("file length")));
        assert_eq!(decode(&bytes[..10]), Err(ParseError::TooShort(10)));
        let mut foreign = bytes.clone();
        foreign[0] = b'X';
        assert_eq!(decode(&foreign), Err(ParseError::BadMagic));
        assert_eq!(decode(&encode(&[(u64::MAX, 1)])), Err(ParseError::OutOfRange("end")));
        let unordered = encode(&[(21, 6_000), (11, 7_000)]);
        assert_eq!(decode(&unordered), Err(ParseError::OutOfRange("points out of order")));
    }
}
