//! The SQL surface: the functions CREATE EXTENSION declares in sql/functions.sql.
//!
//! Every function here is `sql = false`: its CREATE FUNCTION statement (defaults,
//! SECURITY DEFINER, pinned search_path, comment) is hand-written next to the others in
//! sql/functions.sql. Arguments arrive as Options so that NULL gets the documented
//! 22004 error instead of a silent NULL result.

use crate::args::{self, Key};
use crate::claim::{self, Claim};
use crate::errors;
use crate::jsonb::Jsonb;
use crate::liveness;
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
    fcinfo: pg_sys::FunctionCallInfo,
) -> pgrx::composite_type!('static, "claim") {
    let key = Key::new(key);
    let lease = args::lease(lease);
    let wait_micros = args::wait(wait);
    let claim = if wait_micros > 0 {
        refuse_wait_under_snapshot_isolation();
        wait::claim_waiting(&key, lease, wait_micros)
    } else {
        claim::attempt(&key, lease, &mut liveness::OwnerWatch::default())
    };
    claim_row(fcinfo, claim)
}

/// complete_key(key text, token bigint, result jsonb, ttl interval). `result` and `ttl` are
/// read from fcinfo: the result is passed through as the jsonb datum it already is.
#[pg_extern(sql = false)]
fn complete_key(key: Option<&str>, token: Option<i64>, fcinfo: pg_sys::FunctionCallInfo) -> bool {
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
}

#[pg_extern(sql = false)]
fn fail_key(
    key: Option<&str>,
    token: Option<i64>,
    error: Option<String>,
    retry_after: Option<Interval>,
) -> bool {
    let key = Key::new(key);
    let token = args::token(token);
    let error = args::required(
        error,
        "error",
        "Describe what went wrong, e.g. the upstream error message.",
    );
    let retry_after = args::retry_after(retry_after);
    claim::fail(&key, token, error, retry_after)
}

#[pg_extern(sql = false)]
fn heartbeat_key(
    key: Option<&str>,
    token: Option<i64>,
    lease: Option<Interval>,
) -> Option<TimestampWithTimeZone> {
    let key = Key::new(key);
    let token = args::token(token);
    let lease = args::lease(lease);
    claim::heartbeat(&key, token, lease)
}

#[pg_extern(sql = false)]
fn release_key(key: Option<&str>, token: Option<i64>) -> bool {
    let key = Key::new(key);
    let token = args::token(token);
    claim::release(&key, token)
}

#[pg_extern(sql = false)]
fn invalidate_key(key: Option<&str>) -> bool {
    let key = Key::new(key);
    claim::invalidate(&key)
}

#[pg_extern(sql = false)]
fn reap_stale() -> TableIterator<'static, (name!(reclaimed, i64), name!(expired, i64))> {
    let (reclaimed, expired) = claim::reap();
    TableIterator::once((reclaimed, expired))
}

#[pg_extern(sql = false)]
fn backend_alive(pid: Option<i32>, started: Option<TimestampWithTimeZone>) -> Option<bool> {
    Some(liveness::backend_alive(pid?, started?.into_inner()))
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
fn refuse_wait_under_snapshot_isolation() {
    // SAFETY: reads the current transaction's isolation level.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        errors::not_supported(
            "claim_key cannot wait inside a REPEATABLE READ or SERIALIZABLE transaction".into(),
            "Call claim_key with wait in its own READ COMMITTED transaction (autocommit), or pass wait => '0'.",
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
            token.into_datum(),
            None,
            None,
            text(owner),
            lease_expires_at.into_datum(),
            attempts.into_datum(),
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
