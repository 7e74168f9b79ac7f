//! The shared tier split by tenant (`SharedConfig::tenant_shares`, docs/tenants.md): a data file
//! holds one tenant's blocks and names the tenant's tag (`format::data_file_name`), so that the
//! index's files are the tier's accounts (`tiers::remote::tenants`, which also orders the evictor's
//! victims). The room the shares are fractions of is `low_watermark` of the capacity.

use super::format::data_file_tenant;
use super::index::Index;
use crate::tenant::TenantShares;
use crate::tiers::remote::tenants::Accounts;
use std::collections::HashMap;

/// The index's files by tenant; those accessed at or before `evictable_before_unix_ms` may go.
pub(super) fn accounts(
    index: &Index,
    shares: &TenantShares,
    room_bytes: u64,
    evictable_before_unix_ms: u64,
) -> Accounts<String> {
    let mut accounts = Accounts::new(shares, room_bytes);
    for f in index.files() {
        let evictable =
            (f.last_access_unix_ms <= evictable_before_unix_ms).then(|| (f.last_access_unix_ms, f.name.clone()));
        accounts.add(data_file_tenant(&f.name), f.file_bytes, evictable);
    }
    accounts
}

/// Bytes of indexed files per tenant tag (the split tier's gauge).
pub(super) fn bytes_by_tenant(index: &Index) -> HashMap<Option<u32>, u64> {
    let mut bytes = HashMap::new();
    for f in index.files() {
        *bytes.entry(data_file_tenant(&f.name)).or_default() += f.file_bytes;
    }
    bytes
}
