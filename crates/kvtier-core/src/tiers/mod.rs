//! Storage tiers: the DRAM arena ([`dram`]) with its eviction policy ([`eviction`]), and the NVMe
//! region log ([`nvme`]): device files, geometry and recovery; and the shared-filesystem tier
//! ([`shared`]): grouped data files, manifests, capacity rules; and the object-storage tier
//! ([`object`]): segment objects in an S3 bucket.

pub mod dram;
pub mod eviction;
pub mod nvme;
pub mod object;
pub mod shared;
