//! Storage tiers: the DRAM arena ([`dram`]) with its eviction policy ([`eviction`]), and the NVMe
//! region log ([`nvme`]): device files, geometry and recovery.

pub mod dram;
pub mod eviction;
pub mod nvme;
