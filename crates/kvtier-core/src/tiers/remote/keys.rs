//! The keys of a remote tier's index (the shared filesystem's files, the object store's segments):
//! where each block is, its other copies, a generation that moves whenever a key is gained or lost,
//! and which keys the residency report names when the index holds more than it takes.
//!
//! Two writers that have not yet seen each other's file or segment can both publish a block: both
//! copies are indexed, the first listed in use, the others kept for when it goes (evicted, gone,
//! refused), so that a block another writer still holds is never a miss.
//!
//! The report (`Store::residency_changes`, the change log behind routers' KV events) takes at most
//! `limit` keys of a tier. A cut in the map's own order changed with every insert and resize: blocks
//! still present were reported removed, and a resize reordered the whole cut, more changes than the
//! log's ring holds. Here every key carries a mark, "named": a key named once stays named while the
//! index holds it, and room under the limit is filled with unnamed keys. Only a key leaving the
//! index leaves the cut; the map's order and resizes never change it.

use crate::key::BlockKey;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A key's location and its mark.
struct Entry<L> {
    loc: L,
    /// Named by the residency report (see the module comment). Atomic: `cut` marks under the
    /// index's read lock, so that lookups go on meanwhile.
    named: AtomicBool,
}

/// The keys of a remote index, each at one location `L` (the tier's own: a file and offset, a
/// segment and offset).
pub struct KeyIndex<L> {
    keys: HashMap<BlockKey, Entry<L>>,
    /// The other copies of indexed keys (rarely any), in the order they were listed.
    others: HashMap<BlockKey, Vec<L>>,
    /// How many entries are named.
    named: AtomicUsize,
    /// One `cut` at a time: it changes marks and `named` without the write lock.
    cutting: Mutex<()>,
    /// Bumped whenever a key is gained or lost.
    generation: u64,
}

impl<L> Default for KeyIndex<L> {
    fn default() -> Self {
        KeyIndex {
            keys: HashMap::new(),
            others: HashMap::new(),
            named: AtomicUsize::new(0),
            cutting: Mutex::new(()),
            generation: 0,
        }
    }
}

impl<L> KeyIndex<L> {
    pub fn get(&self, key: &BlockKey) -> Option<&L> {
        self.keys.get(key).map(|e| &e.loc)
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.keys.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.keys.keys()
    }

    /// Moves whenever a key is gained or lost (the change log reads the keys again only then).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Indexes a copy of `key` at `loc`: the one used if the key had none (`true`: a key gained),
    /// else kept for when the copies before it go.
    pub fn insert(&mut self, key: BlockKey, loc: L) -> bool {
        match self.keys.entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => {
                self.others.entry(key).or_default().push(loc);
                false
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry { loc, named: AtomicBool::new(false) });
                self.generation += 1;
                true
            }
        }
    }

    /// Drops the copies of `key` that `is_it` picks (those in the file or segment going). When the
    /// copy in use goes, the next other copy takes its place and the key stays (named or not);
    /// `true` only when the key left the index, its last copy gone.
    pub fn remove(&mut self, key: &BlockKey, is_it: impl Fn(&L) -> bool) -> bool {
        let Some(entry) = self.keys.get_mut(key) else {
            debug_assert!(!self.others.contains_key(key), "other copies only of an indexed key");
            return false;
        };
        let mut others = self.others.remove(key).unwrap_or_default();
        others.retain(|loc| !is_it(loc));
        let in_use_goes = is_it(&entry.loc);
        let replaced = in_use_goes && !others.is_empty();
        if replaced {
            entry.loc = others.remove(0);
        }
        let gone = in_use_goes && !replaced;
        if !others.is_empty() {
            self.others.insert(*key, others);
        }
        if !gone {
            return false;
        }
        let mut entry = self.keys.remove(key).expect("checked present");
        if *entry.named.get_mut() {
            *self.named.get_mut() -= 1;
        }
        self.generation += 1;
        true
    }

    /// Up to `limit` keys for the residency report: every named key (all of them, unless `limit`
    /// shrank since the last cut: then the first `limit` met), then unnamed keys, named now, while
    /// there is room. One pass over the index; call it under the index's read lock.
    pub fn cut(&self, limit: usize) -> Vec<BlockKey> {
        let _one = self.cutting.lock();
        let mut room = limit.saturating_sub(self.named.load(Ordering::Acquire));
        let mut out = Vec::with_capacity(limit.min(self.keys.len()));
        for (key, entry) in &self.keys {
            if entry.named.load(Ordering::Relaxed) {
                if out.len() < limit {
                    out.push(*key);
                } else {
                    entry.named.store(false, Ordering::Relaxed);
                    let before = self.named.fetch_sub(1, Ordering::AcqRel);
                    debug_assert!(before > 0, "a named key not counted");
                }
            } else if room > 0 {
                room -= 1;
                entry.named.store(true, Ordering::Relaxed);
                self.named.fetch_add(1, Ordering::AcqRel);
                out.push(*key);
            }
        }
        assert!(out.len() <= limit, "the cut names at most its limit");
        debug_assert_eq!(self.named.load(Ordering::Acquire), out.len(), "every named key is in the cut");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn key(i: u32) -> BlockKey {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        BlockKey(k)
    }

    fn cut_of(index: &KeyIndex<u32>, limit: usize) -> HashSet<BlockKey> {
        index.cut(limit).into_iter().collect()
    }

    #[test]
    fn a_named_key_stays_named_while_indexed_through_inserts_and_resizes() {
        let (limit, mut index) = (64, KeyIndex::default());
        let mut named = HashSet::new();
        for i in 0..10_000u32 {
            assert!(index.insert(key(i), i)); // the map resizes many times on the way
            if i % 97 == 0 {
                let now = cut_of(&index, limit);
                assert!(named.is_subset(&now), "a present key left the cut at {i}");
                assert_eq!(now.len(), index.len().min(limit));
                named = now;
            }
        }
    }

    #[test]
    fn only_a_key_leaving_the_index_leaves_the_cut_and_its_room_is_filled() {
        let (limit, mut index) = (8, KeyIndex::default());
        for i in 0..100 {
            index.insert(key(i), i);
        }
        let first = cut_of(&index, limit);
        let gone: Vec<BlockKey> = first.iter().take(3).copied().collect();
        let before = index.generation();
        for k in &gone {
            assert!(!index.remove(k, |&loc| loc == u32::MAX), "another location: stays");
            assert!(index.remove(k, |_| true));
        }
        assert_eq!(index.generation(), before + 3, "a key lost moves the generation");
        let second = cut_of(&index, limit);
        assert_eq!(second.len(), limit, "refilled");
        assert!(first.difference(&second).all(|k| gone.contains(k)), "only the removed keys left");
        let smaller = cut_of(&index, 4);
        assert!(smaller.len() == 4 && smaller.is_subset(&second), "a smaller limit keeps named keys");
        assert_eq!(cut_of(&index, 4), smaller, "and then stays");
        let present = *smaller.iter().next().unwrap();
        assert!(!index.insert(present, u32::MAX), "indexed already: another copy, no key gained");
    }

    #[test]
    fn another_copy_takes_over_when_the_one_in_use_goes() {
        let mut index = KeyIndex::default();
        assert!(index.insert(key(1), 10), "a key gained");
        assert!(!index.insert(key(1), 20) && !index.insert(key(1), 30), "other copies: no key gained");
        assert_eq!(index.get(&key(1)), Some(&10), "the first listed is used");
        let named = cut_of(&index, 4);
        let before = index.generation();
        assert!(!index.remove(&key(1), |&loc| loc == 20), "another copy going changes nothing in use");
        assert_eq!(index.get(&key(1)), Some(&10));
        assert!(!index.remove(&key(1), |&loc| loc == 10), "the copy in use going: the next takes over");
        assert_eq!(index.get(&key(1)), Some(&30));
        assert_eq!(index.generation(), before, "the key never left");
        assert_eq!(cut_of(&index, 4), named, "and stays named");
        assert!(index.remove(&key(1), |&loc| loc == 30), "its last copy: the key leaves");
        assert!(index.get(&key(1)).is_none() && index.generation() == before + 1);
        assert!(!index.remove(&key(1), |_| true), "gone already");
    }
}
