//! Tenants (issue 40): a tenant is the `cache_salt` of the requests whose blocks it stores (no salt:
//! the default tenant). Blocks of different salts never share keys, so tenancy is about who pays for
//! the room: each tenant may be guaranteed a share of the DRAM pool (`tenant_dram_share`,
//! `tenant_dram_shares`) and capped at another (`tenant_dram_max_share`); the catalog's `tenants`
//! module enforces both.
//!
//! A tenant is known by a 16-byte id hashed from its salt (`tenant_id`), never by the salt itself:
//! the id is what the wire, the counters and the metrics carry. The salt guards a tenant's prefixes
//! against timing probes by other tenants; an id cannot be turned back into it.

use sha2::{Digest, Sha256};

pub type TenantId = [u8; 16];
/// The tenant of requests with no `cache_salt`.
pub const DEFAULT_TENANT: TenantId = [0; 16];
const ID_CONTEXT: &[u8] = b"kvtier.tenant\0";

/// The id of the tenant whose requests carry `salt` (the empty salt: `DEFAULT_TENANT`).
pub fn tenant_id(salt: &[u8]) -> TenantId {
    if salt.is_empty() {
        return DEFAULT_TENANT;
    }
    let digest = Sha256::new().chain_update(ID_CONTEXT).chain_update(salt).finalize();
    digest[..16].try_into().expect("sha256 is 32 bytes")
}

/// How a tenant is named in counters, metrics and `kvtier status`: the first 8 bytes of its id, in
/// hex (`default` for the default tenant).
pub fn tenant_label(id: &TenantId) -> String {
    if *id == DEFAULT_TENANT {
        return "default".to_string();
    }
    id[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The guaranteed shares of the DRAM pool, as fractions of its slots.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantShares {
    /// Every tenant not named below (the default tenant too).
    pub default_share: f64,
    pub named: Vec<(TenantId, f64)>,
    /// The most of the pool any one tenant holds (`tenant_dram_max_share`); None: no cap.
    pub max_share: Option<f64>,
}

impl TenantShares {
    /// Whether the pool is split by tenant at all (otherwise one eviction order serves everyone).
    pub fn enabled(&self) -> bool {
        self.default_share > 0.0 || !self.named.is_empty() || self.max_share.is_some()
    }

    /// The most slots of a `slots`-slot pool one tenant holds before it evicts its own blocks.
    pub fn cap_slots(&self, slots: usize) -> usize {
        self.max_share.map_or(usize::MAX, |share| ((share * slots as f64) as usize).max(1))
    }

    pub fn share_of(&self, id: &TenantId) -> f64 {
        self.named.iter().find(|(named, _)| named == id).map_or(self.default_share, |&(_, share)| share)
    }
}

/// Parses `tenant_dram_shares`: `salt=share` pairs separated by commas (`"team-a=0.5,team-b=0.25"`),
/// each share in (0, 1], together at most 1, no salt twice. Whitespace around items is ignored.
pub fn parse_named_shares(text: &str) -> Result<Vec<(TenantId, f64)>, String> {
    let mut named: Vec<(TenantId, f64)> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|item| !item.is_empty()) {
        let Some((salt, share)) = item.rsplit_once('=') else {
            return Err(format!("{item:?} is not salt=share; write for example \"team-a=0.5\""));
        };
        let salt = salt.trim();
        if salt.is_empty() {
            return Err(format!("{item:?} names no salt; the default tenant's share is tenant_dram_share"));
        }
        let share: f64 = share.trim().parse().map_err(|_| format!("{item:?}: the share is not a number"))?;
        if !(share > 0.0 && share <= 1.0) {
            return Err(format!("{item:?}: a share is a fraction of the pool in (0, 1]"));
        }
        let id = tenant_id(salt.as_bytes());
        if named.iter().any(|(other, _)| *other == id) {
            return Err(format!("salt {salt:?} is listed twice; list each tenant once"));
        }
        named.push((id, share));
    }
    let total: f64 = named.iter().map(|(_, share)| share).sum();
    if total > 1.0 + 1e-9 {
        return Err(format!("the shares add up to {total}: guarantees past the whole pool cannot all hold"));
    }
    Ok(named)
}

/// The accounts, in the order they give up room to `asker` (the DRAM pool's and the NVMe tier's
/// order, `catalog::tenants`), from what each `held` and is `guaranteed`: the asker first if it holds
/// its guarantee, the accounts past theirs (furthest first), the asker, the rest (largest first).
/// Every account once.
pub fn eviction_order(asker: usize, held: &[usize], guaranteed: &[usize]) -> Vec<usize> {
    debug_assert!(asker < held.len(), "the asker {asker} has no account");
    let (past, rest) = past_and_rest(held, guaranteed, Some(asker));
    let mut order = Vec::with_capacity(held.len());
    if held[asker] >= guaranteed[asker] {
        order.push(asker);
        order.extend(past);
    } else {
        order.extend(past);
        order.push(asker);
    }
    order.extend(rest);
    debug_assert_eq!(order.len(), held.len(), "every account once in the eviction order");
    order
}

/// The order in which accounts give up room when nobody asks for it (a watermark's eviction, the
/// shared-filesystem tier's): the accounts past their guarantees, furthest first, then the rest,
/// largest first. Every account once.
pub fn order_to_give_up(held: &[usize], guaranteed: &[usize]) -> Vec<usize> {
    let (mut order, rest) = past_and_rest(held, guaranteed, None);
    order.extend(rest);
    debug_assert_eq!(order.len(), held.len(), "every account once in the order");
    order
}

/// The accounts other than `except` past their guarantees (furthest first), and the others (largest first).
fn past_and_rest(held: &[usize], guaranteed: &[usize], except: Option<usize>) -> (Vec<usize>, Vec<usize>) {
    assert_eq!(held.len(), guaranteed.len(), "an account without a guarantee");
    let excess = |a: usize| held[a] as i64 - guaranteed[a] as i64;
    let others = || (0..held.len()).filter(|&a| Some(a) != except);
    let mut past: Vec<usize> = others().filter(|&a| excess(a) > 0).collect();
    past.sort_by_key(|&a| std::cmp::Reverse(excess(a)));
    let mut rest: Vec<usize> = others().filter(|&a| excess(a) <= 0).collect();
    rest.sort_by_key(|&a| std::cmp::Reverse(held[a]));
    (past, rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salts_hash_to_ids_and_no_salt_is_the_default_tenant() {
        assert_eq!(tenant_id(b""), DEFAULT_TENANT);
        assert_ne!(tenant_id(b"a"), tenant_id(b"b"));
        assert_eq!(tenant_id(b"a"), tenant_id(b"a"));
        assert_eq!(tenant_label(&DEFAULT_TENANT), "default");
        assert_eq!(tenant_label(&tenant_id(b"a")).len(), 16);
    }

    #[test]
    fn accounts_give_up_room_past_their_guarantees_first_then_largest_first() {
        let (held, guaranteed) = ([5, 30, 20, 12], [10, 10, 10, 10]);
        assert_eq!(order_to_give_up(&held, &guaranteed), [1, 2, 3, 0], "20 past, 10 past, 2 past, then the rest");
        assert_eq!(eviction_order(0, &held, &guaranteed), [1, 2, 3, 0], "an asker under its guarantee comes after");
        assert_eq!(eviction_order(3, &held, &guaranteed), [3, 1, 2, 0], "an asker past its own comes first");
        assert_eq!(order_to_give_up(&[4, 9, 6], &[10, 10, 10]), [1, 2, 0], "nobody past: the largest first");
    }

    #[test]
    fn named_shares_parse_and_bad_ones_say_why() {
        let named = parse_named_shares(" team-a=0.5, b=c=0.25 ,").unwrap();
        assert_eq!(named, vec![(tenant_id(b"team-a"), 0.5), (tenant_id(b"b=c"), 0.25)]);
        assert_eq!(parse_named_shares("").unwrap(), vec![]);
        for (text, why) in [
            ("a", "not salt=share"),
            ("=0.5", "names no salt"),
            ("a=x", "not a number"),
            ("a=0", "(0, 1]"),
            ("a=0.5,a=0.1", "listed twice"),
            ("a=0.6,b=0.6", "add up to"),
        ] {
            let err = parse_named_shares(text).unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
    }
}
