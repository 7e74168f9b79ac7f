//! S3-FIFO against LRU on a prefix-caching trace: shared prefixes with Zipf popularity (system
//! prompts, documents reused across requests) mixed with one-hit unique suffixes. The DRAM policy
//! must keep the hot prefixes when unique blocks stream through.

use kvtier_core::testing::{EvictionPolicy, Lru, S3Fifo};
use std::collections::HashMap;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Block ids of a trace: each request reads a shared prefix (Zipf over `prefixes`, 16 blocks each)
/// then `unique_blocks` blocks nobody reads again.
fn trace(requests: usize, prefixes: usize, unique_blocks: usize, seed: u64) -> Vec<u64> {
    let mut rng = Rng(seed);
    let weights: Vec<f64> = (1..=prefixes).map(|r| 1.0 / (r as f64).powf(0.9)).collect();
    let total: f64 = weights.iter().sum();
    let mut out = Vec::new();
    let mut unique = 1u64 << 40;
    for _ in 0..requests {
        let mut x = rng.unit() * total;
        let mut p = 0;
        while x > weights[p] && p + 1 < prefixes {
            x -= weights[p];
            p += 1;
        }
        out.extend((0..16).map(|b| (p as u64) << 8 | b));
        for _ in 0..unique_blocks {
            unique += 1;
            out.push(unique);
        }
    }
    out
}

fn hit_ratio(policy: &mut dyn EvictionPolicy, slots: usize, trace: &[u64]) -> f64 {
    let mut where_: HashMap<u64, u32> = HashMap::new();
    let mut holder: Vec<Option<u64>> = vec![None; slots];
    let mut free: Vec<u32> = (0..slots as u32).collect();
    let mut hits = 0usize;
    for &block in trace {
        if let Some(&slot) = where_.get(&block) {
            hits += 1;
            policy.touch(slot);
            continue;
        }
        let slot = match free.pop() {
            Some(s) => s,
            None => {
                let victim = policy.victim(&mut |_| true).expect("a victim");
                where_.remove(&holder[victim as usize].take().unwrap());
                victim
            }
        };
        holder[slot as usize] = Some(block);
        where_.insert(block, slot);
        policy.insert(slot, block.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }
    hits as f64 / trace.len() as f64
}

#[test]
fn s3fifo_beats_lru_when_unique_suffixes_stream_through() {
    let slots = 512;
    let mut rows = Vec::new();
    for (unique_blocks, seed) in [(8usize, 7u64), (32, 11), (64, 13)] {
        let t = trace(4000, 200, unique_blocks, seed);
        let s3 = hit_ratio(&mut S3Fifo::new(slots), slots, &t);
        let lru = hit_ratio(&mut Lru::new(slots), slots, &t);
        println!("unique blocks/request {unique_blocks:>3}: S3-FIFO hit ratio {s3:.3}, LRU {lru:.3}");
        rows.push((s3, lru));
    }
    for (s3, lru) in rows {
        assert!(s3 >= lru, "S3-FIFO {s3} should not lose to LRU {lru} on this trace");
    }
}

#[test]
fn policies_skip_unevictable_slots() {
    for policy in [&mut S3Fifo::new(8) as &mut dyn EvictionPolicy, &mut Lru::new(8)] {
        for s in 0..8 {
            policy.insert(s, s as u64);
        }
        let v = policy.victim(&mut |s| s == 5).unwrap();
        assert_eq!(v, 5);
        assert!(policy.victim(&mut |_| false).is_none());
        policy.remove(3);
        let v = policy.victim(&mut |s| s == 3);
        assert_eq!(v, None, "a removed slot is not a victim");
    }
}
