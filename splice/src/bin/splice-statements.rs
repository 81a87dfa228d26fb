//! Every statement file of a directory with its rules spliced in, printed as one JSON
//! object by name (`{"complete": "UPDATE once.entries ..."}`): what the SQL edition's
//! script (scripts/sql_edition.py) runs, the same text the extension prepares.
//!
//!     splice-statements src/protocol/sql      (its rules are in src/protocol/sql/rules)

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

/// Each `*.sql` file of `dir`, by its name without `.sql`.
fn sql_files(dir: &Path) -> Result<BTreeMap<String, String>, String> {
    let mut files = BTreeMap::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_some_and(|e| e == "sql") {
            let name = path
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            files.insert(name, text);
        }
    }
    Ok(files)
}

fn spliced(dir: &Path) -> Result<BTreeMap<String, String>, String> {
    let rules = sql_files(&dir.join("rules"))?;
    let rules: Vec<(&str, &str)> = rules
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    sql_files(dir)?
        .into_iter()
        .map(|(name, sql)| {
            let text =
                pg_once_splice::splice(&sql, &rules).map_err(|e| format!("{name}.sql: {e}"))?;
            Ok((name, text))
        })
        .collect()
}

fn main() -> ExitCode {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: splice-statements DIR");
        return ExitCode::from(2);
    };
    match spliced(Path::new(&dir)) {
        Ok(statements) => {
            println!(
                "{}",
                serde_json::Value::from(serde_json::Map::from_iter(
                    statements.into_iter().map(|(n, t)| (n, t.into()))
                ))
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("splice-statements: {e}");
            ExitCode::FAILURE
        }
    }
}
