//! pg_compat means the same on every PostgreSQL major: each function against what
//! PostgreSQL itself says, so a wrong branch for a version fails here on that version.

#[pgrx::pg_schema]
mod tests {
    use crate::pg_compat;
    use crate::tests::one;
    use pgrx::pg_sys;
    use pgrx::prelude::*;

    #[pg_test]
    fn a_backend_number_is_the_same_from_inside_and_from_its_pgproc() {
        let mine = pg_compat::my_backend_number().expect("a client backend has a number");
        assert!(mine < pg_compat::max_backends());
        // SAFETY: our own pid; BackendPidGetProc takes ProcArrayLock itself.
        let proc_ = unsafe { pg_sys::BackendPidGetProc(pg_sys::MyProcPid) };
        assert!(!proc_.is_null());
        assert_eq!(unsafe { pg_compat::backend_number(proc_) }, Some(mine));
    }

    #[pg_test]
    fn max_backends_counts_every_backend_that_can_have_a_number() {
        // InitializeMaxBackends: client connections, autovacuum workers, the special
        // workers (the autovacuum launcher; since 17 the slot sync worker too), background
        // workers, WAL senders. 18 counts autovacuum_worker_slots, not _max_workers.
        let expected = one::<i32>(
            "SELECT current_setting('max_connections')::int
                  + coalesce(current_setting('autovacuum_worker_slots', true)::int,
                             current_setting('autovacuum_max_workers')::int)
                  + CASE WHEN current_setting('server_version_num')::int >= 170000
                         THEN 2 ELSE 1 END
                  + current_setting('max_worker_processes')::int
                  + current_setting('max_wal_senders')::int",
        )
        .unwrap() as usize;
        assert_eq!(pg_compat::max_backends(), expected);
    }

    #[pg_test]
    fn my_proc_number_reaches_my_own_latch() {
        // SAFETY: MyProc is this backend's PGPROC.
        let own = unsafe { &raw mut (*pg_sys::MyProc).procLatch };
        assert_eq!(pg_compat::latch_of(pg_compat::my_proc_number()), own);
    }

    #[pg_test]
    fn the_backend_status_table_by_position_finds_this_backend() {
        // SAFETY: inside a transaction; entries are read before the copy is cleared.
        let found = unsafe {
            let n = pg_sys::pgstat_fetch_stat_numbackends();
            (1..=n).any(|i| {
                pg_compat::local_backend_status(i)
                    .as_ref()
                    .is_some_and(|entry| entry.backendStatus.st_procpid == pg_sys::MyProcPid)
            })
        };
        assert!(found);
        // Out of range is NULL, not another entry.
        assert!(unsafe { pg_compat::local_backend_status(0) }.is_null());
    }
}
