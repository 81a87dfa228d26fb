//! SQL statements prepared once per backend and kept for its lifetime, with named
//! parameters.
//!
//! A statement's text names its parameters (`WHERE key_hash = $key_hash`) and a call
//! passes them by the same names (`params![key_hash = key.hash_param()]`), so the text and
//! its callers never have to agree by position. The names become `$1`, `$2`, ... in order
//! of first appearance when the statement is first prepared, with the types of the values
//! that first call passed; every later call must pass the same names with the same types,
//! or the call fails (an internal error: a broken invariant, not bad input).
//!
//! A statement kept in a file may name rules, pieces of SQL that several statements share,
//! spliced in before its parameters are numbered (pg_once_splice, the crate in splice/ that
//! the SQL edition's script uses too; CONTRIBUTING.md, "Where statements live").
//!
//! Plans are prepared as "mutating": SPI then takes a fresh snapshot for every execution,
//! even of a SELECT. A waiting claim_key re-reads its key many times inside one
//! transaction and must see each change as soon as it is committed.
//!
//! Every statement runs with the rights of the extension's owner, as the user
//! `SECURITY_LOCAL_USERID_CHANGE` makes it (what a `SECURITY DEFINER` function's body runs
//! as), and with `search_path = pg_catalog, pg_temp`, so that no schema, function or
//! operator on the caller's path changes what it means. This is the one place where pg_once
//! takes its owner's rights. Its C functions are not `SECURITY DEFINER` themselves: so
//! that, up to here, the current user (`GetUserId()`) is the role that called them, the
//! one PostgreSQL's own privilege checks judge, whom the namespace checks judge too
//! (protocol::namespace, docs/security.md); and because a cache hit runs no statement,
//! it pays for neither switch (a `SET` clause on the declarations cost a hit about 7% of
//! its server time).

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, PgOid};
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiTupleTable};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// SQL text whose parameters are named `$name` (lower-case letters, digits, `_`), and the
/// rules it may splice in.
pub struct Statement {
    sql: &'static str,
    rules: &'static [Rule],
}

use pg_once_splice::splice;
pub use pg_once_splice::Rule;

impl Statement {
    pub const fn new(sql: &'static str) -> Statement {
        Statement { sql, rules: &[] }
    }

    /// A statement kept in a file (protocol::rules), made of SQL and of the `rules` it
    /// names; see `splice`.
    pub const fn with_rules(sql: &'static str, rules: &'static [Rule]) -> Statement {
        Statement { sql, rules }
    }

    /// The text the plan is made of.
    fn text(&self) -> Result<String, String> {
        splice(self.sql, self.rules)
    }
}

/// A parameter value and the name it has in the statement's text.
pub type Param<'a> = (&'static str, DatumWithOid<'a>);

/// Parameters by name: `params![key_hash = key.hash_param(), token = token]`. Values are
/// anything that converts into a DatumWithOid (NULL as `None::<T>`, typed).
macro_rules! params {
    ($($name:ident = $value:expr),* $(,)?) => {
        [$((stringify!($name), ::pgrx::datum::DatumWithOid::from($value))),*]
    };
}
pub(crate) use params;

/// A plan kept for the backend's lifetime, and the names and types of its parameters in
/// the order of `$1`, `$2`, ...
struct Kept {
    plan: OwnedPreparedStatement,
    names: Vec<String>,
    types: Vec<pg_sys::Oid>,
}

thread_local! {
    /// Kept plans by the address of their Statement. Boxed so a plan never moves.
    static PLANS: RefCell<HashMap<usize, Box<Kept>>> = RefCell::new(HashMap::new());
}

/// Execute `statement` with `params` and hand its result to `read` before SPI memory goes
/// away.
pub fn run<'a, R>(
    statement: &'static Statement,
    params: impl IntoIterator<Item = Param<'a>>,
    read: impl FnOnce(SpiTupleTable<'_>) -> pgrx::spi::Result<R>,
) -> R {
    let params: Vec<Param<'a>> = params.into_iter().collect();
    as_extension_owner(|| {
        Spi::connect(|client| {
            let kept: *const Kept = PLANS.with_borrow_mut(|plans| {
                let id = statement as *const Statement as usize;
                if let Some(kept) = plans.get(&id) {
                    return Ok::<_, pgrx::spi::SpiError>(&**kept as *const Kept);
                }
                let text = statement.text().unwrap_or_else(|e| {
                    error!("pg_once: bad statement text: {e}: {}", statement.sql)
                });
                let (sql, names) = number_params(&text)
                    .unwrap_or_else(|e| error!("pg_once: bad statement text: {e}: {text}"));
                let names: Vec<String> = names.into_iter().map(str::to_owned).collect();
                let types: Vec<pg_sys::Oid> = names
                    .iter()
                    .map(
                        |name| match params.iter().find(|(given, _)| given == name) {
                            Some((_, value)) => value.oid(),
                            None => error!("pg_once: statement parameter ${name} was not given"),
                        },
                    )
                    .collect();
                let arg_types: Vec<PgOid> = types.iter().map(|&t| PgOid::from(t)).collect();
                let plan = client.prepare_mut(sql.as_str(), &arg_types)?.keep();
                let kept = plans
                    .entry(id)
                    .or_insert(Box::new(Kept { plan, names, types }));
                Ok(&**kept as *const Kept)
            })?;
            // SAFETY: kept plans are boxed and never removed, so the pointer stays valid.
            let kept = unsafe { &*kept };
            let args = in_order(kept, params);
            // `select` on a mutating plan: a fresh snapshot per execution (read_only = false)
            // without pgrx's `update`, which would assign a transaction id up front and turn
            // every cache hit into a committed write. Statements that write get one anyway.
            let table = client.select(&*kept.plan, None, &args)?;
            read(table)
        })
    })
    .unwrap_or_else(|e| error!("pg_once: {e}"))
}

/// Run `f` as the extension's owner (with SECURITY_LOCAL_USERID_CHANGE: nothing `f` runs
/// may SET ROLE meanwhile; as the current user where pg_once is not installed, which leaves
/// nothing of pg_once's to protect) and with `search_path = pg_catalog, pg_temp` at a GUC nesting
/// level of its own, as a SECURITY DEFINER function with a `SET` clause would. An error
/// inside needs no cleanup here: the abort of the (sub)transaction that catches it
/// restores both the user and the path, as it does for such a function.
pub fn as_extension_owner<R>(f: impl FnOnce() -> R) -> R {
    let owner = crate::storage::owner::extension_owner();
    let (user, context) = current_user();
    // The call's user, for what the statement asks about its caller (calling_user).
    let outermost = CALLER.get().is_none();
    if outermost {
        CALLER.set(Some((user, context)));
    }
    let _forget = ForgetCaller(outermost);
    // SAFETY: switches to the owner, opens a GUC nesting level and sets search_path at it
    // with GUC_ACTION_SAVE; once `f` has returned, closes the level (restoring the caller's
    // path) and restores the user.
    unsafe {
        pg_sys::SetUserIdAndSecContext(
            owner.unwrap_or(user),
            context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32,
        );
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"search_path".as_ptr(),
            c"pg_catalog, pg_temp".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        let result = f();
        pg_sys::AtEOXact_GUC(true, level);
        pg_sys::SetUserIdAndSecContext(user, context);
        result
    }
}

thread_local! {
    /// While pg_once's statements run with the owner's rights: the user and security
    /// context of the call they run for (the outermost one, when statements nest).
    static CALLER: Cell<Option<(pg_sys::Oid, i32)>> = const { Cell::new(None) };
}

/// Forgets CALLER when the outermost statement ends, by returning or by an error
/// unwinding through it.
struct ForgetCaller(bool);

impl Drop for ForgetCaller {
    fn drop(&mut self) {
        if self.0 {
            CALLER.set(None);
        }
    }
}

fn current_user() -> (pg_sys::Oid, i32) {
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: reads two backend globals.
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    (user, context)
}

/// The user a pg_once call is made by, and its security context (`SECURITY_*` bits): the
/// current ones, or, while a statement runs with the owner's rights, those of the call
/// that runs it. A filter evaluated inside such a statement (may_use_key in
/// invalidate_keys' statement) must judge the caller, not the owner it runs as.
pub fn calling_user() -> (pg_sys::Oid, i32) {
    CALLER.get().unwrap_or_else(current_user)
}

/// `params` in the order of the plan's `$1`, `$2`, ..., each checked against the type the
/// plan was prepared with.
fn in_order<'a>(kept: &Kept, params: Vec<Param<'a>>) -> Vec<DatumWithOid<'a>> {
    if params.len() != kept.names.len() {
        let given: Vec<&str> = params.iter().map(|(name, _)| *name).collect();
        error!(
            "pg_once: statement takes parameters {:?}, was given {given:?}",
            kept.names
        );
    }
    let mut slots: Vec<Option<DatumWithOid<'a>>> = (0..params.len()).map(|_| None).collect();
    for (name, value) in params {
        let Some(i) = kept.names.iter().position(|n| *n == name) else {
            error!("pg_once: statement has no parameter ${name}");
        };
        if value.oid() != kept.types[i] {
            error!(
                "pg_once: parameter ${name} has type {:?}, the statement was prepared with {:?}",
                value.oid(),
                kept.types[i]
            );
        }
        slots[i] = Some(value);
    }
    slots
        .into_iter()
        .map(|slot| slot.expect("as many distinct names as parameters"))
        .collect()
}

/// `sql` with each `$name` replaced by `$1`, `$2`, ... in the order of first appearance,
/// and the names in that order. Quoted literals and identifiers are left alone; positional
/// `$1` and dollar-quoting are refused, so that every parameter has a name.
fn number_params(sql: &str) -> Result<(String, Vec<&str>), String> {
    let mut out = String::with_capacity(sql.len());
    let mut names: Vec<&str> = Vec::new();
    let bytes = sql.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => {
                // A doubled quote inside is an escaped quote: the scan simply resumes.
                let end = sql[i + 1..]
                    .find(quote as char)
                    .ok_or("unterminated quote")?;
                out.push_str(&sql[i..i + 1 + end + 1]);
                i += end + 2;
            }
            b'$' => {
                let start = i + 1;
                let len = bytes[start..]
                    .iter()
                    .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || **b == b'_')
                    .count();
                let name = &sql[start..start + len];
                if name.is_empty() || name.as_bytes()[0].is_ascii_digit() {
                    return Err(format!("parameters must be named, found ${name}"));
                }
                if bytes.get(start + len) == Some(&b'$') {
                    return Err(format!("dollar quoting (${name}$) is not supported"));
                }
                let number = match names.iter().position(|n| *n == name) {
                    Some(p) => p + 1,
                    None => {
                        names.push(name);
                        names.len()
                    }
                };
                out.push_str(&format!("${number}"));
                i = start + len;
            }
            _ => {
                let next = sql[i..].find(['\'', '"', '$']).map_or(sql.len(), |n| i + n);
                out.push_str(&sql[i..next]);
                i = next;
            }
        }
    }
    Ok((out, names))
}

#[cfg(test)]
mod tests {
    use super::number_params;

    #[test]
    fn names_become_numbers_in_order_of_first_appearance() {
        let (sql, names) =
            number_params("UPDATE t SET a = $lease, b = $key WHERE k = $key AND c = $lease::text")
                .unwrap();
        assert_eq!(
            sql,
            "UPDATE t SET a = $1, b = $2 WHERE k = $2 AND c = $1::text"
        );
        assert_eq!(names, ["lease", "key"]);
    }

    #[test]
    fn quoted_text_is_left_alone() {
        let (sql, names) =
            number_params("SELECT format('owner %s is gone: $not_a_param', $who), \"$col\"")
                .unwrap();
        assert_eq!(
            sql,
            "SELECT format('owner %s is gone: $not_a_param', $1), \"$col\""
        );
        assert_eq!(names, ["who"]);
        let (sql, _) = number_params("SELECT 'it''s', $x").unwrap();
        assert_eq!(sql, "SELECT 'it''s', $1");
    }

    #[test]
    fn positional_parameters_and_dollar_quotes_are_refused() {
        assert!(number_params("SELECT $1").is_err());
        assert!(number_params("SELECT $body$ x $body$").is_err());
        assert!(number_params("SELECT $").is_err());
        assert!(number_params("SELECT 'open").is_err());
    }

    #[test]
    fn text_without_parameters_is_unchanged() {
        let sql = "DELETE FROM once.entries WHERE state = 'done'";
        assert_eq!(number_params(sql).unwrap(), (sql.to_owned(), vec![]));
    }
}
