//! Stress child for the shared-tier tests: one process publishing and reading blocks in a shared root
//! while eviction runs. Every value is derived from its key, so a reader can tell wrong bytes from
//! right ones without trusting kvtier's checksums. Prints `WRITER <id>`, `LEASE <id>` when it becomes
//! the evictor, and a final `STATS ...` line; exits 2 if it ever read wrong bytes.
//!
//! Usage: kvtier-shared-stress root=DIR [namespace=S] [secs=N] [capacity_bytes=N] [file_bytes=N]
//!        [object_bytes=N] [staleness_ms=N] [lease_ms=N] [grace_ms=N] [publish_every_ms=N] [tag=N]
//!        [stop_file=PATH] (ends the run early once PATH exists: a test that waits for an event)

use kvtier_core::testing::SharedTier;
use kvtier_core::SharedConfig;
use kvtier_core::Stats;
use kvtier_core::{BlockKey, Namespace};
use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The value every process expects for `key`.
fn value_for(key: &BlockKey, object_bytes: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(object_bytes + 8);
    let mut state = u64::from_le_bytes(key.0[..8].try_into().unwrap()) ^ 0x9e37_79b9_7f4a_7c15;
    while v.len() < object_bytes {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        v.extend_from_slice(&state.to_le_bytes());
    }
    v.truncate(object_bytes);
    v
}

/// The number argument `key=N`, else `default`.
fn number(args: &HashMap<String, String>, key: &str, default: u64) -> u64 {
    args.get(key).map(|v| v.parse::<u64>().expect(key)).unwrap_or(default)
}

/// The shared tier's options from the arguments (defaults sized for a test of a few seconds).
fn shared_config(args: &HashMap<String, String>, root: &str) -> SharedConfig {
    let num = |k: &str, d: u64| number(args, k, d);
    let mut config = SharedConfig::new(root);
    config.capacity_bytes = args.get("capacity_bytes").map(|v| v.parse().unwrap());
    config.file_target_bytes = num("file_bytes", 1 << 20);
    config.staleness_ms = num("staleness_ms", 50);
    config.lease_ms = num("lease_ms", 1000);
    config.grace_ms = num("grace_ms", 200);
    config.publish_delay_ms = num("publish_delay_ms", 100);
    config.orphan_tmp_ms = num("orphan_tmp_ms", 60_000);
    config
}

/// The next four keys of writer `tag`: unique per process (`tag`) and per call (`counter`).
fn next_keys(tag: u64, counter: &mut u64) -> Vec<BlockKey> {
    (0..4)
        .map(|_| {
            *counter += 1;
            let mut k = [0u8; 32];
            k[..8].copy_from_slice(&tag.to_le_bytes());
            k[8..16].copy_from_slice(&counter.to_le_bytes());
            k[16..24].copy_from_slice(&(tag ^ *counter).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
            BlockKey(k)
        })
        .collect()
}

/// Reads of indexed blocks: found with the right bytes or wrong ones, or missed.
#[derive(Default)]
struct Reads {
    hits: u64,
    misses: u64,
    wrong: u64,
}

/// Reads up to 8 blocks picked at random from the tier's index and checks each one found.
fn read_sample(tier: &SharedTier, rng: &mut u64, out: &mut [u8], reads: &mut Reads) {
    let sample = tier.indexed_keys(512);
    for _ in 0..8.min(sample.len()) {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let key = sample[(*rng % sample.len() as u64) as usize];
        if tier.read_value(&key, out).unwrap() {
            reads.hits += 1;
            if out != value_for(&key, out.len()) {
                reads.wrong += 1;
                eprintln!("WRONG bytes for {key:?}");
            }
        } else {
            reads.misses += 1;
        }
    }
}

fn main() {
    let args: HashMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| a.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    let num = |k: &str, d: u64| number(&args, k, d);
    let root = args.get("root").expect("root=DIR");
    let namespace =
        Namespace::from_description(args.get("namespace").map(String::as_str).unwrap_or("stress").as_bytes());
    let object_bytes = num("object_bytes", 60_000) as usize;
    let config = shared_config(&args, root);
    let secs = num("secs", 5);
    let publish_every = Duration::from_millis(num("publish_every_ms", 10));
    let tag = num("tag", std::process::id() as u64);
    let stats = Arc::new(Stats::default());
    let tier = SharedTier::open(&config, namespace, object_bytes, Arc::clone(&stats), &Default::default())
        .expect("open shared tier");
    println!("WRITER {:016x}", tier.writer_id());
    std::io::stdout().flush().unwrap();
    let started = Instant::now();
    let mut published = 0u64;
    let mut reads = Reads::default();
    let mut counter = 0u64;
    let mut was_evictor = false;
    let mut out = vec![0u8; object_bytes];
    let mut rng = tag.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let stop_file = args.get("stop_file").map(std::path::PathBuf::from);
    while started.elapsed() < Duration::from_secs(secs) && !stop_file.as_ref().is_some_and(|f| f.exists()) {
        let keys = next_keys(tag, &mut counter);
        let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, object_bytes)).collect();
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
        published += tier.publish_values(&keys, &refs).unwrap() as u64;
        read_sample(&tier, &mut rng, &mut out, &mut reads);
        let evictor = tier.is_evictor();
        if evictor && !was_evictor {
            println!("LEASE {:016x}", tier.writer_id());
            std::io::stdout().flush().unwrap();
        }
        was_evictor = evictor;
        std::thread::sleep(publish_every);
    }
    tier.close();
    let s = stats.snapshot();
    let Reads { hits, misses, wrong } = reads;
    println!(
        "STATS published={published} hits={hits} misses={misses} wrong={wrong} files={} evicted={} quarantined={} \
         publish_errors={} vanished={}",
        s.shared_files_published,
        s.shared_evicted_files,
        s.shared_quarantined_files,
        s.shared_publish_errors,
        tier.vanished_reads.load(std::sync::atomic::Ordering::Relaxed)
    );
    std::process::exit(if wrong == 0 { 0 } else { 2 });
}
