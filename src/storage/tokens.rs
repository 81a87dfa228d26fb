//! Fencing tokens: never equal to, nor below, a token handed out before, whatever happened
//! to the WAL that recorded them (docs/concepts.md, "Fencing tokens").
//!
//! A token is a *band* above a count: `band << 48 | count`. The count is the sequence
//! once_internal.token_seq, which hands tokens out in order; the band changes only when
//! the history of the cluster may have lost tokens, and then it goes above every band
//! that history could have used:
//!
//! - **A new timeline** (a standby promoted, a point-in-time recovery): WAL the new
//!   primary never received may have handed tokens out, in the band the sequence had
//!   there, or (if that history itself began a timeline whose first draw was lost too)
//!   one band more per timeline it passed. The first draw on the new timeline moves the
//!   sequence to the band `recorded + max(1, timelines passed)`.
//! - **The sequence from elsewhere** (a dump of another cluster restored here, or on
//!   Citus a shard's keys moved from another node): a band above the recorded one, moved
//!   one band higher still, above whatever that cluster handed out after the dump.
//! - **Below its band or its floor** (a dump of this cluster restored here, or tokens of
//!   an install older than bands): moved up to the floor, the sequence's START, which
//!   CREATE EXTENSION sets above every token this cluster has handed out
//!   (sql/schema.sql says why).
//!
//! The record of which band the current timeline draws from is a second sequence,
//! once_internal.token_history (`timeline << 16 | band`): like the token sequence it is
//! changed outside transactions, so a claim that rolls back after the first draw of a
//! timeline leaves the move done and recorded, and it is WAL-logged before any token drawn
//! after it, so a crash that loses the record loses those tokens too. A backend checks
//! the record once per timeline and band; afterwards a draw costs nextval and one read of
//! shared memory.
//!
//! A crash on the same timeline loses no token a client holds: a transaction that draws
//! one commits with its WAL flushed (`commit_durably`).

use crate::errors;
use crate::pg_compat;
use crate::storage::statements::{self, Statement};
use crate::storage::watched::Watched;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::IntoDatum;
use std::cell::Cell;

/// Bits of a token below its band: 2^48 draws per band, and the floor (a WAL position in
/// bytes) fits below it until a cluster has written 256 TiB of WAL.
const COUNT_BITS: u32 = 48;
/// The highest band a positive bigint holds.
const MAX_BAND: i64 = (1 << (63 - COUNT_BITS)) - 1;

/// The two sequences and the floor of the token sequence.
#[derive(Clone, Copy)]
struct Sequences {
    tokens: pg_sys::Oid,
    /// Its START (seqstart): above every token this cluster handed out before
    /// CREATE EXTENSION.
    floor: i64,
    history: pg_sys::Oid,
}

/// What once_internal.token_history records: the timeline whose first draw settled the
/// band, and the band.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Record {
    timeline: u32,
    band: i64,
}

thread_local! {
    /// Read once per backend, and again after a relcache invalidation of either sequence
    /// (DROP and CREATE EXTENSION make new ones).
    static SEQUENCES: Watched<Sequences> = const { Watched::of_relations() };
    /// The timeline and band this backend has found settled: a token drawn on that
    /// timeline in that band, at or above the floor, needs no other check.
    static SETTLED: Cell<Option<(u32, i64)>> = const { Cell::new(None) };
}

/// The next fencing token.
pub fn next() -> i64 {
    commit_durably();
    let sequences = sequences();
    let token = nextval(sequences.tokens);
    // After nextval: it refuses on a standby, where there is no timeline to write on.
    let timeline = pg_compat::insert_timeline();
    if token >= sequences.floor && SETTLED.get() == Some((timeline, band_of(token))) {
        return token;
    }
    settle(sequences, timeline)
}

/// With synchronous_commit off, a commit returns before its WAL is flushed, and a crash
/// soon after loses the claim together with the sequence's advance, while the client
/// holds the token: after the restart the same token would be drawn again, on the same
/// timeline. So a transaction that draws a token commits with at least a local flush
/// (a setting for this transaction only; a higher one, such as `on` with synchronous
/// standbys, is kept).
fn commit_durably() {
    // SAFETY: a read of a setting of this backend.
    let level = unsafe { pg_sys::synchronous_commit };
    if level >= pg_sys::SyncCommitLevel::SYNCHRONOUS_COMMIT_LOCAL_FLUSH as i32 {
        return;
    }
    // SAFETY: SET LOCAL synchronous_commit = local, as the SQL command does; a setting
    // every role may change.
    unsafe {
        pg_sys::set_config_option(
            c"synchronous_commit".as_ptr(),
            c"local".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_LOCAL,
            true,
            0,
            false,
        );
    }
}

fn band_of(token: i64) -> i64 {
    token >> COUNT_BITS
}

/// The band the token sequence must be moved to before it hands out `token`'s successors,
/// or None when `token` is safe to hand out (see the module's comment).
fn band_needed(timeline: u32, record: Record, token_band: i64) -> Option<i64> {
    if timeline != record.timeline {
        let passed = i64::from(timeline.saturating_sub(record.timeline)).max(1);
        let past_lost = record.band + passed;
        let past_foreign = if token_band > record.band {
            token_band + 1
        } else {
            0
        };
        return Some(past_lost.max(past_foreign));
    }
    match token_band.cmp(&record.band) {
        std::cmp::Ordering::Greater => Some(token_band + 1),
        std::cmp::Ordering::Less => Some(record.band),
        std::cmp::Ordering::Equal => None,
    }
}

/// Draw a token that is safe, moving the sequence first if it must move.
///
/// One backend at a time moves it, holding a lock on the token sequence
/// (`try_lock_sequence`): two that each found it below the band must not both set it,
/// or the second would set it back below the first one's draws. The others never wait on
/// that lock (a claim's lock waits are bounded, and a bounded wait that runs out answers
/// `wait`): they look again after a moment, and once the sequence has moved, their next
/// draw is safe. The lock is released as soon as both sequences are set: they change
/// outside transactions, so holding it to the end of the transaction would protect
/// nothing more, and would make every other claim look again until then.
fn settle(sequences: Sequences, timeline: u32) -> i64 {
    loop {
        let token = nextval(sequences.tokens);
        let needed = band_needed(timeline, record(sequences.history), band_of(token));
        if token >= sequences.floor && needed.is_none() {
            SETTLED.set(Some((timeline, band_of(token))));
            return token;
        }
        if try_lock_sequence(sequences.tokens) {
            // Again, now that no one else moves them.
            let token = nextval(sequences.tokens);
            match band_needed(timeline, record(sequences.history), band_of(token)) {
                Some(band) => {
                    if band > MAX_BAND {
                        errors::limit_exceeded(
                            format!("pg_once's fencing tokens have used all {MAX_BAND} bands"),
                            "Each promotion, point-in-time recovery or restore from another \
                             cluster uses one; none is left to keep tokens from repeating. \
                             Report this to pg_once's developers.",
                        );
                    }
                    setval(sequences.tokens, sequences.floor.max(band << COUNT_BITS));
                    setval(sequences.history, i64::from(timeline) << 16 | band);
                }
                None if token < sequences.floor => setval(sequences.tokens, sequences.floor),
                None => {}
            }
            unlock_sequence(sequences.tokens);
            continue;
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
/// role that held it kept the sequence below its floor after a restore, and every claim
/// drew one value a moment until it reached the floor, for hours. Only the sequence's
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

fn record(history: pg_sys::Oid) -> Record {
    // SAFETY: pg_sequence_last_value(regclass) of an existing sequence, which CREATE
    // EXTENSION set (so it is never NULL but on a standby, where no token is drawn).
    let value = unsafe {
        pgrx::direct_function_call::<i64>(pg_sys::pg_sequence_last_value, &[history.into_datum()])
    }
    .unwrap_or(0);
    Record {
        timeline: u32::try_from(value >> 16).unwrap_or(0),
        band: value & 0xffff,
    }
}

fn sequences() -> Sequences {
    SEQUENCES.with(|kept| kept.get(read_sequences))
}

fn read_sequences() -> (Sequences, [pg_sys::Oid; 2]) {
    static READ: Statement = Statement::new(concat!(
        "SELECT s.seqrelid, s.seqstart, '",
        internal!("token_history"),
        "'::pg_catalog.regclass::pg_catalog.oid FROM pg_catalog.pg_sequence s WHERE s.seqrelid = '",
        internal!("token_seq"),
        "'::pg_catalog.regclass"
    ));
    let known = statements::run(&READ, statements::params![], |table| {
        let row = table.first();
        Ok(Sequences {
            tokens: row.get::<pg_sys::Oid>(1)?.expect("seqrelid is NOT NULL"),
            floor: row.get::<i64>(2)?.expect("seqstart is NOT NULL"),
            history: row
                .get::<pg_sys::Oid>(3)?
                .expect("a regclass of a name is set"),
        })
    });
    (known, [known.tokens, known.history])
}

#[cfg(test)]
mod tests {
    use super::{band_needed, Record};

    const AT: Record = Record {
        timeline: 3,
        band: 3,
    };

    #[test]
    fn a_settled_band_needs_nothing() {
        assert_eq!(band_needed(3, AT, 3), None);
    }

    #[test]
    fn a_new_timeline_goes_past_one_band_per_timeline_it_passed() {
        assert_eq!(band_needed(4, AT, 3), Some(4));
        // A point-in-time recovery to timeline 7: the lost histories of 4 to 6 may each
        // have moved one band up.
        assert_eq!(band_needed(7, AT, 3), Some(7));
        // A record from a lower timeline's numbering (another cluster's): still one more.
        assert_eq!(band_needed(2, AT, 3), Some(4));
    }

    #[test]
    fn a_sequence_from_elsewhere_goes_past_its_own_band() {
        assert_eq!(band_needed(3, AT, 9), Some(10));
        assert_eq!(band_needed(4, AT, 9), Some(10));
    }

    #[test]
    fn a_sequence_below_its_band_goes_up_to_it() {
        assert_eq!(band_needed(3, AT, 0), Some(3));
    }
}
