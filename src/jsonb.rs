//! Results are jsonb, stored and returned as they are: pg_once never parses a result.
//! pgrx's own JsonB type would turn every cached result into a serde value and back,
//! which would make each cache hit pay for a full parse and print of its result.

use pgrx::datum::{FromDatum, IntoDatum};
use pgrx::memcxt::PgMemoryContexts;
use pgrx::pg_sys;
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};

/// A jsonb value, as the datum PostgreSQL gave us.
#[derive(Clone, Copy)]
pub struct Jsonb(pg_sys::Datum);

impl FromDatum for Jsonb {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _typoid: pg_sys::Oid,
    ) -> Option<Self> {
        (!is_null).then_some(Jsonb(datum))
    }

    /// Values read through SPI live in SPI's memory, which is freed when the SPI
    /// connection closes; copy them into the caller's context.
    unsafe fn from_datum_in_memory_context(
        mut memory_context: PgMemoryContexts,
        datum: pg_sys::Datum,
        is_null: bool,
        _typoid: pg_sys::Oid,
    ) -> Option<Self> {
        if is_null {
            return None;
        }
        // SAFETY: `datum` is a valid jsonb varlena; the copy is made in `memory_context`.
        memory_context.switch_to(|_| unsafe {
            Some(Jsonb(pg_sys::Datum::from(pg_sys::pg_detoast_datum_copy(
                datum.cast_mut_ptr(),
            ))))
        })
    }
}

impl IntoDatum for Jsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

// SAFETY: a Jsonb is exactly a jsonb datum.
unsafe impl SqlTranslatable for Jsonb {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(Jsonb);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> = Ok(SqlMappingRef::literal("jsonb"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
        Ok(ReturnsRef::One(SqlMappingRef::literal("jsonb")));
}

// SAFETY: returns the datum as it is, as every by-reference IntoDatum type does.
unsafe impl pgrx::callconv::BoxRet for Jsonb {
    unsafe fn box_into<'fcx>(
        self,
        fcinfo: &mut pgrx::callconv::FcInfo<'fcx>,
    ) -> pgrx::datum::Datum<'fcx> {
        unsafe { fcinfo.return_raw_datum(self.0) }
    }
}
