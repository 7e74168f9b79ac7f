//! The on-disk checksum is standard XXH3-64: the runtime-dispatched implementation must agree with
//! the reference one, in one shot and fed in arbitrary pieces.

use proptest::prelude::*;
use std::hash::Hasher;

proptest! {
    #[test]
    fn checksum_is_reference_xxh3(data in proptest::collection::vec(any::<u8>(), 0..20_000), cut in 0usize..20_000) {
        let reference = xxhash_rust::xxh3::xxh3_64(&data);
        prop_assert_eq!(kvtier_core::format::checksum(&data), reference);
        let cut = cut.min(data.len());
        let mut h = kvtier_core::format::checksum_hasher();
        h.write(&data[..cut]);
        h.write(&data[cut..]);
        prop_assert_eq!(h.finish(), reference);
    }
}

#[test]
fn large_values_match() {
    let data: Vec<u8> = (0..(3usize << 20) + 123).map(|i| (i * 31 % 251) as u8).collect();
    assert_eq!(kvtier_core::format::checksum(&data), xxhash_rust::xxh3::xxh3_64(&data));
}
