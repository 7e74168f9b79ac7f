//! The NVMe regions of every device (`Regions`, after CacheLib navy's `RegionManager`). A region is
//! free, open (taking entries at its cursor), sealing (its trailer being written, or held out of
//! use) or sealed. Each device has at most one open region; devices take entries in turn; a device
//! out of free regions reclaims its oldest sealed one (FIFO by region generation), whole.
//!
//! `Regions` keeps each region's trailer list (the entries recovery is to find there) and counts the
//! metadata writes it hands out. Which of those entries are still current, and which are pinned, is
//! the index's business: reclaim asks the catalog (`pinned`), and hands back what it dropped.
//!
//! Split by tenant (`tenant_shares_nvme`, with shares or a cap on the DRAM pool), each region belongs
//! to the tenant account whose blocks it takes: every account has an open region of its own per
//! device, and a region for it is taken as a DRAM slot is (`tenants.rs`): its own oldest region
//! when it holds its cap, else a free one, else the oldest region of the accounts past their
//! guaranteed regions, the furthest past first, then its own, then the others', the largest first.
//! So a flood rewrites its own regions and leaves a quiet tenant's share of the device alone. Not
//! split, every region is account 0's and the tier is one FIFO log, as it always was.

use super::{MetaWrite, NvmeLoc};
use crate::format::trailer::TrailerEntry;
use crate::key::BlockKey;
use crate::tenant::eviction_order;
use crate::tiers::nvme::{Geometry, RecoveredRegion};

/// Attempts at one trailer write: without its trailer a region is only recoverable by a scan that
/// stops at the first hole, so a failed one is retried, a bounded number of times.
const MAX_TRAILER_ATTEMPTS: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RegionState {
    Free,
    Open,
    Sealing,
    Sealed,
}

#[derive(Debug)]
pub(super) struct Region {
    pub(super) state: RegionState,
    pub(super) region_seq: u64,
    /// Where the next entry goes, in bytes from the region's start.
    pub(super) cursor: u64,
    /// The trailer's list: the entries written here that recovery is to find.
    pub(super) entries: Vec<TrailerEntry>,
    /// Entry writes planned here and not complete: a sealing region's trailer waits for them.
    pub(super) pending_writes: u32,
    /// The tenant account whose blocks it takes (0 when the tier is not split by tenant, and for a
    /// region recovery adopted: a device file does not record who stored a region).
    pub(super) account: u8,
}

impl Region {
    fn free() -> Self {
        Region {
            state: RegionState::Free,
            region_seq: 0,
            cursor: 0,
            entries: Vec::new(),
            pending_writes: 0,
            account: 0,
        }
    }
}

pub(super) struct DeviceRegions {
    pub(super) regions: Vec<Region>,
    /// The regions taking entries, `(account, region)`: at most one per tenant account.
    pub(super) open: Vec<(u8, u32)>,
}

impl DeviceRegions {
    fn open_of(&self, account: u8) -> Option<u32> {
        self.open.iter().find(|&&(a, _)| a == account).map(|&(_, region)| region)
    }

    /// Regions in use per account, for `accounts` accounts at least.
    fn held(&self, accounts: usize) -> Vec<usize> {
        let mut held = vec![0; accounts];
        for r in self.regions.iter().filter(|r| r.state != RegionState::Free) {
            let a = r.account as usize;
            if a >= held.len() {
                held.resize(a + 1, 0);
            }
            held[a] += 1;
        }
        held
    }
}

/// A tenant account's part of each device (`Tenants::region_quotas`), in regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RegionQuota {
    /// Regions no other account takes while any account is past its own.
    pub(super) guaranteed: usize,
    /// The most it holds before it rewrites its own oldest (`usize::MAX`: no cap).
    pub(super) cap: usize,
}

/// Where `Regions::alloc` placed an entry.
pub(super) struct Placement {
    pub(super) loc: NvmeLoc,
    pub(super) region_seq: u64,
    /// The trailer list of the region reclaimed to make room, if one was (the placement's region):
    /// the catalog forgets the copies still current there.
    pub(super) reclaimed: Option<Vec<TrailerEntry>>,
}

pub(super) struct Regions {
    geometry: Geometry,
    devices: Vec<DeviceRegions>,
    /// The device that takes the next entry, round robin.
    next_device: usize,
    next_region_seq: u64,
    /// Metadata writes handed out and not complete (`complete_meta`): the store is not idle before
    /// they land.
    pending_meta_writes: usize,
    /// Regions reclaimed from each tenant account, for the gauges.
    reclaimed_from: Vec<u64>,
}

impl Regions {
    pub(super) fn new(geometry: Geometry, device_count: usize) -> Self {
        let device = || DeviceRegions {
            regions: (0..geometry.region_count).map(|_| Region::free()).collect(),
            open: Vec::new(),
        };
        Regions {
            geometry,
            devices: (0..device_count).map(|_| device()).collect(),
            next_device: 0,
            next_region_seq: 1,
            pending_meta_writes: 0,
            reclaimed_from: Vec::new(),
        }
    }

    /// Regions in use and regions reclaimed, per tenant account (index), over every device.
    pub(super) fn by_account(&self) -> Vec<(u64, u64)> {
        let mut by_account: Vec<(u64, u64)> = self.reclaimed_from.iter().map(|&n| (0, n)).collect();
        for device in &self.devices {
            for (a, held) in device.held(0).into_iter().enumerate() {
                if a >= by_account.len() {
                    by_account.resize(a + 1, (0, 0));
                }
                by_account[a].0 += held as u64;
            }
        }
        by_account
    }

    pub(super) fn geometry(&self) -> Geometry {
        self.geometry
    }

    #[cfg(test)]
    pub(super) fn device(&self, device: usize) -> &DeviceRegions {
        &self.devices[device]
    }

    pub(super) fn region(&self, device: usize, region: u32) -> &Region {
        &self.devices[device].regions[region as usize]
    }

    fn region_mut(&mut self, device: usize, region: u32) -> &mut Region {
        &mut self.devices[device].regions[region as usize]
    }

    pub(super) fn pending_meta_writes(&self) -> usize {
        self.pending_meta_writes
    }

    /// Regions in use and in all.
    pub(super) fn usage(&self) -> (u64, u64) {
        let all = self.devices.iter().flat_map(|d| d.regions.iter());
        let used = all.clone().filter(|r| r.state != RegionState::Free).count();
        (used as u64, all.count() as u64)
    }

    /// The write of `region`'s trailer as its list stands now, counted until `complete_meta`.
    fn trailer_write(&mut self, device: usize, region: u32) -> MetaWrite {
        self.pending_meta_writes += 1;
        let r = self.region(device, region);
        debug_assert_eq!(r.state, RegionState::Sealing, "a trailer for region {region} that is not sealing");
        debug_assert_eq!(r.pending_writes, 0, "a trailer for region {region} under entry writes");
        debug_assert!(r.entries.len() as u64 <= self.geometry.max_entries, "a trailer past the region's entries");
        MetaWrite { device, region, region_seq: r.region_seq, entries: Some(r.entries.clone()), attempt: 0 }
    }

    /// Takes over a region recovery found (full: a scanned region takes no more entries either). One
    /// found by a scan has no trailer yet: its write is returned.
    pub(super) fn adopt(&mut self, device: usize, found: RecoveredRegion) -> Option<MetaWrite> {
        let cursor = self.geometry.data_bytes();
        debug_assert!(found.entries.len() as u64 <= self.geometry.max_entries, "recovery found too many entries");
        self.next_region_seq = self.next_region_seq.max(found.region_seq + 1);
        let r = self.region_mut(device, found.region);
        r.region_seq = found.region_seq;
        r.cursor = cursor;
        r.entries = found.entries;
        if found.sealed {
            r.state = RegionState::Sealed;
            return None;
        }
        r.state = RegionState::Sealing;
        Some(self.trailer_write(device, found.region))
    }

    /// A place for one more entry of tenant account `asker`'s, on the next device in turn that has
    /// one: its open region there, or a region opened for it (sealing its full one, whose trailer may
    /// go to `meta`), reclaiming a sealed region none of whose entries is `pinned` when it must
    /// (`region_for`). `quotas`: each account's part of a device; empty when the tier is not split.
    pub(super) fn alloc(
        &mut self,
        meta: &mut Vec<MetaWrite>,
        pinned: &dyn Fn(usize, u32, &TrailerEntry) -> bool,
        asker: u8,
        quotas: &[RegionQuota],
    ) -> Option<Placement> {
        debug_assert!(!quotas.is_empty() || asker == 0, "account {asker} in a tier not split by tenant");
        let device_count = self.devices.len();
        let data_bytes = self.geometry.data_bytes();
        for _ in 0..device_count {
            let device = self.next_device;
            self.next_device = (device + 1) % device_count;
            if let Some((region, reclaimed)) = self.open_region(device, meta, pinned, asker, quotas) {
                let slot_bytes = self.geometry.slot_bytes;
                let r = self.region_mut(device, region);
                debug_assert_eq!(r.state, RegionState::Open, "an entry placed in region {region} that is not open");
                debug_assert_eq!(r.account, asker, "an entry placed in another account's region {region}");
                debug_assert!(r.cursor.is_multiple_of(slot_bytes), "region {region}'s cursor off the slot grid");
                let loc = NvmeLoc { device: device as u16, region, offset: r.cursor };
                r.cursor += slot_bytes;
                r.pending_writes += 1;
                debug_assert!(r.cursor <= data_bytes, "an entry placed past region {region}'s data");
                return Some(Placement { loc, region_seq: r.region_seq, reclaimed });
            }
        }
        None
    }

    /// `asker`'s open region of the device with room for one more entry, opening (and if needed
    /// reclaiming) one; with the reclaimed region's trailer list.
    fn open_region(
        &mut self,
        device: usize,
        meta: &mut Vec<MetaWrite>,
        pinned: &dyn Fn(usize, u32, &TrailerEntry) -> bool,
        asker: u8,
        quotas: &[RegionQuota],
    ) -> Option<(u32, Option<Vec<TrailerEntry>>)> {
        let geometry = self.geometry;
        if let Some(open) = self.devices[device].open_of(asker) {
            if self.region(device, open).cursor + geometry.slot_bytes <= geometry.data_bytes() {
                return Some((open, None));
            }
            self.seal(device, open, meta);
        }
        debug_assert!(self.devices[device].open_of(asker).is_none(), "account {asker} opens a second region");
        let Some((region, reclaimed)) = self.region_for(device, pinned, asker, quotas) else {
            self.seal_others(device, asker, meta);
            return None;
        };
        assert_eq!(self.region(device, region).pending_writes, 0, "region {region} reopened under writes");
        debug_assert!(
            matches!(self.region(device, region).state, RegionState::Free | RegionState::Sealed),
            "region {region} reopened from {:?}",
            self.region(device, region).state
        );
        let region_seq = self.next_region_seq;
        self.next_region_seq += 1;
        *self.region_mut(device, region) = Region {
            state: RegionState::Open,
            region_seq,
            cursor: 0,
            entries: Vec::new(),
            pending_writes: 0,
            account: asker,
        };
        self.devices[device].open.push((asker, region));
        if reclaimed.is_some() {
            // The old trailer goes first, or recovery would adopt the old entries over the new ones.
            self.pending_meta_writes += 1;
            meta.push(MetaWrite { device, region, region_seq, entries: None, attempt: 0 });
        }
        Some((region, reclaimed))
    }

    /// The region `asker` opens next on `device` (the module's order): its own oldest at its cap, a
    /// free one, else a reclaimed one, taken from the accounts in `eviction_order`.
    fn region_for(
        &mut self,
        device: usize,
        pinned: &dyn Fn(usize, u32, &TrailerEntry) -> bool,
        asker: u8,
        quotas: &[RegionQuota],
    ) -> Option<(u32, Option<Vec<TrailerEntry>>)> {
        let held = self.devices[device].held(quotas.len().max(asker as usize + 1));
        let cap = quotas.get(asker as usize).map_or(usize::MAX, |q| q.cap);
        if held[asker as usize] >= cap {
            if let Some((region, entries)) = self.reclaim_oldest(device, pinned, asker) {
                return Some((region, Some(entries)));
            }
        }
        if let Some(free) = self.devices[device].regions.iter().position(|r| r.state == RegionState::Free) {
            return Some((free as u32, None));
        }
        let order = if quotas.is_empty() {
            (0..held.len()).collect()
        } else {
            let mut guaranteed: Vec<usize> = quotas.iter().map(|q| q.guaranteed).collect();
            guaranteed.resize(held.len(), 0);
            eviction_order(asker as usize, &held, &guaranteed)
        };
        order.into_iter().find_map(|a| self.reclaim_oldest(device, pinned, a as u8)).map(|(r, e)| (r, Some(e)))
    }

    /// Seals the other accounts' open regions of a device with nothing left to reclaim, so that the
    /// next write may take one when its trailer lands: a tenant that stopped storing would otherwise
    /// keep its open region out of use for ever. (Not split, the asker's was the only one.)
    fn seal_others(&mut self, device: usize, asker: u8, meta: &mut Vec<MetaWrite>) {
        let others: Vec<u32> =
            self.devices[device].open.iter().filter(|&&(a, _)| a != asker).map(|&(_, region)| region).collect();
        for region in others {
            self.seal(device, region, meta);
        }
    }

    fn seal(&mut self, device: usize, region: u32, meta: &mut Vec<MetaWrite>) {
        self.devices[device].open.retain(|&(_, open)| open != region);
        let r = self.region_mut(device, region);
        assert_eq!(r.state, RegionState::Open, "region {region} sealed while not open");
        r.state = RegionState::Sealing;
        if r.pending_writes == 0 {
            meta.push(self.trailer_write(device, region));
        }
    }

    /// Empties the oldest sealed region of `account`'s on `device` none of whose entries is `pinned`:
    /// the region and what its trailer listed.
    fn reclaim_oldest(
        &mut self,
        device: usize,
        pinned: &dyn Fn(usize, u32, &TrailerEntry) -> bool,
        account: u8,
    ) -> Option<(u32, Vec<TrailerEntry>)> {
        let regions = &self.devices[device].regions;
        let mut candidates: Vec<(u64, u32)> = regions
            .iter()
            .enumerate()
            .filter(|(_, r)| r.state == RegionState::Sealed && r.account == account)
            .map(|(i, r)| (r.region_seq, i as u32))
            .collect();
        candidates.sort_unstable();
        let victim = candidates
            .into_iter()
            .map(|(_, r)| r)
            .find(|&region| !regions[region as usize].entries.iter().any(|t| pinned(device, region, t)))?;
        let a = account as usize;
        if a >= self.reclaimed_from.len() {
            self.reclaimed_from.resize(a + 1, 0);
        }
        self.reclaimed_from[a] += 1;
        Some((victim, std::mem::take(&mut self.region_mut(device, victim).entries)))
    }

    /// Whether dropping the write planned at `loc` leaves every open region without a hole: it is the
    /// last entry planned in its device's open region, or its region is sealing.
    pub(super) fn cancel_leaves_no_hole(&self, loc: NvmeLoc) -> bool {
        let region = &self.devices[loc.device as usize].regions[loc.region as usize];
        match region.state {
            RegionState::Open => loc.offset + self.geometry.slot_bytes == region.cursor,
            state => state == RegionState::Sealing,
        }
    }

    /// The write planned at `loc` is dropped: if it was its open region's last entry, the next
    /// entry takes its place.
    pub(super) fn rewind_if_last(&mut self, loc: NvmeLoc) {
        let slot_bytes = self.geometry.slot_bytes;
        let region = &mut self.devices[loc.device as usize].regions[loc.region as usize];
        if region.state == RegionState::Open && loc.offset + slot_bytes == region.cursor {
            region.cursor = loc.offset;
            debug_assert!(region.cursor.is_multiple_of(slot_bytes), "a rewound cursor off the slot grid");
        }
    }

    /// An entry write planned at `loc` is over; `listed`: it was written and its block is current, so
    /// the trailer lists it. Returns the trailer write of a sealing region that waited only for it.
    pub(super) fn entry_done(&mut self, loc: NvmeLoc, listed: Option<TrailerEntry>) -> Option<MetaWrite> {
        let (device, region) = (loc.device as usize, loc.region);
        let r = self.region_mut(device, region);
        debug_assert!(
            matches!(r.state, RegionState::Open | RegionState::Sealing),
            "a write into a {:?} region",
            r.state
        );
        debug_assert!(listed.is_none_or(|t| t.offset == loc.offset), "a trailer entry listed at another offset");
        r.pending_writes = r.pending_writes.checked_sub(1).expect("an entry write completed twice");
        r.entries.extend(listed);
        let trailer_due = r.state == RegionState::Sealing && r.pending_writes == 0;
        trailer_due.then(|| self.trailer_write(device, region))
    }

    /// A metadata write finished. A failed trailer write comes back to retry while attempts are
    /// left; otherwise a trailer write seals its region if that generation still waits for it (after
    /// the last failed attempt too: the region must become reclaimable again).
    pub(super) fn complete_meta(&mut self, write: &MetaWrite, ok: bool) -> Option<MetaWrite> {
        self.pending_meta_writes = self.pending_meta_writes.checked_sub(1).expect("a metadata write completed twice");
        if !ok && write.entries.is_some() && write.attempt + 1 < MAX_TRAILER_ATTEMPTS {
            self.pending_meta_writes += 1;
            return Some(MetaWrite { entries: write.entries.clone(), attempt: write.attempt + 1, ..*write });
        }
        if write.entries.is_some() {
            let r = self.region_mut(write.device, write.region);
            if r.state == RegionState::Sealing && r.region_seq == write.region_seq {
                r.state = RegionState::Sealed;
            }
        }
        None
    }

    /// Drops one entry from its region's trailer list. A sealed region's trailer is rewritten without
    /// it (returned), the region sealing until then: reclaim takes only sealed regions.
    pub(super) fn forget_entry(&mut self, key: &BlockKey, loc: NvmeLoc) -> Option<MetaWrite> {
        let r = self.region_mut(loc.device as usize, loc.region);
        let before = r.entries.len();
        r.entries.retain(|t| !(t.key == *key && t.offset == loc.offset));
        if r.entries.len() == before || r.state != RegionState::Sealed {
            return None;
        }
        r.state = RegionState::Sealing;
        Some(self.trailer_write(loc.device as usize, loc.region))
    }

    /// Every region in use as `(device, region)`, oldest generation first.
    pub(super) fn in_use_oldest_first(&self) -> Vec<(usize, u32)> {
        let mut regions: Vec<(u64, usize, u32)> = self
            .devices
            .iter()
            .enumerate()
            .flat_map(|(d, dev)| {
                dev.regions
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.state != RegionState::Free)
                    .map(move |(i, r)| (r.region_seq, d, i as u32))
            })
            .collect();
        regions.sort_unstable();
        regions.into_iter().map(|(_, d, r)| (d, r)).collect()
    }

    /// Empties a sealed region a trim frees and holds it out of use (sealing: neither reclaimed nor
    /// opened) until its trailer and first entry are zeroed on disk, so that recovery cannot find them
    /// again (`release_trimmed`). Its generation and what its trailer listed.
    pub(super) fn hold_trimmed(&mut self, device: usize, region: u32) -> (u64, Vec<TrailerEntry>) {
        let r = self.region_mut(device, region);
        assert_eq!(r.state, RegionState::Sealed, "trimmed region {region} of device {device} was not sealed");
        r.state = RegionState::Sealing;
        (r.region_seq, std::mem::take(&mut r.entries))
    }

    /// A trimmed region is zeroed on disk: free, if it is still the generation that was trimmed.
    pub(super) fn release_trimmed(&mut self, device: usize, region: u32, region_seq: u64) {
        let r = self.region_mut(device, region);
        if r.state == RegionState::Sealing && r.region_seq == region_seq && r.entries.is_empty() {
            r.state = RegionState::Free;
            r.cursor = 0;
        }
    }

    /// The regions' own invariants (tests and debug builds).
    pub(super) fn check(&self) {
        let data_bytes = self.geometry.data_bytes();
        for (d, device) in self.devices.iter().enumerate() {
            for (n, &(account, region)) in device.open.iter().enumerate() {
                assert_eq!(
                    device.regions[region as usize].account, account,
                    "device {d}: region {region} opened for another"
                );
                assert!(
                    device.open[..n].iter().all(|&(a, _)| a != account),
                    "device {d}: account {account} holds two open regions"
                );
            }
            for (i, r) in device.regions.iter().enumerate() {
                let open = device.open.iter().any(|&(_, region)| region == i as u32);
                assert_eq!(r.state == RegionState::Open, open, "device {d} region {i}: open disagrees with the device");
                assert!(r.cursor <= data_bytes, "device {d} region {i}: cursor {} past the data", r.cursor);
                if r.state == RegionState::Free {
                    assert!(r.entries.is_empty() && r.pending_writes == 0, "device {d} region {i}: free but in use");
                } else {
                    assert!(r.region_seq < self.next_region_seq, "device {d} region {i}: generation from the future");
                }
                if r.state == RegionState::Sealed {
                    assert_eq!(r.pending_writes, 0, "device {d} region {i}: sealed under writes");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::test_support::key;

    const SLOT_BYTES: u64 = 4096;

    /// `devices` devices of `regions` regions of `entries` entries each.
    fn regions(devices: usize, regions: u64, entries: u64) -> Regions {
        let region_bytes = entries * SLOT_BYTES + crate::format::trailer::trailer_bytes(entries as usize) as u64;
        let geometry = Geometry::new(SLOT_BYTES, region_bytes, regions);
        assert_eq!(geometry.max_entries, entries);
        Regions::new(geometry, devices)
    }

    fn nothing_pinned(_: usize, _: u32, _: &TrailerEntry) -> bool {
        false
    }

    fn entry(k: u8, loc: NvmeLoc) -> TrailerEntry {
        TrailerEntry { key: key(k), sequence: u64::from(k) + 1, offset: loc.offset, value_bytes: 1, value_checksum: 0 }
    }

    /// Places one entry, writes it (listed) and completes any trailer write it makes due; returns the
    /// placement and the metadata writes made.
    fn place_and_write(r: &mut Regions, k: u8) -> (Placement, Vec<MetaWrite>) {
        place_and_write_for(r, k, 0, &[])
    }

    /// `place_and_write` for tenant account `account` of a tier split by `quotas`.
    fn place_and_write_for(r: &mut Regions, k: u8, account: u8, quotas: &[RegionQuota]) -> (Placement, Vec<MetaWrite>) {
        let mut meta = Vec::new();
        let placement = r.alloc(&mut meta, &nothing_pinned, account, quotas).expect("room");
        meta.extend(r.entry_done(placement.loc, Some(entry(k, placement.loc))));
        for write in &meta {
            assert!(r.complete_meta(write, true).is_none());
        }
        r.check();
        (placement, meta)
    }

    #[test]
    fn devices_take_entries_in_turn_and_a_full_region_seals() {
        let mut r = regions(2, 2, 2);
        let devices: Vec<u16> = (0..4).map(|k| place_and_write(&mut r, k).0.loc.device).collect();
        assert_eq!(devices, [0, 1, 0, 1]);
        assert_eq!(r.region(0, 0).state, RegionState::Open, "full, but nothing asked for more room yet");
        let (placement, meta) = place_and_write(&mut r, 4);
        assert_eq!((placement.loc.device, placement.loc.region), (0, 1));
        assert_eq!(meta.len(), 1, "the full region's trailer");
        assert_eq!(meta[0].entries.as_ref().map(Vec::len), Some(2));
        assert_eq!(r.region(0, 0).state, RegionState::Sealed);
        assert_eq!(r.pending_meta_writes(), 0);
    }

    #[test]
    fn the_oldest_unpinned_sealed_region_is_reclaimed_whole() {
        let mut r = regions(1, 3, 1);
        for k in 0..3 {
            place_and_write(&mut r, k);
        }
        // Regions 0 and 1 are sealed, 2 is open and full: the next entry needs a reclaim.
        let pinned_first = |_: usize, region: u32, _: &TrailerEntry| region == 0;
        let mut meta = Vec::new();
        let placement = r.alloc(&mut meta, &pinned_first, 0, &[]).expect("region 1 is reclaimable");
        assert_eq!(placement.loc.region, 1, "region 0 is older but pinned");
        assert_eq!(placement.reclaimed.as_deref().map(|e| e[0].key), Some(key(1)));
        assert!(meta.iter().any(|m| m.region == 1 && m.entries.is_none()), "the stale trailer is zeroed");
        let everything_pinned = |_: usize, _: u32, _: &TrailerEntry| true;
        let mut more = Vec::new();
        meta.extend(r.entry_done(placement.loc, None));
        assert!(r.alloc(&mut more, &everything_pinned, 0, &[]).is_none(), "nothing free, nothing reclaimable");
        r.check();
    }

    #[test]
    fn a_failed_trailer_write_is_retried_then_seals_anyway() {
        let mut r = regions(1, 2, 1);
        let (placement, _) = place_and_write(&mut r, 0);
        let mut meta = Vec::new();
        r.alloc(&mut meta, &nothing_pinned, 0, &[]).unwrap();
        let mut write = meta.into_iter().find(|m| m.entries.is_some()).expect("region 0's trailer");
        for attempt in 1..MAX_TRAILER_ATTEMPTS {
            write = r.complete_meta(&write, false).expect("retried");
            assert_eq!(write.attempt, attempt);
        }
        assert!(r.complete_meta(&write, false).is_none(), "attempts are bounded");
        assert_eq!(r.region(0, placement.loc.region).state, RegionState::Sealed);
        assert_eq!(r.pending_meta_writes(), 0);
    }

    #[test]
    fn only_the_last_planned_entry_of_an_open_region_can_be_dropped_without_a_hole() {
        let mut r = regions(1, 2, 3);
        let mut meta = Vec::new();
        let first = r.alloc(&mut meta, &nothing_pinned, 0, &[]).unwrap().loc;
        let second = r.alloc(&mut meta, &nothing_pinned, 0, &[]).unwrap().loc;
        assert!(!r.cancel_leaves_no_hole(first));
        assert!(r.cancel_leaves_no_hole(second));
        r.rewind_if_last(second);
        let _ = r.entry_done(second, None);
        assert_eq!(r.alloc(&mut meta, &nothing_pinned, 0, &[]).unwrap().loc, second, "the next entry takes its place");
    }

    #[test]
    fn a_trimmed_region_stays_out_of_use_until_released() {
        let mut r = regions(1, 2, 1);
        let (placement, _) = place_and_write(&mut r, 0);
        place_and_write(&mut r, 1);
        let (region_seq, entries) = r.hold_trimmed(0, placement.loc.region);
        assert_eq!(entries.len(), 1);
        let mut meta = Vec::new();
        assert!(r.alloc(&mut meta, &nothing_pinned, 0, &[]).is_none(), "held, not reclaimable");
        r.release_trimmed(0, placement.loc.region, region_seq);
        assert_eq!(r.alloc(&mut meta, &nothing_pinned, 0, &[]).unwrap().loc.region, placement.loc.region);
        r.check();
    }

    #[test]
    fn a_dropped_entry_rewrites_a_sealed_trailer() {
        let mut r = regions(1, 2, 1);
        let (placement, _) = place_and_write(&mut r, 0);
        place_and_write(&mut r, 1);
        assert!(r.forget_entry(&key(9), placement.loc).is_none(), "not listed: nothing to rewrite");
        let write = r.forget_entry(&key(0), placement.loc).expect("the trailer is rewritten");
        assert_eq!(write.entries, Some(vec![]));
        assert_eq!(r.region(0, 0).state, RegionState::Sealing, "not reclaimable until it lands");
        assert!(r.complete_meta(&write, true).is_none());
        assert_eq!(r.region(0, 0).state, RegionState::Sealed);
    }

    const NO_CAP: usize = usize::MAX;

    /// The entries of account `account`'s regions still listed, by key.
    fn listed_keys(r: &Regions, account: u8) -> Vec<BlockKey> {
        let regions = &r.device(0).regions;
        regions.iter().filter(|g| g.account == account).flat_map(|g| g.entries.iter().map(|t| t.key)).collect()
    }

    #[test]
    fn a_flood_rewrites_its_own_regions_and_leaves_a_guaranteed_share_alone() {
        // Account 0 is guaranteed half of 8 regions; account 1, guaranteed none, floods.
        let quotas = [RegionQuota { guaranteed: 4, cap: NO_CAP }, RegionQuota { guaranteed: 0, cap: NO_CAP }];
        let mut split = regions(1, 8, 1);
        for k in 0..3 {
            place_and_write_for(&mut split, k, 0, &quotas);
        }
        for k in 10..40 {
            let (placement, _) = place_and_write_for(&mut split, k, 1, &quotas);
            if let Some(reclaimed) = placement.reclaimed {
                assert!(
                    reclaimed.iter().all(|t| t.key.0[0] >= 10),
                    "the flood reclaimed the quiet tenant's {reclaimed:?}"
                );
            }
        }
        assert_eq!(listed_keys(&split, 0), [key(0), key(1), key(2)], "the quiet tenant's entries stay listed");
        let by_account = split.by_account();
        assert_eq!(by_account[0], (3, 0), "3 regions held, none reclaimed");
        assert_eq!(by_account[1].0, 5, "the flood holds the rest");
        assert!(by_account[1].1 >= 20, "and rewrites its own: {by_account:?}");
        // The same writes in one log: the oldest regions go first, whoever wrote them.
        let mut log = regions(1, 8, 1);
        for k in (0..3).chain(10..40) {
            place_and_write(&mut log, k);
        }
        assert!(listed_keys(&log, 0).iter().all(|k| k.0[0] >= 10), "one log keeps only the flood's newest");
    }

    #[test]
    fn an_account_under_its_share_takes_regions_back_from_one_past_its_own() {
        let quotas = [RegionQuota { guaranteed: 4, cap: NO_CAP }, RegionQuota { guaranteed: 0, cap: NO_CAP }];
        let mut r = regions(1, 8, 1);
        for k in 10..20 {
            place_and_write_for(&mut r, k, 1, &quotas);
        }
        assert_eq!(r.by_account()[1].0, 8, "free regions go to whoever asks");
        for k in 0..4 {
            let (placement, _) = place_and_write_for(&mut r, k, 0, &quotas);
            let reclaimed = placement.reclaimed.expect("nothing is free: a region is reclaimed");
            assert!(reclaimed.iter().all(|t| t.key.0[0] >= 10), "taken from the account past its share");
        }
        assert_eq!(r.by_account()[0].0, 4);
        assert_eq!(r.by_account()[1].0, 4);
        r.check();
    }

    #[test]
    fn an_account_at_its_cap_rewrites_its_own_oldest_region_while_regions_are_free() {
        let quotas = [RegionQuota { guaranteed: 0, cap: 2 }];
        let mut r = regions(1, 8, 1);
        for k in 0..6 {
            place_and_write_for(&mut r, k, 0, &quotas);
            assert!(r.by_account()[0].0 <= 2, "past its cap of 2 regions");
        }
        assert_eq!(listed_keys(&r, 0), [key(4), key(5)], "its newest entries stay, in its own regions");
        assert_eq!(r.usage(), (2, 8), "the other regions stay free for other tenants");
        // With its own regions all pinned it takes a free one: a cap never refuses a write.
        let everything_pinned = |_: usize, _: u32, _: &TrailerEntry| true;
        let mut meta = Vec::new();
        assert!(r.alloc(&mut meta, &everything_pinned, 0, &quotas).is_some());
        r.check();
    }

    #[test]
    fn with_every_region_open_for_another_tenant_they_are_sealed_for_the_next_write() {
        let quotas = [RegionQuota { guaranteed: 0, cap: NO_CAP }; 4];
        let mut r = regions(1, 4, 1);
        for account in 0..4 {
            place_and_write_for(&mut r, account, account, &quotas);
        }
        let mut meta = Vec::new();
        assert!(r.alloc(&mut meta, &nothing_pinned, 0, &quotas).is_none(), "every region open or sealing");
        assert_eq!(meta.iter().filter(|m| m.entries.is_some()).count(), 4, "its own and the others' trailers");
        assert!(r.device(0).open.is_empty());
        for write in &meta {
            assert!(r.complete_meta(write, true).is_none());
        }
        let placement = r.alloc(&mut Vec::new(), &nothing_pinned, 0, &quotas).expect("a sealed region now");
        assert_eq!(placement.reclaimed.map(|e| e.len()), Some(1));
        r.check();
    }
}
