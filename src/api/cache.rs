//! The cache functions: claim_key and what an owner does with its claim.

use super::args;
use super::{body, claim_owner, refuse_wait_under_snapshot_isolation, usable_key};
use crate::key::Key;
use crate::protocol::cached;
use crate::protocol::claim::{self, Claim, Kept, Taken};
use crate::protocol::{reap, rerun, resolve, waiting};
use crate::runtime::liveness;
use crate::storage::jsonb::Jsonb;
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgTupleDesc;
use std::cell::RefCell;

/// Named for the release of its signature: 0.3.0 added `fingerprint` to 0.2.0's
/// claim_key (symbol claim_key_0_2_wrapper, which added `serve_stale` to 0.1.0's
/// claim_key_wrapper; CONTRIBUTING.md, "Upgrades").
#[pg_extern(sql = false)]
fn claim_key_0_3(
    key: Option<&str>,
    lease: Option<Interval>,
    wait: Option<Interval>,
    owner_pid: Option<i32>,
    serve_stale: Option<bool>,
    fingerprint: Option<&[u8]>,
    fcinfo: pg_sys::FunctionCallInfo,
) -> pgrx::composite_type!('static, "claim") {
    body(|| {
        let key = usable_key(key, "claim_key");
        let lease = args::lease(lease);
        let wait_micros = args::wait(wait);
        let owner = claim_owner(owner_pid);
        let serve_stale = args::required(
            serve_stale,
            "serve_stale",
            "Pass true to be answered refresh and stale (see Freshness), false for the four outcomes of pg_once 0.1.",
        );
        let fingerprint = args::fingerprint(fingerprint);
        if wait_micros > 0 {
            refuse_wait_under_snapshot_isolation("claim_key");
        }
        let claim = waiting::claim_key(&key, lease, owner, wait_micros, serve_stale, fingerprint);
        claim_row(fcinfo, claim)
    })
}

/// once.get(key): a fresh result, or NULL where claim_key would answer anything but hit
/// (protocol::claim::get). A scalar in the target list: claim_key's row, read as
/// `SELECT ... FROM once.claim_key(...)`, costs a FunctionScan and a tuplestore per call,
/// which kept a claim_key hit at 0.70-0.76x a primary-key SELECT; get measured 0.91-0.97x
/// (issue 25).
#[pg_extern(sql = false)]
fn get(key: Option<&str>) -> Option<Jsonb> {
    body(|| claim::get(&usable_key(key, "get")))
}

/// once.owner_session(): see liveness::become_owner_session.
#[pg_extern(sql = false)]
fn owner_session() -> i32 {
    body(liveness::become_owner_session)
}

/// Named for the release of its signature: 0.2.0 added `stale`, `beta` and `jitter` to
/// 0.1.0's complete_key (symbol complete_key_wrapper).
#[pg_extern(sql = false)]
fn complete_key_0_2(
    key: Option<&str>,
    token: Option<i64>,
    result: Option<Jsonb>,
    ttl: Option<Interval>,
    stale: Option<Interval>,
    beta: Option<f64>,
    jitter: Option<f64>,
) -> bool {
    body(|| {
        let (key, token) = claim_of(key, token, "complete_key");
        let result = args::required(
            result,
            "result",
            "Pass the computed value as jsonb; to cache \"nothing\", pass 'null'::jsonb.",
        );
        args::result_size(result.size(), "result");
        let policy = args::policy(ttl, stale, beta, jitter);
        resolve::complete(&key, token, result, &policy)
    })
}

#[pg_extern(sql = false)]
fn fail_key(
    key: Option<&str>,
    token: Option<i64>,
    error: Option<String>,
    retry_after: Option<Interval>,
) -> bool {
    body(|| {
        let (key, token) = claim_of(key, token, "fail_key");
        let error = args::required(
            error,
            "error",
            "Describe what went wrong, e.g. the upstream error message.",
        );
        args::error_size(&error);
        let retry_after = args::retry_after(retry_after);
        resolve::fail(&key, token, error, retry_after)
    })
}

#[pg_extern(sql = false)]
fn heartbeat_key(
    key: Option<&str>,
    token: Option<i64>,
    lease: Option<Interval>,
) -> Option<TimestampWithTimeZone> {
    body(|| {
        let (key, token) = claim_of(key, token, "heartbeat_key");
        let lease = args::lease(lease);
        resolve::heartbeat(&key, token, lease)
    })
}

#[pg_extern(sql = false)]
fn release_key(key: Option<&str>, token: Option<i64>) -> bool {
    body(|| {
        let (key, token) = claim_of(key, token, "release_key");
        resolve::release(&key, token)
    })
}

#[pg_extern(sql = false)]
fn invalidate_key(key: Option<&str>) -> bool {
    body(|| rerun::invalidate(&usable_key(key, "invalidate_key")))
}

#[pg_extern(sql = false)]
fn refresh_key(key: Option<&str>, stale: Option<Interval>) -> &'static str {
    body(|| {
        let key = usable_key(key, "refresh_key");
        let stale = args::stale(stale);
        match rerun::request_refresh(&key, stale) {
            rerun::Refreshed::Absent => "absent",
            rerun::Refreshed::Expired => "expired",
            rerun::Refreshed::Rerun => "rerun",
            rerun::Refreshed::Pending => "pending",
        }
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
    body(|| {
        let reaped = reap::reap();
        TableIterator::once((reaped.reclaimed, reaped.expired, reaped.history))
    })
}

/// The claim an owner's call names: its key and fencing token, checked.
fn claim_of<'a>(key: Option<&'a str>, token: Option<i64>, function: &str) -> (Key<'a>, i64) {
    (usable_key(key, function), args::token(token))
}

/// The once.claim row this call returns, each value set by its column's name.
fn claim_row(
    fcinfo: pg_sys::FunctionCallInfo,
    claim: Claim,
) -> PgHeapTuple<'static, AllocatedByRust> {
    let mut row = ClaimRow::for_call(fcinfo);
    let (outcome, token, attempts) = match claim {
        // Only a claim this call took carries a token (`set_taken`): a hit may be served
        // while the key is refreshed, and the entry's token is then the refresher's, which
        // would let whoever holds it end that claim; a failure's token is its owner's.
        Claim::Hit {
            result,
            expires_at,
            attempts,
        } => {
            row.set("result", result);
            row.set("expires_at", expires_at);
            ("hit", None, Some(attempts))
        }
        Claim::Claimed { taken, kept } => {
            if let Some(kept) = kept {
                row.set_kept(kept);
            }
            row.set_taken("claimed", taken)
        }
        Claim::Refresh { taken, kept } => {
            row.set_kept(kept);
            row.set_taken("refresh", taken)
        }
        // A waiter is told who computes the key and until when, never the running claim's
        // token (nor is a stale answer).
        Claim::Wait {
            owner,
            lease_expires_at,
            attempts,
            ..
        } => {
            row.set("owner", owner);
            row.set("lease_expires_at", lease_expires_at);
            ("wait", None, attempts)
        }
        Claim::Failed {
            error,
            retry_at,
            attempts,
        } => {
            row.set("error", error);
            row.set("retry_at", retry_at);
            ("failed", None, Some(attempts))
        }
        Claim::Stale {
            owner,
            lease_expires_at,
            result,
            expires_at,
            error,
            attempts,
            ..
        } => {
            row.set("owner", owner);
            row.set("lease_expires_at", lease_expires_at);
            row.set("result", result);
            row.set("expires_at", expires_at);
            row.set("error", error);
            ("stale", None, Some(attempts))
        }
        // Says nothing of the key: the caller's request is not the one it stands for.
        Claim::Mismatch => ("mismatch", None, None),
    };
    row.set("outcome", outcome);
    row.set("token", token);
    row.set("attempts", attempts);
    row.build()
}

/// A row of the calling function's composite result type (once.claim), built by column
/// name: columns not set are NULL.
struct ClaimRow {
    tupdesc: PgTupleDesc<'static>,
    datums: Vec<Option<pg_sys::Datum>>,
}

thread_local! {
    /// The columns (name, type) of the once.claim type with this oid: looked up once per
    /// backend rather than by scanning attribute names on every cache hit.
    static COLUMNS: RefCell<(pg_sys::Oid, Vec<(String, pg_sys::Oid)>)> =
        const { RefCell::new((pg_sys::InvalidOid, Vec::new())) };
}

impl ClaimRow {
    fn for_call(fcinfo: pg_sys::FunctionCallInfo) -> ClaimRow {
        // SAFETY: asks PostgreSQL for the declared result type of the running function.
        let tupdesc = unsafe {
            let mut tupdesc: pg_sys::TupleDesc = std::ptr::null_mut();
            let kind = pg_sys::get_call_result_type(fcinfo, std::ptr::null_mut(), &mut tupdesc);
            if kind != pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE {
                error!("pg_once: claim_key must be declared to return once.claim");
            }
            PgTupleDesc::from_pg_copy(tupdesc)
        };
        COLUMNS.with_borrow_mut(|(type_oid, columns)| {
            if *type_oid != tupdesc.tdtypeid {
                *columns = tupdesc
                    .iter()
                    .map(|a| (a.name().to_owned(), a.atttypid))
                    .collect();
                *type_oid = tupdesc.tdtypeid;
            }
        });
        let datums = vec![None; tupdesc.len()];
        ClaimRow { tupdesc, datums }
    }

    /// Set `column`, which must exist with the SQL type of `T`.
    fn set<T: IntoDatum>(&mut self, column: &str, value: T) {
        let found = COLUMNS.with_borrow(|(_, columns)| {
            columns
                .iter()
                .position(|(name, oid)| name == column && *oid == T::type_oid())
        });
        match found {
            Some(i) => self.datums[i] = value.into_datum(),
            None => error!("pg_once: once.claim has no column {column} of the type this call sets"),
        }
    }

    /// The columns of a claim this call took; its outcome, token and attempts.
    fn set_taken(
        &mut self,
        outcome: &'static str,
        taken: Taken,
    ) -> (&'static str, Option<i64>, Option<i32>) {
        self.set("owner", taken.owner);
        self.set("lease_expires_at", taken.lease_expires_at);
        (outcome, Some(taken.token), Some(taken.attempts))
    }

    /// The result a refresh keeps, served to others meanwhile.
    fn set_kept(&mut self, kept: Kept) {
        self.set("result", kept.result);
        self.set("expires_at", kept.expires_at);
    }

    fn build(self) -> PgHeapTuple<'static, AllocatedByRust> {
        // SAFETY: each datum was checked against its column's type in `set`.
        unsafe { PgHeapTuple::from_datums(self.tupdesc, self.datums) }
            .unwrap_or_else(|e| error!("pg_once: cannot build once.claim: {e}"))
    }
}

/// once.cached_key(key, query): the key once.cached keeps `query`'s rows under, for the
/// calling role and search_path (protocol::cached). 42601 unless `query` is one SELECT.
#[pg_extern(sql = false)]
fn cached_key(key: Option<&str>, query: Option<&str>) -> String {
    body(|| {
        let key = args::key(key);
        let query = args::required(
            query,
            "query",
            "Pass the query whose rows are to be cached, e.g. 'SELECT ... FROM ...'.",
        );
        cached::key_for(key, query)
    })
}
