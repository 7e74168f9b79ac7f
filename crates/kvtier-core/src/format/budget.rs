//! The `WRITE_BUDGET` file: the bytes each bounded write budget below DRAM had left when it was
//! last saved, so that a store opened again resumes its budgets instead of starting each with a
//! full burst (a day's writes by default: a service restarted every hour would take 24 days' worth
//! a day).
//! ```text
//! header (32 bytes)
//!      0    8 magic            b"KVTBUDG\0"
//!      8    4 format_version   u32 LE (1)
//!     12    4 entry_count      u32 LE (<= MAX_ENTRIES)
//!     16    8 saved_unix_ms    u64 LE, when the entries were read off the budgets
//!     24    8 checksum         xxh3-64 of bytes 0..24 followed by the entries
//! entries (16 bytes each), from byte 32
//!      0    4 tier             u32 LE, the tier's code on the wire (2 nvme, 3 shared, 4 bucket)
//!      4    4 reserved         0
//!      8    8 bytes_left       u64 LE
//! ```

use super::*;

pub const BUDGET_MAGIC: [u8; 8] = *b"KVTBUDG\0";
pub const BUDGET_VERSION: u32 = 1;
pub const BUDGET_HEADER_BYTES: usize = 32;
pub const BUDGET_ENTRY_BYTES: usize = 16;
/// More entries than tiers ever will be: a larger count is a damaged file.
pub const MAX_ENTRIES: usize = 64;

/// What the budgets had left at `saved_unix_ms`: (tier code, bytes left) per bounded budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedBudgets {
    pub saved_unix_ms: u64,
    pub entries: Vec<(u32, u64)>,
}

fn body_checksum(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut hasher = checksum_hasher();
    hasher.write(&bytes[..24]);
    hasher.write(&bytes[BUDGET_HEADER_BYTES..]);
    hasher.finish()
}

pub fn encode(saved: &SavedBudgets) -> Vec<u8> {
    assert!(saved.entries.len() <= MAX_ENTRIES, "at most {MAX_ENTRIES} budgets");
    let mut out = vec![0u8; BUDGET_HEADER_BYTES + saved.entries.len() * BUDGET_ENTRY_BYTES];
    out[0..8].copy_from_slice(&BUDGET_MAGIC);
    put_u32(&mut out, 8, BUDGET_VERSION);
    put_u32(&mut out, 12, saved.entries.len() as u32);
    put_u64(&mut out, 16, saved.saved_unix_ms);
    for (i, &(tier, bytes_left)) in saved.entries.iter().enumerate() {
        let at = BUDGET_HEADER_BYTES + i * BUDGET_ENTRY_BYTES;
        put_u32(&mut out, at, tier);
        put_u64(&mut out, at + 8, bytes_left);
    }
    let sum = body_checksum(&out);
    put_u64(&mut out, 24, sum);
    out
}

pub fn decode(bytes: &[u8]) -> Result<SavedBudgets, ParseError> {
    if bytes.len() < BUDGET_HEADER_BYTES {
        return Err(ParseError::TooShort(bytes.len()));
    }
    if bytes[0..8] != BUDGET_MAGIC {
        return Err(ParseError::BadMagic);
    }
    let version = get_u32(bytes, 8);
    if version != BUDGET_VERSION {
        return Err(ParseError::Version(version));
    }
    let count = get_u32(bytes, 12) as usize;
    if count > MAX_ENTRIES {
        return Err(ParseError::OutOfRange("entry_count"));
    }
    if bytes.len() != BUDGET_HEADER_BYTES + count * BUDGET_ENTRY_BYTES {
        return Err(ParseError::OutOfRange("file length"));
    }
    if body_checksum(bytes) != get_u64(bytes, 24) {
        return Err(ParseError::HeaderChecksum);
    }
    let entries = (0..count)
        .map(|i| {
            let at = BUDGET_HEADER_BYTES + i * BUDGET_ENTRY_BYTES;
            (get_u32(bytes, at), get_u64(bytes, at + 8))
        })
        .collect();
    Ok(SavedBudgets { saved_unix_ms: get_u64(bytes, 16), entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_budgets_round_trip_and_any_damage_is_rejected() {
        let saved = SavedBudgets { saved_unix_ms: 1_765_000_000_000, entries: vec![(2, 1 << 40), (4, 7)] };
        let bytes = encode(&saved);
        assert_eq!(bytes.len(), BUDGET_HEADER_BYTES + 2 * BUDGET_ENTRY_BYTES);
        assert_eq!(decode(&bytes), Ok(saved));
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            assert!(decode(&damaged).is_err(), "a flipped bit at byte {at} was accepted");
        }
        assert!(decode(&bytes[..bytes.len() - 1]).is_err(), "a cut file was accepted");
        let empty = SavedBudgets { saved_unix_ms: 0, entries: Vec::new() };
        assert_eq!(decode(&encode(&empty)), Ok(empty));
    }
}
