//! The DRAM pool's slots (`Slots`): what each slot holds and in which state, the free list, and the
//! eviction policy that picks victims among resident slots. Which block a slot serves is the index's
//! business (`Entry::dram`); the catalog keeps the two pointing at each other, and decides which
//! blocks may lose their slot (`Slots::evict` asks it).

use super::tenants::{PolicyFactory, TenantGauge, Tenants, MAX_TENANTS};
use crate::key::BlockKey;
use crate::tenant::{TenantId, TenantShares};
use crate::tiers::dram::ResidentMarks;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    Filling,
    Loading,
    Resident,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    pub(super) key: Option<BlockKey>,
    pub(super) state: SlotState,
    /// An NVMe write reads the slot, or waits in a device queue to: the slot is no victim.
    pub(super) writing: bool,
    /// The tenant account (`tenants.rs`) the block is charged to once resident.
    pub(super) account: u8,
    /// A scrub found the resident copy bad while a reader still copies out of it: the slot stays
    /// until eviction takes it, never served again, and not marked resident (`ResidentMarks`).
    pub(super) quarantined: bool,
}

impl Slot {
    const EMPTY: Slot = Slot { key: None, state: SlotState::Free, writing: false, account: 0, quarantined: false };

    /// What the slot's resident mark says: a whole block its catalog serves.
    fn marked(&self) -> bool {
        self.state == SlotState::Resident && !self.quarantined
    }

    /// A fill or a read under way for a block: its tenant's slot, not yet in its eviction policy.
    fn in_flight(&self) -> bool {
        self.key.is_some() && matches!(self.state, SlotState::Filling | SlotState::Loading)
    }
}

pub(super) struct Slots {
    slots: Vec<Slot>,
    /// Free slots, the last freed on top. A slot emptied for its caller (a victim, a stolen write's
    /// slot) is reused at once and never listed.
    free: Vec<u32>,
    /// The eviction policies, one per tenant account. They know the resident slots only: a slot
    /// enters its account's when its block becomes visible and leaves it when emptied.
    tenants: Tenants,
    /// Slots in flight (`Slot::in_flight`) per tenant account: with its resident ones, what a cap
    /// counts, so that a batch of fills cannot pass it before any of them lands.
    in_flight: Vec<u32>,
    /// A shared pool's resident marks, kept equal to `Slot::marked` (what a service that takes the
    /// pool over after this one's death may keep).
    marks: Option<ResidentMarks>,
}

/// The hash an eviction policy remembers a block by (S3-FIFO's ghost queue): keys are content
/// hashes already, so their first bytes do.
fn key_hash(key: &BlockKey) -> u64 {
    u64::from_le_bytes(key.0[..8].try_into().unwrap())
}

impl Slots {
    pub(super) fn new(count: usize, make_policy: PolicyFactory) -> Self {
        let tenants = Tenants::new(count, make_policy, TenantShares::default());
        let free = (0..count as u32).rev().collect();
        Slots { slots: vec![Slot::EMPTY; count], free, tenants, in_flight: vec![0; MAX_TENANTS], marks: None }
    }

    /// Keeps `marks` from now on (every slot is marked as it is now).
    pub(super) fn set_resident_marks(&mut self, marks: ResidentMarks) {
        for slot in 0..self.slots.len() as u32 {
            marks.set(slot, self.slots[slot as usize].marked());
        }
        self.marks = Some(marks);
    }

    /// Takes `taken` off the free list: slots claimed by number (`Catalog::keep_pool_blocks`), in use.
    pub(super) fn unlist(&mut self, taken: &[u32]) {
        let mut unlisted = vec![false; self.slots.len()];
        for &slot in taken {
            assert_ne!(self.slots[slot as usize].state, SlotState::Free, "slot {slot} unlisted while free");
            unlisted[slot as usize] = true;
        }
        self.free.retain(|&slot| !unlisted[slot as usize]);
    }

    /// Changes `slot`, keeping the in-flight counts and its resident mark.
    fn update(&mut self, slot: u32, change: impl FnOnce(&mut Slot)) {
        let Slots { slots, in_flight, marks, .. } = self;
        let s = &mut slots[slot as usize];
        if s.in_flight() {
            assert!(in_flight[s.account as usize] > 0, "slot {slot} in flight but its account counts none");
            in_flight[s.account as usize] -= 1;
        }
        change(s);
        if s.in_flight() {
            in_flight[s.account as usize] += 1;
        }
        if let Some(marks) = marks {
            marks.set(slot, s.marked());
        }
    }

    /// Splits the pool, still empty, by tenant (`Tenants::set_shares`).
    pub(super) fn set_tenant_shares(&mut self, shares: TenantShares) {
        self.tenants.set_shares(shares);
    }

    /// The account of tenant `id` (`Tenants::account_for`).
    pub(super) fn account_for(&mut self, id: &TenantId) -> u8 {
        self.tenants.account_for(id)
    }

    pub(super) fn tenancy_enabled(&self) -> bool {
        self.tenants.enabled()
    }

    /// The block in `slot` is charged to `account` from now on (moved there if resident).
    pub(super) fn charge(&mut self, slot: u32, account: u8, key: &BlockKey) {
        if self.slots[slot as usize].account == account {
            return;
        }
        debug_assert!((account as usize) < MAX_TENANTS, "account {account} past MAX_TENANTS");
        self.update(slot, |s| s.account = account);
        assert_eq!(self.slots[slot as usize].account, account);
        if self.slots[slot as usize].state == SlotState::Resident {
            self.tenants.insert(slot, account, key_hash(key));
            self.tenants.touch(slot);
        }
    }

    /// Each tenant account's part of an NVMe device of `regions` regions (`Tenants::region_quotas`).
    pub(super) fn region_quotas(&self, regions: usize) -> Vec<super::regions::RegionQuota> {
        self.tenants.region_quotas(regions)
    }

    pub(super) fn tenant_gauges(&self) -> (Vec<TenantGauge>, u64) {
        (self.tenants.gauges(), self.tenants.untracked_blocks)
    }

    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    pub(super) fn get(&self, slot: u32) -> Slot {
        self.slots[slot as usize]
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter()
    }

    /// The free list, for checks.
    #[cfg(test)]
    pub(super) fn free_list(&self) -> &[u32] {
        &self.free
    }

    pub(super) fn resident_count(&self) -> usize {
        self.slots.iter().filter(|s| s.state == SlotState::Resident).count()
    }

    pub(super) fn take_free(&mut self) -> Option<u32> {
        let slot = self.free.pop()?;
        debug_assert_eq!(self.slots[slot as usize].state, SlotState::Free, "listed slot {slot} is in use");
        Some(slot)
    }

    /// Whether tenant account `asker` holds its cap with its resident and in-flight slots
    /// (`Tenants::past_cap`).
    pub(super) fn past_cap(&self, asker: u8) -> bool {
        self.tenants.past_cap(asker, self.in_flight[asker as usize] as usize)
    }

    /// The victim (`Tenants::victim`, for a block of `asker`'s; `own_only`: among `asker`'s own
    /// blocks) among the resident slots no NVMe write reads and whose key `may_evict` lets go, emptied
    /// for the caller: `(slot, the key it held)`.
    pub(super) fn evict(
        &mut self,
        asker: u8,
        own_only: bool,
        mut may_evict: impl FnMut(Option<BlockKey>) -> bool,
    ) -> Option<(u32, Option<BlockKey>)> {
        let Slots { slots, tenants, .. } = self;
        let mut evictable = |slot: u32| {
            let s = &slots[slot as usize];
            s.state == SlotState::Resident && !s.writing && may_evict(s.key)
        };
        let victim =
            if own_only { tenants.own_victim(asker, &mut evictable) } else { tenants.victim(asker, &mut evictable) }?;
        let s = &self.slots[victim as usize];
        debug_assert!(s.state == SlotState::Resident && !s.writing, "victim {victim} is not evictable");
        let key = s.key;
        self.update(victim, |s| *s = Slot { account: s.account, ..Slot::EMPTY });
        Some((victim, key))
    }

    /// Hands an empty slot (free, a victim, a stolen write's) to `key` for a fill or a load, charged
    /// to tenant `account`.
    pub(super) fn claim(&mut self, slot: u32, key: BlockKey, state: SlotState, account: u8) {
        assert_eq!(self.slots[slot as usize].state, SlotState::Free, "slot {slot} claimed while in use");
        assert!(matches!(state, SlotState::Filling | SlotState::Loading), "slot {slot} claimed as {state:?}");
        self.update(slot, |s| *s = Slot { key: Some(key), state, account, ..Slot::EMPTY });
        debug_assert!(self.slots[slot as usize].in_flight());
    }

    /// A put filled the slot: resident, and a newcomer to the eviction policy.
    pub(super) fn admit(&mut self, slot: u32, key: &BlockKey) {
        let s = self.slots[slot as usize];
        debug_assert!(s.in_flight(), "slot {slot} admitted from {:?}", s.state);
        debug_assert_eq!(s.key, Some(*key), "slot {slot} admitted for another key");
        self.update(slot, |s| s.state = SlotState::Resident);
        self.tenants.insert(slot, self.slots[slot as usize].account, key_hash(key));
    }

    /// A block read up from NVMe or the shared tier is resident, and enters the eviction policy as
    /// one already used once: it was read because it was hit. As a newcomer (S3-FIFO's small queue)
    /// it would be the first victim of the next promotion, so a prefetch of a long prefix would evict
    /// its own earlier blocks before the load that follows could copy them (each block read twice).
    pub(super) fn promote(&mut self, slot: u32, key: &BlockKey) {
        self.admit(slot, key);
        self.tenants.touch(slot);
    }

    /// A scrub found the resident block in `slot` bad while a reader still copies out of it: it
    /// stays until eviction takes it, unmarked.
    pub(super) fn quarantine(&mut self, slot: u32) {
        assert_eq!(self.slots[slot as usize].state, SlotState::Resident, "slot {slot} quarantined while not resident");
        self.update(slot, |s| s.quarantined = true);
    }

    /// The block in `slot` was hit.
    pub(super) fn touch(&mut self, slot: u32) {
        self.tenants.touch(slot);
    }

    pub(super) fn set_writing(&mut self, slot: u32, writing: bool) {
        debug_assert!(
            !writing || self.slots[slot as usize].state == SlotState::Resident,
            "an NVMe write of slot {slot} that is not resident"
        );
        self.slots[slot as usize].writing = writing;
    }

    /// Empties `slot` for its caller to reuse at once, unlisted.
    pub(super) fn take(&mut self, slot: u32) {
        self.tenants.remove(slot);
        self.update(slot, |s| *s = Slot::EMPTY);
    }

    pub(super) fn free(&mut self, slot: u32) {
        assert_ne!(self.slots[slot as usize].state, SlotState::Free, "slot {slot} freed twice");
        self.take(slot);
        self.free.push(slot);
        debug_assert!(self.free.len() <= self.slots.len(), "the free list outgrew the pool");
    }

    /// Takes a slot out of use for good: neither free nor a victim (it stays `Loading`, keyless). The
    /// kernel may still write into it (an abandoned read).
    pub(super) fn retire(&mut self, slot: u32) {
        self.tenants.remove(slot);
        self.update(slot, |s| *s = Slot { key: None, state: SlotState::Loading, ..Slot::EMPTY });
    }

    /// Frees a slot `retire`d while a read into it was still in flight, once that read finished.
    pub(super) fn free_retired(&mut self, slot: u32) {
        let s = self.slots[slot as usize];
        assert!(s.state == SlotState::Loading && s.key.is_none(), "slot {slot} was not retired");
        self.free(slot);
    }

    /// Keeps a reserved fill's slot out of use, keyless, while a hung writer may still copy into it
    /// (`free_abandoned` ends that).
    pub(super) fn abandon(&mut self, slot: u32) {
        assert_eq!(self.slots[slot as usize].state, SlotState::Filling, "slot {slot} abandoned while not filling");
        self.update(slot, |s| *s = Slot { key: None, state: SlotState::Filling, ..Slot::EMPTY });
    }

    pub(super) fn free_abandoned(&mut self, slot: u32) {
        let s = self.slots[slot as usize];
        assert!(s.state == SlotState::Filling && s.key.is_none(), "slot {slot} was not abandoned");
        self.free(slot);
    }

    /// The free list against the slots, and the tenant accounts (tests and debug builds).
    pub(super) fn check(&self) {
        self.tenants.check();
        let mut in_flight = vec![0u32; MAX_TENANTS];
        for s in self.slots.iter().filter(|s| s.in_flight()) {
            in_flight[s.account as usize] += 1;
        }
        assert_eq!(in_flight, self.in_flight, "slots in flight miscounted per tenant account");
        let mut listed = vec![false; self.slots.len()];
        for &slot in &self.free {
            assert!(!std::mem::replace(&mut listed[slot as usize], true), "slot {slot} is twice on the free list");
            assert_eq!(self.slots[slot as usize].state, SlotState::Free, "listed slot {slot} is in use");
        }
        for (slot, s) in self.slots.iter().enumerate() {
            if s.state == SlotState::Free {
                assert!(s.key.is_none() && !s.writing, "free slot {slot} still holds {:?}", s.key);
            }
            if let Some(marks) = &self.marks {
                assert_eq!(marks.get(slot as u32), s.marked(), "slot {slot}'s resident mark");
            }
            assert!(!s.quarantined || s.state == SlotState::Resident, "slot {slot} quarantined while {:?}", s.state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::test_support::key;
    use crate::tiers::eviction::Lru;

    fn pool(count: usize) -> Slots {
        Slots::new(count, Box::new(|n| Box::new(Lru::new(n))))
    }

    /// Fills every slot with a resident block (slot `i` holds key `i`).
    fn full_pool(count: usize) -> Slots {
        let mut slots = pool(count);
        for i in 0..count as u8 {
            let slot = slots.take_free().unwrap();
            slots.claim(slot, key(i), SlotState::Filling, 0);
            slots.admit(slot, &key(i));
        }
        slots
    }

    #[test]
    fn free_slots_go_lowest_first_and_freed_ones_come_back() {
        let mut slots = pool(3);
        assert_eq!((slots.take_free(), slots.take_free()), (Some(0), Some(1)));
        slots.claim(1, key(1), SlotState::Filling, 0);
        slots.free(1);
        assert_eq!(slots.take_free(), Some(1), "the last freed goes first");
        assert_eq!(slots.take_free(), Some(2));
        assert_eq!(slots.take_free(), None);
        slots.check();
    }

    #[test]
    fn a_victim_is_resident_not_being_written_and_let_go_by_its_key() {
        let mut slots = full_pool(3);
        slots.set_writing(0, true);
        let (victim, held) = slots.evict(0, false, |held| held != Some(key(1))).expect("slot 2 may go");
        assert_eq!((victim, held), (2, Some(key(2))));
        assert_eq!(slots.get(2).state, SlotState::Free);
        assert!(slots.free_list().is_empty(), "a victim is the caller's, not listed");
        assert!(slots.evict(0, false, |held| held != Some(key(1))).is_none(), "slot 0 is being written");
        slots.check();
    }

    #[test]
    fn retired_and_abandoned_slots_are_neither_free_nor_victims() {
        let mut slots = full_pool(2);
        slots.retire(0);
        let slot = slots.evict(0, false, |_| true).map(|(slot, _)| slot);
        assert_eq!(slot, Some(1));
        slots.claim(1, key(9), SlotState::Filling, 0);
        slots.abandon(1);
        assert!(slots.evict(0, false, |_| true).is_none() && slots.take_free().is_none());
        slots.free_abandoned(1);
        assert_eq!(slots.take_free(), Some(1));
        slots.check();
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn a_slot_freed_twice_panics() {
        let mut slots = pool(1);
        slots.free(0);
    }

    #[test]
    #[should_panic(expected = "claimed while in use")]
    fn a_slot_in_use_cannot_be_claimed() {
        let mut slots = full_pool(1);
        slots.claim(0, key(5), SlotState::Loading, 0);
    }
}
