//! jsonb values, stored and returned as they are: pg_once never parses a result.
//! pgrx's own JsonB type would turn every cached result into a serde value and back,
//! which would make each cache hit pay for a full parse and print of its result.
//!
//! `Jsonb` and `JsonbArray` are the datums PostgreSQL gave us, typed: they are arguments
//! of the SQL functions like any other (pgrx unboxes them in declaration order), values
//! of statement parameters, and results.

use crate::storage::statements::{self, params, Statement};
use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::datum::{FromDatum, IntoDatum};
use pgrx::memcxt::PgMemoryContexts;
use pgrx::nullable::Nullable;
use pgrx::pg_sys;
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};

/// A jsonb value, as the datum PostgreSQL gave us.
#[derive(Clone, Copy)]
pub struct Jsonb(pg_sys::Datum);

/// A jsonb[] value (complete_keys' results), as the datum PostgreSQL gave us.
#[derive(Clone, Copy)]
pub struct JsonbArray(pg_sys::Datum);

/// What both types share: a datum of one SQL type, passed through untouched.
macro_rules! datum_passed_through {
    ($type:ident, $oid:expr, $sql:literal) => {
        impl FromDatum for $type {
            unsafe fn from_polymorphic_datum(
                datum: pg_sys::Datum,
                is_null: bool,
                _typoid: pg_sys::Oid,
            ) -> Option<Self> {
                (!is_null).then_some($type(datum))
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
                // SAFETY: `datum` is a valid varlena; the copy is made in `memory_context`.
                memory_context.switch_to(|_| unsafe {
                    Some($type(pg_sys::Datum::from(pg_sys::pg_detoast_datum_copy(
                        datum.cast_mut_ptr(),
                    ))))
                })
            }
        }

        impl IntoDatum for $type {
            fn into_datum(self) -> Option<pg_sys::Datum> {
                Some(self.0)
            }

            fn type_oid() -> pg_sys::Oid {
                $oid
            }
        }

        // SAFETY: the argument is unboxed as the datum it is, like pgrx's own types that
        // implement FromDatum; NULL becomes None through Option<Self>.
        unsafe impl<'fcx> ArgAbi<'fcx> for $type {
            unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
                let index = arg.index();
                unsafe { arg.unbox_arg_using_from_datum() }
                    .unwrap_or_else(|| panic!("argument {index} must not be null"))
            }

            unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
                unsafe { arg.unbox_arg_using_from_datum() }.into()
            }
        }

        // SAFETY: the value is exactly a datum of this SQL type.
        unsafe impl SqlTranslatable for $type {
            const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!($type);
            const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
            const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
                Ok(SqlMappingRef::literal($sql));
            const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
                Ok(ReturnsRef::One(SqlMappingRef::literal($sql)));
        }

        // SAFETY: returns the datum as it is, as every by-reference IntoDatum type does.
        unsafe impl BoxRet for $type {
            unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
                unsafe { fcinfo.return_raw_datum(self.0) }
            }
        }
    };
}

datum_passed_through!(Jsonb, pg_sys::JSONBOID, "jsonb");
datum_passed_through!(JsonbArray, pg_sys::JSONBARRAYOID, "jsonb[]");

impl Jsonb {
    /// The value's size in bytes, uncompressed (what a hit sends).
    pub fn size(self) -> usize {
        // SAFETY: the datum is a valid jsonb varlena, possibly toasted or compressed.
        unsafe { pg_sys::toast_raw_datum_size(self.0) }
    }
}

// An array's elements are stored uncompressed and untoasted, so pg_column_size of one is
// its size as Jsonb::size would say.
static SHAPE: Statement = Statement::new(
    "SELECT coalesce(cardinality($array), 0) AS length,
            array_position($array, NULL) IS NOT NULL AS has_null,
            (SELECT max(pg_column_size(r)) FROM unnest($array) r) AS largest",
);

/// What complete_keys checks of its results.
pub struct Shape {
    pub length: usize,
    pub has_null: bool,
    /// The size of the largest element, in bytes.
    pub largest: usize,
}

impl JsonbArray {
    /// How many elements the array has, whether one of them is NULL, and the largest.
    pub fn shape(self) -> Shape {
        statements::run(&SHAPE, params![array = self], |table| {
            let row = table.first();
            Ok(Shape {
                length: row.get_by_name::<i32, _>("length")?.unwrap_or(0) as usize,
                has_null: row.get_by_name::<bool, _>("has_null")?.unwrap_or(false),
                largest: row.get_by_name::<i32, _>("largest")?.unwrap_or(0) as usize,
            })
        })
    }
}
