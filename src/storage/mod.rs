//! Access to once.entries below the protocol: statements prepared once per backend with
//! named parameters, direct reads of the primary-key index that bypass the executor,
//! subtransactions that bound lock waits, jsonb datums passed through untouched, and
//! per-backend copies of small tables dropped when the tables change.
//! Knows tables and rows, not what a claim means.

pub mod entry;
pub mod installed;
pub mod jsonb;
pub mod owner;
pub mod statements;
pub mod subxact;
pub mod tokens;
pub mod watched;
