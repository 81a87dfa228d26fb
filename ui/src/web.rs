//! Routes: the pages, their JSON under /api/, their events, and the actions (POST only,
//! each with the CSRF token and a confirmation; all refused with --read-only).

use crate::db::{self, Action, KeyFilter};
use crate::live;
use crate::pages;
use crate::view::View;
use crate::App;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use maud::html;
use serde::Deserialize;
use std::convert::Infallible;

pub fn router(app: App) -> Router {
    Router::new()
        .route("/", get(overview))
        .route("/keys", get(keys))
        .route("/keys/{*key}", get(key))
        .route("/queues", get(queues))
        .route("/dead-letters", get(dead_letters))
        .route("/events", get(events))
        .route("/action", post(action))
        .route("/api/overview", get(api_overview))
        .route("/api/keys", get(api_keys))
        .route("/api/keys/{*key}", get(api_key))
        .route("/api/queues", get(api_queues))
        .route("/api/dead-letters", get(api_dead_letters))
        .route(
            "/static/style.css",
            get(|| async { ([(header::CONTENT_TYPE, "text/css")], pages::STYLE) }),
        )
        .route(
            "/static/live.js",
            get(|| async { ([(header::CONTENT_TYPE, "text/javascript")], pages::SCRIPT) }),
        )
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// Requests for this dashboard's names only (`host_allowed`), basic auth when asked for,
/// and headers that keep other sites from framing the pages or our pages from loading
/// anything from elsewhere.
async fn guard(State(app): State<App>, req: Request, next: Next) -> Response {
    // DNS rebinding: a page of another site, once its name resolves to our address, is
    // the same origin as we are for the browser, which then lets it read every page (the
    // CSRF token included) and post actions. Its requests name its own host.
    // (A request without Host, as HTTP/1.0 allows, is no browser's.)
    let foreign = req
        .headers()
        .get(header::HOST)
        .is_some_and(|v| v.to_str().map_or(true, |h| !app.host_allowed(h)));
    if foreign {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            "this dashboard does not answer to that host name (see --allowed-host)",
        )
            .into_response();
    }
    if let Some((user, pass)) = &app.basic_auth {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Basic "))
            .and_then(|b| {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD.decode(b).ok()
            })
            .unwrap_or_default();
        let expected = format!("{user}:{pass}");
        // Compared as HMACs, in constant time.
        let tag = ring::hmac::sign(&app.auth_key, expected.as_bytes());
        if ring::hmac::verify(&app.auth_key, &given, tag.as_ref()).is_err() {
            return (
                StatusCode::UNAUTHORIZED,
                [(
                    header::WWW_AUTHENTICATE,
                    "Basic realm=\"pg_once\", charset=\"UTF-8\"",
                )],
                "authentication required",
            )
                .into_response();
        }
    }
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    resp
}

fn error(app: &App, status: StatusCode, message: &str) -> Response {
    (
        status,
        Html(pages::error_page(app, status.as_u16(), message).into_string()),
    )
        .into_response()
}

fn api_error(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

async fn snapshot_page(
    app: &App,
    view: View,
    title: &str,
    active: &str,
    before: maud::Markup,
) -> Response {
    match live::get(app, &view).await {
        Ok(s) => Html(
            pages::live_page(
                app,
                title,
                active,
                &view,
                s.seq,
                before,
                maud::PreEscaped(s.html.clone()),
            )
            .into_string(),
        )
        .into_response(),
        Err(e) => error(app, StatusCode::BAD_GATEWAY, &e),
    }
}

async fn overview(State(app): State<App>) -> Response {
    snapshot_page(&app, View::Overview, "Overview", "Overview", html! {}).await
}

async fn queues(State(app): State<App>) -> Response {
    snapshot_page(&app, View::Queues, "Queues", "Queues", html! {}).await
}

/// Pages whose rows can be selected: the live region sits inside the form of the
/// actions, whose buttons stay put while the rows update.
async fn selectable(
    app: &App,
    view: View,
    title: &str,
    active: &str,
    filter: &KeyFilter,
    dead: bool,
    back: String,
) -> Response {
    let s = match live::get(app, &view).await {
        Ok(s) => s,
        Err(e) => return error(app, StatusCode::BAD_GATEWAY, &e),
    };
    let caps = app.hub.caps.lock().unwrap().clone();
    let actions: &[Action] = if dead {
        &[Action::Retry, Action::Invalidate]
    } else if caps.entries {
        &[Action::Invalidate, Action::Refresh, Action::Release]
    } else {
        &[Action::Retry, Action::Invalidate, Action::Refresh]
    };
    let body = html! {
        h1 { (title) }
        (pages::filter_form(filter, dead))
        @if app.read_only {
            div #live data-events=(pages::events_url(&view, s.seq)) { (maud::PreEscaped(s.html.clone())) }
        } @else {
            form #bulk method="post" action="/action" {
                (pages::action_buttons(app, actions, &back))
                div #live data-events=(pages::events_url(&view, s.seq)) { (maud::PreEscaped(s.html.clone())) }
            }
        }
    };
    Html(pages::layout(app, title, active, body).into_string()).into_response()
}

fn back_url(path: &str, f: &KeyFilter) -> String {
    let q = serde_urlencoded(f);
    if q.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{q}")
    }
}

fn serde_urlencoded(f: &KeyFilter) -> String {
    let mut s = form_urlencoded::Serializer::new(String::new());
    for (k, v) in [
        ("state", &f.state),
        ("prefix", &f.prefix),
        ("queue", &f.queue),
        ("after", &f.after),
    ] {
        if let Some(v) = v {
            s.append_pair(k, v);
        }
    }
    s.finish()
}

async fn keys(State(app): State<App>, Query(f): Query<KeyFilter>) -> Response {
    let back = back_url("/keys", &f);
    selectable(&app, View::Keys(f.clone()), "Keys", "Keys", &f, false, back).await
}

async fn dead_letters(State(app): State<App>, Query(mut f): Query<KeyFilter>) -> Response {
    f.state = None;
    let back = back_url("/dead-letters", &f);
    selectable(
        &app,
        View::Dead(f.clone()),
        "Dead letters",
        "Dead letters",
        &f,
        true,
        back,
    )
    .await
}

async fn key(State(app): State<App>, Path(key): Path<String>) -> Response {
    let view = View::Key(key.clone());
    let s = match live::get(&app, &view).await {
        Ok(s) => s,
        Err(e) => return error(&app, StatusCode::BAD_GATEWAY, &e),
    };
    let caps = app.hub.caps.lock().unwrap().clone();
    let mut actions = vec![Action::Invalidate, Action::Refresh];
    if caps.entries && s.json["row"]["state"] == "running" {
        actions.push(Action::Release);
    }
    if s.json["row"]["queue"].is_string() && s.json["row"]["state"] == "failed" {
        actions.push(Action::Retry);
    }
    let before = html! {
        p { code.key { (key) } }
        @if !app.read_only {
            form method="post" action="/action" {
                input type="hidden" name="key" value=(pages::form_key(&key));
                (pages::action_buttons(&app, &actions, &pages::key_href(&key)))
            }
        }
    };
    Html(
        pages::live_page(
            &app,
            "Key",
            "",
            &view,
            s.seq,
            before,
            maud::PreEscaped(s.html.clone()),
        )
        .into_string(),
    )
    .into_response()
}

async fn api_view(app: &App, view: View) -> Response {
    match live::get(app, &view).await {
        Ok(s) => Json(s.json.clone()).into_response(),
        Err(e) => api_error(StatusCode::BAD_GATEWAY, &e),
    }
}

async fn api_overview(State(app): State<App>) -> Response {
    api_view(&app, View::Overview).await
}
async fn api_queues(State(app): State<App>) -> Response {
    api_view(&app, View::Queues).await
}
async fn api_keys(State(app): State<App>, Query(f): Query<KeyFilter>) -> Response {
    api_view(&app, View::Keys(f)).await
}
async fn api_dead_letters(State(app): State<App>, Query(mut f): Query<KeyFilter>) -> Response {
    f.state = None;
    api_view(&app, View::Dead(f)).await
}
async fn api_key(State(app): State<App>, Path(key): Path<String>) -> Response {
    api_view(&app, View::Key(key)).await
}

#[derive(Deserialize)]
struct EventsQuery {
    page: String,
    #[serde(default)]
    seq: u64,
    key: Option<String>,
    #[serde(flatten)]
    filter: KeyFilter,
}

/// One viewer's events: the view's snapshots as the shared refresher makes them; no
/// query of its own.
async fn events(State(app): State<App>, Query(q): Query<EventsQuery>) -> Response {
    let mut filter = q.filter;
    if q.page == "dead" {
        filter.state = None;
    }
    if filter
        .state
        .as_deref()
        .is_some_and(|s| !db::STATES.contains(&s))
    {
        return api_error(
            StatusCode::BAD_REQUEST,
            "state must be queued, running, done or failed",
        );
    }
    let Some(view) = View::parse(&q.page, filter, q.key) else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "page must be overview, queues, keys, dead or key",
        );
    };
    let rx = live::subscribe(&app, &view, q.seq);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.changed().await.ok()?;
        let html = rx
            .borrow_and_update()
            .as_ref()
            .map(|s| s.html.clone())
            .unwrap_or_default();
        Some((
            Ok::<_, Infallible>(Event::default().event("update").data(html)),
            rx,
        ))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// POST /action: action=..., key=... (repeated, each percent-encoded: pages::form_key),
/// csrf=..., back=..., confirmed=yes. Without
/// `confirmed` it shows what would be done and asks; with it, it does it.
async fn action(State(app): State<App>, body: Bytes) -> Response {
    if app.read_only {
        return error(
            &app,
            StatusCode::FORBIDDEN,
            "This dashboard is read-only (--read-only): no action is allowed.",
        );
    }
    let (mut act, mut keys, mut csrf, mut back, mut confirmed) =
        (None, Vec::new(), String::new(), "/".to_owned(), false);
    for (k, v) in form_urlencoded::parse(&body) {
        match &*k {
            "action" => act = Action::parse(&v),
            // Percent-encoded by the forms (pages::form_key).
            "key" => match percent_encoding::percent_decode_str(&v).decode_utf8() {
                Ok(key) => keys.push(key.into_owned()),
                Err(_) => return error(&app, StatusCode::BAD_REQUEST, "A key is not UTF-8."),
            },
            "csrf" => csrf = v.into_owned(),
            "back" => back = v.into_owned(),
            "confirmed" => confirmed = v == "yes",
            _ => {}
        }
    }
    if !app.csrf_ok(&csrf) {
        return error(
            &app,
            StatusCode::FORBIDDEN,
            "Missing or invalid CSRF token: reload the page and try again.",
        );
    }
    if !is_local_path(&back) {
        back = "/".into();
    }
    let Some(act) = act else {
        return error(&app, StatusCode::BAD_REQUEST, "Unknown action.");
    };
    if act != Action::Reap && keys.is_empty() {
        return error(&app, StatusCode::BAD_REQUEST, "Select at least one key.");
    }
    keys.truncate(1000);
    if !confirmed {
        return Html(pages::confirm_page(&app, act, &keys, &back).into_string()).into_response();
    }
    match db::act(&app.pool, act, &keys).await {
        Ok(results) => {
            Html(pages::result_page(&app, act, &results, &back).into_string()).into_response()
        }
        Err(e) => error(&app, StatusCode::BAD_GATEWAY, &e),
    }
}

/// Whether `back` is a path of this dashboard, never a way elsewhere: browsers read `\`
/// as `/` and drop tabs and line breaks from a URL, so `/\t/evil.example` would become
/// `//evil.example`, another host.
fn is_local_path(back: &str) -> bool {
    back.starts_with('/')
        && !back.starts_with("//")
        && !back.contains('\\')
        && !back.chars().any(char::is_control)
}

#[cfg(test)]
mod tests {
    use super::is_local_path;

    #[test]
    fn only_paths_of_this_dashboard_are_gone_back_to() {
        assert!(is_local_path("/keys?state=failed"));
        for elsewhere in [
            "//evil.example",
            "/\\evil.example",
            "/\t/evil.example",
            "/\n/evil.example",
            "https://evil.example",
            "",
        ] {
            assert!(!is_local_path(elsewhere), "{elsewhere:?}");
        }
    }
}
