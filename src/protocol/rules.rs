//! The protocol's SQL: each statement that writes once.entries or once.attempts is a file
//! of sql/ (`statement!("complete")` is sql/complete.sql), and each rule that more than
//! one statement applies is a file of sql/rules/, written once and spliced into the
//! statements that name it (`{{token_holder(alias=e.)}}`: see storage::statements for
//! how). The files are plain SQL for a reviewer, and for a second implementation of the
//! protocol to share; the plans see the statements with their rules spliced in, the text
//! the `concat!` of Rust strings these files replaced made.

use crate::protocol::namespace;
use crate::runtime::liveness::Me;
use crate::storage::statements::{params, Param, Rule};
use pgrx::datum::Interval;

/// The statement of file sql/`$name`.sql, with the rules of sql/rules/.
macro_rules! statement {
    ($name:literal) => {
        $crate::storage::statements::Statement::with_rules(
            include_str!(concat!("sql/", $name, ".sql")),
            &$crate::protocol::rules::RULES,
        )
    };
}
pub(crate) use statement;

/// Every rule, by the name statements give it: each file of sql/rules/.
pub static RULES: [Rule; 11] = [
    (
        "claimant_columns",
        include_str!("sql/rules/claimant_columns.sql"),
    ),
    (
        "claimant_values",
        include_str!("sql/rules/claimant_values.sql"),
    ),
    ("completed", include_str!("sql/rules/completed.sql")),
    (
        "completions_recorded",
        include_str!("sql/rules/completions_recorded.sql"),
    ),
    (
        "ended_attempt_columns",
        include_str!("sql/rules/ended_attempt_columns.sql"),
    ),
    (
        "failed_attempt",
        include_str!("sql/rules/failed_attempt.sql"),
    ),
    ("owner_gone", include_str!("sql/rules/owner_gone.sql")),
    (
        "owner_gone_error",
        include_str!("sql/rules/owner_gone_error.sql"),
    ),
    (
        "rerun_requested",
        include_str!("sql/rules/rerun_requested.sql"),
    ),
    ("retry_policy", include_str!("sql/rules/retry_policy.sql")),
    ("token_holder", include_str!("sql/rules/token_holder.sql")),
];

/// The parameters of the rule claimant_values (sql/rules/claimant_values.sql): who
/// claims, and for how long.
pub fn claimant_params(me: &Me, lease: Interval) -> [Param<'static>; 6] {
    params![
        owner_role = namespace::caller(),
        owner = me.label.clone(),
        owner_pid = me.pid,
        owner_started = me.started_param(),
        lease_only = me.lease_only,
        lease = lease,
    ]
}
