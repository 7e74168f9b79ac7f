//! kvtier core: a tiered store for LLM KV-cache blocks (DRAM arena + NVMe region log).
//!
//! - `admission`: which stored blocks go below DRAM (evidence of reuse) and how fast (write budgets).
//! - `catalog`: the control plane (index, allocation, eviction, pins, recovery adoption).
//! - `mover`: the data plane (copies and I/O at locations the catalog hands out).
//! - `store_state`: `StoreState`, the state a store's threads share; the mover works on it, not on `store`.
//! - `remote_tiers`: `RemoteTiers`, every remote tier of a store behind one value (no per-tier branches).
//! - `tenant`: who stores a block (a request's `cache_salt`), and the DRAM pool's shares by tenant.
//! - `tiers`: the DRAM arena and eviction policy; the NVMe device files and recovery; the remote tiers
//!   (shared filesystem, object store) on their floor, `tiers::remote`.
//! - `io`: I/O engines (io_uring, psync pool, fault injection) and the device queue every tier
//!   moves block data through (NVMe: one per device file; the shared tier: one for its files).
//! - [`format`]: on-disk structures, versioned and checksummed.
//! - [`service`]: the host service (one per host and store path) and its client, over a Unix socket.
//! - `timeline`: when sequences were handed out (dates for trim and inspect); `namespace_dir`: the
//!   DESCRIPTION and TIMELINE files beside a namespace's device file.
//! - `maintenance`: scrub, trim and namespace facts for operators (`kvtier verify|trim|inspect`).
//! - `store`: the facade tying them together, with blocking and asynchronous APIs ([`Store`]);
//!   `store_residency`: what the service's change log reads from it on each refresh.

mod admission;
mod catalog;
mod config;
mod error;
pub mod format;
mod io;
mod key;
mod maintenance;
mod mover;
mod namespace_dir;
mod remote_tiers;
pub mod service;
mod stats;
mod store;
mod store_residency;
mod store_state;
mod tenant;
mod tiers;
mod timeline;

// The public surface, on purpose: everything else is private, so rustc reports what nothing uses.
// `format` stays a public module: the on-disk structures are an interface of their own (tools,
// the format fuzzers).
pub use admission::WriteAdmission;
pub use catalog::{Gauges, Tier, TierRow, TrimCounts, TIER_ROWS};
pub use config::{
    find_option, unknown_option_message, ConfigOption, NvmeWithoutSpace, OptionKind, OptionValue, StoreConfig, OPTIONS,
};
pub use error::{Error, Result};
pub use io::{DirectIo, EngineChoice};
pub use key::{BlockKey, Namespace};
pub use maintenance::{BadBlock, NamespaceFacts, TrimRequest, VerifyBatch};
pub use mover::{BlockBuffer, Reservation};
pub use namespace_dir::DESCRIPTION_FILE_NAME;
pub use stats::{Stats, StatsSnapshot};
pub use store::{Job, JobKind, PoolLayout, Store, StoreStats};
pub use tenant::{tenant_id, tenant_label, TenantId, DEFAULT_TENANT};
pub use tiers::shared::SharedConfig;

/// What only tests, fuzzers and stress tools need: fault injection, aligned buffers, the shared
/// tier and the eviction policies driven on their own, and the wire framing for forged requests.
/// Not an interface for engines or operators; it may change with any release. Built only with the
/// `testing` feature (the integration tests get it from the crate's dev-dependency on itself), as are
/// the other seams: `StoreConfig::fault_plan`, `ServiceConfig::panic_on_label`, `Store::check_invariants`.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    pub use crate::io::buffer::AlignedBuf;
    pub use crate::io::faults::FaultPlan;
    pub use crate::io::IoSetup;
    pub use crate::tiers::eviction::{EvictionPolicy, Lru, S3Fifo};
    pub use crate::tiers::health::HealthPolicy;
    pub use crate::tiers::shared::SharedTier;

    /// The host service's framing (docs/service.md), for tests that speak to it byte by byte.
    pub mod wire {
        pub use crate::service::protocol::{read_frame, write_frame, Op, Writer, PROTOCOL_VERSION};
    }
}
