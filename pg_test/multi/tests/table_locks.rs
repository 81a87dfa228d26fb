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

/// Released as soon as the claim waits for the lock.
const WAITING: &str = "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND NOT granted
                                       AND relation = 'once.entries'::regclass)";

/// One test, the two locks one after the other: two tests would lock the table under
/// each other's claims.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_without_wait_looks_again_while_a_table_lock_passes() -> Result<()> {
    admin().await?;
    // A lock the insert of a new key waits for. Before, the SQL edition never claimed.
    claims_once_a_lock_passes(
        "BEGIN; LOCK TABLE once.entries IN SHARE MODE",
        || fresh_key("table-lock"),
        WAITING,
    )
    .await?;
    // One that even the look's read waits for, as VACUUM's truncation of the table takes
    // it. Before, the SQL edition failed the call with 55P03 (lock_timeout). Released as
    // soon as the claim is under way: the extension does not wait for this lock, it
    // looks again.
    claims_once_a_lock_passes(
        "BEGIN; LOCK TABLE once.entries IN ACCESS EXCLUSIVE MODE",
        || fresh_key("table-lock-exclusive"),
        "SELECT coalesce(bool_or(state = 'active' AND query LIKE '%claim_key%'), false)
           FROM pg_stat_activity WHERE pid = $1",
    )
    .await
}
