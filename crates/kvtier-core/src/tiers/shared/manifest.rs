//! Manifests: this writer's append-only log (`append_records`), and the tailing of every other
//! writer's into the index (`refresh`), with the quarantine records both send.

use super::files::{open_regular, OpenError};
use super::format::{unix_ms, Record};
use super::{io_err, SharedTier};
use crate::error::{Error, Result};
use crate::stats::Stats;
use std::fs::File;
use std::io::{ErrorKind, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// Bytes of one manifest read per refresh; a longer backlog is read over several passes.
const MAX_MANIFEST_READ_BYTES: u64 = 64 << 20;

pub(super) struct ManifestWriter {
    /// `None` once the tier is closed: the descriptor is released at close, not when the last
    /// reference goes (a caller may keep the store object, and an open file pins a mount).
    pub(super) file: Option<File>,
    pub(super) path: PathBuf,
    pub(super) len: u64,
}

/// What one pass decoded from one manifest: the authentic records, how many were rejected, the
/// files those publish, and the bytes consumed (whole records only).
#[derive(Default)]
struct DecodedManifest {
    records: Vec<Record>,
    rejected: u64,
    forged_files: Vec<String>,
    consumed_bytes: usize,
}

impl SharedTier {
    /// Moves a file that failed verification to `quarantine/`, drops it from every index (through a
    /// quarantine record), and counts it once.
    pub(crate) fn quarantine(&self, name: &str, why: &str) {
        let removed = {
            let mut index = self.index.write();
            if let Some(id) = index.file_id(name) {
                self.read_handles.lock().remove(&id);
            }
            index.remove_file(name).is_some()
        };
        if !removed {
            return;
        }
        log::warn!("kvtier: shared file {name} failed verification ({why}); quarantined, its blocks are misses");
        Stats::add(&self.stats.shared_quarantined_files, 1);
        match std::fs::rename(self.data_path(name), self.dir.join("quarantine").join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => log::warn!("kvtier: moving {name} to quarantine failed: {e}"),
        }
        let _ = self.append_records(&[Record::Quarantine { at_unix_ms: unix_ms(), names: vec![name.to_string()] }]);
    }

    /// Quarantines a data file named by a manifest record that failed authentication (it was never
    /// indexed here): moved to `quarantine/` and a quarantine record appended, so that keyless
    /// processes on the same root drop it too. Counted once.
    fn quarantine_unauthenticated(&self, name: &str) {
        let first = {
            let mut index = self.index.write();
            let first = !index.is_gone(name);
            if let Some(id) = index.file_id(name) {
                self.read_handles.lock().remove(&id);
            }
            index.remove_file(name);
            first
        };
        if !first {
            return;
        }
        match std::fs::rename(self.data_path(name), self.dir.join("quarantine").join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return,
            Err(e) => {
                log::warn!("kvtier: moving {name} to quarantine failed: {e}");
                return;
            }
        }
        Stats::add(&self.stats.shared_quarantined_files, 1);
        let _ = self.append_records(&[Record::Quarantine { at_unix_ms: unix_ms(), names: vec![name.to_string()] }]);
    }

    /// Appends records to this writer's manifest in one write, then fdatasync. On failure the
    /// manifest is cut back so readers never see a torn record followed by good ones.
    pub(crate) fn append_records(&self, records: &[Record]) -> Result<()> {
        let mut bytes = Vec::new();
        let auth = self.auth.as_ref().map(|k| (k, &self.namespace, self.writer_id));
        for r in records {
            bytes.extend(r.encode_tagged(auth));
        }
        let mut m = self.manifest.lock();
        let len = m.len;
        let path = m.path.clone();
        let Some(file) = m.file.as_mut() else {
            return Err(Error::Closed);
        };
        let result = file.write_all(&bytes).and_then(|_| file.sync_data());
        if let Err(e) = result {
            let _ = file.set_len(len);
            let _ = file.seek(SeekFrom::End(0));
            return Err(Error::io(format!("appending to {}", path.display()), e));
        }
        m.len += bytes.len() as u64;
        drop(m);
        let mut index = self.index.write();
        for r in records {
            index.apply(self.writer_id, r.clone(), &self.namespace, self.object_bytes as u64);
        }
        Ok(())
    }

    /// Reads new records from every other writer's manifest. Returns whether anything was read.
    pub fn refresh(&self) -> Result<bool> {
        let dir = self.dir.join("manifests");
        let entries = std::fs::read_dir(&dir).map_err(io_err(format!("listing {}", dir.display())))?;
        let mut progressed = false;
        let mut forged_files = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(writer) = name.to_str().and_then(parse_manifest_name) else { continue };
            if writer == self.writer_id {
                continue;
            }
            progressed |= self.refresh_manifest(writer, &entry.path(), &mut forged_files);
        }
        for name in forged_files {
            self.quarantine_unauthenticated(&name);
        }
        self.last_refresh_unix_ms.store(unix_ms(), Ordering::Relaxed);
        Ok(progressed)
    }

    /// Reads one other writer's manifest from its cursor (at most `MAX_MANIFEST_READ_BYTES`) into
    /// the index; adds the files its forged records publish to `forged_files`. Returns whether a
    /// record was read. A manifest that cannot be read now is skipped: the next pass retries it.
    fn refresh_manifest(&self, writer: u64, path: &Path, forged_files: &mut Vec<String>) -> bool {
        let (offset, accepted) = {
            let index = self.index.read();
            let c = index.cursors.get(&writer);
            (c.map_or(0, |c| c.offset), c.and_then(|c| c.accepted))
        };
        if accepted == Some(false) {
            return false;
        }
        // Opened afresh every pass: on NFS, open revalidates the attribute cache (close-to-open
        // consistency), which is what bounds staleness there.
        let file = match open_regular(path, 0) {
            Ok(file) => file,
            Err(OpenError::NotRegular(kind)) => {
                self.skip_not_regular_manifest(writer, path, kind);
                return false;
            }
            Err(OpenError::Io(_)) => return false,
        };
        let Ok(len) = file.metadata().map(|m| m.len()) else { return false };
        if len <= offset {
            return false;
        }
        let want = (len - offset).min(MAX_MANIFEST_READ_BYTES) as usize;
        let mut buf = vec![0u8; want];
        let got = match read_at_most(&file, &mut buf, offset) {
            Ok(n) => n,
            Err(e) => {
                log::warn!("kvtier: reading manifest {} failed: {e}", path.display());
                return false;
            }
        };
        let mut decoded = self.decode_manifest(writer, &buf[..got], path, offset);
        if decoded.consumed_bytes == 0 {
            return false;
        }
        forged_files.append(&mut decoded.forged_files);
        self.apply_manifest(writer, path, offset, decoded);
        true
    }

    /// Decodes the whole records at the start of `bytes` (read from `path` at `offset`), checking
    /// each one's tag when a deployment key is set. Stops at a torn or unreadable record.
    fn decode_manifest(&self, writer: u64, bytes: &[u8], path: &Path, offset: u64) -> DecodedManifest {
        let mut decoded = DecodedManifest::default();
        let mut at = 0;
        loop {
            match Record::decode(&bytes[at..]) {
                Ok(Some((r, n))) => {
                    let authentic =
                        self.auth.as_ref().is_none_or(|k| k.verify_record(&self.namespace, writer, &bytes[at..at + n]));
                    if authentic {
                        decoded.records.push(r);
                    } else {
                        decoded.rejected += 1;
                        // The files such a record publishes are named after its manifest's writer
                        // (names are never reused): they are that writer's, and unauthenticated.
                        if let Record::Publish { name, .. } = &r {
                            if name.starts_with(&format!("{writer:016x}-")) {
                                decoded.forged_files.push(name.clone());
                            }
                        }
                    }
                    at += n;
                }
                Ok(None) => break,
                Err(e) => {
                    // A torn tail that is still being written looks the same: retry next pass, and
                    // say so once in case the writer died mid-record.
                    if !self.warned_stall.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "kvtier: manifest {} has an unreadable record at {} ({e}); waiting for it",
                            path.display(),
                            offset + at as u64
                        );
                    }
                    break;
                }
            }
        }
        debug_assert!(at <= bytes.len(), "decoded past the bytes read");
        decoded.consumed_bytes = at;
        decoded
    }

    /// Applies the authentic records decoded from `path` at `offset` to the index, counts (and warns
    /// once per writer about) the rejected ones, and moves the writer's cursor past them all.
    fn apply_manifest(&self, writer: u64, path: &Path, offset: u64, decoded: DecodedManifest) {
        debug_assert!(decoded.consumed_bytes > 0, "a cursor only moves forward");
        let mut index = self.index.write();
        if decoded.rejected > 0 {
            let rejected = decoded.rejected;
            Stats::add(&self.stats.shared_auth_failures, rejected);
            let cursor = index.cursors.entry(writer).or_default();
            if !cursor.auth_warned {
                cursor.auth_warned = true;
                log::warn!(
                    "kvtier: manifest {} has {rejected} records without a valid tag (written without the deployment \
                     key or with another); ignoring them and quarantining the files they publish",
                    path.display()
                );
            }
        }
        for r in decoded.records {
            index.apply(writer, r, &self.namespace, self.object_bytes as u64);
        }
        index.cursors.entry(writer).or_default().offset = offset + decoded.consumed_bytes as u64;
    }

    /// A manifest that is no regular file (as a FIFO, it would have blocked every refresh): skipped on
    /// every pass, counted each time, logged once per writer.
    fn skip_not_regular_manifest(&self, writer: u64, path: &Path, kind: &str) {
        Stats::add(&self.stats.shared_not_regular_files, 1);
        let mut index = self.index.write();
        let cursor = index.cursors.entry(writer).or_default();
        if !std::mem::replace(&mut cursor.not_regular_warned, true) {
            log::warn!(
                "kvtier: manifest {} is a {kind}, not a regular file; skipping it (only someone who can write the \
                 shared root can have put it there)",
                path.display()
            );
        }
    }
}

fn parse_manifest_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".log")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok()).flatten()
}

fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
