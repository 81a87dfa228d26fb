//! An adversarial sweep of pg_once's whole SQL surface (issue 23): every function,
//! procedure and view of schema once, enumerated from pg_proc and pg_class at run time, is
//! called by an attacker with ordinary grants against another tenant's namespace keys,
//! queue, once.cached entry and claims, through each way PostgreSQL runs one role's code:
//!
//! (a) a role with no grant at all, calling directly;
//! (b) a role with the README's grants, outside every namespace, calling directly;
//! (c) the same role's code in a SECURITY DEFINER function, called by the victim tenant
//!     and by a superuser;
//! (d) the same role's code in an index expression evaluated by a superuser's ANALYZE,
//!     and in a materialized view refreshed by a superuser;
//! (e) a cheap leaky function on every column of every view, directly and through a view
//!     of the attacker's own.
//!
//! Each attempt must be refused (42501 where pg_once judges a key, queue or namespace), or
//! succeed without showing anything the attacker did not already know (the victim's
//! results, payloads, errors, tokens, hidden keys, queue), and change nothing of the
//! victim's, the namespaces' or the shared queues' (compared row by row before and after
//! every call). A function added later is swept too, with arguments made from its types,
//! and the sweep fails until it is classified in `expected`. Every failure is collected
//! and the whole table printed, so that one hole does not hide the others.
//!
//! Other attacks the fix's own tests (attacks.rs) do not try are separate tests below.

use anyhow::Result;
use pg_once_multi::roles::{app_role, connect_as, refusal};
use pg_once_multi::{admin, fresh_key, once};
use std::fmt::Write as _;
use std::time::Duration;
use tokio_postgres::{Client, SimpleQueryMessage};

fn fresh_id(name: &str) -> String {
    fresh_key(name).replace(['/', '-'], "_")
}

/// What the victim's world is made of, and what the attacker must never learn.
struct World {
    id: String,
    admin: Client,
    /// A superuser (pg_once_multi::superuser: the administrator itself on the extension's
    /// test servers, PostgreSQL's superuser on the SQL edition's, whose administrator
    /// is the database's owner).
    superuser: Client,
    /// The victim tenant (owner of namespace `prefix`).
    victim: Client,
    victim_role: String,
    /// The attacker: README grants, a schema of its own, a namespace of its own.
    attacker: Client,
    attacker_role: String,
    attacker_oid: u32,
    /// A role with no grant at all.
    nobody: Client,
    prefix: String,
    /// The attacker's own namespace (for create_queue(namespace => ...)).
    attacker_prefix: String,
    queue: String,
    shared_queue: String,
    /// Keys and tokens the attacks aim at.
    ns_done: String,
    ns_running: String,
    ns_token: i64,
    cached_done: String,
    cached_running: String,
    cached_token: i64,
    cached_query: String,
    cached_user_key: String,
    shared_admin_running: String,
    shared_admin_token: i64,
    shared_victim_running: String,
    shared_victim_token: i64,
    /// Strings the attacker must never see (unless it passed them itself).
    secrets: Vec<String>,
}

const RESULT_MARK: &str = "RESULT-078-05-1120";
const PAYLOAD_MARK: &str = "PAYLOAD-4111111111111111";
const ERROR_MARK: &str = "ERROR-declined-for-alice";
const CACHED_MARK: &str = "CACHED-ROWS-salary-99999";

async fn one_i64(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<i64> {
    Ok(client.query_one(sql, params).await?.get(0))
}

/// The tests of this file, one at a time: the race tests hold create_namespace's lock on
/// once.entries, which would answer the other tests' claims `wait`.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn world(name: &str) -> Result<World> {
    let admin = admin().await?;
    let id = fresh_id(name);
    let victim_role = format!("victim_{id}");
    let attacker_role = format!("attacker_{id}");
    let nobody_role = format!("nobody_{id}");
    let victim = app_role(&admin, &victim_role).await?;
    let attacker = app_role(&admin, &attacker_role).await?;
    admin
        .batch_execute(&format!(
            "BEGIN;
             -- One at a time, as app_role does: concurrent GRANTs on the same routines fail.
             SELECT pg_advisory_xact_lock(20261201);
             CREATE ROLE {nobody_role} LOGIN;
             -- Each makes its own schema (the SQL edition's administrator, a database
             -- owner with CREATEROLE, is no member of their roles).
             GRANT CREATE ON DATABASE \"{database}\" TO {attacker_role}, {victim_role};
             -- The README's grants (\"Granting access\"): routines, the procedure included.
             GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO {attacker_role}, {victim_role};
             COMMIT;",
            database = admin
                .query_one("SELECT current_database()::text", &[])
                .await?
                .get::<_, String>(0)
        ))
        .await?;
    attacker
        .batch_execute(&format!("CREATE SCHEMA {attacker_role}"))
        .await?;
    victim
        .batch_execute(&format!("CREATE SCHEMA {victim_role}"))
        .await?;
    let nobody = connect_as(&nobody_role).await?;
    let prefix = format!("{id}/victim/");
    let attacker_prefix = format!("{id}/attacker/");
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&prefix, &victim_role],
        )
        .await?;
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&attacker_prefix, &attacker_role],
        )
        .await?;

    // The victim's namespace: a result, a running claim, a queue with a queued job and a
    // dead letter, whose keys the attacker never names.
    let ns_done = format!("{prefix}secret");
    let t: i64 = one_i64(&victim, "SELECT token FROM once.claim_key($1)", &[&ns_done]).await?;
    victim
        .execute(
            "SELECT once.complete_key($1, $2, jsonb_build_object('ssn', $3::text))",
            &[&ns_done, &t, &RESULT_MARK],
        )
        .await?;
    let ns_running = format!("{prefix}running");
    let ns_token = one_i64(
        &victim,
        "SELECT token FROM once.claim_key($1, lease => '1 hour')",
        &[&ns_running],
    )
    .await?;
    let queue = format!("vq_{id}");
    victim
        .execute(
            "SELECT once.create_queue($1, max_attempts => 1, namespace => $2)",
            &[&queue, &prefix],
        )
        .await?;
    let dead = format!("{prefix}hidden-dead");
    victim
        .execute(
            "SELECT once.enqueue_key($1, jsonb_build_object('card', $2::text), $3)",
            &[&dead, &PAYLOAD_MARK, &queue],
        )
        .await?;
    let dead_token = one_i64(&victim, "SELECT token FROM once.claim_next($1)", &[&queue]).await?;
    victim
        .execute(
            "SELECT once.fail_key($1, $2, $3)",
            &[&dead, &dead_token, &ERROR_MARK],
        )
        .await?;
    let job = format!("{prefix}hidden-job");
    victim
        .execute(
            "SELECT once.enqueue_key($1, jsonb_build_object('card', $2::text), $3)",
            &[&job, &PAYLOAD_MARK, &queue],
        )
        .await?;

    // The victim's once.cached rows, outside every namespace: only the key's binding to
    // the victim's role protects them.
    victim
        .batch_execute(&format!(
            "CREATE TABLE {victim_role}.salaries (who text);
             INSERT INTO {victim_role}.salaries VALUES ('{CACHED_MARK}');"
        ))
        .await?;
    let cached_user_key = format!("{id}/shared/report");
    let cached_query = format!("SELECT who FROM {victim_role}.salaries");
    victim
        .execute(
            "SELECT once.cached($1, $2)",
            &[&cached_user_key, &cached_query],
        )
        .await?;
    let cached_done: String = victim
        .query_one(
            "SELECT once.cached_key($1, $2)",
            &[&cached_user_key, &cached_query],
        )
        .await?
        .get(0);
    let running_query = format!("SELECT who, 2 FROM {victim_role}.salaries");
    let cached_running: String = victim
        .query_one(
            "SELECT once.cached_key($1, $2)",
            &[&cached_user_key, &running_query],
        )
        .await?
        .get(0);
    let cached_token = one_i64(
        &victim,
        "SELECT token FROM once.claim_key($1, lease => '1 hour')",
        &[&cached_running],
    )
    .await?;

    // Shared keys: claims of the administrator and of the victim, whose tokens an attacker
    // may guess (they come from one sequence) but must not use.
    let shared_admin_running = format!("{id}/shared/admin-running");
    let shared_admin_token = one_i64(
        &admin,
        "SELECT token FROM once.claim_key($1, lease => '1 hour', owner_pid => 0)",
        &[&shared_admin_running],
    )
    .await?;
    let shared_victim_running = format!("{id}/shared/victim-running");
    let shared_victim_token = one_i64(
        &victim,
        "SELECT token FROM once.claim_key($1, lease => '1 hour', owner_pid => 0)",
        &[&shared_victim_running],
    )
    .await?;
    // A shared queue with the administrator's policy.
    let shared_queue = format!("sq_{id}");
    admin
        .execute(
            "SELECT once.create_queue($1, max_attempts => 7)",
            &[&shared_queue],
        )
        .await?;

    let attacker_oid: u32 = attacker
        .query_one("SELECT oid FROM pg_roles WHERE rolname = current_user", &[])
        .await?
        .get(0);
    let secrets = vec![
        RESULT_MARK.into(),
        PAYLOAD_MARK.into(),
        ERROR_MARK.into(),
        CACHED_MARK.into(),
        dead.clone(),
        job.clone(),
        ns_done.clone(),
        ns_running.clone(),
        cached_done.clone(),
        cached_running.clone(),
        queue.clone(),
        ns_token.to_string(),
        dead_token.to_string(),
        cached_token.to_string(),
        shared_admin_token.to_string(),
        shared_victim_token.to_string(),
    ];
    let w = World {
        id,
        admin,
        superuser: pg_once_multi::superuser().await?,
        victim,
        victim_role,
        attacker,
        attacker_role,
        attacker_oid,
        nobody,
        prefix,
        attacker_prefix,
        queue,
        shared_queue,
        ns_done,
        ns_running,
        ns_token,
        cached_done,
        cached_running,
        cached_token,
        cached_query,
        cached_user_key,
        shared_admin_running,
        shared_admin_token,
        shared_victim_running,
        shared_victim_token,
        secrets,
    };
    w.plant_attacker_code().await?;
    Ok(w)
}

impl World {
    /// The attacker's tools, in its own schema: a probe that runs a call as whoever runs
    /// the probe's code and records what it got in the attacker's table (its way out), a
    /// SECURITY DEFINER wrapper, an index expression and a materialized view that run
    /// queued calls, and a cheap leaky function.
    async fn plant_attacker_code(&self) -> Result<()> {
        let s = &self.attacker_role;
        self.attacker
            .batch_execute(&format!(
                "CREATE TABLE {s}.loot (entry text, call text, sqlstate text, output text, judged name);
                 CREATE TABLE {s}.seen (v text);
                 CREATE TABLE {s}.todo (entry text, call text);
                 CREATE FUNCTION {s}.probe(entry text, call text) RETURNS text LANGUAGE plpgsql AS $f$
                 DECLARE out text; state text := '00000';
                 BEGIN
                   BEGIN
                     IF call LIKE 'CALL %' THEN EXECUTE call; out := '';
                     ELSE EXECUTE 'SELECT string_agg(t::text, E''\\n'') FROM (' || call || ') t' INTO out;
                     END IF;
                   EXCEPTION WHEN OTHERS THEN
                     GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, out = MESSAGE_TEXT;
                   END;
                   INSERT INTO {s}.loot VALUES (entry, call, state, coalesce(out, ''), current_user);
                   RETURN state;
                 END $f$;
                 CREATE FUNCTION {s}.probe_definer(entry text, call text) RETURNS text
                   SECURITY DEFINER SET search_path = {s}, pg_catalog LANGUAGE sql
                   AS $f$ SELECT {s}.probe(entry, call) $f$;
                 GRANT USAGE ON SCHEMA {s} TO {victim};
                 GRANT EXECUTE ON FUNCTION {s}.probe_definer(text, text) TO {victim};
                 CREATE FUNCTION {s}.run_todo(x int) RETURNS int LANGUAGE plpgsql VOLATILE AS $f$
                 DECLARE r record;
                 BEGIN
                   FOR r IN SELECT * FROM {s}.todo LOOP PERFORM {s}.probe(r.entry, r.call); END LOOP;
                   DELETE FROM {s}.todo;
                   RETURN x;
                 END $f$;
                 CREATE FUNCTION {s}.idx(x int) RETURNS int IMMUTABLE LANGUAGE plpgsql AS $f$
                 BEGIN PERFORM {s}.run_todo(x); RETURN x; END $f$;
                 CREATE TABLE {s}.bait (x int);
                 INSERT INTO {s}.bait VALUES (1);
                 CREATE INDEX ON {s}.bait ({s}.idx(x));
                 CREATE MATERIALIZED VIEW {s}.mv AS SELECT {s}.run_todo(1) AS x;
                 CREATE FUNCTION {s}.record(v text) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $f$
                 BEGIN INSERT INTO {s}.seen VALUES (v); RETURN true; END $f$;
                 CREATE FUNCTION {s}.leak(v text) RETURNS boolean LANGUAGE plpgsql STABLE COST 0.000001 AS $f$
                 BEGIN RETURN {s}.record(v); END $f$;",
                victim = self.victim_role
            ))
            .await?;
        Ok(())
    }

    /// Everything an attack must leave as it was: the victim's keys, every namespace key
    /// and shared key of this world (the attacker's own once.cached entries aside), the
    /// namespaces and the queues.
    async fn state(&self) -> Result<String> {
        let mark = format!("%#cached:{}:%", self.attacker_oid);
        let row = self
            .admin
            .query_one(
                "SELECT (SELECT coalesce(string_agg(to_jsonb(e)::text, E'\\n' ORDER BY key), '')
                           FROM once.entries e
                          WHERE key LIKE $1 || '/%' AND key NOT LIKE $2
                            AND key NOT LIKE $3 || '%')
                     || E'\\n' ||
                       (SELECT coalesce(string_agg(to_jsonb(q)::text, E'\\n' ORDER BY name), '')
                          FROM once.queues q)
                     || E'\\n' ||
                       (SELECT coalesce(string_agg(to_jsonb(n)::text, E'\\n' ORDER BY prefix), '')
                          FROM once_internal.namespace_owners n)",
                &[&self.id, &mark, &self.attacker_prefix],
            )
            .await?;
        Ok(row.get(0))
    }

    /// The secrets an output must not contain: all of them but what the call itself
    /// passed (an attacker knows its own arguments).
    fn leaked(&self, call: &str, output: &str) -> Vec<String> {
        self.secrets
            .iter()
            .filter(|s| !call.contains(s.as_str()) && output.contains(s.as_str()))
            .cloned()
            .collect()
    }
}

/// A routine of schema once, as pg_proc has it.
#[derive(Clone, Debug)]
struct Routine {
    name: String,
    procedure: bool,
    /// Input arguments: name, type, has a default.
    args: Vec<(String, String, bool)>,
}

async fn routines(admin: &Client, schema: &str) -> Result<Vec<Routine>> {
    let rows = admin
        .query(
            "SELECT p.proname::text, p.prokind = 'p', p.pronargs, p.pronargdefaults,
                    coalesce((SELECT array_agg(n ORDER BY o)
                                FROM unnest(coalesce(p.proargnames,
                                                     array_fill(''::text, ARRAY[coalesce(array_length(p.proallargtypes, 1), p.pronargs)])),
                                            coalesce(p.proargmodes,
                                                     array_fill('i'::\"char\", ARRAY[coalesce(array_length(p.proallargtypes, 1), p.pronargs)])))
                                     WITH ORDINALITY AS a(n, m, o)
                               WHERE m IN ('i', 'b', 'v')), '{}'),
                    coalesce((SELECT array_agg(format_type(t, NULL) ORDER BY o)
                                FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS u(t, o)), '{}')
               FROM pg_proc p WHERE p.pronamespace = $1::text::regnamespace
              ORDER BY 1, p.oid",
            &[&schema],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let nargs: i16 = row.get(2);
            let ndefaults: i16 = row.get(3);
            let names: Vec<String> = row.get(4);
            let types: Vec<String> = row.get(5);
            let args = types
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let name = names.get(i).cloned().unwrap_or_default();
                    (name, t, (i as i16) >= nargs - ndefaults)
                })
                .collect();
            Routine {
                name: row.get(0),
                procedure: row.get(1),
                args,
            }
        })
        .collect())
}

/// What the sweep aims a routine's calls at.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Target {
    /// The victim's namespace: its done key, running key and token, queue, prefix.
    Namespace,
    /// The victim's once.cached keys (forged by the attacker), outside every namespace.
    Cached,
    /// Shared claims of the administrator and the victim, with their (guessed) tokens.
    SharedTokens,
}

/// How an attempt must end.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Expect {
    /// 42501.
    Refused,
    /// May succeed, but shows no secret and changes nothing.
    Harmless,
    /// Succeeds with an answer that does nothing: false, NULL, no rows, 'wait' without token.
    Nothing,
}

/// What each routine of schema once must do when the attacker (with grants) aims it at
/// `target`. None: the routine is not classified yet (a new one): the sweep fails.
fn expected(routine: &Routine, target: Target) -> Option<Expect> {
    use Expect::*;
    use Target::*;
    let keyed = [
        "claim_key",
        "get",
        "complete_key",
        "fail_key",
        "heartbeat_key",
        "release_key",
        "invalidate_key",
        "refresh_key",
        "enqueue_key",
        "enqueue_keys",
        "complete_keys",
    ];
    let name = routine.name.as_str();
    Some(match (name, target) {
        ("key_hash" | "owner_session" | "reap_stale" | "cached_key", _) => Harmless,
        // The attacker may cache its own rows, never read the victim's: the query reads a
        // table of the victim's, so PostgreSQL refuses it.
        ("cached", _) => Refused,
        ("create_namespace" | "drop_namespace", _) => Refused,
        // invalidate_keys passes over keys the caller may not use.
        ("invalidate_keys", _) => Nothing,
        ("create_queue" | "drop_queue", _) => Refused,
        ("claim_next", Namespace) => Refused,
        ("claim_next", _) => Nothing,
        (k, Namespace | Cached) if keyed.contains(&k) => Refused,
        // Shared keys are shared: a claim is answered 'wait' (no token), a guessed token
        // changes nothing.
        ("claim_key", SharedTokens) => Nothing,
        // A running key has no result to give: NULL.
        ("get", SharedTokens) => Nothing,
        (
            "complete_key" | "fail_key" | "heartbeat_key" | "release_key" | "complete_keys",
            SharedTokens,
        ) => Nothing,
        // Allowed to every role on shared keys by design (not aimed at them).
        ("invalidate_key" | "refresh_key" | "enqueue_key" | "enqueue_keys", SharedTokens) => {
            Harmless
        }
        _ => return None,
    })
}

/// The SQL value of argument `name` of type `ty` for a call at `target`.
fn value(w: &World, routine: &Routine, name: &str, ty: &str, target: Target) -> Option<String> {
    let q = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let token_fn = routine
        .args
        .iter()
        .any(|(n, _, _)| n == "token" || n == "tokens");
    let (key, token, queue, prefix) = match target {
        Target::Namespace => (
            if token_fn { &w.ns_running } else { &w.ns_done },
            w.ns_token,
            &w.queue,
            w.prefix.clone(),
        ),
        Target::Cached => (
            if token_fn {
                &w.cached_running
            } else {
                &w.cached_done
            },
            w.cached_token,
            &w.shared_queue,
            format!("{}#cached:", w.cached_user_key),
        ),
        Target::SharedTokens => (
            &w.shared_admin_running,
            w.shared_admin_token,
            &w.shared_queue,
            w.prefix.clone(),
        ),
    };
    let key = if routine.name == "cached" || routine.name == "cached_key" {
        &w.cached_user_key
    } else {
        key
    };
    Some(match (routine.name.as_str(), name, ty) {
        ("create_namespace", "prefix", _) => q(&w.prefix),
        ("create_namespace", "owner", _) => q(&w.attacker_role),
        ("create_namespace", "existing", _) => q("adopt"),
        ("create_namespace", "notify", _) => q("key"),
        ("create_queue", "namespace", _) => q(&w.attacker_prefix),
        ("create_queue", "max_attempts", _) => "1".into(),
        ("invalidate_keys", "queue", _) => return None,
        (_, "owner_pid" | "worker" | "beta" | "jitter" | "run_at", _) => return None,
        ("cached", "result", _) => "NULL".into(),
        (_, "query", _) => q(&w.cached_query),
        (_, "key", _) => q(key),
        (_, "keys", _) if target == Target::SharedTokens => {
            format!("ARRAY[{}, {}]", q(key), q(&w.shared_victim_running))
        }
        (_, "keys", _) => format!("ARRAY[{}]", q(key)),
        (_, "token", _) => token.to_string(),
        (_, "tokens", _) => match target {
            Target::SharedTokens => {
                format!("ARRAY[{}, {}]::bigint[]", token, w.shared_victim_token)
            }
            _ => format!("ARRAY[{token}]::bigint[]"),
        },
        ("complete_keys", "results", _) if target == Target::SharedTokens => {
            "ARRAY['\"forged\"', '\"forged\"']::jsonb[]".into()
        }
        (_, "results", _) => "ARRAY['\"forged\"']::jsonb[]".into(),
        (_, "queue", _) | (_, "name", _) => q(queue),
        (_, "prefix", _) => q(&prefix),
        (_, "wait", _) => "'0'".into(),
        (_, "lease", _) => "'1 day'".into(),
        (_, "retry_after", _) => "'1 year'".into(),
        (_, "error", _) => q("forged"),
        (_, "payload", _) => "'{\"forged\": true}'".into(),
        (_, "refresh", _) => "true".into(),
        (_, _, "text") => q(key),
        (_, _, "bigint") => token.to_string(),
        (_, _, "integer") => "1".into(),
        (_, _, "interval") => "'1 second'".into(),
        (_, _, "jsonb") => "'\"forged\"'".into(),
        (_, _, "boolean") => "true".into(),
        (_, _, "text[]") => format!("ARRAY[{}]", q(key)),
        (_, _, "bigint[]") => format!("ARRAY[{token}]::bigint[]"),
        (_, _, "jsonb[]") => "ARRAY['\"forged\"']::jsonb[]".into(),
        (_, _, "regrole") => q(&w.attacker_role),
        (_, _, _) => return None,
    })
}

/// The statement that calls `routine` at `target`: every argument without a default, and
/// those with one that the sweep has a value for, by name.
fn call(w: &World, routine: &Routine, target: Target) -> String {
    let mut args = Vec::new();
    for (name, ty, has_default) in &routine.args {
        match value(w, routine, name, ty, target) {
            Some(v) if !name.is_empty() => args.push(format!("{name} => {v}")),
            Some(v) => args.push(v),
            None if *has_default => {}
            None => args.push(format!("NULL::{ty}")),
        }
    }
    let list = args.join(", ");
    if routine.procedure {
        format!("CALL once.{}({list})", routine.name)
    } else {
        format!("SELECT r::text FROM once.{}({list}) AS r", routine.name)
    }
}

/// How an attempt ended: SQLSTATE ("00000" on success) and output (rows, or the error's
/// message, detail and hint).
async fn attempt(client: &Client, sql: &str) -> (String, String) {
    match client.simple_query(sql).await {
        Ok(messages) => {
            let mut out = String::new();
            for m in messages {
                if let SimpleQueryMessage::Row(row) = m {
                    for i in 0..row.len() {
                        let _ = write!(out, "{}|", row.get(i).unwrap_or("NULL"));
                    }
                    out.push('\n');
                }
            }
            ("00000".into(), out)
        }
        Err(e) => match e.as_db_error() {
            Some(db) => (
                db.code().code().to_owned(),
                format!(
                    "{} {} {}",
                    db.message(),
                    db.detail().unwrap_or(""),
                    db.hint().unwrap_or("")
                ),
            ),
            None => ("XX000".into(), e.to_string()),
        },
    }
}

/// Whether an answer that succeeded did nothing: no rows, or only false / NULL / empty
/// values, or a claim answered 'wait' (whose token column is NULL).
fn did_nothing(output: &str) -> bool {
    output.lines().all(|line| {
        let line = line.trim_end_matches('|');
        // The probe's answers are rows of records: ("(wait,,...)"), (false).
        let line: String = line
            .chars()
            .filter(|c| !matches!(c, '(' | ')' | '"'))
            .collect();
        matches!(line.as_str(), "" | "f" | "false" | "NULL" | "0") || line.starts_with("wait,,")
    })
}

/// The ways the attacker's code is run, by whom.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Entry {
    /// (b) the attacker calls.
    Direct,
    /// (c) the victim calls the attacker's SECURITY DEFINER function.
    DefinerByVictim,
    /// (c) a superuser calls it.
    DefinerBySuperuser,
    /// (d) a superuser's ANALYZE evaluates the attacker's index expression.
    AnalyzeBySuperuser,
    /// (d) a superuser refreshes the attacker's materialized view.
    RefreshBySuperuser,
}

/// Run `sql` as the attacker's code through `entry`: its SQLSTATE and output.
async fn through(w: &World, entry: Entry, sql: &str) -> Result<(String, String)> {
    let s = &w.attacker_role;
    let label = format!("{entry:?}");
    match entry {
        Entry::Direct => return Ok(attempt(&w.attacker, sql).await),
        Entry::DefinerByVictim | Entry::DefinerBySuperuser => {
            let caller = if entry == Entry::DefinerByVictim {
                &w.victim
            } else {
                &w.superuser
            };
            let (code, out) = attempt(
                caller,
                &format!("SELECT {s}.probe_definer({}, {})", lit(&label), lit(sql)),
            )
            .await;
            if code != "00000" {
                return Ok((code, format!("(the probe itself failed) {out}")));
            }
        }
        Entry::AnalyzeBySuperuser | Entry::RefreshBySuperuser => {
            w.attacker
                .execute(
                    &format!("INSERT INTO {s}.todo VALUES ($1, $2)"),
                    &[&label, &sql],
                )
                .await?;
            let maintenance = if entry == Entry::AnalyzeBySuperuser {
                format!("ANALYZE {s}.bait")
            } else {
                format!("REFRESH MATERIALIZED VIEW {s}.mv")
            };
            let (code, out) = attempt(&w.superuser, &maintenance).await;
            if code != "00000" {
                return Ok((code, format!("(the maintenance itself failed) {out}")));
            }
        }
    }
    // What the attacker's code recorded, read by the attacker.
    let rows = w
        .attacker
        .query(
            &format!(
                "DELETE FROM {s}.loot WHERE entry = $1 RETURNING sqlstate, output, judged::text"
            ),
            &[&label],
        )
        .await?;
    match rows.as_slice() {
        [row] => {
            let judged: String = row.get(2);
            anyhow::ensure!(
                judged == *s,
                "{entry:?} ran the attacker's code as {judged}"
            );
            Ok((row.get(0), row.get(1)))
        }
        _ => Ok((
            "NONE".into(),
            format!("{} loot rows: the code did not run once", rows.len()),
        )),
    }
}

/// The lines of two states that differ.
fn difference(before: &str, after: &str) -> String {
    let b: Vec<&str> = before.lines().collect();
    let a: Vec<&str> = after.lines().collect();
    let mut out = String::new();
    for l in b.iter().filter(|l| !a.contains(l)) {
        let _ = writeln!(
            out,
            "        gone:  {}",
            l.chars().take(160).collect::<String>()
        );
    }
    for l in a.iter().filter(|l| !b.contains(l)) {
        let _ = writeln!(
            out,
            "        new:   {}",
            l.chars().take(160).collect::<String>()
        );
    }
    out
}

fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// One line of the sweep's table, and whether it held.
struct Line {
    who: String,
    what: String,
    got: String,
    failure: Option<String>,
}

fn report(lines: &[Line]) -> String {
    let mut out = String::new();
    for l in lines {
        let _ = writeln!(
            out,
            "{} {:<22} {:<60} {}{}",
            if l.failure.is_some() { "FAIL" } else { "ok  " },
            l.who,
            l.what.chars().take(60).collect::<String>(),
            l.got
                .chars()
                .take(80)
                .collect::<String>()
                .replace('\n', " "),
            l.failure
                .as_ref()
                .map(|f| format!("\n     -> {f}"))
                .unwrap_or_default(),
        );
    }
    out
}

/// Judge one attempt against what it must do, and against the state before it.
fn judge(
    w: &World,
    routine: Option<&Routine>,
    target: Option<Target>,
    sql: &str,
    code: &str,
    out: &str,
    changed: bool,
) -> Option<String> {
    let leaked = w.leaked(sql, out);
    if !leaked.is_empty() {
        return Some(format!("leaked {leaked:?}: {out}"));
    }
    if changed {
        return Some(format!(
            "changed the victim's state (answered {code} {out})"
        ));
    }
    let (Some(routine), Some(target)) = (routine, target) else {
        return None;
    };
    let Some(expect) = expected(routine, target) else {
        return Some(format!(
            "once.{} is not classified: add it to `expected` in sweep.rs with what an attacker's call must get",
            routine.name
        ));
    };
    match expect {
        // A procedure called from a function cannot commit: PostgreSQL stops it first.
        Expect::Refused if routine.procedure && code == "2D000" => None,
        Expect::Refused if code != "42501" => Some(format!("expected 42501, got {code} {out}")),
        Expect::Nothing if code == "00000" && !did_nothing(out) => {
            Some(format!("expected an answer that does nothing, got {out}"))
        }
        Expect::Nothing if code != "00000" && code != "42501" => Some(format!(
            "expected an answer that does nothing, got {code} {out}"
        )),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_function_and_view_refuses_an_attacker_through_every_entry_point() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut lines = Vec::new();
    for entry in [
        Entry::Direct,
        Entry::DefinerByVictim,
        Entry::DefinerBySuperuser,
        Entry::AnalyzeBySuperuser,
        Entry::RefreshBySuperuser,
    ] {
        // A world per entry point: a hole found by one does not spoil the next.
        let w = world("sweep").await?;
        let all = routines(&w.admin, "once").await?;
        anyhow::ensure!(
            all.len() >= 20,
            "only {} routines in schema once",
            all.len()
        );

        if entry == Entry::Direct {
            sweep_ungranted(&w, &all, &mut lines).await?;
            sweep_views(&w, &mut lines).await?;
            sweep_internal(&w, &mut lines).await?;
        }
        // The most destructive calls last, so that a hole in them does not hide others.
        let mut ordered = all.clone();
        ordered.sort_by_key(|r| matches!(r.name.as_str(), "invalidate_keys" | "invalidate_key"));
        for target in [Target::Namespace, Target::Cached, Target::SharedTokens] {
            for routine in &ordered {
                if target == Target::SharedTokens
                    && matches!(
                        routine.name.as_str(),
                        "invalidate_key"
                            | "refresh_key"
                            | "enqueue_key"
                            | "enqueue_keys"
                            | "invalidate_keys"
                    )
                {
                    continue;
                }
                let sql = call(&w, routine, target);
                let before = w.state().await?;
                let (code, out) = through(&w, entry, &sql).await?;
                let after = w.state().await?;
                let failure = judge(
                    &w,
                    Some(routine),
                    Some(target),
                    &sql,
                    &code,
                    &out,
                    before != after,
                )
                .map(|f| {
                    if before != after {
                        format!("{f}\n{}", difference(&before, &after))
                    } else {
                        f
                    }
                });
                lines.push(Line {
                    who: format!("{entry:?}/{target:?}"),
                    what: sql.clone(),
                    got: format!("{code} {out}"),
                    failure,
                });
            }
        }
        // The queue-only form of invalidate_keys, aimed at the victim's queue.
        let sql = format!("SELECT once.invalidate_keys(queue => {})", lit(&w.queue));
        let before = w.state().await?;
        let (code, out) = through(&w, entry, &sql).await?;
        let changed = before != w.state().await?;
        lines.push(Line {
            who: format!("{entry:?}/Namespace"),
            failure: judge(&w, None, None, &sql, &code, &out, changed)
                .or_else(|| (code != "42501").then(|| format!("expected 42501, got {code} {out}"))),
            what: sql,
            got: format!("{code} {out}"),
        });
    }
    let failed = lines.iter().filter(|l| l.failure.is_some()).count();
    println!("{}", report(&lines));
    anyhow::ensure!(
        failed == 0,
        "{failed} of {} attempts got through:\n{}",
        lines.len(),
        report(
            &lines
                .into_iter()
                .filter(|l| l.failure.is_some())
                .collect::<Vec<_>>()
        )
    );
    Ok(())
}

/// (a) A role with no grant: every routine and view of once refused, but key_hash
/// (PUBLIC's: a digest of what it is given).
async fn sweep_ungranted(w: &World, all: &[Routine], lines: &mut Vec<Line>) -> Result<()> {
    let mut objects: Vec<(String, bool)> = all
        .iter()
        .map(|r| (call(w, r, Target::Namespace), r.name == "key_hash"))
        .collect();
    for view in relations(w, "once").await? {
        objects.push((format!("SELECT v::text FROM {view} v"), false));
    }
    for (sql, harmless) in objects {
        let before = w.state().await?;
        let (code, out) = attempt(&w.nobody, &sql).await;
        let changed = before != w.state().await?;
        let failure = judge(w, None, None, &sql, &code, &out, changed).or_else(|| {
            (!harmless && code != "42501").then(|| format!("expected 42501, got {code} {out}"))
        });
        lines.push(Line {
            who: "Ungranted".into(),
            what: sql,
            got: format!("{code} {out}"),
            failure,
        });
    }
    Ok(())
}

/// Every relation (table, view, sequence, materialized view) of `schema`, qualified.
async fn relations(w: &World, schema: &str) -> Result<Vec<String>> {
    let rows = w
        .admin
        .query(
            "SELECT c.oid::regclass::text, c.relkind::text FROM pg_class c
              WHERE c.relnamespace = $1::text::regnamespace AND c.relkind IN ('r', 'v', 'm', 'S', 'p', 'f')
              ORDER BY 1",
            &[&schema],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let name: String = r.get(0);
            // A sequence has no row type (t::text fails with 42809 before any privilege
            // check): read its value instead.
            if r.get::<_, String>(1) == "S" {
                format!("(SELECT last_value FROM {name})")
            } else {
                name
            }
        })
        .collect())
}

async fn views(w: &World) -> Result<Vec<(String, Vec<String>)>> {
    let rows = w
        .admin
        .query(
            "SELECT c.oid::regclass::text, array_agg(a.attname::text ORDER BY a.attnum)
               FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
              WHERE c.relnamespace = 'once'::regnamespace AND c.relkind IN ('v', 'm')
              GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// (b, e) Every view as the granted attacker: plainly, through a leaky cheap function on
/// each column, and through a view of the attacker's own with the same function. Tables
/// of once: refused.
async fn sweep_views(w: &World, lines: &mut Vec<Line>) -> Result<()> {
    let s = &w.attacker_role;
    for (view, columns) in views(w).await? {
        let plain = format!("SELECT v::text FROM {view} v");
        let (code, out) = attempt(&w.attacker, &plain).await;
        lines.push(Line {
            who: "Direct/view".into(),
            failure: w
                .leaked(&plain, &out)
                .first()
                .map(|l| format!("shows {l}: {out}"))
                .or_else(|| {
                    (code != "00000")
                        .then(|| format!("a granted role could not read it: {code} {out}"))
                }),
            what: plain,
            got: format!("{code} {out}"),
        });
        let wrapper = format!("{s}.wrap_{}", view.replace("once.", ""));
        w.attacker
            .batch_execute(&format!("CREATE VIEW {wrapper} AS SELECT * FROM {view}"))
            .await?;
        for column in &columns {
            for from in [&view, &wrapper] {
                w.attacker
                    .batch_execute(&format!("TRUNCATE {s}.seen"))
                    .await?;
                let sql = format!("SELECT count(*) FROM {from} WHERE {s}.leak({column}::text)");
                let (code, out) = attempt(&w.attacker, &sql).await;
                let seen: Vec<String> = w
                    .attacker
                    .query(&format!("SELECT v FROM {s}.seen WHERE v IS NOT NULL"), &[])
                    .await?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                let seen = seen.join("\n");
                let leaked = w.leaked("", &seen);
                lines.push(Line {
                    who: "Leaky/view".into(),
                    failure: (!leaked.is_empty())
                        .then(|| format!("the leaky function was shown {leaked:?}"))
                        .or_else(|| (code != "00000").then(|| format!("{code} {out}"))),
                    what: sql,
                    got: format!("{code} saw {} values", seen.lines().count()),
                });
            }
        }
    }
    for table in relations(w, "once").await? {
        if views(w).await?.iter().any(|(v, _)| *v == table) {
            continue;
        }
        for sql in [
            format!("SELECT t::text FROM {table} t"),
            format!("DELETE FROM {table}"),
        ] {
            let (code, out) = attempt(&w.attacker, &sql).await;
            lines.push(Line {
                who: "Direct/table".into(),
                failure: (code != "42501").then(|| format!("expected 42501, got {code} {out}")),
                what: sql,
                got: format!("{code} {out}"),
            });
        }
    }
    Ok(())
}

/// once_internal: no role has USAGE on it; every function and relation refused.
async fn sweep_internal(w: &World, lines: &mut Vec<Line>) -> Result<()> {
    let mut sqls: Vec<String> = routines(&w.admin, "once_internal")
        .await?
        .iter()
        .filter(|r| {
            !r.args
                .iter()
                .any(|(_, t, _)| t == "internal" || t == "trigger")
        })
        .map(|r| {
            let args: Vec<String> = r
                .args
                .iter()
                .map(|(_, t, _)| format!("NULL::{t}"))
                .collect();
            format!("SELECT once_internal.{}({})", r.name, args.join(", "))
        })
        .collect();
    for table in relations(w, "once_internal").await? {
        sqls.push(format!("SELECT t::text FROM {table} t"));
    }
    // The SQL edition grants every role USAGE on once_internal (once.*'s wrappers call
    // their implementations there as the caller, and each implementation refuses any
    // other caller with 42501), and the views' helpers to PUBLIC, as the extension does
    // (where no role has USAGE on the schema). Those answer only what anyone may know
    // (whether a role may use a key, administers, how pg_once runs): called directly,
    // they may answer, without a secret, like every other call here.
    let public_helpers = [
        "view_may_use_key",
        "may_use_key_as",
        "caller_administers",
        "administers_as",
        "runtime",
        "pending_key_counts",
    ];
    for sql in sqls {
        let helper = pg_once_multi::edition()
            && public_helpers
                .iter()
                .any(|h| sql.starts_with(&format!("SELECT once_internal.{h}(")));
        for (who, client) in [
            ("Direct/internal", &w.attacker),
            ("Ungranted/internal", &w.nobody),
        ] {
            let (code, out) = attempt(client, &sql).await;
            // A STRICT function called with NULLs is answered NULL by the planner before
            // any privilege check: it ran nothing (on the extension the schema refuses first).
            let nothing = pg_once_multi::edition()
                && code == "00000"
                && out.split('|').all(|v| matches!(v.trim(), "" | "NULL"));
            let failure = if helper || nothing {
                (!matches!(code.as_str(), "00000" | "42501")
                    || w.secrets.iter().any(|m| out.contains(m.as_str())))
                .then(|| format!("expected 42501 or an answer without secrets, got {code} {out}"))
            } else {
                (code != "42501").then(|| format!("expected 42501, got {code} {out}"))
            };
            lines.push(Line {
                who: who.into(),
                failure,
                what: sql.clone(),
                got: format!("{code} {out}"),
            });
        }
    }
    Ok(())
}

// ---- Attacks the fix's own tests do not try ------------------------------------------

/// invalidate_keys judged its filter (once_internal.may_use_key, evaluated inside a
/// statement that runs as the extension's owner) as the owner, not as its caller: any
/// granted role emptied every namespace with `prefix => ...`, while nobody, administrators
/// and the keys' own role included, could invalidate a once.cached key that way.
#[tokio::test(flavor = "multi_thread")]
async fn invalidate_keys_judges_its_caller_not_the_extension_owner() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("invalidate").await?;
    let gone: i64 = w
        .attacker
        .query_one("SELECT once.invalidate_keys(prefix => $1)", &[&w.prefix])
        .await?
        .get(0);
    let left: i64 = w
        .admin
        .query_one(
            "SELECT count(*) FROM once.entries WHERE key LIKE $1 || '%'",
            &[&w.prefix],
        )
        .await?
        .get(0);
    let attacker_gone = (gone, left);
    // The victim's own once.cached entries, invalidated by the victim, then by an
    // administrator.
    let cached_prefix = format!("{}#cached:", w.cached_user_key);
    let by_victim: i64 = w
        .victim
        .query_one(
            "SELECT once.invalidate_keys(prefix => $1)",
            &[&cached_prefix],
        )
        .await?
        .get(0);
    let by_admin: i64 = w
        .admin
        .query_one(
            "SELECT once.invalidate_keys(prefix => $1)",
            &[&cached_prefix],
        )
        .await?
        .get(0);
    assert_eq!(
        (attacker_gone, by_victim, by_admin),
        ((0, 4), 2, 0),
        "(attacker's count, victim keys left), the victim's own cached keys, then an administrator's"
    );
    Ok(())
}

/// once.cached keys can be forged (the digest is of things an attacker can guess), but a
/// forged key is no use: every function refuses it (the sweep's `Cached` target). A query
/// that switches role inside once.cached is refused by PostgreSQL.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_cached_key_and_a_role_switch_inside_cached_get_nothing() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("forge").await?;
    // The key is no secret: it is computable from the victim's role OID, the schemas its
    // search_path resolves to and the query (once.cached_key, as the victim would ask).
    // Knowing it must not be enough.
    let forged: String = w
        .victim
        .query_one(
            "SELECT once.cached_key($1, $2)",
            &[&w.cached_user_key, &w.cached_query],
        )
        .await?
        .get(0);
    assert_eq!(
        forged, w.cached_done,
        "the victim's key, known to the attacker"
    );
    let (code, message) = refusal(
        w.attacker
            .query_one("SELECT result FROM once.claim_key($1)", &[&forged])
            .await,
    );
    assert_eq!(code, "42501", "{message}");
    for switch in [
        format!("SELECT set_config('role', '{}', true)", w.victim_role),
        "SELECT set_config('session_authorization', 'postgres', true)".to_owned(),
    ] {
        let result = w
            .attacker
            .query_one(
                "SELECT once.cached($1, $2)",
                &[&fresh_key("switch"), &switch],
            )
            .await;
        let (code, message) = refusal(result);
        assert_eq!(code, "42501", "{switch}: {message}");
    }
    Ok(())
}

/// A victim's SECURITY DEFINER function whose search_path leaves out pg_temp (PostgreSQL
/// then searches the caller's temporary schema first for tables) caches what an attacker's
/// temporary table says, under the key of the victim's role and search_path string: every
/// later caller of the function is served the attacker's rows. PostgreSQL's own advice
/// (pg_temp last) avoids it; once.cached turns the mistake from one call's into every
/// caller's, because its key binds the search_path's text, not the schemas it resolves to
/// (current_schemas(true) would name the attacker's pg_temp_N).
#[tokio::test(flavor = "multi_thread")]
async fn a_temporary_table_cannot_poison_a_victims_cached_rows() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("temp").await?;
    let v = &w.victim_role;
    let key = fresh_key("prices");
    w.victim
        .batch_execute(&format!(
            "CREATE TABLE {v}.prices (p text); INSERT INTO {v}.prices VALUES ('real');
             CREATE FUNCTION {v}.report() RETURNS jsonb SECURITY DEFINER SET search_path = {v}
               LANGUAGE sql AS $$ SELECT once.cached('{key}', 'SELECT p FROM prices') $$;
             GRANT USAGE ON SCHEMA {v} TO {a};
             GRANT EXECUTE ON FUNCTION {v}.report() TO {a};",
            a = w.attacker_role
        ))
        .await?;
    w.attacker
        .batch_execute(&format!(
            "CREATE TEMP TABLE prices (p text); INSERT INTO prices VALUES ('POISON');
             GRANT SELECT ON prices TO {v};"
        ))
        .await?;
    let attackers: serde_json::Value = w
        .attacker
        .query_one(&format!("SELECT {v}.report()"), &[])
        .await?
        .get(0);
    // The victim's own next call, in a session without the attacker's table.
    let victims: serde_json::Value = w
        .victim
        .query_one(&format!("SELECT {v}.report()"), &[])
        .await?
        .get(0);
    assert_eq!(
        victims,
        serde_json::json!([{"p": "real"}]),
        "the attacker's call got {attackers}; the victim's was served it"
    );
    Ok(())
}

/// create_namespace against a claim in flight under its prefix: neither order lets the
/// claim's key into the new namespace unseen.
#[tokio::test(flavor = "multi_thread")]
async fn create_namespace_racing_a_claim_hands_nothing_over() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("race").await?;
    let prefix = format!("{}/late/", w.id);
    // The claim first, uncommitted: create_namespace waits for it, then counts it.
    w.attacker.batch_execute("BEGIN").await?;
    w.attacker
        .query_one(
            "SELECT outcome FROM once.claim_key($1)",
            &[&format!("{prefix}planted")],
        )
        .await?;
    let admin = pg_once_multi::session().await?;
    let role = w.victim_role.clone();
    let p = prefix.clone();
    let create = tokio::spawn(async move {
        admin
            .execute(
                "SELECT once.create_namespace($1, $2::text::regrole)",
                &[&p, &role],
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    w.attacker.batch_execute("COMMIT").await?;
    let (code, message) = refusal(create.await?);
    assert_eq!(code, "55006", "{message}");

    // create_namespace first, uncommitted: the claim waits for it, and is then refused.
    w.admin.batch_execute("BEGIN").await?;
    w.admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole, existing => 'purge')",
            &[&prefix, &w.victim_role],
        )
        .await?;
    let attacker = connect_as(&w.attacker_role).await?;
    let key = format!("{prefix}planted-2");
    let claim = tokio::spawn(async move {
        attacker
            .query_one(
                "SELECT outcome FROM once.claim_key($1, wait => '5 s')",
                &[&key],
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    w.admin.batch_execute("COMMIT").await?;
    let (code, message) = refusal(claim.await?);
    assert_eq!(code, "42501", "{message}");
    let planted: i64 = w
        .admin
        .query_one(
            "SELECT count(*) FROM once.entries WHERE key LIKE $1 || '%'",
            &[&prefix],
        )
        .await?
        .get(0);
    assert_eq!(planted, 0);
    Ok(())
}

/// drop_namespace against the tenant's claim in flight: the claim's key must not outlive
/// the namespace as a shared key that every role may read ("a namespace that still has
/// keys cannot be dropped, since they would become shared").
#[tokio::test(flavor = "multi_thread")]
async fn drop_namespace_racing_a_claim_shares_nothing() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("droprace").await?;
    let prefix = format!("{}/short/", w.id);
    w.admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&prefix, &w.victim_role],
        )
        .await?;
    let key = format!("{prefix}medical-record");
    w.victim.batch_execute("BEGIN").await?;
    let token: i64 = w
        .victim
        .query_one("SELECT token FROM once.claim_key($1)", &[&key])
        .await?
        .get(0);
    // drop_namespace while the claim is in flight; the tenant commits meanwhile.
    let admin = pg_once_multi::session().await?;
    let p = prefix.clone();
    let drop =
        tokio::spawn(async move { admin.execute("SELECT once.drop_namespace($1)", &[&p]).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    w.victim.batch_execute("COMMIT").await?;
    let dropped = drop.await?;
    if dropped.is_ok() {
        // The tenant goes on as before; its key is now anyone's.
        w.victim
            .execute(
                "SELECT once.complete_key($1, $2, '{\"diagnosis\": \"secret\"}')",
                &[&key, &token],
            )
            .await?;
        let read = w
            .attacker
            .query_one(
                "SELECT outcome, result::text FROM once.claim_key($1)",
                &[&key],
            )
            .await?;
        let (outcome, result): (String, Option<String>) = (read.get(0), read.get(1));
        panic!("drop_namespace succeeded with a claim in flight; the attacker then got {outcome} {result:?}");
    }
    let (code, message) = refusal(dropped);
    assert_eq!(code, "55006", "{message}");
    Ok(())
}

/// Queue calls the sweep's generated arguments do not make: a new queue put into the
/// victim's namespace, a shared key pushed into the victim's queue, and the attacker's
/// own namespace queue fed the victim's key.
#[tokio::test(flavor = "multi_thread")]
async fn queue_calls_across_namespaces_are_refused() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("queues").await?;
    let mine = format!("mine_{}", w.id);
    w.attacker
        .execute(
            "SELECT once.create_queue($1, namespace => $2)",
            &[&mine, &w.attacker_prefix],
        )
        .await?;
    let before = w.state().await?;
    let attempts: [(&str, Vec<String>); 4] = [
        (
            "SELECT once.create_queue($1, namespace => $2)::text",
            vec![format!("new_{}", w.id), w.prefix.clone()],
        ),
        (
            "SELECT once.enqueue_key($1, queue => $2)",
            vec![format!("{}/shared/pushed", w.id), w.queue.clone()],
        ),
        (
            "SELECT once.enqueue_key($1, queue => $2)",
            vec![format!("{}pulled", w.prefix), mine.clone()],
        ),
        (
            "SELECT count(*)::text FROM once.claim_next($1, n => $2::text::int)",
            vec![w.queue.clone(), "100".into()],
        ),
    ];
    for (sql, args) in attempts {
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = args
            .iter()
            .map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        let (code, message) = refusal(w.attacker.query_one(sql, &params).await);
        assert_eq!(code, "42501", "{sql} {args:?}: {message}");
    }
    assert_eq!(before, w.state().await?, "nothing changed");
    Ok(())
}

/// A role with no grant at all LISTENs on channel once while the victim does everything
/// a tenant does with its namespace's keys (complete, fail, release, invalidate, refresh,
/// enqueue, claim_next, once.cached): no announcement names a key of the namespace.
#[tokio::test(flavor = "multi_thread")]
async fn a_listener_without_rights_hears_no_namespace_key_from_any_call() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("listen").await?;
    let nobody = format!("nobody_{}", w.id);
    let dsn = format!("{} user={nobody}", once::dsn_from_env()?);
    let (listener, mut heard) = once::connect_listening(&dsn).await?;
    listener.batch_execute("LISTEN once").await?;
    let p = &w.prefix;
    let v = &w.victim;
    for (i, end) in ["complete", "fail", "release"].iter().enumerate() {
        let key = format!("{p}listened-{i}");
        let token: i64 = v
            .query_one("SELECT token FROM once.claim_key($1)", &[&key])
            .await?
            .get(0);
        let sql = match *end {
            "complete" => "SELECT once.complete_key($1, $2, '1')",
            "fail" => "SELECT once.fail_key($1, $2, 'x')",
            _ => "SELECT once.release_key($1, $2)",
        };
        v.execute(sql, &[&key, &token]).await?;
    }
    v.execute("SELECT once.refresh_key($1)", &[&format!("{p}listened-0")])
        .await?;
    v.execute(
        "SELECT once.invalidate_key($1)",
        &[&format!("{p}listened-0")],
    )
    .await?;
    v.execute(
        "SELECT once.enqueue_key($1, NULL, $2)",
        &[&format!("{p}listened-job"), &w.queue],
    )
    .await?;
    let taken = v
        .query(
            "SELECT key, token FROM once.claim_next($1, n => 10)",
            &[&w.queue],
        )
        .await?;
    for row in taken {
        let (key, token): (String, i64) = (row.get(0), row.get(1));
        v.execute("SELECT once.complete_key($1, $2, '2')", &[&key, &token])
            .await?;
    }
    v.execute(
        "SELECT once.cached($1, 'SELECT 1 AS one')",
        &[&format!("{p}listened-cached")],
    )
    .await?;
    v.execute("SELECT once.invalidate_keys(prefix => $1)", &[p])
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut payloads = Vec::new();
    while let Ok(n) = heard.try_recv() {
        payloads.push(n.payload().to_owned());
    }
    assert!(!payloads.is_empty(), "the listener heard the announcements");
    let named: Vec<&String> = payloads
        .iter()
        .filter(|p| p.contains(w.prefix.as_str()))
        .collect();
    assert!(
        named.is_empty(),
        "keys of the namespace announced verbatim: {named:?}"
    );
    Ok(())
}

/// drop_namespace against the tenant's create_queue in flight: the queue must not outlive
/// the namespace, naming a namespace that no longer exists (then anyone's).
#[tokio::test(flavor = "multi_thread")]
async fn drop_namespace_racing_a_new_queue_leaves_no_orphan() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world("queuerace").await?;
    let prefix = format!("{}/short/", w.id);
    w.admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&prefix, &w.victim_role],
        )
        .await?;
    let queue = format!("late_{}", w.id);
    w.victim.batch_execute("BEGIN").await?;
    w.victim
        .execute(
            "SELECT once.create_queue($1, namespace => $2)",
            &[&queue, &prefix],
        )
        .await?;
    let admin = pg_once_multi::session().await?;
    let p = prefix.clone();
    let drop =
        tokio::spawn(async move { admin.execute("SELECT once.drop_namespace($1)", &[&p]).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    w.victim.batch_execute("COMMIT").await?;
    let dropped = drop.await?;
    let orphans: i64 = w
        .admin
        .query_one(
            "SELECT count(*) FROM once.queues q WHERE namespace IS NOT NULL
                AND NOT EXISTS (SELECT FROM once_internal.namespace_owners n WHERE n.prefix = q.namespace)",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(
        orphans,
        0,
        "drop_namespace answered {:?}; queue {queue} names a namespace that is gone",
        dropped.map_err(|e| e.to_string())
    );
    Ok(())
}
