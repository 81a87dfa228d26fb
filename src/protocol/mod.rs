//! The protocol: what a claim, a completion, a failure, a queue and a wait mean, as
//! statements on once.entries and reads of it. Called by the SQL surface (api) and by
//! the worker (reap_stale); calls storage and runtime. On a hot standby only reads are
//! served (standby).

pub mod cached;
pub mod claim;
pub mod counts;
pub mod freshness;
pub mod namespace;
pub mod queue;
mod rules;
pub mod standby;
pub mod waiting;
