//! The rules for an evictor lease record (`format::shared::Lease`) that every remote tier applies
//! the same way, so that nothing anyone can write into the shared storage (a forged lease object, or
//! one from a node whose clock runs far ahead and then died) stops eviction for good.

use crate::format::shared::Lease;

/// Lease generations at or above this are forged: one per takeover, no root or bucket reaches 2^62
/// of them. Counting `ffffffffffffffff.lease` as the newest would leave no next generation to take
/// (the increment overflows) and stop eviction everywhere for good.
pub const GENERATION_LIMIT: u64 = 1 << 62;

/// The clock skew between nodes a lease's expiry may carry beyond the lease's term (ten minutes).
pub const CLOCK_SKEW_MS: u64 = 600_000;

/// Whether a listed generation can be in force: below [`GENERATION_LIMIT`].
pub fn genuine_generation(generation: u64) -> bool {
    generation < GENERATION_LIMIT
}

/// The generation in force among those listed: the highest genuine one.
pub fn generation_in_force(listed: impl IntoIterator<Item = u64>) -> Option<u64> {
    listed.into_iter().filter(|&g| genuine_generation(g)).max()
}

/// The generation a takeover (or a renewal, or a release) creates after `generation`.
///
/// # Panics
/// When `generation` is not genuine: only a generation in force is ever followed.
pub fn next_generation(generation: u64) -> u64 {
    assert!(genuine_generation(generation), "lease generation {generation:#x} is past the limit and never in force");
    generation + 1
}

/// Whether `lease` holds other evictors off at `now_ms`: not expired, and not expiring further out
/// than a holder sets it (its clock plus `lease_ms`) plus the clock skew between nodes. One further
/// out is forged, or from a clock far ahead, and would hold every evictor off for good.
pub fn holds_off(lease: &Lease, now_ms: u64, lease_ms: u64) -> bool {
    let latest_honest_ms = now_ms.saturating_add(lease_ms).saturating_add(CLOCK_SKEW_MS);
    now_ms < lease.expires_unix_ms && lease.expires_unix_ms <= latest_honest_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expiring(expires_unix_ms: u64) -> Lease {
        Lease { generation: 3, holder: 7, expires_unix_ms, renewed_unix_ms: 0 }
    }

    #[test]
    fn a_lease_holds_off_until_it_expires_unless_it_expires_too_far_out() {
        let (now, term) = (1_000_000, 10_000);
        assert!(holds_off(&expiring(now + term), now, term), "renewed just now");
        assert!(holds_off(&expiring(now + 1), now, term));
        assert!(!holds_off(&expiring(now), now, term), "expired at now");
        assert!(!holds_off(&expiring(0), now, term), "released");
        assert!(holds_off(&expiring(now + term + CLOCK_SKEW_MS), now, term), "a clock ahead within the skew");
        assert!(!holds_off(&expiring(now + term + CLOCK_SKEW_MS + 1), now, term), "further out: forged");
        assert!(holds_off(&expiring(u64::MAX), u64::MAX - 1, term), "saturates near the end of time: no overflow");
    }

    #[test]
    fn the_last_generations_are_never_in_force_nor_followed() {
        assert_eq!(generation_in_force([1, 5, u64::MAX, GENERATION_LIMIT]), Some(5));
        assert_eq!(generation_in_force([u64::MAX]), None, "only a forged one listed: none in force");
        assert_eq!(generation_in_force([]), None);
        assert_eq!(next_generation(GENERATION_LIMIT - 1), GENERATION_LIMIT);
        let past = std::panic::catch_unwind(|| next_generation(u64::MAX));
        assert!(past.is_err(), "never wraps to 0");
    }
}
