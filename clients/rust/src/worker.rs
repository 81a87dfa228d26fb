//! [`Client::work`]: the queue worker loop.

use crate::claim_task;
use crate::error::{Error, Result};
use crate::inner::Inner;
use crate::raw::{self, Job, Owner};
use crate::run::{compute_with_heartbeat, ComputeError, Ran};
use crate::Client;
use futures_util::FutureExt;
use serde::Serialize;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How [`Client::work`] runs.
#[derive(Debug, Clone)]
pub struct WorkOptions {
    /// Jobs handled at once; `claim_next` is asked for as many as there are free slots.
    /// Default 1 (rule W2: a handler need not be safe to run beside itself unless asked).
    pub concurrency: usize,
    /// Lease of each claimed job, heartbeated every `lease / 3`. Default 30 s.
    pub lease: Duration,
    /// When idle, how long `claim_next` waits inside the server for a job (holding one
    /// pooled connection meanwhile; shutdown is noticed after at most this). Default 1 s.
    pub idle_wait: Duration,
    /// When busy with free slots, how often to look for more work (jittered). Default 200 ms.
    pub poll: Duration,
    /// The worker's name in `once.attempts`. Default `host:pid` (rule W2), as the Python
    /// and Node workers name themselves; None records no name.
    pub worker: Option<String>,
    /// How long results are cached (None: until invalidated). Default None.
    pub ttl: Option<Duration>,
    /// Passed to `fail_key` for a failed job (the queue's backoff applies if longer).
    /// Default 0.
    pub retry_after: Duration,
    /// On shutdown, how long running jobs may take to finish before they are stopped and
    /// their keys released (back to the queue, the attempt not counted). Default 30 s
    /// (rule W2's `grace`).
    pub drain: Duration,
}

impl Default for WorkOptions {
    fn default() -> Self {
        WorkOptions {
            concurrency: 1,
            lease: Duration::from_secs(30),
            idle_wait: Duration::from_secs(1),
            poll: Duration::from_millis(200),
            worker: Some(worker_name()),
            ttl: None,
            retry_after: Duration::ZERO,
            drain: Duration::from_secs(30),
        }
    }
}

/// `host:pid`, the default worker name of every client (rule W2): the host as
/// `socket.gethostname()` and `os.hostname()` give it (the kernel's node name), so that a
/// Rust, Python and Node worker on one machine are told apart by their pid alone.
fn worker_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// What a worker loop did, returned when it stops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkReport {
    /// Jobs whose result was stored.
    pub completed: u64,
    /// Jobs whose handler returned an error (the key was failed with it).
    pub failed: u64,
    /// Jobs whose claim was lost before their result was stored.
    pub lost: u64,
    /// Jobs given back unfinished at shutdown.
    pub released: u64,
    /// Jobs whose ending call (complete, fail, release) failed on a connection error.
    pub errors: u64,
}

enum End {
    Completed,
    Failed,
    Lost,
    Released,
    Error,
}

impl WorkReport {
    fn count(&mut self, end: End) {
        match end {
            End::Completed => self.completed += 1,
            End::Failed => self.failed += 1,
            End::Lost => self.lost += 1,
            End::Released => self.released += 1,
            End::Error => self.errors += 1,
        }
    }
}

impl Client {
    /// Work `queue` until `shutdown` resolves: claim up to `concurrency` jobs at once
    /// (`claim_next(n => free slots, owner_pid => P)`), run `handler` on each with
    /// heartbeats, and complete the key with its result or fail it with its error. When
    /// idle it waits for work inside the server (`idle_wait`). On shutdown it claims
    /// nothing more, lets running jobs finish for up to `drain`, then stops the rest and
    /// releases their keys. Returns what it did; an error only for one that retrying
    /// cannot fix (e.g. an unknown queue).
    pub async fn work<H, Fut, T, E>(
        &self,
        queue: &str,
        handler: H,
        opts: WorkOptions,
        shutdown: impl Future<Output = ()>,
    ) -> Result<WorkReport>
    where
        H: Fn(Job) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
        T: Serialize + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
    {
        let inner = self.inner.clone();
        let handler = Arc::new(handler);
        let concurrency = opts.concurrency.max(1);
        let (give_up, give_up_rx) = watch::channel(false);
        let mut running: JoinSet<End> = JoinSet::new();
        let mut report = WorkReport::default();
        let mut server_wait = true;
        let mut trouble = Duration::from_millis(100);
        let shutdown = shutdown.fuse();
        tokio::pin!(shutdown);

        'work: loop {
            while let Some(done) = running.try_join_next() {
                report.count(done.unwrap_or(End::Error));
            }
            let free = concurrency - running.len();
            let mut claimed_any = false;
            if free > 0 {
                let wait = if running.is_empty() && server_wait {
                    opts.idle_wait
                } else {
                    Duration::ZERO
                };
                // The claim is not raced against shutdown: the keys it claims are handled.
                // Shutdown is noticed when it returns.
                let claimed = match inner.owner(opts.lease).await {
                    Ok(owner) => {
                        // R2: a worker's claim has no caller's wait; its budget is any
                        // statement's.
                        let budget = Instant::now() + inner.options.connect_timeout;
                        let claimed = with_conn!(inner, until budget, owned |conn| {
                            claim_jobs(&inner, conn, queue, &opts, free as i32, wait, owner)
                        });
                        match claimed {
                            // R3: the owner pid died under the call; ask again as the new one.
                            Err(e) if inner.owner_died(&e, owner, opts.lease).await => continue,
                            other => other,
                        }
                    }
                    Err(e) => Err(e),
                };
                match claimed {
                    Ok(jobs) => {
                        trouble = Duration::from_millis(100);
                        claimed_any = !jobs.is_empty();
                        let stopping = (&mut shutdown).now_or_never().is_some();
                        for job in jobs {
                            if stopping {
                                let end = release(&inner, &job).await;
                                report.count(end);
                            } else {
                                running.spawn(run_job(
                                    inner.clone(),
                                    handler.clone(),
                                    job,
                                    opts.clone(),
                                    give_up_rx.clone(),
                                ));
                            }
                        }
                        if stopping {
                            break 'work;
                        }
                    }
                    Err(e) if e.sqlstate() == Some("42883") && server_wait => {
                        // A server whose claim_next has no `wait`: poll instead.
                        server_wait = false;
                        continue;
                    }
                    Err(e) if e.is_connection_error() || matches!(e, Error::Listener(_)) => {
                        tokio::select! {
                            _ = &mut shutdown => break 'work,
                            _ = tokio::time::sleep(crate::jitter(trouble)) => {}
                        }
                        trouble = (trouble * 2).min(Duration::from_secs(5));
                        continue;
                    }
                    Err(e) => {
                        let _ = give_up.send(true);
                        while let Some(done) = running.join_next().await {
                            report.count(done.unwrap_or(End::Error));
                        }
                        return Err(e);
                    }
                }
            }
            if claimed_any && running.len() < concurrency {
                continue; // there may be more: ask again at once
            }
            // Full, or nothing due: wait for a free slot, shutdown, or the next look.
            let look_again = if running.len() >= concurrency {
                Duration::from_secs(3600)
            } else if running.is_empty() && server_wait {
                Duration::ZERO // claim_next already waited inside the server
            } else {
                crate::jitter(opts.poll)
            };
            tokio::select! {
                biased;
                _ = &mut shutdown => break 'work,
                Some(done) = running.join_next(), if !running.is_empty() => {
                    report.count(done.unwrap_or(End::Error));
                }
                _ = tokio::time::sleep(look_again) => {}
            }
        }

        // Shutdown: finish what we hold for up to `drain`, then release the rest.
        let drained = tokio::time::timeout(opts.drain, async {
            while let Some(done) = running.join_next().await {
                report.count(done.unwrap_or(End::Error));
            }
        })
        .await;
        if drained.is_err() {
            let _ = give_up.send(true);
            while let Some(done) = running.join_next().await {
                report.count(done.unwrap_or(End::Error));
            }
        }
        Ok(report)
    }
}

/// `claim_next` on `conn`, on a task of its own (`claim_task`): when the loop's future is
/// dropped while it is on its way (its caller stopped it some other way than `shutdown`),
/// the jobs it claims are released when its answer comes, rather than held by nobody
/// until their lease runs out (R2).
async fn claim_jobs(
    inner: &Arc<Inner>,
    conn: deadpool_postgres::Object,
    queue: &str,
    opts: &WorkOptions,
    n: i32,
    wait: Duration,
    owner: Owner,
) -> Result<Vec<Job>> {
    let statement = {
        let (queue, worker, lease) = (queue.to_owned(), opts.worker.clone(), opts.lease);
        async move { raw::claim_next(&conn, &queue, lease, worker.as_deref(), n, wait, owner).await }
    };
    let claims_in = |jobs: Vec<Job>| jobs.into_iter().map(|j| (j.key, j.token)).collect();
    claim_task::claim_on_its_own_task(inner, statement, claims_in, None)
        .await
        .expect("a claim waited for without a bound is answered")
}

async fn release(inner: &Inner, job: &Job) -> End {
    match with_conn!(inner, |c| raw::release_key(c, &job.key, job.token)) {
        Ok(true) => End::Released,
        Ok(false) => End::Lost,
        Err(e) => {
            tracing::warn!(key = job.key, error = %e, "pg_once: could not release a job at shutdown");
            End::Error
        }
    }
}

/// Handle one claimed job, from handler to complete / fail / release.
async fn run_job<H, Fut, T, E>(
    inner: Arc<Inner>,
    handler: Arc<H>,
    job: Job,
    opts: WorkOptions,
    mut give_up: watch::Receiver<bool>,
) -> End
where
    H: Fn(Job) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    T: Serialize + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    let work = handler(job.clone());
    let work = async move {
        let value = work.await.map_err(ComputeError::failed)?;
        serde_json::to_value(value).map_err(ComputeError::Serialize)
    }
    .boxed();
    let ran = tokio::select! {
        ran = compute_with_heartbeat(&inner, &job.key, job.token, opts.lease, work) => ran,
        _ = async { drop(give_up.wait_for(|stop| *stop).await) } => return release(&inner, &job).await,
    };
    let (key, token) = (job.key.as_str(), job.token);
    let outcome = match ran {
        Ran::Lost => return End::Lost,
        Ran::Done(Ok(value)) => with_conn!(inner, |c| raw::complete_key(
            c, key, token, &value, opts.ttl
        ))
        .map(|stored| if stored { End::Completed } else { End::Lost }),
        Ran::Done(Err(e)) => {
            let message = match e {
                ComputeError::Failed(kind, e) => crate::run::failure_text(kind, &*e),
                ComputeError::Serialize(e) => format!("the result is not JSON-serialisable: {e}"),
            };
            with_conn!(inner, |c| raw::fail_key(
                c,
                key,
                token,
                &message,
                opts.retry_after
            ))
            .map(|failed| if failed { End::Failed } else { End::Lost })
        }
    };
    outcome.unwrap_or(End::Error)
}

#[cfg(test)]
mod tests {
    use super::WorkOptions;
    use std::time::Duration;

    #[test]
    fn defaults_are_the_contracts() {
        // W2: concurrency 1, lease 30 s, ttl none, retry_after 0, idle_wait 1 s, grace 30 s,
        // name host:pid.
        let o = WorkOptions::default();
        assert_eq!(o.concurrency, 1);
        assert_eq!(o.lease, Duration::from_secs(30));
        assert_eq!(o.ttl, None);
        assert_eq!(o.retry_after, Duration::ZERO);
        assert_eq!(o.idle_wait, Duration::from_secs(1));
        assert_eq!(o.drain, Duration::from_secs(30));
        let name = o.worker.expect("a default name");
        let (host, pid) = name.rsplit_once(':').expect("host:pid");
        assert!(!host.is_empty(), "{name}");
        assert_eq!(pid, std::process::id().to_string());
    }
}
