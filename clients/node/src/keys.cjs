// Default cache keys: docs/clients.md, rule K. A Python, Node and Rust process calling
// report(7, "eu") derive one key, and two different argument lists never derive one.
'use strict';

const { createHash } = require('node:crypto');

/** The server's key limit in bytes (K3). */
const MAX_KEY_BYTES = 7500;

/** `name:ENCODE(args)`, hashed when longer than MAX_KEY_BYTES (K1, K3). */
function defaultKey(name, args) {
  const encoded = encode(args);
  const key = `${name}:${encoded}`;
  if (Buffer.byteLength(key, 'utf8') <= MAX_KEY_BYTES) return key;
  // An encoding starts with "[", so a hashed key never equals a plain one.
  return `${name}:#sha256:${createHash('sha256').update(encoded, 'utf8').digest('hex')}`;
}

/** A key the caller wrote: used as it is, refused (before any call) when the server would refuse it. */
function checkKey(key) {
  if (typeof key !== 'string' || key === '') throw new TypeError('pg-once: key must be a non-empty string');
  const bytes = Buffer.byteLength(key, 'utf8');
  if (bytes > MAX_KEY_BYTES) {
    throw new RangeError(`pg-once: key is ${bytes} bytes, over the server's limit of ${MAX_KEY_BYTES}: shorten it or hash it`);
  }
  return key;
}

const refuse = (what) => new TypeError(
  `pg-once: cannot derive a cache key from ${what}: pass key (a function of the arguments returning a string)`);

// Lone surrogates would reach the server as U+FFFD (two keys would become one): escaped
// as \udxxx, as JSON.stringify writes them.
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g;
const SHORT_ESCAPES = { '"': '\\"', '\\': '\\\\', '\b': '\\b', '\f': '\\f', '\n': '\\n', '\r': '\\r', '\t': '\\t' };

const unicodeEscape = (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`;

/** A JSON string escaping only `"`, `\`, control characters and lone surrogates (K2). */
function encodeString(s) {
  return `"${s.replace(/["\\\u0000-\u001f]/g, (c) => SHORT_ESCAPES[c] ?? unicodeEscape(c))
    .replace(LONE_SURROGATE, unicodeEscape)}"`;
}

function encodeNumber(n) {
  if (!Number.isFinite(n)) throw refuse(String(n));
  return String(n); // Number.prototype.toString: 1.0 is 1, -0 is 0, 1e21 is 1e+21
}

const byUtf8 = (a, b) => Buffer.compare(Buffer.from(a[0], 'utf8'), Buffer.from(b[0], 'utf8'));

function encodeObject(entries) {
  return `{${entries.sort(byUtf8).map(([k, v]) => `${encodeString(k)}:${v}`).join(',')}}`;
}

function isPlainObject(v) {
  const proto = Object.getPrototypeOf(v);
  return proto === Object.prototype || proto === null;
}

function typeName(v) {
  return v?.constructor?.name ? `a ${v.constructor.name}` : `a ${typeof v}`;
}

/** ENCODE of rule K2; a TypeError for anything it does not cover. */
function encode(value) {
  switch (typeof value) {
    case 'string': return encodeString(value);
    case 'number': return encodeNumber(value);
    case 'bigint': return value.toString();
    case 'boolean': return String(value);
    case 'object': break;
    default: throw refuse(`a ${typeof value}`);
  }
  if (value === null) return 'null';
  if (Array.isArray(value)) return `[${Array.from(value, (v) => encode(v)).join(',')}]`;
  if (value instanceof Uint8Array) return `bytes("${Buffer.from(value.buffer, value.byteOffset, value.byteLength).toString('base64')}")`;
  if (value instanceof Date) {
    if (Number.isNaN(value.getTime())) throw refuse('an invalid Date');
    return `datetime("${isoUtc(value)}")`;
  }
  if (value instanceof Set) {
    const members = [...value].map((m) => [encode(m)]).sort(byUtf8).map(([m]) => m);
    return `set([${members.join(',')}])`;
  }
  if (value instanceof Map) {
    const entries = [...value];
    // A map with string keys is what JSON and Python's dict call an object.
    if (entries.every(([k]) => typeof k === 'string')) return encodeObject(entries.map(([k, v]) => [k, encode(v)]));
    const pairs = entries.map(([k, v]) => [encode(k), encode(v)]).sort(byUtf8);
    return `map([${pairs.map(([k, v]) => `[${k},${v}]`).join(',')}])`;
  }
  if (isPlainObject(value)) {
    if (Object.getOwnPropertySymbols(value).length) throw refuse('an object with symbol keys');
    return encodeObject(Object.entries(value).map(([k, v]) => [k, encode(v)]));
  }
  throw refuse(typeName(value));
}

/** A Date in UTC, its fraction of a second without trailing zeros: 2026-12-02T10:00:00.5+00:00. */
function isoUtc(d) {
  const iso = d.toISOString(); // 2026-12-02T10:00:00.500Z (years 0..9999)
  if (!/^\d{4}-/.test(iso)) throw refuse('a Date outside the years 0 to 9999');
  const fraction = iso.slice(20, 23).replace(/0+$/, '');
  return `${iso.slice(0, 19)}${fraction ? `.${fraction}` : ''}+00:00`;
}

module.exports = { MAX_KEY_BYTES, defaultKey, checkKey, encode };
