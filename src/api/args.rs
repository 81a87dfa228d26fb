//! Checks every SQL argument against the rules of docs/sql-reference.md ("Bad input raises
//! an error and changes nothing") and turns it into a value the protocol can use. Pure
//! validation: no statement runs here, and every check runs before any statement
//! touches once.entries. (What needs the database, such as whether a queue exists, is
//! asked of the protocol by the API layer.)

use crate::errors;
use crate::protocol::freshness::Policy;
use crate::protocol::namespace::{Existing, Payload};
use crate::runtime::guc;
use crate::storage::jsonb::Jsonb;
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::GucSetting;

const SECOND: i128 = 1_000_000;
const DAY: i128 = 86_400 * SECOND;
/// Interval lengths are compared the way PostgreSQL compares intervals: a month is 30 days.
const YEAR: i128 = 360 * DAY;

/// A cache key, checked by its rule (not empty, at most 7,500 bytes: a key is also the
/// NOTIFY payload, which must stay under 8,000 bytes).
pub fn key(key: Option<&str>) -> &str {
    named_key(key, "key")
}

/// A key that errors call `name` (an element of an array: `keys[3]`).
pub fn named_key<'a>(key: Option<&'a str>, name: &str) -> &'a str {
    text("key", name, key).expect("the rule refuses NULL")
}

/// A fencing token handed out by claim_key or claim_next (its rule: positive, never NULL).
pub fn token(token: Option<i64>) -> i64 {
    integer("token", token).expect("the rule refuses NULL")
}

/// How long a claim stays valid without a heartbeat (its rule: more than zero, at most
/// one day).
pub fn lease(lease: Option<Interval>) -> Interval {
    interval("lease", lease).expect("the rule refuses NULL")
}

/// The most bytes a fingerprint may have: 64, a SHA-512 digest, the largest digest a
/// caller is likely to use. A fingerprint is compared, never read back, so a digest of the
/// request is all it needs to be; the bound keeps once.entries' rows small (a claim's
/// update stays on its page) and refuses the mistake of passing the request body itself.
pub const MAX_FINGERPRINT_BYTES: usize = 64;

/// claim_key's fingerprint: NULL (none), or 1 to MAX_FINGERPRINT_BYTES bytes. Empty is
/// refused: it is what a digest of nothing is not, and most likely a caller's bug.
pub fn fingerprint(fingerprint: Option<&[u8]>) -> Option<&[u8]> {
    let hint = "Pass a digest of the request, e.g. sha256(convert_to(method || ' ' || path || ' ' || body, 'UTF8')) (32 bytes), or NULL to claim without one.";
    let fingerprint = fingerprint?;
    if fingerprint.is_empty() {
        errors::invalid_argument("fingerprint must not be empty".to_string(), hint);
    }
    if fingerprint.len() > MAX_FINGERPRINT_BYTES {
        errors::invalid_argument(
            format!(
                "fingerprint must be at most {MAX_FINGERPRINT_BYTES} bytes, got {}",
                fingerprint.len()
            ),
            hint,
        );
    }
    Some(fingerprint)
}

/// How long claim_key may block, in microseconds (its rule: zero, do not wait, up to one
/// day).
pub fn wait(wait: Option<Interval>) -> i128 {
    interval("wait", wait)
        .expect("the rule refuses NULL")
        .as_micros()
}

/// How long a result is served (its rule: NULL, forever, or more than zero, at most 100
/// years).
pub fn ttl(ttl: Option<Interval>) -> Option<Interval> {
    interval("ttl", ttl)
}

/// The rules of interval, integer and text arguments: src/api/argument_rules.json, which
/// the SQL edition's checks are written from too (scripts/sql_edition.py).
#[derive(serde::Deserialize)]
struct ArgumentRules {
    intervals: Vec<IntervalRule>,
    integers: Vec<IntegerRule>,
    texts: Vec<TextRule>,
}

#[derive(serde::Deserialize)]
struct TextRule {
    name: String,
    null: Null,
    /// Whether '' is refused (22023) or allowed, spelt as `null` is.
    empty: Null,
    /// The most bytes (22001 past it), or None for no bound.
    most_bytes: Option<usize>,
    hint: String,
    /// The hints of an empty and of a too long value, where they differ from `hint`.
    empty_hint: Option<String>,
    long_hint: Option<String>,
}

#[derive(serde::Deserialize)]
struct IntegerRule {
    name: String,
    null: Null,
    least: i64,
    /// None: no bound above, and `least` is 1 ("must be positive").
    most: Option<i64>,
    hint: String,
}

#[derive(serde::Deserialize)]
struct IntervalRule {
    name: String,
    null: Null,
    least: Least,
    /// The longest: a number of days or years, e.g. "1 day", "100 years".
    most: String,
    hint: String,
}

/// Whether NULL is refused (22004) or allowed (no value: the call's meaning of none).
#[derive(serde::Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Null {
    Refused,
    Allowed,
}

/// The least an interval may be: more than zero, or zero.
#[derive(serde::Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Least {
    Positive,
    Zero,
}

impl IntervalRule {
    /// `most` in microseconds, compared as PostgreSQL compares intervals (a year is 360
    /// days there).
    fn most_micros(&self) -> i128 {
        let (count, unit) = self.most.split_once(' ').expect("most is \"N unit\"");
        let count: i128 = count.parse().expect("most starts with a number");
        count
            * match unit.trim_end_matches('s') {
                "day" => DAY,
                "year" => YEAR,
                other => panic!("argument_rules.json: no unit {other:?}"),
            }
    }
}

fn rules() -> &'static ArgumentRules {
    static RULES: std::sync::OnceLock<ArgumentRules> = std::sync::OnceLock::new();
    RULES.get_or_init(|| {
        serde_json::from_str(include_str!("argument_rules.json"))
            .expect("argument_rules.json parses")
    })
}

fn interval_rule(name: &str) -> &'static IntervalRule {
    named(&rules().intervals, name, |rule| &rule.name)
}

fn integer_rule(name: &str) -> &'static IntegerRule {
    named(&rules().integers, name, |rule| &rule.name)
}

fn text_rule(name: &str) -> &'static TextRule {
    named(&rules().texts, name, |rule| &rule.name)
}

/// The rule of argument `name` among `rules` (a missing one is this crate's bug).
fn named<'a, R>(rules: &'a [R], name: &str, name_of: impl Fn(&R) -> &str) -> &'a R {
    rules
        .iter()
        .find(|rule| name_of(rule) == name)
        .unwrap_or_else(|| panic!("argument_rules.json has no rule for {name:?}"))
}

/// `value`, or None where the rule allows NULL; a NULL the rule refuses is 22004.
fn present<T>(name: &str, value: Option<T>, null: &Null, hint: &str) -> Option<T> {
    match value {
        None if *null == Null::Allowed => None,
        None => errors::null_argument(name, hint),
        value => value,
    }
}

/// The integer argument `name`, checked by its rule of argument_rules.json.
fn integer(name: &str, value: Option<i64>) -> Option<i64> {
    let rule = integer_rule(name);
    let value = present(name, value, &rule.null, &rule.hint)?;
    match rule.most {
        Some(most) if !(rule.least..=most).contains(&value) => errors::invalid_argument(
            format!(
                "{name} must be between {} and {most}, got {value}",
                rule.least
            ),
            &rule.hint,
        ),
        None if value < rule.least => {
            errors::invalid_argument(format!("{name} must be positive, got {value}"), &rule.hint)
        }
        _ => Some(value),
    }
}

/// The text argument of rule `rule`, called `shown` in errors (`keys[3]` for an element of
/// an array of keys), checked by its rule of argument_rules.json.
fn text<'a>(rule: &str, shown: &str, value: Option<&'a str>) -> Option<&'a str> {
    let rule = text_rule(rule);
    let value = present(shown, value, &rule.null, &rule.hint)?;
    if value.is_empty() && rule.empty == Null::Refused {
        errors::invalid_argument(
            format!("{shown} must not be empty"),
            rule.empty_hint.as_deref().unwrap_or(&rule.hint),
        );
    }
    if let Some(most) = rule.most_bytes.filter(|most| value.len() > *most) {
        errors::too_long(
            format!(
                "{shown} is {} bytes long; the limit is {most} bytes",
                value.len()
            ),
            rule.long_hint.as_deref().unwrap_or(&rule.hint),
        );
    }
    Some(value)
}

/// The interval argument `name`, checked by its rule of argument_rules.json.
fn interval(name: &str, value: Option<Interval>) -> Option<Interval> {
    let rule = interval_rule(name);
    let value = present(name, value, &rule.null, &rule.hint)?;
    if mixes_signs(&value) {
        errors::invalid_argument(
            format!("{name} must not mix months with days or time of the other sign, got {value}"),
            &rule.hint,
        );
    }
    let micros = value.as_micros();
    if rule.least == Least::Positive && micros <= 0 {
        let or_null = if rule.null == Null::Allowed {
            " or NULL"
        } else {
            ""
        };
        errors::invalid_argument(
            format!("{name} must be positive{or_null}, got {value}"),
            &rule.hint,
        );
    }
    if micros < 0 {
        errors::invalid_argument(
            format!("{name} must not be negative, got {value}"),
            &rule.hint,
        );
    }
    if micros > rule.most_micros() {
        errors::invalid_argument(
            format!("{name} must be at most {}, got {value}", rule.most),
            &rule.hint,
        );
    }
    Some(value)
}

/// Whether `value` has months and days or time of the other sign ('-1 mon 31 days'): its
/// length then depends on the date it is added to (from March 1 that one spans 3 days,
/// from February 1 none), while it is compared as 1 day (a month as 30 days), so no bound
/// would hold.
fn mixes_signs(value: &Interval) -> bool {
    let months = i64::from(value.months().signum());
    months != 0
        && (i64::from(value.days().signum()) == -months || value.micros().signum() == -months)
}

/// How a result stays servable (complete_key, complete_keys, cached): a ttl as `ttl`
/// checks it; `stale` more than zero, at most 100 years; `beta` more than zero, at most
/// 100 (0 or NULL: no early refreshes); `jitter` from 0 to less than 1. Each of the three
/// only means something for a result that expires, so each needs a ttl.
pub fn policy(
    ttl: Option<Interval>,
    stale: Option<Interval>,
    beta: Option<f64>,
    jitter: Option<f64>,
) -> Policy {
    let ttl = self::ttl(ttl);
    let stale = self::stale(stale);
    let beta = beta.filter(|b| *b != 0.0);
    if let Some(beta) = beta {
        if !(beta > 0.0 && beta <= 100.0) {
            errors::invalid_argument(
                format!("beta must be between 0 and 100, got {beta}"),
                "Use 1.0 for the early refreshes of the XFetch paper, more to refresh earlier, 0 or NULL for none.",
            );
        }
    }
    if let Some(jitter) = jitter {
        if !(0.0..1.0).contains(&jitter) {
            errors::invalid_argument(
                format!("jitter must be at least 0 and less than 1, got {jitter}"),
                "Use the fraction of the ttl by which expiries may be brought forward, e.g. 0.1 for up to 10%.",
            );
        }
    }
    if ttl.is_none() {
        let given = [
            (stale.is_some(), "stale"),
            (beta.is_some(), "beta"),
            (jitter.is_some_and(|j| j > 0.0), "jitter"),
        ];
        if let Some((_, name)) = given.iter().find(|(set, _)| *set) {
            errors::invalid_argument(
                format!("{name} needs a ttl: a result without one never expires"),
                "Pass a ttl as well, e.g. ttl => '1 hour', or leave the option out.",
            );
        }
    }
    Policy {
        ttl,
        jitter,
        stale,
        beta,
    }
}

/// How long a result may be served as stale (refresh_key; its rule: NULL, not at all, or
/// more than zero, at most 100 years).
pub fn stale(stale: Option<Interval>) -> Option<Interval> {
    interval("stale", stale)
}

/// A result no larger than once.max_result_size; `size` in bytes.
pub fn result_size(size: usize, what: &str) {
    within_limit(
        size,
        what,
        "once.max_result_size",
        &guc::MAX_RESULT_SIZE_KB,
        "Store a smaller result (a reference to where a large one is kept, e.g. an object's URL), or ask an administrator to raise once.max_result_size.",
    );
}

const PAYLOAD_SIZE_HINT: &str = "Pass a smaller payload (a reference to where large input is kept, e.g. an object's URL), or ask an administrator to raise once.max_payload_size.";

/// A payload no larger than once.max_payload_size.
pub fn payload_size(payload: Option<Jsonb>) {
    if let Some(payload) = payload {
        within_limit(
            payload.size(),
            "payload",
            "once.max_payload_size",
            &guc::MAX_PAYLOAD_SIZE_KB,
            PAYLOAD_SIZE_HINT,
        );
    }
}

/// The largest of enqueue_keys' payloads (`largest` bytes) no larger than
/// once.max_payload_size.
pub fn payloads_size(largest: usize) {
    within_limit(
        largest,
        "a payload",
        "once.max_payload_size",
        &guc::MAX_PAYLOAD_SIZE_KB,
        PAYLOAD_SIZE_HINT,
    );
}

/// An error no longer than once.max_error_size.
pub fn error_size(error: &str) {
    within_limit(
        error.len(),
        "error",
        "once.max_error_size",
        &guc::MAX_ERROR_SIZE_KB,
        "Record the error's first lines and keep the whole of it in your logs, or ask an administrator to raise once.max_error_size.",
    );
}

/// The one rule of the once.max_*_size settings: `size` bytes at most `setting` kB.
fn within_limit(size: usize, what: &str, name: &str, setting: &GucSetting<i32>, hint: &str) {
    let limit_kb = setting.get() as usize;
    if size > limit_kb * 1024 {
        errors::limit_exceeded(
            format!("{what} is {size} bytes, more than {name} ({limit_kb} kB)"),
            hint,
        );
    }
}

/// How long a failure is served to callers before the key may be retried (its rule: 0 up
/// to 1 year).
pub fn retry_after(retry_after: Option<Interval>) -> Interval {
    interval("retry_after", retry_after).expect("the rule refuses NULL")
}

/// A value that must be present (the result of complete_key, the error of fail_key).
pub fn required<T>(value: Option<T>, name: &str, hint: &str) -> T {
    value.unwrap_or_else(|| errors::null_argument(name, hint))
}

/// A queue's name (whether the queue exists is protocol::queue::require).
pub fn queue(queue: Option<&str>) -> &str {
    text("queue", "queue", queue).expect("the rule refuses NULL")
}

/// A name for a new queue: 1 to 63 letters, digits, `_ . : -`.
pub fn new_queue_name(name: Option<&str>) -> &str {
    let hint = "Use 1 to 63 letters, digits, '_', '.', ':' or '-', e.g. 'thumbnails'.";
    let Some(name) = name else {
        errors::null_argument("name", hint)
    };
    let valid = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
    if !valid {
        errors::invalid_argument(format!("invalid queue name \"{name}\""), hint);
    }
    name
}

/// How many times a queued key may be claimed (its rule: NULL, the queue's, or 1 to 1000).
pub fn max_attempts(max_attempts: Option<i32>) -> Option<i32> {
    integer("max_attempts", max_attempts.map(i64::from)).map(|n| n as i32)
}

/// How many keys one claim_next call may take (its rule: 1 to 1000).
pub fn batch_size(n: Option<i32>) -> i32 {
    integer("n", n.map(i64::from)).expect("the rule refuses NULL") as i32
}

/// How many keys one enqueue_keys call may enqueue: at most 1000, as claim_next's `n`, so
/// that one call's statement, its locks and its answer stay small.
pub const MAX_ENQUEUE_BATCH: usize = 1000;

/// A worker's name, as recorded with its claims and attempts (its rule: at most 256 bytes).
pub fn worker(worker: Option<&str>) -> Option<&str> {
    text("worker", "worker", worker)
}

/// A queue's first retry delay and its cap: more than zero, at most 1 year, cap >= delay.
pub fn backoff(backoff: Option<Interval>, max_backoff: Option<Interval>) -> (Interval, Interval) {
    let hint = "Use e.g. backoff => '1 second', max_backoff => '1 hour'.";
    let Some(backoff) = backoff else {
        errors::null_argument("backoff", hint)
    };
    let Some(max_backoff) = max_backoff else {
        errors::null_argument("max_backoff", hint)
    };
    for (name, value) in [("backoff", backoff), ("max_backoff", max_backoff)] {
        let micros = value.as_micros();
        if micros <= 0 || micros > YEAR {
            errors::invalid_argument(
                format!("{name} must be positive and at most 1 year, got {value}"),
                hint,
            );
        }
    }
    if max_backoff.as_micros() < backoff.as_micros() {
        errors::invalid_argument(
            format!("max_backoff ({max_backoff}) is shorter than backoff ({backoff})"),
            hint,
        );
    }
    (backoff, max_backoff)
}

/// When a queued key becomes due: NULL (now) or a finite time.
pub fn run_at(run_at: Option<TimestampWithTimeZone>) -> Option<TimestampWithTimeZone> {
    let t = run_at?;
    if t.is_infinity() || t.is_neg_infinity() {
        errors::invalid_argument(
            "run_at must be a finite time".into(),
            "Pass NULL to make the key due now, or a time such as now() + interval '10 minutes'.",
        );
    }
    Some(t)
}

/// A namespace's prefix (its rule: not empty, at most as long as a key, as keys start
/// with it).
pub fn namespace_prefix(prefix: Option<&str>) -> &str {
    text("prefix", "prefix", prefix).expect("the rule refuses NULL")
}

/// What create_namespace does with keys already under the prefix: 'refuse', 'purge' or
/// 'adopt' (protocol::namespace::Existing).
pub fn existing_keys(existing: Option<&str>) -> Existing {
    let hint = "Pass 'refuse' (the default: fail while any key under the prefix would change hands), 'purge' (delete them) or 'adopt' (give them to the namespace).";
    match existing {
        None => errors::null_argument("existing", hint),
        Some("refuse") => Existing::Refuse,
        Some("purge") => Existing::Purge,
        Some("adopt") => Existing::Adopt,
        Some(other) => errors::invalid_argument(
            format!("existing must be 'refuse', 'purge' or 'adopt', got '{other}'"),
            hint,
        ),
    }
}

/// What a namespace's keys are announced as on channel `once`: 'key' or 'digest'.
pub fn notify_payload(notify: Option<&str>) -> Payload {
    let hint = "Pass 'digest' (the key's hex SHA-256: listeners without rights learn nothing) or 'key' (the key itself).";
    match notify {
        None => errors::null_argument("notify", hint),
        Some("digest") => Payload::Digest,
        Some("key") => Payload::Key,
        Some(other) => errors::invalid_argument(
            format!("notify must be 'digest' or 'key', got '{other}'"),
            hint,
        ),
    }
}

#[cfg(test)]
mod tests {
    /// Every interval the extension checks has a rule that reads (a unit it knows, enums it
    /// knows), so that no call finds out at its first bad argument.
    #[test]
    fn every_interval_rule_reads() {
        for name in ["lease", "wait", "ttl", "stale", "retry_after"] {
            assert!(super::interval_rule(name).most_micros() > 0, "{name}");
        }
        assert_eq!(super::interval_rule("lease").most_micros(), super::DAY);
        assert_eq!(super::interval_rule("ttl").most_micros(), 100 * super::YEAR);
        for name in ["token", "max_attempts", "n"] {
            let rule = super::integer_rule(name);
            // Without a bound above the message says "positive": only right from 1.
            assert!(rule.most.is_some() || rule.least == 1, "{name}");
        }
        for name in ["key", "prefix", "queue", "worker"] {
            super::text_rule(name);
        }
        // A key is a NOTIFY payload (under 8,000 bytes), and the relay stores its length in
        // two bytes (runtime/shmem/relay.rs); a prefix is at most as long as a key.
        let key = super::text_rule("key")
            .most_bytes
            .expect("keys have a limit");
        assert!(key < 8000 && key <= u16::MAX as usize, "{key}");
        assert_eq!(super::text_rule("prefix").most_bytes, Some(key));
    }
}
