//! Live updates: ONE connection LISTENs on channel `once` for the whole process, and each
//! view (a page type with its filters) is re-queried at most once per interval however
//! many viewers watch it; the result, rendered once, goes to every viewer's
//! server-sent-events stream. Viewers never make the dashboard query the database
//! themselves.

use crate::db::{self, Caps};
use crate::view::View;
use crate::App;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_postgres::AsyncMessage;

/// The shortest time between two queries of one view.
pub const MIN_INTERVAL: Duration = Duration::from_millis(250);
/// A view's queries take at most 1/SLOWDOWN of the time (a view that takes 100 ms, as
/// once.stats does on a million keys, is asked at most every 400 ms).
const SLOWDOWN: u32 = 4;
/// once.stats reads kept counts (about a millisecond), but scanned every key before them
/// (a second at a million keys), and what it reads may grow again: the overview reads it
/// again only after STATS_SLOWDOWN times its last query time, so that watching the
/// overview costs at most a tenth of one backend, and its other parts (the queues)
/// follow notifications at MIN_INTERVAL meanwhile.
const STATS_SLOWDOWN: u32 = 10;
/// Claims and leases change without a notification: a watched view is asked again after
/// this long even when nothing was announced.
pub const FALLBACK: Duration = Duration::from_secs(5);

pub struct Snapshot {
    /// Increases with each query of the view: a page says which one it shows, and its
    /// event stream starts with any later one.
    pub seq: u64,
    pub json: Value,
    pub html: String,
    at: Instant,
    took: Duration,
}

struct ViewState {
    dirty: AtomicBool,
    cache: tokio::sync::Mutex<Option<Arc<Snapshot>>>,
    tx: watch::Sender<Option<Arc<Snapshot>>>,
    used: Mutex<Instant>,
    /// When its last query failed: the refresher waits FALLBACK before trying again.
    failed: Mutex<Option<Instant>>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct ListenStatus {
    pub connected: bool,
    pub notifications: u64,
    pub last_notification_age_s: Option<f64>,
    pub reconnections: u64,
    pub last_error: Option<String>,
    #[serde(skip)]
    last_at: Option<Instant>,
}

#[derive(Default)]
pub struct Hub {
    views: Mutex<HashMap<View, Arc<ViewState>>>,
    seq: AtomicU64,
    pub listen: Mutex<ListenStatus>,
    pub caps: Mutex<Caps>,
    /// Queries the dashboard ran (not counting actions), for the overview.
    pub queries: AtomicU64,
    samples: Mutex<VecDeque<(Instant, Value)>>,
    /// once.stats' last answer: when it was read, how long that took.
    stats: Mutex<Option<(Instant, Duration, Value)>>,
    /// A query of once.stats is under way.
    stats_running: AtomicBool,
}

impl Hub {
    fn state(&self, view: &View) -> Arc<ViewState> {
        let mut views = self.views.lock().unwrap();
        let st = views.entry(view.clone()).or_insert_with(|| {
            Arc::new(ViewState {
                dirty: AtomicBool::new(true),
                cache: tokio::sync::Mutex::new(None),
                tx: watch::channel(None).0,
                used: Mutex::new(Instant::now()),
                failed: Mutex::new(None),
            })
        });
        *st.used.lock().unwrap() = Instant::now();
        st.clone()
    }

    fn notify(&self, payload: &str) {
        {
            let mut l = self.listen.lock().unwrap();
            l.notifications += 1;
            l.last_at = Some(Instant::now());
        }
        self.mark(payload);
    }

    fn mark_view(&self, view: &View) {
        if let Some(st) = self.views.lock().unwrap().get(view) {
            st.dirty.store(true, Ordering::Release);
        }
    }

    /// Marks the views a notification with `payload` may change ('': all of them).
    fn mark(&self, payload: &str) {
        for (view, st) in self.views.lock().unwrap().iter() {
            if view.touched_by(payload) {
                st.dirty.store(true, Ordering::Release);
            }
        }
    }

    pub fn listen_status(&self) -> ListenStatus {
        let mut l = self.listen.lock().unwrap().clone();
        l.last_notification_age_s = l.last_at.map(|t| t.elapsed().as_secs_f64());
        l
    }

    /// Per-second rates of the counters named, over the overview's samples of the last
    /// half minute.
    fn rates(&self, now: Instant, stats: &Value) -> Value {
        let mut samples = self.samples.lock().unwrap();
        if samples.back().is_none_or(|(t, _)| *t < now) {
            samples.push_back((now, stats.clone()));
        }
        while samples.len() > 2
            && samples
                .front()
                .is_some_and(|(t, _)| now - *t > Duration::from_secs(30))
        {
            samples.pop_front();
        }
        let (t0, first) = samples.front().unwrap();
        let dt = (now - *t0).as_secs_f64();
        let mut rates = serde_json::Map::new();
        for name in [
            "claims",
            "hits",
            "completions",
            "failures",
            "takeovers",
            "reaped",
        ] {
            let rate = match (first[name].as_i64(), stats[name].as_i64()) {
                (Some(a), Some(b)) if dt >= 1.0 => {
                    Value::from(((b - a) as f64 / dt * 10.0).round() / 10.0)
                }
                _ => Value::Null,
            };
            rates.insert(name.to_owned(), rate);
        }
        Value::Object(rates)
    }
}

fn min_interval(took: Duration) -> Duration {
    MIN_INTERVAL.max(took * SLOWDOWN)
}

/// The view's latest snapshot: the cached one while nothing it shows was announced (and
/// for at most FALLBACK), or while its last query is more recent than its interval;
/// otherwise a new query, which every concurrent caller waits for and shares.
pub async fn get(app: &App, view: &View) -> Result<Arc<Snapshot>, String> {
    let st = app.hub.state(view);
    let mut cache = st.cache.lock().await;
    if let Some(s) = &*cache {
        let age = s.at.elapsed();
        let dirty = st.dirty.load(Ordering::Acquire);
        if (!dirty && age < FALLBACK) || age < min_interval(s.took) {
            return Ok(s.clone());
        }
    }
    st.dirty.store(false, Ordering::Release);
    let started = Instant::now();
    let (json, html) = match compute(app, view).await {
        Ok(v) => v,
        Err(e) => {
            *st.failed.lock().unwrap() = Some(Instant::now());
            return Err(e);
        }
    };
    *st.failed.lock().unwrap() = None;
    let snap = Arc::new(Snapshot {
        seq: app.hub.seq.fetch_add(1, Ordering::Relaxed) + 1,
        json,
        html: html.replace('\r', "&#13;"),
        at: Instant::now(),
        took: started.elapsed(),
    });
    *cache = Some(snap.clone());
    st.tx.send_replace(Some(snap.clone()));
    Ok(snap)
}

async fn compute(app: &App, view: &View) -> Result<(Value, String), String> {
    let caps = app.hub.caps.lock().unwrap().clone();
    let q = |n: u64| app.hub.queries.fetch_add(n, Ordering::Relaxed);
    let json = match view {
        View::Overview => {
            let ((read_at, stats), queues) = tokio::try_join!(stats(app), db::queues(&app.pool))?;
            q(1);
            let rates = app.hub.rates(read_at, &stats);
            serde_json::json!({
                "role": caps.role,
                "caps": caps,
                "stats": stats,
                "stats_age_s": read_at.elapsed().as_secs_f64(),
                "rates": rates,
                "queues": queues,
                "listener": app.hub.listen_status(),
                "dashboard_queries": app.hub.queries.load(Ordering::Relaxed),
            })
        }
        View::Queues => {
            q(1);
            serde_json::json!({ "queues": db::queues(&app.pool).await? })
        }
        View::Keys(f) => {
            q(1);
            serde_json::to_value(db::keys(&app.pool, &caps, f).await?).unwrap()
        }
        View::Dead(f) => {
            q(1);
            serde_json::to_value(db::dead_letters(&app.pool, f).await?).unwrap()
        }
        View::Key(k) => {
            q(2);
            serde_json::to_value(db::key(&app.pool, &caps, k).await?).unwrap()
        }
    };
    let html = crate::pages::fragment(app, view, &json).into_string();
    Ok((json, html))
}

/// once.stats for the overview: read when first asked for; then, once STATS_SLOWDOWN times
/// its last query time has passed (and MIN_INTERVAL at least), read again in the
/// background while the overview goes on with the last answer, and marked as changed
/// when the new one is in.
async fn stats(app: &App) -> Result<(Instant, Value), String> {
    let cached = app.hub.stats.lock().unwrap().clone();
    if let Some((at, took, v)) = cached {
        if at.elapsed() >= MIN_INTERVAL.max(took * STATS_SLOWDOWN)
            && !app.hub.stats_running.swap(true, Ordering::AcqRel)
        {
            let app = app.clone();
            tokio::spawn(async move {
                match read_stats(&app).await {
                    Ok(_) => app.hub.mark_view(&View::Overview),
                    Err(e) => eprintln!("pg-once-ui: once.stats: {e}"),
                }
                app.hub.stats_running.store(false, Ordering::Release);
            });
        }
        return Ok((at, v));
    }
    read_stats(app).await
}

async fn read_stats(app: &App) -> Result<(Instant, Value), String> {
    let started = Instant::now();
    let v = Value::Object(db::stats(&app.pool).await?);
    app.hub.queries.fetch_add(1, Ordering::Relaxed);
    let at = Instant::now();
    *app.hub.stats.lock().unwrap() = Some((at, at - started, v.clone()));
    Ok((at, v))
}

/// A stream of the view's snapshots for one viewer, starting with any later than `seen`.
pub fn subscribe(app: &App, view: &View, seen: u64) -> watch::Receiver<Option<Arc<Snapshot>>> {
    let st = app.hub.state(view);
    let mut rx = st.tx.subscribe();
    let newer = rx.borrow().as_ref().is_some_and(|s| s.seq > seen);
    if newer {
        rx.mark_changed();
    } else {
        rx.mark_unchanged();
    }
    rx
}

/// Re-queries, at most once per interval each, the views someone watches whose data a
/// notification touched (or that FALLBACK has passed for); forgets views nobody used
/// for a minute.
pub async fn refresher(app: App) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let due: Vec<View> = {
            let mut views = app.hub.views.lock().unwrap();
            views.retain(|_, st| {
                st.tx.receiver_count() > 0
                    || st.used.lock().unwrap().elapsed() < Duration::from_secs(60)
            });
            views
                .iter()
                .filter(|(_, st)| st.tx.receiver_count() > 0)
                .filter(|(_, st)| {
                    !st.failed
                        .lock()
                        .unwrap()
                        .is_some_and(|t| t.elapsed() < FALLBACK)
                })
                .filter(|(_, st)| {
                    let Ok(cache) = st.cache.try_lock() else {
                        return false; // being queried now
                    };
                    match &*cache {
                        None => true,
                        Some(s) => {
                            let age = s.at.elapsed();
                            (st.dirty.load(Ordering::Acquire) || age >= FALLBACK)
                                && age >= min_interval(s.took)
                        }
                    }
                })
                .map(|(v, _)| v.clone())
                .collect()
        };
        for view in due {
            let app = app.clone();
            tokio::spawn(async move {
                if let Err(e) = get(&app, &view).await {
                    eprintln!("pg-once-ui: refreshing {view:?}: {e}");
                }
            });
        }
    }
}

/// The one LISTEN connection: reconnects after a second when lost, and marks every view
/// as changed when it (re)connects (notifications may have been missed meanwhile).
pub async fn listener(app: App, conninfo: pg_once_client::Conninfo) {
    loop {
        let result = listen_once(&app, &conninfo).await;
        {
            let mut l = app.hub.listen.lock().unwrap();
            l.connected = false;
            l.reconnections += 1;
            if let Err(e) = &result {
                l.last_error = Some(e.clone());
            }
        }
        if let Err(e) = result {
            eprintln!("pg-once-ui: LISTEN connection: {e}; reconnecting in 1 s");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn listen_once(app: &App, conninfo: &pg_once_client::Conninfo) -> Result<(), String> {
    let mut config = conninfo.config().clone();
    config.application_name("pg-once-ui listener");
    let (client, mut connection) = config
        .connect(conninfo.connector().map_err(|e| e.to_string())?)
        .await
        .map_err(db::describe)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let driver = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(n)) if n.channel() == "once" => {
                    if tx.send(n.payload().to_owned()).is_err() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(db::describe(e)),
            }
        }
        Ok(())
    });
    client
        .batch_execute("LISTEN once")
        .await
        .map_err(db::describe)?;
    if let Ok(caps) = db::caps(&app.pool).await {
        *app.hub.caps.lock().unwrap() = caps;
    }
    {
        let mut l = app.hub.listen.lock().unwrap();
        l.connected = true;
        l.last_error = None;
    }
    app.hub.mark("");
    while let Some(payload) = rx.recv().await {
        app.hub.notify(&payload);
    }
    drop(client);
    driver.await.map_err(|e| e.to_string())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_views_are_asked_less_often() {
        assert_eq!(min_interval(Duration::from_millis(10)), MIN_INTERVAL);
        assert_eq!(min_interval(Duration::from_secs(1)), Duration::from_secs(4));
    }
}
