//! `bench memory`: what N idle connections cost the server after each has done what a
//! pg_once caller does, against N connections that did what any application connection
//! does; and the shared memory pg_once takes.
//!
//! Per-backend memory comes from /proc/<pid>/smaps_rollup, so the tool must run on the
//! server's machine, as root or as the server's user.

use anyhow::{Context, Result};
use futures_util::{stream, StreamExt, TryStreamExt};
use pg_once_tools as once;
use serde_json::json;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// Connections opened (and set to work) at once: enough to keep both cores busy without
/// a thousand forks competing with the backends they start.
const CONNECTING_AT_ONCE: usize = 8;

/// Memory contexts of one backend listed in the JSON figures, largest first.
const TOP_CONTEXTS: usize = 12;

/// How long a call may wait. A call told `wait` with no time to wait returns at once when
/// it meets a lock on once.entries, e.g. autovacuum truncating it after an earlier
/// benchmark deleted its rows; with time it waits for the lock, as callers do.
const WAIT: Duration = Duration::from_secs(10);

/// File descriptors the tool needs besides one socket per connection (the runtime's,
/// the admin connection, stdio).
const SPARE_FILES: u64 = 64;

/// One backend's memory, in kB, from /proc/<pid>/smaps_rollup.
#[derive(Clone, Copy, Default)]
struct Footprint {
    rss: u64,
    /// Proportional set size: each shared page (shared buffers, the binary, libraries)
    /// divided among the processes that map it.
    pss: u64,
    /// Private_Clean + Private_Dirty: pages only this backend maps (its caches, plans,
    /// copies of pages it wrote after the fork).
    private: u64,
    anonymous: u64,
}

impl Footprint {
    fn of(pid: i32) -> Result<Footprint> {
        let path = format!("/proc/{pid}/smaps_rollup");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("reading {path}: bench memory must run on the server's machine, as root or the server's user")
        })?;
        let mut f = Footprint::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(name), Some(kb)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(kb) = kb.parse::<u64>() else { continue };
            match name {
                "Rss:" => f.rss = kb,
                "Pss:" => f.pss = kb,
                "Private_Clean:" | "Private_Dirty:" => f.private += kb,
                "Anonymous:" => f.anonymous = kb,
                _ => {}
            }
        }
        anyhow::ensure!(f.rss > 0, "{path} has no Rss line");
        Ok(f)
    }
}

/// The soft limit on open files, from /proc/self/limits.
fn open_files_limit() -> Result<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits")?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("/proc/self/limits has no line for open files")?;
    let soft = line
        .split_whitespace()
        .nth(3)
        .context("no soft limit of open files")?;
    Ok(if soft == "unlimited" {
        u64::MAX
    } else {
        soft.parse()?
    })
}

/// The `what` of a connection: what it ran before it went idle.
#[derive(Clone, Copy, PartialEq)]
enum Workload {
    /// A claim_key hit on a completed key, a claim_key + complete_key on a key of its own,
    /// and a claim_next + complete_key on a queued job.
    Once,
    /// A primary-key SELECT, an INSERT and an UPDATE on an ordinary table.
    Baseline,
}

pub async fn memory(dsn: &str, connections: usize, baseline: bool) -> Result<serde_json::Value> {
    let files = open_files_limit()?;
    let needed = connections as u64 + SPARE_FILES;
    anyhow::ensure!(
        files >= needed,
        "{connections} connections need about {needed} open files and the limit is {files}: raise it first (ulimit -n {needed})"
    );
    let workload = if baseline {
        Workload::Baseline
    } else {
        Workload::Once
    };
    let admin = once::connect(dsn).await?;
    let row = admin
        .query_one(
            "SELECT current_setting('max_connections')::int,
                    (SELECT count(*)::int FROM pg_stat_activity WHERE backend_type = 'client backend'),
                    (SELECT coalesce(sum(allocated_size), 0)::bigint FROM pg_shmem_allocations
                      WHERE name LIKE 'pg_once%'),
                    pg_size_bytes(current_setting('shared_memory_size'))",
            &[],
        )
        .await?;
    let (max_connections, in_use, once_shmem, server_shmem): (i32, i32, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    // The shared memory pg_once registers (src/runtime/shmem: the struct "pg_once", whose
    // size grows with max_connections). Without it the server does not preload pg_once,
    // and neither side would measure a production backend.
    anyhow::ensure!(
        once_shmem > 0,
        "pg_once is not in the server's shared_preload_libraries: bench memory measures a server that preloads it"
    );
    anyhow::ensure!(
        connections as i32 + in_use + 3 <= max_connections,
        "max_connections is {max_connections} with {in_use} connections open: {connections} more need max_connections >= {}",
        connections as i32 + 20
    );
    // Fail now, not after opening a thousand connections, if /proc is not the server's.
    Footprint::of(once::backend_pid(&admin).await?)?;

    let tag = format!("bench_memory_{}", std::process::id());
    setup(&admin, workload, &tag, connections).await?;
    let started = Instant::now();
    let clients: Vec<(Client, i32)> = stream::iter(0..connections)
        .map(|i| {
            let tag = tag.clone();
            async move {
                let client = once::connect(dsn).await?;
                run(&client, workload, &tag, i).await?;
                let pid = once::backend_pid(&client).await?;
                anyhow::Ok((client, pid))
            }
        })
        .buffer_unordered(CONNECTING_AT_ONCE)
        .try_collect()
        .await?;
    let connect_s = started.elapsed().as_secs_f64();
    // All of them now sit idle, as a pool's connections do between requests.
    let footprints = clients
        .iter()
        .map(|(_, pid)| Footprint::of(*pid))
        .collect::<Result<Vec<_>>>()?;
    // Where one backend's memory goes, by memory context (palloc'd memory only: not
    // malloc, nor pages of libraries written after the fork), read after the figures above
    // since the query itself allocates.
    let contexts = clients[0]
        .0
        .query(
            "SELECT name, (sum(total_bytes) / 1024)::bigint FROM pg_backend_memory_contexts
              GROUP BY name ORDER BY 2 DESC",
            &[],
        )
        .await?;
    let contexts_total_kb: i64 = contexts.iter().map(|r| r.get::<_, i64>(1)).sum();
    let top_contexts_kb: Vec<serde_json::Value> = contexts
        .iter()
        .take(TOP_CONTEXTS)
        .map(|r| json!([r.get::<_, String>(0), r.get::<_, i64>(1)]))
        .collect();
    let pids: Vec<i32> = clients.iter().map(|(_, pid)| *pid).collect();
    drop(clients);
    wait_until_gone(&admin, &pids).await?;
    teardown(&admin, workload, &tag).await?;

    let summary = |figure: fn(&Footprint) -> u64| {
        let mut kb: Vec<u64> = footprints.iter().map(figure).collect();
        kb.sort_unstable();
        json!({"median": kb[kb.len() / 2], "min": kb[0], "max": kb[kb.len() - 1]})
    };
    let (private, pss) = (summary(|f| f.private), summary(|f| f.pss));
    let mb = |kb: &serde_json::Value| kb.as_u64().unwrap_or(0) as f64 / 1024.0;
    Ok(json!({
        "bench": "memory",
        "workload": if baseline { "baseline" } else { "once" },
        "connections": connections,
        "max_connections": max_connections,
        "connect_s": connect_s,
        // Per backend, kB.
        "rss_kb": summary(|f| f.rss),
        "pss_kb": pss,
        "private_kb": private,
        "anonymous_kb": summary(|f| f.anonymous),
        "contexts_total_kb": contexts_total_kb,
        "top_contexts_kb": top_contexts_kb,
        // The markdown row's figures, MB.
        "private_median_mb": mb(&private["median"]),
        "private_max_mb": mb(&private["max"]),
        "pss_median_mb": mb(&pss["median"]),
        "pss_max_mb": mb(&pss["max"]),
        "once_shmem_mb": once_shmem as f64 / 1048576.0,
        "shared_memory_mb": server_shmem as f64 / 1048576.0,
    }))
}

/// What the connections' workload needs, made once: a completed key for the hits and a
/// job per connection, or the baseline's table with the row its SELECTs read.
async fn setup(admin: &Client, workload: Workload, tag: &str, connections: usize) -> Result<()> {
    match workload {
        Workload::Once => {
            admin
                .execute("SELECT once.create_queue($1)", &[&tag])
                .await?;
            admin
                .execute(
                    "SELECT count(once.enqueue_key($1 || '/job/' || i, queue => $1))
                       FROM generate_series(1, $2) i",
                    &[&tag, &(connections as i32)],
                )
                .await?;
            let hit = format!("{tag}/hit");
            let claim = once::claim_key(admin, &hit, super::LEASE, WAIT).await?;
            let token = claim
                .token
                .with_context(|| format!("claiming a new key: {claim:?}"))?;
            anyhow::ensure!(
                once::complete_key(admin, &hit, token, &json!({"ok": true}), None).await?,
                "completing the key the connections hit"
            );
        }
        Workload::Baseline => {
            admin
                .batch_execute(&format!(
                    "CREATE TABLE {tag} (id bigint PRIMARY KEY, value jsonb NOT NULL);
                     INSERT INTO {tag} VALUES (0, '{{\"ok\": true}}');"
                ))
                .await?;
        }
    }
    Ok(())
}

/// Connection `i`'s workload.
async fn run(client: &Client, workload: Workload, tag: &str, i: usize) -> Result<()> {
    match workload {
        Workload::Once => {
            let hit = once::claim_key(client, &format!("{tag}/hit"), super::LEASE, WAIT).await?;
            anyhow::ensure!(hit.is("hit"), "the completed key was not a hit: {hit:?}");
            let own = format!("{tag}/own/{i}");
            let claim = once::claim_key(client, &own, super::LEASE, WAIT).await?;
            let token = claim
                .token
                .with_context(|| format!("claiming a new key: {claim:?}"))?;
            anyhow::ensure!(
                once::complete_key(client, &own, token, &json!({"ok": true}), None).await?
            );
            let job = client
                .query_one(
                    "SELECT key, token FROM once.claim_next($1, worker => $2, wait => make_interval(secs => $3))",
                    &[&tag, &format!("m{i}"), &WAIT.as_secs_f64()],
                )
                .await
                .context("claim_next found no job")?;
            let (key, token): (String, i64) = (job.get(0), job.get(1));
            anyhow::ensure!(
                once::complete_key(client, &key, token, &json!({"ok": true}), None).await?
            );
        }
        Workload::Baseline => {
            client
                .query_one(&format!("SELECT value FROM {tag} WHERE id = 0"), &[])
                .await?;
            let id = i as i64 + 1;
            client
                .execute(&format!("INSERT INTO {tag} VALUES ($1, '{{}}')"), &[&id])
                .await?;
            client
                .execute(
                    &format!("UPDATE {tag} SET value = '{{\"ok\": true}}' WHERE id = $1"),
                    &[&id],
                )
                .await?;
        }
    }
    Ok(())
}

async fn teardown(admin: &Client, workload: Workload, tag: &str) -> Result<()> {
    match workload {
        Workload::Once => {
            super::drop_queue(admin, super::QueueImpl::Once, tag).await?;
            admin
                .execute(
                    "DELETE FROM once.entries WHERE key LIKE $1 || '/%'",
                    &[&tag],
                )
                .await?;
        }
        Workload::Baseline => admin.batch_execute(&format!("DROP TABLE {tag}")).await?,
    }
    Ok(())
}

/// Wait until the closed connections' backends have exited, so that the next round (or
/// the next run of the script) finds its connection slots free.
async fn wait_until_gone(admin: &Client, pids: &[i32]) -> Result<()> {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let left: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
                &[&pids],
            )
            .await?
            .get(0);
        if left == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < give_up,
            "{left} backends still there 60 s after their connections closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
