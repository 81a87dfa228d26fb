//! Queue mode: the same keys, fed to a fleet of workers.
//!
//! A queued key is a row in state `queued` with a queue, a payload, a priority and a due
//! time. Workers take due keys with claim_next, which is `FOR UPDATE SKIP LOCKED` over a
//! partial index of queued keys: no global lock, no hot row, and two workers never get
//! the same key. They finish with the same complete_key / fail_key / heartbeat_key as any
//! owner; fail_key sends a queued key back with a backoff (see claim.rs).
//!
//! Plans: every statement that writes rows found by a CTE also names them as
//! `key_hash = ANY (...)`, so that its plan looks them up in the primary key whatever the
//! statistics say. (A generic plan made while statistics said the table was small scanned
//! the whole primary key for every claim_next.)
//!
//! Lost races: claim_next's snapshot is taken when its statement starts, and by the time it
//! reaches a candidate another worker may have claimed that key and committed. FOR UPDATE
//! would then lock the claimed (running) version, find it no longer queued, skip it, and
//! keep the lock until claim_next's transaction ends, so that the owner's complete_key
//! waits for a worker that never got the key. With 64 workers on 2 cores completions spent
//! more time waiting there than anywhere else, and jobs/s fell to half of the peak. A key
//! another worker is claiming right now SKIP LOCKED skips, but only after an exclusive
//! lock on its page, and 64 workers at the head of one queue queued up on those.
//! claim_next therefore first asks once.row_taken(ctid) (see entry::taken) and passes over
//! versions a committed transaction has replaced or another transaction holds, without
//! trying to lock them.
//!
//! Deadlocks: claim_next never waits (SKIP LOCKED). Every operation that locks several
//! keys (invalidate_keys, complete_keys) locks them in key_hash order, and every other
//! write locks one key; so no two pg_once calls can wait for each other in a cycle.

use crate::claim::LockBudget;
use crate::jsonb::Jsonb;
use crate::key::Key;
use crate::liveness;
use crate::liveness::{Me, Owner};
use crate::notify;
use crate::shmem::{self, Counter};
use crate::statements::types::*;
use crate::statements::{self, Statement};
use crate::subxact::{self, Blocked};
use pgrx::datum::{DatumWithOid, Interval, TimestampWithTimeZone};
use pgrx::pg_sys;

static QUEUE_EXISTS: Statement =
    Statement::new("SELECT 1 FROM once.queues WHERE name = $1", &[TEXT]);

static UPSERT_QUEUE: Statement = Statement::new(
    "INSERT INTO once.queues (name, max_attempts, backoff, max_backoff) VALUES ($1, $2, $3, $4)
     ON CONFLICT (name) DO UPDATE
        SET max_attempts = EXCLUDED.max_attempts, backoff = EXCLUDED.backoff,
            max_backoff = EXCLUDED.max_backoff",
    &[TEXT, INT4, INTERVAL, INTERVAL],
);

static COUNT_QUEUE_KEYS: Statement = Statement::new(
    "SELECT count(*) FROM once.entries WHERE queue = $1",
    &[TEXT],
);

static DROP_QUEUE: Statement = Statement::new("DELETE FROM once.queues WHERE name = $1", &[TEXT]);

static KEY_STATE: Statement = Statement::new(
    "SELECT state::text FROM once.entries WHERE key_hash = $1",
    &[BYTEA],
);

static ENQUEUE_NEW: Statement = Statement::new(
    "INSERT INTO once.entries (key_hash, key, state, token, queue, payload, priority, run_at,
                               max_attempts, enqueued_at)
     VALUES ($1, $2, 'queued', 0, $3, $4, $5, coalesce($6, clock_timestamp()), $7,
             clock_timestamp())
     ON CONFLICT (key_hash) DO NOTHING",
    &[BYTEA, TEXT, TEXT, JSONB, INT4, TIMESTAMPTZ, INT4],
);

// A key that failed for good, whose result expired, or (with refresh) whose result is
// still fresh, goes back in the queue with a new budget of attempts. A fresh result stays
// and is served until the new one lands; errors are kept, so a key that keeps failing
// stays behind healthier ones.
static ENQUEUE_AGAIN: Statement = Statement::new(
    "UPDATE once.entries
        SET state = 'queued', queue = $3, payload = $4, priority = $5,
            run_at = coalesce($6, clock_timestamp()), max_attempts = $7,
            enqueued_at = clock_timestamp(), attempts = 0, retry_at = NULL,
            updated_at = clock_timestamp()
      WHERE key_hash = $1
        AND (state = 'failed'
             OR (state = 'done' AND ($8 OR expires_at <= clock_timestamp())))",
    &[BYTEA, TEXT, TEXT, JSONB, INT4, TIMESTAMPTZ, INT4, BOOL],
);

static CLAIM_NEXT: Statement = Statement::new(
    "WITH next AS (
         SELECT key_hash FROM once.entries
          WHERE state = 'queued' AND queue = $1 AND run_at <= clock_timestamp()
            AND NOT once.row_taken(ctid)
          ORDER BY errors, priority, run_at
          LIMIT $2
            FOR UPDATE SKIP LOCKED)
     UPDATE once.entries AS e
        SET state = 'running', token = nextval('once.token_seq'),
            owner = $3, owner_pid = $4, owner_started = $5, lease_only = $6,
            lease_expires_at = clock_timestamp() + $7,
            claimed_at = clock_timestamp(), updated_at = clock_timestamp(),
            attempts = e.attempts + 1
       FROM next
      WHERE e.key_hash = ANY (ARRAY(SELECT key_hash FROM next)) AND e.key_hash = next.key_hash
     RETURNING e.key, e.token, e.payload, e.attempts, e.key_hash",
    &[TEXT, INT8, TEXT, INT4, TIMESTAMPTZ, BOOL, INTERVAL],
);

// Locks in key_hash order (the ORDER BY sits below the row locking), then deletes.
static INVALIDATE_MANY: Statement = Statement::new(
    "WITH doomed AS (
         SELECT key_hash FROM once.entries
          WHERE ($1::text IS NULL OR queue = $1)
            AND ($2::text IS NULL OR left(key, length($2)) = $2)
          ORDER BY key_hash
            FOR UPDATE)
     DELETE FROM once.entries AS e USING doomed
      WHERE e.key_hash = ANY (ARRAY(SELECT key_hash FROM doomed)) AND e.key_hash = doomed.key_hash",
    &[TEXT, TEXT],
);

// Each (key, token, result) completes like complete_key; rows are locked in key_hash
// order first, so two batches (or a batch and invalidate_keys) cannot deadlock.
static COMPLETE_MANY: Statement = Statement::new(
    "WITH input AS (
         SELECT * FROM unnest($1::bytea[], $2::bigint[], $3::jsonb[]) AS i(key_hash, token, result)),
     locked AS (
         SELECT key_hash FROM once.entries
          WHERE key_hash = ANY ($1) AND state = 'running'
          ORDER BY key_hash
            FOR UPDATE)
     UPDATE once.entries AS e
        SET state = 'done', result = i.result, expires_at = clock_timestamp() + $4,
            completed_at = clock_timestamp(), updated_at = clock_timestamp(),
            lease_expires_at = NULL, error = NULL, retry_at = NULL
       FROM input i, locked l
      WHERE e.key_hash = ANY ($1) AND e.key_hash = l.key_hash AND e.key_hash = i.key_hash
        AND e.token = i.token AND e.state = 'running'
     RETURNING e.key",
    &[BYTEA_ARRAY, INT8_ARRAY, JSONB_ARRAY, INTERVAL],
);

pub fn queue_exists(name: &str) -> bool {
    statements::run(&QUEUE_EXISTS, &[name.into()], |table| Ok(!table.is_empty()))
}

pub fn upsert_queue(name: &str, max_attempts: i32, backoff: Interval, max_backoff: Interval) {
    let args = [
        name.into(),
        max_attempts.into(),
        backoff.into(),
        max_backoff.into(),
    ];
    statements::run(&UPSERT_QUEUE, &args, |_| Ok(()));
}

pub fn keys_in_queue(name: &str) -> i64 {
    statements::run(&COUNT_QUEUE_KEYS, &[name.into()], |table| {
        Ok(table.first().get(1)?.unwrap_or(0))
    })
}

pub fn drop_queue(name: &str) -> bool {
    statements::run(&DROP_QUEUE, &[name.into()], |table| Ok(table.len() == 1))
}

/// What enqueue_key did.
pub enum Enqueued {
    /// The key was absent and is now queued.
    Queued,
    /// The key failed, expired, or (refresh) had a result, and is queued again.
    Requeued,
    /// The key is already queued or being computed: nothing changed.
    Duplicate,
    /// The key has a fresh result and refresh was not asked for: nothing changed.
    Cached,
}

pub struct Job<'a> {
    pub key: &'a Key<'a>,
    pub payload: Option<Jsonb>,
    pub queue: &'a str,
    pub priority: i32,
    pub run_at: Option<TimestampWithTimeZone>,
    pub max_attempts: Option<i32>,
}

pub fn enqueue(job: &Job, refresh: bool) -> Enqueued {
    let args = |extra: Option<bool>| {
        let mut args: Vec<DatumWithOid> = vec![
            job.key.hash_param(),
            job.key.text_param(),
            job.queue.into(),
            job.payload.into(),
            job.priority.into(),
            job.run_at.into(),
            job.max_attempts.into(),
        ];
        args.extend(extra.map(Into::into));
        args
    };
    if statements::run(&ENQUEUE_NEW, &args(None), |table| Ok(table.len() == 1)) {
        notify::queue_has_work(job.queue);
        return Enqueued::Queued;
    }
    if statements::run(&ENQUEUE_AGAIN, &args(Some(refresh)), |table| {
        Ok(table.len() == 1)
    }) {
        notify::queue_has_work(job.queue);
        return Enqueued::Requeued;
    }
    // Through SQL, not entry::read: that look gives up when DDL waits for once.entries,
    // whereas this transaction, having written the table, is let ahead of such DDL.
    let state: Option<String> = statements::run(&KEY_STATE, &[job.key.hash_param()], |table| {
        if table.is_empty() {
            Ok(None)
        } else {
            table.first().get(1)
        }
    });
    match state.as_deref() {
        Some("done") => Enqueued::Cached,
        _ => Enqueued::Duplicate,
    }
}

/// A key handed to a worker by claim_next.
pub struct Claimed {
    pub key: String,
    pub token: i64,
    pub payload: Option<Jsonb>,
    pub attempt: i32,
}

/// Claim up to `n` due keys of `queue` for `owner`.
pub fn claim_next(
    queue: &str,
    lease: Interval,
    worker: Option<&str>,
    owner: Owner,
    n: i32,
) -> Vec<Claimed> {
    let me = Me::new(worker, owner);
    // The owner's identity must be registered before its claims are visible to others.
    owner.before_claiming(None);
    let args = [
        queue.into(),
        (n as i64).into(),
        me.label.clone().into(),
        me.pid.into(),
        me.started_param(),
        me.lease_only.into(),
        lease.into(),
    ];
    let claimed = statements::run(&CLAIM_NEXT, &args, |table| {
        let mut claimed = Vec::with_capacity(table.len());
        for row in table {
            let digest: &[u8] = row.get(5)?.expect("key_hash is NOT NULL");
            if owner == Owner::ThisBackend {
                liveness::own(shmem::key_tag(digest));
            }
            claimed.push(Claimed {
                key: row.get(1)?.expect("key is NOT NULL"),
                token: row.get(2)?.expect("token is NOT NULL"),
                payload: row.get(3)?,
                attempt: row.get(4)?.unwrap_or(1),
            });
        }
        Ok(claimed)
    });
    shmem::count_n(Counter::Claimed, claimed.len() as u64);
    claimed
}

/// One look of a waiting claim_next: `claim_next` in a subtransaction that keeps nothing
/// (no lock either) unless it claimed something, and whose lock waits end at `budget`.
pub fn claim_next_within(
    queue: &str,
    lease: Interval,
    worker: Option<&str>,
    owner: Owner,
    n: i32,
    budget: LockBudget,
) -> Result<Vec<Claimed>, Blocked> {
    subxact::keep_if(
        budget.0,
        || claim_next(queue, lease, worker, owner, n),
        |claimed| !claimed.is_empty(),
    )
}

static NEXT_DUE: Statement = Statement::new(
    "SELECT min(run_at) FROM once.entries WHERE state = 'queued' AND queue = $1",
    &[TEXT],
);

/// When the earliest queued key of `queue` is due (None: nothing is queued), read in a
/// subtransaction that is rolled back, so that a waiting worker keeps no lock.
pub fn next_due(queue: &str, budget: LockBudget) -> Result<Option<TimestampWithTimeZone>, Blocked> {
    subxact::keep_if(
        budget.0,
        || statements::run(&NEXT_DUE, &[queue.into()], |table| table.first().get(1)),
        |_| false,
    )
}

pub fn invalidate_many(queue: Option<&str>, prefix: Option<&str>) -> i64 {
    let args = [queue.into(), prefix.into()];
    let n = statements::run(&INVALIDATE_MANY, &args, |table| Ok(table.len() as i64));
    shmem::count_n(Counter::Invalidated, n as u64);
    n
}

static JSONB_ARRAY_SHAPE: Statement = Statement::new(
    "SELECT coalesce(cardinality($1), 0), array_position($1, NULL) IS NOT NULL",
    &[JSONB_ARRAY],
);

/// How many elements a jsonb[] has, and whether one of them is NULL.
pub fn jsonb_array_shape(array: pg_sys::Datum) -> (usize, bool) {
    // SAFETY: the caller passes a jsonb[] datum.
    let arg = unsafe { DatumWithOid::new(array, pg_sys::JSONBARRAYOID) };
    statements::run(&JSONB_ARRAY_SHAPE, &[arg], |table| {
        let row = table.first();
        Ok((
            row.get::<i32>(1)?.unwrap_or(0) as usize,
            row.get::<bool>(2)?.unwrap_or(false),
        ))
    })
}

/// Complete several claims in one statement; returns the keys that were completed.
pub fn complete_many(
    keys: &[Key],
    tokens: Vec<i64>,
    results: pg_sys::Datum,
    ttl: Option<Interval>,
) -> Vec<String> {
    let hashes: Vec<Vec<u8>> = keys.iter().map(Key::digest).collect();
    // SAFETY: `results` is the caller's jsonb[] argument.
    let results = unsafe { DatumWithOid::new(results, pg_sys::JSONBARRAYOID) };
    let args = [hashes.into(), tokens.into(), results, ttl.into()];
    let done: Vec<String> = statements::run(&COMPLETE_MANY, &args, |table| {
        table
            .map(|row| Ok(row.get::<String>(1)?.expect("key is NOT NULL")))
            .collect()
    });
    for key in keys.iter().filter(|k| done.iter().any(|d| d == k.text)) {
        liveness::disown(key.tag);
    }
    shmem::count_n(Counter::Completed, done.len() as u64);
    done
}
