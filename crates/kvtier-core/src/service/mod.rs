//! The host service: one process per host and store path owns the stores (catalog, NVMe and shared
//! tiers) and their DRAM pools in shared memory; every engine on the host talks to it over a Unix
//! socket (`protocol`) and copies its own KV slices in and out of the pool (`client`), so a
//! prefix that any engine computed is a DRAM hit for all of them and outlives engine restarts.

pub(crate) mod changes;
mod client;
mod engines;
mod fills;
mod gate;
mod latency;
mod namespaces;
mod placement;
// The framing is the service's own: engines use `Client`; tests that forge frames use
// `kvtier_core::testing::wire`.
pub(crate) mod protocol;
mod server;
mod sessions;
mod socket_file;

pub use changes::{TIER_DRAM, TIER_NVME, TIER_REMOTE};
pub use client::{Attached, Client, EngineEntry, NamespaceInfo, RemoteBadBlock, RemoteVerifyBatch, ReserveReply};
pub use engines::{EngineCounters, ENGINE_FALLBACKS, ENGINE_REPORTED, MAX_ENGINES};
pub use gate::CopyGate;
pub use placement::{Placement, PlacementRun};
pub use server::{Service, ServiceConfig, MAX_TP_SIZE};
