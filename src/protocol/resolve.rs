//! Resolving a claim: what its owner does with it (complete_key, fail_key,
//! heartbeat_key, release_key), and the announcement of a resolved key.
//!
//! Fencing: every write by an owner names the key *and* its token and the state
//! `running`; a write whose token is no longer current matches no row and changes nothing.
//! Only the role that made a claim acts on it with its token (rules::token_holder).

use crate::key::{self, Key};
use crate::protocol::freshness::{self, Policy};
use crate::protocol::namespace;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::liveness;
use crate::runtime::notify;
use crate::runtime::shmem::{self, Counter};
use crate::storage::jsonb::Jsonb;
use crate::storage::statements::{self, params, Statement};
use pgrx::datum::{Interval, TimestampWithTimeZone};

// One key: the jitter's draw and the time come as parameters ($draw, $now), read just
// before the statement, rather than from a row source `FROM (SELECT random() AS draw,
// clock_timestamp() AS now) d` as complete_keys has them for each of its keys: that join
// made every complete_key plan a nested loop over a subquery, whose executor start alone
// was 4% of a claim+complete cycle's server time (perf, issue 25).
static COMPLETE: Statement = Statement::new(concat!(
    "UPDATE once.entries AS e SET ",
    completed!("$result", "$"),
    "
      WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND ",
    token_holder!(""),
    "
     RETURNING ",
    ended_attempt_columns!()
));

// The history of a queued key that complete_key completed (rules::completions_recorded).
static RECORD_COMPLETION: Statement = Statement::new(completions_recorded!(
    "(SELECT $key_hash::bytea, $key::text, $queue::text, $token::bigint, $owner::text,
             $claimed_at::timestamptz) AS ended (key_hash, key, queue, token, owner, claimed_at)"
));

// A failure is served to callers until retry_at; a queued key goes back to its queue
// instead (rules::failed_attempt).
static FAIL: Statement = Statement::new(concat!(
    "WITH policy AS (
         SELECT e.key_hash, ",
    retry_policy!(),
    "
           FROM once.entries e LEFT JOIN once.queues q ON q.name = e.queue
          WHERE e.key_hash = $key_hash AND e.token = $token AND e.state = 'running'
            AND ",
    token_holder!("e."),
    ")
     UPDATE once.entries AS e
        SET ",
    failed_attempt!("p.", "$retry_after"),
    ",
            error = $error, last_outcome = 'failed'
       FROM policy p
      WHERE e.key_hash = $key_hash AND e.key_hash = p.key_hash AND e.token = $token
        AND e.state = 'running'"
));

static HEARTBEAT: Statement = Statement::new(concat!(
    "UPDATE once.entries
        SET lease_expires_at = clock_timestamp() + $lease, updated_at = clock_timestamp()
      WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND ",
    token_holder!(""),
    "
     RETURNING lease_expires_at"
));

// A released key becomes absent, so the next caller claims it as if it were cold (tokens
// come from a sequence, so deleting the row cannot make an old token valid again); a
// released refresh goes back to serving the result it kept, and the next caller in its
// stale window refreshes it. A queued key goes back to its queue, due now, and the
// attempt does not count.
static RELEASE: Statement = Statement::new(concat!(
    "WITH gone AS (
         DELETE FROM once.entries
          WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND queue IS NULL
            AND result IS NULL AND ",
    token_holder!(""),
    "
         RETURNING 1),
     kept AS (
         UPDATE once.entries
            SET state = 'done', lease_expires_at = NULL, updated_at = clock_timestamp(),
                last_outcome = 'released', rerun = NULL, rerun_stale = NULL
          WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND queue IS NULL
            AND result IS NOT NULL AND ",
    token_holder!(""),
    "
         RETURNING 1),
     requeued AS (
         UPDATE once.entries
            SET state = 'queued', attempts = greatest(attempts - 1, 0),
                run_at = clock_timestamp(), lease_expires_at = NULL,
                updated_at = clock_timestamp(), last_outcome = 'released'
          WHERE key_hash = $key_hash AND token = $token AND state = 'running'
            AND queue IS NOT NULL AND ",
    token_holder!(""),
    "
         RETURNING 1)
     SELECT 1 FROM gone UNION ALL SELECT 1 FROM kept UNION ALL SELECT 1 FROM requeued"
));

/// An owner's write took effect: its claim is resolved by itself, not by its exit.
fn resolved_by_owner(key: &Key, done: bool, counter: Counter) -> bool {
    if done {
        liveness::disown(key.tag);
        shmem::count(counter);
    }
    done
}

/// Store the result of a claim, fresh and then stale as `policy` says; false when the
/// claim is no longer current.
pub fn complete(key: &Key, token: i64, result: Jsonb, policy: &Policy) -> bool {
    standby::refuse_writes("complete_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
        result = result,
        draw = freshness::jitter_draw(),
        now = TimestampWithTimeZone::try_from(crate::runtime::wait::now())
            .expect("the server's clock is a valid timestamp"),
    ]
    .into_iter()
    .chain(policy.params());
    let ended = statements::run(&COMPLETE, args, |table| {
        if table.is_empty() {
            return Ok(None);
        }
        let row = table.first();
        Ok(Some((
            row.get_by_name::<String, _>("queue")?,
            row.get_by_name::<String, _>("owner")?,
            row.get_by_name::<TimestampWithTimeZone, _>("claimed_at")?,
        )))
    });
    if let Some((Some(queue), owner, claimed_at)) = &ended {
        let args = params![
            key_hash = key.hash_param(),
            key = key.text,
            queue = queue.as_str(),
            token = token,
            owner = owner.as_deref(),
            claimed_at = *claimed_at,
        ];
        statements::run(&RECORD_COMPLETION, args, |_| Ok(()));
    }
    resolved_by_owner(key, ended.is_some(), Counter::Completed)
}

/// Record a failure of a claim; false when the claim is no longer current.
pub fn fail(key: &Key, token: i64, error: String, retry_after: Interval) -> bool {
    standby::refuse_writes("fail_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
        error = error,
        retry_after = retry_after,
    ];
    let done = statements::run(&FAIL, args, |table| Ok(table.len() == 1));
    resolved_by_owner(key, done, Counter::Failed)
}

/// Extend a claim's lease; None when the claim is no longer current.
pub fn heartbeat(key: &Key, token: i64, lease: Interval) -> Option<TimestampWithTimeZone> {
    standby::refuse_writes("heartbeat_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
        lease = lease,
    ];
    statements::run(&HEARTBEAT, args, |table| {
        if table.is_empty() {
            Ok(None)
        } else {
            table.first().get(1)
        }
    })
}

/// Give a claim back unfailed; false when the claim is no longer current.
pub fn release(key: &Key, token: i64) -> bool {
    standby::refuse_writes("release_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
    ];
    let done = statements::run(&RELEASE, args, |table| Ok(table.len() == 1));
    resolved_by_owner(key, done, Counter::Released)
}

/// A running key was resolved (completed, failed, released, reaped, invalidated): its
/// waiters are woken and it is announced on channel `once`, as its namespace says (the
/// key, or its digest).
pub fn announce_resolved(key: &str, digest: &[u8]) {
    notify::key_resolved(&namespace::payload(key, digest), key::tag_of(digest));
}
