//! A cache key: its text, checked against the documented limits, and its SHA-256 digest,
//! which is the primary key of once.entries and, in its first 8 bytes, the tag that
//! shared-memory waiter slots hold.

use crate::errors;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Longest key, in bytes. A key is also the NOTIFY payload, which must stay under 8,000
/// bytes; 7,500 leaves room.
pub const MAX_KEY_BYTES: usize = 7500;

/// A checked key and its SHA-256 digest (the primary key of once.entries).
pub struct Key<'a> {
    pub text: &'a str,
    hash: pg_sys::Datum,
    /// The digest's first 8 bytes: what shared-memory waiter slots hold.
    pub tag: u64,
}

impl<'a> Key<'a> {
    pub fn new(key: Option<&'a str>) -> Key<'a> {
        let Some(text) = key else {
            errors::null_argument("key", "Pass the cache key as text, e.g. a URL.");
        };
        if text.is_empty() {
            errors::invalid_argument(
                "key must not be empty".into(),
                "Use a non-empty string that names what is being computed.",
            );
        }
        if text.len() > MAX_KEY_BYTES {
            errors::too_long(
                format!("key is {} bytes long; the limit is {MAX_KEY_BYTES} bytes", text.len()),
                "Keys are sent as NOTIFY payloads. Use a digest of long input as the key, e.g. encode(sha256(convert_to(url, 'UTF8')), 'hex').",
            );
        }
        let hash = hash_key(text);
        // SAFETY: sha256_bytea returns a freshly built, untoasted bytea.
        let digest = unsafe { pgrx::varlena::varlena_to_byte_slice(hash.cast_mut_ptr()) };
        Key {
            text,
            hash,
            tag: crate::shmem::key_tag(digest),
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
        // SAFETY: `hash` is an untoasted bytea built by sha256_bytea.
        unsafe { pgrx::varlena::varlena_to_byte_slice(self.hash.cast_mut_ptr()) }.to_vec()
    }

    /// The key's digest as an SPI parameter (bytea).
    pub fn hash_param(&self) -> DatumWithOid<'static> {
        // SAFETY: `hash` is a bytea varlena allocated in the current memory context, which
        // outlives every SPI call made while this Key is alive.
        unsafe { DatumWithOid::new(self.hash, pg_sys::BYTEAOID) }
    }
}

/// SHA-256 of the key's bytes, computed by the same server function (sha256_bytea) that
/// backs once.key_hash(text), so ad-hoc lookups by once.key_hash(key) find the same row.
fn hash_key(text: &str) -> pg_sys::Datum {
    // SAFETY: sha256_bytea reads one varlena argument; text and bytea share that layout.
    unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(pg_sys::sha256_bytea, &[text.into_datum()])
            .expect("sha256 of a value is never NULL")
    }
}
