//! The trigger functions schema.sql attaches (schema `once_internal`), entry points like
//! the SQL functions: each reads what its row says and calls the protocol, which owns
//! what the change means.

use crate::protocol::{counts, namespace, queue, resolve};
use pgrx::prelude::*;
use pgrx::PgTrigger;

type TriggerResult<'a> = Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError>;

/// On once.entries: a running key was resolved (completed, failed, released, reaped,
/// invalidated).
#[pg_trigger(sql = false)]
fn notify_key_resolved<'a>(trigger: &'a PgTrigger<'a>) -> TriggerResult<'a> {
    // The triggers fire only for rows that were running (see schema.sql), so OLD exists.
    if let Some(old) = trigger.old() {
        let key = old
            .get_by_name::<&str>("key")
            .unwrap_or_else(|e| error!("pg_once: {e}"))
            .expect("once.entries.key is NOT NULL");
        let digest = old
            .get_by_name::<&[u8]>("key_hash")
            .unwrap_or_else(|e| error!("pg_once: {e}"))
            .expect("once.entries.key_hash is NOT NULL");
        resolve::announce_resolved(key, digest);
    }
    Ok(None)
}

/// On once.entries: a running key went back to its queue (a failure with retries left, a
/// release, a reaped claim).
#[pg_trigger(sql = false)]
fn wake_queue<'a>(trigger: &'a PgTrigger<'a>) -> TriggerResult<'a> {
    if let Some(new) = trigger.new() {
        if let Some(name) = new
            .get_by_name::<&str>("queue")
            .unwrap_or_else(|e| error!("pg_once: {e}"))
        {
            queue::has_work(name);
        }
    }
    Ok(None)
}

/// On once_internal.namespace_owners and once.queues, for each statement: every backend's
/// kept copy of them is out of date.
#[pg_trigger(sql = false)]
fn namespaces_changed<'a>(trigger: &'a PgTrigger<'a>) -> TriggerResult<'a> {
    let table = trigger.relid().unwrap_or_else(|e| error!("pg_once: {e}"));
    namespace::kept_copies_outdated(table);
    Ok(None)
}

/// On once.entries, for each row inserted, updated or deleted: once.stats' key counts.
#[pg_trigger(sql = false)]
fn count_key<'a>(trigger: &'a PgTrigger<'a>) -> TriggerResult<'a> {
    counts::count_change(trigger);
    Ok(None)
}

/// On once.entries, for TRUNCATE: no key is left, count again.
#[pg_trigger(sql = false)]
fn write_key_counts<'a>(_trigger: &'a PgTrigger<'a>) -> TriggerResult<'a> {
    counts::recount();
    Ok(None)
}
