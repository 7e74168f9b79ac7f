//! How the host service waits for room, and what it lets go of for an engine that froze. A test
//! binary of its own: it reads the process's CPU time, which tests running beside it in one process
//! would add to.

mod common;
use common::*;

use kvtier_core::service::{Client, ReserveReply, Service, ServiceConfig};
use kvtier_core::{BlockBuffer, BlockKey, StoreConfig};
use std::time::{Duration, Instant};

const SLICE: usize = 8192;
const SLOTS: u64 = 8;

/// The CPU time this process has used so far (every thread), from /proc: 1/100 s steps.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

fn client(socket: &std::path::Path) -> Client {
    let mut c = Client::connect(socket, Duration::from_secs(10)).unwrap();
    c.hello(b"service-waits/model/tp", 1, 0, SLICE).unwrap();
    c
}

fn store(c: &mut Client, keys: &[BlockKey], values: &[Vec<u8>]) -> Vec<bool> {
    let bufs: Vec<BlockBuffer> = values.iter().map(|v| BlockBuffer::single(v.as_ptr() as *mut u8, v.len())).collect();
    // SAFETY: the values outlive the call.
    unsafe { c.store_blocks(keys, &bufs).unwrap() }
}

/// An engine pinned every DRAM slot (its scheduler promised them to loads) and froze. Another
/// engine's store found no slot to take, and its reserve went round again at once for the whole
/// `slot_wait_ms`: a core spent scanning for victims under the catalog lock every other call of the
/// namespace needs. It now waits for a change that may free a slot (an unpin, a release, a
/// commit), and takes the slot as soon as one is freed.
/// A service whose DRAM pool has `SLOTS` slots and no NVMe tier.
fn start(dir: &std::path::Path, slot_wait_ms: u64, pin_lease_ms: u64) -> (Service, std::path::PathBuf) {
    start_with_slots(dir, SLOTS, slot_wait_ms, pin_lease_ms)
}

fn start_with_slots(
    dir: &std::path::Path,
    slots: u64,
    slot_wait_ms: u64,
    pin_lease_ms: u64,
) -> (Service, std::path::PathBuf) {
    let mut store_config = StoreConfig::new(dir.join("store"), 1);
    store_config.dram_bytes = slots as usize * (SLICE + 4096);
    store_config.nvme_bytes = 0;
    store_config.slot_wait_ms = slot_wait_ms;
    let socket = dir.join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store_config);
    config.pool_dir = dir.to_path_buf();
    config.pin_lease_ms = pin_lease_ms;
    (Service::start(config).unwrap(), socket)
}

/// Stores blocks `ids` through `c` and pins them.
fn store_and_pin(c: &mut Client, ids: std::ops::Range<u64>) -> Vec<BlockKey> {
    let keys: Vec<BlockKey> = ids.clone().map(key).collect();
    let values: Vec<Vec<u8>> = ids.map(|i| value(i, SLICE)).collect();
    assert_eq!(store(c, &keys, &values), vec![true; keys.len()]);
    assert_eq!(c.pin(&keys).unwrap(), vec![true; keys.len()]);
    keys
}

#[test]
fn a_store_that_finds_every_slot_pinned_waits_without_spinning_and_takes_a_slot_once_one_is_freed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 1_500, 0);
    let mut frozen = client(&socket);
    store_and_pin(&mut frozen, 0..SLOTS); // every slot

    let mut other = client(&socket);
    let (cpu_before, started) = (cpu_time(), Instant::now());
    assert_eq!(other.reserve(&[key(100)]).unwrap(), vec![ReserveReply::Dropped], "no slot to take");
    let (waited, cpu) = (started.elapsed(), cpu_time() - cpu_before);
    assert!(waited >= Duration::from_millis(1_400), "the store waited only {waited:?} of its slot_wait_ms");
    assert!(cpu < waited / 4, "waiting {waited:?} for a slot took {cpu:?} of CPU");

    let unpin = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        frozen.unpin(&[key(0)]).unwrap();
        frozen
    });
    let started = Instant::now();
    assert_eq!(store(&mut other, &[key(101)], &[value(101, SLICE)]), vec![true], "the freed slot is taken");
    assert!(started.elapsed() < Duration::from_millis(1_000), "taken {:?} after the unpin", started.elapsed());
    drop(unpin.join().unwrap());
    service.stop().unwrap();
}

/// An engine that froze holding pins kept its blocks unevictable for as long as it stayed stopped:
/// the service let go of a connection's pins only when it closed. Pins held through `pin_lease_ms`
/// of the connection's silence now go; a connection that keeps asking keeps its own.
#[test]
fn pins_held_through_a_connections_silence_past_the_lease_are_let_go() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 200, 1_000);
    let mut frozen = client(&socket);
    let frozen_keys = store_and_pin(&mut frozen, 0..SLOTS / 2);
    let mut live = client(&socket);
    let kept = store_and_pin(&mut live, SLOTS / 2..SLOTS);
    let mut other = client(&socket);
    let fresh: Vec<BlockKey> = (100..100 + SLOTS).map(key).collect();
    let values: Vec<Vec<u8>> = (100..100 + SLOTS).map(|i| value(i, SLICE)).collect();
    assert_eq!(store(&mut other, &fresh[..1], &values[..1]), vec![false], "every slot pinned");
    for _ in 0..12 {
        std::thread::sleep(Duration::from_millis(250)); // past the lease, and a poll period
        assert_eq!(live.locate(&kept).unwrap().len(), kept.len()); // the live engine keeps asking
    }
    let half = (SLOTS / 2) as usize;
    assert_eq!(store(&mut other, &fresh[1..=half], &values[1..=half]), vec![true; half], "the silent one's slots");
    assert_eq!(other.locate(&frozen_keys).unwrap(), vec![0; half], "evicted once its pins went");
    assert!(live.locate(&kept).unwrap().iter().all(|&tier| tier != 0), "the live engine's pins were let go");
    let stats: std::collections::HashMap<String, u64> = other.stats().unwrap().into_iter().collect();
    assert_eq!(stats["service_expired_pins"], SLOTS / 2, "{stats:?}");
    assert_eq!(stats["service_held_pins"], SLOTS / 2, "the live engine's pins, not the expired ones: {stats:?}");
    drop(frozen);
    service.stop().unwrap();
}

/// The engine still believes it holds a pin the lease let go of: its late unpin of that block (the
/// old request's) must not release a pin taken on it since (a new request's), or the block could be
/// evicted before the new request loads it.
#[test]
fn an_unpin_of_a_pin_the_lease_let_go_leaves_a_pin_taken_since() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 200, 1_000);
    let mut engine = client(&socket);
    let keys = store_and_pin(&mut engine, 0..SLOTS);
    std::thread::sleep(Duration::from_millis(2_500)); // silent past the lease, and a poll period
    assert_eq!(engine.pin(&keys[..1]).unwrap(), vec![true], "a new request pins block 0");
    engine.unpin(&keys[..1]).unwrap(); // the old request's unpin, late
    let mut operator = client(&socket);
    let (_, namespaces) = operator.namespaces().unwrap();
    operator.trim(&namespaces[0].digest, 0, 0).unwrap(); // every unpinned block
    let located = operator.locate(&keys).unwrap();
    assert_ne!(located[0], 0, "the late unpin released the new request's pin");
    assert!(located[1..].iter().all(|&tier| tier == 0), "the expired pins still held blocks: {located:?}");
    service.stop().unwrap();
}

fn stats_of(c: &mut Client) -> std::collections::HashMap<String, u64> {
    c.stats().unwrap().into_iter().collect()
}

/// Waits (5 s at most) for the service's stat `name` to read `want`: a closed connection's holds
/// are given back by its thread once it sees the hang-up.
fn wait_for_stat(c: &mut Client, name: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while stats_of(c)[name] != want {
        assert!(Instant::now() < deadline, "{name} stayed {} (want {want})", stats_of(c)[name]);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A rank that froze between reserving and committing keeps its fills' slots (until
/// `reservation_timeout_ms`, and out of use after it while it stays stopped). One reserve could
/// take every slot of the pool (a GPU rank reserves a whole store round), and every other engine's
/// stores dropped. A connection now holds at most half the pool in new fills; past that a
/// reserve answers "no room now", which a live client meets by committing first.
#[test]
fn a_rank_that_froze_holding_reservations_keeps_at_most_half_the_pool() {
    const POOL: u64 = 16;
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start_with_slots(dir.path(), POOL, 300, 0);
    let mut live = client(&socket);
    let keys: Vec<BlockKey> = (0..POOL).map(key).collect();
    let values: Vec<Vec<u8>> = (0..POOL).map(|i| value(i, SLICE)).collect();
    assert_eq!(store(&mut live, &keys, &values), vec![true; POOL as usize], "a live client commits in rounds");
    assert!(stats_of(&mut live)["service_capped_reserves"] > 0, "its one call went in more than one round");

    let mut frozen = client(&socket);
    let wanted: Vec<BlockKey> = (100..100 + POOL).map(key).collect();
    let replies = frozen.reserve(&wanted).unwrap();
    let cap = (POOL / 2) as usize;
    assert!(replies[..cap].iter().all(|reply| matches!(reply, ReserveReply::Fill { .. })), "{replies:?}");
    assert!(replies[cap..].iter().all(|reply| *reply == ReserveReply::Retry), "{replies:?}");
    // It never commits (frozen). The others keep the rest of the pool.
    let mut other = client(&socket);
    let more: Vec<BlockKey> = (200..200 + POOL - cap as u64).map(key).collect();
    let more_values: Vec<Vec<u8>> = (200..200 + POOL - cap as u64).map(|i| value(i, SLICE)).collect();
    assert_eq!(store(&mut other, &more, &more_values), vec![true; more.len()], "the frozen rank starved the others");
    assert_eq!(stats_of(&mut other)["service_pending_fills"], cap as u64);
    drop(frozen);
    wait_for_stat(&mut other, "service_pending_fills", 0); // its close gave them back
    service.stop().unwrap();
}

/// A store larger than the cap into a pool with no room: the cap held back half of it, the first
/// half waited `slot_wait_ms` and was dropped, and the client asked again for the rest, which waited
/// as long again: a round's worth of waiting per cap, the engine's job thread held all along. What
/// the cap held back is dropped with the rest once the wait for room ran out.
#[test]
fn a_store_past_the_cap_into_a_full_pool_waits_for_room_once() {
    const SLOT_WAIT_MS: u64 = 600;
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), SLOT_WAIT_MS, 0);
    let mut frozen = client(&socket);
    store_and_pin(&mut frozen, 0..SLOTS); // every slot

    let mut other = client(&socket);
    let wanted: Vec<BlockKey> = (100..100 + SLOTS).map(key).collect();
    let replies = other.reserve(&wanted).unwrap();
    assert_eq!(replies, vec![ReserveReply::Dropped; SLOTS as usize], "past the cap, asked again: {replies:?}");
    let more: Vec<BlockKey> = (200..200 + SLOTS).map(key).collect();
    let values: Vec<Vec<u8>> = (200..200 + SLOTS).map(|i| value(i, SLICE)).collect();
    let started = Instant::now();
    assert_eq!(store(&mut other, &more, &values), vec![false; SLOTS as usize], "stored into a pool with no room");
    let waited = started.elapsed();
    assert!(waited < Duration::from_millis(2 * SLOT_WAIT_MS), "the store waited {waited:?}: for room more than once");
    assert!(stats_of(&mut other)["service_capped_reserves"] > 0, "the cap held nothing back: the test proves nothing");
    service.stop().unwrap();
}

/// A TP rank that lags behind its peer finds every fill the peer opened meanwhile: joining them all
/// in one reserve, then freezing, would hold more than the cap allows. Joins count against it.
#[test]
fn a_lagging_rank_joins_no_more_fills_than_the_cap_allows() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start_with_slots(dir.path(), 32, 300, 0); // 19 blocks of TP=2: a cap of 9
    let ranks: Vec<Client> = (0..2)
        .map(|rank| {
            let mut c = Client::connect(&socket, Duration::from_secs(10)).unwrap();
            c.hello(b"service-waits/model/tp2", 2, rank, SLICE).unwrap();
            c
        })
        .collect();
    let [mut ahead, mut lagging]: [Client; 2] = ranks.try_into().ok().unwrap();
    let opened: Vec<BlockKey> = (0..8).map(key).collect();
    for round in opened.chunks(4) {
        assert!(ahead.reserve(round).unwrap().iter().all(|r| matches!(r, ReserveReply::Fill { .. })));
        assert_eq!(ahead.commit(round).unwrap(), vec![true; 4]); // its slice; the fills wait for rank 1
    }
    let batch: Vec<BlockKey> = (0..16).map(key).collect(); // the 8 open fills and 8 new blocks
    let replies = lagging.reserve(&batch).unwrap();
    let filled = replies.iter().filter(|r| matches!(r, ReserveReply::Fill { .. })).count();
    assert_eq!(filled, 9, "the lagging rank joined past the cap: {replies:?}");
    assert!(replies[9..].iter().all(|r| *r == ReserveReply::Retry), "{replies:?}");
    assert_eq!(stats_of(&mut ahead)["service_capped_reserves"], 7);
    service.stop().unwrap();
}

/// A frozen engine's pins and load slots stay while it holds them (a load's copy may still read its
/// slots): `service_held_pins` and `service_held_load_slots` show what it keeps from the others.
#[test]
fn the_pins_and_load_slots_connections_hold_are_gauges_that_follow_them() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 200, 0);
    let mut engine = client(&socket);
    let keys = store_and_pin(&mut engine, 0..4);
    let mut loader = client(&socket);
    assert!(loader.acquire(&keys[..3]).unwrap().iter().all(Option::is_some));
    let held = |c: &mut Client| {
        let stats = stats_of(c);
        (stats["service_held_pins"], stats["service_held_load_slots"])
    };
    assert_eq!(held(&mut engine), (4, 3));
    loader.release(&keys[..1]).unwrap();
    engine.unpin(&keys[..2]).unwrap();
    engine.unpin(&keys[..2]).unwrap(); // held no more: changes nothing
    assert_eq!(held(&mut engine), (2, 2));
    drop(loader); // a loader killed holding its slots
    let mut operator = client(&socket);
    wait_for_stat(&mut operator, "service_held_load_slots", 0);
    assert_eq!(held(&mut operator), (2, 0));
    drop(engine);
    wait_for_stat(&mut operator, "service_held_pins", 0);
    service.stop().unwrap();
}
