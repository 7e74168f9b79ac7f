//! State-machine test of the `Catalog` against a reference model (issue 10, item 6).
//!
//! proptest drives random sequences of catalog operations the way the data plane issues them (puts
//! reserved, filled, aborted; loads planned and finished with good, corrupt, failed and abandoned reads;
//! pins by prefix and by slot; NVMe entry and trailer writes completing or failing; loads waiting for a
//! slot; remote-tier loads; scrubs that quarantine bad copies; a restart that adopts what a recovery would
//! find) on a tiny geometry, so that eviction and region reclaim run all the time. The model owns the
//! "bytes": what each DRAM slot and each NVMe location holds, as `(key, value id)`, written where the
//! data plane would write them. After every step it checks the catalog's own invariants and the model's:
//! - every visible key maps to a DRAM slot and/or NVMe location holding that key's latest value;
//! - every answer of a load (`plan_get`, `pin_resident`) points at the right bytes, and they stay
//!   there while the load or the pin holds them;
//! - a pinned block stays loadable: no NVMe reclaim, and its DRAM copy goes only when it has an NVMe
//!   copy and no reader (a read or a scrub that finds a copy bad may drop it regardless);
//! - a reader's slot (a DRAM hit, `pin_resident`, a scrub) keeps its bytes until released;
//! - pin counts, the write backlog, slot counts and the free list agree with what the model holds;
//! - a slot being written to NVMe is never reused, and no write lands on a live location;
//! - a key is never both missing and readable, and a put never reaches a key that is visible.

use super::regions::RegionState;
use super::*;
use crate::service::changes::{Change, ChangeLog, ChangesReply, TIER_REMOTE};
use crate::tiers::eviction::{EvictionPolicy, Lru, S3Fifo};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashSet};

const SLOT_BYTES: u64 = 4096;
const KEYS: u8 = 7;

fn key(k: u8) -> BlockKey {
    let mut b = [0u8; 32];
    b[0] = k;
    b[31] = 0xa5;
    BlockKey(b)
}

/// What a DRAM slot or an NVMe location holds, as the model's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bytes {
    /// A whole value: the key and the value id it was stored with (the value id doubles as the
    /// checksum handed to the catalog, so a read "verifies" when the bytes' id equals the checksum).
    Value(BlockKey, u64),
    /// Torn or unknown bytes (a failed write, an abandoned read, a copy a scrub found bad).
    Garbage,
    /// An expectation dropped: a scrub found the copy bad while this holder was reading it.
    Tainted,
}

/// Whether `actual` is what a holder expecting `expect` may see.
fn holds(actual: Bytes, expect: Bytes) -> bool {
    expect == Bytes::Tainted || actual == expect
}

type Loc = (u16, u32, u64);

fn loc_of(l: NvmeLoc) -> Loc {
    (l.device, l.region, l.offset)
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8),
    FinishPut(usize),
    AbortPut(usize),
    StartGet(u8, bool),
    /// 0 ok, 1 corrupt, 2 I/O error, 3 abandoned.
    FinishGet(usize, u8),
    PinPrefix(Vec<u8>),
    PinResident(u8),
    Unpin(usize),
    /// The device queue reaches a queued write (`start_write`): submitted, or cancelled if a load
    /// took its slot.
    StartWrite(usize),
    /// A write completes (started first if the queue had not reached it yet).
    CompleteWrite(usize, bool),
    CompleteMeta(usize, bool),
    LoadWaits(bool),
    /// A remote-tier load of a key the catalog does not hold; finished as a hit (the tier holds it),
    /// a miss, or abandoned by a broken I/O engine.
    StartRemote(u8),
    FinishRemote(usize, RemoteEnd),
    /// A scrub pins a visible block, then reports which of its copies were bad.
    ScrubPin(u8),
    ScrubDone(usize, bool, bool),
    /// The engine names a block's tenant (one of three), whether or not the block is held.
    AssignTenant(u8, u8),
    Restart,
}

/// How a remote-tier read into a slot ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RemoteEnd {
    Hit,
    Miss,
    Abandoned,
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0..KEYS;
    let i = any::<usize>();
    prop_oneof![
        18 => k.clone().prop_map(Op::Put),
        15 => i.prop_map(Op::FinishPut),
        3 => i.prop_map(Op::AbortPut),
        18 => (k.clone(), any::<bool>()).prop_map(|(k, d)| Op::StartGet(k, d)),
        18 => (i, prop_oneof![12 => Just(0u8), 2 => Just(1u8), 2 => Just(2u8), 1 => Just(3u8)])
            .prop_map(|(i, o)| Op::FinishGet(i, o)),
        6 => prop::collection::vec(k.clone(), 1..4).prop_map(Op::PinPrefix),
        6 => k.clone().prop_map(Op::PinResident),
        12 => i.prop_map(Op::Unpin),
        8 => i.prop_map(Op::StartWrite),
        15 => (i, prop_oneof![6 => Just(true), 1 => Just(false)]).prop_map(|(i, ok)| Op::CompleteWrite(i, ok)),
        12 => (i, prop_oneof![6 => Just(true), 1 => Just(false)]).prop_map(|(i, ok)| Op::CompleteMeta(i, ok)),
        3 => any::<bool>().prop_map(Op::LoadWaits),
        3 => k.clone().prop_map(Op::StartRemote),
        3 => (i, prop_oneof![6 => Just(RemoteEnd::Hit), 2 => Just(RemoteEnd::Miss), 1 => Just(RemoteEnd::Abandoned)])
            .prop_map(|(i, end)| Op::FinishRemote(i, end)),
        3 => k.clone().prop_map(Op::ScrubPin),
        3 => (i, prop_oneof![3 => Just(false), 1 => Just(true)], prop_oneof![3 => Just(false), 1 => Just(true)])
            .prop_map(|(i, d, n)| Op::ScrubDone(i, d, n)),
        4 => (k.clone(), 0u8..3).prop_map(|(k, t)| Op::AssignTenant(k, t)),
        1 => Just(Op::Restart),
    ]
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    slots: usize,
    /// NVMe tier: (devices, regions per device, entries per region); `None` is DRAM only.
    nvme: Option<(usize, u64, u64)>,
    /// Write backlog budget, in slots.
    dirty_slots: usize,
    lru: bool,
    /// Loads may take the slots of queued writes.
    cancel_writes: bool,
    /// Every tenant's guaranteed share of the DRAM pool (0: the pool is not split).
    tenant_share: f64,
}

fn setup() -> impl Strategy<Value = Setup> {
    let tenant_share = prop_oneof![Just(0.0), Just(0.25), Just(0.5)];
    (
        2usize..6,
        prop::option::weighted(0.85, (1usize..3, 2u64..5, 1u64..4)),
        1usize..5,
        any::<bool>(),
        any::<bool>(),
        tenant_share,
    )
        .prop_map(|(slots, nvme, dirty_slots, lru, cancel_writes, tenant_share)| Setup {
            slots,
            nvme,
            dirty_slots,
            lru,
            cancel_writes,
            tenant_share,
        })
}

/// An NVMe entry write the data plane has queued.
#[derive(Debug, Clone, Copy)]
struct Write {
    key: BlockKey,
    plan: WritePlan,
    bytes: Bytes,
    sequence: u64,
    /// The device queue submitted it (the kernel reads the slot from now on).
    started: bool,
    /// A load took its slot before it started: the queue must cancel it.
    stolen: bool,
}

/// A load in flight.
#[derive(Debug, Clone, Copy)]
enum Get {
    Dram {
        key: BlockKey,
        slot: u32,
        expect: Bytes,
    },
    /// `tainted`: a scrub quarantined the copy it reads while it was in flight.
    Nvme {
        key: BlockKey,
        read: NvmeRead,
        tainted: bool,
    },
}

/// A pin the "engine" holds; `Resident` pins are copy-outs, whose slot must keep its bytes.
#[derive(Debug, Clone, Copy)]
enum Pin {
    Prefix(BlockKey),
    Resident { key: BlockKey, slot: u32, expect: Bytes },
}

impl Pin {
    fn key(&self) -> BlockKey {
        match *self {
            Pin::Prefix(k) | Pin::Resident { key: k, .. } => k,
        }
    }
}

struct Model {
    setup: Setup,
    cat: Catalog,
    geometry: Option<Geometry>,
    next_vid: u64,
    /// The value id of each key's last finished put (what a visible key must serve).
    latest: HashMap<BlockKey, u64>,
    /// Recovery may adopt any value a key ever had on NVMe (keys are content hashes: every value of a
    /// key is the same KV data); after a restart `latest` follows what the catalog adopted.
    slot_bytes: Vec<Bytes>,
    nvme_bytes: HashMap<Loc, Bytes>,
    /// On-disk trailers: (device, region) -> (region_seq, entries); `None` entries = zeroed.
    trailers: HashMap<(usize, u32), (u64, Vec<TrailerEntry>)>,
    /// Region generation stamped in each written NVMe entry's descriptor (for the restart's scan).
    stamped: HashMap<Loc, (u64, TrailerEntry)>,
    fills: Vec<(BlockKey, u32, u64)>,
    gets: Vec<Get>,
    pins: Vec<Pin>,
    writes: Vec<Write>,
    metas: Vec<MetaWrite>,
    loads_waiting: usize,
    retired: HashSet<u32>,
    /// A remote tier (shared filesystem or bucket: the catalog's loads do not tell them apart): the
    /// last value published for each key (every finished put publishes).
    remote_tier: HashMap<BlockKey, u64>,
    remote_reads: Vec<(BlockKey, u32)>,
    scrubs: Vec<ScrubTarget>,
    /// What the run exercised (for the coverage test).
    seen: BTreeMap<&'static str, u64>,
}

fn new_catalog(setup: &Setup, geometry: Option<Geometry>) -> Catalog {
    let layout = SlotLayout {
        slot_count: setup.slots,
        slot_bytes: SLOT_BYTES,
        object_bytes: 1000,
        max_dirty_bytes: setup.dirty_slots * SLOT_BYTES as usize,
    };
    let policy: crate::catalog::PolicyFactory = if setup.lru {
        Box::new(|n| Box::new(Lru::new(n)) as Box<dyn EvictionPolicy>)
    } else {
        Box::new(|n| Box::new(S3Fifo::new(n)) as Box<dyn EvictionPolicy>)
    };
    let devices = setup.nvme.map(|(d, _, _)| d).unwrap_or(0);
    let mut cat = Catalog::new(layout, policy, geometry.map(|g| (g, devices)), Arc::new(Stats::default()));
    cat.set_loads_cancel_writes(setup.cancel_writes);
    cat.set_tenant_shares(crate::tenant::TenantShares {
        default_share: setup.tenant_share,
        named: vec![],
        max_share: None,
    });
    // With shares, NVMe regions are split by the same accounts: the walk exercises both layouts.
    cat.split_nvme_by_tenant();
    // A shared pool's resident marks (what a service that takes the pool over keeps): `check` holds
    // every marked slot to a whole value of its key.
    let marks: &'static mut [u8] = Box::leak(vec![0u8; setup.slots].into_boxed_slice());
    cat.set_resident_marks(crate::tiers::dram::ResidentMarks::over(marks));
    cat
}

impl Model {
    fn new(setup: Setup) -> Self {
        let geometry = setup.nvme.map(|(_, regions, entries)| {
            let region_bytes = entries * SLOT_BYTES + crate::format::trailer::trailer_bytes(entries as usize) as u64;
            let g = Geometry::new(SLOT_BYTES, region_bytes, regions);
            assert_eq!(g.max_entries, entries);
            g
        });
        Model {
            setup,
            cat: new_catalog(&setup, geometry),
            geometry,
            next_vid: 1,
            latest: HashMap::new(),
            slot_bytes: vec![Bytes::Garbage; setup.slots],
            nvme_bytes: HashMap::new(),
            trailers: HashMap::new(),
            stamped: HashMap::new(),
            fills: Vec::new(),
            gets: Vec::new(),
            pins: Vec::new(),
            writes: Vec::new(),
            metas: Vec::new(),
            loads_waiting: 0,
            retired: HashSet::new(),
            remote_tier: HashMap::new(),
            remote_reads: Vec::new(),
            scrubs: Vec::new(),
            seen: BTreeMap::new(),
        }
    }

    fn held_pins(&self, key: &BlockKey) -> u32 {
        let gets = self
            .gets
            .iter()
            .filter(|g| match g {
                Get::Dram { key: k, .. } | Get::Nvme { key: k, .. } => k == key,
            })
            .count();
        let remote = self.remote_reads.iter().filter(|r| r.0 == *key).count();
        let scrubs = self.scrubs.iter().filter(|t| t.key == *key).count();
        (gets + remote + scrubs + self.pins.iter().filter(|p| p.key() == *key).count()) as u32
    }

    /// The pins of `key` that copy out of its DRAM slot: DRAM hits, resident pins, scrubs.
    fn held_readers(&self, key: &BlockKey) -> u32 {
        let hits = self.gets.iter().filter(|g| matches!(g, Get::Dram { key: k, .. } if k == key)).count();
        let scrubs = self.scrubs.iter().filter(|t| t.key == *key).count();
        let resident = self.pins.iter().filter(|p| matches!(p, Pin::Resident { key: k, .. } if k == key)).count();
        (hits + scrubs + resident) as u32
    }

    /// The copies of every pinned key (DRAM slot when ready, NVMe location) and its readers.
    fn pinned_copies(&self) -> BTreeMap<BlockKey, (Option<u32>, Option<NvmeLoc>, u32)> {
        let mut out = BTreeMap::new();
        for k in 0..KEYS {
            let key = key(k);
            if self.held_pins(&key) == 0 {
                continue;
            }
            if let Some(e) = self.cat.index.get(&key) {
                out.insert(key, (e.dram.filter(|_| e.dram_ready), e.nvme, self.held_readers(&key)));
            }
        }
        out
    }

    fn saw(&mut self, what: &'static str) {
        *self.seen.entry(what).or_default() += 1;
    }

    /// Folds the catalog's own counters into `seen` (before the catalog is replaced or dropped).
    fn fold_stats(&mut self) {
        let s = self.cat.stats.snapshot();
        for (name, n) in [
            ("dram eviction", s.dram_evictions),
            ("region reclaim", s.nvme_region_evictions),
            ("retired slot", s.retired_slots),
            ("recovered block", s.recovered_blocks),
            ("write dropped (no region)", s.nvme_dropped_writes),
            ("write cancelled for a load", s.cancelled_writes),
        ] {
            *self.seen.entry(name).or_default() += n;
        }
    }

    fn submit_meta(&mut self, meta: Vec<MetaWrite>) {
        self.metas.extend(meta);
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Put(k) => {
                let key = key(k);
                let was_visible = self.cat.contains(&key);
                let tracked = self.cat.has_entry(&key);
                match self.cat.plan_put(&key) {
                    PutStep::Present => assert!(tracked, "Present for a key the catalog does not hold"),
                    PutStep::NoSlot => {
                        assert!(!tracked);
                        self.saw("put without a slot");
                    }
                    PutStep::Fill { slot, .. } => {
                        assert!(!tracked && !was_visible, "a put reserved a slot for a key already held");
                        assert_eq!(self.loads_waiting, 0, "a put got a slot while a load waits for one");
                        assert!(!self.retired.contains(&slot), "a retired slot was handed out");
                        let vid = self.next_vid;
                        self.next_vid += 1;
                        // The data plane fills the slot now (the descriptor and the value).
                        self.slot_bytes[slot as usize] = Bytes::Value(key, vid);
                        self.fills.push((key, slot, vid));
                        self.saw("put filled");
                    }
                }
            }
            Op::FinishPut(i) => {
                if self.fills.is_empty() {
                    return;
                }
                let (key, slot, vid) = self.fills.remove(i % self.fills.len());
                assert_eq!(self.slot_bytes[slot as usize], Bytes::Value(key, vid), "a filling slot was reused");
                let mut meta = Vec::new();
                let plan = self.cat.finish_put(&key, slot, vid, Persist::Now, &mut meta);
                self.latest.insert(key, vid);
                self.remote_tier.insert(key, vid);
                if let Some(plan) = plan {
                    let l = loc_of(plan.loc);
                    assert!(
                        !self.cat.index.values().any(|e| e.nvme == Some(plan.loc)),
                        "an NVMe write planned over a live location"
                    );
                    assert!(
                        !self.writes.iter().any(|w| !w.stolen && loc_of(w.plan.loc) == l),
                        "two writes planned at one location"
                    );
                    let g = self.geometry.unwrap();
                    assert!(plan.loc.offset + g.slot_bytes <= g.data_bytes(), "an entry past its region's data area");
                    let sequence = self.cat.index[&key].sequence;
                    assert_eq!(plan.sequence, sequence);
                    // The data plane stamps the descriptor and hands the write to its device queue.
                    self.cat.write_queued(&key, &plan);
                    let bytes = Bytes::Value(key, vid);
                    self.writes.push(Write { key, plan, bytes, sequence, started: false, stolen: false });
                }
                self.submit_meta(meta);
            }
            Op::AbortPut(i) => {
                if self.fills.is_empty() {
                    return;
                }
                let (key, slot, _) = self.fills.remove(i % self.fills.len());
                self.cat.abort_put(&key, slot);
                assert!(!self.cat.has_entry(&key));
            }
            Op::StartGet(k, direct) => {
                let key = key(k);
                let visible = self.cat.contains(&key);
                let direct = direct && self.geometry.is_some();
                // Short of slots, a load that cannot stage elsewhere may take a queued write's slot,
                // never one of a block it still needs (here: the next key).
                let spare = self::key((k + 1) % KEYS);
                let mut step = self.cat.plan_get(&key, direct);
                if matches!(step, GetStep::NoSlot) {
                    step = self.cat.plan_get_taking_queued_write(&key, &HashSet::from([spare]));
                }
                match step {
                    GetStep::Miss => assert!(!visible, "a visible key missed"),
                    GetStep::NoSlot => {
                        assert!(visible, "NoSlot for a key that is not visible");
                        assert!(!direct);
                        self.saw("load without a slot");
                    }
                    GetStep::Dram { slot } => {
                        assert!(visible);
                        let expect = Bytes::Value(key, self.latest[&key]);
                        assert_eq!(self.slot_bytes[slot as usize], expect, "a DRAM hit points at wrong bytes");
                        self.gets.push(Get::Dram { key, slot, expect });
                        self.saw("DRAM hit");
                    }
                    GetStep::Nvme(read) => {
                        assert!(visible);
                        assert_eq!(read.value_checksum, self.latest[&key], "a read expects another value");
                        assert_eq!(direct, read.slot == NO_SLOT);
                        if read.slot != NO_SLOT {
                            assert!(!self.retired.contains(&read.slot));
                            self.note_stolen(read.slot, spare);
                            // The read lands in the slot later; until then it holds nothing usable.
                            self.slot_bytes[read.slot as usize] = Bytes::Garbage;
                        }
                        self.gets.push(Get::Nvme { key, read, tainted: false });
                        self.saw(if direct { "direct NVMe read" } else { "staged NVMe read" });
                    }
                    GetStep::Pending => {
                        let staged = self
                            .gets
                            .iter()
                            .any(|g| matches!(g, Get::Nvme { key: k, read, .. } if *k == key && read.slot != NO_SLOT));
                        let remote = self.remote_reads.iter().any(|(k, _)| *k == key);
                        assert!(staged || remote, "a load waits for a read of {key:?} that nobody does");
                        self.saw("load joins a read in flight");
                    }
                }
            }
            Op::FinishGet(i, outcome) => {
                if self.gets.is_empty() {
                    return;
                }
                match self.gets.remove(i % self.gets.len()) {
                    Get::Dram { key, slot, expect } => {
                        assert!(holds(self.slot_bytes[slot as usize], expect), "a hit's slot changed under its copy");
                        self.cat.finish_get_dram(&key);
                    }
                    Get::Nvme { key, read, tainted } => {
                        let on_disk = self.nvme_bytes.get(&loc_of(read.loc)).copied().unwrap_or(Bytes::Garbage);
                        let verifies = on_disk == Bytes::Value(key, read.value_checksum);
                        let outcome = match outcome {
                            // A copy a scrub found bad fails the load's verification too.
                            0 if tainted && !verifies => LoadOutcome::Corrupt,
                            0 => {
                                // The data plane verifies key and checksum: the pinned location must
                                // still hold what the catalog promised.
                                assert_eq!(
                                    on_disk,
                                    Bytes::Value(key, read.value_checksum),
                                    "an NVMe read of a pinned block found other bytes"
                                );
                                self.saw("NVMe read verified");
                                LoadOutcome::Ok
                            }
                            1 => LoadOutcome::Corrupt,
                            2 => LoadOutcome::IoError,
                            _ => LoadOutcome::Abandoned,
                        };
                        if read.slot != NO_SLOT {
                            self.slot_bytes[read.slot as usize] =
                                if matches!(outcome, LoadOutcome::Ok) { on_disk } else { Bytes::Garbage };
                            if matches!(outcome, LoadOutcome::Abandoned) {
                                self.retired.insert(read.slot);
                            }
                        }
                        self.cat.finish_get_nvme(&key, &read, outcome);
                        if self.held_pins(&key) > 0 && self.cat.index.get(&key).is_some_and(|e| !e.visible()) {
                            self.saw("pinned entry left copyless");
                        }
                    }
                }
            }
            Op::PinPrefix(ref ks) => {
                let keys: Vec<BlockKey> = ks.iter().map(|&k| key(k)).collect();
                let expect = keys.iter().take_while(|k| self.cat.contains(k)).count();
                let n = self.cat.pin_prefix(&keys);
                assert_eq!(n, expect, "pin_prefix pinned other than the leading visible keys");
                self.pins.extend(keys[..n].iter().map(|&k| Pin::Prefix(k)));
                if n > 0 {
                    self.saw("prefix pinned");
                }
            }
            Op::PinResident(k) => {
                let key = key(k);
                let in_dram = self.cat.locate(&key) == Some(Tier::Dram);
                match self.cat.pin_resident(&key) {
                    Some(slot) => {
                        assert!(in_dram);
                        let expect = Bytes::Value(key, self.latest[&key]);
                        assert_eq!(self.slot_bytes[slot as usize], expect, "pin_resident points at wrong bytes");
                        self.pins.push(Pin::Resident { key, slot, expect });
                        self.saw("resident pinned");
                    }
                    None => assert!(!in_dram, "pin_resident refused a DRAM-resident block"),
                }
            }
            Op::Unpin(i) => {
                if self.pins.is_empty() {
                    return;
                }
                let pin = self.pins.remove(i % self.pins.len());
                if let Pin::Resident { slot, expect, .. } = pin {
                    assert!(holds(self.slot_bytes[slot as usize], expect), "a pinned slot changed under its copy");
                }
                match pin {
                    Pin::Resident { .. } => self.cat.release_readers(&[pin.key()]),
                    Pin::Prefix(key) => self.cat.unpin(&[key]),
                }
            }
            Op::StartWrite(i) => {
                let queued: Vec<usize> = (0..self.writes.len()).filter(|&w| !self.writes[w].started).collect();
                if !queued.is_empty() {
                    self.start_write(queued[i % queued.len()]);
                }
            }
            Op::CompleteWrite(i, ok) => {
                if self.writes.is_empty() {
                    return;
                }
                let at = i % self.writes.len();
                if !self.writes[at].started && !self.start_write(at) {
                    return;
                }
                let Write { key, plan, bytes, sequence, .. } = self.writes.remove(at);
                assert_eq!(self.slot_bytes[plan.slot as usize], bytes, "a slot was reused while written to NVMe");
                let l = loc_of(plan.loc);
                if ok {
                    self.nvme_bytes.insert(l, bytes);
                    let Bytes::Value(_, vid) = bytes else { unreachable!() };
                    let entry =
                        TrailerEntry { key, sequence, offset: plan.loc.offset, value_bytes: 1000, value_checksum: vid };
                    self.stamped.insert(l, (plan.region_seq, entry));
                } else {
                    self.nvme_bytes.insert(l, Bytes::Garbage);
                    self.stamped.remove(&l);
                }
                self.saw(if ok { "NVMe write" } else { "NVMe write failed" });
                let outcome = if ok { WriteOutcome::Written } else { WriteOutcome::Failed };
                if let Some(t) = self.cat.complete_write(&key, &plan, outcome) {
                    self.submit_meta(vec![t]);
                }
            }
            Op::CompleteMeta(i, ok) => {
                if self.metas.is_empty() {
                    return;
                }
                let w = self.metas.remove(i % self.metas.len());
                let at = (w.device, w.region);
                if ok {
                    match &w.entries {
                        Some(entries) => {
                            self.trailers.insert(at, (w.region_seq, entries.clone()));
                        }
                        None => {
                            // A reclaimed region: trailer zeroed (its old entries are left, stamped
                            // with an older generation, and the scan skips them).
                            self.trailers.remove(&at);
                        }
                    }
                }
                self.saw(match (&w.entries, ok) {
                    (Some(_), true) => "trailer written",
                    (Some(_), false) => "trailer write failed",
                    (None, _) => "reclaimed trailer zeroed",
                });
                if let Some(retry) = self.cat.complete_meta(&w, ok) {
                    self.submit_meta(vec![retry]);
                }
            }
            Op::LoadWaits(start) => {
                if start {
                    self.cat.load_waits(true);
                    self.loads_waiting += 1;
                } else if self.loads_waiting > 0 {
                    self.cat.load_waits(false);
                    self.loads_waiting -= 1;
                }
            }
            Op::StartRemote(k) => {
                let key = key(k);
                let tracked = self.cat.has_entry(&key);
                let spare = self::key((k + 1) % KEYS);
                let slot = self.cat.plan_get_remote(&key).or_else(|| {
                    let tracked = self.cat.has_entry(&key);
                    (!tracked).then(|| self.cat.plan_get_remote_taking_queued_write(&key, &HashSet::from([spare])))?
                });
                match slot {
                    Some(slot) => {
                        assert!(!tracked, "a remote load planned for a key the catalog holds");
                        assert!(!self.retired.contains(&slot));
                        self.note_stolen(slot, spare);
                        assert!(!self.cat.contains(&key), "a block being loaded is visible");
                        self.slot_bytes[slot as usize] = Bytes::Garbage;
                        self.remote_reads.push((key, slot));
                        self.saw("remote load");
                    }
                    None => assert!(tracked || self.setup.slots > 0),
                }
            }
            Op::FinishRemote(i, end) => {
                if self.remote_reads.is_empty() {
                    return;
                }
                let (key, slot) = self.remote_reads.remove(i % self.remote_reads.len());
                if end == RemoteEnd::Abandoned {
                    // The engine gave the read up: the slot may still be written, so never reused.
                    self.cat.abandon_get_remote(&key, slot);
                    self.retired.insert(slot);
                    assert!(
                        self.held_pins(&key) > 0 || !self.cat.has_entry(&key),
                        "an abandoned remote load left an entry"
                    );
                    self.saw("remote read abandoned");
                    return;
                }
                match self.remote_tier.get(&key).copied().filter(|_| end == RemoteEnd::Hit) {
                    Some(vid) => {
                        // The mover read and verified the tier's file into the slot.
                        self.slot_bytes[slot as usize] = Bytes::Value(key, vid);
                        self.cat.finish_get_remote(&key, slot, Some(vid));
                        self.latest.insert(key, vid);
                        assert!(self.cat.contains(&key));
                        self.saw("remote hit");
                    }
                    None => {
                        self.cat.finish_get_remote(&key, slot, None);
                        assert!(
                            self.held_pins(&key) > 0 || !self.cat.has_entry(&key),
                            "a missed remote load left an entry"
                        );
                    }
                }
            }
            Op::ScrubPin(k) => {
                let key = key(k);
                let Some(sequence) = self.cat.index.get(&key).filter(|e| e.visible()).map(|e| e.sequence) else {
                    return;
                };
                let t = self.cat.scrub_pin(&key, sequence).expect("a visible block can be scrubbed");
                let want = Bytes::Value(key, self.latest[&key]);
                if let Some(slot) = t.dram {
                    assert_eq!(self.slot_bytes[slot as usize], want, "a scrub was offered wrong DRAM bytes");
                }
                if let Some(l) = t.nvme {
                    assert_eq!(self.nvme_bytes.get(&loc_of(l)), Some(&want), "a scrub was offered wrong NVMe bytes");
                }
                assert!(t.dram.is_some() || t.nvme.is_some() || self.cat.index[&key].dram_ready);
                self.scrubs.push(t);
            }
            Op::ScrubDone(i, bad_dram, bad_nvme) => {
                if self.scrubs.is_empty() {
                    return;
                }
                let t = self.scrubs.remove(i % self.scrubs.len());
                let bad_slot = t.dram.filter(|_| bad_dram);
                let bad_loc = t.nvme.filter(|_| bad_nvme);
                let mut meta = Vec::new();
                let (dram_q, nvme_q) = self.cat.scrub_done(&t.key, t.sequence, bad_slot, bad_loc, &mut meta);
                self.submit_meta(meta);
                // The copies found bad hold bad bytes (a fault the scrub caught): holders reading them
                // now get what the fault left, and no load may be planned on them again.
                if let (true, Some(slot)) = (dram_q, bad_slot) {
                    self.slot_bytes[slot as usize] = Bytes::Garbage;
                    for g in &mut self.gets {
                        if let Get::Dram { slot: s, expect, .. } = g {
                            if *s == slot {
                                *expect = Bytes::Tainted;
                            }
                        }
                    }
                    for p in &mut self.pins {
                        if let Pin::Resident { slot: s, expect, .. } = p {
                            if *s == slot {
                                *expect = Bytes::Tainted;
                            }
                        }
                    }
                    if let Some(e) = self.cat.index.get(&t.key) {
                        assert!(!(e.dram == Some(slot) && e.dram_ready), "a quarantined DRAM copy is still served");
                    }
                    self.saw("DRAM copy quarantined");
                }
                if let (true, Some(l)) = (nvme_q, bad_loc) {
                    self.nvme_bytes.insert(loc_of(l), Bytes::Garbage);
                    self.stamped.remove(&loc_of(l));
                    for g in &mut self.gets {
                        if let Get::Nvme { read, tainted, .. } = g {
                            if read.loc == l {
                                *tainted = true;
                            }
                        }
                    }
                    if let Some(e) = self.cat.index.get(&t.key) {
                        assert_ne!(e.nvme, Some(l), "a quarantined NVMe copy is still served");
                    }
                    self.saw("NVMe copy quarantined");
                }
            }
            Op::AssignTenant(k, tenant) => {
                self.cat.assign_tenant(&[key(k)], &crate::tenant::tenant_id(&[tenant]));
                self.saw("tenant named");
            }
            Op::Restart => self.restart(),
        }
    }

    /// A load was handed `slot`: if a queued write still names it, the load took it from that write
    /// (only an unstarted write of an unpinned block, and only when allowed), and the block is gone.
    fn note_stolen(&mut self, slot: u32, spare: BlockKey) {
        let Some(at) = self.writes.iter().position(|w| w.plan.slot == slot && !w.stolen) else { return };
        assert_ne!(self.writes[at].key, spare, "a load took the slot of a block it said it still needs");
        assert!(self.setup.cancel_writes, "a load took a queued write's slot with cancellation off");
        assert!(!self.writes[at].started, "a load took the slot of a write the kernel is reading");
        self.writes[at].stolen = true;
        let w = self.writes[at];
        let key = w.key;
        assert!(
            self.cat.index.get(&key).is_none_or(|e| e.sequence != w.sequence),
            "the block whose write was cancelled is still indexed"
        );
        assert_eq!(self.held_pins(&key), 0, "a load took the slot of a pinned block");
        // No hole in an open region (recovery's scan would stop there): the cancelled entry was the
        // open region's last, and the next entry takes its place; or its region is sealing.
        let loc = w.plan.loc;
        let nvme = self.cat.nvme.as_ref().unwrap();
        let device = nvme.device(loc.device as usize);
        let region = &device.regions[loc.region as usize];
        if region.state == RegionState::Open {
            assert_eq!(region.cursor, loc.offset, "a cancelled write left a hole in an open region");
        } else {
            assert_eq!(
                region.state,
                RegionState::Sealing,
                "a write was cancelled in a region neither open nor sealing"
            );
        }
        self.saw("load took a queued write's slot");
    }

    /// The device queue reaches write `at`: the gate submits it, or cancels it if a load took its
    /// slot (then it completes at once, without touching the slot). Whether it was submitted.
    fn start_write(&mut self, at: usize) -> bool {
        let w = self.writes[at];
        let submitted = self.cat.start_write(&w.plan);
        assert_eq!(submitted, !w.stolen, "the gate disagrees with whether a load took the slot");
        if submitted {
            self.writes[at].started = true;
            return true;
        }
        self.writes.remove(at);
        if let Some(t) = self.cat.complete_write(&w.key, &w.plan, WriteOutcome::Cancelled) {
            self.submit_meta(vec![t]);
        }
        false
    }

    /// A clean restart: the data plane drains (reads finish, pins go, fills abort, writes and trailers
    /// land), then a new catalog adopts what recovery would read back: sealed regions from their
    /// trailers, trailer-less regions by a scan of entries stamped with the region's generation.
    fn restart(&mut self) {
        let Some(g) = self.geometry else { return };
        while let Some(get) = self.gets.pop() {
            self.gets.push(get);
            self.step(&Op::FinishGet(self.gets.len() - 1, 0));
        }
        while !self.pins.is_empty() {
            self.step(&Op::Unpin(0));
        }
        while !self.remote_reads.is_empty() {
            self.step(&Op::FinishRemote(0, RemoteEnd::Miss));
        }
        while !self.scrubs.is_empty() {
            self.step(&Op::ScrubDone(0, false, false));
        }
        while !self.fills.is_empty() {
            self.step(&Op::AbortPut(0));
        }
        while !self.writes.is_empty() || !self.metas.is_empty() {
            if !self.writes.is_empty() {
                self.step(&Op::CompleteWrite(0, true));
            } else {
                self.step(&Op::CompleteMeta(0, true));
            }
        }
        while self.loads_waiting > 0 {
            self.step(&Op::LoadWaits(false));
        }
        self.check();
        self.fold_stats();
        self.saw("restart");
        let (devices, regions, _) = self.setup.nvme.unwrap();
        let mut cat = new_catalog(&self.setup, self.geometry);
        let mut meta = Vec::new();
        for d in 0..devices {
            let mut found = Vec::new();
            for r in 0..regions as u32 {
                if let Some((region_seq, entries)) = self.trailers.get(&(d, r)) {
                    // A trailer whose zeroing failed can outlive its region's reuse: entries whose bytes
                    // were overwritten would fail a load's verification, so recovery's input keeps
                    // only the entries still on disk as listed.
                    let entries: Vec<TrailerEntry> = entries
                        .iter()
                        .filter(|e| {
                            let l = (d as u16, r, e.offset);
                            self.stamped.get(&l) == Some(&(*region_seq, **e))
                                && self.nvme_bytes.get(&l) == Some(&Bytes::Value(e.key, e.value_checksum))
                        })
                        .copied()
                        .collect();
                    found.push(RecoveredRegion { region: r, region_seq: *region_seq, entries, sealed: true });
                    continue;
                }
                // Scan: entries from offset 0 while they carry one generation, the highest first seen.
                let mut entries = Vec::new();
                let mut seq = None;
                for i in 0..g.max_entries {
                    let l = (d as u16, r, i * SLOT_BYTES);
                    let Some(&(rs, e)) = self.stamped.get(&l) else { break };
                    if *seq.get_or_insert(rs) != rs {
                        break;
                    }
                    if self.nvme_bytes.get(&l) != Some(&Bytes::Value(e.key, e.value_checksum)) {
                        break;
                    }
                    entries.push(e);
                }
                if let Some(region_seq) = seq.filter(|_| !entries.is_empty()) {
                    found.push(RecoveredRegion { region: r, region_seq, entries, sealed: false });
                }
            }
            meta.extend(cat.adopt_recovered(d, found));
        }
        self.cat = cat;
        // The DRAM pool starts empty; what NVMe holds is what the keys serve now.
        self.slot_bytes = vec![Bytes::Garbage; self.setup.slots];
        self.retired.clear();
        self.latest.clear();
        for (k, e) in &self.cat.index {
            self.latest.insert(*k, e.value_checksum);
        }
        self.submit_meta(meta);
    }

    fn check(&self) {
        let cat = &self.cat;
        cat.check_invariants();
        // Slots: the free list is duplicate-free, holds only free slots, never more than the pool.
        let free: HashSet<u32> = cat.slots.free_list().iter().copied().collect();
        assert_eq!(free.len(), cat.slots.free_list().len(), "a slot is twice on the free list");
        assert!(free.len() <= cat.slots.len());
        for &s in &free {
            assert_eq!(cat.slots.get(s).state, SlotState::Free);
        }
        // A resident slot (marked: `Slots::check`) holds the whole value of a visible entry's key,
        // which is what a service that takes the pool over after a kill may keep.
        for (slot, s) in cat.slots.iter().enumerate().filter(|(_, s)| s.state == SlotState::Resident && !s.quarantined)
        {
            let key = s.key.expect("a resident slot without a key");
            let e = cat.index.get(&key).expect("a resident slot whose key has no entry");
            assert!(e.dram == Some(slot as u32) && e.dram_ready, "resident slot {slot} is not its entry's copy");
            assert_eq!(self.slot_bytes[slot], Bytes::Value(key, e.value_checksum), "resident slot {slot}'s bytes");
        }
        let mut owners: HashMap<u32, BlockKey> = HashMap::new();
        for (key, e) in &cat.index {
            let visible = e.visible();
            assert_eq!(cat.contains(key), visible);
            let tier = cat.locate(key);
            assert_eq!(tier.is_some(), visible, "locate and contains disagree");
            if let Some(slot) = e.dram {
                assert!(owners.insert(slot, *key).is_none(), "two entries share DRAM slot {slot}");
                assert!(!free.contains(&slot), "an entry's slot is on the free list");
                assert!(!self.retired.contains(&slot), "an entry holds a retired slot");
            }
            if visible {
                let vid = self.latest.get(key).copied();
                assert_eq!(Some(e.value_checksum), vid, "a visible key serves a value other than its last");
                let want = Bytes::Value(*key, e.value_checksum);
                if e.dram_ready {
                    assert_eq!(tier, Some(Tier::Dram));
                    assert_eq!(self.slot_bytes[e.dram.unwrap() as usize], want, "a resident slot holds other bytes");
                }
                if let Some(l) = e.nvme {
                    assert_eq!(self.nvme_bytes.get(&loc_of(l)), Some(&want), "an NVMe copy holds other bytes");
                    let g = self.geometry.unwrap();
                    assert!(l.offset + g.slot_bytes <= g.data_bytes());
                }
            }
            // An entry nobody fills, loads or pins must be visible: an orphan would answer `Present` to
            // every later put of its key, which could then never be stored again.
            if !visible {
                let filling = self.fills.iter().any(|f| f.0 == *key);
                assert!(filling || e.pins > 0 || e.dram.is_some(), "orphan entry {key:?}: {e:?}");
            }
            // Pins: exactly the loads in flight and the engine's pins on this key.
            assert_eq!(e.pins, self.held_pins(key), "pin count of {key:?} differs from the pins held");
            assert_eq!(e.readers, self.held_readers(key), "reader count of {key:?} differs from the readers held");
        }
        // A key someone holds a pin on keeps its entry (pins would otherwise land on a later entry).
        for p in &self.pins {
            assert!(cat.index.contains_key(&p.key()), "the entry of a pinned key {:?} is gone", p.key());
        }
        for (k, _, _) in &self.fills {
            let e = &cat.index[k];
            assert!(!e.visible(), "a block being filled is visible");
        }
        for p in &self.pins {
            if let Pin::Resident { slot, expect, .. } = p {
                assert!(holds(self.slot_bytes[*slot as usize], *expect), "a pinned slot was reused");
            }
        }
        for g in &self.gets {
            if let Get::Dram { slot, expect, .. } = g {
                assert!(holds(self.slot_bytes[*slot as usize], *expect), "a hit's slot was reused");
            }
        }
        for (key, slot) in &self.remote_reads {
            let e = &cat.index[key];
            assert_eq!(e.dram, Some(*slot), "a remote load's slot is not its entry's");
            assert!(!e.visible(), "a block being loaded from the remote tier is visible");
        }
        for w in self.writes.iter().filter(|w| !w.stolen) {
            assert_eq!(self.slot_bytes[w.plan.slot as usize], w.bytes, "a slot being written was reused");
        }
        // The write backlog is exactly the fills and writes in flight (with an NVMe tier).
        if self.geometry.is_some() {
            let dirty = (self.fills.len() + self.writes.len()) * SLOT_BYTES as usize;
            assert_eq!(cat.dirty_bytes, dirty, "write backlog differs from the fills and writes in flight");
            assert!(dirty <= cat.max_dirty_bytes);
        }
        assert_eq!(cat.nvme.as_ref().map_or(0, |n| n.pending_meta_writes()), self.metas.len());
        assert_eq!(cat.loads_waiting, self.loads_waiting);
        let resident = cat.slots.iter().filter(|s| s.state == SlotState::Resident).count();
        let gauges = cat.gauges();
        assert!(resident <= cat.slots.len());
        assert!(gauges.dram_used_bytes <= gauges.dram_capacity_bytes);
        assert!(gauges.nvme_used_bytes <= gauges.nvme_capacity_bytes);
    }

    /// A failed read of `key` may drop its copy even while pinned; a load's eviction may drop the DRAM
    /// copy of a pinned block without readers that has an NVMe copy (the load reads NVMe); nothing
    /// else may drop a pinned block's copy.
    fn check_pinned_kept(
        &mut self,
        before: &BTreeMap<BlockKey, (Option<u32>, Option<NvmeLoc>, u32)>,
        op: &Op,
        failed: &[BlockKey],
    ) {
        let mut evicted_to_nvme = 0;
        for (key, &(dram, nvme, readers)) in before {
            // A copyless entry (its read failed while pinned) only waits for its last pin.
            if failed.contains(key) || matches!(op, Op::Restart) || (dram.is_none() && nvme.is_none()) {
                continue;
            }
            let e = self.cat.index.get(key).unwrap_or_else(|| panic!("pinned {key:?} evicted by {op:?}"));
            let kept = e.dram_ready && e.dram == dram;
            if nvme.is_some() {
                assert_eq!(e.nvme, nvme, "pinned {key:?} lost its NVMe copy to {op:?}");
            }
            if let (Some(_), false) = (dram, kept) {
                assert!(readers == 0 && nvme.is_some(), "pinned {key:?} lost its DRAM copy to {op:?}");
                // Only a load may evict a block a pending load pinned; a store never does.
                assert!(!matches!(op, Op::Put(_)), "a store evicted pinned {key:?} from DRAM");
                evicted_to_nvme += 1;
            }
        }
        if evicted_to_nvme > 0 {
            self.saw("pinned block evicted to its NVMe copy");
        }
    }
}

/// Keys a catalog tracks between two refreshes of the change logs below: small, so that overflows
/// (and the full walk after them) happen in the model's runs too.
const TRACK_CAP: usize = 3;

/// Two change logs fed after every step (issue 26): one with full snapshots of the residency (the
/// service's way before the catalog tracked changes), one with `Catalog::residency_changes`. They
/// must tell a follower the same thing; and the tracked keys, applied to what was applied before,
/// must give the full walk (a key whose tiers changed and was not recorded fails here).
struct Followers {
    full: ChangeLog,
    tracked: ChangeLog,
    cursors: (u64, u64),
    applied: HashMap<BlockKey, u8>,
    remote_seen: Option<Vec<BlockKey>>,
}

/// `(key, tier)` pairs of a reply, sorted.
type Tiers = Vec<(BlockKey, u8)>;

/// A follower's view of one reply: removals come before additions; each part sorted.
fn removals_then_additions(changes: Vec<Change>) -> (Tiers, Tiers) {
    assert!(
        changes.windows(2).all(|w| w[0].removed || !w[1].removed),
        "an addition came before a removal: {changes:?}"
    );
    let part = |removed: bool| {
        let mut part: Tiers = changes.iter().filter(|c| c.removed == removed).map(|c| (c.key, c.tier)).collect();
        part.sort_unstable_by_key(|(k, t)| (k.0, *t));
        part
    };
    (part(true), part(false))
}

impl Followers {
    fn new() -> Self {
        Followers {
            full: ChangeLog::new(1 << 16),
            tracked: ChangeLog::new(1 << 16),
            cursors: (0, 0),
            applied: HashMap::new(),
            remote_seen: None,
        }
    }

    fn follow(&mut self, m: &mut Model) {
        let mut local = HashMap::new();
        m.cat.residency(&mut local);
        let changes = m.cat.residency_changes(false, TRACK_CAP);
        match &changes {
            ResidencyChanges::All(all) => {
                m.saw("residency walked");
                self.applied = all.clone();
            }
            ResidencyChanges::Keys(keys) => {
                m.saw("residency by tracked keys");
                for &(key, tiers) in keys {
                    match tiers {
                        0 => self.applied.remove(&key),
                        _ => self.applied.insert(key, tiers),
                    };
                }
            }
        }
        assert_eq!(self.applied, local, "the tracked keys missed a change of tiers");
        let mut remote_keys: Vec<BlockKey> = m.remote_tier.keys().copied().collect();
        remote_keys.sort_unstable_by_key(|k| k.0);
        let remote = (self.remote_seen.as_ref() != Some(&remote_keys)).then(|| remote_keys.clone());
        let mut now = local;
        for key in &remote_keys {
            *now.entry(*key).or_insert(0) |= TIER_REMOTE;
        }
        self.remote_seen = Some(remote_keys);
        self.full.update(now);
        self.tracked.apply(changes, remote);
        let (a, b) = (self.full.since(self.cursors.0, usize::MAX), self.tracked.since(self.cursors.1, usize::MAX));
        assert_eq!(a.reset, b.reset);
        assert_eq!(removals_then_additions(a.changes), removals_then_additions(b.changes));
        self.cursors = (a.next, b.next);
        assert_eq!(
            self.full.since(0, usize::MAX),
            ChangesReply { next: self.full.since(0, 1).next, ..self.tracked.since(0, usize::MAX) }
        );
    }
}

fn run(setup: Setup, ops: &[Op]) -> BTreeMap<&'static str, u64> {
    let mut m = Model::new(setup);
    let mut followers = Followers::new();
    for op in ops {
        let before = m.pinned_copies();
        // The key of a read finished with a failure (its copy may go although pinned).
        let failed: Vec<BlockKey> = match *op {
            Op::FinishGet(i, o) if !m.gets.is_empty() => match m.gets[i % m.gets.len()] {
                // A tainted read fails whatever the outcome drawn.
                Get::Nvme { key, tainted, .. } if o != 0 || tainted => vec![key],
                _ => vec![],
            },
            Op::ScrubDone(i, d, n) if (d || n) && !m.scrubs.is_empty() => vec![m.scrubs[i % m.scrubs.len()].key],
            _ => vec![],
        };
        m.step(op);
        m.check();
        m.check_pinned_kept(&before, op, &failed);
        followers.follow(&mut m);
    }
    m.fold_stats();
    m.seen
}

proptest! {
    #[test]
    fn catalog_matches_reference_model(setup in setup(), ops in prop::collection::vec(op(), 1..300)) {
        run(setup, &ops);
    }
}

/// The model is only as good as what it drives: 200 fixed-seed cases must reach every path the checks
/// are about (eviction, reclaim, every kind of read and failure, retired slots, recovery).
#[test]
fn model_reaches_every_path() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = (setup(), prop::collection::vec(op(), 1..300));
    let mut seen: BTreeMap<&'static str, u64> = BTreeMap::new();
    for _ in 0..200 {
        let (setup, ops) = strategy.new_tree(&mut runner).unwrap().current();
        for (what, n) in run(setup, &ops) {
            *seen.entry(what).or_default() += n;
        }
    }
    eprintln!("MODEL coverage over 200 cases: {seen:?}");
    for what in [
        "put filled",
        "put without a slot",
        "DRAM hit",
        "staged NVMe read",
        "direct NVMe read",
        "load joins a read in flight",
        "NVMe read verified",
        "load without a slot",
        "pinned entry left copyless",
        "prefix pinned",
        "resident pinned",
        "pinned block evicted to its NVMe copy",
        "NVMe write",
        "NVMe write failed",
        "trailer written",
        "trailer write failed",
        "reclaimed trailer zeroed",
        "restart",
        "tenant named",
        "dram eviction",
        "region reclaim",
        "retired slot",
        "recovered block",
        "write dropped (no region)",
        "write cancelled for a load",
        "load took a queued write's slot",
        "remote load",
        "remote hit",
        "remote read abandoned",
        "DRAM copy quarantined",
        "NVMe copy quarantined",
        "residency walked",
        "residency by tracked keys",
    ] {
        assert!(seen.get(what).copied().unwrap_or(0) > 0, "the model never reached: {what}");
    }
}

// ---- regressions of what the model found (each failed before the fix in catalog.rs) ----

/// A catalog with 2 DRAM slots and one device of `regions` one-entry regions, region `i` holding key
/// `i` (sealed, as recovery adopts it): every key starts NVMe-only.
fn recovered_catalog(regions: u32) -> Catalog {
    let setup = Setup {
        slots: 2,
        nvme: Some((1, regions as u64, 1)),
        dirty_slots: 2,
        lru: false,
        cancel_writes: true,
        tenant_share: 0.0,
    };
    let g = Geometry::new(SLOT_BYTES, SLOT_BYTES + crate::format::trailer::trailer_bytes(1) as u64, regions as u64);
    let mut cat = new_catalog(&setup, Some(g));
    let found = (0..regions)
        .map(|r| RecoveredRegion {
            region: r,
            region_seq: r as u64 + 1,
            entries: vec![TrailerEntry {
                key: key(r as u8),
                sequence: r as u64 + 1,
                offset: 0,
                value_bytes: 1000,
                value_checksum: 100 + r as u64,
            }],
            sealed: true,
        })
        .collect();
    assert!(cat.adopt_recovered(0, found).is_empty());
    cat
}

fn nvme_read(step: GetStep) -> NvmeRead {
    match step {
        GetStep::Nvme(read) => read,
        other => panic!("expected an NVMe read, got {other:?}"),
    }
}

/// A failed read used to drop the entry although the engine still pinned it; a new put of the key
/// then made a new entry, and the engine's later unpin took the pin off that one (a worker copying
/// out of it could then see its slot evicted and refilled).
#[test]
fn failed_read_keeps_a_pinned_entry_until_its_last_pin() {
    let mut cat = recovered_catalog(1);
    let k = key(0);
    assert_eq!(cat.pin_prefix(&[k]), 1);
    let read = nvme_read(cat.plan_get(&k, false));
    cat.finish_get_nvme(&k, &read, LoadOutcome::Corrupt);
    assert!(!cat.contains(&k), "a block whose only copy failed is a miss");
    assert!(cat.has_entry(&k), "the entry waits for the engine's pin");
    assert!(matches!(cat.plan_put(&k), PutStep::Present));
    cat.unpin(&[k]);
    assert!(!cat.has_entry(&k), "the last pin takes the copyless entry");
    let PutStep::Fill { slot, .. } = cat.plan_put(&k) else { panic!("the block can be stored again") };
    let mut meta = Vec::new();
    let _ = cat.finish_put(&k, slot, 7, Persist::Now, &mut meta);
    assert_eq!(cat.pin_resident(&k), Some(slot));
    assert_eq!(cat.index[&k].pins, 1);
    cat.check_invariants();
}

/// Two loads of one NVMe-only block: the staged one fails and drops the copy; the direct one's read
/// of the same location is still in flight, so its region must not be reclaimed (it used to be, and
/// the next put's write landed where the read was reading). When the direct read finishes, the
/// copyless entry goes (it used to stay for good, answering `Present` to every later put).
#[test]
fn region_under_an_inflight_read_waits_and_the_copyless_entry_goes() {
    let mut cat = recovered_catalog(2);
    let k = key(0);
    let direct = nvme_read(cat.plan_get(&k, true));
    let staged = nvme_read(cat.plan_get(&k, false));
    cat.finish_get_nvme(&k, &staged, LoadOutcome::IoError);
    assert!(!cat.contains(&k));
    // Every region is sealed and full: the put's write reclaims one, never the one being read.
    let x = key(5);
    let PutStep::Fill { slot, .. } = cat.plan_put(&x) else { panic!("a slot is free") };
    let mut meta = Vec::new();
    let plan = cat.finish_put(&x, slot, 9, Persist::Now, &mut meta).expect("region 1 is reclaimable");
    assert_ne!(plan.loc.region, direct.loc.region, "a region was reclaimed under a read in flight");
    cat.finish_get_nvme(&k, &direct, LoadOutcome::Ok);
    assert!(!cat.has_entry(&k), "a copyless, unpinned entry was left behind");
    assert!(matches!(cat.plan_put(&k), PutStep::Fill { .. }));
    cat.check_invariants();
}

/// The engine pins a request's blocks at prepare_load, most of them on NVMe only; the worker then
/// loads them through the pool, a few at a time. The engine's pins used to hold every slot a load
/// read into until complete_load, so a request with more NVMe blocks than the pool has slots never
/// got slots for its last ones (each try waited `slot_wait_ms`, missed, and vLLM retried forever).
/// A loaded copy of a pinned block with an NVMe copy is now evictable once its reader is done.
#[test]
fn engine_pins_on_nvme_blocks_do_not_hold_the_slots_their_loads_use() {
    let mut cat = recovered_catalog(6);
    let keys: Vec<BlockKey> = (0..6).map(key).collect();
    assert_eq!(cat.pin_prefix(&keys), 6, "the engine pins the whole request (2 slots, 6 blocks)");
    for k in &keys {
        let read = nvme_read(cat.plan_get(k, false));
        cat.finish_get_nvme(k, &read, LoadOutcome::Ok);
        let slot = cat.pin_resident(k).expect("the block was just read into the pool");
        // While the worker copies out of the slot, no other load may take it.
        if k == &keys[0] {
            let other = nvme_read(cat.plan_get(&keys[5], false));
            assert_ne!(other.slot, slot, "a reader's slot was handed to another load");
            cat.finish_get_nvme(&keys[5], &other, LoadOutcome::Ok);
        }
        cat.release_readers(std::slice::from_ref(k));
        cat.check_invariants();
    }
    for k in &keys {
        assert!(cat.contains(k), "a pinned block stays loadable");
        assert_eq!(cat.index[k].readers, 0);
    }
    cat.unpin(&keys);
    assert!(keys.iter().all(|k| cat.index[k].pins == 0));
}

/// The ranks of a tensor-parallel engine load the same blocks at once (each copies its slice of the
/// one object). The second load of a block being read into DRAM used to read it again into another
/// slot (N reads per block for TP=N, or, for a remote-tier read, a miss); it now waits for that read
/// and copies from the slot it fills, and a failed read leaves it a clean miss.
#[test]
fn a_second_load_joins_the_read_in_flight() {
    let mut cat = recovered_catalog(2);
    let (a, b) = (key(0), key(1));
    let read = nvme_read(cat.plan_get(&a, false));
    assert!(matches!(cat.plan_get(&a, false), GetStep::Pending));
    assert!(matches!(cat.plan_get(&a, true), GetStep::Pending), "a direct load joins too");
    cat.check_invariants();
    cat.finish_get_nvme(&a, &read, LoadOutcome::Ok);
    let GetStep::Dram { slot } = cat.plan_get(&a, false) else { panic!("the joined load copies from DRAM") };
    assert_eq!(slot, read.slot);
    cat.finish_get_dram(&a);

    let read = nvme_read(cat.plan_get(&b, false));
    assert!(matches!(cat.plan_get(&b, false), GetStep::Pending));
    cat.finish_get_nvme(&b, &read, LoadOutcome::Corrupt);
    assert!(matches!(cat.plan_get(&b, false), GetStep::Miss), "a failed read leaves the waiter a miss");
    cat.check_invariants();
}

/// What differs between two full walks, as the tracked keys should report it.
fn residency_diff(before: &HashMap<BlockKey, u8>, after: &HashMap<BlockKey, u8>) -> Vec<(BlockKey, u8)> {
    let keys: BTreeSet<[u8; 32]> = before.keys().chain(after.keys()).map(|k| k.0).collect();
    let tiers = |m: &HashMap<BlockKey, u8>, k: [u8; 32]| m.get(&BlockKey(k)).copied().unwrap_or(0);
    keys.into_iter().filter(|&k| tiers(before, k) != tiers(after, k)).map(|k| (BlockKey(k), tiers(after, k))).collect()
}

/// The catalog records exactly the keys whose local tiers changed, from the first refresh on: not
/// a pin, not a load's staging slot, not an entry that came and went without being loadable; and
/// past its cap it asks for a walk of the whole index.
#[test]
fn the_catalog_tracks_exactly_the_keys_whose_tiers_changed() {
    let mut cat = recovered_catalog(3);
    let (a, b) = (key(0), key(1));
    let all: HashMap<BlockKey, u8> = [(key(0), 2), (key(1), 2), (key(2), 2)].into_iter().collect();
    assert_eq!(cat.residency_changes(false, 10), ResidencyChanges::All(all.clone()), "the first refresh walks");
    assert_eq!(cat.pin_prefix(&[a, b]), 2);
    let read = nvme_read(cat.plan_get(&a, false));
    assert_eq!(cat.residency_changes(false, 10), ResidencyChanges::Keys(vec![]), "pins and a read in flight");
    cat.finish_get_nvme(&a, &read, LoadOutcome::Ok);
    let (new, gone) = (key(7), key(8));
    let PutStep::Fill { slot, .. } = cat.plan_put(&gone) else { panic!("a slot is free") };
    cat.abort_put(&gone, slot);
    let PutStep::Fill { slot, .. } = cat.plan_put(&new) else { panic!("a slot is free") };
    let mut meta = Vec::new();
    let _ = cat.finish_put(&new, slot, 7, Persist::Now, &mut meta);
    cat.unpin(&[a, b]);
    let mut now = HashMap::new();
    cat.residency(&mut now);
    assert_eq!((now[&a], now[&new]), (3, 1), "a in DRAM too, the new block in DRAM");
    let ResidencyChanges::Keys(mut keys) = cat.residency_changes(false, 10) else { panic!("a walk") };
    keys.sort_unstable_by_key(|(k, _)| k.0);
    assert_eq!(keys, residency_diff(&all, &now));
    assert_eq!(cat.residency_changes(false, 0), ResidencyChanges::Keys(vec![]), "nothing since");
    let mut meta = Vec::new();
    assert!(cat.quarantine_nvme(&b, cat.index[&b].nvme.unwrap(), &mut meta));
    assert!(matches!(cat.residency_changes(false, 0), ResidencyChanges::All(_)), "past the cap: a walk");
    assert_eq!(cat.residency_changes(false, 0), ResidencyChanges::Keys(vec![]));
    assert!(matches!(cat.residency_changes(true, 10), ResidencyChanges::All(_)), "asked for everything");
    cat.check_invariants();
}
