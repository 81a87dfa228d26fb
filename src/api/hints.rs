//! Hints for calls of pg_once functions that PostgreSQL refuses before pg_once runs.
//!
//! `once.claim_key('k', wait => 10)` fails in the parser with `42883 function
//! once.claim_key(unknown, wait => integer) does not exist` and PostgreSQL's generic hint
//! ("You might need to add explicit type casts"). An overload taking numbers cannot fix
//! it: `wait => '5 s'` (a literal of type unknown) would then match both an interval and
//! an integer parameter, which are of different type categories, so PostgreSQL could not
//! choose and every ordinary call would fail as ambiguous; and `\df once.*` would list
//! each function twice. So pg_once instead rewrites the hint of that one error, in an
//! `emit_log_hook` installed by `_PG_init`: the message is PostgreSQL's, the hint says
//! which argument is wrong and what to write.
//!
//! The hook runs in every backend that has loaded pg_once: every backend when it is in
//! shared_preload_libraries; otherwise a session that has called a pg_once C function or
//! created the extension (a session that has not sees PostgreSQL's own hint). It sees an
//! error only if it is logged (`log_min_messages` at ERROR or below, the default).
//!
//! The signatures come from the install script itself (sql/), parsed once per backend,
//! so they cannot disagree with what CREATE EXTENSION made.

use pgrx::pg_sys;
use std::ffi::{CStr, CString};
use std::sync::OnceLock;

/// The hook that was installed before ours, called after ours.
static mut PREVIOUS: pg_sys::emit_log_hook_type = None;

/// Install the hook (from _PG_init, once per process that loads pg_once).
pub fn install() {
    // SAFETY: _PG_init runs once per process, before any error this hook could see;
    // chaining keeps whatever hook another library installed.
    unsafe {
        PREVIOUS = pg_sys::emit_log_hook;
        pg_sys::emit_log_hook = Some(hint_mistaken_call);
    }
}

/// PostgreSQL's untranslated message for a call that matches no function.
const NO_SUCH_FUNCTION: &CStr = c"function %s does not exist";

unsafe extern "C-unwind" fn hint_mistaken_call(edata: *mut pg_sys::ErrorData) {
    // SAFETY: PostgreSQL passes the error being reported; its strings live in ErrorContext,
    // where the new hint is allocated too. Nothing here may raise an error (we are inside
    // error reporting): the hint is computed in plain Rust, a panic is caught and ignored.
    unsafe {
        if !edata.is_null()
            && (*edata).sqlerrcode == pgrx::PgSqlErrorCode::ERRCODE_UNDEFINED_FUNCTION as i32
            && !(*edata).message_id.is_null()
            && CStr::from_ptr((*edata).message_id) == NO_SUCH_FUNCTION
            && !(*edata).message.is_null()
        {
            let message = CStr::from_ptr((*edata).message).to_string_lossy();
            let hint = std::panic::catch_unwind(|| hint_for(&message))
                .ok()
                .flatten();
            if let Some(hint) = hint.and_then(|h| CString::new(h).ok()) {
                (*edata).hint = pg_sys::MemoryContextStrdup(pg_sys::ErrorContext, hint.as_ptr());
            }
        }
        if let Some(previous) = PREVIOUS {
            previous(edata);
        }
    }
}

/// A parameter of a pg_once function, as sql/ declares it.
#[derive(Debug, Clone, PartialEq)]
struct Param {
    name: String,
    /// As PostgreSQL prints it in messages (`timestamp with time zone`, not `timestamptz`).
    type_name: String,
    has_default: bool,
}

#[derive(Debug, Clone)]
struct Function {
    name: String,
    params: Vec<Param>,
    /// The declaration's argument list, for a hint that shows it.
    signature: String,
}

/// The functions of schema once, parsed from the install script.
fn api() -> &'static [Function] {
    static API: OnceLock<Vec<Function>> = OnceLock::new();
    API.get_or_init(|| {
        let mut functions = parse(include_str!("../../sql/schema.sql"));
        functions.extend(parse(include_str!("../../sql/functions.sql")));
        functions
    })
}

/// Every `CREATE FUNCTION once.<name>(...)` of an SQL script (once_internal's are not API).
fn parse(script: &str) -> Vec<Function> {
    const START: &str = "CREATE FUNCTION once.";
    let mut found = Vec::new();
    let mut rest = script;
    while let Some(at) = rest.find(START) {
        rest = &rest[at + START.len()..];
        let Some(open) = rest.find('(') else { break };
        let name = rest[..open].trim().to_string();
        let Some(close) = matching_paren(&rest[open..]) else {
            break;
        };
        let args = &rest[open + 1..open + close];
        let params = split_top_level(args)
            .iter()
            .filter_map(|arg| {
                let (decl, default) = match arg.find(" DEFAULT ") {
                    Some(i) => (&arg[..i], true),
                    None => (arg.as_str(), false),
                };
                let mut words = decl.split_whitespace();
                let name = words.next()?.to_string();
                let type_name = printed_type(&words.collect::<Vec<_>>().join(" "));
                Some(Param {
                    name,
                    type_name,
                    has_default: default,
                })
            })
            .collect();
        let signature = format!(
            "once.{name}({})",
            args.split_whitespace().collect::<Vec<_>>().join(" ")
        );
        found.push(Function {
            name,
            params,
            signature,
        });
        rest = &rest[open + close..];
    }
    found
}

/// The type name PostgreSQL prints for one written in sql/.
fn printed_type(written: &str) -> String {
    match written {
        "timestamptz" => "timestamp with time zone",
        "int" | "int4" => "integer",
        "int8" => "bigint",
        "bool" => "boolean",
        "float8" => "double precision",
        other => other,
    }
    .to_string()
}

/// The offset of the parenthesis closing the one `text` starts with.
fn matching_paren(text: &str) -> Option<usize> {
    let (mut depth, mut quoted) = (0, false);
    for (i, ch) in text.char_indices() {
        match ch {
            '\'' => quoted = !quoted,
            '(' if !quoted => depth += 1,
            ')' if !quoted => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// Split on commas outside parentheses and quotes.
fn split_top_level(text: &str) -> Vec<String> {
    let (mut parts, mut current, mut depth, mut quoted) = (Vec::new(), String::new(), 0, false);
    for ch in text.chars() {
        match ch {
            '\'' => quoted = !quoted,
            '(' if !quoted => depth += 1,
            ')' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => {
                parts.push(std::mem::take(&mut current).trim().to_string());
                continue;
            }
            _ => {}
        }
        current.push(ch);
    }
    if !current.trim().is_empty() {
        parts.push(current.trim().to_string());
    }
    parts
}

/// The hint for PostgreSQL's "function ... does not exist" message, if it names a
/// function of schema once (qualified, or unqualified with a pg_once function's name).
fn hint_for(message: &str) -> Option<String> {
    // The call's signature is the only parenthesised text of the message, in every
    // language: "function once.claim_key(unknown, wait => integer) does not exist".
    let open = message.find('(')?;
    let called = message[..open].rsplit(|c: char| c.is_whitespace()).next()?;
    let close = open + matching_paren(&message[open..])?;
    let given: Vec<(Option<String>, String)> = split_top_level(&message[open + 1..close])
        .into_iter()
        .map(|arg| match arg.split_once(" => ") {
            Some((name, type_name)) => (Some(name.to_string()), type_name.to_string()),
            None => (None, arg),
        })
        .collect();
    let (qualified, name) = match called.split_once('.') {
        Some(("once", name)) => (true, name),
        Some(_) => return None,
        None => (false, called),
    };
    let Some(function) = api().iter().find(|f| f.name == name) else {
        if !qualified {
            return None;
        }
        return Some(no_such_function(name));
    };
    Some(mistake(function, &given))
}

fn no_such_function(name: &str) -> String {
    let names: Vec<&str> = api().iter().map(|f| f.name.as_str()).collect();
    let near = names
        .iter()
        .find(|n| n.starts_with(name) || name.starts_with(*n));
    match near {
        Some(near) => format!(
            "pg_once has no function {name}; did you mean once.{near}? \\df once.* lists them."
        ),
        None => format!(
            "pg_once has no function {name}. Its functions: {}.",
            names.join(", ")
        ),
    }
}

/// What is wrong with a call of `function` with arguments of `given` types.
fn mistake(function: &Function, given: &[(Option<String>, String)]) -> String {
    let names = || {
        function
            .params
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut bound: Vec<(&Param, &str)> = Vec::new();
    for (i, (arg_name, type_name)) in given.iter().enumerate() {
        let param = match arg_name {
            Some(arg_name) => match function.params.iter().find(|p| &p.name == arg_name) {
                Some(param) => param,
                None => {
                    return format!(
                        "once.{} has no argument named {arg_name}; its arguments are {}.",
                        function.name,
                        names()
                    );
                }
            },
            None => match function.params.get(i) {
                Some(param) => param,
                None => {
                    return format!(
                        "once.{} takes at most {} arguments: {}.",
                        function.name,
                        function.params.len(),
                        function.signature
                    );
                }
            },
        };
        bound.push((param, type_name));
    }
    if let Some((param, given_type)) = bound.iter().find(|(p, t)| !accepts(&p.type_name, t)) {
        return wrong_type(param, given_type);
    }
    let missing: Vec<&str> = function
        .params
        .iter()
        .filter(|p| !p.has_default && !bound.iter().any(|(b, _)| b.name == p.name))
        .map(|p| p.name.as_str())
        .collect();
    if !missing.is_empty() {
        return format!(
            "once.{} needs {} as well: {}.",
            function.name,
            missing.join(", "),
            function.signature
        );
    }
    format!("Call it as {}.", function.signature)
}

/// Whether an argument of type `given` reaches a parameter of type `expected` without a
/// cast written out (a literal, or one of PostgreSQL's implicit casts that matter here).
fn accepts(expected: &str, given: &str) -> bool {
    expected == given
        || given == "unknown"
        || matches!(
            (expected, given),
            ("bigint", "integer" | "smallint")
                | ("integer", "smallint")
                | ("text", "character varying" | "character" | "name")
                | (
                    "timestamp with time zone",
                    "timestamp without time zone" | "date"
                )
                | ("regrole", "oid")
        )
}

const NUMBERS: [&str; 6] = [
    "integer",
    "bigint",
    "smallint",
    "numeric",
    "double precision",
    "real",
];

/// The hint for an argument of the wrong type.
fn wrong_type(param: &Param, given: &str) -> String {
    let name = &param.name;
    match param.type_name.as_str() {
        "interval" if NUMBERS.contains(&given) => format!(
            "{name} is an interval, not a number of seconds: write {name} => '10 seconds' \
             (or '500 ms', '1 hour'), or make_interval(secs => n) for a number n."
        ),
        "interval" => {
            format!("{name} is an interval, got {given}: cast it, {name} => value::interval.")
        }
        "jsonb" => format!(
            "{name} is jsonb, got {given}: pass value::jsonb for JSON text, or to_jsonb(value) \
             to store the value itself (a string becomes a JSON string)."
        ),
        // claim_key's fingerprint: a text or a number is most likely the request itself.
        "bytea" => format!(
            "{name} is bytea, got {given}: pass a digest of it, e.g. \
             {name} => sha256(convert_to(value, 'UTF8'))."
        ),
        expected => {
            format!("{name} is {expected}, got {given}: cast it, {name} => value::{expected}.")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_install_script_gives_every_api_function_its_parameters() {
        let claim_key = api().iter().find(|f| f.name == "claim_key").unwrap();
        let names: Vec<_> = claim_key.params.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "key",
                "lease",
                "wait",
                "owner_pid",
                "serve_stale",
                "fingerprint"
            ]
        );
        assert!(!claim_key.params[0].has_default && claim_key.params[2].has_default);
        assert_eq!(claim_key.params[2].type_name, "interval");
        assert!(api().iter().any(|f| f.name == "key_hash"));
        assert!(
            !api().iter().any(|f| f.name == "row_taken"),
            "internal, not API"
        );
    }

    #[test]
    fn a_number_for_an_interval_is_explained() {
        let hint =
            hint_for("function once.claim_key(unknown, wait => integer) does not exist").unwrap();
        assert!(
            hint.starts_with("wait is an interval, not a number of seconds"),
            "{hint}"
        );
        let hint = hint_for("function once.claim_key(unknown, integer) does not exist").unwrap();
        assert!(hint.starts_with("lease is an interval"), "{hint}");
    }

    #[test]
    fn other_slips_are_named() {
        let hint = hint_for("function once.claim_key(unknown, wiat => unknown) does not exist");
        assert!(hint.unwrap().contains("no argument named wiat"));
        let hint = hint_for("function once.claim(unknown) does not exist").unwrap();
        assert!(hint.contains("did you mean once.claim_key"), "{hint}");
        let hint = hint_for("function once.complete_key(unknown) does not exist").unwrap();
        assert!(hint.contains("needs token, result as well"), "{hint}");
        let hint = hint_for("function once.complete_key(unknown, integer, text) does not exist");
        assert!(hint.unwrap().starts_with("result is jsonb, got text"));
        let hint = "function once.claim_key(unknown, fingerprint => text) does not exist";
        let hint = hint_for(hint).unwrap();
        assert!(
            hint.contains("fingerprint => sha256(convert_to(value"),
            "{hint}"
        );
        assert_eq!(
            hint_for("function other.claim_key(integer) does not exist"),
            None
        );
        assert_eq!(hint_for("function my_own(integer) does not exist"), None);
    }
}
