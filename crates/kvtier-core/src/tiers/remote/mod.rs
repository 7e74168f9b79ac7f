//! The floor under the remote tiers (the shared filesystem, `tiers/shared`; the object store,
//! `tiers/object`): what every remote tier shares, so that no tier names another.
//!
//! - [`RemoteTier`]: what a remote tier implements, in its own folder, for the store's
//!   `RemoteTiers` (`crate::remote_tiers`) to answer for all of them: membership, the index's
//!   generation and keys, reads started and judged, and (as a [`PublishSink`]) publishing.
//! - [`publisher`]: the store's background thread batching accepted blocks into a tier.
//! - [`heartbeat`]: a tier's index refreshes, timed, so that a tier that stopped answering is
//!   seen before a request's load meets it.
//! - [`keys`]: a remote index's keys (`KeyIndex`): locations, the generation, and which keys a
//!   residency report names when there are more than it takes.
//! - [`key`]: the deployment key's loader (the tags are `crate::format::shared::AuthKey`).
//! - [`lease`]: the evictor lease's rules (which generation is in force, whether a record holds
//!   others off), so that no forged lease object stops eviction in any tier.
//! - [`ReadOutcome`], [`StartedRead`]: how a read ends, and a tier's own record of a read in flight.
//! - [`tenants`]: a remote tier split by tenant: tenant tags in names, the evictor's accounts and
//!   victims, the labels of the per-tenant figures.
//! - [`random_nonzero_u64`]: writer ids.

pub mod heartbeat;
pub mod key;
pub mod keys;
pub mod lease;
pub mod publisher;
pub mod tenants;

pub use heartbeat::Heartbeat;
pub use publisher::{PublishSink, Publisher, Refetch};

use crate::io::device::OnDone;
use crate::key::BlockKey;
use std::any::Any;

/// How one remote read ended, once the tier judged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The slot holds the verified block (descriptor page then value).
    Hit,
    /// Not indexed, gone, short, failed or not verified: counted, and what was bad dealt with by
    /// the tier (a file quarantined, a block left out of the index).
    Miss,
    /// The I/O engine gave the read up: the kernel may still write into the slot, so its owner must
    /// never reuse it.
    Abandoned,
}

/// One block to read into a DRAM slot: its key, the slot (`slot_bytes`, 4096-aligned), and what to
/// call when the bytes are there (or the read failed).
pub type ReadRequest = (BlockKey, *mut u8, OnDone);

/// A read a remote tier started, in that tier's own terms, until the same tier judges it. Opaque to
/// everyone else: the caller only carries it back to the tier that made it.
pub struct StartedRead(Box<dyn Any + Send>);

impl StartedRead {
    pub fn new<T: Any + Send>(read: T) -> Self {
        StartedRead(Box::new(read))
    }

    /// The tier's own record back.
    ///
    /// # Panics
    /// When handed to a tier that did not start it: the caller keeps each read with its tier.
    pub fn into_inner<T: Any>(self) -> T {
        match self.0.downcast::<T>() {
            Ok(read) => *read,
            Err(_) => panic!("a remote read judged by a tier that did not start it"),
        }
    }
}

/// What a remote tier implements (besides publishing, [`PublishSink`]) for the store to use it
/// without naming it. Every answer comes from memory except the reads.
pub trait RemoteTier: PublishSink {
    /// Changes whenever the index gains or loses a key. Read it before `cut_keys`: a change in
    /// between is then read again next time, never missed.
    fn keys_generation(&self) -> u64;

    /// Up to `limit` indexed keys for the residency report (`KeyIndex::cut`): the same keys from
    /// call to call while the index holds them.
    fn cut_keys(&self, limit: usize) -> Vec<BlockKey>;

    /// The tier's index refreshes, timed by its maintenance thread (`Heartbeat::refresh`).
    fn heartbeat(&self) -> &Heartbeat;

    /// Adjacent blocks one request reads at most: a load plans rounds of at least this many, so
    /// that a run is not cut into single-block requests.
    fn blocks_per_request(&self) -> usize {
        1
    }

    /// Starts reading each block into its slot; each read's `on_done` gets its I/O result, to be
    /// handed with the returned read to `finish_read`. `None`: not started, a miss the tier counted,
    /// and its `on_done` is dropped uncalled.
    ///
    /// # Safety
    /// Each slot is 4096-aligned, valid for `slot_bytes` bytes of writes and used by nothing else
    /// until `finish_read` judged its read; a slot whose outcome is `Abandoned` is never used again.
    unsafe fn start_reads(&self, requests: Vec<ReadRequest>) -> Vec<Option<StartedRead>>;

    /// Judges a finished read of this tier: verified, it is a hit; anything else a counted miss.
    ///
    /// # Safety
    /// `slot` is the read's own and its `on_done` ran.
    unsafe fn finish_read(&self, read: StartedRead, slot: *mut u8, result: std::io::Result<()>) -> ReadOutcome;
}

/// A random non-zero id (writer ids: a tier's files, segments and lease records name their writer).
pub fn random_nonzero_u64() -> u64 {
    let mut buf = [0u8; 8];
    loop {
        if rustix::rand::getrandom(&mut buf, rustix::rand::GetRandomFlags::empty()).is_err() {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            buf = (t.as_nanos() as u64 ^ ((std::process::id() as u64) << 32)).to_le_bytes();
        }
        let v = u64::from_le_bytes(buf);
        if v != 0 {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_started_read_comes_back_as_what_its_tier_put_in() {
        let read = StartedRead::new((7u64, "segment"));
        assert_eq!(read.into_inner::<(u64, &str)>(), (7, "segment"));
    }

    #[test]
    #[should_panic(expected = "did not start it")]
    fn a_read_handed_to_another_tier_is_refused() {
        StartedRead::new(7u64).into_inner::<String>();
    }
}
