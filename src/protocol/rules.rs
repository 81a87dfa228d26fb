//! The protocol's rules that more than one statement applies, each written once as a piece
//! of SQL text that the statements of claim.rs and queue.rs splice in with `concat!`
//! (compile-time text: the plans see plain SQL).
//!
//! Macros rather than constants because `concat!` takes only literals. The column rules
//! take the table alias (`""` or `"e."`) of the row they describe.

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
/// `$lease` from now. Pass claim::claimant_params for these five parameters.
macro_rules! claimant_columns {
    () => {
        "state, token, owner, owner_pid, owner_started, lease_only, lease_expires_at, \
         claimed_at, updated_at"
    };
}
macro_rules! claimant_values {
    () => {
        concat!(
            "'running', ",
            internal!("next_token()"),
            ", $owner, $owner_pid, $owner_started, \
             $lease_only, clock_timestamp() + $lease, clock_timestamp(), clock_timestamp()"
        )
    };
}

/// SET list of a completed claim: `$result` (an expression) is served until `$ttl` from
/// now (NULL: until invalidated).
macro_rules! completed {
    ($result:literal) => {
        concat!(
            "state = 'done', result = ",
            $result,
            ", expires_at = clock_timestamp() + $ttl,
            completed_at = clock_timestamp(), updated_at = clock_timestamp(),
            lease_expires_at = NULL, error = NULL, retry_at = NULL,
            last_outcome = 'completed'"
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
macro_rules! retry_policy {
    () => {
        "e.queue IS NOT NULL AS queued_key,
         e.attempts >= coalesce(e.max_attempts, q.max_attempts, 1) AS dead,
         least(q.max_backoff, q.backoff * power(2, greatest(e.attempts - 1, 0)))
             * (0.5 + random() / 2) AS backoff"
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
            "queued_key THEN clock_timestamp() + ",
            $retry_after,
            "
                             WHEN ",
            $p,
            "dead THEN 'infinity' END,
             run_at = CASE WHEN ",
            $p,
            "queued_key AND NOT ",
            $p,
            "dead
                           THEN clock_timestamp() + greatest(",
            $retry_after,
            ", ",
            $p,
            "backoff)
                           ELSE e.run_at END,
             errors = e.errors + 1, lease_expires_at = NULL, updated_at = clock_timestamp()"
        )
    };
}

pub(crate) use {
    claimant_columns, claimant_values, completed, failed_attempt, owner_gone, owner_gone_error,
    retry_policy,
};
