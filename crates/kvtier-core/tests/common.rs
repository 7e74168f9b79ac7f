//! Shared helpers for the integration tests: engine matrix, deterministic blocks, store builders.
#![allow(dead_code)]

use kvtier_core::{BlockKey, EngineChoice, Store, StoreConfig};
use std::path::Path;

/// Every test runs against both I/O engines. KVTIER_TEST_ENGINES=psync limits the matrix (CI hosts
/// with io_uring disabled).
pub fn engines() -> Vec<EngineChoice> {
    match std::env::var("KVTIER_TEST_ENGINES").as_deref() {
        Ok("psync") => vec![EngineChoice::Psync],
        Ok("io_uring") => vec![EngineChoice::IoUring],
        _ => vec![EngineChoice::IoUring, EngineChoice::Psync],
    }
}

pub fn key(i: u64) -> BlockKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.to_le_bytes());
    k[8..16].copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
    BlockKey(k)
}

/// Deterministic content for block `i` (differs per block and per byte position).
pub fn value(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn config(dir: &Path, engine: EngineChoice, object_bytes: usize) -> StoreConfig {
    let mut c = StoreConfig::new(dir, object_bytes);
    c.io_engine = engine;
    c.namespace = b"test-model/bf16/128".to_vec();
    c.dram_bytes = 16 * (object_bytes + 4096);
    c.nvme_bytes = 64 << 20;
    c.region_bytes = 4 << 20;
    c.slot_wait_ms = 2000;
    c
}

pub fn put(store: &Store, ids: &[u64]) -> Vec<bool> {
    let n = store.object_bytes();
    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
    let values: Vec<_> = ids.iter().map(|&i| value(i, n)).collect();
    let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
    store.put_many(&keys, &refs).unwrap()
}

/// Gets the blocks and checks every returned one byte for byte. Returns the hit flags.
pub fn get_checked(store: &Store, ids: &[u64]) -> Vec<bool> {
    let n = store.object_bytes();
    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
    let mut bufs: Vec<Vec<u8>> = ids.iter().map(|_| vec![0xAB; n]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|v| v.as_mut_slice()).collect();
    let hits = store.get_many(&keys, &mut refs).unwrap();
    for ((&i, hit), buf) in ids.iter().zip(&hits).zip(&bufs) {
        if *hit {
            assert!(buf == &value(i, n), "block {i} returned wrong bytes");
        }
    }
    hits
}
