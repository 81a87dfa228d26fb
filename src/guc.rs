//! The once.* settings.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// Whether a claim also ends when the backend that made it exits. Recorded with each claim
/// (as once.entries.lease_only), so the session that claims decides how its claim is judged.
pub static BACKEND_LIVENESS: GucSetting<bool> = GucSetting::<bool>::new(true);

/// Milliseconds between two looks at a key while claim_key waits without shared memory.
pub static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(20);

pub fn register() {
    GucRegistry::define_bool_guc(
        c"once.backend_liveness",
        c"A claim also ends when the backend that made it exits, not only when its lease runs out.",
        c"Turn off for sessions behind a proxy that may close server connections under live clients \
          (e.g. PgBouncer server_lifetime); their claims then end only when the lease expires. \
          Recorded with each claim, so it can be set per role or per session.",
        &BACKEND_LIVENESS,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"once.poll_interval",
        c"How often a waiting claim_key looks at its key again.",
        c"Only used when waiting cannot be woken through shared memory.",
        &POLL_INTERVAL_MS,
        1,
        60_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
}
