//! The server-side machinery: shared memory (backend slots, relay queues, counters),
//! sleeping and waking, backend liveness, notifications, the launcher and the
//! per-database workers it starts, and the once.* settings. Knows nothing of the
//! protocol's statements; the worker is the one entry point besides the SQL surface, and
//! it calls protocol::claim::reap.

pub mod guc;
pub mod launcher;
pub mod liveness;
pub mod notify;
pub mod shmem;
pub mod wait;
pub mod worker;
