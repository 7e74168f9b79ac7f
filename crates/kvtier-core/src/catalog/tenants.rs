//! The DRAM pool's tenants (`crate::tenant`): each has an account of the slots it holds and its own
//! eviction policy, so S3-FIFO orders a tenant's blocks among themselves exactly as it orders a
//! pool of one tenant.
//!
//! With shares set, a victim is taken from, in order: the tenant asking for room if it holds its
//! guaranteed share already (past it, a tenant evicts its own blocks first); the tenants past their
//! shares, the furthest past first; the tenant asking; the rest, the largest first. A tenant under
//! its share therefore loses blocks to nobody while another tenant is past its own, and free slots
//! go to whoever asks (a share is a floor, not a ceiling). The last step only runs when no tenant is
//! past its share and nothing of the asker's can go: shares that add up to the whole pool, with
//! blocks held by fills, loads and writes. Choosing is O(tenants), at most `MAX_TENANTS`.
//!
//! A cap (`TenantShares::max_share`) is the ceiling: a tenant holding its cap makes room from its own
//! blocks even while slots are free (`past_cap`, `own_victim`; the catalog asks before it takes a
//! free slot). When none of its blocks may go it is served as above: a cap never makes a store wait.
//!
//! Without shares or a cap every block is in account 0 and the pool behaves as it always did.

use super::regions::RegionQuota;
use crate::key::BlockKey;
use crate::tenant::{eviction_order, tenant_label, TenantId, TenantShares, DEFAULT_TENANT};
use crate::tiers::eviction::EvictionPolicy;
use std::collections::{HashMap, VecDeque};

/// Tenants the pool keeps accounts for; blocks of any tenant past them go to the default tenant's
/// account (counted in `untracked_tenant_blocks`).
pub const MAX_TENANTS: usize = 64;
const UNLISTED: u8 = u8::MAX;

/// Makes one eviction policy for a pool of this many slots (one per tenant account).
pub type PolicyFactory = Box<dyn Fn(usize) -> Box<dyn EvictionPolicy> + Send>;

struct Account {
    id: TenantId,
    guaranteed_slots: usize,
    /// The most slots it holds before it evicts its own blocks (`usize::MAX`: no cap).
    cap_slots: usize,
    resident_slots: usize,
    evicted_blocks: u64,
    policy: Box<dyn EvictionPolicy>,
}

/// One tenant's part of the pool, for `kvtier status` and the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantGauge {
    /// `tenant_label`: the id's first bytes in hex, never the salt.
    pub label: String,
    pub guaranteed_slots: u64,
    /// The most it holds (`tenant_dram_max_share`); None: no cap.
    pub cap_slots: Option<u64>,
    pub resident_slots: u64,
    pub evicted_blocks: u64,
    /// Its part of the NVMe tier when that is split by tenant (`tenant_shares_nvme`).
    pub nvme: Option<NvmeTenantGauge>,
}

/// One tenant's part of the NVMe tier (`regions.rs`), over every device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeTenantGauge {
    /// Bytes of the regions in use that take its blocks (open, sealing or sealed).
    pub bytes: u64,
    /// Its regions reclaimed to make room, its own or another tenant's blocks' (the oldest first).
    pub reclaimed_regions: u64,
}

pub(super) struct Tenants {
    accounts: Vec<Account>,
    /// The account whose policy lists each slot (`UNLISTED`: none lists it).
    listed_in: Vec<u8>,
    shares: TenantShares,
    make_policy: PolicyFactory,
    pub(super) untracked_blocks: u64,
}

impl Tenants {
    pub(super) fn new(slot_count: usize, make_policy: PolicyFactory, shares: TenantShares) -> Self {
        assert!(slot_count < u32::MAX as usize);
        let mut tenants = Tenants {
            accounts: Vec::new(),
            listed_in: vec![UNLISTED; slot_count],
            shares,
            make_policy,
            untracked_blocks: 0,
        };
        tenants.open_account(DEFAULT_TENANT);
        tenants
    }

    fn open_account(&mut self, id: TenantId) -> u8 {
        let slots = self.listed_in.len();
        let guaranteed_slots = (self.shares.share_of(&id) * slots as f64) as usize;
        let policy = (self.make_policy)(slots);
        let cap_slots = self.shares.cap_slots(slots);
        assert!(cap_slots >= guaranteed_slots, "a cap under a guarantee is refused by the config");
        debug_assert!(self.accounts.len() < MAX_TENANTS, "an account past MAX_TENANTS");
        self.accounts.push(Account { id, guaranteed_slots, cap_slots, resident_slots: 0, evicted_blocks: 0, policy });
        let guaranteed: usize = self.accounts.iter().map(|a| a.guaranteed_slots).sum();
        if guaranteed > slots && guaranteed - guaranteed_slots <= slots {
            log::warn!(
                "kvtier: {} tenants are guaranteed {guaranteed} of the DRAM pool's {slots} slots: past the whole \
                 pool, a tenant under its share may lose blocks to another under its own (lower \
                 tenant_dram_share, or name the tenants' shares in tenant_dram_shares)",
                self.accounts.len()
            );
        }
        (self.accounts.len() - 1) as u8
    }

    /// Sets the shares of a pool that holds nothing yet.
    pub(super) fn set_shares(&mut self, shares: TenantShares) {
        assert!(self.accounts.len() == 1 && self.accounts[0].resident_slots == 0, "shares set on a used pool");
        let slots = self.listed_in.len();
        self.accounts[0].guaranteed_slots = (shares.share_of(&DEFAULT_TENANT) * slots as f64) as usize;
        self.accounts[0].cap_slots = shares.cap_slots(slots);
        self.shares = shares;
    }

    pub(super) fn enabled(&self) -> bool {
        self.shares.enabled()
    }

    /// The account of tenant `id`, opened on first sight; the default tenant's when shares are off
    /// or `MAX_TENANTS` are open.
    pub(super) fn account_for(&mut self, id: &TenantId) -> u8 {
        if !self.enabled() {
            return 0;
        }
        if let Some(at) = self.accounts.iter().position(|a| a.id == *id) {
            return at as u8;
        }
        if self.accounts.len() >= MAX_TENANTS {
            self.untracked_blocks += 1;
            return 0;
        }
        self.open_account(*id)
    }

    /// `slot` holds a resident block of `account`'s, a newcomer to its policy.
    pub(super) fn insert(&mut self, slot: u32, account: u8, key_hash: u64) {
        self.remove(slot);
        debug_assert!(self.lister(slot).is_none(), "slot {slot} listed twice");
        let a = &mut self.accounts[account as usize];
        a.policy.insert(slot, key_hash);
        a.resident_slots += 1;
        debug_assert!(a.resident_slots <= self.listed_in.len(), "more resident slots than the pool has");
        self.listed_in[slot as usize] = account;
    }

    pub(super) fn touch(&mut self, slot: u32) {
        if let Some(a) = self.lister(slot) {
            self.accounts[a].policy.touch(slot);
        }
    }

    /// The slot left its account's policy (emptied, or moved to another account).
    pub(super) fn remove(&mut self, slot: u32) {
        if let Some(a) = self.lister(slot) {
            let account = &mut self.accounts[a];
            account.policy.remove(slot);
            assert!(account.resident_slots > 0, "slot {slot} listed in an account that counts none");
            account.resident_slots -= 1;
            self.listed_in[slot as usize] = UNLISTED;
        }
    }

    fn lister(&self, slot: u32) -> Option<usize> {
        let a = self.listed_in[slot as usize];
        (a != UNLISTED).then_some(a as usize)
    }

    /// A victim for `asker`'s block among the slots `evictable` lets go (see the module's order),
    /// taken out of its account.
    pub(super) fn victim(&mut self, asker: u8, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let order = if self.enabled() { self.eviction_order(asker as usize) } else { vec![0] };
        order.into_iter().find_map(|a| self.take_victim(a, evictable))
    }

    /// Whether `asker`, with `in_flight` more slots filling or loading, holds its cap: its new
    /// blocks take the room of its own (`own_victim`).
    pub(super) fn past_cap(&self, asker: u8, in_flight: usize) -> bool {
        let account = &self.accounts[asker as usize];
        account.resident_slots + in_flight >= account.cap_slots
    }

    /// A victim among `asker`'s own slots only, taken out of its account.
    pub(super) fn own_victim(&mut self, asker: u8, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.take_victim(asker as usize, evictable)
    }

    fn take_victim(&mut self, a: usize, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let slot = self.accounts[a].policy.victim(evictable)?;
        debug_assert_eq!(self.listed_in[slot as usize] as usize, a, "victim {slot} of an account it is not in");
        let account = &mut self.accounts[a];
        assert!(account.resident_slots > 0, "a victim from an account that counts no slot");
        account.resident_slots -= 1;
        account.evicted_blocks += 1;
        self.listed_in[slot as usize] = UNLISTED;
        Some(slot)
    }

    fn eviction_order(&self, asker: usize) -> Vec<usize> {
        let held: Vec<usize> = self.accounts.iter().map(|a| a.resident_slots).collect();
        let guaranteed: Vec<usize> = self.accounts.iter().map(|a| a.guaranteed_slots).collect();
        eviction_order(asker, &held, &guaranteed)
    }

    /// Each account's part of an NVMe device of `regions` regions, in account order (the same
    /// shares and cap as the pool's); empty when the pool is not split.
    pub(super) fn region_quotas(&self, regions: usize) -> Vec<RegionQuota> {
        if !self.enabled() {
            return Vec::new();
        }
        let quota = |a: &Account| RegionQuota {
            guaranteed: (self.shares.share_of(&a.id) * regions as f64) as usize,
            cap: self.shares.cap_slots(regions),
        };
        self.accounts.iter().map(quota).collect()
    }

    pub(super) fn gauges(&self) -> Vec<TenantGauge> {
        self.accounts
            .iter()
            .map(|a| TenantGauge {
                label: tenant_label(&a.id),
                guaranteed_slots: a.guaranteed_slots as u64,
                cap_slots: (a.cap_slots != usize::MAX).then_some(a.cap_slots as u64),
                resident_slots: a.resident_slots as u64,
                evicted_blocks: a.evicted_blocks,
                nvme: None,
            })
            .collect()
    }

    /// Every listed slot is counted in exactly its account (tests and debug builds).
    pub(super) fn check(&self) {
        let mut listed = vec![0usize; self.accounts.len()];
        for &a in self.listed_in.iter().filter(|&&a| a != UNLISTED) {
            listed[a as usize] += 1;
        }
        for (a, account) in self.accounts.iter().enumerate() {
            assert_eq!(account.resident_slots, listed[a], "tenant account {a} miscounts its slots");
        }
    }
}

/// Tenants named for blocks that are not in DRAM yet: the engine's scheduler names a request's
/// tenant when it plans the store (or the load), before the worker's put (or the read) claims a
/// slot. At most `MAX_HINTS`, the oldest forgotten first (a block stored by no one after all).
#[derive(Default)]
pub(super) struct TenantHints {
    /// The account a named block is charged to, and its tenant.
    named: HashMap<BlockKey, (u8, TenantId)>,
    order: VecDeque<BlockKey>,
}

const MAX_HINTS: usize = 1 << 16;

impl TenantHints {
    pub(super) fn name(&mut self, key: BlockKey, account: u8, tenant: TenantId) {
        if self.named.insert(key, (account, tenant)).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > MAX_HINTS {
            let oldest = self.order.pop_front().expect("order is longer than the bound");
            self.named.remove(&oldest);
        }
        debug_assert!(self.order.len() <= MAX_HINTS && self.named.len() <= self.order.len());
    }

    /// The account `key`'s block is charged to when it claims a slot (the default tenant's unless named).
    pub(super) fn account_of(&self, key: &BlockKey) -> u8 {
        self.named(key).0
    }

    /// The account and tenant `key`'s block is stored for (the default tenant's unless named).
    pub(super) fn named(&self, key: &BlockKey) -> (u8, TenantId) {
        self.named.get(key).copied().unwrap_or((0, DEFAULT_TENANT))
    }

    /// The block claimed its slot: its hint is spent (its key stays in `order` until it comes
    /// round, where removing an absent key is harmless).
    pub(super) fn take(&mut self, key: &BlockKey) {
        if self.named.is_empty() {
            return;
        }
        self.named.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::tenant_id;
    use crate::tiers::eviction::S3Fifo;

    fn tenants(slots: usize, default_share: f64) -> Tenants {
        let shares = TenantShares { default_share, named: vec![], max_share: None };
        Tenants::new(slots, Box::new(|n| Box::new(S3Fifo::new(n))), shares)
    }

    /// Fills `slots` with `account`'s blocks.
    fn fill(t: &mut Tenants, account: u8, slots: std::ops::Range<u32>) {
        for slot in slots {
            t.insert(slot, account, slot as u64);
        }
    }

    #[test]
    fn a_tenant_under_its_share_takes_room_from_the_one_past_it() {
        let mut t = tenants(10, 0.5);
        let (quiet, flood) = (t.account_for(&tenant_id(b"quiet")), t.account_for(&tenant_id(b"flood")));
        fill(&mut t, quiet, 0..3);
        fill(&mut t, flood, 3..10);
        let victim = t.victim(quiet, &mut |_| true).unwrap();
        assert!(victim >= 3, "the quiet tenant (3 of its 5) evicted its own slot {victim}");
        t.insert(victim, quiet, 99);
        // The flooder, past its share, evicts its own blocks, never the quiet tenant's.
        for _ in 0..20 {
            let victim = t.victim(flood, &mut |_| true).unwrap();
            assert!(victim >= 3, "the flooder took the quiet tenant's slot {victim}");
            t.insert(victim, flood, 100);
        }
        t.check();
        let gauges = t.gauges();
        assert_eq!((gauges[1].resident_slots, gauges[2].resident_slots), (4, 6));
    }

    #[test]
    fn without_shares_every_tenant_is_one_account() {
        let mut t = tenants(4, 0.0);
        assert_eq!(t.account_for(&tenant_id(b"a")), 0);
        fill(&mut t, 0, 0..4);
        assert!(t.victim(0, &mut |_| true).is_some());
        assert_eq!(t.gauges().len(), 1);
        t.check();
    }

    #[test]
    fn past_the_tracked_tenants_blocks_go_to_the_default_account() {
        let mut t = tenants(4, 0.01);
        for i in 1..MAX_TENANTS {
            assert_eq!(t.account_for(&tenant_id(&i.to_le_bytes())) as usize, i);
        }
        assert_eq!(t.account_for(&tenant_id(b"one more")), 0);
        assert_eq!(t.untracked_blocks, 1);
    }

    #[test]
    fn an_unevictable_tenant_falls_through_to_the_next() {
        let mut t = tenants(4, 0.5);
        let (a, b) = (t.account_for(&tenant_id(b"a")), t.account_for(&tenant_id(b"b")));
        fill(&mut t, a, 0..3);
        fill(&mut t, b, 3..4);
        // a is past its share, but its blocks are all pinned: b's own block goes.
        assert_eq!(t.victim(b, &mut |slot| slot >= 3), Some(3));
        assert_eq!(t.victim(b, &mut |slot| slot >= 3), None);
        t.remove(0);
        t.check();
    }
}

#[cfg(test)]
mod catalog_tests {
    use crate::catalog::test_support::{dram_catalog, key, put};
    use crate::key::BlockKey;
    use crate::tenant::{tenant_id, TenantShares};

    fn keyed(tenant: u8, i: u8) -> BlockKey {
        let mut k = key(i);
        k.0[1] = tenant;
        k
    }

    #[test]
    fn a_flooding_tenant_leaves_the_other_its_share_of_the_pool() {
        let mut cat = dram_catalog(8);
        cat.set_tenant_shares(TenantShares { default_share: 0.5, named: vec![], max_share: None });
        let (quiet, flood) = (tenant_id(b"quiet"), tenant_id(b"flood"));
        let quiet_keys: Vec<BlockKey> = (0..4).map(|i| keyed(1, i)).collect();
        cat.assign_tenant(&quiet_keys, &quiet);
        for k in &quiet_keys {
            put(&mut cat, *k);
        }
        for i in 0..100 {
            let k = keyed(2, i);
            cat.assign_tenant(&[k], &flood);
            put(&mut cat, k);
        }
        assert!(quiet_keys.iter().all(|k| cat.contains(k)), "the flood evicted the quiet tenant's blocks");
        let (gauges, _) = cat.tenant_gauges();
        assert_eq!(gauges.iter().map(|g| g.resident_slots).collect::<Vec<_>>(), vec![0, 4, 4]);
        cat.check_invariants();
    }

    #[test]
    fn without_shares_the_flood_evicts_everyone() {
        let mut cat = dram_catalog(8);
        let quiet_keys: Vec<BlockKey> = (0..4).map(|i| keyed(1, i)).collect();
        cat.assign_tenant(&quiet_keys, &tenant_id(b"quiet"));
        for k in &quiet_keys {
            put(&mut cat, *k);
        }
        for i in 0..100 {
            put(&mut cat, keyed(2, i));
        }
        assert!(quiet_keys.iter().all(|k| !cat.contains(k)));
    }

    #[test]
    fn a_tenant_at_its_cap_evicts_its_own_blocks_while_slots_are_free() {
        let mut cat = dram_catalog(8);
        cat.set_tenant_shares(TenantShares { default_share: 0.0, named: vec![], max_share: Some(0.25) });
        let (flood, quiet) = (tenant_id(b"flood"), tenant_id(b"quiet"));
        for i in 0..20 {
            let k = keyed(2, i);
            cat.assign_tenant(&[k], &flood);
            put(&mut cat, k);
        }
        let resident =
            |cat: &crate::catalog::Catalog| cat.tenant_gauges().0.iter().map(|g| g.resident_slots).collect::<Vec<_>>();
        assert_eq!(resident(&cat), vec![0, 2], "the flood holds its cap, 2 of 8 slots, and no more");
        assert!((18..20).all(|i| cat.contains(&keyed(2, i))), "its newest blocks stay");
        let quiet_keys: Vec<BlockKey> = (0..2).map(|i| keyed(1, i)).collect();
        cat.assign_tenant(&quiet_keys, &quiet);
        for k in &quiet_keys {
            put(&mut cat, *k);
        }
        assert_eq!(resident(&cat), vec![0, 2, 2], "the other tenant took free slots, not the flood's");
        cat.check_invariants();
    }

    #[test]
    fn a_tenant_at_its_cap_with_nothing_to_let_go_still_gets_a_slot() {
        let mut cat = dram_catalog(8);
        cat.set_tenant_shares(TenantShares { default_share: 0.0, named: vec![], max_share: Some(0.25) });
        let keys: Vec<BlockKey> = (0..3).map(|i| keyed(2, i)).collect();
        cat.assign_tenant(&keys, &tenant_id(b"flood"));
        put(&mut cat, keys[0]);
        put(&mut cat, keys[1]);
        assert_eq!(cat.pin_prefix(&keys[..2]), 2);
        put(&mut cat, keys[2]);
        assert!(keys.iter().all(|k| cat.contains(k)), "pinned blocks stayed and the store was not refused");
        cat.check_invariants();
    }

    #[test]
    fn a_put_carries_the_tenant_named_for_it_when_the_catalog_names_tenants() {
        use crate::catalog::PutStep;
        use crate::tenant::DEFAULT_TENANT;
        let put_tenant = |cat: &mut crate::catalog::Catalog, k: BlockKey| match cat.plan_put(&k) {
            PutStep::Fill { tenant, .. } => tenant,
            step => panic!("{k:?}: {step:?}"),
        };
        let team_a = tenant_id(b"team-a");
        let mut cat = dram_catalog(4);
        cat.assign_tenant(&[keyed(1, 0)], &team_a);
        assert_eq!(put_tenant(&mut cat, keyed(1, 0)), DEFAULT_TENANT, "neither split nor naming: not remembered");
        cat.name_tenants();
        assert!(cat.tracks_tenants());
        cat.assign_tenant(&[keyed(1, 1)], &team_a);
        assert_eq!(put_tenant(&mut cat, keyed(1, 1)), team_a);
        assert_eq!(put_tenant(&mut cat, keyed(1, 2)), DEFAULT_TENANT, "unnamed");
        let (gauges, _) = cat.tenant_gauges();
        assert_eq!(gauges.len(), 1, "naming alone opens no account: the pool is not split");
    }

    #[test]
    fn a_resident_block_named_for_a_tenant_moves_to_its_account() {
        let mut cat = dram_catalog(4);
        cat.set_tenant_shares(TenantShares { default_share: 0.5, named: vec![], max_share: None });
        put(&mut cat, keyed(1, 0));
        cat.assign_tenant(&[keyed(1, 0)], &tenant_id(b"late"));
        let (gauges, _) = cat.tenant_gauges();
        assert_eq!((gauges[0].resident_slots, gauges[1].resident_slots), (0, 1));
        cat.check_invariants();
    }
}
