//! Keys are data: stored verbatim, up to 7,500 bytes, addressed by their digest once.key_hash.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{answer, one, outcome_and_token};
    use pgrx::prelude::*;

    #[pg_test]
    fn keys_are_data_stored_verbatim() {
        for key in [
            "it's",
            "back\\slash",
            "new\nline",
            "ünïcødé ✓ 漢字",
            "'; DROP TABLE once.entries; --",
            "\"quoted\"",
        ] {
            let (outcome, _) = outcome_and_token(key);
            assert_eq!(outcome, "claimed", "{key:?}");
            let stored = Spi::get_one_with_args::<String>(
                "SELECT key FROM once.entries WHERE key_hash = once.key_hash($1)",
                &[key.into()],
            )
            .unwrap();
            assert_eq!(stored.as_deref(), Some(key));
        }
        assert_eq!(one::<i64>("SELECT count(*) FROM once.entries"), Some(6));
    }

    #[pg_test]
    fn keys_up_to_7500_bytes_work_end_to_end() {
        let key = "é".repeat(3750); // 7,500 bytes in UTF-8
        let (outcome, token) = outcome_and_token(&key);
        assert_eq!(outcome, "claimed");
        let done = Spi::get_one_with_args::<bool>(
            "SELECT once.complete_key($1, $2, '\"long\"')",
            &[key.as_str().into(), token.into()],
        )
        .unwrap();
        assert_eq!(done, Some(true));
        assert_eq!(answer(&key).0, "hit");
    }

    #[pg_test]
    fn stored_digest_is_once_key_hash() {
        outcome_and_token("abc");
        assert_eq!(
            one::<bool>("SELECT key_hash = sha256('abc'::bytea) AND key_hash = once.key_hash(key) FROM once.entries"),
            Some(true)
        );
    }

    /// pg_once computes key digests itself (key::digest), not through the server's
    /// sha256(): every key length around the 64-byte block and its padding, multi-byte
    /// text and the longest key must still get the digest once.key_hash gives.
    #[pg_test]
    fn key_digests_match_the_server_sha256_at_every_length() {
        let mut keys: Vec<String> = (1..=200).map(|n| "k".repeat(n)).collect();
        keys.push("ünïcødé ✓ 漢字".repeat(9));
        keys.push("é".repeat(3750));
        for key in &keys {
            outcome_and_token(key);
        }
        assert_eq!(
            one::<i64>("SELECT count(*) FROM once.entries WHERE key_hash = sha256(convert_to(key, 'UTF8'))"),
            Some(keys.len() as i64)
        );
    }
}
