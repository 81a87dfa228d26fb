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
use pg_once_multi::{admin, fresh_key, once, session};
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(30);
const NO_WAIT: Duration = Duration::ZERO;
/// How late a call may answer past what it was told, on a loaded machine.
const SLACK: Duration = Duration::from_secs(2);
const LOCK: &str = "BEGIN; LOCK TABLE once.entries IN SHARE MODE";

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_without_wait_looks_again_while_a_table_lock_passes() -> Result<()> {
    let admin = admin().await?;
    let holder = session().await?;
    let mut claimer = session().await?;

    // Locked for longer than 100 ms: `wait`, after 100 ms and not much later.
    holder.batch_execute(LOCK).await?;
    let started = Instant::now();
    let answer = once::claim_key(&claimer, &fresh_key("table-held"), LEASE, NO_WAIT).await?;
    let took = started.elapsed();
    holder.batch_execute("ROLLBACK").await?;
    assert!(answer.is("wait"), "{answer:?}");
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(100) + SLACK,
        "a new key's claim under a table lock answered after {took:?}"
    );

    // Released while the claim waits: claimed. The release must come within those 100 ms,
    // which a loaded machine may miss, so it is tried up to ten times; before, the SQL
    // edition never claimed one.
    let claimer_pid = once::backend_pid(&claimer).await?;
    for _ in 0..10 {
        holder.batch_execute(LOCK).await?;
        let claiming = {
            let key = fresh_key("table-passing");
            tokio::spawn(async move {
                let answer = once::claim_key(&claimer, &key, LEASE, NO_WAIT).await;
                (answer, claimer)
            })
        };
        // Released as soon as the claim is seen waiting for the lock.
        while !claiming.is_finished()
            && !admin
                .query_one(
                    "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND NOT granted
                                      AND relation = 'once.entries'::regclass)",
                    &[&claimer_pid],
                )
                .await?
                .get::<_, bool>(0)
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        holder.batch_execute("COMMIT").await?;
        let (answer, back) = claiming.await?;
        claimer = back;
        if answer?.is("claimed") {
            return Ok(());
        }
    }
    panic!("no claim of a new key under a passing table lock was claimed once it passed")
}
