//! DRAM eviction policies over slot ids. S3-FIFO is the default (a small probationary FIFO, a main
//! FIFO with reinsertion of accessed entries, and a ghost queue of recently evicted keys), which
//! keeps one-hit scans from flushing hot shared prefixes; LRU is kept to measure against on traces.

use std::collections::{HashSet, VecDeque};

pub trait EvictionPolicy: Send {
    /// A slot now holds a block whose key hashes to `key_hash`.
    fn insert(&mut self, slot: u32, key_hash: u64);
    /// The block in `slot` was hit.
    fn touch(&mut self, slot: u32);
    /// The slot was emptied outside eviction.
    fn remove(&mut self, slot: u32);
    /// Picks a victim among the slots `evictable` accepts and forgets it; `None` if none is evictable.
    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32>;
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Queue {
    None,
    Small,
    Main,
}

pub struct S3Fifo {
    small: VecDeque<(u32, u32)>,
    main: VecDeque<(u32, u32)>,
    ghost: VecDeque<u64>,
    ghost_set: HashSet<u64>,
    ghost_capacity: usize,
    queue_of: Vec<Queue>,
    generation: Vec<u32>,
    freq: Vec<u8>,
    key_hash: Vec<u64>,
    small_live: usize,
    main_live: usize,
    small_target: usize,
}

impl S3Fifo {
    pub fn new(slot_count: usize) -> Self {
        S3Fifo {
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghost: VecDeque::new(),
            ghost_set: HashSet::new(),
            ghost_capacity: slot_count.max(1),
            queue_of: vec![Queue::None; slot_count],
            generation: vec![0; slot_count],
            freq: vec![0; slot_count],
            key_hash: vec![0; slot_count],
            small_live: 0,
            main_live: 0,
            small_target: (slot_count / 10).max(1),
        }
    }

    fn push(&mut self, slot: u32, queue: Queue) {
        let s = slot as usize;
        debug_assert!(self.queue_of[s] == Queue::None, "slot {slot} queued twice");
        self.queue_of[s] = queue;
        let item = (slot, self.generation[s]);
        match queue {
            Queue::Small => {
                self.small.push_back(item);
                self.small_live += 1;
            }
            Queue::Main => {
                self.main.push_back(item);
                self.main_live += 1;
            }
            Queue::None => {}
        }
    }

    fn forget(&mut self, slot: u32) {
        let s = slot as usize;
        match self.queue_of[s] {
            Queue::Small => {
                assert!(self.small_live > 0, "slot {slot} in the small queue, which counts none");
                self.small_live -= 1;
            }
            Queue::Main => {
                assert!(self.main_live > 0, "slot {slot} in the main queue, which counts none");
                self.main_live -= 1;
            }
            Queue::None => return,
        }
        self.queue_of[s] = Queue::None;
        self.generation[s] = self.generation[s].wrapping_add(1);
    }

    fn remember_ghost(&mut self, key_hash: u64) {
        if self.ghost_set.insert(key_hash) {
            self.ghost.push_back(key_hash);
            if self.ghost.len() > self.ghost_capacity {
                if let Some(old) = self.ghost.pop_front() {
                    self.ghost_set.remove(&old);
                }
            }
        }
        debug_assert!(self.ghost.len() <= self.ghost_capacity && self.ghost_set.len() <= self.ghost.len());
    }
}

impl EvictionPolicy for S3Fifo {
    fn insert(&mut self, slot: u32, key_hash: u64) {
        self.forget(slot);
        let s = slot as usize;
        self.freq[s] = 0;
        self.key_hash[s] = key_hash;
        let queue = if self.ghost_set.remove(&key_hash) { Queue::Main } else { Queue::Small };
        self.push(slot, queue);
    }

    fn touch(&mut self, slot: u32) {
        let f = &mut self.freq[slot as usize];
        *f = (*f + 1).min(3);
    }

    fn remove(&mut self, slot: u32) {
        self.forget(slot);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        // Each live entry can be examined a bounded number of times (freq <= 3 plus one skip).
        let mut budget = 5 * (self.small.len() + self.main.len()) + 2;
        while budget > 0 {
            budget -= 1;
            let from_small = self.small_live > self.small_target || self.main_live == 0;
            let popped = if from_small { self.small.pop_front() } else { self.main.pop_front() };
            let Some((slot, generation)) = popped else {
                if self.small.is_empty() && self.main.is_empty() {
                    return None;
                }
                continue;
            };
            let s = slot as usize;
            let expected = if from_small { Queue::Small } else { Queue::Main };
            if self.generation[s] != generation || self.queue_of[s] != expected {
                continue; // stale queue item
            }
            // Take it off its queue's live count; put back below if it survives.
            self.forget(slot);
            self.generation[s] = generation; // keep the same generation while it is re-queued
            if self.freq[s] > 0 {
                if from_small {
                    self.freq[s] = 0;
                } else {
                    self.freq[s] -= 1;
                }
                self.push(slot, Queue::Main);
                continue;
            }
            if !evictable(slot) {
                self.push(slot, expected);
                continue;
            }
            self.generation[s] = self.generation[s].wrapping_add(1);
            if from_small {
                let h = self.key_hash[s];
                self.remember_ghost(h);
            }
            debug_assert!(self.queue_of[s] == Queue::None, "victim {slot} still queued");
            return Some(slot);
        }
        None
    }
}

/// Least recently used, for comparison on traces (tests only: the `testing` feature).
#[cfg(any(test, feature = "testing"))]
pub struct Lru {
    tick: u64,
    last_use: Vec<Option<u64>>,
    order: std::collections::BTreeMap<u64, u32>,
}

#[cfg(any(test, feature = "testing"))]
impl Lru {
    pub fn new(slot_count: usize) -> Self {
        Lru { tick: 0, last_use: vec![None; slot_count], order: Default::default() }
    }

    fn bump(&mut self, slot: u32) {
        if let Some(t) = self.last_use[slot as usize].take() {
            let listed = self.order.remove(&t);
            debug_assert_eq!(listed, Some(slot), "slot {slot}'s last use lists another slot");
        }
        self.tick += 1;
        self.last_use[slot as usize] = Some(self.tick);
        self.order.insert(self.tick, slot);
        debug_assert!(self.order.len() <= self.last_use.len(), "more uses listed than slots");
    }
}

#[cfg(any(test, feature = "testing"))]
impl EvictionPolicy for Lru {
    fn insert(&mut self, slot: u32, _key_hash: u64) {
        self.bump(slot);
    }

    fn touch(&mut self, slot: u32) {
        if self.last_use[slot as usize].is_some() {
            self.bump(slot);
        }
    }

    fn remove(&mut self, slot: u32) {
        if let Some(t) = self.last_use[slot as usize].take() {
            self.order.remove(&t);
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let found = self.order.iter().find(|(_, &slot)| evictable(slot)).map(|(&t, &s)| (t, s));
        let (t, slot) = found?;
        self.order.remove(&t);
        self.last_use[slot as usize] = None;
        Some(slot)
    }
}
