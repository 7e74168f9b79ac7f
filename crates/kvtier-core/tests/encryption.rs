//! Encryption at rest of the NVMe tier (`encryption_key_file`, docs/format.md "Encrypted values"),
//! with both I/O engines: no plaintext of a stored block in the device file, every block served
//! byte-identical through loads and reopens, a changed byte, another key or no key a counted miss,
//! a store written in clear still read, a key file others can read refused, and each tenant's blocks
//! sealed under its own key (on NVMe and in the shared tier), a changed tenant a counted miss.

mod common;

use common::*;
use kvtier_core::format::descriptor::{Descriptor, DESCRIPTOR_BYTES, DESCRIPTOR_MAGIC};
use kvtier_core::format::encrypted::{page_tenant, HEADER_AT};
use kvtier_core::{tenant_id, EngineChoice, Store, StoreConfig, TenantId, DEFAULT_TENANT};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

const OBJ: usize = 16 * 1024;
const N: u64 = 60;

fn key_file(dir: &Path, name: &str, fill: u8) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, [fill; 32]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn cfg(dir: &Path, engine: EngineChoice, key: Option<&Path>) -> StoreConfig {
    let mut c = config(dir, engine, OBJ);
    c.dram_bytes = 8 * (OBJ + 4096);
    c.nvme_bytes = 8 << 20;
    c.region_bytes = 1 << 20;
    c.encryption_key_file = key.map(Path::to_path_buf);
    c
}

fn device_bytes(dir: &Path) -> (PathBuf, Vec<u8>) {
    let ns = kvtier_core::Namespace::from_description(b"test-model/bf16/128");
    let path = dir.join(ns.hex()).join("nvme.kvt");
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

/// Offsets of the descriptor pages in the device file, with whether each says its value is encrypted.
fn descriptors(bytes: &[u8]) -> Vec<(usize, bool)> {
    (0..bytes.len() / 4096)
        .map(|page| page * 4096)
        .filter(|&at| bytes[at..at + 8] == DESCRIPTOR_MAGIC && Descriptor::decode(&bytes[at..at + 4096]).is_ok())
        .map(|at| (at, Descriptor::is_encrypted(&bytes[at..at + 4096])))
        .collect()
}

fn stored(dir: &Path, engine: EngineChoice, key: Option<&Path>) {
    let store = Store::open(cfg(dir, engine, key)).unwrap();
    for chunk in (0..N).collect::<Vec<_>>().chunks(10) {
        assert!(put(&store, chunk).iter().all(|&ok| ok));
    }
    store.flush().unwrap();
    let ids: Vec<u64> = (0..N).collect();
    assert!(get_checked(&store, &ids).iter().all(|&hit| hit), "served in the store that wrote them");
    let s = store.stats().counters;
    assert!(s.nvme_hits > 0 && s.nvme_auth_failures == 0, "{s:?}");
    store.close().unwrap();
}

fn reopened_hits(dir: &Path, engine: EngineChoice, key: Option<&Path>) -> (usize, u64) {
    let store = Store::open(cfg(dir, engine, key)).unwrap();
    let ids: Vec<u64> = (0..N).collect();
    let hits = get_checked(&store, &ids).iter().filter(|&&hit| hit).count();
    let failures = store.stats().counters.nvme_auth_failures;
    store.close().unwrap();
    (hits, failures)
}

#[test]
fn no_plaintext_on_disk_and_every_block_comes_back() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let keys = tempfile::tempdir().unwrap();
        let key = key_file(keys.path(), "kvtier.key", 7);
        stored(dir.path(), engine, Some(&key));
        let (_, bytes) = device_bytes(dir.path());
        let pages = descriptors(&bytes);
        assert!(pages.len() >= N as usize && pages.iter().all(|&(_, encrypted)| encrypted), "{pages:?}");
        for i in 0..N {
            // Any 64 bytes of a stored value would be found: none is.
            let plain = value(i, OBJ);
            let probe = &plain[OBJ / 2..OBJ / 2 + 64];
            assert!(!bytes.windows(64).any(|w| w == probe), "block {i}'s plaintext is in the device file");
        }
        assert_eq!(reopened_hits(dir.path(), engine, Some(&key)), (N as usize, 0), "restart: every block");
    }
}

#[test]
fn a_changed_byte_another_key_or_no_key_is_a_counted_miss() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let keys = tempfile::tempdir().unwrap();
        let key = key_file(keys.path(), "kvtier.key", 7);
        let other = key_file(keys.path(), "other.key", 8);
        stored(dir.path(), engine, Some(&key));

        let (path, bytes) = device_bytes(dir.path());
        let (at, _) = descriptors(&bytes)[0];
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[bytes[at + DESCRIPTOR_BYTES + 100] ^ 1], (at + DESCRIPTOR_BYTES + 100) as u64).unwrap();
        // The changed block is a counted miss at its load, or (in a region with no trailer yet) left
        // out at recovery, which checks values as a load does; every other block is served.
        let (hits, failures) = reopened_hits(dir.path(), engine, Some(&key));
        assert!(hits == N as usize - 1 && failures <= 1, "one changed byte: {hits} hits, {failures} refused");

        let (hits, failures) = reopened_hits(dir.path(), engine, Some(&other));
        assert!(hits < N as usize && failures > 0, "another key: {hits} hits, {failures} refused");
        let (hits, failures) = reopened_hits(dir.path(), engine, None);
        assert!(hits < N as usize && failures > 0, "no key: {hits} hits, {failures} refused");
    }
}

#[test]
fn a_store_written_in_clear_is_still_read_and_new_blocks_are_encrypted() {
    let engine = EngineChoice::Psync;
    let dir = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path(), "kvtier.key", 7);
    stored(dir.path(), engine, None);
    let (_, bytes) = device_bytes(dir.path());
    assert!(descriptors(&bytes).iter().all(|&(_, encrypted)| !encrypted));
    assert_eq!(reopened_hits(dir.path(), engine, Some(&key)), (N as usize, 0));

    let store = Store::open(cfg(dir.path(), engine, Some(&key))).unwrap();
    let fresh: Vec<u64> = (1000..1020).collect();
    assert!(put(&store, &fresh).iter().all(|&ok| ok));
    store.flush().unwrap();
    store.close().unwrap();
    let (_, bytes) = device_bytes(dir.path());
    assert!(descriptors(&bytes).iter().any(|&(_, encrypted)| encrypted), "new writes are encrypted");
}

#[test]
fn a_key_file_others_can_read_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path(), "kvtier.key", 7);
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = Store::open(cfg(dir.path(), EngineChoice::Psync, Some(&key))).err().expect("refused");
    let message = err.to_string();
    assert!(message.contains("encryption_key_file") && message.contains("chmod 600"), "{message}");
}

/// (NVMe copies checked, bad ones found) by a whole `kvtier verify` pass.
fn verify_all(store: &Store) -> (u64, u64) {
    let (mut checked, mut bad, mut after) = (0, 0, 0);
    loop {
        let b = store.verify_batch(after, 16, 0).unwrap();
        (checked, bad, after) = (checked + b.checked_nvme, bad + b.bad_nvme, b.next_after);
        if b.done {
            return (checked, bad);
        }
    }
}

#[test]
fn verify_checks_encrypted_copies_with_the_key_and_leaves_them_alone_without() {
    let engine = EngineChoice::Psync;
    let dir = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path(), "kvtier.key", 7);
    stored(dir.path(), engine, Some(&key));
    let store = Store::open(cfg(dir.path(), engine, Some(&key))).unwrap();
    let (checked, bad) = verify_all(&store);
    assert!(checked >= N - 8 && bad == 0, "with the key: {checked} checked, {bad} bad");
    store.close().unwrap();
    // Without the key an encrypted copy cannot be judged: not checked, and never quarantined.
    let store = Store::open(cfg(dir.path(), engine, None)).unwrap();
    assert_eq!(verify_all(&store), (0, 0));
    store.close().unwrap();
    assert_eq!(reopened_hits(dir.path(), engine, Some(&key)), (N as usize, 0), "nothing was dropped");
}

/// A node on `dir/<name>` with no NVMe tier and the shared-filesystem tier on `shared`.
fn shared_node(dir: &Path, name: &str, shared: &Path, key: Option<&Path>, deployment: &Path) -> Store {
    let mut c = cfg(&dir.join(name), EngineChoice::Psync, key);
    c.nvme_bytes = 0;
    let mut tier = kvtier_core::SharedConfig::new(shared.to_path_buf());
    tier.publish_delay_ms = 10;
    tier.key_file = Some(deployment.to_path_buf());
    c.shared = Some(tier);
    Store::open(c).unwrap()
}

/// Every regular file under `dir`, read whole.
fn files_under(dir: &Path) -> Vec<u8> {
    let mut bytes = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            bytes.extend(files_under(&path));
        } else if path.is_file() {
            bytes.extend(std::fs::read(&path).unwrap());
        }
    }
    bytes
}

#[test]
fn the_shared_tier_holds_only_encrypted_values_which_only_the_key_opens() {
    let dir = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    let (key, other) = (key_file(keys.path(), "kvtier.key", 7), key_file(keys.path(), "other.key", 8));
    let deployment = key_file(keys.path(), "deployment.key", 9);
    let ids: Vec<u64> = (0..24).collect();
    let writer = shared_node(dir.path(), "writer", &shared, Some(&key), &deployment);
    assert!(put(&writer, &ids).iter().all(|&ok| ok));
    writer.flush().unwrap();
    writer.close().unwrap();

    let bytes = files_under(&shared);
    assert!(bytes.len() > ids.len() * OBJ, "the blocks were published");
    for &i in &ids {
        let probe = &value(i, OBJ)[OBJ / 2..OBJ / 2 + 64];
        assert!(!bytes.windows(64).any(|w| w == probe), "block {i}'s plaintext is in the shared directory");
    }
    let reader = shared_node(dir.path(), "reader", &shared, Some(&key), &deployment);
    assert!(get_checked(&reader, &ids).iter().all(|&hit| hit), "the key opens every block");
    assert_eq!(reader.stats().counters.remote_decrypt_failures, 0);
    for (name, key) in [("keyless", None), ("stranger", Some(other.as_path()))] {
        let node = shared_node(dir.path(), name, &shared, key, &deployment);
        assert!(!get_checked(&node, &ids).iter().any(|&hit| hit), "{name} was served encrypted blocks");
        let s = node.stats().counters;
        assert_eq!((s.remote_decrypt_failures, s.shared_quarantined_files), (ids.len() as u64, 0), "{name}");
    }
    // Nothing was quarantined by the stores without the key: the reader still gets every block.
    assert!(get_checked(&reader, &ids).iter().all(|&hit| hit));
}

/// The first half of the blocks named for tenant "team-a" before their put, the rest unnamed.
fn stored_for_a_tenant(store: &Store) -> TenantId {
    let team_a = tenant_id(b"team-a");
    let named: Vec<_> = (0..N / 2).map(key).collect();
    store.assign_tenant(&named, &team_a);
    for chunk in (0..N).collect::<Vec<_>>().chunks(10) {
        assert!(put(store, chunk).iter().all(|&ok| ok));
    }
    store.flush().unwrap();
    team_a
}

/// The tenant each stored block's encryption header names, by block id.
fn tenants_on_disk(bytes: &[u8]) -> Vec<(u64, usize, TenantId)> {
    descriptors(bytes)
        .into_iter()
        .filter_map(|(at, encrypted)| {
            assert!(encrypted, "a block in clear at {at}");
            let desc = Descriptor::decode(&bytes[at..at + 4096]).unwrap();
            let id = (0..N).find(|&i| key(i) == desc.key)?;
            Some((id, at, page_tenant(&bytes[at..at + 4096])))
        })
        .collect()
}

#[test]
fn each_tenant_s_blocks_are_sealed_under_its_key_and_a_changed_tenant_is_a_counted_miss() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let keys = tempfile::tempdir().unwrap();
        let key_path = key_file(keys.path(), "kvtier.key", 7);
        let store = Store::open(cfg(dir.path(), engine, Some(&key_path))).unwrap();
        assert!(store.stats().tenant_fields.contains(&("tenant_keys".to_string(), 1)), "stores are to be named");
        let team_a = stored_for_a_tenant(&store);
        store.close().unwrap();

        let (path, bytes) = device_bytes(dir.path());
        let on_disk = tenants_on_disk(&bytes);
        assert!(on_disk.len() >= N as usize, "every block is on NVMe: {}", on_disk.len());
        for &(id, at, tenant) in &on_disk {
            let expected = if id < N / 2 { team_a } else { DEFAULT_TENANT };
            assert_eq!(tenant, expected, "block {id} at {at}");
        }
        assert_eq!(reopened_hits(dir.path(), engine, Some(&key_path)), (N as usize, 0), "each under its key");

        // A block of team-a's relabelled as the default tenant's: neither key nor associated data fit.
        let &(id, at, _) = on_disk.iter().find(|&&(id, _, _)| id < N / 2).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&DEFAULT_TENANT, (at + HEADER_AT + 16) as u64).unwrap();
        let (hits, failures) = reopened_hits(dir.path(), engine, Some(&key_path));
        assert!(hits == N as usize - 1 && failures <= 1, "block {id} relabelled: {hits} hits, {failures} refused");
    }
}

#[test]
fn a_tenant_s_blocks_are_sealed_under_its_key_in_the_shared_tier_too() {
    let dir = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    let key_path = key_file(keys.path(), "kvtier.key", 7);
    let deployment = key_file(keys.path(), "deployment.key", 9);
    let writer = shared_node(dir.path(), "writer", &shared, Some(&key_path), &deployment);
    let team_a = stored_for_a_tenant(&writer);
    writer.close().unwrap();

    let bytes = files_under(&shared);
    let pages: Vec<TenantId> = (0..bytes.len() / 4096)
        .map(|page| &bytes[page * 4096..(page + 1) * 4096])
        .filter(|page| page[..8] == DESCRIPTOR_MAGIC && Descriptor::is_encrypted(page))
        .map(page_tenant)
        .collect();
    assert!(pages.len() >= N as usize, "every block was published: {}", pages.len());
    let named = pages.iter().filter(|&&t| t == team_a).count();
    assert_eq!((named, pages.len() - named), (N as usize / 2, pages.len() - N as usize / 2));
    assert!(pages.iter().all(|&t| t == team_a || t == DEFAULT_TENANT), "only the two tenants");
    let reader = shared_node(dir.path(), "reader", &shared, Some(&key_path), &deployment);
    let ids: Vec<u64> = (0..N).collect();
    assert!(get_checked(&reader, &ids).iter().all(|&hit| hit), "the key file opens both tenants' blocks");
    assert_eq!(reader.stats().counters.remote_decrypt_failures, 0);
}
