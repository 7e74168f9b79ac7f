//! kvtier core: a tiered store for LLM KV-cache blocks (DRAM arena + NVMe region log).
//!
//! - [`catalog`]: the control plane (index, allocation, eviction, pins, recovery adoption).
//! - [`mover`]: the data plane (copies and I/O at locations the catalog hands out).
//! - [`tiers`]: the DRAM arena and eviction policy; the NVMe device files and recovery.
//! - [`io`]: I/O engines (io_uring, psync pool, fault injection) and the per-device queue.
//! - [`format`]: on-disk structures, versioned and checksummed.
//! - [`store`]: the facade tying them together, with blocking and asynchronous APIs.

pub mod catalog;
pub mod config;
pub mod error;
pub mod format;
pub mod io;
pub mod key;
pub mod mover;
pub mod stats;
pub mod store;
pub mod tiers;

pub use config::{find_option, unknown_option_message, ConfigOption, DirectIo, OptionKind, OptionValue, StoreConfig, OPTIONS};
pub use error::{Error, Result};
pub use io::EngineChoice;
pub use key::{BlockKey, Namespace};
pub use mover::BlockBuffer;
pub use store::{Job, JobKind, Store, StoreStats};
