//! The queue functions: queues, enqueue_key, claim_next and the batch operations
//! (enqueue_keys, complete_keys, invalidate_keys).

use super::args;
use super::{body, claim_owner, refuse_wait_under_snapshot_isolation, usable_key};
use crate::errors;
use crate::key::Key;
use crate::protocol::{queue, waiting};
use crate::storage::jsonb::{Jsonb, JsonbArray};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::prelude::*;
use std::collections::HashMap;

/// Named for the release of its signature: 0.2.0 added `namespace` to 0.1.0's
/// create_queue (symbol create_queue_wrapper), which must never reach this code with one
/// argument fewer than it unboxes (CONTRIBUTING.md, "Upgrades").
#[pg_extern(sql = false)]
fn create_queue_0_2(
    name: Option<&str>,
    max_attempts: Option<i32>,
    backoff: Option<Interval>,
    max_backoff: Option<Interval>,
    namespace: Option<&str>,
) {
    body(|| {
        let name = args::new_queue_name(name);
        let max_attempts = args::required(
            args::max_attempts(max_attempts),
            "max_attempts",
            "Pass how many times a key may be tried before it stays failed, e.g. 5.",
        );
        let (backoff, max_backoff) = args::backoff(backoff, max_backoff);
        let namespace = namespace.map(|n| args::namespace_prefix(Some(n)));
        queue::upsert_queue(name, max_attempts, backoff, max_backoff, namespace);
    })
}

#[pg_extern(sql = false)]
fn drop_queue(name: Option<&str>) {
    body(|| {
        let name = queue::require(args::queue(name), "drop_queue").name;
        queue::drop_queue(name)
    })
}

#[pg_extern(sql = false)]
#[allow(clippy::too_many_arguments)]
fn enqueue_key(
    key: Option<&str>,
    payload: Option<Jsonb>,
    queue: Option<&str>,
    priority: Option<i32>,
    run_at: Option<TimestampWithTimeZone>,
    refresh: Option<bool>,
    max_attempts: Option<i32>,
) -> &'static str {
    body(|| {
        let key = usable_key(key, "enqueue_key");
        args::payload_size(payload);
        let queue = queue::require(args::queue(queue), "enqueue_key");
        let job = queue::Job {
            key: &key,
            payload,
            queue: &queue,
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
        outcome(queue::enqueue(&job, refresh))
    })
}

/// What a call of enqueue_keys answers for one key.
fn outcome(enqueued: queue::Enqueued) -> &'static str {
    match enqueued {
        queue::Enqueued::Queued => "queued",
        queue::Enqueued::Requeued => "requeued",
        queue::Enqueued::Duplicate => "duplicate",
        queue::Enqueued::Cached => "cached",
    }
}

/// enqueue_key for many keys in one statement. Every argument is checked, every key
/// against the caller's rights, before anything is written: a batch is refused whole.
#[pg_extern(sql = false)]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn enqueue_keys(
    keys: Option<Vec<Option<String>>>,
    payloads: Option<JsonbArray>,
    queue: Option<&str>,
    priority: Option<i32>,
    run_at: Option<TimestampWithTimeZone>,
    refresh: Option<bool>,
    max_attempts: Option<i32>,
) -> TableIterator<'static, (name!(key, String), name!(outcome, &'static str))> {
    body(|| {
        let hint = "Pass an array of keys, and optionally an array of as many payloads, the i-th for the i-th key.";
        let keys = args::required(keys, "keys", hint);
        if keys.len() > args::MAX_ENQUEUE_BATCH {
            errors::invalid_argument(
                format!(
                    "keys has {} elements; enqueue_keys takes at most {}",
                    keys.len(),
                    args::MAX_ENQUEUE_BATCH
                ),
                "Split the keys into batches of at most 1000.",
            );
        }
        let keys: Vec<String> = keys
            .into_iter()
            .enumerate()
            .map(|(i, k)| args::named_key(k.as_deref(), &format!("keys[{}]", i + 1)).to_owned())
            .collect();
        if let Some(payloads) = payloads {
            let shape = payloads.shape();
            if shape.length != keys.len() {
                errors::invalid_argument(
                    format!(
                        "keys and payloads have {} and {} elements",
                        keys.len(),
                        shape.length
                    ),
                    "Pass one payload per key (NULL for none), or payloads => NULL.",
                );
            }
            args::payloads_size(shape.largest);
        }
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            if let Some(first) = seen.insert(key, i + 1) {
                errors::invalid_argument(
                    format!("keys[{first}] and keys[{}] are both \"{key}\"", i + 1),
                    "Pass each key once: a key is enqueued once, with one payload.",
                );
            }
        }
        let queue = queue::require(args::queue(queue), "enqueue_keys");
        let priority = args::required(
            priority,
            "priority",
            "Pass an integer; smaller runs first, default 0.",
        );
        let run_at = args::run_at(run_at);
        let max_attempts = args::max_attempts(max_attempts);
        let refresh = args::required(
            refresh,
            "refresh",
            "Pass true to recompute keys that have a fresh result, else false.",
        );
        let checked: Vec<Key> = keys
            .iter()
            .map(|k| usable_key(Some(k.as_str()), "enqueue_keys"))
            .collect();
        let batch = queue::Batch {
            keys: &checked,
            payloads,
            queue: &queue,
            priority,
            run_at,
            max_attempts,
        };
        let outcomes = queue::enqueue_many(&batch, refresh);
        TableIterator::new(
            keys.into_iter()
                .zip(outcomes)
                .map(|(key, enqueued)| (key, outcome(enqueued)))
                .collect::<Vec<_>>(),
        )
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
    body(|| {
        let queue_name = queue::require(args::queue(queue), "claim_next").name;
        let lease = args::lease(lease);
        let worker = args::worker(worker);
        let n = args::batch_size(n);
        let wait_micros = args::wait(wait);
        let owner = claim_owner(owner_pid);
        if wait_micros > 0 {
            refuse_wait_under_snapshot_isolation("claim_next");
        }
        let claimed = waiting::claim_next(queue_name, lease, worker, owner, n, wait_micros);
        TableIterator::new(
            claimed
                .into_iter()
                .map(|c| (c.key, c.token, c.payload, c.attempt)),
        )
    })
}

#[pg_extern(sql = false)]
fn invalidate_keys(queue: Option<&str>, prefix: Option<&str>) -> i64 {
    body(|| {
        if queue.is_none() && prefix.is_none() {
            errors::invalid_argument(
                "invalidate_keys needs a queue or a key prefix".into(),
                "Pass queue => 'name' and/or prefix => 'https://example.com/'.",
            );
        }
        let queue = queue.map(|q| queue::require(args::queue(Some(q)), "invalidate_keys").name);
        if prefix == Some("") {
            errors::invalid_argument(
                "prefix must not be empty".into(),
                "Pass a key prefix such as 'https://example.com/', or only a queue.",
            );
        }
        queue::invalidate_many(queue, prefix)
    })
}

/// Named for the release of its signature: 0.2.0 added `stale`, `beta` and `jitter` to
/// 0.1.0's complete_keys (symbol complete_keys_wrapper).
#[pg_extern(sql = false)]
fn complete_keys_0_2(
    keys: Option<Vec<Option<String>>>,
    tokens: Option<Vec<Option<i64>>>,
    results: Option<JsonbArray>,
    ttl: Option<Interval>,
    stale: Option<Interval>,
    beta: Option<f64>,
    jitter: Option<f64>,
) -> TableIterator<'static, (name!(key, String),)> {
    body(|| {
        let hint = "Pass three arrays of the same length: keys, their tokens, their results.";
        let keys = args::required(keys, "keys", hint);
        let tokens = args::required(tokens, "tokens", hint);
        let results = args::required(results, "results", hint);
        let shape = results.shape();
        let length = shape.length;
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
        if shape.has_null {
            errors::null_argument("results[i]", hint);
        }
        args::result_size(shape.largest, "a result");
        let keys: Vec<String> = keys
            .into_iter()
            .map(|k| args::required(k, "keys[i]", hint))
            .collect();
        let keys: Vec<Key> = keys
            .iter()
            .map(|k| usable_key(Some(k), "complete_keys"))
            .collect();
        let tokens: Vec<i64> = tokens.into_iter().map(args::token).collect();
        let policy = args::policy(ttl, stale, beta, jitter);
        let done = queue::complete_many(&keys, tokens, results, &policy);
        TableIterator::new(done.into_iter().map(|k| (k,)))
    })
}
