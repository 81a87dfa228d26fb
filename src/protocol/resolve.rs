//! Resolving a claim: what its owner does with it (complete_key, fail_key,
//! heartbeat_key, release_key), and the announcement of a resolved key.
//!
//! Fencing: every write by an owner names the key *and* its token and the state
//! `running`; a write whose token is no longer current matches no row and changes nothing.
//! Only the role that made a claim acts on it with its token
//! (protocol/sql/rules/token_holder.sql).

use crate::key::{self, Key};
use crate::protocol::freshness::{self, Policy};
use crate::protocol::namespace;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::liveness;
use crate::runtime::notify;
use crate::runtime::shmem::{self, Counter};
use crate::storage::jsonb::Jsonb;
use crate::storage::statements::{self, params, Param, Statement};
use pgrx::datum::{Interval, TimestampWithTimeZone};

static COMPLETE: Statement = statement!("complete");

static RECORD_COMPLETION: Statement = statement!("record_completion");

static FAIL: Statement = statement!("fail");

static HEARTBEAT: Statement = statement!("heartbeat");

static RELEASE: Statement = statement!("release");

/// The parameters every owner's write names its claim by: the key, its token, and who
/// may act on it (`$holder`, sql/rules/token_holder.sql).
fn held(key: &Key, token: i64) -> [Param<'static>; 3] {
    params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
    ]
}

/// An owner's write took effect: its claim is resolved by itself, not by its exit.
fn resolved_by_owner(key: &Key, done: bool, counter: Counter) -> bool {
    if done {
        liveness::disown(key.tag);
        shmem::count(counter);
    }
    done
}

/// Store the result of a claim, fresh and then stale as `policy` says; false when the
/// claim is no longer current.
pub fn complete(key: &Key, token: i64, result: Jsonb, policy: &Policy) -> bool {
    standby::refuse_writes("complete_key");
    let args = held(key, token)
        .into_iter()
        .chain(params![
            result = result,
            draw = freshness::jitter_draw(),
            now = TimestampWithTimeZone::try_from(crate::runtime::wait::now())
                .expect("the server's clock is a valid timestamp"),
        ])
        .chain(policy.params());
    let ended = statements::run(&COMPLETE, args, |table| {
        if table.is_empty() {
            return Ok(None);
        }
        let row = table.first();
        Ok(Some((
            row.get_by_name::<String, _>("queue")?,
            row.get_by_name::<String, _>("owner")?,
            row.get_by_name::<TimestampWithTimeZone, _>("claimed_at")?,
        )))
    });
    if let Some((Some(queue), owner, claimed_at)) = &ended {
        let args = params![
            key_hash = key.hash_param(),
            key = key.text,
            queue = queue.as_str(),
            token = token,
            owner = owner.as_deref(),
            claimed_at = *claimed_at,
        ];
        statements::run(&RECORD_COMPLETION, args, |_| Ok(()));
    }
    resolved_by_owner(key, ended.is_some(), Counter::Completed)
}

/// Record a failure of a claim; false when the claim is no longer current.
pub fn fail(key: &Key, token: i64, error: String, retry_after: Interval) -> bool {
    standby::refuse_writes("fail_key");
    let args = held(key, token)
        .into_iter()
        .chain(params![error = error, retry_after = retry_after]);
    let done = statements::run(&FAIL, args, |table| Ok(table.len() == 1));
    resolved_by_owner(key, done, Counter::Failed)
}

/// Extend a claim's lease; None when the claim is no longer current.
pub fn heartbeat(key: &Key, token: i64, lease: Interval) -> Option<TimestampWithTimeZone> {
    standby::refuse_writes("heartbeat_key");
    let args = held(key, token).into_iter().chain(params![lease = lease]);
    statements::run(&HEARTBEAT, args, |table| {
        if table.is_empty() {
            Ok(None)
        } else {
            table.first().get(1)
        }
    })
}

/// Give a claim back unfailed; false when the claim is no longer current.
pub fn release(key: &Key, token: i64) -> bool {
    standby::refuse_writes("release_key");
    let done = statements::run(&RELEASE, held(key, token), |table| Ok(table.len() == 1));
    resolved_by_owner(key, done, Counter::Released)
}

/// A running key was resolved (completed, failed, released, reaped, invalidated): its
/// waiters are woken and it is announced on channel `once`, as its namespace says (the
/// key, or its digest).
pub fn announce_resolved(key: &str, digest: &[u8]) {
    notify::key_resolved(&namespace::payload(key, digest), key::tag_of(digest));
}
