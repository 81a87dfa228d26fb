//! The protocol: what a claim, a completion, a failure, a queue and a wait mean, as
//! statements on once.entries and reads of it. Called by the SQL surface (api) and by
//! the background workers (reap); calls storage and runtime. On a hot standby only reads
//! are served (standby).
//!
//! A key's life, one file a stage: `claim` (taking it, as `decision` decides), `resolve` (what its owner does
//! with the claim), `rerun` (refresh and invalidate), `reap` (claims whose owner is
//! gone, expired results, old history); `queue` (queue mode), `waiting` (calls with
//! `wait`). `rules` holds what several statements share.

pub mod cached;
pub mod claim;
pub mod counts;
pub mod decision;
pub mod freshness;
pub mod namespace;
pub mod queue;
pub mod reap;
pub mod rerun;
pub mod resolve;
mod rules;
pub mod standby;
pub mod waiting;
