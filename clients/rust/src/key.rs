//! Default cache keys, rule K of docs/clients.md: `NAME:ENCODE(args)`, the same in the
//! three clients, so that a Rust, a Python and a Node process calling `report(7, "eu")`
//! share one entry.
//!
//! `ENCODE` is a serde serializer that writes JSON without spaces for what JSON can say
//! (integers of any size as digits, other numbers as ECMAScript writes them, maps and
//! structs with their members sorted by the keys' UTF-8 bytes) and `tag(...)` for the rest
//! (`bytes("<base64>")` for `serde_bytes`, `set([...])` for [`KeySet`], `map([[k,v],...])`
//! for a map whose keys are not all strings). It is injective: no two argument lists give
//! one key. NaN and infinities are refused, as serde_json would write them as `null`.

use crate::error::{Error, Result};
use base64::Engine as _;
use serde::ser::{self, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fmt::Write as _;

/// The server's limit on a key, in bytes.
pub const MAX_KEY_BYTES: usize = 7500;

/// The default key of a call of the function `name` with `args` (a tuple of the
/// arguments: `(7, "eu")`, or `(x,)` for one): `name:ENCODE(args)`, or, past
/// [`MAX_KEY_BYTES`], `name:#sha256:<hex>` of the encoding (K3). A value the encoding
/// refuses is [`Error::NotSerializable`], before anything runs.
pub fn derive<A: Serialize + ?Sized>(name: &str, args: &A) -> Result<String> {
    let encoded = encode(args).map_err(|e| Error::NotSerializable {
        key: name.to_owned(),
        reason: format!("{e}: pass a key of your own (cached_by_key) for such arguments"),
    })?;
    let key = format!("{name}:{encoded}");
    if key.len() <= MAX_KEY_BYTES {
        return Ok(key);
    }
    let hashed = format!(
        "{name}:#sha256:{}",
        crate::listener::hex(&Sha256::digest(encoded.as_bytes()))
    );
    check(&hashed)?; // a name too long for any key
    Ok(hashed)
}

/// F1, K3: a key the caller wrote is a non-empty string of at most [`MAX_KEY_BYTES`]
/// bytes, refused before any call otherwise.
pub(crate) fn check(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidOption("a key must not be empty".into()));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::InvalidOption(format!(
            "a key is at most {MAX_KEY_BYTES} bytes (the server's limit), this one {}: \
             use a shorter key, or let cached_named derive (and hash) it",
            key.len()
        )));
    }
    Ok(())
}

/// A set in a default key, written `set([...])` with its members sorted by their
/// encoding, so that it differs from a list of the same members (a `BTreeSet` or
/// `HashSet` serializes as a plain sequence, and a `HashSet` in no stable order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySet<T>(pub BTreeSet<T>);

/// The newtype name by which [`Encoder`] recognises a [`KeySet`].
pub(crate) const SET_TOKEN: &str = "$pg_once::KeySet";

impl<T: Serialize> Serialize for KeySet<T> {
    fn serialize<S: ser::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_newtype_struct(SET_TOKEN, &self.0)
    }
}

/// Why an argument cannot be encoded.
#[derive(Debug)]
pub struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Refused {}
impl ser::Error for Refused {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Refused(msg.to_string())
    }
}

/// ENCODE of K2.
pub(crate) fn encode<A: Serialize + ?Sized>(value: &A) -> std::result::Result<String, Refused> {
    value.serialize(Encoder)
}

/// A finite number as ECMAScript's `Number.prototype.toString` writes it: the shortest
/// digits that read back (Rust's `{:e}` finds them), placed as ECMA-262's Number::toString
/// places them (plain from 1e-6 up to below 1e21, exponent form outside).
fn ecmascript_number(x: f64) -> String {
    if x == 0.0 {
        return "0".into(); // -0 too
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exponent) = sci.split_once('e').expect("{:e} has an exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let k = digits.len() as i32;
    let n = exponent.parse::<i32>().expect("an integer exponent") + 1;
    let sign = if x < 0.0 { "-" } else { "" };
    let body = if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        format!("{}.{}", &digits[..n as usize], &digits[n as usize..])
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let e = n - 1;
        let e = if e >= 0 {
            format!("+{e}")
        } else {
            e.to_string()
        };
        match digits.split_at(1) {
            (d, "") => format!("{d}e{e}"),
            (d, rest) => format!("{d}.{rest}e{e}"),
        }
    };
    format!("{sign}{body}")
}

/// A string as a JSON string escaping only `"`, `\` and control characters.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

type Encoded = std::result::Result<String, Refused>;

/// The serializer of ENCODE; each value is written to a `String`.
struct Encoder;

/// A sequence being written: its members' encodings, then `[...]` (or `set([...])`).
struct Seq {
    items: Vec<String>,
    set: bool,
}

/// A map or struct being written: its entries' encodings, and whether every key was a
/// string (then a JSON object; else `map(...)`).
struct Map {
    entries: Vec<(String, String)>,
    next_key: Option<String>,
}

/// An externally tagged variant with content: `{"Variant":<content>}`, as serde_json.
struct Variant<T> {
    name: &'static str,
    inner: T,
}

impl Seq {
    fn finish(mut self) -> String {
        if self.set {
            self.items.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
            self.items.dedup();
            format!("set([{}])", self.items.join(","))
        } else {
            format!("[{}]", self.items.join(","))
        }
    }
}

impl Map {
    fn finish(mut self) -> String {
        self.entries
            .sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        if self.entries.iter().all(|(k, _)| k.starts_with('"')) {
            let members: Vec<String> = self
                .entries
                .iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect();
            format!("{{{}}}", members.join(","))
        } else {
            let members: Vec<String> = self
                .entries
                .iter()
                .map(|(k, v)| format!("[{k},{v}]"))
                .collect();
            format!("map([{}])", members.join(","))
        }
    }
}

fn tagged(name: &str, content: String) -> String {
    format!("{{{}:{content}}}", json_string(name))
}

impl ser::Serializer for Encoder {
    type Ok = String;
    type Error = Refused;
    type SerializeSeq = Seq;
    type SerializeTuple = Seq;
    type SerializeTupleStruct = Seq;
    type SerializeTupleVariant = Variant<Seq>;
    type SerializeMap = Map;
    type SerializeStruct = Map;
    type SerializeStructVariant = Variant<Map>;

    fn serialize_bool(self, v: bool) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_i8(self, v: i8) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_i16(self, v: i16) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_i32(self, v: i32) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_i64(self, v: i64) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_i128(self, v: i128) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_u8(self, v: u8) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_u16(self, v: u16) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_u32(self, v: u32) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_u64(self, v: u64) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_u128(self, v: u128) -> Encoded {
        Ok(v.to_string())
    }
    fn serialize_f32(self, v: f32) -> Encoded {
        // Through its decimal form, so that 0.1f32 is 0.1 and not 0.10000000149011612.
        self.serialize_f64(v.to_string().parse().expect("an f32 reads as an f64"))
    }
    fn serialize_f64(self, v: f64) -> Encoded {
        if !v.is_finite() {
            return Err(Refused(format!("{v} has no JSON form")));
        }
        Ok(ecmascript_number(v))
    }
    fn serialize_char(self, v: char) -> Encoded {
        Ok(json_string(v.encode_utf8(&mut [0; 4])))
    }
    fn serialize_str(self, v: &str) -> Encoded {
        Ok(json_string(v))
    }
    fn serialize_bytes(self, v: &[u8]) -> Encoded {
        Ok(format!(
            "bytes(\"{}\")",
            base64::engine::general_purpose::STANDARD.encode(v)
        ))
    }
    fn serialize_none(self) -> Encoded {
        Ok("null".into())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Encoded {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Encoded {
        Ok("null".into())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Encoded {
        Ok("null".into())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Encoded {
        Ok(json_string(variant))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Encoded {
        if name == SET_TOKEN {
            return value.serialize(SetEncoder);
        }
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Encoded {
        Ok(tagged(variant, value.serialize(Encoder)?))
    }
    fn serialize_seq(self, len: Option<usize>) -> std::result::Result<Seq, Refused> {
        Ok(Seq {
            items: Vec::with_capacity(len.unwrap_or(0)),
            set: false,
        })
    }
    fn serialize_tuple(self, len: usize) -> std::result::Result<Seq, Refused> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        len: usize,
    ) -> std::result::Result<Seq, Refused> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> std::result::Result<Variant<Seq>, Refused> {
        Ok(Variant {
            name: variant,
            inner: self.serialize_seq(Some(len))?,
        })
    }
    fn serialize_map(self, _: Option<usize>) -> std::result::Result<Map, Refused> {
        Ok(Map {
            entries: Vec::new(),
            next_key: None,
        })
    }
    fn serialize_struct(self, _: &'static str, len: usize) -> std::result::Result<Map, Refused> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> std::result::Result<Variant<Map>, Refused> {
        Ok(Variant {
            name: variant,
            inner: self.serialize_map(Some(len))?,
        })
    }
}

/// Writes the sequence inside a [`KeySet`] as `set([...])`.
struct SetEncoder;

impl SetEncoder {
    fn refuse(self) -> Encoded {
        not_a_set()
    }
}

/// What a [`KeySet`] that holds anything but a set's sequence is refused with.
fn not_a_set<T>() -> std::result::Result<T, Refused> {
    Err(Refused("a KeySet holds a set".into()))
}

macro_rules! refuse_all {
    ($($method:ident($($arg:ty),*);)*) => {$(
        fn $method(self, $(_: $arg),*) -> Encoded {
            self.refuse()
        }
    )*};
}

impl ser::Serializer for SetEncoder {
    type Ok = String;
    type Error = Refused;
    type SerializeSeq = Seq;
    type SerializeTuple = ser::Impossible<String, Refused>;
    type SerializeTupleStruct = ser::Impossible<String, Refused>;
    type SerializeTupleVariant = ser::Impossible<String, Refused>;
    type SerializeMap = ser::Impossible<String, Refused>;
    type SerializeStruct = ser::Impossible<String, Refused>;
    type SerializeStructVariant = ser::Impossible<String, Refused>;

    fn serialize_seq(self, len: Option<usize>) -> std::result::Result<Seq, Refused> {
        Ok(Seq {
            items: Vec::with_capacity(len.unwrap_or(0)),
            set: true,
        })
    }
    refuse_all! {
        serialize_bool(bool); serialize_i8(i8); serialize_i16(i16); serialize_i32(i32);
        serialize_i64(i64); serialize_u8(u8); serialize_u16(u16); serialize_u32(u32);
        serialize_u64(u64); serialize_f32(f32); serialize_f64(f64); serialize_char(char);
        serialize_str(&str); serialize_bytes(&[u8]); serialize_none(); serialize_unit();
        serialize_unit_struct(&'static str);
        serialize_unit_variant(&'static str, u32, &'static str);
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Encoded {
        self.refuse()
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, _: &T) -> Encoded {
        self.refuse()
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Encoded {
        self.refuse()
    }
    fn serialize_tuple(self, _: usize) -> std::result::Result<Self::SerializeTuple, Refused> {
        not_a_set()
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> std::result::Result<Self::SerializeTupleStruct, Refused> {
        not_a_set()
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> std::result::Result<Self::SerializeTupleVariant, Refused> {
        not_a_set()
    }
    fn serialize_map(self, _: Option<usize>) -> std::result::Result<Self::SerializeMap, Refused> {
        not_a_set()
    }
    fn serialize_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> std::result::Result<Self::SerializeStruct, Refused> {
        not_a_set()
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> std::result::Result<Self::SerializeStructVariant, Refused> {
        not_a_set()
    }
}

/// The three sequence traits of serde, which differ only in their method's name.
macro_rules! seq_impl {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Seq {
            type Ok = String;
            type Error = Refused;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> std::result::Result<(), Refused> {
                self.items.push(value.serialize(Encoder)?);
                Ok(())
            }
            fn end(self) -> Encoded {
                Ok(self.finish())
            }
        }
    )*};
}

seq_impl!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field
);

impl ser::SerializeTupleVariant for Variant<Seq> {
    type Ok = String;
    type Error = Refused;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> std::result::Result<(), Refused> {
        ser::SerializeSeq::serialize_element(&mut self.inner, value)
    }
    fn end(self) -> Encoded {
        Ok(tagged(self.name, self.inner.finish()))
    }
}

impl ser::SerializeMap for Map {
    type Ok = String;
    type Error = Refused;
    fn serialize_key<T: Serialize + ?Sized>(
        &mut self,
        key: &T,
    ) -> std::result::Result<(), Refused> {
        self.next_key = Some(key.serialize(Encoder)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> std::result::Result<(), Refused> {
        let key = self
            .next_key
            .take()
            .expect("serde gives a key before its value");
        self.entries.push((key, value.serialize(Encoder)?));
        Ok(())
    }
    fn end(self) -> Encoded {
        Ok(self.finish())
    }
}

impl ser::SerializeStruct for Map {
    type Ok = String;
    type Error = Refused;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> std::result::Result<(), Refused> {
        self.entries
            .push((json_string(name), value.serialize(Encoder)?));
        Ok(())
    }
    fn end(self) -> Encoded {
        Ok(self.finish())
    }
}

impl ser::SerializeStructVariant for Variant<Map> {
    type Ok = String;
    type Error = Refused;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> std::result::Result<(), Refused> {
        ser::SerializeStruct::serialize_field(&mut self.inner, name, value)
    }
    fn end(self) -> Encoded {
        Ok(tagged(self.name, self.inner.finish()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_before_any_call() {
        assert!(matches!(check(""), Err(Error::InvalidOption(_))));
        assert!(check(&"k".repeat(MAX_KEY_BYTES)).is_ok());
        let e = check(&"k".repeat(MAX_KEY_BYTES + 1)).unwrap_err();
        assert!(e.to_string().contains("7500"), "{e}");
        assert!(derive(&"n".repeat(MAX_KEY_BYTES), &(1,)).is_err());
        assert_eq!(
            derive("f", &(KeySet([3, 1].into()), "a")).unwrap(),
            r#"f:[set([1,3]),"a"]"#
        );
    }

    #[test]
    fn numbers_as_ecmascript_writes_them() {
        for (x, js) in [
            (1.0, "1"),
            (-0.0, "0"),
            (0.5, "0.5"),
            (1e21, "1e+21"),
            (1e20, "100000000000000000000"),
            (1e-7, "1e-7"),
            (1.5e-7, "1.5e-7"),
            (1e-6, "0.000001"),
            (123.456, "123.456"),
            (5e-324, "5e-324"),
            (-2.5, "-2.5"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ] {
            assert_eq!(ecmascript_number(x), js, "{x:e}");
        }
    }
}
