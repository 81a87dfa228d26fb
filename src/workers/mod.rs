//! The background workers, an entry point like the SQL surface: PostgreSQL calls into
//! them, and they only call down. The launcher (one, registered when pg_once is
//! preloaded) starts and restarts a worker per database named in once.databases; each
//! worker reaps (protocol::reap) and relays notifications (runtime::notify).

pub mod launcher;
pub mod worker;
