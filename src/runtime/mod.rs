//! The server-side machinery: shared memory (backend slots, relay queues, counters),
//! sleeping and waking, backend liveness, notifications and the once.* settings. Knows
//! nothing of the protocol's statements; the background workers that use it live above
//! the protocol, in workers/.

pub mod guc;
pub mod liveness;
pub mod notify;
pub mod shmem;
pub mod wait;
