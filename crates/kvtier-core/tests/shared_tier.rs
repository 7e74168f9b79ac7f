//! The shared-filesystem tier against real files in temporary directories (and child processes for
//! the concurrency and lease tests).

use kvtier_core::format::shared::Lease;
use kvtier_core::testing::{FaultPlan, HealthPolicy, IoSetup, SharedTier};
use kvtier_core::SharedConfig;
use kvtier_core::Stats;
use kvtier_core::{BlockKey, Namespace};
use kvtier_core::{Error, Store, StoreConfig};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const OBJECT_BYTES: usize = 10_000; // not a multiple of 4096 on purpose
const STRESS: &str = env!("CARGO_BIN_EXE_kvtier-shared-stress");

fn key(i: u64) -> BlockKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.to_le_bytes());
    k[8] = 0xab;
    BlockKey(k)
}

fn value(i: u64) -> Vec<u8> {
    (0..OBJECT_BYTES).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

fn config(root: &Path) -> SharedConfig {
    let mut c = SharedConfig::new(root);
    c.file_target_bytes = 256 << 10;
    c.staleness_ms = 20;
    c.lease_ms = 500;
    c.grace_ms = 100;
    c.publish_delay_ms = 50;
    c.orphan_tmp_ms = 60_000;
    c
}

fn open(c: &SharedConfig, ns: &str) -> (Arc<SharedTier>, Arc<Stats>) {
    let stats = Arc::new(Stats::default());
    let tier = SharedTier::open(
        c,
        Namespace::from_description(ns.as_bytes()),
        OBJECT_BYTES,
        Arc::clone(&stats),
        &IoSetup::default(),
    )
    .unwrap();
    (tier, stats)
}

fn publish(tier: &SharedTier, range: std::ops::Range<u64>) {
    let keys: Vec<_> = range.clone().map(key).collect();
    let values: Vec<_> = range.map(value).collect();
    let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
    assert_eq!(tier.publish_values(&keys, &refs).unwrap(), keys.len());
    tier.flush();
}

fn data_files(ns_dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for d in std::fs::read_dir(ns_dir.join("data")).unwrap().flatten() {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            out.push(f.path());
        }
    }
    out.sort();
    out
}

fn read_ok(tier: &SharedTier, i: u64) -> bool {
    let mut out = vec![0u8; OBJECT_BYTES];
    let ok = tier.read_value(&key(i), &mut out).unwrap();
    if ok {
        assert_eq!(out, value(i), "wrong bytes for block {i}");
    }
    ok
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}

#[test]
fn publish_and_read_roundtrip_across_processes_views() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let (a, a_stats) = open(&c, "model-a");
    publish(&a, 0..40);
    // 40 blocks of 16 KiB slots in files of 256 KiB: a few files, never one per block.
    let files = data_files(a.namespace_dir());
    assert!((2..=4).contains(&files.len()), "{} files", files.len());
    for i in 0..40 {
        assert!(a.contains(&key(i)));
        assert!(read_ok(&a, i));
    }
    assert!(!read_ok(&a, 1000));
    let s = a_stats.snapshot();
    assert_eq!(s.shared_hits, 40);
    assert_eq!(s.shared_misses, 1);
    assert_eq!(s.shared_files_published, files.len() as u64);
    assert!(s.shared_bytes_written >= 40 * 16384);

    // Another writer on the same root (another process, as far as the files can tell) sees the blocks
    // within the staleness bound, and its blocks become visible to the first.
    let (b, _) = open(&c, "model-a");
    assert!((0..40).all(|i| b.contains(&key(i))), "a new tier indexes everything at open");
    assert!(read_ok(&b, 7));
    publish(&b, 100..110);
    let started = Instant::now();
    assert!(wait_until(Duration::from_millis(c.staleness_ms * 5), || a.contains(&key(105))));
    eprintln!("visible to the other writer after {:?} (staleness_ms={})", started.elapsed(), c.staleness_ms);
    assert!(read_ok(&a, 109));
}

/// Two writers publish the same blocks before either has read the other's manifest (two nodes
/// racing); a reader uses the file it listed first. When that file goes (here removed behind its
/// back, as another node's evictor unlinks it), the reader serves the blocks from the other file.
#[test]
fn a_block_two_writers_published_is_served_from_the_other_file_once_the_first_goes() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let mut unaware = config(dir.path());
    // Its index is read at open only, within the test: it never learns of the other's file.
    (unaware.staleness_ms, unaware.lease_ms) = (600_000, 2_000);
    (unaware.grace_ms, unaware.orphan_tmp_ms) = (1_200_000, 1_200_000);
    let (a, _) = open(&c, "raced");
    let (b, _) = open(&unaware, "raced");
    publish(&a, 0..4);
    let (reader, stats) = open(&c, "raced");
    assert!((0..4).all(|i| reader.contains(&key(i))), "a's file, indexed at open");
    publish(&b, 0..4); // not in b's index: published again, in b's file
    reader.maintain();
    let prefix = format!("{:016x}-", a.writer_id());
    let files = data_files(reader.namespace_dir());
    assert_eq!(files.len(), 2, "one file per writer: {files:?}");
    let first = files.iter().find(|f| f.file_name().unwrap().to_str().unwrap().starts_with(&prefix)).unwrap();
    std::fs::remove_file(first).unwrap();
    assert!(!read_ok(&reader, 0), "its file vanished: a clean miss, and the file is forgotten");
    assert!((0..4).all(|i| reader.contains(&key(i))), "the blocks stay indexed: b's file holds them");
    assert!((0..4).all(|i| read_ok(&reader, i)), "served from b's file");
    assert_eq!(stats.snapshot().shared_hits, 4);
}

#[test]
fn restart_rebuilds_index_from_manifests_without_reading_values() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let ns_dir;
    {
        let (a, _) = open(&c, "model-a");
        publish(&a, 0..30);
        ns_dir = a.namespace_dir().to_path_buf();
        a.close();
    }
    // Scramble every value byte range on disk (descriptors, headers, footers intact). If opening
    // read values it could not index these blocks as present; it must, since it reads manifests only.
    let slot = 4096 + 12288;
    for f in data_files(&ns_dir) {
        let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
        let len = file.metadata().unwrap().len();
        let mut off = 4096;
        while off + slot as u64 <= len - 4096 {
            file.write_all_at(&[0x5a; 64], off + 4096 + 100).unwrap();
            off += slot as u64;
        }
    }
    let started = Instant::now();
    let (b, stats) = open(&c, "model-a");
    eprintln!("reopen indexed {} blocks in {:?}", b.indexed_keys(usize::MAX).len(), started.elapsed());
    assert!((0..30).all(|i| b.contains(&key(i))));
    assert_eq!(stats.snapshot().shared_bytes_read, 0);
    // The scrambled values are caught on read: misses, never bytes.
    assert!(!read_ok(&b, 3));
    assert_eq!(stats.snapshot().shared_quarantined_files, 1);
}

#[test]
fn corrupt_value_is_a_miss_and_quarantines_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let (a, stats) = open(&c, "model-a");
    publish(&a, 0..10);
    let files = data_files(a.namespace_dir());
    assert_eq!(files.len(), 1);
    // Flip one byte inside the value of the third entry.
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&files[0]).unwrap();
    let at = 4096 + 2 * (4096 + 12288) + 4096 + 5000;
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, at).unwrap();
    file.write_all_at(&[b[0] ^ 1], at).unwrap();
    let (other, _) = open(&c, "model-a");
    assert!(other.contains(&key(0)));

    assert!(!read_ok(&a, 2));
    let s = stats.snapshot();
    assert_eq!(s.shared_quarantined_files, 1);
    assert_eq!(s.checksum_failures, 1);
    assert_eq!(s.shared_misses, 1);
    // The whole file is out: moved to quarantine/, its other blocks are misses now.
    assert!(!files[0].exists());
    let name = files[0].file_name().unwrap();
    assert!(a.namespace_dir().join("quarantine").join(name).exists());
    assert!(!a.contains(&key(0)));
    assert!(!read_ok(&a, 0));
    // Other processes drop it through the quarantine record.
    assert!(wait_until(Duration::from_millis(500), || !other.contains(&key(0))));
    // Quarantining is counted once, and a second reader racing it gets a clean miss.
    assert!(!read_ok(&other, 5));
    assert_eq!(stats.snapshot().shared_quarantined_files, 1);
}

#[test]
fn foreign_namespace_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let (a, _) = open(&c, "model-a");
    let (b, b_stats) = open(&c, "model-b");
    publish(&a, 0..5);
    b.refresh().unwrap();
    assert!(!b.contains(&key(0)), "namespaces have separate directories");

    // A manifest copied from namespace A into B's directory is ignored whole (its header names A).
    let a_manifest = std::fs::read_dir(a.namespace_dir().join("manifests")).unwrap().next().unwrap().unwrap().path();
    std::fs::copy(&a_manifest, b.namespace_dir().join("manifests").join(a_manifest.file_name().unwrap())).unwrap();
    for f in data_files(a.namespace_dir()) {
        let rel = f.strip_prefix(a.namespace_dir()).unwrap();
        std::fs::create_dir_all(b.namespace_dir().join(rel).parent().unwrap()).unwrap();
        std::fs::copy(&f, b.namespace_dir().join(rel)).unwrap();
    }
    b.refresh().unwrap();
    assert!(!b.contains(&key(0)), "a foreign manifest must not be indexed");

    // B publishes the same keys, then its file's bytes are replaced by A's: every descriptor names
    // namespace A, so B's reads are misses and the file is quarantined.
    publish(&b, 0..5);
    let b_file = data_files(b.namespace_dir())
        .into_iter()
        .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with(&format!("{:016x}", b.writer_id())))
        .unwrap();
    let a_file = data_files(a.namespace_dir()).remove(0);
    std::fs::copy(&a_file, &b_file).unwrap();
    assert!(!read_ok(&b, 0));
    assert_eq!(b_stats.snapshot().shared_quarantined_files, 1);
    assert_eq!(b_stats.snapshot().shared_hits, 0);
}

#[test]
fn watermarks_evict_least_recently_used_files_after_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path());
    c.capacity_bytes = Some(4 << 20); // high 3.6 MiB, low 3.2 MiB
    let (a, stats) = open(&c, "model-a");
    let file_bytes = 256 << 10;
    let mut hot_reads = 0;
    for round in 0..40u64 {
        // Writers may be refused at the hard ceiling while victims wait out their grace period.
        let keys: Vec<_> = (round * 15..round * 15 + 15).map(key).collect();
        let values: Vec<_> = (round * 15..round * 15 + 15).map(value).collect();
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
        a.publish_values(&keys, &refs).unwrap();
        a.flush();
        // Block 0's file is read all the time: it must survive as the least recently used go.
        if read_ok(&a, 0) {
            hot_reads += 1;
        }
        std::thread::sleep(Duration::from_millis(30));
        let usage = a.usage();
        assert!(
            usage.used_bytes <= (0.95 * usage.capacity_bytes as f64) as u64 + file_bytes,
            "round {round}: usage {} of {}",
            usage.used_bytes,
            usage.capacity_bytes
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    let s = stats.snapshot();
    eprintln!("evicted {} files, {} hot reads, usage {:?}", s.shared_evicted_files, hot_reads, a.usage());
    assert!(s.shared_evicted_files > 10, "{s:?}");
    assert_eq!(hot_reads, 40, "the recently read file was evicted");
    assert!(read_ok(&a, 0));
    assert!(!a.contains(&key(20)), "an old, unread file should be gone");
}

/// Forged evictor leases (anyone who can write the root can plant one): of the highest possible
/// generation, and expiring at the end of time. Both are ignored as forged and eviction goes on.
/// Before, the latter held every process off for good (usage grew past the high watermark), and
/// the former left no next generation to take (the increment overflows).
#[test]
fn a_forged_lease_of_the_last_generation_does_not_stop_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path());
    c.capacity_bytes = Some(4 << 20); // high 3.6 MiB, low 3.2 MiB
    let (a, stats) = open(&c, "model-a");
    let lease_dir = a.namespace_dir().join("lease");
    std::fs::create_dir_all(&lease_dir).unwrap();
    for generation in [u64::MAX, 1 << 40] {
        let forged = Lease { generation, holder: 0xdead, expires_unix_ms: u64::MAX, renewed_unix_ms: now_ms() };
        std::fs::write(lease_dir.join(format!("{generation:016x}.lease")), forged.encode()).unwrap();
    }
    for round in 0..30u64 {
        let keys: Vec<_> = (round * 15..round * 15 + 15).map(key).collect();
        let values: Vec<_> = (round * 15..round * 15 + 15).map(value).collect();
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
        // Refused at the hard ceiling while victims wait out their grace period: fine here.
        let _ = a.publish_values(&keys, &refs);
        a.flush();
        std::thread::sleep(Duration::from_millis(30));
        let usage = a.usage();
        assert!(
            usage.used_bytes <= (0.95 * usage.capacity_bytes as f64) as u64 + (256 << 10),
            "round {round}: usage {} of {}: eviction stopped",
            usage.used_bytes,
            usage.capacity_bytes
        );
    }
    assert!(stats.snapshot().shared_evicted_files > 0, "{:?}", stats.snapshot());
    assert!(wait_until(Duration::from_secs(2), || a.is_evictor()), "no process holds a real lease generation");
}

#[test]
fn fail_on_full_refuses_to_publish_instead_of_evicting() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path());
    c.capacity_bytes = Some(2 << 20);
    c.fail_on_full = true;
    let (a, stats) = open(&c, "model-a");
    for round in 0..20u64 {
        let keys: Vec<_> = (round * 15..round * 15 + 15).map(key).collect();
        let values: Vec<_> = (round * 15..round * 15 + 15).map(value).collect();
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
        a.publish_values(&keys, &refs).unwrap();
        a.flush();
        a.maintain();
    }
    let s = stats.snapshot();
    assert!(s.shared_publish_errors > 0, "{s:?}");
    assert_eq!(s.shared_evicted_files, 0);
    assert!(a.usage().used_bytes <= (2 << 20) + (512 << 10), "{:?}", a.usage());
    assert!(read_ok(&a, 0), "nothing was evicted");
}

#[test]
fn startup_errors_name_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let stats = Arc::new(Stats::default());
    let ns = Namespace::from_description(b"x");
    let err = |c: &SharedConfig| {
        SharedTier::open(c, ns, OBJECT_BYTES, Arc::clone(&stats), &IoSetup::default()).err().unwrap().to_string()
    };

    let e = err(&config(&dir.path().join("missing/deeper")));
    assert!(e.contains("does not exist, nor does its parent"), "{e}");
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let e = err(&config(&file));
    assert!(e.contains("is not a directory"), "{e}");
    let mut c = config(dir.path());
    c.low_watermark = 0.95;
    let e = err(&c);
    assert!(e.contains("shared_low_watermark"), "{e}");
    let mut c = config(dir.path());
    c.grace_ms = 10;
    assert!(err(&c).contains("shared_grace_ms"));
    // A missing root whose parent exists is created.
    let c = config(&dir.path().join("new-root"));
    assert!(SharedTier::open(&c, ns, OBJECT_BYTES, Arc::clone(&stats), &IoSetup::default()).is_ok());
    // Full: a capacity with no room for one file and nothing to evict.
    let mut c = config(&dir.path().join("tiny"));
    c.capacity_bytes = Some(64 << 10);
    let e = err(&c);
    assert!(e.contains("less than one file"), "{e}");
}

/// A separately mounted small filesystem (tmpfs; O_DIRECT there depends on the kernel: supported
/// since Linux 6.6): the probe decides, and publish/read work either way. Needs root; skipped otherwise.
#[test]
fn tmpfs_without_o_direct_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16m", "tmpfs"])
        .arg(&mnt)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: cannot mount tmpfs here");
        return;
    }
    let result = std::panic::catch_unwind(|| {
        let c = config(&mnt.join("root"));
        let (a, _) = open(&c, "model-a");
        eprintln!("tmpfs: O_DIRECT {}", if a.direct_io() { "supported" } else { "unsupported, fell back" });
        publish(&a, 0..10);
        assert!((0..10).all(|i| read_ok(&a, i)));
        a.close();
    });
    let _ = Command::new("umount").arg(&mnt).status();
    result.unwrap();
}

fn spawn_stress(root: &Path, extra: &[String]) -> (Child, String) {
    let mut child = Command::new(STRESS)
        .arg(format!("root={}", root.display()))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let stdout = child.stdout.as_mut().unwrap();
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut first).unwrap();
    let id = first.trim().strip_prefix("WRITER ").expect("WRITER line").to_string();
    (child, id)
}

fn lease_holder(ns_dir: &Path) -> Option<(String, u64)> {
    let mut gens: Vec<_> = std::fs::read_dir(ns_dir.join("lease")).ok()?.flatten().map(|e| e.path()).collect();
    gens.sort();
    let bytes = std::fs::read(gens.last()?).ok()?;
    if bytes.len() < 64 {
        return None;
    }
    let holder = u64::from_le_bytes(bytes[24..32].try_into().unwrap());
    let expires = u64::from_le_bytes(bytes[32..40].try_into().unwrap());
    Some((format!("{holder:016x}"), expires))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn allocated(dir: &Path) -> u64 {
    fn walk(d: &Path) -> u64 {
        let Ok(rd) = std::fs::read_dir(d) else { return 0 };
        rd.flatten()
            .map(|e| match e.metadata() {
                Ok(m) if m.is_dir() => walk(&e.path()),
                Ok(m) => m.blocks() * 512,
                Err(_) => 0,
            })
            .sum()
    }
    walk(dir)
}

#[test]
fn lease_moves_to_another_process_when_the_holder_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let ns_dir = dir.path().join(Namespace::from_description(b"stress").hex());
    // Tiny capacity and a long grace: usage stays above the high watermark, so the holder keeps the
    // lease (renewing it) for the whole run.
    let args: Vec<String> = [
        "secs=30",
        "capacity_bytes=2097152",
        "file_bytes=262144",
        "grace_ms=60000",
        "lease_ms=600",
        "publish_every_ms=50",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (mut first, first_id) = spawn_stress(dir.path(), &args);
    // Wait until the first holds the lease with usage above the high watermark (it keeps it from then).
    assert!(wait_until(Duration::from_secs(10), || allocated(&ns_dir) > 2_000_000
        && lease_holder(&ns_dir).is_some_and(|(h, _)| h == first_id)));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(lease_holder(&ns_dir).unwrap().0, first_id);
    let (mut second, second_id) = spawn_stress(dir.path(), &args);
    // While the first lives and renews, the second never takes over.
    std::thread::sleep(Duration::from_millis(1500));
    let (holder, expires) = lease_holder(&ns_dir).unwrap();
    assert_eq!(holder, first_id);
    assert!(expires > now_ms());
    first.kill().unwrap(); // SIGKILL: no release
    first.wait().unwrap();
    let killed = Instant::now();
    assert!(
        wait_until(Duration::from_secs(5), || lease_holder(&ns_dir).is_some_and(|(h, _)| h == second_id)),
        "the lease did not move to the surviving process"
    );
    eprintln!("lease taken over {:?} after SIGKILL (lease_ms=600)", killed.elapsed());
    second.kill().unwrap();
    second.wait().unwrap();
}

#[test]
fn four_processes_share_a_root_with_eviction_running() {
    let dir = tempfile::tempdir().unwrap();
    let ns_dir = dir.path().join(Namespace::from_description(b"stress").hex());
    let capacity: u64 = 24 << 20;
    let file_bytes: u64 = 1 << 20;
    let args: Vec<String> = vec![
        "secs=8".into(),
        format!("capacity_bytes={capacity}"),
        format!("file_bytes={file_bytes}"),
        "grace_ms=200".into(),
        "lease_ms=600".into(),
        "staleness_ms=50".into(),
        "publish_every_ms=5".into(),
    ];
    let mut children: Vec<(Child, String)> = (0..4).map(|_| spawn_stress(dir.path(), &args)).collect();
    let started = Instant::now();
    let mut max_used = 0;
    let mut killed_holder = None;
    while started.elapsed() < Duration::from_secs(8) {
        max_used = max_used.max(allocated(&ns_dir));
        // Halfway, kill whoever holds the lease; one of the others must take over.
        if killed_holder.is_none() && started.elapsed() > Duration::from_secs(3) {
            if let Some((holder, expires)) = lease_holder(&ns_dir) {
                if expires > now_ms() {
                    if let Some(pos) = children.iter().position(|(_, id)| *id == holder) {
                        let (mut c, id) = children.remove(pos);
                        c.kill().unwrap();
                        c.wait().unwrap();
                        killed_holder = Some(id);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut total_hits = 0;
    for (c, _) in children.iter_mut() {
        let out = c.wait_with_output_ref();
        assert!(out.0.success(), "a child read wrong bytes or failed: {}", out.1);
        let line = out.1.lines().find(|l| l.starts_with("STATS")).unwrap().to_string();
        eprintln!("{line}");
        assert!(line.contains(" wrong=0 "));
        total_hits += line.split(" hits=").nth(1).unwrap().split(' ').next().unwrap().parse::<u64>().unwrap();
    }
    // Writers stop at the hard ceiling (0.95); each may finish the file it has open.
    let bound = (0.95 * capacity as f64) as u64 + 5 * file_bytes;
    eprintln!(
        "max usage {} bytes ({:.2} of capacity {}), bound {bound}; killed holder {killed_holder:?}; total hits {total_hits}",
        max_used,
        max_used as f64 / capacity as f64,
        capacity
    );
    assert!(total_hits > 100);
    assert!(max_used <= bound, "usage {max_used} above {bound}");
    let killed = killed_holder.expect("a lease holder was found and killed");
    let (holder, _) = lease_holder(&ns_dir).unwrap();
    assert_ne!(holder, killed, "the lease stayed with the killed process");
}

trait WaitOutput {
    fn wait_with_output_ref(&mut self) -> (std::process::ExitStatus, String);
}

impl WaitOutput for Child {
    fn wait_with_output_ref(&mut self) -> (std::process::ExitStatus, String) {
        let mut s = String::new();
        if let Some(out) = self.stdout.as_mut() {
            use std::io::Read;
            out.read_to_string(&mut s).unwrap();
        }
        (self.wait().unwrap(), s)
    }
}

/// A store ("node") on `local` with 64 DRAM slots, `nvme_bytes` of NVMe (regions of 4 MiB) and the
/// shared tier on `shared_root`.
fn node_config(local: &Path, shared_root: &Path, nvme_bytes: u64) -> StoreConfig {
    let mut c = StoreConfig::new(local, OBJECT_BYTES);
    c.namespace = b"shared-tier-test".to_vec();
    c.nvme_bytes = nvme_bytes;
    c.region_bytes = 4 << 20;
    c.dram_bytes = 64 * 16384;
    let mut s = config(shared_root);
    s.publish_delay_ms = 20;
    c.shared = Some(s);
    c
}

#[test]
fn store_with_shared_tier_and_no_nvme_serves_another_stores_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let shared_root = dir.path().join("shared");
    let make = |local: &str| node_config(&dir.path().join(local), &shared_root, 0);
    let a = Store::open(make("node-a")).unwrap();
    let keys: Vec<_> = (0..20).map(key).collect();
    let values: Vec<_> = (0..20).map(value).collect();
    let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
    assert!(a.put_many(&keys, &refs).unwrap().iter().all(|&ok| ok));
    a.flush().unwrap();
    let b = Store::open(make("node-b")).unwrap();
    assert!(wait_until(Duration::from_secs(2), || b.lookup_prefix(&keys) == 20));
    // Present but only in the shared tier: reported without a pin, so that nobody releases one.
    assert_eq!(b.pin_prefix(&keys[..3]), vec![false; 3]);
    let mut out: Vec<Vec<u8>> = (0..20).map(|_| vec![0u8; OBJECT_BYTES]).collect();
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|v| v.as_mut_slice()).collect();
    assert!(b.get_many(&keys, &mut outs).unwrap().iter().all(|&ok| ok));
    assert_eq!(out, values);
    let s = b.stats().counters;
    assert_eq!(s.shared_hits, 20);
    // Now resident in B's DRAM: a second get is a DRAM hit.
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|v| v.as_mut_slice()).collect();
    assert!(b.get_many(&keys, &mut outs).unwrap().iter().all(|&ok| ok));
    assert_eq!(b.stats().counters.shared_hits, 20);
    // Now pinnable, and one pin each: the shared-only "pin" above took nothing to give back.
    assert_eq!(b.pin_prefix(&keys[..3]), vec![true; 3]);
    b.unpin(&keys[..3]);
    let _ = Error::Closed;
}

#[test]
fn one_load_reads_from_nvme_and_the_shared_tier_together() {
    // Node B has the first half of a prompt on its own NVMe (stored, then restarted: nothing in DRAM)
    // and the second half only in the shared tier (published by node A). One get_many reads both.
    let dir = tempfile::tempdir().unwrap();
    let shared_root = dir.path().join("shared");
    let make = |local: &str| node_config(&dir.path().join(local), &shared_root, 32 << 20);
    let keys: Vec<_> = (0..32).map(key).collect();
    let values: Vec<_> = (0..32).map(value).collect();
    let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
    let a = Store::open(make("node-a")).unwrap();
    a.put_many(&keys[16..], &refs[16..]).unwrap();
    a.close().unwrap();
    let mut b_config = make("node-b");
    b_config.shared = None; // the local half stays local
    let b = Store::open(b_config).unwrap();
    b.put_many(&keys[..16], &refs[..16]).unwrap();
    b.close().unwrap();
    let b = Store::open(make("node-b")).unwrap();
    assert!(wait_until(Duration::from_secs(2), || b.lookup_prefix(&keys) == 32));
    let tiers = b.locate_many(&keys);
    assert!(tiers[..16].iter().all(|t| *t == Some(kvtier_core::Tier::Nvme)), "{tiers:?}");
    assert!(tiers[16..].iter().all(|t| *t == Some(kvtier_core::Tier::Shared)), "{tiers:?}");
    let mut out: Vec<Vec<u8>> = (0..32).map(|_| vec![0u8; OBJECT_BYTES]).collect();
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|v| v.as_mut_slice()).collect();
    assert!(b.get_many(&keys, &mut outs).unwrap().iter().all(|&ok| ok));
    assert!(out == values, "a block read back wrong");
    let s = b.stats().counters;
    assert_eq!((s.nvme_hits, s.shared_hits, s.misses, s.checksum_failures), (16, 16, 0, 0), "{s:?}");
    // Both halves are now resident: the next load is all DRAM hits.
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|v| v.as_mut_slice()).collect();
    assert!(b.get_many(&keys, &mut outs).unwrap().iter().all(|&ok| ok));
    assert_eq!(b.stats().counters.dram_hits, 32);
    b.check_invariants();
}

/// Gets one block from `store`: whether it was found (and right).
fn get_one(store: &Store, i: u64) -> bool {
    let mut out = vec![0u8; OBJECT_BYTES];
    let found = store.get_many(&[key(i)], &mut [out.as_mut_slice()]).unwrap()[0];
    assert!(!found || out == value(i), "block {i} read back wrong");
    found
}

#[test]
fn a_shared_tier_whose_reads_fail_steps_aside_until_a_probe_brings_it_back() {
    // Node B reads node A's blocks from the shared tier through an I/O engine that fails every read
    // with EIO while the fault is on: three failed reads in a row make the tier sick, its blocks are
    // then not offered (counted misses, no read tried) for the back-off; with the fault off and the
    // back-off passed, the store's own probe read brings it back and reads hit again.
    let dir = tempfile::tempdir().unwrap();
    let shared_root = dir.path().join("shared");
    let make = |local: &str| node_config(&dir.path().join(local), &shared_root, 0);
    let keys: Vec<_> = (0..20).map(key).collect();
    let values: Vec<_> = (0..20).map(value).collect();
    let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
    let a = Store::open(make("node-a")).unwrap();
    assert!(a.put_many(&keys, &refs).unwrap().iter().all(|&ok| ok));
    a.close().unwrap();
    let plan = Arc::new(FaultPlan { read_eio_every: 1, ..FaultPlan::default() });
    plan.paused.store(true, std::sync::atomic::Ordering::Relaxed);
    let backoff = Duration::from_millis(300);
    let mut c = make("node-b");
    c.fault_plan = Some(Arc::clone(&plan));
    c.tier_health = HealthPolicy { sick_after: 3, first_backoff: backoff, max_backoff: 4 * backoff };
    let b = Store::open(c).unwrap();
    assert!(wait_until(Duration::from_secs(2), || b.lookup_prefix(&keys) == 20));
    plan.paused.store(false, std::sync::atomic::Ordering::Relaxed);
    for i in 0..3 {
        assert!(!get_one(&b, i), "block {i}: its read fails");
    }
    let s = b.stats().counters;
    assert_eq!((s.remote_tier_outages, s.remote_tiers_sick, s.shared_hits), (1, 1, 0), "{s:?}");
    assert!(s.io_errors >= 3, "{s:?}");
    // Sick: not offered, and a load tries no read.
    assert_eq!(b.lookup_prefix(&keys[3..]), 0);
    let reads_before = plan.reads_seen.load(std::sync::atomic::Ordering::Relaxed);
    assert!(!get_one(&b, 3));
    assert_eq!(plan.reads_seen.load(std::sync::atomic::Ordering::Relaxed), reads_before, "no read on a sick tier");
    let s = b.stats().counters;
    assert!(s.remote_tier_lookups_skipped >= 2, "{s:?}");
    // Still failing when the back-off ends: the store's prober reads one block in the background,
    // which fails, and the back-off doubles. No request is offered the tier meanwhile: none waits on
    // a probe of a tier still down.
    let reads = || plan.reads_seen.load(std::sync::atomic::Ordering::Relaxed);
    let before_probe = reads();
    assert!(wait_until(8 * backoff, || reads() > before_probe), "the prober never probed the sick tier");
    for _ in 0..5 {
        assert_eq!(b.lookup_prefix(&keys[3..]), 0, "a sick tier is never offered to a request");
        assert!(!get_one(&b, 3));
        std::thread::sleep(backoff / 5);
    }
    let s = b.stats().counters;
    assert_eq!((s.remote_tier_outages, s.remote_tiers_sick, s.shared_hits), (1, 1, 0), "{s:?}");
    // The fault cleared: a later probe hits and brings the tier back, with nobody asking.
    plan.paused.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(wait_until(16 * backoff, || b.lookup_prefix(&keys) == 20), "the tier never came back");
    let s = b.stats().counters;
    assert_eq!((s.remote_tier_outages, s.remote_tiers_sick, s.shared_hits), (1, 0, 1), "{s:?}");
    let mut out: Vec<Vec<u8>> = (0..20).map(|_| vec![0u8; OBJECT_BYTES]).collect();
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|v| v.as_mut_slice()).collect();
    assert!(b.get_many(&keys, &mut outs).unwrap().iter().all(|&ok| ok));
    assert_eq!(out, values);
    assert_eq!(b.stats().counters.shared_hits, 20, "the probed block from DRAM, the others from the shared tier");
    b.check_invariants();
}

#[test]
fn publishing_resumes_after_the_shared_directory_is_removed_and_close_releases_files() {
    let dir = tempfile::tempdir().unwrap();
    let shared_root = dir.path().join("shared");
    let make = |local: &str| {
        let mut c = StoreConfig::new(dir.path().join(local), OBJECT_BYTES);
        c.namespace = b"shared-tier-removal".to_vec();
        c.nvme_bytes = 0;
        c.dram_bytes = 64 * 16384;
        c.shared = Some(config(&shared_root));
        c
    };
    let a = Store::open(make("node-a")).unwrap();
    let put = |store: &Store, ids: std::ops::Range<u64>| {
        let keys: Vec<_> = ids.clone().map(key).collect();
        let values: Vec<_> = ids.map(value).collect();
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
        store.put_many(&keys, &refs).unwrap();
        store.flush().unwrap();
        keys
    };
    put(&a, 0..8);
    // The store's maintenance thread may recreate the directory while it is being removed (what the
    // test is about): `rm -rf` then finds it not empty, and is run again, as a person would.
    let removed = (0..50).any(|_| {
        std::fs::remove_dir_all(&shared_root).is_ok() || {
            std::thread::sleep(Duration::from_millis(10));
            false
        }
    });
    assert!(removed, "the shared directory could not be removed");
    std::fs::create_dir_all(&shared_root).unwrap();
    std::thread::sleep(Duration::from_millis(200)); // several maintenance passes
    let later = put(&a, 100..108);
    let b = Store::open(make("node-b")).unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || b.lookup_prefix(&later) == later.len()),
        "blocks published after the directory was removed never became visible"
    );
    a.close().unwrap();
    b.close().unwrap();
    // After close no descriptor of this process points into the shared root.
    let open_under_root = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|target| target.starts_with(&shared_root))
        .count();
    assert_eq!(open_under_root, 0, "closed stores still hold files under the shared root");
}

/// A DRAM-only store on `local` that publishes to `shared` through a queue of `queue_blocks` blocks.
fn publishing_store(local: &Path, shared: &Path, dram_blocks: usize, queue_blocks: usize) -> StoreConfig {
    let mut c = StoreConfig::new(local, OBJECT_BYTES);
    c.namespace = b"shared-tier-test".to_vec();
    c.nvme_bytes = 0;
    c.dram_bytes = dram_blocks * (OBJECT_BYTES + 4096);
    let mut s = config(shared);
    s.publish_queue_bytes = queue_blocks * (OBJECT_BYTES + 4096);
    c.shared = Some(s);
    c
}

/// Stores blocks 0..n in one burst; every put must succeed without waiting for the publisher.
fn put_burst(store: &Store, n: u64) -> Vec<BlockKey> {
    let keys: Vec<_> = (0..n).map(key).collect();
    let values: Vec<_> = (0..n).map(value).collect();
    let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
    assert!(store.put_many(&keys, &refs).unwrap().iter().all(|&ok| ok), "DRAM stores never fail for the shared tier");
    keys
}

/// The blocks another node finds in the shared tier, each read back and compared byte for byte.
fn published_elsewhere(dir: &Path, shared: &Path, keys: &[BlockKey]) -> usize {
    let reader = Store::open(publishing_store(&dir.join("reader"), shared, keys.len() + 8, 2)).unwrap();
    let mut found = 0;
    for (i, k) in keys.iter().enumerate() {
        let mut out = vec![0u8; OBJECT_BYTES];
        if reader.get_many(std::slice::from_ref(k), &mut [out.as_mut_slice()]).unwrap()[0] {
            assert_eq!(out, value(i as u64), "block {i} read back wrong");
            found += 1;
        }
    }
    assert_eq!(reader.stats().counters.checksum_failures, 0);
    reader.close().unwrap();
    found
}

#[test]
fn a_burst_larger_than_the_publish_queue_is_published_whole_from_the_backlog() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    // Two blocks of queue: a burst of puts outruns any publisher, and DRAM holds the whole burst.
    let store = Store::open(publishing_store(&dir.path().join("local"), &shared, 256, 2)).unwrap();
    let keys = put_burst(&store, 200);
    let deferred = store.stats().counters.shared_deferred_publishes;
    assert!(deferred > 0, "a put must not wait for room in the publish queue");
    store.flush().unwrap();
    let counters = store.stats().counters;
    assert_eq!((counters.shared_dropped_publishes, counters.shared_publish_errors), (0, 0), "{counters:?}");
    store.close().unwrap();
    assert_eq!(published_elsewhere(dir.path(), &shared, &keys), keys.len(), "every block of the burst is published");
}

#[test]
fn a_backlogged_block_that_left_dram_first_is_dropped_and_counted_never_published_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    let mut c = publishing_store(&dir.path().join("local"), &shared, 16, 2);
    // A slow shared filesystem: every write waits 20 ms, so the burst leaves DRAM long before the
    // publisher gets to most of it.
    c.fault_plan = Some(Arc::new(FaultPlan { delay_ms: 20, ..FaultPlan::default() }));
    let store = Store::open(c).unwrap();
    let keys = put_burst(&store, 200);
    store.flush().unwrap();
    let counters = store.stats().counters;
    assert!(counters.shared_deferred_publishes > 0, "{counters:?}");
    assert!(counters.shared_dropped_publishes > 0, "16 DRAM slots cannot hold a 200-block backlog: {counters:?}");
    assert_eq!(counters.shared_publish_errors, 0);
    store.close().unwrap();
    let published = published_elsewhere(dir.path(), &shared, &keys);
    assert_eq!(published as u64 + counters.shared_dropped_publishes, 200, "every block is published or counted");
}

#[test]
fn flushes_return_while_another_thread_keeps_storing_past_the_publish_queue() {
    // A flush waits for what was backlogged before it, never for blocks queued behind it: with a
    // writer that keeps overflowing a 2-block queue, every flush still returns.
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    let mut c = publishing_store(&dir.path().join("local"), &shared, 512, 2);
    c.fault_plan = Some(Arc::new(FaultPlan { delay_ms: 1, ..FaultPlan::default() }));
    let store = Arc::new(Store::open(c).unwrap());
    let writer = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || {
            for burst in 0..8u64 {
                let ids = burst * 50..(burst + 1) * 50;
                let keys: Vec<_> = ids.clone().map(key).collect();
                let values: Vec<_> = ids.map(value).collect();
                let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
                assert!(store.put_many(&keys, &refs).unwrap().iter().all(|&ok| ok));
            }
        })
    };
    for _ in 0..6 {
        store.flush().unwrap();
    }
    writer.join().unwrap();
    store.flush().unwrap();
    let counters = store.stats().counters;
    assert!(counters.shared_deferred_publishes > 0, "{counters:?}");
    assert_eq!((counters.shared_dropped_publishes, counters.shared_publish_errors), (0, 0), "{counters:?}");
    Arc::try_unwrap(store).ok().expect("the writer is done").close().unwrap();
    let keys: Vec<_> = (0..400).map(key).collect();
    assert_eq!(published_elsewhere(dir.path(), &shared, &keys), 400);
}

// ---- deployment key (`shared_key_file`): authenticated blocks and manifest records ----

/// Writes a key file of `len` random-ish bytes with `mode` and returns its path.
fn key_file(dir: &Path, name: &str, len: usize, mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(37) ^ name.len() as u8 ^ name.as_bytes()[0]).collect();
    std::fs::write(&path, bytes).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

fn keyed(root: &Path, key: &Path) -> SharedConfig {
    let mut c = config(root);
    c.key_file = Some(key.to_path_buf());
    c
}

fn quarantined(ns_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(ns_dir.join("quarantine"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn files_of(ns_dir: &Path, tier: &SharedTier) -> Vec<PathBuf> {
    let prefix = format!("{:016x}-", tier.writer_id());
    data_files(ns_dir).into_iter().filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(&prefix)).collect()
}

#[test]
fn keyed_tier_never_serves_files_written_without_the_key_or_with_another() {
    let root = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let right = key_file(keys.path(), "right.key", 32, 0o600);
    let wrong = key_file(keys.path(), "wrong.key", 64, 0o600);

    // Planted before the keyed store opens: a writer with another key and a keyless writer (same
    // layout, valid checksums, no tags), both publishing blocks the keyed store will be asked for. (The
    // other key's writer is closed first: it would quarantine everybody else's files just the same.)
    let (other_key, _) = open(&keyed(root.path(), &wrong), "model-a");
    assert!(other_key.authenticated());
    publish(&other_key, 10..20);
    let ns_dir = other_key.namespace_dir().to_path_buf();
    let mut planted = files_of(&ns_dir, &other_key);
    other_key.close();
    let (plain, _) = open(&config(root.path()), "model-a");
    publish(&plain, 0..10);
    planted.extend(files_of(&ns_dir, &plain));
    let planted: Vec<String> = planted.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(planted.len(), 2);

    let (a, stats) = open(&keyed(root.path(), &right), "model-a");
    // Nothing they published is indexed, read or served; their records are counted and their files
    // quarantined, all at open.
    for i in 0..20 {
        assert!(!a.contains(&key(i)), "block {i} of an unauthenticated writer is indexed");
        assert!(!read_ok(&a, i), "block {i} of an unauthenticated writer was served");
    }
    let s = stats.snapshot();
    assert!(s.shared_auth_failures >= 4, "header and publish record of each: {s:?}");
    assert_eq!(s.shared_hits, 0);
    assert_eq!(s.shared_misses, 20);
    assert_eq!(s.shared_quarantined_files, 2);
    let mut expected = planted.clone();
    expected.sort();
    assert_eq!(quarantined(&ns_dir), expected);
    assert!(data_files(&ns_dir).is_empty());

    // The right key reads its own blocks, here and in another process with the same key file.
    publish(&a, 20..30);
    assert!((20..30).all(|i| read_ok(&a, i)));
    let (b, b_stats) = open(&keyed(root.path(), &right), "model-a");
    assert!((20..30).all(|i| read_ok(&b, i)));
    assert_eq!(b_stats.snapshot().shared_hits, 10);

    b.close();

    // Published after the keyed store opened: caught by the tailing as well, never indexed.
    let failures = stats.snapshot().shared_auth_failures;
    publish(&plain, 40..45);
    a.maintain();
    assert!((40..45).all(|i| !a.contains(&key(i)) && !read_ok(&a, i)));
    assert!(stats.snapshot().shared_auth_failures > failures);
    assert_eq!(stats.snapshot().shared_quarantined_files, 3);
    assert_eq!(quarantined(&ns_dir).len(), 3);
    assert_eq!(stats.snapshot().shared_hits, 10);
}

#[test]
fn forged_file_under_an_authenticated_name_is_quarantined_on_read() {
    // The manifest record is authentic, the data file's bytes are not: a keyless writer's file with
    // the same keys, values and layout (so every descriptor and xxh3 checksum is valid) is copied over
    // the keyed writer's file.
    let root = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let right = key_file(keys.path(), "right.key", 32, 0o600);
    let (a, stats) = open(&keyed(root.path(), &right), "model-a");
    publish(&a, 0..10);
    let (plain, _) = open(&config(elsewhere.path()), "model-a");
    publish(&plain, 0..10);
    let target = files_of(a.namespace_dir(), &a).remove(0);
    let forged = files_of(plain.namespace_dir(), &plain).remove(0);
    assert_eq!(std::fs::metadata(&target).unwrap().len(), std::fs::metadata(&forged).unwrap().len());
    std::fs::write(&target, std::fs::read(&forged).unwrap()).unwrap();

    let (reader, reader_stats) = open(&keyed(root.path(), &right), "model-a");
    assert!(reader.contains(&key(3)), "its manifest record is authentic");
    assert!(!read_ok(&reader, 3));
    let s = reader_stats.snapshot();
    assert_eq!((s.shared_auth_failures, s.shared_quarantined_files, s.shared_hits), (1, 1, 0));
    assert_eq!(s.checksum_failures, 0, "every checksum in the forged file is valid");
    assert!(!target.exists());
    assert!(reader.namespace_dir().join("quarantine").join(target.file_name().unwrap()).exists());
    // The writer drops the file too (through the quarantine record) and never serves it.
    assert!(wait_until(Duration::from_millis(500), || {
        a.maintain();
        !a.contains(&key(0))
    }));
    assert!(!read_ok(&a, 0));
    assert_eq!(stats.snapshot().shared_hits, 0);
}

#[test]
fn keyless_tiers_read_keyed_files_unchanged() {
    let root = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let right = key_file(keys.path(), "right.key", 40, 0o400);
    let (a, _) = open(&keyed(root.path(), &right), "model-a");
    publish(&a, 0..5);
    let (plain, stats) = open(&config(root.path()), "model-a");
    assert!(!plain.authenticated());
    assert!((0..5).all(|i| read_ok(&plain, i)));
    assert_eq!(stats.snapshot().shared_auth_failures, 0);
}

#[test]
fn key_file_on_the_shared_root_readable_by_others_or_short_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let stats = Arc::new(Stats::default());
    let ns = Namespace::from_description(b"model-a");
    let err = |key: &Path| {
        let e =
            SharedTier::open(&keyed(root.path(), key), ns, OBJECT_BYTES, Arc::clone(&stats), &IoSetup::default()).err();
        e.expect("refused").to_string()
    };
    let on_root = key_file(root.path(), "shared.key", 32, 0o600);
    let e = err(&on_root);
    assert!(e.contains("shared_key_file") && e.contains("is on the shared root") && e.contains("local storage"), "{e}");
    // Also through a symlink from local storage, and deeper in the root.
    std::fs::create_dir(root.path().join("sub")).unwrap();
    let deeper = key_file(&root.path().join("sub"), "k", 32, 0o600);
    std::os::unix::fs::symlink(&deeper, keys.path().join("link.key")).unwrap();
    let e = err(&keys.path().join("link.key"));
    assert!(e.contains("is on the shared root"), "{e}");

    let world = key_file(keys.path(), "world.key", 32, 0o644);
    let e = err(&world);
    assert!(e.contains("shared_key_file") && e.contains("mode 644") && e.contains("chmod 600"), "{e}");
    let group = key_file(keys.path(), "group.key", 32, 0o640);
    assert!(err(&group).contains("chmod 600"));
    let short = key_file(keys.path(), "short.key", 31, 0o600);
    let e = err(&short);
    assert!(e.contains("holds 31 bytes") && e.contains("/dev/urandom"), "{e}");
    let e = err(&keys.path().join("missing.key"));
    assert!(e.contains("does not exist") && e.contains("/dev/urandom"), "{e}");
    let e = err(keys.path());
    assert!(e.contains("not a regular file"), "{e}");
    // Nothing was created for a refused key: no manifest is written unauthenticated.
    assert!(!root.path().join(ns.hex()).join("manifests").exists());

    // And a good one through a symlink (as a Kubernetes secret volume mounts it) is accepted.
    let good = key_file(keys.path(), "good.key", 32, 0o600);
    std::os::unix::fs::symlink(&good, keys.path().join("good-link.key")).unwrap();
    assert!(SharedTier::open(
        &keyed(root.path(), &keys.path().join("good-link.key")),
        ns,
        OBJECT_BYTES,
        stats,
        &IoSetup::default()
    )
    .is_ok());
}

/// The cost of the tags, printed (figures go to docs/shared-tier.md, not into assertions):
/// `cargo test --release -p kvtier-core --test shared_tier -- --ignored --nocapture measure_tag_cost`.
/// Keyed BLAKE3 against the xxh3-64 checksum over 64 MiB (one thread), then publishing and reading
/// 64 MiB of 2 MiB blocks through the tier (page cache warm) without and with a key.
#[test]
#[ignore]
fn measure_tag_cost() {
    const TOTAL: usize = 64 << 20;
    let buf: Vec<u8> = (0..TOTAL).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let best = |f: &mut dyn FnMut()| {
        (0..7)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    };
    let gbs = |secs: f64| TOTAL as f64 / secs / 1e9;
    let mut sink = 0u64;
    let xxh = best(&mut || sink ^= kvtier_core::format::checksum(std::hint::black_box(&buf)));
    let mac_key = blake3::derive_key("kvtier shared tier v1", &[7u8; 32]);
    let b3 = best(&mut || {
        let mut h = blake3::Hasher::new_keyed(&mac_key);
        h.update(std::hint::black_box(&buf));
        sink ^= h.finalize().as_bytes()[0] as u64;
    });
    println!("64 MiB, one thread: xxh3-64 {:.1} GB/s, keyed BLAKE3 {:.1} GB/s ({sink})", gbs(xxh), gbs(b3));

    const OBJECT: usize = 2 << 20;
    let keys_dir = tempfile::tempdir().unwrap();
    let k = key_file(keys_dir.path(), "bench.key", 32, 0o600);
    for with_key in [false, true] {
        let root = tempfile::tempdir().unwrap();
        let mut c = config(root.path());
        c.file_target_bytes = 64 << 20;
        c.key_file = with_key.then(|| k.clone());
        let stats = Arc::new(Stats::default());
        let tier =
            SharedTier::open(&c, Namespace::from_description(b"bench"), OBJECT, stats, &IoSetup::default()).unwrap();
        let n = TOTAL / OBJECT;
        let keys: Vec<_> = (0..n as u64).map(key).collect();
        let values: Vec<&[u8]> = (0..n).map(|i| &buf[i * OBJECT..(i + 1) * OBJECT]).collect();
        let t = Instant::now();
        assert_eq!(tier.publish_values(&keys, &values).unwrap(), n);
        tier.flush();
        let publish = t.elapsed().as_secs_f64();
        let mut slot = kvtier_core::testing::AlignedBuf::zeroed(tier.slot_bytes());
        let read = best(&mut || {
            for k in &keys {
                assert!(tier.read_into(k, slot.as_mut_slice()).unwrap());
            }
        });
        println!(
            "tier, {} MiB of 2 MiB blocks, {}: publish {:.2} GB/s (incl. fdatasync), read+verify {:.2} GB/s",
            TOTAL >> 20,
            if with_key { "with key" } else { "no key" },
            gbs(publish),
            gbs(read)
        );
    }
}

/// The shared tier's data I/O runs through the device queue, so the fault plan reaches it: faults on
/// the reading node and on the writing node are counted misses, never wrong bytes, and short
/// transfers are completed.
#[test]
fn injected_faults_on_shared_reads_and_writes_are_misses_never_wrong_bytes() {
    let n = 96;
    let faulty = |plan: FaultPlan| {
        let plan = Arc::new(plan);
        (IoSetup { fault_plan: Some(Arc::clone(&plan)), ..IoSetup::default() }, plan)
    };
    let open_with = |c: &SharedConfig, io: &IoSetup| {
        let stats = Arc::new(Stats::default());
        let ns = Namespace::from_description(b"faults");
        (SharedTier::open(c, ns, OBJECT_BYTES, Arc::clone(&stats), io).unwrap(), stats)
    };

    // Read side: a clean writer, a reader whose reads fail, flip bits or come back short.
    let root = tempfile::tempdir().unwrap();
    let c = config(root.path());
    let (writer, _) = open_with(&c, &IoSetup::default());
    publish(&writer, 0..n);
    let (io, plan) =
        faulty(FaultPlan { read_eio_every: 7, read_bitflip_every: 11, short_every: 3, ..FaultPlan::default() });
    let (reader, stats) = open_with(&c, &io);
    assert!(wait_until(Duration::from_secs(5), || (0..n).all(|i| reader.contains(&key(i)))));
    let hits = (0..n).filter(|&i| read_ok(&reader, i)).count();
    let s = stats.snapshot();
    assert!(plan.injected.load(std::sync::atomic::Ordering::Relaxed) > 0, "no fault reached the shared reads");
    assert!(s.io_errors > 0 && s.checksum_failures > 0, "faults not counted: {s:?}");
    assert!(hits > 0 && hits < n as usize, "{hits} hits of {n}");
    assert_eq!(s.shared_hits as usize, hits);

    // Write side: torn and short writes on the writer; a clean reader serves only whole blocks.
    let root = tempfile::tempdir().unwrap();
    let c = config(root.path());
    let (io, plan) = faulty(FaultPlan { torn_write_every: 5, short_every: 3, ..FaultPlan::default() });
    let (writer, _) = open_with(&c, &io);
    publish(&writer, 0..n);
    let (reader, stats) = open_with(&c, &IoSetup::default());
    assert!(wait_until(Duration::from_secs(5), || (0..n).all(|i| reader.contains(&key(i)))));
    let hits = (0..n).filter(|&i| read_ok(&reader, i)).count();
    assert!(plan.injected.load(std::sync::atomic::Ordering::Relaxed) > 0, "no fault reached the shared writes");
    assert!(stats.snapshot().checksum_failures > 0, "torn writes were not caught");
    assert!(hits < n as usize, "every block was served although some were torn");
}

// ---- a FIFO or a symlink where a data file, manifest or lease should be (issue 24, item 2) ----
//
// Anyone who can write the shared root can plant these, with no key. A FIFO's plain open blocks until a
// writer comes: before the fix a load touching it, or the maintenance pass reading it, never returned.
// Each test therefore runs under `within`, so that a regression fails instead of hanging the run.

/// Runs `f` on a thread and fails the test if it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(limit) {
        Ok(()) => handle.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{what}: no result after {limit:?} (hang)"),
    }
}

fn mkfifo(path: &Path) {
    try_mkfifo(path).unwrap();
}

fn try_mkfifo(path: &Path) -> std::io::Result<()> {
    let mode = rustix::fs::Mode::from_raw_mode(0o600);
    rustix::fs::mknodat(rustix::fs::CWD, path, rustix::fs::FileType::Fifo, mode, 0).map_err(std::io::Error::from)
}

/// What takes a published data file's place.
#[derive(Debug, Clone, Copy)]
enum Planted {
    Fifo,
    SymlinkToFifo,
    /// A symlink to the file's own bytes, moved aside: valid blocks, still never read through a link.
    SymlinkToTheFile,
}

fn plant(path: &Path, planted: Planted) {
    let aside = path.with_extension("aside");
    std::fs::rename(path, &aside).unwrap();
    match planted {
        Planted::Fifo => mkfifo(path),
        Planted::SymlinkToFifo => {
            let fifo = path.with_extension("fifo");
            mkfifo(&fifo);
            std::os::unix::fs::symlink(&fifo, path).unwrap();
        }
        Planted::SymlinkToTheFile => std::os::unix::fs::symlink(&aside, path).unwrap(),
    }
}

#[test]
fn a_data_file_replaced_by_a_fifo_or_a_symlink_is_a_counted_miss_within_bounded_time() {
    for planted in [Planted::Fifo, Planted::SymlinkToFifo, Planted::SymlinkToTheFile] {
        within(Duration::from_secs(60), &format!("{planted:?}"), move || {
            let dir = tempfile::tempdir().unwrap();
            let c = config(dir.path());
            let (a, stats) = open(&c, "model-a");
            publish(&a, 0..10);
            let files = data_files(a.namespace_dir());
            assert_eq!(files.len(), 1);
            plant(&files[0], planted);
            let (other, _) = open(&c, "model-a");
            assert!(other.contains(&key(0)));

            let reader = Arc::clone(&a);
            let hit =
                within(Duration::from_secs(5), &format!("a load from a {planted:?}"), move || read_ok(&reader, 3));
            assert!(!hit, "{planted:?}: served through something that is not a regular file");
            let s = stats.snapshot();
            let counted = (s.shared_misses, s.shared_not_regular_files, s.shared_quarantined_files, s.shared_hits);
            assert_eq!(counted, (1, 1, 1, 0), "{planted:?}: {s:?}");
            // Quarantined like a file that fails verification: moved out of data/, dropped from every
            // index (the other process through the quarantine record), its other blocks clean misses.
            let name = files[0].file_name().unwrap();
            assert!(std::fs::symlink_metadata(&files[0]).is_err());
            assert!(std::fs::symlink_metadata(a.namespace_dir().join("quarantine").join(name)).is_ok());
            assert!(!a.contains(&key(0)) && !read_ok(&a, 0));
            assert!(wait_until(Duration::from_secs(2), || !other.contains(&key(0))));
            // The tier keeps publishing and serving.
            publish(&a, 100..110);
            assert!((100..110).all(|i| read_ok(&a, i)));
            assert_eq!(stats.snapshot().shared_not_regular_files, 1, "counted once: the file is gone from the index");
        });
    }
}

/// The same through a store's load (the mover's shared reads, as a service connection thread runs it).
#[test]
fn a_store_load_touching_a_fifo_data_file_is_a_counted_miss() {
    within(Duration::from_secs(60), "store load", || {
        let dir = tempfile::tempdir().unwrap();
        let shared_root = dir.path().join("shared");
        let make = |local: &str| node_config(&dir.path().join(local), &shared_root, 0);
        let a = Store::open(make("node-a")).unwrap();
        let keys: Vec<_> = (0..10).map(key).collect();
        let values: Vec<_> = (0..10).map(value).collect();
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
        assert!(a.put_many(&keys, &refs).unwrap().iter().all(|&ok| ok));
        a.flush().unwrap();
        let ns_dir = std::fs::read_dir(&shared_root).unwrap().flatten().next().unwrap().path();
        let b = Arc::new(Store::open(make("node-b")).unwrap());
        assert!(wait_until(Duration::from_secs(2), || b.lookup_prefix(&keys) == 10));
        for f in data_files(&ns_dir) {
            plant(&f, Planted::Fifo);
        }
        let loader = Arc::clone(&b);
        let hits = within(Duration::from_secs(5), "a store load from a FIFO", move || {
            let mut out: Vec<Vec<u8>> = (0..10).map(|_| vec![0u8; OBJECT_BYTES]).collect();
            let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|v| v.as_mut_slice()).collect();
            loader.get_many(&keys, &mut outs).unwrap()
        });
        assert_eq!(hits, vec![false; 10]);
        let s = b.stats().counters;
        assert_eq!((s.shared_hits, s.shared_not_regular_files, s.shared_quarantined_files), (0, 1, 1), "{s:?}");
        assert_eq!(s.shared_misses, 10, "every block of the file is a counted miss: {s:?}");
    });
}

#[test]
fn fifo_and_symlinked_manifests_are_skipped_and_the_index_keeps_refreshing() {
    within(Duration::from_secs(60), "manifests", || {
        let dir = tempfile::tempdir().unwrap();
        let c = config(dir.path());
        let (a, a_stats) = open(&c, "model-a");
        let (b, _) = open(&c, "model-a");
        publish(&b, 0..5);
        assert!(wait_until(Duration::from_secs(2), || a.contains(&key(0))));
        let manifests = a.namespace_dir().join("manifests");
        mkfifo(&manifests.join("00000000000000f1.log"));
        let b_manifest = manifests.join(format!("{:016x}.log", b.writer_id()));
        std::os::unix::fs::symlink(&b_manifest, manifests.join("00000000000000f2.log")).unwrap();
        let outside = dir.path().join("outside.fifo");
        mkfifo(&outside);
        std::os::unix::fs::symlink(&outside, manifests.join("00000000000000f3.log")).unwrap();

        let refresher = Arc::clone(&a);
        within(Duration::from_secs(5), "a refresh with a FIFO manifest", move || refresher.refresh().unwrap());
        assert!(a_stats.snapshot().shared_not_regular_files >= 3, "{:?}", a_stats.snapshot());
        // The maintenance thread keeps tailing the real manifests: B's new blocks reach A.
        publish(&b, 100..105);
        assert!(wait_until(Duration::from_secs(5), || a.contains(&key(104))), "the index stopped refreshing");
        assert!(read_ok(&a, 104));
        // A process opening the tier (which replays every manifest) opens in bounded time.
        let c2 = c.clone();
        let (late, _) = within(Duration::from_secs(5), "an open with a FIFO manifest", move || open(&c2, "model-a"));
        assert!(late.contains(&key(104)) && late.contains(&key(0)));
    });
}

/// Publishes round `round`'s 15 blocks; writers may be refused at the hard ceiling while victims wait
/// out their grace period.
fn publish_round(tier: &SharedTier, round: u64) {
    let keys: Vec<_> = (round * 15..round * 15 + 15).map(key).collect();
    let values: Vec<_> = (round * 15..round * 15 + 15).map(value).collect();
    let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
    tier.publish_values(&keys, &refs).unwrap();
    tier.flush();
}

#[test]
fn a_fifo_lease_neither_stops_lease_renewal_nor_eviction() {
    within(Duration::from_secs(60), "lease", || {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path());
        c.capacity_bytes = Some(4 << 20); // above the high watermark after a few files: eviction runs
        let (a, stats) = open(&c, "model-a");
        let mut round = 0;
        while !(a.is_evictor() && stats.snapshot().shared_evicted_files > 0) {
            assert!(round < 100, "eviction never started: {:?}", stats.snapshot());
            publish_round(&a, round);
            std::thread::sleep(Duration::from_millis(30));
            round += 1;
        }
        let lease_dir = a.namespace_dir().join("lease");
        let fifo = lease_dir.join(format!("{:016x}.lease", 1000));
        mkfifo(&fifo);
        let evicted = stats.snapshot().shared_evicted_files;

        // Passes (the maintenance thread's and these) meet the FIFO as the highest generation: it holds
        // nobody off, and the lease is taken one generation above it, which removes it. Publishing keeps
        // usage above the high watermark, so that every pass wants the lease.
        let (tier, planted) = (Arc::clone(&a), fifo.clone());
        let round = within(Duration::from_secs(10), "maintenance passes with a FIFO lease", move || {
            let mut r = round;
            while !(tier.is_evictor() && std::fs::symlink_metadata(&planted).is_err()) {
                assert!(r < round + 200, "the lease was not taken over above the FIFO");
                publish_round(&tier, r);
                tier.maintain();
                std::thread::sleep(Duration::from_millis(30));
                r += 1;
            }
            r
        });
        // Taken at 1001 (or later: released while usage dipped below the watermark, then retaken).
        let mut generations: Vec<String> =
            std::fs::read_dir(&lease_dir).unwrap().flatten().map(|e| e.file_name().into_string().unwrap()).collect();
        generations.sort();
        assert!(generations.last().unwrap().as_str() >= format!("{:016x}.lease", 1001).as_str(), "{generations:?}");
        assert_eq!(lease_holder(a.namespace_dir()).unwrap().0, format!("{:016x}", a.writer_id()));
        assert!(stats.snapshot().shared_not_regular_files >= 1);
        // And eviction goes on.
        for r in round..round + 20 {
            publish_round(&a, r);
            std::thread::sleep(Duration::from_millis(30));
        }
        assert!(
            wait_until(Duration::from_secs(5), || stats.snapshot().shared_evicted_files > evicted),
            "eviction stopped: {:?}",
            stats.snapshot()
        );
    });
}

/// A symlink in data/ named like a fan-out directory: the orphan sweep lists directories with lstat,
/// so it never dooms (and unlinks) a file named like a data file in the directory the link points to.
#[test]
fn a_symlinked_data_directory_never_leads_the_orphan_sweep_outside_the_root() {
    within(Duration::from_secs(30), "orphan sweep", || {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(&dir.path().join("root"));
        c.orphan_tmp_ms = c.grace_ms; // sweeps every grace_ms, unlisted files old after as long
        let (a, _) = open(&c, "model-a");
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let name = "00000000000000aa-00000001.kvs";
        let victim = outside.join(name);
        std::fs::write(&victim, b"not kvtier's").unwrap();
        let fanout = format!("{:02x}", kvtier_core::format::checksum(name.as_bytes()) & 0xff);
        std::os::unix::fs::symlink(&outside, a.namespace_dir().join("data").join(fanout)).unwrap();
        std::thread::sleep(Duration::from_millis(2 * c.orphan_tmp_ms));
        for _ in 0..20 {
            a.maintain();
            std::thread::sleep(Duration::from_millis(30));
        }
        assert!(victim.exists(), "the evictor unlinked a file outside the shared root through a symlink");
    });
}

/// What the file-type fuzz puts somewhere under the root.
#[derive(Debug, Clone, Copy)]
enum Special {
    Fifo,
    SymlinkToFifo,
    SymlinkToGarbage,
    DanglingSymlink,
    Directory,
    Socket,
    Garbage,
}

const SPECIALS: [Special; 7] = [
    Special::Fifo,
    Special::SymlinkToFifo,
    Special::SymlinkToGarbage,
    Special::DanglingSymlink,
    Special::Directory,
    Special::Socket,
    Special::Garbage,
];

/// Puts `what` at `path` (moving aside what is there), as plant number `n` (its helper files in
/// `outside` are named after it); returns a bound socket to keep alive. A writer may recreate its
/// file at `path` between the move and the plant: then that file is moved aside too and the plant
/// tried again.
fn put_special(path: &Path, what: Special, outside: &Path, n: usize) -> Option<std::os::unix::net::UnixListener> {
    let garbage = outside.join(format!("garbage-{n}"));
    std::fs::write(&garbage, vec![0x5a; 20_000]).unwrap();
    for attempt in 0..100 {
        if std::fs::symlink_metadata(path).is_ok() {
            std::fs::rename(path, path.with_extension(format!("aside{n}-{attempt}"))).unwrap();
        }
        match plant_special(path, what, outside, &garbage, n) {
            Ok(listener) => return listener,
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => panic!("planting {what:?} at {}: {error}", path.display()),
        }
    }
    panic!("a writer recreated {} 100 times in a row; nothing planted", path.display());
}

fn plant_special(
    path: &Path,
    what: Special,
    outside: &Path,
    garbage: &Path,
    n: usize,
) -> std::io::Result<Option<std::os::unix::net::UnixListener>> {
    match what {
        Special::Fifo => try_mkfifo(path)?,
        Special::SymlinkToFifo => {
            let fifo = outside.join(format!("fifo-{n}"));
            if std::fs::symlink_metadata(&fifo).is_err() {
                mkfifo(&fifo);
            }
            std::os::unix::fs::symlink(&fifo, path)?;
        }
        Special::SymlinkToGarbage => std::os::unix::fs::symlink(garbage, path)?,
        Special::DanglingSymlink => std::os::unix::fs::symlink(outside.join("nothing-here"), path)?,
        Special::Directory => std::fs::create_dir(path)?,
        Special::Socket => {
            // Bound at a short path (a socket's path is limited to 108 bytes), then moved into place.
            let short = outside.join(format!("s{n}"));
            let _ = std::fs::remove_file(&short);
            let listener = std::os::unix::net::UnixListener::bind(&short)?;
            std::fs::rename(&short, path)?;
            return Ok(Some(listener));
        }
        Special::Garbage => {
            // Not `fs::copy`: it would truncate a file a writer just recreated instead of failing.
            let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(path)?;
            std::io::Write::write_all(&mut file, &std::fs::read(garbage)?)?;
        }
    }
    Ok(None)
}

/// Fuzz over the file types of the shared root: random symlinks, FIFOs, sockets, directories and
/// garbage in place of data files, manifests and leases, and in tmp/ and quarantine/. Every pass and
/// load must return in bounded time, every block served must be byte-exact, and the tiers must keep
/// publishing and serving. `PROPTEST_CASES / 16` cases (at least 8), seeded.
#[test]
fn fuzz_special_files_in_the_shared_root_never_hang_nor_serve_wrong_bytes() {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(256) / 16;
    let mut seed = 0x2400_0000_0000_0001u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for case in 0..cases.max(8) {
        let plan: Vec<(u64, Special)> =
            (0..1 + next() % 4).map(|_| (next() % 6, SPECIALS[(next() % 7) as usize])).collect();
        within(Duration::from_secs(30), &format!("case {case}: {plan:?}"), move || {
            let dir = tempfile::tempdir().unwrap();
            let outside = dir.path().join("outside");
            std::fs::create_dir(&outside).unwrap();
            let c = config(&dir.path().join("root"));
            let (a, _) = open(&c, "model-a");
            publish(&a, 0..30);
            let ns = a.namespace_dir().to_path_buf();
            let (b, _) = open(&c, "model-a");
            let mut sockets = Vec::new();
            for (n, &(target, what)) in plan.iter().enumerate() {
                let files = data_files(&ns);
                let path = match target {
                    0 if !files.is_empty() => files[n % files.len()].clone(),
                    1 => ns.join("manifests").join(format!("{:016x}.log", a.writer_id())),
                    2 => ns.join("manifests").join(format!("{:016x}.log", 0xf00 + n)),
                    3 => ns.join("lease").join(format!("{:016x}.lease", 1000 + n)),
                    4 => ns.join("tmp").join(format!("{:016x}-{:08x}.tmp", 0xf00 + n, 1)),
                    _ => ns.join("quarantine").join(format!("{:016x}-{:08x}.kvs", 0xf00 + n, 1)),
                };
                sockets.extend(put_special(&path, what, &outside, n));
            }
            for tier in [&a, &b] {
                tier.maintain();
                for i in 0..30 {
                    read_ok(tier, i); // a miss or the exact bytes (read_ok asserts them)
                }
            }
            publish(&b, 100..110);
            assert!((100..110).all(|i| read_ok(&b, i)), "the tier stopped serving what it publishes");
            assert!(wait_until(Duration::from_secs(5), || a.contains(&key(109))), "the index stopped refreshing");
            let (late, _) = open(&c, "model-a");
            late.maintain();
            assert!(read_ok(&late, 105));
        });
    }
}
