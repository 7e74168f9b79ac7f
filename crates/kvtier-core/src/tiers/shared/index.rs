//! The in-memory index of the shared tier: which key lives at which offset of which data file, the
//! files' sizes and last access times, and the names of files that are gone (evicted or quarantined).
//! It is fed only by manifest records (ours applied at once, everybody's by tailing), so a lookup
//! never touches the filesystem.
//!
//! File names are never reused (writer ids are random per process, sequence numbers increase), so a
//! doom or quarantine record is final: a name once gone is never indexed again, whatever order the
//! manifests of different writers are read in.

use super::format::{IndexEntry, Record};
use crate::key::{BlockKey, Namespace};
use crate::tiers::remote::keys::KeyIndex;
use std::collections::{HashMap, HashSet};

pub type FileId = u32;

#[derive(Debug, Clone, Copy)]
pub struct Location {
    pub file: FileId,
    pub offset: u64,
    pub value_checksum: u64,
}

#[derive(Debug, Clone)]
pub struct FileInfo {
    pub name: String,
    pub file_bytes: u64,
    pub keys: Vec<BlockKey>,
    /// Latest access seen in any process's access records (or publish time if never read).
    pub last_access_unix_ms: u64,
}

/// How far one writer's manifest has been read.
#[derive(Debug, Default)]
pub struct ManifestCursor {
    pub offset: u64,
    /// `Some(false)`: its header names another namespace or object size; ignored from then on.
    pub accepted: Option<bool>,
    pub warned: bool,
    /// Records without a valid tag were logged once (a deployment key is configured).
    pub auth_warned: bool,
    /// The manifest was found to be no regular file (a FIFO, a symlink) and that was logged once.
    pub not_regular_warned: bool,
}

#[derive(Default)]
pub struct Index {
    /// Where each key is; its generation moves whenever a key is gained or lost (the service's
    /// change log walks the keys again only then, `SharedTier::keys_generation`).
    keys: KeyIndex<Location>,
    files: HashMap<FileId, FileInfo>,
    by_name: HashMap<String, FileId>,
    next_file: FileId,
    /// Names evicted or quarantined: never indexed again.
    gone: HashSet<String>,
    /// Files chosen for eviction: when (unix ms) and their size. The lease holder unlinks them after
    /// the grace period; until then their bytes still count in the filesystem's usage.
    pub doomed: HashMap<String, (u64, u64)>,
    pub cursors: HashMap<u64, ManifestCursor>,
}

impl Index {
    pub fn get(&self, key: &BlockKey) -> Option<(Location, &str)> {
        let loc = *self.keys.get(key)?;
        Some((loc, self.files.get(&loc.file)?.name.as_str()))
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.keys.contains(key)
    }

    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    pub fn keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.keys.keys()
    }

    /// Up to `limit` keys for the residency report (`KeyIndex::cut`).
    pub fn cut(&self, limit: usize) -> Vec<BlockKey> {
        self.keys.cut(limit)
    }

    pub fn files(&self) -> impl Iterator<Item = &FileInfo> {
        self.files.values()
    }

    pub fn file_id(&self, name: &str) -> Option<FileId> {
        self.by_name.get(name).copied()
    }

    pub fn is_gone(&self, name: &str) -> bool {
        self.gone.contains(name)
    }

    pub fn indexed_bytes(&self) -> u64 {
        self.files.values().map(|f| f.file_bytes).sum()
    }

    /// Applies one record of the manifest of `writer_id` (ours or another's). `namespace` and
    /// `object_bytes` are ours: a manifest whose header disagrees is ignored whole.
    pub fn apply(&mut self, writer_id: u64, record: Record, namespace: &Namespace, object_bytes: u64) {
        let cursor = self.cursors.entry(writer_id).or_default();
        if let Record::Header { namespace: ns, object_bytes: ob, writer_id: w, .. } = &record {
            let ok = ns == namespace && *ob == object_bytes && *w == writer_id;
            if !ok && !cursor.warned {
                log::warn!(
                    "kvtier: shared manifest of writer {writer_id:016x} belongs to namespace {} / object_bytes {ob}, not \
                     ours; ignoring it (a foreign or copied manifest)",
                    &ns.hex()[..16]
                );
                cursor.warned = true;
            }
            cursor.accepted = Some(ok);
            return;
        }
        // Records before a header, or after a foreign header, are not ours to trust.
        if cursor.accepted != Some(true) {
            return;
        }
        match record {
            Record::Header { .. } => {}
            Record::Publish { name, file_bytes, published_unix_ms, entries } => {
                self.insert_file(name, file_bytes, published_unix_ms, &entries)
            }
            Record::Doom { at_unix_ms, names } => {
                for name in names {
                    let bytes = self.remove_file(&name).map_or(0, |f| f.file_bytes);
                    self.doomed.entry(name).or_insert((at_unix_ms, bytes));
                }
            }
            Record::Quarantine { names, .. } => {
                for name in names {
                    self.remove_file(&name);
                }
            }
            Record::Access { accesses } => {
                for (at, name) in accesses {
                    self.touch(&name, at);
                }
            }
        }
    }

    pub fn insert_file(&mut self, name: String, file_bytes: u64, published_unix_ms: u64, entries: &[IndexEntry]) {
        if self.gone.contains(&name) || self.by_name.contains_key(&name) {
            return;
        }
        let id = self.next_file;
        self.next_file = self.next_file.wrapping_add(1);
        let mut keys = Vec::with_capacity(entries.len());
        for e in entries {
            // A key published twice (two writers raced) keeps its first location; the second copy
            // is still listed with its file so that eviction accounting is exact.
            self.keys.insert(e.key, Location { file: id, offset: e.offset, value_checksum: e.value_checksum });
            keys.push(e.key);
        }
        self.by_name.insert(name.clone(), id);
        self.files.insert(id, FileInfo { name, file_bytes, keys, last_access_unix_ms: published_unix_ms });
    }

    /// Drops a file and its keys; its name is never indexed again.
    pub fn remove_file(&mut self, name: &str) -> Option<FileInfo> {
        self.gone.insert(name.to_string());
        let id = self.by_name.remove(name)?;
        let info = self.files.remove(&id)?;
        for key in &info.keys {
            self.keys.remove(key, |l| l.file == id);
        }
        Some(info)
    }

    pub fn touch(&mut self, name: &str, at_unix_ms: u64) {
        if let Some(id) = self.by_name.get(name) {
            if let Some(f) = self.files.get_mut(id) {
                f.last_access_unix_ms = f.last_access_unix_ms.max(at_unix_ms);
            }
        }
    }
}

impl super::SharedTier {
    /// Changes whenever the index gains or loses a key; read it before the keys (a refresh that
    /// races a change then reads the keys again next time, never misses one).
    pub fn keys_generation(&self) -> u64 {
        self.index.read().keys.generation()
    }
}
