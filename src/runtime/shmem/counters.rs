//! Counters of calls since server start, shown by once.stats.

use super::shared;
use std::sync::atomic::Ordering::SeqCst;

/// Declares Counter and, in the same order, the once.stats column of each counter: the
/// one list both are made from (once_internal.runtime() reports counters by these names).
macro_rules! counters {
    ($($counter:ident => $column:literal,)*) => {
        /// What once.stats counts, since server start.
        #[derive(Clone, Copy)]
        #[repr(usize)]
        pub enum Counter {
            $($counter,)*
        }
        /// The once.stats column of each counter, in `Counter` order.
        pub const COUNTER_COLUMNS: &[&str] = &[$($column,)*];
    };
}

counters! {
    Claimed => "claims",
    Hits => "hits",
    Waited => "waits",
    Wakeups => "wakeups",
    TakenOver => "takeovers",
    Completed => "completions",
    Failed => "failures",
    Released => "releases",
    Invalidated => "invalidations",
    Reaped => "reaped",
    Purged => "purged",
    NotifiedDirect => "notified_direct",
    NotifiedRelayed => "notified_relayed",
    Stale => "stale",
    Refreshes => "refreshes",
}
pub(super) const COUNTERS: usize = COUNTER_COLUMNS.len();

/// Count one event, if counting is possible.
pub fn count(counter: Counter) {
    if let Some(shared) = shared() {
        shared.counters[counter as usize].fetch_add(1, SeqCst);
    }
}

/// Count `n` events.
pub fn count_n(counter: Counter, n: u64) {
    if let Some(shared) = shared() {
        shared.counters[counter as usize].fetch_add(n, SeqCst);
    }
}

/// The counters, in `Counter` order.
pub fn counters() -> Option<[u64; COUNTERS]> {
    shared().map(|s| std::array::from_fn(|i| s.counters[i].load(SeqCst)))
}
