//! claim_key's fingerprint (issue 27): a key claimed for one request answers `mismatch` to
//! another while it runs or its result is served, changes nothing then, and takes the new
//! request's fingerprint once its attempt no longer counts. NULL on either side never
//! mismatches. The race of two first claims is pg_test/isolation/specs/fingerprint.spec.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{assert_error, hint_of, kill_owner, one, snapshot};
    use pgrx::prelude::*;

    /// claim_key(key, fingerprint => decode(fp, 'hex')) with `extra` arguments: its
    /// outcome, and whether every other column of the answer is NULL.
    fn claim(key: &str, fp: Option<&str>, extra: &str) -> (String, bool) {
        let fp = fp.map_or("NULL".to_string(), |hex| format!("decode('{hex}', 'hex')"));
        let sql = format!(
            "SELECT outcome, num_nulls(token, result, error, owner, lease_expires_at, attempts,
                                      retry_at, expires_at) = 8
               FROM once.claim_key('{key}', fingerprint => {fp}{extra})"
        );
        let (outcome, all_null) = Spi::get_two::<String, bool>(&sql).unwrap();
        (outcome.unwrap(), all_null.unwrap())
    }

    fn outcome(key: &str, fp: Option<&str>) -> String {
        claim(key, fp, "").0
    }

    /// The key's stored fingerprint, as hex.
    fn stored(key: &str) -> Option<String> {
        one::<String>(&format!(
            "SELECT encode(fingerprint, 'hex') FROM once.entries WHERE key = '{key}'"
        ))
    }

    fn token_of(key: &str) -> i64 {
        one::<i64>(&format!(
            "SELECT token FROM once.entries WHERE key = '{key}'"
        ))
        .unwrap()
    }

    fn complete(key: &str, extra: &str) {
        let token = token_of(key);
        Spi::run(&format!(
            "SELECT once.complete_key('{key}', {token}, '\"r\"'{extra})"
        ))
        .unwrap();
    }

    #[pg_test]
    fn another_fingerprint_is_a_mismatch_while_the_key_runs() {
        assert_eq!(outcome("k", Some("aa")), "claimed");
        assert_eq!(stored("k").as_deref(), Some("aa"));
        let before = snapshot();
        // Says nothing of the key (nor of its owner), and changes nothing.
        assert_eq!(claim("k", Some("bb"), ""), ("mismatch".to_string(), true));
        assert_eq!(claim("k", Some("bb"), ", wait => '0.2 s'").0, "mismatch");
        assert_eq!(snapshot(), before);
        // The same request waits for it, as does one without a fingerprint.
        assert_eq!(outcome("k", Some("aa")), "wait");
        assert_eq!(outcome("k", None), "wait");
    }

    #[pg_test]
    fn a_gone_owner_is_taken_over_only_by_the_same_request() {
        outcome("k", Some("aa"));
        kill_owner("k");
        let before = snapshot();
        assert_eq!(outcome("k", Some("bb")), "mismatch");
        assert_eq!(snapshot(), before);
        assert_eq!(outcome("k", Some("aa")), "claimed");
    }

    #[pg_test]
    fn another_fingerprint_is_a_mismatch_while_the_result_is_served() {
        outcome("k", Some("aa"));
        complete("k", ", ttl => '1 hour'");
        let before = snapshot();
        assert_eq!(claim("k", Some("bb"), ""), ("mismatch".to_string(), true));
        assert_eq!(snapshot(), before);
        assert_eq!(outcome("k", Some("aa")), "hit");
        assert_eq!(outcome("k", None), "hit");
        // once.get takes no fingerprint: the result is anyone's who asks by key.
        assert_eq!(
            one::<String>("SELECT once.get('k')::text").as_deref(),
            Some("\"r\"")
        );
    }

    #[pg_test]
    fn a_stale_result_mismatches_and_its_refresh_keeps_the_fingerprint() {
        outcome("k", Some("aa"));
        complete("k", ", ttl => '1 millisecond', stale => '1 hour'");
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        let before = snapshot();
        assert_eq!(
            claim("k", Some("bb"), ", serve_stale => true").0,
            "mismatch"
        );
        assert_eq!(claim("k", Some("bb"), "").0, "mismatch");
        assert_eq!(snapshot(), before);
        // A refresh without a fingerprint serves the kept result meanwhile: the result
        // is still aa's request's, so bb is still told mismatch.
        assert_eq!(claim("k", None, ", serve_stale => true").0, "refresh");
        assert_eq!(stored("k").as_deref(), Some("aa"));
        assert_eq!(outcome("k", Some("bb")), "mismatch");
    }

    #[pg_test]
    fn a_key_without_a_fingerprint_accepts_any() {
        assert_eq!(outcome("k", None), "claimed");
        assert_eq!(outcome("k", Some("bb")), "wait");
        complete("k", "");
        assert_eq!(outcome("k", Some("bb")), "hit");
        assert_eq!(stored("k"), None);
    }

    #[pg_test]
    fn a_new_attempt_stores_the_new_fingerprint() {
        // After the result expired.
        outcome("expired", Some("aa"));
        complete("expired", ", ttl => '1 millisecond'");
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        assert_eq!(outcome("expired", Some("bb")), "claimed");
        assert_eq!(stored("expired").as_deref(), Some("bb"));
        assert_eq!(outcome("expired", Some("aa")), "mismatch");

        // After a failure: served to everyone until retry_at, then claimable by anyone.
        outcome("failed", Some("aa"));
        let token = token_of("failed");
        Spi::run(&format!(
            "SELECT once.fail_key('failed', {token}, 'e', retry_after => '1 hour')"
        ))
        .unwrap();
        assert_eq!(outcome("failed", Some("bb")), "failed");
        Spi::run("UPDATE once.entries SET retry_at = now() - interval '1 s' WHERE key = 'failed'")
            .unwrap();
        assert_eq!(outcome("failed", Some("bb")), "claimed");
        assert_eq!(stored("failed").as_deref(), Some("bb"));

        // After release.
        outcome("released", Some("aa"));
        let token = token_of("released");
        Spi::run(&format!("SELECT once.release_key('released', {token})")).unwrap();
        assert_eq!(outcome("released", Some("bb")), "claimed");
        assert_eq!(stored("released").as_deref(), Some("bb"));

        // After invalidate.
        outcome("invalidated", Some("aa"));
        complete("invalidated", "");
        Spi::run("SELECT once.invalidate_key('invalidated')").unwrap();
        assert_eq!(outcome("invalidated", Some("bb")), "claimed");
        assert_eq!(stored("invalidated").as_deref(), Some("bb"));

        // A new attempt without a fingerprint stores none: it accepts any again.
        outcome("none", Some("aa"));
        complete("none", ", ttl => '1 millisecond'");
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        assert_eq!(outcome("none", None), "claimed");
        assert_eq!(stored("none"), None);
        assert_eq!(outcome("none", Some("bb")), "wait");
    }

    #[pg_test]
    fn bad_fingerprints_are_refused() {
        let before = snapshot();
        let empty = "SELECT once.claim_key('k', fingerprint => ''::bytea)";
        assert_error(empty, "22023", "fingerprint must not be empty");
        let long = "SELECT once.claim_key('k', fingerprint => decode(repeat('ab', 65), 'hex'))";
        assert_error(
            long,
            "22023",
            "fingerprint must be at most 64 bytes, got 65",
        );
        assert!(hint_of(long).unwrap().contains("digest"));
        assert_eq!(snapshot(), before);
        // 64 bytes (a SHA-512 digest) is the most there may be.
        let sha512 = "SELECT outcome FROM once.claim_key('k', fingerprint => sha512('r'))";
        assert_eq!(one::<String>(sha512).as_deref(), Some("claimed"));
    }
}
