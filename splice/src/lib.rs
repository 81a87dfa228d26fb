//! How pg_once's statement files become the SQL a plan runs: comment lines dropped, and
//! the rules they name spliced in (CONTRIBUTING.md, "Where statements live"). One splicer
//! for both editions: the extension's storage::statements calls it for each statement
//! it prepares, and the SQL edition's script (scripts/sql_edition.py) asks the
//! `splice-statements` program for every statement at once, so that the edition runs the
//! same text.

/// A piece of SQL that several statements share: its name and its text, in which
/// `{param}` stands for a value each statement gives.
pub type Rule = (&'static str, &'static str);

/// `sql` as a plan sees it. Lines that begin with `--` are comments, for whoever reads the
/// file, and are dropped, as is white space around the whole; then every
/// `{{name(param=value; ...)}}` (or `{{name}}`, a rule with no parameters) becomes the
/// text of rule `name`, so dropped of its comments too, with each `{param}` in it replaced
/// by the value given (verbatim: any text but `;` and `)}}`, possibly empty). Text
/// without `{{` and comments is left exactly as it is.
pub fn splice(sql: &str, rules: &[(&str, &str)]) -> Result<String, String> {
    let sql = uncommented(sql);
    let mut out = String::with_capacity(sql.len() * 2);
    let mut rest = sql.as_str();
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find("}}").ok_or("a {{ without its }}")?;
        let call = &rest[start + 2..start + end];
        let (name, given) = match call.split_once('(') {
            Some((name, args)) => (
                name,
                args.strip_suffix(')')
                    .ok_or_else(|| format!("rule {name}: no ) before }}}}"))?,
            ),
            None => (call, ""),
        };
        let (_, text) = rules
            .iter()
            .find(|(rule, _)| *rule == name)
            .ok_or_else(|| format!("no rule {name}"))?;
        let mut text = uncommented(text);
        for arg in given.split(';').filter(|a| !a.trim().is_empty()) {
            let (param, value) = arg
                .split_once('=')
                .ok_or_else(|| format!("rule {name}: {arg:?} is not param=value"))?;
            let placeholder = format!("{{{}}}", param.trim());
            if !text.contains(&placeholder) {
                return Err(format!("rule {name} has no parameter {}", param.trim()));
            }
            text = text.replace(&placeholder, value);
        }
        if let Some(at) = text.find('{') {
            return Err(format!(
                "rule {name}: a parameter not given at {}",
                &text[at..]
            ));
        }
        out.push_str(&text);
        rest = &rest[start + end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `sql` without its comment lines and the white space around it.
pub fn uncommented(sql: &str) -> String {
    sql.lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::splice;

    #[test]
    fn rules_are_spliced_in_with_their_parameters_and_comments_dropped() {
        let rules = [
            (
                "holder",
                "-- why\n({alias}owner = $holder OR {alias}owner IS NULL)\n",
            ),
            ("columns", "-- why\na, b\n"),
        ];
        let sql = "-- what it does\nUPDATE t AS e SET ({{columns}}) = (1, 2)\n  WHERE {{holder(alias=e.)}} AND {{holder(alias=)}}\n";
        assert_eq!(
            splice(sql, &rules).unwrap(),
            "UPDATE t AS e SET (a, b) = (1, 2)\n  WHERE (e.owner = $holder OR e.owner IS NULL) AND (owner = $holder OR owner IS NULL)"
        );
        let multi = [("f", "format('%s: {how}', {row}owner, {why})")];
        assert_eq!(
            splice("{{f(row=e.; why=g.why; how=taken over)}}", &multi).unwrap(),
            "format('%s: taken over', e.owner, g.why)"
        );
    }

    #[test]
    fn a_missing_rule_or_parameter_is_refused() {
        let rules = [("r", "{x} = 1")];
        assert!(splice("{{s}}", &rules).is_err());
        assert!(splice("{{r(y=1)}}", &rules).is_err());
        assert!(splice("{{r(x=1)", &rules).is_err());
        assert!(splice("{{r}}", &rules).is_err());
        assert_eq!(splice("SELECT 1", &rules).unwrap(), "SELECT 1");
    }
}
