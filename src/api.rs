//! The SQL surface: the functions CREATE EXTENSION declares in sql/functions.sql.
//!
//! Every function here is `sql = false`: its CREATE FUNCTION statement (defaults,
//! SECURITY DEFINER, pinned search_path, comment) is hand-written next to the others in
//! sql/functions.sql. Arguments arrive as Options so that NULL gets the documented
//! 22004 error instead of a silent NULL result.

use crate::args;
use crate::claim::{self, Claim, LockBudget};
use crate::entry;
use crate::errors;
use crate::jsonb::Jsonb;
use crate::key::Key;
use crate::liveness::{self, Owner};
use crate::queue;
use crate::wait;
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgTupleDesc;

#[pg_extern(sql = false)]
fn claim_key(
    key: Option<&str>,
    lease: Option<Interval>,
    wait: Option<Interval>,
    owner_pid: Option<i32>,
    fcinfo: pg_sys::FunctionCallInfo,
) -> pgrx::composite_type!('static, "claim") {
    errors::plain(|| {
        let key = Key::new(key);
        let lease = args::lease(lease);
        let wait_micros = args::wait(wait);
        let owner = Owner::from_arg(owner_pid);
        let claim = if wait_micros > 0 {
            refuse_wait_under_snapshot_isolation("claim_key");
            wait::claim_waiting(&key, lease, owner, wait_micros)
        } else {
            let mut watch = liveness::OwnerWatch::default();
            // wait => 0 never waits for a lock: an uncommitted claim answers `wait` at once.
            claim::attempt(&key, lease, owner, &mut watch, LockBudget(1))
        };
        claim_row(fcinfo, claim)
    })
}

/// once.owner_session(): see liveness::become_owner_session.
#[pg_extern(sql = false)]
fn owner_session() -> i32 {
    errors::plain(liveness::become_owner_session)
}

/// complete_key(key text, token bigint, result jsonb, ttl interval). `result` and `ttl` are
/// read from fcinfo: the result is passed through as the jsonb datum it already is.
#[pg_extern(sql = false)]
fn complete_key(key: Option<&str>, token: Option<i64>, fcinfo: pg_sys::FunctionCallInfo) -> bool {
    errors::plain(|| {
        let key = Key::new(key);
        let token = args::token(token);
        // SAFETY: functions.sql declares argument 2 as jsonb and argument 3 as interval.
        let (result, ttl) = unsafe {
            (
                pgrx::fcinfo::pg_getarg::<Jsonb>(fcinfo, 2),
                pgrx::fcinfo::pg_getarg::<Interval>(fcinfo, 3),
            )
        };
        let result = args::required(
            result,
            "result",
            "Pass the computed value as jsonb; to cache \"nothing\", pass 'null'::jsonb.",
        );
        let ttl = args::ttl(ttl);
        claim::complete(&key, token, result, ttl)
    })
}

#[pg_extern(sql = false)]
fn fail_key(
    key: Option<&str>,
    token: Option<i64>,
    error: Option<String>,
    retry_after: Option<Interval>,
) -> bool {
    errors::plain(|| {
        let key = Key::new(key);
        let token = args::token(token);
        let error = args::required(
            error,
            "error",
            "Describe what went wrong, e.g. the upstream error message.",
        );
        let retry_after = args::retry_after(retry_after);
        claim::fail(&key, token, error, retry_after)
    })
}

#[pg_extern(sql = false)]
fn heartbeat_key(
    key: Option<&str>,
    token: Option<i64>,
    lease: Option<Interval>,
) -> Option<TimestampWithTimeZone> {
    errors::plain(|| {
        let key = Key::new(key);
        let token = args::token(token);
        let lease = args::lease(lease);
        claim::heartbeat(&key, token, lease)
    })
}

#[pg_extern(sql = false)]
fn release_key(key: Option<&str>, token: Option<i64>) -> bool {
    errors::plain(|| {
        let key = Key::new(key);
        let token = args::token(token);
        claim::release(&key, token)
    })
}

#[pg_extern(sql = false)]
fn invalidate_key(key: Option<&str>) -> bool {
    errors::plain(|| {
        let key = Key::new(key);
        claim::invalidate(&key)
    })
}

#[pg_extern(sql = false)]
fn reap_stale() -> TableIterator<
    'static,
    (
        name!(reclaimed, i64),
        name!(expired, i64),
        name!(history, i64),
    ),
> {
    errors::plain(|| {
        let reaped = claim::reap();
        TableIterator::once((reaped.reclaimed, reaped.expired, reaped.history))
    })
}

// ---- queue mode -------------------------------------------------------------------

#[pg_extern(sql = false)]
fn create_queue(
    name: Option<&str>,
    max_attempts: Option<i32>,
    backoff: Option<Interval>,
    max_backoff: Option<Interval>,
) {
    errors::plain(|| {
        let name = args::new_queue_name(name);
        let max_attempts = args::required(
            args::max_attempts(max_attempts),
            "max_attempts",
            "Pass how many times a key may be tried before it stays failed, e.g. 5.",
        );
        let (backoff, max_backoff) = args::backoff(backoff, max_backoff);
        queue::upsert_queue(name, max_attempts, backoff, max_backoff);
    })
}

#[pg_extern(sql = false)]
fn drop_queue(name: Option<&str>) {
    errors::plain(|| {
        let name = args::queue(name);
        let keys = queue::keys_in_queue(name);
        if keys > 0 {
            errors::object_in_use(
                format!("queue \"{name}\" still has {keys} keys"),
                &format!(
                    "Remove them first: SELECT once.invalidate_keys(queue => '{}');",
                    name.replace('\'', "''")
                ),
            );
        }
        queue::drop_queue(name);
    })
}

/// enqueue_key(key, payload, queue, priority, run_at, refresh, max_attempts). The
/// arguments after `key` are read from fcinfo: `payload` must pass through as the jsonb it
/// already is, and typed parameters after it would have to come before it.
#[pg_extern(sql = false)]
fn enqueue_key(key: Option<&str>, fcinfo: pg_sys::FunctionCallInfo) -> &'static str {
    errors::plain(|| {
        let key = Key::new(key);
        // SAFETY: functions.sql declares the arguments in this order and with these types.
        let (payload, queue, priority, run_at, refresh, max_attempts) = unsafe {
            use pgrx::fcinfo::pg_getarg;
            (
                pg_getarg::<Jsonb>(fcinfo, 1),
                pg_getarg::<&str>(fcinfo, 2),
                pg_getarg::<i32>(fcinfo, 3),
                pg_getarg::<TimestampWithTimeZone>(fcinfo, 4),
                pg_getarg::<bool>(fcinfo, 5),
                pg_getarg::<i32>(fcinfo, 6),
            )
        };
        let job = queue::Job {
            key: &key,
            payload,
            queue: args::queue(queue),
            priority: args::required(
                priority,
                "priority",
                "Pass an integer; smaller runs first, default 0.",
            ),
            run_at: args::run_at(run_at),
            max_attempts: args::max_attempts(max_attempts),
        };
        let refresh = args::required(
            refresh,
            "refresh",
            "Pass true to recompute a key that has a fresh result, else false.",
        );
        match queue::enqueue(&job, refresh) {
            queue::Enqueued::Queued => "queued",
            queue::Enqueued::Requeued => "requeued",
            queue::Enqueued::Duplicate => "duplicate",
            queue::Enqueued::Cached => "cached",
        }
    })
}

#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn claim_next(
    queue: Option<&str>,
    lease: Option<Interval>,
    worker: Option<&str>,
    n: Option<i32>,
    wait: Option<Interval>,
    owner_pid: Option<i32>,
) -> TableIterator<
    'static,
    (
        name!(key, String),
        name!(token, i64),
        name!(payload, Option<Jsonb>),
        name!(attempt, i32),
    ),
> {
    errors::plain(|| {
        let queue = args::queue(queue);
        let lease = args::lease(lease);
        let worker = args::worker(worker);
        let n = args::batch_size(n);
        let wait_micros = args::wait(wait);
        let owner = Owner::from_arg(owner_pid);
        let claimed = if wait_micros > 0 {
            refuse_wait_under_snapshot_isolation("claim_next");
            wait::claim_next_waiting(queue, lease, worker, owner, n, wait_micros)
        } else {
            queue::claim_next(queue, lease, worker, owner, n)
        };
        TableIterator::new(
            claimed
                .into_iter()
                .map(|c| (c.key, c.token, c.payload, c.attempt)),
        )
    })
}

#[pg_extern(sql = false)]
fn invalidate_keys(queue: Option<&str>, prefix: Option<&str>) -> i64 {
    errors::plain(|| {
        if queue.is_none() && prefix.is_none() {
            errors::invalid_argument(
                "invalidate_keys needs a queue or a key prefix".into(),
                "Pass queue => 'name' and/or prefix => 'https://example.com/'.",
            );
        }
        let queue = queue.map(|q| args::queue(Some(q)));
        if prefix == Some("") {
            errors::invalid_argument(
                "prefix must not be empty".into(),
                "Pass a key prefix such as 'https://example.com/', or only a queue.",
            );
        }
        queue::invalidate_many(queue, prefix)
    })
}

/// complete_keys(keys text[], tokens bigint[], results jsonb[], ttl interval). `results`
/// is passed through as the jsonb[] it already is.
#[pg_extern(sql = false)]
fn complete_keys(
    keys: Option<Vec<Option<String>>>,
    tokens: Option<Vec<Option<i64>>>,
    fcinfo: pg_sys::FunctionCallInfo,
) -> TableIterator<'static, (name!(key, String),)> {
    errors::plain(|| {
        let hint = "Pass three arrays of the same length: keys, their tokens, their results.";
        let keys = args::required(keys, "keys", hint);
        let tokens = args::required(tokens, "tokens", hint);
        // SAFETY: functions.sql declares argument 2 as jsonb[] and argument 3 as interval.
        let (results, ttl) = unsafe {
            (
                pgrx::fcinfo::pg_getarg_datum(fcinfo, 2),
                pgrx::fcinfo::pg_getarg::<Interval>(fcinfo, 3),
            )
        };
        let results = args::required(results, "results", hint);
        let (length, has_null) = queue::jsonb_array_shape(results);
        if keys.len() != tokens.len() || keys.len() != length {
            errors::invalid_argument(
                format!(
                    "keys, tokens and results have {}, {} and {length} elements",
                    keys.len(),
                    tokens.len()
                ),
                hint,
            );
        }
        if has_null {
            errors::null_argument("results[i]", hint);
        }
        let keys: Vec<String> = keys
            .into_iter()
            .map(|k| args::required(k, "keys[i]", hint))
            .collect();
        let keys: Vec<Key> = keys.iter().map(|k| Key::new(Some(k.as_str()))).collect();
        let tokens: Vec<i64> = tokens.into_iter().map(args::token).collect();
        let ttl = args::ttl(ttl);
        let done = queue::complete_many(&keys, tokens, results, ttl);
        TableIterator::new(done.into_iter().map(|k| (k,)))
    })
}
#[pg_extern(sql = false)]
fn backend_alive(pid: Option<i32>, started: Option<TimestampWithTimeZone>) -> Option<bool> {
    Some(liveness::backend_alive(pid?, started?.into_inner()))
}

/// claim_next's filter: see entry::taken.
#[pg_extern(sql = false)]
fn row_taken(tid: Option<pg_sys::ItemPointerData>) -> Option<bool> {
    Some(entry::taken(tid?))
}

/// How pg_once runs in this server, and its counters since start (NULL without shared
/// memory). Feeds the once.stats view.
#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn runtime() -> TableIterator<
    'static,
    (
        name!(shared_memory, bool),
        name!(notify, String),
        name!(workers, Option<i32>),
        name!(counters, Option<Vec<i64>>),
    ),
> {
    let shared = crate::shmem::shared();
    let notify = match crate::guc::NOTIFY.get() {
        crate::guc::NotifyMode::Relay if shared.is_some() => "relay",
        crate::guc::NotifyMode::Off => "off",
        _ => "direct",
    };
    let counters = crate::shmem::counters().map(|c| c.iter().map(|&v| v as i64).collect());
    TableIterator::once((
        shared.is_some(),
        notify.to_owned(),
        shared.map(|s| s.workers_running()),
        counters,
    ))
}

/// A waiting claim needs to see other sessions' commits, which a REPEATABLE READ or
/// SERIALIZABLE snapshot never shows: it would always wait out its full time.
fn refuse_wait_under_snapshot_isolation(function: &str) {
    // SAFETY: reads the current transaction's isolation level.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        errors::not_supported(
            format!("{function} cannot wait inside a REPEATABLE READ or SERIALIZABLE transaction"),
            &format!("Call {function} with wait in its own READ COMMITTED transaction (autocommit), or pass wait => '0'."),
        );
    }
}

/// Build the once.claim row this call returns.
fn claim_row(
    fcinfo: pg_sys::FunctionCallInfo,
    claim: Claim,
) -> PgHeapTuple<'static, AllocatedByRust> {
    let text = |s: Option<String>| s.and_then(IntoDatum::into_datum);
    let ts = |t: Option<TimestampWithTimeZone>| t.and_then(IntoDatum::into_datum);
    // outcome, token, result, error, owner, lease_expires_at, attempts, retry_at, expires_at
    let datums: [Option<pg_sys::Datum>; 9] = match claim {
        Claim::Hit {
            token,
            result,
            expires_at,
            attempts,
        } => [
            "hit".into_datum(),
            token.into_datum(),
            result.into_datum(),
            None,
            None,
            None,
            attempts.into_datum(),
            None,
            ts(expires_at),
        ],
        Claim::Claimed {
            token,
            owner,
            lease_expires_at,
            attempts,
        } => [
            "claimed".into_datum(),
            token.into_datum(),
            None,
            None,
            owner.into_datum(),
            lease_expires_at.into_datum(),
            attempts.into_datum(),
            None,
            None,
        ],
        Claim::Wait {
            token,
            owner,
            lease_expires_at,
            attempts,
            ..
        } => [
            "wait".into_datum(),
            token.and_then(IntoDatum::into_datum),
            None,
            None,
            text(owner),
            ts(lease_expires_at),
            attempts.and_then(IntoDatum::into_datum),
            None,
            None,
        ],
        Claim::Failed {
            token,
            error,
            retry_at,
            attempts,
        } => [
            "failed".into_datum(),
            token.into_datum(),
            None,
            text(error),
            None,
            None,
            attempts.into_datum(),
            ts(retry_at),
            None,
        ],
    };
    // SAFETY: the declared result type of the calling function is once.claim, whose nine
    // columns are listed above in order with matching types.
    unsafe {
        let mut tupdesc: pg_sys::TupleDesc = std::ptr::null_mut();
        let kind = pg_sys::get_call_result_type(fcinfo, std::ptr::null_mut(), &mut tupdesc);
        if kind != pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE {
            error!("pg_once: claim_key must be declared to return once.claim");
        }
        PgHeapTuple::from_datums(PgTupleDesc::from_pg_copy(tupdesc), datums)
            .unwrap_or_else(|e| error!("pg_once: cannot build once.claim: {e}"))
    }
}
