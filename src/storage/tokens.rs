//! Fencing tokens: never equal to, nor below, a token handed out before, whatever happened
//! to the WAL or the data that recorded them (docs/concepts.md, "Fencing tokens").
//!
//! A token is drawn from the sequence once_internal.token_seq, which hands tokens out in
//! order. The sequence is anchored to the server's clock: CREATE EXTENSION starts it at
//! the current time in microseconds since 2000-01-01 (PostgreSQL's timestamp), and a
//! draw is handed out only if it is at most `LAG` behind the clock and was drawn on the
//! timeline recorded at the last anchor. Otherwise the sequence is anchored first: set to
//! the clock (or left where it is, if it is ahead), and the timeline recorded.
//!
//! Claims come fewer than one a microsecond, so the sequence never gets ahead of the
//! clock, and every token ever handed out is below the clock's reading at that moment.
//! Whatever sets the sequence back, or hands it to a server that did not see the latest
//! draws, takes longer than `LAG`, so the next draw is behind the clock and anchors:
//!
//! - **a restore** of a dump, here or into another cluster (pg_restore sets the sequence to
//!   the dumped value; the SQL edition's sequence is an ordinary object, dumped too);
//! - **a crash** that loses WAL a client's token came from (an uncommitted claim, or one
//!   committed with `synchronous_commit = off`);
//! - **a promotion** of a standby that missed the old primary's last WAL, and one of
//!   another standby of the same history after it (both start a timeline with the same
//!   number: the clock, not the timeline, sets them apart);
//! - on Citus, **a shard** whose keys move to another node.
//!
//! A new timeline anchors at its first draw even if the sequence looks fresh: a
//! promotion may come within `LAG` of the old primary's last draw. The record of the
//! timeline is a second sequence, once_internal.token_history: like the token sequence it
//! changes outside transactions, so a claim that rolls back after an anchor leaves it done.
//! It is set after the token sequence, and a draw reads it before drawing, so a draw that
//! finds the new timeline recorded is above the anchor.
//!
//! What this rests on (docs/concepts.md lists it, and where it does not hold): the
//! servers' clocks agree to within the time such an event takes and do not step back, no
//! event takes less than `LAG`, and one history serves claims at a time.

use crate::errors;
use crate::pg_compat;
use crate::storage::statements::{self, Statement};
use crate::storage::watched::Watched;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::IntoDatum;
use std::cell::Cell;

/// How far a draw may lag the clock (microseconds) and still be handed out. A
/// PostgreSQL restart after a crash, a pg_restore, a promotion or a shard move each take
/// far longer; an anchor costs a lock and a setval, at most once per `LAG` under load.
const LAG: i64 = 10_000;

/// How long a draw looks again for the anchor's lock (microseconds) before it gives up
/// with an error. Only an anchor holds that lock, for microseconds, unless the owner or a
/// superuser locks the sequence by hand; no claim waits on that forever.
const ANCHOR_PATIENCE: i64 = 1_000_000;

/// The token sequence and the timeline record.
#[derive(Clone, Copy)]
struct Sequences {
    tokens: pg_sys::Oid,
    history: pg_sys::Oid,
}

thread_local! {
    /// Read once per backend, and again after a relcache invalidation of either sequence
    /// (DROP and CREATE EXTENSION make new ones).
    static SEQUENCES: Watched<Sequences> = const { Watched::of_relations() };
    /// The timeline this backend found recorded: on it, a fresh draw needs no other check.
    static SETTLED: Cell<Option<u32>> = const { Cell::new(None) };
}

/// The next fencing token.
pub fn next() -> i64 {
    let sequences = sequences();
    let token = nextval(sequences.tokens);
    // After nextval: it refuses on a standby, where there is no timeline to write on.
    let timeline = pg_compat::insert_timeline();
    if SETTLED.get() == Some(timeline) && fresh(token, clock()) {
        return token;
    }
    draw_anchored(sequences, timeline)
}

/// The server's clock, in microseconds since 2000-01-01 (what clock_timestamp() reads).
fn clock() -> pg_sys::TimestampTz {
    // SAFETY: reads the system clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Whether a token drawn at `now` may be handed out as it is (see the module's comment).
fn fresh(token: i64, now: pg_sys::TimestampTz) -> bool {
    token >= now - LAG
}

/// Where an anchor sets the sequence: the clock, or where it is if it is ahead.
fn anchor(token: i64, now: pg_sys::TimestampTz) -> i64 {
    token.max(now)
}

/// Draw a token after the timeline's record was read, anchoring the sequence first if it
/// must be.
///
/// One backend at a time anchors, holding a lock on the token sequence
/// (`try_lock_sequence`): two must not both set it, or the second could set it back
/// below the first one's draws. The others never wait on that lock (a claim's lock waits
/// are bounded, and a bounded wait that runs out answers `wait`): they look again after
/// a moment, and once the sequence is anchored their next draw is fresh. The lock is
/// released as soon as both sequences are set: they change outside transactions, so
/// holding it to the end of the transaction would protect nothing more, and would make
/// every other claim that needs an anchor look again until then.
fn draw_anchored(sequences: Sequences, timeline: u32) -> i64 {
    let started = clock();
    loop {
        if recorded_timeline(sequences.history) == timeline {
            SETTLED.set(Some(timeline));
            let token = nextval(sequences.tokens);
            if fresh(token, clock()) {
                return token;
            }
        }
        if try_lock_sequence(sequences.tokens) {
            // Again, now that no one else anchors.
            let token = nextval(sequences.tokens);
            let now = clock();
            if recorded_timeline(sequences.history) != timeline || !fresh(token, now) {
                setval(sequences.tokens, anchor(token, now));
                setval(sequences.history, i64::from(timeline));
            }
            unlock_sequence(sequences.tokens);
            continue;
        }
        if clock() - started > ANCHOR_PATIENCE {
            errors::lock_not_available(
                "pg_once could not anchor its fencing tokens within 1 s: another session holds \
                 the anchor's lock"
                    .into(),
                "Only pg_once's owner or a superuser can hold it (LOCK TABLE, or a maintenance \
                 transaction left open): end that transaction, then call again.",
            );
        }
        // SAFETY: a short sleep; then a cancel or timeout ends the loop.
        unsafe { pg_sys::pg_usleep(100) };
        check_for_interrupts!();
    }
}

/// A lock on the token sequence itself, SHARE UPDATE EXCLUSIVE (one holder at a time; no
/// conflict with the ROW EXCLUSIVE lock nextval and setval take), if it can be had at
/// once. Not an advisory lock: any role may take any advisory lock, and pg_once's key
/// (its constant and the sequence's OID, which pg_class shows to everyone) was one: a
/// role that held it kept a restored sequence from moving up, and every claim looked again
/// for as long as the role liked. Only the sequence's
/// owner may lock it (LOCK TABLE checks privileges, and no role has USAGE on
/// once_internal).
fn try_lock_sequence(sequence: pg_sys::Oid) -> bool {
    // SAFETY: a conditional lock on an existing relation.
    unsafe {
        pg_sys::ConditionalLockRelationOid(
            sequence,
            pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE,
        )
    }
}

fn unlock_sequence(sequence: pg_sys::Oid) {
    // SAFETY: releases the lock try_lock_sequence took.
    unsafe {
        pg_sys::UnlockRelationOid(
            sequence,
            pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE,
        )
    }
}

fn nextval(sequence: pg_sys::Oid) -> i64 {
    // SAFETY: nextval(regclass) of an existing sequence; the caller may use it (the
    // functions that claim run as the extension's owner).
    unsafe { pgrx::direct_function_call::<i64>(pg_sys::nextval_oid, &[sequence.into_datum()]) }
        .expect("nextval returns a value")
}

/// setval(sequence, value, true), as the SQL function: the next value is value + 1.
fn setval(sequence: pg_sys::Oid, value: i64) {
    // SAFETY: setval of an existing sequence the caller may update (as nextval).
    unsafe {
        pgrx::direct_function_call_as_datum(
            pg_sys::setval3_oid,
            &[sequence.into_datum(), value.into_datum(), true.into_datum()],
        )
    };
}

fn recorded_timeline(history: pg_sys::Oid) -> u32 {
    // SAFETY: pg_sequence_last_value(regclass) of an existing sequence, which CREATE
    // EXTENSION set (so it is never NULL but on a standby, where no token is drawn).
    let value = unsafe {
        pgrx::direct_function_call::<i64>(pg_sys::pg_sequence_last_value, &[history.into_datum()])
    }
    .unwrap_or(0);
    u32::try_from(value).unwrap_or(0)
}

fn sequences() -> Sequences {
    SEQUENCES.with(|kept| kept.get(read_sequences))
}

fn read_sequences() -> (Sequences, [pg_sys::Oid; 2]) {
    static READ: Statement = Statement::new(concat!(
        "SELECT '",
        internal!("token_seq"),
        "'::pg_catalog.regclass::pg_catalog.oid, '",
        internal!("token_history"),
        "'::pg_catalog.regclass::pg_catalog.oid"
    ));
    let known = statements::run(&READ, statements::params![], |table| {
        let row = table.first();
        Ok(Sequences {
            tokens: row
                .get::<pg_sys::Oid>(1)?
                .expect("a regclass of a name is set"),
            history: row
                .get::<pg_sys::Oid>(2)?
                .expect("a regclass of a name is set"),
        })
    });
    (known, [known.tokens, known.history])
}

#[cfg(test)]
mod tests {
    use super::{anchor, fresh, LAG};

    #[test]
    fn a_draw_within_lag_of_the_clock_is_handed_out() {
        assert!(fresh(1_000_000, 1_000_000 + LAG));
        assert!(fresh(2_000_000, 1_000_000), "ahead of the clock");
    }

    #[test]
    fn a_draw_further_behind_anchors() {
        assert!(!fresh(1_000_000, 1_000_001 + LAG));
    }

    #[test]
    fn an_anchor_never_moves_the_sequence_back() {
        assert_eq!(anchor(5, 9), 9);
        assert_eq!(anchor(9, 5), 9);
    }
}
