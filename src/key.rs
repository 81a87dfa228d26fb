//! A cache key: its text (checked by api::args::key), its SHA-256 digest, which is the
//! primary key of once.entries, and, in the digest's first 8 bytes, the tag that
//! shared-memory waiter slots hold. Used by every layer.

mod sha256;

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::prelude::*;

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
        let digest = sha256::digest(text.as_bytes());
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
    sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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
    tag_of(&sha256::digest(bytes))
}
