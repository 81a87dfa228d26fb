//! A cache key: its text (checked by api::args::key), its SHA-256 digest, which is the
//! primary key of once.entries, and, in the digest's first 8 bytes, the tag that
//! shared-memory waiter slots hold. Used by every layer.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::prelude::*;
use sha2::{Digest, Sha256};

/// A key and its SHA-256 digest (the primary key of once.entries).
pub struct Key<'a> {
    pub text: &'a str,
    hash: pg_sys::Datum,
    /// The digest's first 8 bytes: what shared-memory waiter slots hold.
    pub tag: u64,
}

impl<'a> Key<'a> {
    /// A key whose text was checked by api::args::key.
    pub fn new(text: &'a str) -> Key<'a> {
        // The same digest as once.key_hash(text) (the server's sha256), so ad-hoc lookups
        // by once.key_hash(key) find the same row.
        let digest = digest(text.as_bytes());
        Key {
            text,
            hash: digest
                .as_slice()
                .into_datum()
                .expect("a bytea of 32 bytes is never NULL"),
            tag: tag_of(&digest),
        }
    }

    /// The key text as an SPI parameter.
    pub fn text_param(&self) -> DatumWithOid<'static> {
        self.text.to_owned().into()
    }

    /// The key's digest (bytea).
    pub fn hash_datum(&self) -> pg_sys::Datum {
        self.hash
    }

    /// The key's digest bytes.
    pub fn digest(&self) -> Vec<u8> {
        // SAFETY: `hash` is an untoasted bytea built in `new`.
        unsafe { pgrx::varlena::varlena_to_byte_slice(self.hash.cast_mut_ptr()) }.to_vec()
    }

    /// The key's digest as an SPI parameter (bytea).
    pub fn hash_param(&self) -> DatumWithOid<'static> {
        // SAFETY: `hash` is a bytea varlena allocated in the current memory context, which
        // outlives every SPI call made while this Key is alive.
        unsafe { DatumWithOid::new(self.hash, pg_sys::BYTEAOID) }
    }
}

/// The SHA-256 of `bytes` in lower-case hex (what once.cached binds its keys with).
pub fn sha256_hex(bytes: &[u8]) -> String {
    digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of `bytes`, computed in the calling backend.
///
/// The server's sha256() goes through OpenSSL, which looks the algorithm up again on every
/// call (EVP_MD_fetch): about 6% of a cache hit's server time, for a digest of one or two
/// 64-byte blocks. The digest must stay bit-for-bit the server's, since once.key_hash(key)
/// finds rows by it: `src/tests/keys.rs` compares the two on keys of every length class.
fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The first 8 bytes of a key digest: what waiter slots hold. Distinct keys sharing a
/// prefix only cause a spurious wake-up, after which the waiter simply looks again.
pub fn tag_of(digest: &[u8]) -> u64 {
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(tag).max(1) // 0 means "not waiting"
}

/// The tag of anything a waiter waits for that is not a key (a queue: runtime::wait::queue_tag),
/// named by `bytes`, made as a key's is, from the SHA-256 digest: the one tag function.
pub fn tag_of_bytes(bytes: &[u8]) -> u64 {
    tag_of(&digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::digest;

    fn hex(bytes: [u8; 32]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The examples of FIPS 180-4 / NIST's SHA-256 test vectors: the empty message, one
    /// block, a message whose padding needs a second block, and a million bytes.
    #[test]
    fn standard_test_vectors() {
        assert_eq!(
            hex(digest(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(digest(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(
            hex(digest(&vec![b'a'; 1_000_000])),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
    }
}
