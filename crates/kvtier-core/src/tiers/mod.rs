//! Storage tiers: the DRAM arena ([`dram`]) with its eviction policy ([`eviction`]), and the NVMe
//! region log ([`nvme`]): device files, geometry and recovery; the health of a tier below DRAM
//! ([`health`]: failed reads in a row make it step aside); and the remote tiers, on their
//! floor ([`remote`]: the publisher, the deployment key, reads, what a remote tier implements):
//! the shared-filesystem tier ([`shared`]): grouped data files, manifests, capacity rules; and the
//! object-storage tier ([`object`]): segment objects in an S3 bucket. Siblings never import each
//! other; the remote tiers share only what is in `remote` (`tests/tidy.rs` checks both).

pub mod dram;
pub mod eviction;
pub mod health;
pub mod nvme;
pub mod object;
pub mod remote;
pub mod shared;
