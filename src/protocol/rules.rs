//! The protocol's rules that more than one statement applies, each written once as a piece
//! of SQL text that the statements of the protocol splice in with `concat!`
//! (compile-time text: the plans see plain SQL).
//!
//! Macros rather than constants because `concat!` takes only literals. The column rules
//! take the table alias (`""` or `"e."`) of the row they describe.

use crate::protocol::namespace;
use crate::runtime::liveness::Me;
use crate::storage::statements::{params, Param};
use pgrx::datum::Interval;

/// A running claim's owner is gone: its lease ran out, or (unless its claim is lease-only)
/// the backend it names is no longer the one that made the claim (once_internal.backend_alive).
/// The same test, made from Rust on a row already read, is claim::running_owner_status.
macro_rules! owner_gone {
    ($row:literal) => {
        concat!(
            "(",
            $row,
            "lease_expires_at <= clock_timestamp() OR (NOT ",
            $row,
            "lease_only AND NOT ",
            internal!("backend_alive"),
            "(",
            $row,
            "owner_pid, ",
            $row,
            "owner_started)))"
        )
    };
}

/// The error recorded when a claim whose owner is gone ends: `$how` is "taken over" or
/// "reaped", `why` an expression saying what made the owner count as gone.
macro_rules! owner_gone_error {
    ($row:literal, $why:literal, $how:literal) => {
        concat!(
            "format('owner %s (token %s) is gone: %s; claim ",
            $how,
            "', ",
            $row,
            "owner, ",
            $row,
            "token, ",
            $why,
            ")"
        )
    };
}

/// What a claim writes, as the columns and the values of a row constructor: the key
/// becomes running under a new token from the one sequence, owned by `$owner` (a label),
/// judged alive by `$owner_pid`/`$owner_started` unless `$lease_only`, until
/// `$lease` from now, made by role `$owner_role` (see token_holder). Pass
/// claimant_params for these six parameters.
macro_rules! claimant_columns {
    () => {
        "state, token, owner, owner_pid, owner_started, lease_only, lease_expires_at, \
         claimed_at, updated_at, rerun, rerun_stale, owner_role"
    };
}
macro_rules! claimant_values {
    () => {
        concat!(
            "'running', ",
            internal!("next_token()"),
            ", $owner, $owner_pid, $owner_started, \
             $lease_only, clock_timestamp() + $lease, clock_timestamp(), clock_timestamp(), \
             NULL, NULL, $owner_role"
        )
    };
}

/// Who may act on a claim with its token (complete, fail, heartbeat, release): the role
/// that made it (`owner_role`), exactly, or anyone when `$holder` is NULL (an
/// administrator: namespace::token_holder), or anyone for a claim older than the column.
/// Tokens come from one sequence, so a role can guess another's from its own; a guess
/// must not let it end or extend another role's claim (docs/security.md). `$alias` is the
/// table's alias with its dot, or "".
macro_rules! token_holder {
    ($alias:literal) => {
        concat!(
            "(",
            $alias,
            "owner_role = $holder OR ",
            $alias,
            "owner_role IS NULL OR $holder IS NULL)"
        )
    };
}

/// SET list of a completed claim (of `once.entries e`): `$result` (an expression) is
/// fresh until `$ttl` from now, shortened by up to `$jitter` of it (`draw`, a random
/// number in [0, 1), and `now` come from the row source `$d`), then served as stale for
/// `$stale` more; NULL ttl: fresh until invalidated. `$beta` is kept for early refreshes,
/// and the time since the claim as the computation's length (protocol::freshness).
///
/// A rerun requested during the run (rerun_requested) is carried out here: the result is
/// stored, but it expires at once (served as stale for rerun_stale, or not at all:
/// `discard`; `keep`: as completed) and a queued key goes back to its queue, due now, so
/// that the key is computed once more.
macro_rules! completed {
    ($result:literal, $d:literal) => {
        concat!(
            "state = CASE WHEN e.rerun IS NOT NULL AND e.queue IS NOT NULL THEN 'queued'
                          ELSE 'done' END::once.key_state,
            result = ",
            $result,
            ",
            expires_at = CASE WHEN e.rerun IN ('discard', 'stale') THEN ",
            $d,
            "now
                              ELSE ",
            $d,
            "now + $ttl * (1 - coalesce($jitter, 0) * ",
            $d,
            "draw) END,
            stale_until = CASE WHEN e.rerun = 'discard' THEN NULL
                               WHEN e.rerun = 'stale' THEN ",
            $d,
            "now + e.rerun_stale
                               ELSE ",
            $d,
            "now + $ttl * (1 - coalesce($jitter, 0) * ",
            $d,
            "draw) + $stale END,
            beta = $beta, compute_time = ",
            $d,
            "now - e.claimed_at,
            run_at = CASE WHEN e.rerun IS NOT NULL AND e.queue IS NOT NULL THEN ",
            $d,
            "now ELSE e.run_at END,
            attempts = CASE WHEN e.rerun IS NOT NULL AND e.queue IS NOT NULL THEN 0
                            ELSE e.attempts END,
            rerun = NULL, rerun_stale = NULL,
            completed_at = ",
            $d,
            "now, updated_at = ",
            $d,
            "now,
            lease_expires_at = NULL, error = NULL, retry_at = NULL,
            last_outcome = 'completed'"
        )
    };
}

/// The columns a completing UPDATE returns (`RETURNING`, of `once.entries e`) for
/// `completions_recorded!`. A completion changes none of them, so the new row's values are
/// the attempt's own.
macro_rules! ended_attempt_columns {
    () => {
        "e.key_hash, e.key, e.queue, e.token, e.owner, e.claimed_at"
    };
}

/// INSERT appending to once.attempts the attempts that completions ended, read from `$ended`
/// (a row source with the columns of `ended_attempt_columns!`); keys that were never
/// enqueued have no history.
///
/// Completions record their attempts themselves, right where they end them; the
/// entries_record_attempt trigger (schema.sql) records every other end (failures,
/// releases, takeovers, reaping, cancellation). A row trigger pays a PL/pgSQL call and an
/// INSERT executor for each key: 14% of a queue's server time with batches of 10
/// (bench/profiles/queue.svg). complete_keys records a batch with one INSERT in its own
/// statement; complete_key records a queued key with one more statement, and a cache key,
/// which has no history, costs nothing.
macro_rules! completions_recorded {
    ($ended:literal) => {
        concat!(
            "INSERT INTO once.attempts (key_hash, key, queue, token, worker, started_at, outcome)
             SELECT key_hash, key, queue, token, owner, claimed_at, 'completed'
               FROM ",
            $ended,
            " WHERE queue IS NOT NULL"
        )
    };
}

/// SET list recording a request to compute a running key once more when its run ends
/// (refresh_key, invalidate_key, enqueue_key with refresh). `$how` says what becomes of
/// the run's result: `keep` (served as completed: a queued key's previous result while it
/// is processed again), `stale` (served as stale for `$stale`) or `discard` (not served).
/// However many requests arrive they make one rerun: the strictest `how` wins, and the
/// shortest stale window.
macro_rules! rerun_requested {
    ($how:literal, $stale:literal) => {
        concat!(
            "rerun = CASE WHEN 'discard' IN (rerun, ",
            $how,
            ") THEN 'discard'
                          WHEN 'stale' IN (rerun, ",
            $how,
            ") THEN 'stale' ELSE 'keep' END,
             rerun_stale = least(CASE WHEN rerun = 'stale' THEN rerun_stale END,
                                 CASE WHEN ",
            $how,
            " = 'stale' THEN ",
            $stale,
            " END),
             updated_at = clock_timestamp()"
        )
    };
}

/// Columns of the retry policy of a key whose attempt failed, for a query over
/// `once.entries e LEFT JOIN once.queues q ON q.name = e.queue`:
/// - queued_key: it belongs to a queue, so it goes back there rather than serving the
///   failure;
/// - dead: that was its last attempt (max_attempts of the key, else of its queue);
/// - backoff: backoff * 2^(attempts - 1), capped at max_backoff, jittered to between half
///   and all of that (see once.create_queue).
/// - rerun: a recompute was requested during the attempt (rerun_requested): the key is
///   due (or claimable) again at once, with a new budget of attempts.
macro_rules! retry_policy {
    () => {
        "e.queue IS NOT NULL AS queued_key,
         e.rerun IS NOT NULL AS rerun,
         e.rerun IS NULL AND e.attempts >= coalesce(e.max_attempts, q.max_attempts, 1) AS dead,
         CASE WHEN e.rerun IS NOT NULL THEN '0'::interval
              ELSE least(q.max_backoff, q.backoff * power(2, greatest(e.attempts - 1, 0)))
                   * (0.5 + random() / 2) END AS backoff"
    };
}

/// SET list applying a retry_policy row `p` to a failed attempt: a key of no queue is
/// failed and serves its failure for `retry_after`; a queued key goes back to its queue
/// after its backoff (or `retry_after`, if longer), unless it is dead: then it stays
/// failed for good (retry_at = infinity: a dead letter, until enqueued again).
macro_rules! failed_attempt {
    ($p:literal, $retry_after:literal) => {
        concat!(
            "state = CASE WHEN ",
            $p,
            "queued_key AND NOT ",
            $p,
            "dead THEN 'queued'
                          ELSE 'failed' END::once.key_state,
             retry_at = CASE WHEN NOT ",
            $p,
            "queued_key THEN clock_timestamp() + CASE WHEN ",
            $p,
            "rerun THEN '0'::interval ELSE ",
            $retry_after,
            " END
                             WHEN ",
            $p,
            "dead THEN 'infinity' END,
             run_at = CASE WHEN ",
            $p,
            "queued_key AND NOT ",
            $p,
            "dead
                           THEN clock_timestamp() + CASE WHEN ",
            $p,
            "rerun THEN '0'::interval ELSE greatest(",
            $retry_after,
            ", ",
            $p,
            "backoff) END
                           ELSE e.run_at END,
             attempts = CASE WHEN ",
            $p,
            "rerun AND ",
            $p,
            "queued_key THEN 0 ELSE e.attempts END,
             rerun = NULL, rerun_stale = NULL,
             errors = e.errors + 1, lease_expires_at = NULL, updated_at = clock_timestamp()"
        )
    };
}

pub(crate) use {
    claimant_columns, claimant_values, completed, completions_recorded, ended_attempt_columns,
    failed_attempt, owner_gone, owner_gone_error, rerun_requested, retry_policy, token_holder,
};

/// The parameters of rules::claimant_values: who claims, and for how long.
pub fn claimant_params(me: &Me, lease: Interval) -> [Param<'static>; 6] {
    params![
        owner_role = namespace::caller(),
        owner = me.label.clone(),
        owner_pid = me.pid,
        owner_started = me.started_param(),
        lease_only = me.lease_only,
        lease = lease,
    ]
}
