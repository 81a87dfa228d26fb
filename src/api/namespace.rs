//! The namespace functions: who may use which keys (protocol::namespace).

use super::args;
use super::body;
use crate::errors;
use crate::protocol::namespace;
use pgrx::pg_sys;
use pgrx::prelude::*;

#[pg_extern(sql = false)]
fn create_namespace(
    prefix: Option<&str>,
    owner: Option<pg_sys::Oid>,
    notify: Option<&str>,
    existing: Option<&str>,
) {
    body(|| {
        let prefix = args::namespace_prefix(prefix);
        let owner = args::required(
            owner,
            "owner",
            "Pass the role whose members may use the namespace's keys, e.g. 'app2'.",
        );
        let payload = args::notify_payload(notify);
        let existing = args::existing_keys(existing);
        namespace::create(prefix, owner, payload, existing);
    })
}

#[pg_extern(sql = false)]
fn drop_namespace(prefix: Option<&str>) {
    body(|| {
        let prefix = args::namespace_prefix(prefix);
        if !namespace::remove(prefix) {
            errors::undefined_object(
                format!("namespace \"{prefix}\" does not exist"),
                "See SELECT prefix FROM once.namespaces;",
            );
        }
    })
}
