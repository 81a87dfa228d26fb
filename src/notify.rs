//! The trigger that tells listeners on channel `once` that a key left the running state.
//!
//! The key is handed to the server's NOTIFY machinery as a value (Async_Notify, what
//! pg_notify() calls), never spliced into SQL text, so any key (quotes, newlines,
//! `'; DROP TABLE`) is delivered verbatim. Notifications are sent when the transaction
//! commits, so a listener never hears of a result it cannot yet read.

use pgrx::prelude::*;

/// The one channel pg_once notifies on.
pub const CHANNEL: &std::ffi::CStr = c"once";

/// Queue a notification on channel `once` with `key` as its payload, through the server's
/// pg_notify(channel, payload) function.
pub fn notify_key(key: &str) {
    let channel = CHANNEL.to_str().expect("ASCII channel name");
    // SAFETY: pg_notify takes two text arguments and returns void.
    unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(
            pg_sys::pg_notify,
            &[channel.into_datum(), key.into_datum()],
        );
    }
}

#[pg_trigger(sql = false)]
fn notify_key_resolved<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    // The triggers fire only for rows that were running (see schema.sql), so OLD exists.
    if let Some(old) = trigger.old() {
        let key = old
            .get_by_name::<&str>("key")
            .unwrap_or_else(|e| error!("pg_once: {e}"));
        notify_key(key.expect("once.entries.key is NOT NULL"));
    }
    Ok(None)
}
