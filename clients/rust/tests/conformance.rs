//! The conformance suite's scenarios (clients/conformance/scenarios, format in the README
//! there), run against a real server in every setup (direct, PgBouncer, TLS). The suite is
//! read from `PG_ONCE_CONFORMANCE_DIR`, or the repository's `clients/conformance`. A case
//! that needs what Rust lacks (a Python-only type, a call this runner does not make) is
//! skipped and named.

mod common;

use common::proxy::{HoldingProxy, Server};
use common::{at_server, fresh, setups, standby_first_setups, Setup};
use pg_once_client::{CallOptions, Client, Error, Job, Options, OutcomeHook, WorkOptions};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

fn suite_dir() -> PathBuf {
    std::env::var_os("PG_ONCE_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../conformance")))
}

/// Every scenario case: (file, case).
/// Each case with its file's name and the setups the file names, if it names any.
fn scenarios() -> Vec<(String, Value, Option<Vec<String>>)> {
    let dir = suite_dir().join("scenarios");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("{}: no scenarios: skipped", dir.display());
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    let mut cases = Vec::new();
    for path in files {
        let suite: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let only: Option<Vec<String>> = suite["setups"].as_array().map(|s| {
            s.iter()
                .map(|v| v.as_str().expect("setup names").to_owned())
                .collect()
        });
        for case in suite["cases"].as_array().expect("cases") {
            cases.push((file.clone(), case.clone(), only.clone()));
        }
    }
    cases
}

/// Why a case cannot run in Rust.
struct Skip(String);

/// A value in the vector notation as Rust's JSON; Err for a type Rust lacks.
fn value(v: &Value) -> Result<Value, Skip> {
    Ok(match v {
        Value::Array(items) => Value::Array(items.iter().map(value).collect::<Result<_, _>>()?),
        Value::Object(m) if m.len() == 1 && m.keys().next().is_some_and(|k| k.starts_with('$')) => {
            let (tag, inner) = m.iter().next().unwrap();
            match tag.as_str() {
                "$repeat" => Value::String(
                    inner[0]
                        .as_str()
                        .unwrap()
                        .repeat(inner[1].as_u64().unwrap() as usize),
                ),
                "$tuple" => value(inner)?,
                other => return Err(Skip(format!("a {other} value"))),
            }
        }
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| Ok((k.clone(), value(v)?)))
                .collect::<Result<_, Skip>>()?,
        ),
        other => other.clone(),
    })
}

fn seconds(v: &Value) -> Duration {
    Duration::from_secs_f64(v.as_f64().expect("seconds"))
}

fn call_options(options: &Value) -> CallOptions {
    let mut o = CallOptions::default();
    let Some(options) = options.as_object() else {
        return o;
    };
    for (name, v) in options {
        match name.as_str() {
            "ttl" => o.ttl = Some(if v.is_null() { None } else { Some(seconds(v)) }),
            "lease" => o.lease = Some(seconds(v)),
            "wait" => o.wait = Some(seconds(v)),
            "retry_after" => o.retry_after = Some(seconds(v)),
            "stale" => o.stale = Some(seconds(v)),
            "beta" => o.beta = v.as_f64(),
            "jitter" => o.jitter = v.as_f64(),
            // enqueue_many's and work's, read by their calls.
            "queue" | "concurrency" | "grace" => {}
            other => panic!("unknown option {other}"),
        }
    }
    o
}

/// `counts_stop`: counts when dropped, as a computation is when its call's cancellation
/// stops it (X2); forgotten when the computation ends by itself.
struct CountsIfDropped(Option<Arc<AtomicUsize>>);

impl Drop for CountsIfDropped {
    fn drop(&mut self) {
        if let Some(c) = &self.0 {
            c.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// One run of a case: its clients, keys, counters and background calls.
struct Run<'a> {
    setup: &'a Setup,
    prefix: String,
    clients: Vec<Client>,
    /// What each client's outcome hook saw: (key, kind, duration), in order.
    outcomes: Vec<Seen>,
    counters: HashMap<String, Arc<AtomicUsize>>,
    background: HashMap<String, Call>,
    /// The pid of each client's LISTEN connection a `kill_listener` step terminated.
    killed: HashMap<usize, i32>,
    /// The stop of each `work` step's worker, by its `as`, for `stop` steps.
    stops: HashMap<String, Arc<tokio::sync::Notify>>,
    admin: tokio_postgres::Client,
    /// `"proxy": true`: client N's pool goes through `proxies[N]`. Dropped with the run,
    /// at the end of the case, they close every connection they made.
    proxies: Vec<HoldingProxy>,
}

type Outcome = Result<Value, Error>;

/// What one client's outcome hook saw: (key, kind, how long the call took), in order.
type Seen = Arc<Mutex<Vec<(String, &'static str, Duration)>>>;

/// A call under way: its task, when it started, which client made it, and its key.
struct Call {
    handle: JoinHandle<Outcome>,
    /// How its task ended, once a `cancel` step has waited for that.
    ended: Option<Result<Outcome, tokio::task::JoinError>>,
    started: Instant,
    client: usize,
    key: String,
}

impl Run<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}/{k}", self.prefix)
    }

    /// A queue of the run's own (`{queue:q}`): the prefix, which a queue name allows.
    fn queue(&self, q: &str) -> String {
        format!("{q}_{}", self.prefix.trim_start_matches("conformance-"))
    }

    /// `{key:k}` in SQL becomes the run's key, quoted for a literal.
    fn sql(&self, text: &str) -> String {
        let mut text = text.to_owned();
        while let Some(start) = text.find("{queue:") {
            let end = start + text[start..].find('}').expect("{queue:...} is closed");
            let queue = self.queue(&text[start + 7..end]);
            text.replace_range(start..=end, &queue);
        }
        let mut out = String::new();
        let mut rest = text.as_str();
        while let Some(start) = rest.find("{key:") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 5..];
            // The key ends at the '}' that closes the placeholder: the last one before
            // the literal's closing quote.
            let end = after.find("}'").expect("{key:...} inside a quoted literal");
            out.push_str(&self.key(&after[..end]).replace('\'', "''"));
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        out
    }

    fn counter(&mut self, name: &str) -> Arc<AtomicUsize> {
        self.counters.entry(name.to_owned()).or_default().clone()
    }

    /// The compute function a step describes, returning JSON.
    fn compute(
        &mut self,
        spec: &Value,
    ) -> Result<
        impl FnOnce() -> futures_util::future::BoxFuture<'static, Result<Value, std::io::Error>>
            + Send
            + Clone
            + 'static,
        Skip,
    > {
        let counter = spec["counts"].as_str().map(|c| self.counter(c));
        let stopped = spec["counts_stop"].as_str().map(|c| self.counter(c));
        let sleep = Duration::from_millis(spec["sleep_ms"].as_u64().unwrap_or(0));
        let returns = match spec.get("returns") {
            Some(v) => Some(value(v)?),
            None => None,
        };
        let raises = spec["raises"].as_str().map(str::to_owned);
        Ok(
            move || -> futures_util::future::BoxFuture<'static, Result<Value, std::io::Error>> {
                Box::pin(async move {
                    if let Some(c) = counter {
                        c.fetch_add(1, Ordering::SeqCst);
                    }
                    let unfinished = CountsIfDropped(stopped);
                    tokio::time::sleep(sleep).await;
                    std::mem::forget(unfinished);
                    match raises {
                        Some(message) => Err(std::io::Error::other(message)),
                        None => Ok(returns.unwrap_or(Value::Null)),
                    }
                })
            },
        )
    }

    /// Start the call a step describes: polled once here, so that it has begun (made
    /// its claim or joined another call's, C1) before the next step, then on a task.
    async fn start(&mut self, step: &Value) -> Result<Call, Skip> {
        let started = Instant::now();
        let (mut call, key) = self.call(step)?;
        let handle = match futures_util::poll!(&mut call) {
            std::task::Poll::Ready(outcome) => tokio::spawn(async move { outcome }),
            std::task::Poll::Pending => tokio::spawn(call),
        };
        Ok(Call {
            handle,
            ended: None,
            started,
            client: step["client"].as_u64().unwrap_or(0) as usize,
            key,
        })
    }

    /// The call a step describes.
    fn call(
        &mut self,
        step: &Value,
    ) -> Result<(futures_util::future::BoxFuture<'static, Outcome>, String), Skip> {
        let client = self.clients[step["client"].as_u64().unwrap_or(0) as usize].clone();
        if step["call"] == "ready" {
            let ready = async move {
                client
                    .ready(Duration::from_secs(10))
                    .await
                    .map(|()| Value::Bool(true))
            };
            return Ok((Box::pin(ready), String::new()));
        }
        let opts = call_options(&step["options"]);
        let name = step["name"].as_str().map(|n| self.key(n));
        let args = match step.get("args") {
            Some(args) => Some(value(args)?),
            None => None,
        };
        // The call's key: given, or derived from the wrapper's name and arguments.
        let key = match (step.get("key"), &name, &args) {
            (Some(k), _, _) => self.key(k.as_str().expect("key")),
            // A batch (enqueue_many): the outcome hook is read for its first key.
            (None, _, _) if step.get("jobs").is_some() => {
                self.key(step["jobs"][0]["key"].as_str().expect("key"))
            }
            // A worker: no key of its own.
            (None, _, _) if step["call"] == "work" => String::new(),
            (None, Some(name), Some(args)) => {
                pg_once_client::key::derive(name, args).expect("a default key")
            }
            _ => panic!("a call needs a key, or a name and args"),
        };
        let call: futures_util::future::BoxFuture<'static, Outcome> =
            match step["call"].as_str().expect("call") {
                "get_or_compute" => {
                    let compute = self.compute(&step["compute"])?;
                    let key = key.clone();
                    Box::pin(async move {
                        client
                            .get_or_compute::<Value, _, _, _>(&key, compute, opts)
                            .await
                    })
                }
                "cached" => {
                    let compute = self.compute(&step["compute"])?;
                    let wrapped = client.cached_named(
                        &name.expect("name"),
                        move |_: Vec<Value>| (compute.clone())(),
                        opts,
                    );
                    let args: Vec<Value> = serde_json::from_value(args.expect("args")).unwrap();
                    Box::pin(async move { wrapped.call::<_, Value, _>(args).await })
                }
                "invalidate" => {
                    let key = key.clone();
                    Box::pin(async move { client.invalidate(&key).await.map(Value::Bool) })
                }
                "refresh" => {
                    let key = key.clone();
                    let stale = step["options"].get("stale").map(seconds);
                    Box::pin(async move { client.refresh(&key, stale).await.map(Value::String) })
                }
                "enqueue_many" => {
                    let jobs: Vec<(String, Option<Value>)> = step["jobs"]
                        .as_array()
                        .expect("jobs")
                        .iter()
                        .map(|j| {
                            Ok((
                                self.key(j["key"].as_str().expect("key")),
                                j.get("payload").map(value).transpose()?,
                            ))
                        })
                        .collect::<Result<_, Skip>>()?;
                    let queue = step["options"]["queue"]
                        .as_str()
                        .unwrap_or("default")
                        .to_owned();
                    Box::pin(async move {
                        let jobs: Vec<(&str, Option<&Value>)> =
                            jobs.iter().map(|(k, p)| (k.as_str(), p.as_ref())).collect();
                        let answered = client.enqueue_many(&jobs, &queue).await?;
                        Ok(Value::Array(
                            answered
                                .into_iter()
                                .map(|(_, outcome)| Value::String(outcome))
                                .collect(),
                        ))
                    })
                }
                "work" => self.work(client, step),
                other => return Err(Skip(format!("call {other}"))),
            };
        Ok((call, key))
    }

    /// A worker on the run's queue, with the step's `options` (W2's `grace` is this
    /// client's `drain`), whose handler sleeps the job's payload's `sleep_ms`, then returns
    /// the payload or fails with its `raises`; it stops once it has run `max_jobs`
    /// handlers, or at a `stop` step naming it (`as`). Answers how many ran.
    fn work(
        &mut self,
        client: Client,
        step: &Value,
    ) -> futures_util::future::BoxFuture<'static, Outcome> {
        let queue = self.queue(step["queue"].as_str().expect("queue"));
        let counter = step["handler"]["counts"].as_str().map(|c| self.counter(c));
        let stopped = step["handler"]["counts_stop"]
            .as_str()
            .map(|c| self.counter(c));
        let max_jobs = step["max_jobs"].as_u64().map_or(usize::MAX, |n| n as usize);
        let handled = Arc::new(AtomicUsize::new(0));
        let enough = Arc::new(tokio::sync::Notify::new());
        if let Some(name) = step["as"].as_str() {
            self.stops.insert(name.to_owned(), enough.clone());
        }
        let handler = {
            let (handled, enough) = (handled.clone(), enough.clone());
            move |job: Job| {
                let (handled, enough, counter) = (handled.clone(), enough.clone(), counter.clone());
                let stopped = stopped.clone();
                async move {
                    if let Some(c) = counter {
                        c.fetch_add(1, Ordering::SeqCst);
                    }
                    if handled.fetch_add(1, Ordering::SeqCst) + 1 >= max_jobs {
                        enough.notify_one();
                    }
                    let payload = job.payload.unwrap_or(Value::Null);
                    if let Some(ms) = payload.get("sleep_ms").and_then(Value::as_u64) {
                        // `counts_stop`: the worker's stop dropped the handler (W3).
                        let unfinished = CountsIfDropped(stopped);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        std::mem::forget(unfinished);
                    }
                    match payload.get("raises").and_then(Value::as_str) {
                        Some(message) => Err(std::io::Error::other(message.to_owned())),
                        None => Ok(payload),
                    }
                }
            }
        };
        let mut opts = WorkOptions {
            idle_wait: Duration::from_millis(200),
            ..WorkOptions::default()
        };
        if let Some(options) = step["options"].as_object() {
            for (name, v) in options {
                match name.as_str() {
                    "concurrency" => opts.concurrency = v.as_u64().expect("a count") as usize,
                    "lease" => opts.lease = seconds(v),
                    "grace" => opts.drain = seconds(v),
                    other => panic!("a work option this runner does not know: {other}"),
                }
            }
        }
        Box::pin(async move {
            client
                .work(
                    &queue,
                    handler,
                    opts,
                    async move { enough.notified().await },
                )
                .await?;
            Ok(Value::from(handled.load(Ordering::SeqCst)))
        })
    }

    /// Check a step's `expect` against a call's outcome.
    fn check(
        &self,
        what: &str,
        call: (usize, &str),
        outcome: &Outcome,
        expect: &Value,
        started: Instant,
    ) {
        if let Some(kind) = expect.get("outcome").and_then(Value::as_str) {
            let seen = self.outcomes[call.0].lock().unwrap();
            let last = seen
                .iter()
                .rev()
                .find(|(k, _, _)| k == call.1)
                .map(|(_, kind, _)| *kind);
            assert_eq!(
                last,
                Some(kind),
                "{what}: the outcome hook; the call: {outcome:?}"
            );
        }
        if let Some(ms) = expect.get("within_ms").and_then(Value::as_u64) {
            assert!(
                started.elapsed() <= Duration::from_millis(ms),
                "{what}: took {:?}",
                started.elapsed()
            );
        }
        if let Some(want) = expect.get("value") {
            let want =
                value(want).unwrap_or_else(|_| panic!("{what}: an expected value Rust lacks"));
            match outcome {
                Ok(got) => assert_eq!(got, &want, "{what}"),
                Err(e) => panic!("{what}: {e}"),
            }
        }
        if let Some(raised) = expect.get("raised").and_then(Value::as_str) {
            match outcome {
                Err(Error::Compute { source, .. }) => {
                    assert_eq!(source.to_string(), raised, "{what}")
                }
                other => panic!("{what}: expected the compute's own error, got {other:?}"),
            }
        }
        if let Some(kind) = expect.get("error").and_then(Value::as_str) {
            let e = match outcome {
                Err(e) => e,
                Ok(v) => panic!("{what}: expected {kind}, got {v}"),
            };
            let matches = match kind {
                "Failed" => matches!(e, Error::Failed { .. }),
                "Timeout" => matches!(e, Error::Timeout { .. }),
                "ClaimLost" => matches!(e, Error::ClaimLost { .. }),
                "NotSerializable" => matches!(e, Error::NotSerializable { .. }),
                "Configuration" => matches!(e, Error::Configuration(_)),
                "Invalid" => matches!(e, Error::InvalidOption(_)),
                "Refused" => matches!(e, Error::Db(_)) && !e.is_connection_error(),
                "Cancelled" => false, // a call that ended by itself
                other => panic!("{what}: unknown error kind {other}"),
            };
            assert!(matches, "{what}: expected {kind}, got {e:?}");
            if let Some(code) = expect.get("sqlstate").and_then(Value::as_str) {
                assert_eq!(e.sqlstate(), Some(code), "{what}");
            }
            // This client's name of the option is the scenarios' own.
            if let Some(option) = expect.get("message_names_option").and_then(Value::as_str) {
                assert!(e.to_string().contains(option), "{what}: {e}");
            }
            if let Some(part) = expect.get("message_contains").and_then(Value::as_str) {
                assert!(e.to_string().contains(part), "{what}: {e}");
            }
        }
    }

    /// Wait for a call to end and check it against `expect`. A call bounded by
    /// `within_ms` is waited for that long only: one that would end only after a later
    /// step (a `resume`) fails the case rather than hang it.
    async fn finish(&self, what: &str, mut call: Call, expect: &Value) {
        let ended = match call.ended.take() {
            Some(ended) => ended,
            None => match expect.get("within_ms").and_then(Value::as_u64) {
                Some(ms) => {
                    let bound = call.started + Duration::from_millis(ms);
                    match tokio::time::timeout_at(bound.into(), &mut call.handle).await {
                        Ok(ended) => ended,
                        Err(_) => {
                            call.handle.abort();
                            panic!("{what}: still running after {ms} ms");
                        }
                    }
                }
                None => call.handle.await,
            },
        };
        let outcome = match ended {
            Ok(outcome) => outcome,
            // A `cancel` step's: its future was dropped (X2), the error kind Cancelled.
            Err(e) if e.is_cancelled() => {
                assert_eq!(expect["error"], "Cancelled", "{what}: cancelled");
                return;
            }
            Err(e) => panic!("{what}: {e}"),
        };
        self.check(
            what,
            (call.client, &call.key),
            &outcome,
            expect,
            call.started,
        );
    }

    /// The rows `sql` answers on the test's own connection (of its last statement), each
    /// row a JSON array of its columns, in order.
    async fn rows(&self, what: &str, sql: &str) -> Value {
        let wrapped = format!(
            "SELECT (SELECT json_agg(value) FROM json_each(row_to_json(q)))::text FROM ({sql}) q"
        );
        let got = self
            .admin
            .query(&wrapped, &[])
            .await
            .unwrap_or_else(|e| panic!("{what}: {sql}: {e}"))
            .iter()
            .map(|r| serde_json::from_str(r.get::<_, &str>(0)).unwrap())
            .collect();
        Value::Array(got)
    }

    /// Client `n`'s proxy, for `pause` and `resume` steps.
    fn proxy(&self, what: &str, n: u64) -> &HoldingProxy {
        self.proxies.get(n as usize).unwrap_or_else(|| {
            panic!("{what}: client {n} has no proxy (the case needs \"proxy\": true)")
        })
    }

    async fn step(&mut self, what: &str, step: &Value) -> Result<(), Skip> {
        let expect = step.get("expect").cloned().unwrap_or(Value::Null);
        let expect = match step.get("within_ms") {
            Some(ms) => {
                let mut e = expect.as_object().cloned().unwrap_or_default();
                e.insert("within_ms".into(), ms.clone());
                Value::Object(e)
            }
            None => expect,
        };
        if let Some(ms) = step.get("sleep_ms").and_then(Value::as_u64) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        } else if let Some(sql) = step.get("sql").and_then(Value::as_str) {
            let sql = self.sql(sql);
            match expect.get("rows") {
                Some(rows) => assert_eq!(self.rows(what, &sql).await, *rows, "{what}: {sql}"),
                None => self
                    .admin
                    .batch_execute(&sql)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: {sql}: {e}")),
            }
        } else if let Some([name, n]) = step
            .pointer("/until/counter")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
        {
            // Waited for, up to 10 s: a counter reaching a count.
            let (counter, n) = (self.counter(name.as_str().unwrap()), n.as_u64().unwrap());
            let deadline = Instant::now() + Duration::from_secs(10);
            while (counter.load(Ordering::SeqCst) as u64) < n && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(
                counter.load(Ordering::SeqCst) as u64 >= n,
                "{what}: counter {name} never reached {n}"
            );
        } else if let Some(until) = step.pointer("/until/sql").and_then(Value::as_str) {
            // Waited for, up to 10 s: the SQL's rows becoming those (a claim has reached
            // the server, say).
            let (sql, want) = (self.sql(until), &step["until"]["rows"]);
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut got = self.rows(what, &sql).await;
            while got != *want && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
                got = self.rows(what, &sql).await;
            }
            assert_eq!(
                got, *want,
                "{what}: {sql} never answered those rows in 10 s"
            );
        } else if let Some(n) = step.get("pause").and_then(Value::as_u64) {
            self.proxy(what, n).pause();
        } else if let Some(n) = step.get("resume").and_then(Value::as_u64) {
            self.proxy(what, n).resume();
        } else if let Some(n) = step.get("kill_listener").and_then(Value::as_u64) {
            let n = n as usize;
            self.clients[n]
                .ready(Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let pid = self.clients[n].owner_pid().expect("the client listens");
            self.killed.insert(n, pid);
            // Waited for until the backend has exited (up to 10 s): a claim made with its
            // pid while it is still exiting would be accepted, then lost with it, where the
            // scenario means a claim refused for a dead pid (R3).
            self.admin
                .execute("SELECT pg_terminate_backend($1, 10000)", &[&pid])
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        } else if let Some(n) = expect.get("new_listener").and_then(Value::as_u64) {
            // The client listens again, on another backend: waited for, up to 10 s.
            let (n, deadline) = (n as usize, Instant::now() + Duration::from_secs(10));
            let killed = self.killed[&n];
            let moved = || matches!(self.clients[n].owner_pid(), Some(p) if p > 0 && p != killed);
            while !moved() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(
                moved(),
                "{what}: client {n} listens as {:?}, killed {killed}",
                self.clients[n].owner_pid()
            );
        } else if let Some(name) = step.get("stop").and_then(Value::as_str) {
            // Gracefully: the worker's drain (W2's grace), then its handlers dropped (W3).
            self.stops[name].notify_one();
        } else if let Some(name) = step.get("cancel").and_then(Value::as_str) {
            // Cancelled once its future has been dropped, not when abort() returns: the
            // steps after it (a `resume` that lets the claim's answer through) come after
            // the cancellation, as the case says.
            let call = self
                .background
                .get_mut(name)
                .expect("a background call of that name");
            call.handle.abort();
            call.ended = Some((&mut call.handle).await);
        } else if let Some(name) = step.get("await").and_then(Value::as_str) {
            let call = self
                .background
                .remove(name)
                .expect("a background call of that name");
            self.finish(what, call, &expect).await;
        } else if step.get("call").is_some() {
            let call = self.start(step).await?;
            if step["background"].as_bool() == Some(true) {
                let name = step["as"]
                    .as_str()
                    .expect("a background call has a name (as)");
                self.background.insert(name.to_owned(), call);
            } else {
                self.finish(what, call, &expect).await;
            }
        } else if let Some([name, n]) = expect
            .get("counter")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
        {
            let got = self.counter(name.as_str().unwrap()).load(Ordering::SeqCst);
            assert_eq!(got as u64, n.as_u64().unwrap(), "{what}: counter {name}");
        } else if let Some([client, kinds]) = expect
            .get("outcomes")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
        {
            let seen = self.outcomes[client.as_u64().unwrap() as usize]
                .lock()
                .unwrap()
                .clone();
            // `at_least_ms`: every call of that kind took at least that long.
            for (kind, ms) in expect["at_least_ms"].as_object().into_iter().flatten() {
                let floor = Duration::from_millis(ms.as_u64().expect("milliseconds"));
                for (_, _, took) in seen.iter().filter(|(_, k, _)| k == kind) {
                    assert!(*took >= floor, "{what}: a {kind} call took {took:?}");
                }
            }
            let mut got: Vec<&str> = seen.iter().map(|(_, kind, _)| *kind).collect();
            let mut want: Vec<&str> = kinds
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap())
                .collect();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "{what}: outcomes of client {client}");
        } else {
            panic!("{what}: a step this runner does not know: {step}");
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scenarios_pass_in_every_setup() {
    let cases = scenarios();
    if cases.is_empty() {
        return;
    }
    let mut skipped = Vec::new();
    for setup in setups().into_iter().chain(standby_first_setups()) {
        for (file, case, only) in &cases {
            // A file that names its setups runs only there; the others everywhere but there.
            let kind = if setup.name.starts_with("standby_first") {
                "standby_first"
            } else {
                setup.name
            };
            let runs_here = match only {
                Some(only) => only.iter().any(|s| s == kind),
                None => kind != "standby_first",
            };
            if !runs_here {
                continue;
            }
            let what = format!("[{}] {file}: {}", setup.name, case["name"]);
            // The proxy stands in front of PG_ONCE_DSN's server: through PgBouncer, over TLS
            // or to a standby, its pause would hold what the case does not mean to hold.
            let proxied = case["proxy"] == true;
            if proxied && setup.name != "direct" {
                skipped.push(format!(
                    "{what} (a proxy case runs in the direct setup only)"
                ));
                continue;
            }
            let mut run = Run {
                setup: &setup,
                prefix: fresh("conformance"),
                clients: Vec::new(),
                outcomes: Vec::new(),
                counters: HashMap::new(),
                background: HashMap::new(),
                killed: HashMap::new(),
                stops: HashMap::new(),
                admin: setup.admin().await,
                proxies: Vec::new(),
            };
            for i in 0..case["clients"].as_u64().unwrap_or(1) {
                let seen: Seen = Arc::default();
                let hook = {
                    let seen = seen.clone();
                    OutcomeHook::new(move |e| {
                        seen.lock().unwrap().push((
                            e.key.to_owned(),
                            e.outcome.as_str(),
                            e.duration,
                        ))
                    })
                };
                let options = Options {
                    on_outcome: Some(hook),
                    ..Options::default()
                };
                // `listen: "pool"`: the LISTEN connection goes where the pool does (README).
                let tag = format!("rust-conformance-{i}");
                let client = if proxied {
                    // The pool through a proxy of its own; the LISTEN connection direct.
                    let proxy = HoldingProxy::start(Server::of(&setup.direct_dsn)).await;
                    let through = Setup {
                        pool_dsn: at_server(&setup.pool_dsn, "127.0.0.1", proxy.port),
                        ..setup.clone()
                    };
                    run.proxies.push(proxy);
                    through.client(&tag, options).await
                } else if case["listen"] == "pool" {
                    let pool = run.setup.pool_dsn.clone();
                    run.setup.client_listening_at(&tag, &pool, options).await
                } else {
                    run.setup.client(&tag, options).await
                };
                run.clients.push(client);
                run.outcomes.push(seen);
            }
            for step in case["steps"].as_array().expect("steps") {
                if let Err(Skip(why)) = run.step(&what, step).await {
                    skipped.push(format!("{what} ({why})"));
                    break;
                }
            }
        }
    }
    eprintln!("{} scenario runs; skipped: {skipped:#?}", cases.len());
}

/// The proxy cases' connection strings: every host, `hostaddr` and port of the string
/// replaced by the proxy's, in either form, and nothing else changed.
#[test]
fn a_connection_string_is_pointed_at_the_proxy_alone() {
    assert_eq!(
        at_server(
            "host=db1,db2 port=5432,5433 user=app password='a b\\'c' dbname=x",
            "127.0.0.1",
            40000
        ),
        "user='app' password='a b\\'c' dbname='x' host=127.0.0.1 port=40000"
    );
    assert_eq!(
        at_server(
            "hostaddr = 10.0.0.1 host=db sslmode=disable",
            "127.0.0.1",
            40000
        ),
        "sslmode='disable' host=127.0.0.1 port=40000"
    );
    assert_eq!(
        at_server(
            "postgresql://u:p@db1:5432,db2/app?host=db3&sslmode=prefer",
            "127.0.0.1",
            40000
        ),
        "postgresql://u:p@127.0.0.1:40000/app?sslmode=prefer"
    );
    assert_eq!(
        at_server("postgres://db1", "127.0.0.1", 40000),
        "postgres://127.0.0.1:40000"
    );
    for dsn in [
        at_server("host=db1 port=1 user=app", "127.0.0.1", 40000),
        at_server("postgresql://db1:1,db2:2/app", "127.0.0.1", 40000),
    ] {
        let parsed = pg_once_client::Conninfo::parse(&dsn).unwrap();
        assert_eq!(parsed.config().get_hosts().len(), 1, "{dsn}");
        assert_eq!(parsed.config().get_ports(), [40000], "{dsn}");
    }
}
