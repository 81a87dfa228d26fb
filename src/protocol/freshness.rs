//! Freshness: when a cached result may still be served, and when a hit refreshes it early.
//!
//! A result is fresh until `expires_at` (complete_key's ttl, jittered), then stale until
//! `stale_until` (ttl + complete_key's stale): in that window the first claim_key takes a
//! claim that keeps the result (outcome `refresh`) and every other caller is served the
//! old result (`stale`). Which answer each state gets is decided in claim::attempt; the
//! rule for early refreshes is here.
//!
//! Early refresh (XFetch): Vattani, Chierichetti and Lowenstein, "Optimal Probabilistic
//! Cache Stampede Prevention", PVLDB 8(8), 2015. A reader of a fresh result recomputes it
//! early when `now - delta * beta * ln(u) >= expiry`, u uniform in (0, 1], where delta is
//! how long the last computation took (pg_once measures it: claim to complete_key,
//! once.entries.compute_time) and beta is complete_key's. Equivalently, a reader `r`
//! before expiry refreshes with probability `exp(-r / (beta * delta))`: rare long before
//! expiry, near-certain in the last delta. The claim it takes is conditional on the key
//! being unchanged, so of several readers that draw at once only one refreshes.

use crate::pg_compat;
use crate::storage::entry::Entry;
use crate::storage::statements::{params, Param};
use pgrx::datum::Interval;
use std::cell::Cell;

/// How a completed result stays servable: complete_key's ttl, stale, beta and jitter,
/// checked (api::args::policy).
pub struct Policy {
    /// Fresh for this long (NULL: until invalidated)...
    pub ttl: Option<Interval>,
    /// ...shortened by up to this fraction of it, drawn per key (0 <= jitter < 1)...
    pub jitter: Option<f64>,
    /// ...then served as stale for this long more.
    pub stale: Option<Interval>,
    /// Early refreshes: XFetch's beta (None: never early).
    pub beta: Option<f64>,
}

impl Policy {
    /// The parameters of protocol/sql/rules/completed.sql.
    pub fn params(&self) -> [Param<'static>; 4] {
        params![
            ttl = self.ttl,
            jitter = self.jitter,
            stale = self.stale,
            beta = self.beta,
        ]
    }
}

/// A uniform draw in (0, 1]. Not for secrets: it only spreads early refreshes. PostgreSQL's
/// own per-backend generator (pg_prng), so nothing here needs seeding.
fn uniform() -> f64 {
    1.0 - pg_compat::random_fraction()
}

thread_local! {
    /// The token of a result whose read by once.get drew an early refresh, owed to this
    /// session's next look at a fresh result (0: none). get cannot claim (it writes
    /// nothing), so it answers NULL and the caller asks claim_key, which takes the refresh
    /// if the result is still the one that drew it. Drawing again instead would refresh
    /// with probability p * p: get then claim_key would behave as a smaller beta. A token
    /// names one result of one key (tokens come from one sequence), and the debt goes with
    /// the session's next draw whichever key it reads: honoured at most once, and only
    /// while that result is still the key's and fresh.
    static OWED: Cell<i64> = const { Cell::new(0) };
}

/// A uniform draw in [0, 1) for complete_key's jitter (SQL's random() draws the same
/// range for complete_keys).
pub fn jitter_draw() -> f64 {
    1.0 - uniform()
}

/// Record that `entry`'s read drew an early refresh that the session's next claim takes.
pub fn owe_early_refresh(entry: &Entry) {
    OWED.set(entry.token);
}

/// Does this read of a fresh result draw an early refresh? (Also when a get of this very
/// result drew one just before: `OWED`.)
pub fn draws_early_refresh(entry: &Entry) -> bool {
    if OWED.replace(0) == entry.token {
        return true;
    }
    let (Some(beta), Some(delta), Some(expires_at)) =
        (entry.beta, entry.compute_time, entry.expires_at)
    else {
        return false;
    };
    if beta <= 0.0 {
        return false;
    }
    let delta_micros = delta.as_micros() as f64;
    let left_micros = (expires_at.into_inner() - entry.read_at) as f64;
    early(left_micros, delta_micros, beta, uniform())
}

/// XFetch's test with a given draw `u` in (0, 1]: `-delta * beta * ln(u) >= time left`.
fn early(left_micros: f64, delta_micros: f64, beta: f64, u: f64) -> bool {
    -delta_micros * beta * u.ln() >= left_micros
}

#[cfg(test)]
mod tests {
    use super::early;

    #[test]
    fn a_refresh_is_drawn_with_probability_exp_of_minus_left_over_beta_delta() {
        // With u uniform, P(early) = P(u <= exp(-left / (beta * delta))).
        let (delta, beta) = (300_000.0, 1.0);
        for left in [0.0, 150_000.0, 300_000.0, 900_000.0] {
            let p = f64::exp(-left / (beta * delta));
            let n = 10_000;
            let hits = (1..=n)
                .filter(|i| early(left, delta, beta, *i as f64 / n as f64))
                .count();
            assert!(
                (hits as f64 / n as f64 - p).abs() < 0.001,
                "left {left}: {hits} of {n}, expected {p}"
            );
        }
    }

    #[test]
    fn an_expired_result_always_draws_and_a_far_one_almost_never() {
        assert!(early(-1.0, 300_000.0, 1.0, 1.0));
        assert!(!early(60_000_000.0, 300_000.0, 1.0, 0.5));
    }
}
