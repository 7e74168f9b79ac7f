//! A remote tier split by tenant (docs/tenants.md): which files or segments its evictor takes, and
//! how its per-tenant figures name tenants. Both remote tiers keep each tenant's blocks in files or
//! segments of their own, whose names carry the tenant's tag ([`tenant_tag`]), so that every
//! process, on every node, accounts the tier by tenant from the names it already lists: a tenant
//! holds the bytes of its files. Shares and the cap are fractions of the tier's room (the level its
//! eviction brings usage back to).
//!
//! Victims, each the least recently used item (one that may go) of its account:
//! 1. a tenant past its cap gives up items until it is back at it, even when the tier is not full;
//! 2. until usage is at the target: the tenants past their shares, the furthest past first
//!    (`tenant::order_to_give_up`). While any tenant is past its share, one under its own loses
//!    nothing, even when the tenants past theirs have nothing that may go yet; when none is, the
//!    largest gives up first.
//!
//! Not split, every item is one account's with no share: plain least-recently-used order.

use crate::format::descriptor::DESCRIPTOR_BYTES;
use crate::format::encrypted::page_tenant;
use crate::tenant::{order_to_give_up, tenant_label, TenantId, TenantShares, DEFAULT_TENANT};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};

/// A tenant's tag in the names of a remote tier's files and segments: the first 4 bytes of its id.
/// None for the default tenant, and for the one id in 2^32 whose first bytes are zero (its blocks
/// count as the default tenant's on the remote tiers).
pub fn tenant_tag(id: &TenantId) -> Option<u32> {
    let tag = u32::from_be_bytes(id[..4].try_into().expect("4 bytes"));
    (tag != 0).then_some(tag)
}

/// Files or segments one writer fills at once when its tier is split by tenant (as many as the DRAM
/// pool has tenant accounts); blocks of tenants past them go to the default tenant's.
pub const MAX_OPEN_PER_WRITER: usize = 64;

/// The tag of the file or segment a DRAM slot's block goes to: its page's tenant (`set_page_tenant`,
/// named by the mover for every store) when `shares` split the tier, else None (one for all).
pub fn slot_tag(shares: &TenantShares, slot: &[u8]) -> Option<u32> {
    if !shares.enabled() {
        return None;
    }
    tenant_tag(&page_tenant(&slot[..DESCRIPTOR_BYTES]))
}

/// The items of a remote tier by tenant account (by tag; `None`: the default tenant's, or every
/// item when the tier is not split), and the victims the module comment orders.
pub struct Accounts<T> {
    split: bool,
    shares: TenantShares,
    room_bytes: u64,
    tags: Vec<Option<u32>>,
    held: Vec<usize>,
    guaranteed: Vec<usize>,
    /// The most bytes one tenant holds (`usize::MAX`: no cap).
    cap: usize,
    /// Each account's items that may go, least recently used first once `sorted`.
    candidates: Vec<VecDeque<(u64, T, u64)>>,
    sorted: bool,
}

impl<T> Accounts<T> {
    /// Empty accounts; `room_bytes`: what the shares and the cap are fractions of.
    pub fn new(shares: &TenantShares, room_bytes: u64) -> Self {
        let split = shares.enabled();
        Accounts {
            split,
            shares: shares.clone(),
            room_bytes,
            tags: Vec::new(),
            held: Vec::new(),
            guaranteed: Vec::new(),
            cap: if split { shares.cap_slots(room_bytes as usize) } else { usize::MAX },
            candidates: Vec::new(),
            sorted: true,
        }
    }

    /// Counts an item of `bytes` for the tenant `tag` names (ignored when not split); `evictable`:
    /// its last use (unix ms) and what to hand back if it is chosen, when it may go.
    pub fn add(&mut self, tag: Option<u32>, bytes: u64, evictable: Option<(u64, T)>) {
        let a = self.account(if self.split { tag } else { None });
        self.held[a] += bytes as usize;
        if let Some((last_use_unix_ms, item)) = evictable {
            self.candidates[a].push_back((last_use_unix_ms, item, bytes));
            self.sorted = false;
        }
    }

    fn account(&mut self, tag: Option<u32>) -> usize {
        if let Some(a) = self.tags.iter().position(|t| *t == tag) {
            return a;
        }
        let shares = &self.shares;
        let share = match tag {
            None if self.split => shares.share_of(&DEFAULT_TENANT),
            None => 0.0,
            Some(tag) => {
                shares.named.iter().find(|(id, _)| tenant_tag(id) == Some(tag)).map_or(shares.default_share, |s| s.1)
            }
        };
        self.tags.push(tag);
        self.held.push(0);
        self.guaranteed.push((share * self.room_bytes as f64) as usize);
        self.candidates.push(VecDeque::new());
        self.tags.len() - 1
    }

    fn sort(&mut self) {
        if !self.sorted {
            for c in &mut self.candidates {
                // Stable: items of the same last use keep the order they were added in.
                c.make_contiguous().sort_by_key(|(last_use, _, _)| *last_use);
            }
            self.sorted = true;
        }
    }

    /// Whether the tenant `tag` names holds less than its share (split by tenant; never when not).
    pub fn under_its_share(&mut self, tag: Option<u32>) -> bool {
        if !self.split {
            return false;
        }
        let a = self.account(tag);
        self.held[a] < self.guaranteed[a]
    }

    /// Whether a tenant holds more than its cap and has an item that may go.
    pub fn past_cap(&self) -> bool {
        (0..self.tags.len()).any(|a| self.held[a] > self.cap && !self.candidates[a].is_empty())
    }

    /// The items to evict (see the module comment): the caps' first, then, from `used_bytes`, until
    /// `target_bytes` is reached. Each with its account's tag.
    pub fn victims(&mut self, used_bytes: u64, target_bytes: u64) -> Vec<(T, Option<u32>)> {
        self.sort();
        let mut projected = used_bytes as usize;
        let mut taken = Vec::new();
        for a in 0..self.tags.len() {
            while self.held[a] > self.cap {
                let Some(bytes) = self.take(a, &mut taken) else { break };
                projected = projected.saturating_sub(bytes);
            }
        }
        while projected > target_bytes as usize {
            let order = order_to_give_up(&self.held, &self.guaranteed);
            let anyone_past = order.first().is_some_and(|&a| self.held[a] > self.guaranteed[a]);
            let next = order
                .into_iter()
                .filter(|&a| !anyone_past || self.held[a] > self.guaranteed[a])
                .find(|&a| !self.candidates[a].is_empty());
            let Some(a) = next else { break };
            let bytes = self.take(a, &mut taken).expect("an account with a candidate");
            projected = projected.saturating_sub(bytes);
        }
        taken
    }

    /// Takes account `a`'s least recently used candidate into `taken`; its bytes.
    fn take(&mut self, a: usize, taken: &mut Vec<(T, Option<u32>)>) -> Option<usize> {
        let (_, item, bytes) = self.candidates[a].pop_front()?;
        debug_assert!(self.held[a] >= bytes as usize, "account {a} holds less than its item");
        self.held[a] = self.held[a].saturating_sub(bytes as usize);
        taken.push((item, self.tags[a]));
        Some(bytes as usize)
    }
}

/// Names tenants by their tags: the label of a full id this process knows (the tenants it stored
/// for, the named shares), else the tag's 8 hex digits; `default` for the default tenant.
#[derive(Default)]
pub struct Labels {
    known: HashMap<u32, TenantId>,
}

/// Full ids a process remembers for its labels (a tag costs 20 bytes).
const MAX_KNOWN_TENANTS: usize = 4096;

impl Labels {
    /// Labels that know the tenants named in `shares`.
    pub fn naming(shares: &TenantShares) -> Self {
        let mut labels = Labels::default();
        for (id, _) in &shares.named {
            labels.learn(id);
        }
        labels
    }

    pub fn learn(&mut self, id: &TenantId) {
        if let Some(tag) = tenant_tag(id) {
            if self.known.len() < MAX_KNOWN_TENANTS {
                self.known.entry(tag).or_insert(*id);
            }
        }
    }

    pub fn label(&self, tag: Option<u32>) -> String {
        match tag {
            None => tenant_label(&DEFAULT_TENANT),
            Some(tag) => self.known.get(&tag).map_or_else(|| format!("{tag:08x}"), tenant_label),
        }
    }
}

/// One tenant's part of a remote tier split by tenant, for the stats and the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantFigures {
    /// `tenant_label` of its id when this process knows it, else the 8 hex digits of its tag.
    pub label: String,
    /// Bytes of its files or segments the tier's index lists.
    pub bytes: u64,
    /// Its files or segments this process evicted (as the evictor lease holder).
    pub evicted: u64,
}

/// What a remote tier split by tenant remembers of its tenants in this process: the full ids it
/// stored for or was given shares for (their labels), and the files or segments it evicted of each.
/// Only its per-tenant figures read it; eviction works from the names the tier lists.
pub struct TenantLedger {
    inner: Mutex<Ledger>,
}

#[derive(Default)]
struct Ledger {
    evicted: HashMap<Option<u32>, u64>,
    labels: Labels,
}

impl TenantLedger {
    /// A ledger that knows the tenants named in `shares` and has evicted nothing.
    pub fn new(shares: &TenantShares) -> Self {
        TenantLedger { inner: Mutex::new(Ledger { evicted: HashMap::new(), labels: Labels::naming(shares) }) }
    }

    /// Learns the full id of a slot's tenant (its descriptor page's), for the tenant's label.
    pub fn learn_slot(&self, slot: &[u8]) {
        self.inner.lock().labels.learn(&page_tenant(&slot[..DESCRIPTOR_BYTES]));
    }

    /// Counts one eviction per tag (one per file or segment this process evicted).
    pub fn count_evicted(&self, tags: impl IntoIterator<Item = Option<u32>>) {
        let mut ledger = self.inner.lock();
        for tag in tags {
            *ledger.evicted.entry(tag).or_default() += 1;
        }
    }

    /// The figures of every tenant with `bytes` in the tier or evictions, largest first.
    pub fn figures(&self, bytes: HashMap<Option<u32>, u64>) -> Vec<TenantFigures> {
        let ledger = self.inner.lock();
        figures(bytes, &ledger.evicted, &ledger.labels)
    }
}

/// The figures of every tenant with indexed bytes or evictions, largest first.
fn figures(
    mut bytes: HashMap<Option<u32>, u64>,
    evicted: &HashMap<Option<u32>, u64>,
    labels: &Labels,
) -> Vec<TenantFigures> {
    for tag in evicted.keys() {
        bytes.entry(*tag).or_default();
    }
    let mut figures: Vec<TenantFigures> = bytes
        .into_iter()
        .map(|(tag, bytes)| TenantFigures {
            label: labels.label(tag),
            bytes,
            evicted: evicted.get(&tag).copied().unwrap_or(0),
        })
        .collect();
    figures.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.label.cmp(&b.label)));
    figures
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::tenant_id;

    fn accounts(files: &[(Option<u32>, u64, u64)], shares: &TenantShares, room: u64) -> Accounts<String> {
        let mut a = Accounts::new(shares, room);
        for (i, &(tag, last_use, bytes)) in files.iter().enumerate() {
            a.add(tag, bytes, Some((last_use, format!("f{i}"))));
        }
        a
    }

    fn names(victims: &[(String, Option<u32>)]) -> Vec<&str> {
        victims.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn not_split_the_least_recently_used_go_first_whatever_their_tags() {
        let files = [(None, 30, 10), (Some(5), 10, 10), (None, 20, 10)];
        let mut a = accounts(&files, &TenantShares::default(), 100);
        assert_eq!(names(&a.victims(30, 15)), ["f1", "f2"]);
    }

    #[test]
    fn a_flood_past_its_share_gives_up_its_own_and_the_quiet_tenant_keeps_its_items() {
        let quiet = tenant_id(b"quiet");
        let shares = TenantShares { default_share: 0.1, named: vec![(quiet, 0.3)], max_share: None };
        let (q, f) = (tenant_tag(&quiet), tenant_tag(&tenant_id(b"flood")));
        // The quiet tenant's items are the least recently used of all, and within its share (30 of 100).
        let files = [(q, 1, 10), (q, 2, 10), (f, 5, 10), (f, 6, 10), (f, 7, 10), (f, 8, 10), (f, 9, 10)];
        let mut a = accounts(&files, &shares, 100);
        assert_eq!(names(&a.victims(70, 40)), ["f2", "f3", "f4"], "the flood's oldest, not the quiet tenant's");
        // The flood's items are all too young to go: the quiet tenant still loses none.
        let mut a = accounts(&files[..2], &shares, 100);
        a.add(f, 50, None);
        assert!(a.victims(70, 40).is_empty(), "nobody under its share pays for a flood's fresh files");
    }

    #[test]
    fn nobody_past_a_share_the_largest_gives_up_first() {
        let shares = TenantShares { default_share: 0.5, named: vec![], max_share: None };
        let files = [(Some(1), 1, 10), (Some(2), 2, 10), (Some(2), 3, 10)];
        let mut a = accounts(&files, &shares, 100);
        assert_eq!(names(&a.victims(90, 80)), ["f1"], "used by others too: the larger tenant's oldest");
    }

    #[test]
    fn a_tenant_past_its_cap_gives_up_items_below_the_target() {
        let shares = TenantShares { default_share: 0.0, named: vec![], max_share: Some(0.25) };
        let files = [(Some(7), 1, 10), (Some(7), 2, 10), (Some(7), 3, 10), (Some(8), 0, 10)];
        let mut a = accounts(&files, &shares, 100);
        assert!(a.past_cap());
        assert_eq!(names(&a.victims(40, 80)), ["f0"], "30 of a 25-byte cap: one item goes");
        assert!(!a.past_cap());
    }

    #[test]
    fn a_tenant_is_under_its_share_until_it_holds_it() {
        let shares = TenantShares { default_share: 0.2, named: vec![], max_share: None };
        let mut a = accounts(&[(Some(1), 1, 10), (Some(2), 2, 30)], &shares, 100);
        assert!(a.under_its_share(Some(1)) && !a.under_its_share(Some(2)), "10 and 30 of a 20-byte share");
        assert!(a.under_its_share(Some(3)) && a.under_its_share(None), "holding nothing");
        assert!(!accounts(&[], &TenantShares::default(), 100).under_its_share(None), "not split");
    }

    #[test]
    fn tags_and_labels() {
        assert_eq!(tenant_tag(&DEFAULT_TENANT), None);
        let mut zero_tag = tenant_id(b"team-a");
        zero_tag[..4].fill(0);
        assert_eq!(tenant_tag(&zero_tag), None, "counted as the default tenant's");
        let mut labels = Labels::default();
        let id = tenant_id(b"team-a");
        let tag = tenant_tag(&id).unwrap();
        assert!(tenant_label(&id).starts_with(&format!("{tag:08x}")), "a tag is the start of the label");
        assert_eq!(labels.label(Some(tag)), format!("{tag:08x}"));
        labels.learn(&id);
        assert_eq!(labels.label(Some(tag)), tenant_label(&id));
        assert_eq!(labels.label(None), "default");
    }

    #[test]
    fn a_ledger_names_the_tenants_it_stored_for_and_counts_their_evictions() {
        let (known, stranger) = (tenant_id(b"team-a"), tenant_id(b"team-b"));
        let (known_tag, stranger_tag) = (tenant_tag(&known), tenant_tag(&stranger));
        let ledger = TenantLedger::new(&TenantShares::default());
        let mut slot = vec![0u8; DESCRIPTOR_BYTES + 64];
        crate::format::encrypted::set_page_tenant(&mut slot[..DESCRIPTOR_BYTES], &known);
        ledger.learn_slot(&slot);
        ledger.count_evicted([known_tag, known_tag, None]);
        let bytes = HashMap::from([(known_tag, 10), (stranger_tag, 30)]);
        let seen: Vec<(String, u64, u64)> =
            ledger.figures(bytes).into_iter().map(|f| (f.label, f.bytes, f.evicted)).collect();
        assert_eq!(
            seen,
            vec![
                (format!("{:08x}", stranger_tag.unwrap()), 30, 0),
                (tenant_label(&known), 10, 2),
                ("default".to_string(), 0, 1),
            ],
            "largest first; a tenant known only by its tag keeps the tag; evictions without bytes still show"
        );
    }
}
