//! Block keys and namespaces: the names under which blocks are stored.
//!
//! A key is the engine's 32-byte chained prefix hash of a block. A namespace is a 32-byte digest of
//! everything that makes KV bytes incompatible (model identity, dtype, layout, tokens per block,
//! parallel layout); blocks of one namespace are never returned for another.

use sha2::{Digest, Sha256};
use std::fmt;

pub const KEY_BYTES: usize = 32;

/// A block key: the engine's chained prefix hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; KEY_BYTES]);

impl BlockKey {
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        Some(BlockKey(bytes.try_into().ok()?))
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({})", hex(&self.0[..8]))
    }
}

/// A namespace digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Namespace(pub [u8; 32]);

impl Namespace {
    /// Derives the namespace digest from the caller's description of the KV layout. A caller that
    /// already holds a 32-byte digest gets it back unchanged only if it passes it through here too,
    /// which keeps one rule: the directory name is sha256(description).
    pub fn from_description(description: &[u8]) -> Self {
        let digest = Sha256::digest(description);
        Namespace(digest.into())
    }

    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({})", &self.hex()[..16])
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
