//! Queue mode: the same keys, fed to a fleet of workers.
//!
//! A queued key is a row in state `queued` with a queue, a payload, a priority and a due
//! time. Workers take due keys with claim_next, which is `FOR UPDATE SKIP LOCKED` over a
//! partial index of queued keys: no global lock, no hot row, and two workers never get
//! the same key. They finish with the same complete_key / fail_key / heartbeat_key as any
//! owner; fail_key sends a queued key back with a backoff
//! (protocol/sql/rules/failed_attempt.sql).
//!
//! Plans: every statement that writes rows found by a CTE also names them as
//! `key_hash = ANY (...)`, so that its plan looks them up in the primary key whatever the
//! statistics say. (A generic plan made while statistics said the table was small scanned
//! the whole primary key for every claim_next.)
//!
//! claim_next names the rows its CTE locked by `ctid = ANY (...)` instead: a TID scan
//! fetches each locked version directly, the cheapest plan at any size, rather than
//! descending the primary key once more for each. A row locked by FOR UPDATE cannot move
//! before the UPDATE; only a version that another transaction replaced and committed after
//! the call's snapshot (the lock then follows it to the new version, which the snapshot
//! does not see) is left out: that key stays queued, locked until the call ends, and the
//! call returns fewer keys. row_taken passes over such versions beforehand in all but a
//! narrow window. complete_keys must not lose a key that way (a heartbeat committed while
//! it waited for the lock replaces the version), so it looks its keys up again by
//! key_hash: pg_test/isolation/specs/complete-after-heartbeat.spec.
//!
//! Lost races: before locking a candidate, claim_next asks once_internal.row_taken(ctid) and passes
//! over versions another worker has claimed since its snapshot or is claiming right now;
//! why plain SKIP LOCKED is not enough is said at storage::entry::taken.
//!
//! Deadlocks: claim_next never waits (SKIP LOCKED). Every operation that locks several
//! keys (invalidate_keys, complete_keys) locks them in key_hash order, and every other
//! write locks one key; so no two pg_once calls can wait for each other in a cycle.

use crate::errors;
use crate::key::Key;
use crate::protocol::freshness::Policy;
use crate::protocol::namespace;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::liveness::{self, Me, Owner};
use crate::runtime::notify;
use crate::runtime::shmem::{self, Counter};
use crate::runtime::wait;
use crate::storage::jsonb::{Jsonb, JsonbArray};
use crate::storage::statements::{self, params, Statement};
use crate::storage::subxact::{self, Blocked, LockBudget};
use crate::storage::watched::Watched;
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;

/// The queue enqueue_key and claim_next use when none is named (their SQL default). It is
/// created with the extension and cannot be dropped.
pub const DEFAULT_QUEUE: &str = "default";

static QUEUE_NAMESPACE: Statement =
    Statement::new("SELECT namespace FROM once.queues WHERE name = $name");

static UPSERT_QUEUE: Statement = statement!("upsert_queue");

static COUNT_QUEUE_KEYS: Statement =
    Statement::new("SELECT count(*) FROM once.entries WHERE queue = $name");

static DROP_QUEUE: Statement = statement!("drop_queue");

static KEY_STATE: Statement =
    Statement::new("SELECT state::text FROM once.entries WHERE key_hash = $key_hash");

static ENQUEUE_NEW: Statement = statement!("enqueue_new");

static ENQUEUE_AGAIN: Statement = statement!("enqueue_again");

static ENQUEUE_RERUN: Statement = statement!("enqueue_rerun");

static ENQUEUE_MANY: Statement = statement!("enqueue_many");

static CLAIM_NEXT: Statement = statement!("claim_next");

static INVALIDATE_MANY: Statement = statement!("invalidate_many");

static COMPLETE_MANY: Statement = statement!("complete_many");

/// A queue, as a call names it.
pub struct Queue<'a> {
    pub name: &'a str,
    /// The namespace it belongs to; None: shared by every role.
    pub namespace: Option<String>,
}

thread_local! {
    /// The namespace of each queue this backend has used (None: shared), read from
    /// once.queues and kept until that table changes (storage::watched). A name that is
    /// not a queue is not kept, so callers cannot fill this with names.
    static QUEUE_NAMESPACES: RefCell<HashMap<String, Option<String>>> = RefCell::new(HashMap::new());
    static QUEUES: Watched = const { Watched::new(crate::schema::API, c"queues") };
}

/// The namespace of queue `name`: None if there is no such queue, Some(None) if it is
/// shared. Every claim_next asks; a statement to answer was 2% of a queue's server time.
fn namespace_of_queue(name: &str) -> Option<Option<String>> {
    if QUEUES.with(Watched::changed) {
        QUEUE_NAMESPACES.with_borrow_mut(HashMap::clear);
    }
    if let Some(kept) = QUEUE_NAMESPACES.with_borrow(|kept| kept.get(name).cloned()) {
        return Some(kept);
    }
    let read = statements::run(&QUEUE_NAMESPACE, params![name = name], |table| {
        if table.is_empty() {
            Ok(None)
        } else {
            Ok(Some(table.first().get::<String>(1)?))
        }
    });
    if let Some(namespace) = &read {
        QUEUE_NAMESPACES.with_borrow_mut(|kept| kept.insert(name.to_owned(), namespace.clone()));
    }
    read
}

/// The queue named `name`, which must exist (42704) and which the caller must be allowed
/// to use (42501); `function` names the call in a refusal.
pub fn require<'a>(name: &'a str, function: &str) -> Queue<'a> {
    let Some(namespace) = namespace_of_queue(name) else {
        errors::undefined_object(
            format!("queue \"{name}\" does not exist"),
            &format!(
                "Create it first: SELECT once.create_queue('{}');",
                name.replace('\'', "''")
            ),
        );
    };
    if let Some(prefix) = &namespace {
        namespace::require_key(prefix, function);
    }
    Queue { name, namespace }
}

/// Keys of `queue` became due in this transaction: wake its waiting workers after commit.
pub fn has_work(queue: &str) {
    notify::wake_after_commit(wait::queue_tag(queue));
}

// The queue's namespace, and whether the call would leave the row as it is.
static QUEUE_AS_ASKED: Statement = Statement::new(
    "SELECT namespace,
            (max_attempts, backoff, max_backoff, namespace)
              IS NOT DISTINCT FROM ($max_attempts, $backoff, $max_backoff, $namespace) AS unchanged
       FROM once.queues WHERE name = $name",
);

const SHARED_QUEUES_HINT: &str = "Shared queues (namespace NULL) serve every role's workers: a superuser or a member of the role that owns the pg_once extension changes them. Applications may create new ones, or use queues of their own namespace.";

/// Create the queue `name` or change its policy. Anyone granted the function may create a
/// new queue, shared or in a namespace it is a member of. A queue of a namespace is changed
/// only by its members (and given to a namespace only by a member of that one); a shared
/// queue, which every role's workers serve, is changed only by an administrator, and
/// likewise only an administrator makes a queue shared. Asking for a queue exactly as it
/// is changes nothing and is allowed to all (applications declare their queues as they
/// start).
pub fn upsert_queue(
    name: &str,
    max_attempts: i32,
    backoff: Interval,
    max_backoff: Interval,
    namespace: Option<&str>,
) {
    if let Some(prefix) = namespace {
        namespace::require_named(prefix, "create_queue");
    }
    let args = || {
        params![
            name = name,
            max_attempts = max_attempts,
            backoff = backoff,
            max_backoff = max_backoff,
            namespace = namespace,
        ]
    };
    let current: Option<(Option<String>, bool)> =
        statements::run(&QUEUE_AS_ASKED, args(), |table| {
            if table.is_empty() {
                return Ok(None);
            }
            let row = table.first();
            Ok(Some((row.get(1)?, row.get(2)?.unwrap_or(false))))
        });
    if let Some((current, unchanged)) = current {
        if let Some(prefix) = &current {
            namespace::require_key(prefix, "create_queue");
        }
        if unchanged {
            return;
        }
        if current.is_none() || namespace.is_none() {
            namespace::require_administrator(
                &format!("queue \"{name}\" is shared by every role"),
                SHARED_QUEUES_HINT,
            );
        }
    }
    standby::refuse_writes("create_queue");
    statements::run(&UPSERT_QUEUE, args(), |_| Ok(()));
    if let Some(prefix) = namespace {
        // A drop_namespace that committed meanwhile (its lock made this write wait) must
        // not leave a queue naming a namespace that is gone, which every role could use.
        namespace::require_named(prefix, "create_queue");
    }
}

/// Drop the queue `name`, which exists. Refused (55006) for the default queue, which every
/// call that names no queue needs, and for a queue that keys still name.
pub fn drop_queue(name: &str) {
    if name == DEFAULT_QUEUE {
        errors::object_in_use(
            format!("queue \"{DEFAULT_QUEUE}\" cannot be dropped"),
            "It is the queue enqueue_key and claim_next use when none is named, and it stays. To empty it: SELECT once.invalidate_keys(queue => 'default'); to change its retry policy: SELECT once.create_queue('default', max_attempts => ...);",
        );
    }
    let keys: i64 = statements::run(&COUNT_QUEUE_KEYS, params![name = name], |table| {
        Ok(table.first().get(1)?.unwrap_or(0))
    });
    if keys > 0 {
        errors::object_in_use(
            format!("queue \"{name}\" still has {keys} keys"),
            &format!(
                "Remove them first: SELECT once.invalidate_keys(queue => '{}');",
                name.replace('\'', "''")
            ),
        );
    }
    if namespace_of_queue(name) == Some(None) {
        namespace::require_administrator(
            &format!("queue \"{name}\" is shared by every role"),
            SHARED_QUEUES_HINT,
        );
    }
    standby::refuse_writes("drop_queue");
    statements::run(&DROP_QUEUE, params![name = name], |_| Ok(()));
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
    pub queue: &'a Queue<'a>,
    pub priority: i32,
    pub run_at: Option<TimestampWithTimeZone>,
    pub max_attempts: Option<i32>,
}

impl Job<'_> {
    /// What ENQUEUE_NEW and ENQUEUE_AGAIN both write.
    fn params(&self) -> [statements::Param<'static>; 6] {
        params![
            key_hash = self.key.hash_param(),
            queue = self.queue.name,
            payload = self.payload,
            priority = self.priority,
            run_at = self.run_at,
            max_attempts = self.max_attempts,
        ]
    }
}

/// A key of a namespace goes only into a queue of the same namespace (42501): a shared
/// queue's workers could be any role, and would get its payload.
fn require_queue_of_key(key: &Key, queue: &Queue) {
    if let Some(prefix) = namespace::prefix_of(key.text) {
        if queue.namespace.as_deref() != Some(prefix.as_str()) {
            errors::insufficient_privilege(
                format!(
                    "key \"{}\" belongs to namespace \"{prefix}\", queue \"{}\" does not",
                    key.text, queue.name
                ),
                "Enqueue a namespace's keys into a queue of the same namespace: once.create_queue(name, namespace => ...).",
            );
        }
    }
}

pub fn enqueue(job: &Job, refresh: bool) -> Enqueued {
    standby::refuse_writes("enqueue_key");
    require_queue_of_key(job.key, job.queue);
    let new = job
        .params()
        .into_iter()
        .chain(params![key = job.key.text_param()]);
    if statements::run(&ENQUEUE_NEW, new, |table| Ok(table.len() == 1)) {
        namespace::recheck_key(job.key.text, "enqueue_key");
        has_work(job.queue.name);
        return Enqueued::Queued;
    }
    let again = job.params().into_iter().chain(params![refresh = refresh]);
    if statements::run(&ENQUEUE_AGAIN, again, |table| Ok(table.len() == 1)) {
        has_work(job.queue.name);
        return Enqueued::Requeued;
    }
    let rerun = params![
        key_hash = job.key.hash_param(),
        queue = job.queue.name,
        payload = job.payload,
        priority = job.priority,
        max_attempts = job.max_attempts,
        refresh = refresh,
    ];
    if statements::run(&ENQUEUE_RERUN, rerun, |table| Ok(table.len() == 1)) {
        return Enqueued::Requeued;
    }
    // Through SQL, not entry::read: that look gives up when DDL waits for once.entries,
    // whereas this transaction, having written the table, is let ahead of such DDL.
    let args = params![key_hash = job.key.hash_param()];
    let state: Option<String> = statements::run(&KEY_STATE, args, |table| {
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

/// What enqueue_keys writes besides each key and its payload: enqueue_key's arguments.
pub struct Batch<'a> {
    pub keys: &'a [Key<'a>],
    /// One per key (NULL elements: no payload); None: no payloads.
    pub payloads: Option<JsonbArray>,
    pub queue: &'a Queue<'a>,
    pub priority: i32,
    pub run_at: Option<TimestampWithTimeZone>,
    pub max_attempts: Option<i32>,
}

/// How many times enqueue_many runs its statement for keys another transaction inserted
/// meanwhile before it gives up. Each round waits for those transactions, so a second
/// round sees their keys; a third is needed only if yet others wrote the same keys again.
const ENQUEUE_ROUNDS: usize = 8;

/// enqueue for every key of `batch` (distinct keys, each one the caller may use) in one
/// statement; the outcomes in the order of the keys.
pub fn enqueue_many(batch: &Batch, refresh: bool) -> Vec<Enqueued> {
    standby::refuse_writes("enqueue_keys");
    for key in batch.keys {
        require_queue_of_key(key, batch.queue);
    }
    let mut outcomes: Vec<Option<Enqueued>> = batch.keys.iter().map(|_| None).collect();
    if batch.keys.is_empty() {
        return Vec::new();
    }
    let key_hashes: Vec<Vec<u8>> = batch.keys.iter().map(Key::digest).collect();
    let keys: Vec<String> = batch.keys.iter().map(|k| k.text.to_owned()).collect();
    let mut pending: Option<Vec<i64>> = None;
    let mut due = false;
    for _ in 0..ENQUEUE_ROUNDS {
        let pending_hashes: Vec<Vec<u8>> = match &pending {
            None => key_hashes.clone(),
            Some(ords) => ords
                .iter()
                .map(|&o| key_hashes[o as usize - 1].clone())
                .collect(),
        };
        let args = params![
            key_hashes = key_hashes.clone(),
            keys = keys.clone(),
            payloads = batch.payloads,
            pending = pending.clone(),
            pending_hashes = pending_hashes,
            queue = batch.queue.name,
            priority = batch.priority,
            run_at = batch.run_at,
            max_attempts = batch.max_attempts,
            refresh = refresh,
        ];
        let rows: Vec<(i64, Option<String>, bool)> =
            statements::run(&ENQUEUE_MANY, args, |table| {
                table
                    .map(|row| {
                        Ok((
                            row.get::<i64>(1)?.expect("ord is NOT NULL"),
                            row.get::<String>(2)?,
                            row.get::<bool>(3)?.unwrap_or(false),
                        ))
                    })
                    .collect()
            });
        let mut left = Vec::new();
        for (ord, outcome, woke) in rows {
            let i = ord as usize - 1;
            due |= woke;
            outcomes[i] = match outcome.as_deref() {
                Some("queued") => {
                    namespace::recheck_key(batch.keys[i].text, "enqueue_keys");
                    Some(Enqueued::Queued)
                }
                Some("requeued") => Some(Enqueued::Requeued),
                Some("cached") => Some(Enqueued::Cached),
                Some("duplicate") => Some(Enqueued::Duplicate),
                Some(other) => error!("pg_once: enqueue_keys' statement answered {other}"),
                None => {
                    left.push(ord);
                    None
                }
            };
        }
        if left.is_empty() {
            break;
        }
        pending = Some(left);
    }
    if due {
        has_work(batch.queue.name);
    }
    outcomes
        .into_iter()
        .map(|o| {
            o.unwrap_or_else(|| {
                errors::raise(
                    pgrx::PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
                    format!("enqueue_keys: other transactions kept writing some of its keys ({ENQUEUE_ROUNDS} tries)"),
                    "Call enqueue_keys again: every key's outcome is decided anew.",
                )
            })
        })
        .collect()
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
    standby::refuse_writes("claim_next");
    let me = Me::new(worker, owner);
    // The owner's identity must be registered before its claims are visible to others.
    owner.before_claiming(None);
    let args = params![queue = queue, n = n as i64]
        .into_iter()
        .chain(claimant_params(&me, lease));
    let claimed = statements::run(&CLAIM_NEXT, args, |table| {
        let mut claimed = Vec::with_capacity(table.len());
        if table.is_empty() {
            return Ok(claimed);
        }
        let column = |name| table.column_ordinal(name);
        let [key, token, payload, attempts, key_hash] = [
            column("key")?,
            column("token")?,
            column("payload")?,
            column("attempts")?,
            column("key_hash")?,
        ];
        for row in table {
            let digest: &[u8] = row.get(key_hash)?.expect("key_hash is NOT NULL");
            if owner == Owner::ThisBackend {
                liveness::own(crate::key::tag_of(digest));
            }
            claimed.push(Claimed {
                key: row.get(key)?.expect("key is NOT NULL"),
                token: row.get(token)?.expect("token is NOT NULL"),
                payload: row.get(payload)?,
                attempt: row.get(attempts)?.unwrap_or(1),
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
        budget,
        || claim_next(queue, lease, worker, owner, n),
        |claimed| !claimed.is_empty(),
    )
}

// The earliest run_at of a queue, read as the first index entry of each (errors, priority)
// group of entries_queue_idx, one probe a group (a loose index scan): min(run_at) over the
// queue read every queued key's row, since run_at is not the index's second column.
static NEXT_DUE: Statement = Statement::new(
    "WITH RECURSIVE firsts AS (
         (SELECT errors, priority, run_at FROM once.entries
           WHERE state = 'queued' AND queue = $queue
           ORDER BY errors, priority, run_at LIMIT 1)
         UNION ALL
         SELECT n.errors, n.priority, n.run_at
           FROM firsts f,
                LATERAL (SELECT errors, priority, run_at FROM once.entries
                          WHERE state = 'queued' AND queue = $queue
                            AND (errors, priority) > (f.errors, f.priority)
                          ORDER BY errors, priority, run_at LIMIT 1) n)
     SELECT min(run_at) FROM firsts",
);

/// When the earliest queued key of `queue` is due (None: nothing is queued), read in a
/// subtransaction that is rolled back, so that a waiting worker keeps no lock.
pub fn next_due(queue: &str, budget: LockBudget) -> Result<Option<TimestampWithTimeZone>, Blocked> {
    subxact::keep_if(
        budget,
        || {
            let args = params![queue = queue];
            statements::run(&NEXT_DUE, args, |table| table.first().get(1))
        },
        |_| false,
    )
}

pub fn invalidate_many(queue: Option<&str>, prefix: Option<&str>) -> i64 {
    standby::refuse_writes("invalidate_keys");
    let args = params![queue = queue, prefix = prefix];
    let n = statements::run(&INVALIDATE_MANY, args, |table| Ok(table.len() as i64));
    shmem::count_n(Counter::Invalidated, n as u64);
    n
}

/// Complete several claims in one statement; returns the keys that were completed.
pub fn complete_many(
    keys: &[Key],
    tokens: Vec<i64>,
    results: JsonbArray,
    policy: &Policy,
) -> Vec<String> {
    standby::refuse_writes("complete_keys");
    let key_hashes: Vec<Vec<u8>> = keys.iter().map(Key::digest).collect();
    let args = params![
        key_hashes = key_hashes,
        tokens = tokens,
        holder = namespace::token_holder(),
        results = results,
    ]
    .into_iter()
    .chain(policy.params());
    let done: Vec<String> = statements::run(&COMPLETE_MANY, args, |table| {
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
