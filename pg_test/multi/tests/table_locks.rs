//! claim_key with `wait => 0` on a new key while once.entries itself is locked for an
//! instant, in both editions. The insert of a new key waits on table-wide locks: the
//! table's extension while another session's insert adds a page (held for moments, longer
//! on a loaded machine) and any LOCK TABLE. The SQL edition used to give such a wait 1 ms
//! and answer `wait`: the caller, told the key was in flight, waited for an announcement
//! that never came (an HTTP duplicate got 409 in_flight). Locking the table here stands
//! for the extension lock, which a test cannot hold.
//!
//! Alone in its binary: a table lock blocks every other test's writes.

use anyhow::Result;
use pg_once_multi::{admin, claims_once_a_lock_passes, fresh_key};

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_without_wait_looks_again_while_a_table_lock_passes() -> Result<()> {
    admin().await?;
    // Before, the SQL edition never claimed. Released as soon as the claim waits for the
    // lock.
    claims_once_a_lock_passes(
        "BEGIN; LOCK TABLE once.entries IN SHARE MODE",
        || fresh_key("table-lock"),
        "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND NOT granted
                          AND relation = 'once.entries'::regclass)",
    )
    .await
}
