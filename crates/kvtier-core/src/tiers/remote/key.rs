//! The deployment key every remote tier shares: loaded at open from the tier's key file option
//! (`shared_key_file`, `bucket_key_file`), or the file named by `KVTIER_SHARED_KEY_FILE` when the
//! option is unset, refused unless only its owner can read it, it is off the shared root (a tier
//! with one) and it holds at least 32 bytes. The tags themselves are in
//! [`crate::format::shared::AuthKey`].
//!
//! Everyone who can write the shared storage can plant objects there, with valid checksums; the key
//! is what they do not have. It must therefore live on each node's local storage, readable by the
//! account that runs kvtier only.

use crate::error::{Error, Result};
use crate::format::shared::AuthKey;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Names the key file when `shared_key_file` is unset.
pub const KEY_FILE_ENV: &str = "KVTIER_SHARED_KEY_FILE";
/// Shortest key file accepted (bytes of key material).
pub const MIN_KEY_BYTES: u64 = 32;
/// Longest key file read: a key is a few random bytes, not a document.
const MAX_KEY_BYTES: u64 = 1 << 20;

const MAKE_ONE: &str = "create one with `head -c 32 /dev/urandom > FILE && chmod 600 FILE` on each node's local \
                        storage, every node with the same bytes";

/// Where a key comes from.
pub struct KeySource<'a> {
    /// The key file option, and its name (for the refusals).
    pub key_file: Option<&'a Path>,
    pub option: &'static str,
    /// The environment variable naming the file when the option is unset.
    pub env: &'static str,
    /// A directory every writer of the tier can write (the shared filesystem's root): the key must
    /// not be under it. `None` for a tier with no such directory (a bucket).
    pub shared_root: Option<&'a Path>,
}

/// The configured key file: the option, else the environment variable, else none (no MAC).
fn key_file(source: &KeySource) -> Option<(PathBuf, &'static str)> {
    if let Some(p) = source.key_file {
        return Some((p.to_path_buf(), source.option));
    }
    match std::env::var_os(source.env) {
        Some(v) if !v.is_empty() => Some((PathBuf::from(v), source.env)),
        _ => None,
    }
}

/// Loads and checks the deployment key; `Ok(None)` when none is configured. Every refusal names the
/// option (or variable) and the fix.
pub fn load_key(source: &KeySource) -> Result<Option<AuthKey>> {
    Ok(load_key_bytes(source)?.map(|bytes| AuthKey::derive(&bytes)))
}

/// Loads and checks a key file's bytes (the deployment key's, the encryption key's); `Ok(None)` when
/// none is configured.
pub fn load_key_bytes(source: &KeySource) -> Result<Option<Vec<u8>>> {
    let Some((path, option)) = key_file(source) else { return Ok(None) };
    let refuse = |why: String| Error::config(option, format!("key file {}: {why}", path.display()));
    // Checked and read through its resolved path (a symlink, such as a Kubernetes secret volume's, is
    // followed once here), so the checks are about the file actually read.
    let canonical = match std::fs::canonicalize(&path) {
        Ok(p) => p,
        Err(e) if e.kind() == ErrorKind::NotFound => return Err(refuse(format!("does not exist; {MAKE_ONE}"))),
        Err(e) => return Err(refuse(format!("cannot be resolved ({e}); it must be readable by uid {}", uid()))),
    };
    if let Some(root) = source.shared_root {
        refuse_on_shared_root(&canonical, root).map_err(refuse)?;
    }
    let mut file =
        match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(&canonical)
        {
            Ok(f) => f,
            Err(e) => return Err(refuse(format!("cannot be opened ({e}); it must be readable by uid {}", uid()))),
        };
    let meta = file.metadata().map_err(|e| refuse(format!("cannot be inspected ({e})")))?;
    if !meta.is_file() {
        return Err(refuse(format!("is not a regular file; {MAKE_ONE}")));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(refuse(format!(
            "has mode {mode:03o}: group or others can read or write it; `chmod 600 {}` (readable by its owner only, \
             the account that runs kvtier)",
            path.display()
        )));
    }
    if meta.len() > MAX_KEY_BYTES {
        return Err(refuse(format!("is {} bytes, more than a key; {MAKE_ONE}", meta.len())));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&mut file).take(MAX_KEY_BYTES + 1).read_to_end(&mut bytes).map_err(|e| refuse(format!("cannot be read ({e})")))?;
    if (bytes.len() as u64) < MIN_KEY_BYTES {
        return Err(refuse(format!(
            "holds {} bytes, fewer than the {MIN_KEY_BYTES} a key needs; {MAKE_ONE}",
            bytes.len()
        )));
    }
    Ok(Some(bytes))
}

/// On the shared root, anyone who can write the root (whom the key is there to exclude) could read
/// or replace it.
fn refuse_on_shared_root(canonical: &Path, root: &Path) -> std::result::Result<(), String> {
    let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    if canonical.starts_with(&root) {
        return Err(format!(
            "is on the shared root {}: everyone who can write the root could read or replace it, which is what the \
             key is there to exclude; keep it on each node's local storage (e.g. /etc/kvtier/shared.key, mode 600)",
            root.display()
        ));
    }
    Ok(())
}

fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}
