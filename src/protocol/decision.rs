//! The claim decision: what claim_key does with one look at a key, as a function of what
//! that look saw and of nothing else. claim::attempt reads the row, asks `decide`, and
//! carries the decision out; the SQL edition's once_internal.claim_decision is the same
//! table in PL/pgSQL. Both are held to the vectors in `claim_decisions.json`: here by
//! `cargo test`, there by pg_test/multi/tests/claim_decision.rs (scripts/test-sql-edition.sh).
//!
//! What may differ between the editions is how the facts are observed (locks, liveness),
//! never what they decide. The facts that cost something to observe (the owner's liveness,
//! the early-refresh draw, another transaction's lock on the row) are asked through
//! `Observe`, only when the decision needs them: the vectors leave out the ones a look
//! never asks, and a test observer refuses to answer them.

use crate::storage::entry::{Entry, KeyState};

/// What one look saw of the key's row (None for `decide`: no row visible).
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize)]
pub struct Seen {
    #[serde(with = "state_label")]
    pub state: KeyState,
    /// A result not past its ttl (Entry::fresh).
    pub fresh: bool,
    /// A result past its ttl, within its stale window (Entry::servable_stale).
    pub servable_stale: bool,
    /// A failure still served, until retry_at (Entry::retry_later).
    pub retry_later: bool,
    /// The key and the caller both have a fingerprint, and they differ.
    pub fingerprint_differs: bool,
}

impl Seen {
    pub fn of(entry: &Entry, fingerprint: Option<&[u8]>) -> Seen {
        Seen {
            state: entry.state,
            fresh: entry.fresh(),
            servable_stale: entry.servable_stale(),
            retry_later: entry.state == KeyState::Failed && entry.retry_later(),
            fingerprint_differs: matches!(
                (entry.fingerprint.as_deref(), fingerprint),
                (Some(theirs), Some(mine)) if theirs != mine
            ),
        }
    }

    /// The caller's request is not the one the key's current attempt was claimed for,
    /// while that attempt still counts: it runs (its owner alive or not: a takeover is a
    /// retry of the same request) or its result is served (fresh, or in its stale
    /// window). Once it no longer counts (failed, expired, released, invalidated), a claim
    /// takes the key and stores its own fingerprint; a failure served until retry_at is
    /// answered `failed` to every caller, as before fingerprints.
    fn mismatches(&self) -> bool {
        self.fingerprint_differs
            && (self.state == KeyState::Running || self.fresh || self.servable_stale)
    }
}

/// The caller: on a hot standby, and whether it takes the answers `refresh` and `stale`.
#[derive(Clone, Copy, Debug, serde::Deserialize)]
pub struct Caller {
    pub standby: bool,
    pub serve_stale: bool,
}

/// Whether a running key's owner is still there (what claim::Look::owner observes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OwnerStatus {
    Alive,
    /// Gone, and why: the reason a takeover records.
    Gone(&'static str),
}

/// The facts a decision may need that cost something to observe, asked only when needed.
pub trait Observe {
    /// A running key's owner, judged off a standby only (on a standby its owner is a
    /// backend of the primary, which only the primary can judge).
    fn owner(&mut self) -> OwnerStatus;
    /// A fresh, done key's read draws an early refresh (freshness::draws_early_refresh).
    fn early_refresh_drawn(&mut self) -> bool;
    /// Another transaction in progress holds the row (for `None`: is inserting the key);
    /// a write would wait for it.
    fn held_elsewhere(&mut self) -> bool;
}

/// What claim_key does with the look.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    /// No row: insert the claim.
    Insert,
    /// Another transaction writes the key: answer `wait`, with what its uncommitted
    /// version says if it can be read, and look again soon.
    Busy,
    /// Another request's attempt still counts: answer `mismatch`, change nothing.
    Mismatch,
    /// Answer the fresh result.
    Hit,
    /// Claim the key keeping its fresh result (the caller drew an early refresh); losing
    /// the race for it is a `Hit`.
    EarlyRefresh,
    /// Answer the failure served until retry_at.
    Failed,
    /// Answer `wait`: its live owner computes it.
    Wait,
    /// Answer the previous result as `stale`; `refreshing`: with its live owner (who
    /// refreshes it), else with none.
    Stale { refreshing: bool },
    /// Claim the key (its owner gone, its result expired, its failure due, or queued);
    /// `keep`: keeping its result, served as stale meanwhile (answered `refresh`, or
    /// `claimed` with the result to a caller without serve_stale). `gone`: why the owner
    /// it takes over from is gone.
    Take {
        keep: bool,
        gone: Option<&'static str>,
    },
}

/// The decision for one look: `seen` the row (None: none visible), `caller` who asks.
pub fn decide(seen: Option<&Seen>, caller: Caller, observe: &mut impl Observe) -> Decision {
    let Some(seen) = seen else {
        // Absent to us, but maybe inserted by a transaction that has not committed:
        // inserting would wait for it.
        return if observe.held_elsewhere() {
            Decision::Busy
        } else {
            Decision::Insert
        };
    };
    if seen.mismatches() {
        return Decision::Mismatch;
    }
    if seen.fresh {
        // Served until the new result lands, also while the key is recomputed. Only a
        // done key draws an early refresh (a running one is already being recomputed),
        // never on a standby, and not while another transaction writes the row.
        if seen.state == KeyState::Done
            && !caller.standby
            && observe.early_refresh_drawn()
            && !observe.held_elsewhere()
        {
            return Decision::EarlyRefresh;
        }
        return Decision::Hit;
    }
    // The one place where serve_stale changes an answer: a result in its stale window is
    // served rather than waited for, failed, or (where it cannot be claimed) withheld.
    let stale = caller.serve_stale && seen.servable_stale;
    let unavailable = |otherwise: Decision, refreshing: bool| {
        if stale {
            Decision::Stale { refreshing }
        } else {
            otherwise
        }
    };
    let gone = match seen.state {
        KeyState::Failed if seen.retry_later => return unavailable(Decision::Failed, false),
        KeyState::Running if caller.standby => return unavailable(Decision::Wait, true),
        KeyState::Running => match observe.owner() {
            OwnerStatus::Alive => return unavailable(Decision::Wait, true),
            OwnerStatus::Gone(why) => Some(why),
        },
        // A queue's worker will recompute it.
        KeyState::Queued if stale => return Decision::Stale { refreshing: false },
        _ => None, // expired result, failure due for retry, or queued
    };
    // Nothing is claimed on a standby: a result in its stale window is served instead
    // (any other claim is refused there by the write). A stale answer never waits, not
    // even for another transaction's lock on the row.
    if stale && caller.standby {
        return Decision::Stale { refreshing: false };
    }
    if observe.held_elsewhere() {
        return when_held(seen, caller);
    }
    Decision::Take {
        keep: seen.servable_stale,
        gone,
    }
}

/// What a key that would be taken answers while another transaction holds its row (seen
/// before the write, or met by it): its stale result, at once, to a caller that takes
/// one; otherwise `Busy`.
pub fn when_held(seen: &Seen, caller: Caller) -> Decision {
    if caller.serve_stale && seen.servable_stale {
        Decision::Stale { refreshing: false }
    } else {
        Decision::Busy
    }
}

#[cfg(test)]
impl Decision {
    /// The decision's name in claim_decisions.json and in the SQL edition.
    pub fn label(self) -> &'static str {
        match self {
            Decision::Insert => "insert",
            Decision::Busy => "busy",
            Decision::Mismatch => "mismatch",
            Decision::Hit => "hit",
            Decision::EarlyRefresh => "early_refresh",
            Decision::Failed => "failed",
            Decision::Wait => "wait",
            Decision::Stale { refreshing: false } => "stale",
            Decision::Stale { refreshing: true } => "stale_refreshing",
            Decision::Take { keep: false, .. } => "take",
            Decision::Take { keep: true, .. } => "take_keep",
        }
    }
}

/// KeyState by its once.key_state label, as the vectors write it.
mod state_label {
    use crate::storage::entry::KeyState;

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<KeyState, D::Error> {
        let label: String = serde::Deserialize::deserialize(d)?;
        [
            KeyState::Queued,
            KeyState::Running,
            KeyState::Done,
            KeyState::Failed,
        ]
        .into_iter()
        .find(|s| s.label() == label)
        .ok_or_else(|| serde::de::Error::custom(format!("no key state {label:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One vector of claim_decisions.json.
    #[derive(serde::Deserialize)]
    struct Vector {
        name: String,
        seen: Option<Seen>,
        caller: Caller,
        /// The observations, each present only if the decision asks for it. `owner`:
        /// "alive", or why it is gone.
        #[serde(default)]
        owner: Option<String>,
        #[serde(default)]
        early_refresh_drawn: Option<bool>,
        #[serde(default)]
        held_elsewhere: Option<bool>,
        decision: String,
    }

    /// Answers what the vector says, and fails the test on a question it leaves out.
    struct Given<'a>(&'a Vector);

    impl Observe for Given<'_> {
        fn owner(&mut self) -> OwnerStatus {
            match self.0.owner.as_deref() {
                Some("alive") => OwnerStatus::Alive,
                Some(why) => OwnerStatus::Gone(Box::leak(why.to_owned().into_boxed_str())),
                None => panic!("{}: asked for the owner, which it leaves out", self.0.name),
            }
        }
        fn early_refresh_drawn(&mut self) -> bool {
            self.0.early_refresh_drawn.unwrap_or_else(|| {
                panic!(
                    "{}: asked for the early-refresh draw, which it leaves out",
                    self.0.name
                )
            })
        }
        fn held_elsewhere(&mut self) -> bool {
            self.0.held_elsewhere.unwrap_or_else(|| {
                panic!(
                    "{}: asked whether the row is held, which it leaves out",
                    self.0.name
                )
            })
        }
    }

    #[test]
    fn every_vector_decides_as_written() {
        let vectors: Vec<Vector> =
            serde_json::from_str(include_str!("claim_decisions.json")).expect("the vectors parse");
        assert!(vectors.len() >= 20, "{} vectors", vectors.len());
        for v in &vectors {
            let decision = decide(v.seen.as_ref(), v.caller, &mut Given(v));
            assert_eq!(decision.label(), v.decision, "{}", v.name);
            // A takeover records why its owner is gone: the reason the look observed.
            if let Decision::Take { gone, .. } = decision {
                let observed = v.owner.as_deref().filter(|o| *o != "alive");
                assert_eq!(gone, observed, "{}", v.name);
            }
        }
    }
}
