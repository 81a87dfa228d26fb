//! The pages, rendered on the server (maud). The part of each page that changes (its
//! "live" region) is rendered by `fragment`, for the page and for its event stream alike.

use crate::db::{Action, KeyFilter, PAGE, SCAN, STATES};
use crate::view::View;
use crate::App;
use maud::{html, Markup, DOCTYPE};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde_json::Value;

pub fn enc(s: &str) -> String {
    utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
}

/// A key as a form carries it (a checkbox's or hidden input's value), percent-encoded
/// whole: a browser reads a CR in the page as LF and submits every line break as CRLF, so
/// that a key with a line break, carried as it is, came back as another key (the action
/// decodes it: `web::action`).
pub fn form_key(key: &str) -> String {
    enc(key)
}

pub fn key_href(key: &str) -> String {
    format!("/keys/{}", enc(key))
}

fn query_string(f: &KeyFilter, after: Option<&str>) -> String {
    let mut parts = Vec::new();
    for (name, v) in [
        ("state", &f.state),
        ("prefix", &f.prefix),
        ("queue", &f.queue),
    ] {
        if let Some(v) = v {
            parts.push(format!("{name}={}", enc(v)));
        }
    }
    if let Some(a) = after {
        parts.push(format!("after={}", enc(a)));
    }
    parts.join("&")
}

/// The URL of the events of a view (with the snapshot the page shows).
pub fn events_url(view: &View, seq: u64) -> String {
    let (page, rest) = match view {
        View::Overview => ("overview", String::new()),
        View::Queues => ("queues", String::new()),
        View::Keys(f) => ("keys", query_string(f, f.after.as_deref())),
        View::Dead(f) => ("dead", query_string(f, f.after.as_deref())),
        View::Key(k) => ("key", format!("key={}", enc(k))),
    };
    let sep = if rest.is_empty() { "" } else { "&" };
    format!("/events?page={page}&seq={seq}{sep}{rest}")
}

/// A duration in seconds as people read it; negative ones are past.
fn secs(v: &Value) -> String {
    let Some(s) = v.as_f64() else {
        return String::new();
    };
    let a = s.abs();
    let t = if a < 10.0 {
        format!("{a:.1} s")
    } else if a < 120.0 {
        format!("{a:.0} s")
    } else if a < 7200.0 {
        format!("{:.0} min", a / 60.0)
    } else if a < 172_800.0 {
        format!("{:.1} h", a / 3600.0)
    } else {
        format!("{:.1} d", a / 86400.0)
    };
    if s < 0.0 {
        format!("{t} ago")
    } else {
        t
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub fn layout(app: &App, title: &str, active: &str, body: Markup) -> Markup {
    let role = app.hub.caps.lock().unwrap().role.clone();
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · pg_once" }
                link rel="stylesheet" href="/static/style.css";
                script src="/static/live.js" defer {}
            }
            body {
                header {
                    strong { "pg_once" }
                    nav {
                        @for (href, name) in [("/", "Overview"), ("/keys", "Keys"), ("/queues", "Queues"), ("/dead-letters", "Dead letters")] {
                            a href=(href) class=[(name == active).then_some("active")] { (name) }
                        }
                    }
                    span.who { "as role " code { (role) } @if app.read_only { " · read-only" } }
                    span #status data-state="off" { "" }
                }
                main { (body) }
            }
        }
    }
}

/// A page whose region `#live` follows the view's events.
pub fn live_page(
    app: &App,
    title: &str,
    active: &str,
    view: &View,
    seq: u64,
    before: Markup,
    inner: Markup,
) -> Markup {
    layout(
        app,
        title,
        active,
        html! {
            h1 { (title) }
            (before)
            div #live data-events=(events_url(view, seq)) { (inner) }
        },
    )
}

pub fn fragment(app: &App, view: &View, json: &Value) -> Markup {
    match view {
        View::Overview => overview(app, json),
        View::Queues => queues_table(&json["queues"]),
        View::Keys(f) => keys_table(app, f, json, false),
        View::Dead(f) => keys_table(app, f, json, true),
        View::Key(_) => key_detail(json),
    }
}

fn overview(app: &App, j: &Value) -> Markup {
    let s = &j["stats"];
    let l = &j["listener"];
    html! {
        p.note { "Counts from once.stats, read " (secs(&j["stats_age_s"])) " ago." }
        section.cards {
            @for state in STATES {
                a.card href={ "/keys?state=" (state) } data-count=(state) {
                    span.n { (text(&s[state])) } span.label { (state) }
                }
            }
        }
        section.grid {
            div {
                h2 { "Attention" }
                table.kv {
                    tr { th { "running past their lease" } td data-field="running_past_lease" { (text(&s["running_past_lease"])) } }
                    tr { th { "expired, not yet purged" } td { (text(&s["expired_unpurged"])) } }
                    tr { th { "oldest running claim" } td { (secs(&s["oldest_claim_age_s"])) } }
                    tr { th { "errors / attempts (summed over keys)" } td { (text(&s["errors"])) " / " (text(&s["attempts"])) } }
                }
                @if !app.read_only {
                    form method="post" action="/action" {
                        input type="hidden" name="csrf" value=(app.csrf());
                        input type="hidden" name="back" value="/";
                        button name="action" value="reap" { "Reap claims of gone owners…" }
                    }
                }
            }
            div {
                h2 { "Rates (per second, since this dashboard started watching)" }
                table.kv {
                    @for name in ["claims", "hits", "completions", "failures", "takeovers", "reaped"] {
                        tr { th { (name) } td data-rate=(name) {
                            @if j["rates"][name].is_null() { "…" } @else { (text(&j["rates"][name])) }
                        } }
                    }
                }
                @if s["claims"].is_null() {
                    p.note { "Counters need pg_once in shared_preload_libraries." }
                }
            }
            div {
                h2 { "Workers and relay" }
                table.kv {
                    tr { th { "pg_once preloaded (shared memory)" } td { (text(&s["shared_memory"])) } }
                    tr { th { "pg_once workers for this database" } td { (text(&s["workers"])) } }
                    tr { th { "announcements" } td { (text(&s["notify"])) } }
                    tr { th { "relayed / direct" } td { (text(&s["notified_relayed"])) " / " (text(&s["notified_direct"])) } }
                    tr { th { "this dashboard's LISTEN" } td {
                        @if l["connected"] == Value::Bool(true) { "connected" } @else { "disconnected" }
                        ", " (text(&l["notifications"])) " notifications"
                    } }
                }
            }
        }
        h2 { "Queues" }
        (queues_table(&j["queues"]))
    }
}

fn queues_table(q: &Value) -> Markup {
    let rows = q.as_array().cloned().unwrap_or_default();
    html! {
        table.list #queues {
            thead { tr { th { "queue" } th { "depth" } th { "due" } th { "running" } th { "dead" } th { "lag (oldest due)" } th { "done/min" } th { "not done/min" } th { "done/hour" } } }
            tbody {
                @for r in &rows {
                    tr data-queue=(text(&r["queue"])) {
                        td { a href={ "/keys?queue=" (enc(&text(&r["queue"]))) } { (text(&r["queue"])) } }
                        td { (text(&r["depth"])) } td { (text(&r["due"])) } td { (text(&r["running"])) }
                        td { a href={ "/dead-letters?queue=" (enc(&text(&r["queue"]))) } { (text(&r["dead"])) } }
                        td { (secs(&r["lag_s"])) }
                        td { (text(&r["completed_last_minute"])) } td { (text(&r["failed_last_minute"])) } td { (text(&r["completed_last_hour"])) }
                    }
                }
            }
        }
    }
}

fn keys_table(app: &App, f: &KeyFilter, j: &Value, dead: bool) -> Markup {
    let rows = j["rows"].as_array().cloned().unwrap_or_default();
    let base = if dead { "/dead-letters" } else { "/keys" };
    html! {
        @if let Some(n) = j["notice"].as_str() { p.notice { (n) } }
        table.list #keys {
            thead { tr {
                @if !app.read_only { th { input type="checkbox" #all title="select all on this page"; } }
                th { "key" } th { "state" } th { "queue" }
                @if dead { th { "payload" } th { "attempts" } th { "error" } th { "failed at" } }
                @else { th { "owner" } th { "lease left" } th { "claim age" } th { "error" } th { "retry in" } th { "attempts" } th { "updated" } }
            } }
            tbody {
                @for r in &rows {
                    @let key = text(&r["key"]);
                    tr data-key=(key) data-state=(text(&r["state"])) {
                        @if !app.read_only { td { input type="checkbox" name="key" value=(form_key(&key)); } }
                        td.key { a href=(key_href(&key)) { (key) } }
                        td { span class={ "state " (text(&r["state"])) } { (text(&r["state"])) }
                             @if r["owner_gone"] == Value::Bool(true) { " " span.warn title="its owner's backend has exited (or its lease-only claim ran out): reap or release it" { "owner gone" } } }
                        td { (text(&r["queue"])) }
                        @if dead {
                            td.small { (text(&r["payload"])) } td { (text(&r["attempts"])) } td.err { (text(&r["error"])) } td.small { (text(&r["failed_at"])) }
                        } @else {
                            td.small { (text(&r["owner"])) } td { (secs(&r["lease_left_s"])) } td { (secs(&r["claim_age_s"])) }
                            td.err { (text(&r["error"])) } td { (secs(&r["retry_in_s"])) } td { (text(&r["attempts"])) } td.small { (text(&r["updated_at"])) }
                        }
                    }
                }
            }
        }
        p.pager {
            (rows.len()) " shown (at most " (PAGE) " a page"
            @if j["source"] == "once.entries" && (f.prefix.is_some() || f.queue.is_some()) { ", from at most " (SCAN) " keys read" }
            ", read from " code { (text(&j["source"])) } ")"
            @if f.after.is_some() { " · " a href={ (base) "?" (query_string(f, None)) } { "first page" } }
            @if let Some(next) = j["next"].as_str() { " · " a #next href={ (base) "?" (query_string(f, Some(next))) } { "next page →" } }
        }
    }
}

/// The fields of one key, in the order a person looks for them (empty ones are left out).
const ROW_ORDER: &[&str] = &[
    "key",
    "state",
    "queue",
    "owner",
    "owner_role",
    "owner_pid",
    "owner_gone",
    "lease_only",
    "lease_left_s",
    "lease_expires_at",
    "claim_age_s",
    "claimed_at",
    "error",
    "retry_in_s",
    "retry_at",
    "failed_at",
    "attempts",
    "errors",
    "last_outcome",
    "result_bytes",
    "result",
    "expires_in_s",
    "expires_at",
    "stale_until",
    "completed_at",
    "rerun",
    "payload",
    "priority",
    "run_at",
    "enqueued_at",
    "created_at",
    "updated_at",
];

fn key_detail(j: &Value) -> Markup {
    let attempts = j["attempts"].as_array().cloned().unwrap_or_default();
    html! {
        @if let Some(n) = j["notice"].as_str() { p.notice { (n) } }
        @match j["row"].as_object() {
            None => p #absent { "No such key visible to this role (in " code { (text(&j["source"])) } ")." },
            Some(row) => table.kv #row {
                @for k in ROW_ORDER {
                    @if let Some(v) = row.get(*k).filter(|v| !v.is_null()) {
                        tr { th { (k) } td data-field=(k) {
                            @if k.ends_with("_s") { (secs(v)) } @else { (text(v)) }
                        } }
                    }
                }
            },
        }
        h2 { "Attempts (once.attempts, newest first)" }
        @if attempts.is_empty() { p { "None recorded (or not readable by this role)." } }
        @else {
            table.list #attempts {
                thead { tr { th { "queue" } th { "worker" } th { "started" } th { "finished" } th { "outcome" } th { "error" } } }
                tbody { @for a in &attempts { tr {
                    td { (text(&a["queue"])) } td { (text(&a["worker"])) } td.small { (text(&a["started_at"])) } td.small { (text(&a["finished_at"])) }
                    td { (text(&a["outcome"])) } td.err { (text(&a["error"])) }
                } } }
            }
        }
    }
}

/// The filter form of the keys and dead-letters pages.
pub fn filter_form(f: &KeyFilter, dead: bool) -> Markup {
    html! {
        form.filters method="get" {
            @if !dead {
                label { "state " select name="state" {
                    option value="" { "any" }
                    @for s in STATES { option value=(s) selected[f.state.as_deref() == Some(s)] { (s) } }
                } }
            }
            label { "key prefix " input name="prefix" value=[f.prefix.as_deref()]; }
            label { "queue " input name="queue" value=[f.queue.as_deref()]; }
            button { "Filter" }
        }
    }
}

/// The action buttons above a list or a key, in the form that holds the checkboxes.
pub fn action_buttons(app: &App, actions: &[Action], back: &str) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(app.csrf());
        input type="hidden" name="back" value=(back);
        div.actions {
            @for a in actions {
                button name="action" value=(a.name()) title=(a.describe()) { (a.name()) "…" }
            }
        }
    }
}

pub fn confirm_page(app: &App, action: Action, keys: &[String], back: &str) -> Markup {
    layout(
        app,
        "Confirm",
        "",
        html! {
            h1 { "Confirm: " (action.name()) }
            p { (action.describe()) "." }
            @if action != Action::Reap {
                p { (keys.len()) " key(s):" }
                ul.keys { @for k in keys.iter().take(100) { li { code { (k) } } } }
            }
            form method="post" action="/action" {
                input type="hidden" name="csrf" value=(app.csrf());
                input type="hidden" name="action" value=(action.name());
                input type="hidden" name="back" value=(back);
                input type="hidden" name="confirmed" value="yes";
                @for k in keys { input type="hidden" name="key" value=(form_key(k)); }
                button #confirm { "Yes, " (action.name()) }
                " " a href=(back) { "Cancel" }
            }
        },
    )
}

pub fn result_page(app: &App, action: Action, results: &[(String, String)], back: &str) -> Markup {
    layout(
        app,
        "Done",
        "",
        html! {
            h1 { (action.name()) ": done" }
            table.list #results {
                thead { tr { th { "key" } th { "answer" } } }
                tbody { @for (k, r) in results { tr { td { code { (k) } } td { (r) } } } }
            }
            p { a #back href=(back) { "Back" } }
        },
    )
}

pub fn error_page(app: &App, status: u16, message: &str) -> Markup {
    layout(
        app,
        "Error",
        "",
        html! { h1 { "Error " (status) } p.notice { (message) } },
    )
}

pub const STYLE: &str = include_str!("style.css");
pub const SCRIPT: &str = include_str!("live.js");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(secs(&Value::from(3.25)), "3.2 s");
        assert_eq!(secs(&Value::from(-45.0)), "45 s ago");
        assert_eq!(secs(&Value::from(3590.0)), "60 min");
        assert_eq!(secs(&Value::from(90000.0)), "25.0 h");
        assert_eq!(secs(&Value::Null), "");
    }

    #[test]
    fn keys_are_encoded_whole_in_links() {
        assert_eq!(key_href("a/b c?&'\"<"), "/keys/a%2Fb%20c%3F%26%27%22%3C");
        let f = KeyFilter {
            state: Some("running".into()),
            prefix: Some("x&y".into()),
            ..KeyFilter::default()
        };
        assert_eq!(
            events_url(&View::Keys(f), 7),
            "/events?page=keys&seq=7&state=running&prefix=x%26y"
        );
    }
}
