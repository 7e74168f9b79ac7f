//! Encrypted values: encryption at rest of the blocks kvtier writes to NVMe (issue 40; docs/format.md,
//! "Encrypted values"). KV blocks can be inverted to the prompt tokens they were computed from, so
//! whoever can read the NVMe files could read every prompt; with `encryption_key_file` set the value
//! of every block written is encrypted with AES-256-GCM.
//!
//! - **Keys.** One key per tenant, derived with HKDF-SHA256 from the key file's bytes
//!   (`info = "kvtier encrypted value v1" || tenant id`). The tenant id travels in the encryption header.
//!   A block's tenant is the one its store named (`Store::assign_tenant`, before the put): the DRAM
//!   slot's page carries it in clear at the header's tenant field (`set_page_tenant`), every copy
//!   written below DRAM is sealed under that tenant's key, and a block read back keeps it.
//! - **Nonces.** 96 random bits from the kernel per write. Writers are many processes (engines, the
//!   host service, restarts of both) with no shared counter to draw from, so a counter could repeat
//!   across them; random nonces collide with probability under 2^-32 for up to 2^32 writes per key
//!   (NIST SP 800-38D's bound), and the key's tenant split and rotation keep each key far below it.
//! - **Associated data**: the block's namespace, key, value length, plaintext checksum and tenant, so
//!   that an encrypted value moved to another block's descriptor, or its checksum swapped, does not decrypt.
//! - What stays in clear: the descriptor (block key, namespace, sequence) and the plaintext's xxh3
//!   checksum. They confirm a guessed prompt exactly as the block key (a hash of the tokens) already
//!   does; the value, which reveals the prompt without a guess, is what is encrypted.
//!
//! The encryption header sits in the descriptor page's padding, past the shared tier's block tag:
//! ```text
//! offset size field (from HEADER_AT = 256 in the descriptor page)
//!      0    4 cipher     u32 LE (1: AES-256-GCM)
//!      4   12 nonce
//!     16   16 tenant     tenant id (all zero: the default tenant)
//!     32   16 tag        GCM tag over the value
//! ```
//! An encrypted descriptor is format version 2 with flag bit 0 set (`descriptor.rs`); version 1 is a
//! value in clear, still read.

use super::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use super::{get_u32, put_u32};
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use ring::hkdf::{Prk, Salt, HKDF_SHA256};

/// Where the encryption header starts in the descriptor page: past the shared tier's block tag
/// (bytes 128..160 of a page in a shared data file), so that the two never overlap.
pub const HEADER_AT: usize = 256;
pub const HEADER_BYTES: usize = 48;
/// Where a page holds its block's tenant: in the encryption header, and in a DRAM slot's page in clear.
const TENANT_AT: usize = HEADER_AT + 16;
const CIPHER_AES_256_GCM: u32 = 1;
const NONCE_BYTES: usize = 12;
const KEY_INFO: &[u8] = b"kvtier encrypted value v1";
const AAD_CONTEXT: &[u8] = b"kvtier encrypted value v1\0";

/// A tenant's id in the encryption header (`crate::tenant`).
pub use crate::tenant::{TenantId, DEFAULT_TENANT};

/// Why an encrypted value did not decrypt: a counted miss, never served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecryptError {
    /// Sealed, and this store has no `encryption_key_file`.
    NoKey,
    /// A cipher this version does not know.
    UnknownCipher(u32),
    /// The tag does not verify: another key (another deployment, another tenant), or bytes changed.
    Refused,
}

impl std::fmt::Display for DecryptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecryptError::NoKey => write!(f, "encrypted, and no encryption_key_file is set"),
            DecryptError::UnknownCipher(id) => write!(f, "encrypted with unknown cipher {id}"),
            DecryptError::Refused => write!(f, "does not authenticate under this key (another key, or changed bytes)"),
        }
    }
}

/// Encrypts and decrypts values with the keys derived from one key file.
pub struct ValueCipher {
    prk: Prk,
    default: LessSafeKey,
}

impl ValueCipher {
    /// From the key file's bytes (at least 32 random bytes; the loader checks them).
    pub fn new(key_material: &[u8]) -> ValueCipher {
        // No salt: RFC 5869's zero-length salt (the key file is already uniformly random).
        let prk = Salt::new(HKDF_SHA256, &[]).extract(key_material);
        let default = tenant_key(&prk, &DEFAULT_TENANT);
        ValueCipher { prk, default }
    }

    fn with_key<R>(&self, tenant: &TenantId, f: impl FnOnce(&LessSafeKey) -> R) -> R {
        if *tenant == DEFAULT_TENANT {
            return f(&self.default);
        }
        f(&tenant_key(&self.prk, tenant))
    }

    /// Encrypts `value` in place under `page`'s descriptor (encoded, version 1) and marks the page
    /// encrypted. `nonce` must be fresh random bytes (`fresh_nonce`).
    pub fn encrypt(&self, page: &mut [u8], value: &mut [u8], tenant: &TenantId, nonce: [u8; NONCE_BYTES]) {
        let desc = Descriptor::decode(page).expect("the writer encoded this descriptor");
        assert_eq!(desc.value_bytes as usize, value.len(), "the descriptor describes this value");
        let aad = associated_data(&desc, tenant);
        let tag = self
            .with_key(tenant, |k| {
                k.seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(&aad), value)
            })
            .expect("a block is far below GCM's 64 GiB limit");
        let header = &mut page[HEADER_AT..HEADER_AT + HEADER_BYTES];
        put_u32(header, 0, CIPHER_AES_256_GCM);
        header[4..16].copy_from_slice(&nonce);
        header[16..32].copy_from_slice(tenant);
        header[32..48].copy_from_slice(tag.as_ref());
        Descriptor::mark_encrypted(page);
    }
}

/// Decrypts a value read from NVMe in place, if its descriptor says it is encrypted, and makes the
/// page a plain descriptor again (so the copy in memory is a block in clear, as DRAM holds them).
/// `Ok(false)`: the value was in clear; `Ok(true)`: decrypted. The page must decode.
pub fn decrypt_in_place(cipher: Option<&ValueCipher>, page: &mut [u8], value: &mut [u8]) -> Result<bool, DecryptError> {
    if !Descriptor::is_encrypted(page) {
        return Ok(false);
    }
    let cipher = cipher.ok_or(DecryptError::NoKey)?;
    let desc = Descriptor::decode(page).map_err(|_| DecryptError::Refused)?;
    if desc.value_bytes as usize != value.len() {
        return Err(DecryptError::Refused);
    }
    let header = &page[HEADER_AT..HEADER_AT + HEADER_BYTES];
    let cipher_id = get_u32(header, 0);
    if cipher_id != CIPHER_AES_256_GCM {
        return Err(DecryptError::UnknownCipher(cipher_id));
    }
    let nonce: [u8; NONCE_BYTES] = header[4..16].try_into().unwrap();
    let tenant: TenantId = header[16..32].try_into().unwrap();
    let tag = Tag::try_from(&header[32..48]).expect("16 bytes");
    let aad = associated_data(&desc, &tenant);
    let nonce = Nonce::assume_unique_for_key(nonce);
    cipher
        .with_key(&tenant, |k| k.open_in_place_separate_tag(nonce, Aad::from(&aad), tag, value, 0..).map(|_| ()))
        .map_err(|_| DecryptError::Refused)?;
    // The tenant stays: a block read back into a DRAM slot is sealed under its tenant's key again
    // when it is written below DRAM once more.
    page[HEADER_AT..TENANT_AT].fill(0);
    page[TENANT_AT + 16..HEADER_AT + HEADER_BYTES].fill(0);
    desc.encode(page);
    debug_assert_eq!(page_tenant(page), tenant, "a decrypted page keeps its tenant");
    Ok(true)
}

/// The tenant a page names (its encryption header's tenant field; all zero: the default tenant).
pub fn page_tenant(page: &[u8]) -> TenantId {
    page[TENANT_AT..TENANT_AT + 16].try_into().expect("16 bytes")
}

/// Names the tenant of the block in a DRAM slot whose page is `page` (in clear: the id is a hash
/// of the salt, no secret), so that the writers below DRAM seal it under that tenant's key.
pub fn set_page_tenant(page: &mut [u8], tenant: &TenantId) {
    page[TENANT_AT..TENANT_AT + 16].copy_from_slice(tenant);
}

/// Encrypts a slot's value (the descriptor page, then the value) in place, as `ValueCipher::encrypt`,
/// under the key of the tenant its page names (`set_page_tenant`), with a fresh nonce.
pub fn seal_slot(cipher: &ValueCipher, slot: &mut [u8], object_bytes: usize) -> std::io::Result<()> {
    let nonce = fresh_nonce()?;
    let (page, rest) = slot.split_at_mut(DESCRIPTOR_BYTES);
    let tenant = page_tenant(page);
    cipher.encrypt(page, &mut rest[..object_bytes], &tenant, nonce);
    Ok(())
}

/// Decrypts a slot read back (`decrypt_in_place` on its page and value).
pub fn open_slot(cipher: Option<&ValueCipher>, slot: &mut [u8], object_bytes: usize) -> Result<bool, DecryptError> {
    let (page, rest) = slot.split_at_mut(DESCRIPTOR_BYTES);
    decrypt_in_place(cipher, page, &mut rest[..object_bytes])
}

/// 96 random bits from the kernel for one write's nonce.
pub fn fresh_nonce() -> std::io::Result<[u8; NONCE_BYTES]> {
    let mut nonce = [0u8; NONCE_BYTES];
    let mut filled = 0;
    while filled < NONCE_BYTES {
        filled += rustix::rand::getrandom(&mut nonce[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    Ok(nonce)
}

fn tenant_key(prk: &Prk, tenant: &TenantId) -> LessSafeKey {
    let info = [KEY_INFO, tenant.as_slice()];
    let okm = prk.expand(&info, &AES_256_GCM).expect("32 bytes is a valid HKDF-SHA256 length");
    LessSafeKey::new(UnboundKey::from(okm))
}

fn associated_data(desc: &Descriptor, tenant: &TenantId) -> Vec<u8> {
    let mut aad = Vec::with_capacity(AAD_CONTEXT.len() + 32 + 32 + 4 + 8 + 16);
    aad.extend_from_slice(AAD_CONTEXT);
    aad.extend_from_slice(&desc.namespace.0);
    aad.extend_from_slice(&desc.key.0);
    aad.extend_from_slice(&desc.value_bytes.to_le_bytes());
    aad.extend_from_slice(&desc.value_checksum.to_le_bytes());
    aad.extend_from_slice(tenant);
    aad
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::checksum;
    use crate::format::descriptor::DESCRIPTOR_BYTES;
    use crate::key::{BlockKey, Namespace};

    fn block(fill: u8) -> (Vec<u8>, Vec<u8>) {
        let value: Vec<u8> = (0..8192u32).map(|i| (i as u8) ^ fill).collect();
        let desc = Descriptor {
            value_bytes: value.len() as u32,
            key: BlockKey([fill; 32]),
            namespace: Namespace([3; 32]),
            sequence: 9,
            region_seq: 2,
            value_checksum: checksum(&value),
        };
        let mut page = vec![0u8; DESCRIPTOR_BYTES];
        desc.encode(&mut page);
        (page, value)
    }

    #[test]
    fn an_encrypted_value_opens_only_under_its_key_and_descriptor() {
        let cipher = ValueCipher::new(&[7u8; 32]);
        let (mut page, mut value) = block(1);
        let plain = value.clone();
        cipher.encrypt(&mut page, &mut value, &DEFAULT_TENANT, fresh_nonce().unwrap());
        assert!(Descriptor::is_encrypted(&page) && value != plain);
        assert_eq!(
            Descriptor::decode(&page).unwrap().value_checksum,
            checksum(&plain),
            "the checksum is of the plaintext"
        );

        let other = ValueCipher::new(&[8u8; 32]);
        let (mut p, mut v) = (page.clone(), value.clone());
        assert_eq!(decrypt_in_place(Some(&other), &mut p, &mut v), Err(DecryptError::Refused), "another key");
        let (mut p, mut v) = (page.clone(), value.clone());
        assert_eq!(decrypt_in_place(None, &mut p, &mut v), Err(DecryptError::NoKey));
        let (mut p, mut v) = (page.clone(), value.clone());
        v[100] ^= 1;
        assert_eq!(decrypt_in_place(Some(&cipher), &mut p, &mut v), Err(DecryptError::Refused), "a changed byte");
        let (mut p, mut v) = (page.clone(), value.clone());
        p[HEADER_AT + 16] ^= 1;
        assert_eq!(decrypt_in_place(Some(&cipher), &mut p, &mut v), Err(DecryptError::Refused), "another tenant");

        assert_eq!(decrypt_in_place(Some(&cipher), &mut page, &mut value), Ok(true));
        assert_eq!(value, plain);
        assert!(!Descriptor::is_encrypted(&page) && page[HEADER_AT..HEADER_AT + HEADER_BYTES].iter().all(|&b| b == 0));
        assert_eq!(page_tenant(&page), DEFAULT_TENANT);
        assert_eq!(decrypt_in_place(Some(&cipher), &mut page, &mut value), Ok(false), "now in clear");
    }

    #[test]
    fn an_encrypted_value_moved_under_another_descriptor_does_not_open() {
        let cipher = ValueCipher::new(&[7u8; 32]);
        let (mut page_a, mut value_a) = block(1);
        cipher.encrypt(&mut page_a, &mut value_a, &DEFAULT_TENANT, fresh_nonce().unwrap());
        let (mut page_b, _) = block(2);
        // B's descriptor, with A's encryption header and value: the associated data differs.
        page_b[HEADER_AT..HEADER_AT + HEADER_BYTES].copy_from_slice(&page_a[HEADER_AT..HEADER_AT + HEADER_BYTES]);
        Descriptor::mark_encrypted(&mut page_b);
        assert_eq!(decrypt_in_place(Some(&cipher), &mut page_b, &mut value_a), Err(DecryptError::Refused));
    }

    #[test]
    fn tenants_have_their_own_keys_and_nonces_do_not_repeat() {
        let cipher = ValueCipher::new(&[7u8; 32]);
        let tenant = [5u8; 16];
        let (mut page, mut value) = block(1);
        let plain = value.clone();
        cipher.encrypt(&mut page, &mut value, &tenant, fresh_nonce().unwrap());
        let (mut page_default, mut value_default) = block(1);
        cipher.encrypt(&mut page_default, &mut value_default, &DEFAULT_TENANT, fresh_nonce().unwrap());
        assert_ne!(value, value_default);
        // Another tenant named in the header: its key and associated data differ.
        let (mut p, mut v) = (page.clone(), value.clone());
        set_page_tenant(&mut p, &[6u8; 16]);
        assert_eq!(decrypt_in_place(Some(&cipher), &mut p, &mut v), Err(DecryptError::Refused), "another tenant");
        assert_eq!(decrypt_in_place(Some(&cipher), &mut page, &mut value), Ok(true));
        assert_eq!(value, plain);
        assert_eq!(page_tenant(&page), tenant, "a page read back keeps its tenant");
        assert!(page[HEADER_AT..HEADER_AT + HEADER_BYTES].iter().filter(|&&b| b != 0).count() <= 16);
        let mut slot = page.clone();
        slot.extend_from_slice(&value);
        seal_slot(&cipher, &mut slot, value.len()).unwrap();
        assert_eq!(page_tenant(&slot), tenant, "sealed again under the tenant its page names");
        let (p, v) = slot.split_at_mut(DESCRIPTOR_BYTES);
        assert_eq!(decrypt_in_place(Some(&cipher), p, v), Ok(true));
        assert_eq!(v, &plain[..]);
        let nonces: std::collections::HashSet<_> = (0..1000).map(|_| fresh_nonce().unwrap()).collect();
        assert_eq!(nonces.len(), 1000);
    }
}
