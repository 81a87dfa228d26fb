// The pure parts of the idempotency middleware (docs/clients.md, rule I): no I/O here, so
// that the conformance vectors (clients/conformance/vectors/idempotency.json) prove them
// byte for byte against the Python and Rust middlewares. http.cjs runs the requests.
'use strict';

const { createHash, createHmac, timingSafeEqual } = require('node:crypto');
const { ConfigurationError } = require('./errors.cjs');
const { defaultKey, encode } = require('./keys.cjs');
const { seconds } = require('./util.cjs');

const MiB = 1024 * 1024;

/**
 * The problem titles (I7): RFC 9110's reason phrases, the same from every pg_once
 * middleware (Node's STATUS_CODES still says "Payload Too Large", "Unprocessable Entity").
 */
const TITLES = {
  400: 'Bad Request',
  409: 'Conflict',
  413: 'Content Too Large',
  422: 'Unprocessable Content',
  500: 'Internal Server Error',
  503: 'Service Unavailable',
};

/** Problem codes (I7), one per answer the middleware makes itself. */
const PROBLEMS = {
  key_missing: 400,
  key_invalid: 400,
  body_too_large: 413,
  in_flight: 409,
  untrusted_entry: 409,
  fingerprint_mismatch: 422,
  handler_failed: 500,
  unavailable: 503,
};

/**
 * The key an `Idempotency-Key` header's value carries (I1), or null when it is not one: 1
 * to 255 visible ASCII characters, after unquoting a structured-field string (RFC 8941:
 * `"..."`, with `\"` and `\\` the only escapes).
 */
function parseKeyHeader(value) {
  if (typeof value !== 'string') return null;
  let key = value;
  // Quoted at both ends: a structured-field string. A lone or unclosed quote is a
  // character of the key, as in the Python and Rust middlewares.
  if (value.length >= 2 && value.startsWith('"') && value.endsWith('"')) {
    const sfString = /^"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"$/.exec(value);
    if (!sfString) return null;
    key = sfString[1].replace(/\\(["\\])/g, '$1');
  }
  return /^[\x21-\x7e]{1,255}$/.test(key) ? key : null;
}

/** I2: the shortest secret: HMAC-SHA-256's output, below which RFC 2104 says the key weakens it. */
const MIN_SECRET_BYTES = 32;

/** Lowercase hex HMAC-SHA-256 of ENCODE(fields) (rule K2) under the secret. */
function mac(secret, fields) {
  return createHmac('sha256', secret).update(encode(fields), 'utf8').digest('hex');
}

/**
 * The pg_once key of a request (I2). With a secret (a Buffer): NAMESPACE +
 * "idempotency:#hmac-sha256:" + hex(HMAC-SHA-256(secret, ENCODE(["idempotency-key", scope,
 * key]))): neither scope nor key is stored or announced, nor checkable against a guess
 * without the secret. Without one (a scope that is a principal, not a credential):
 * NAMESPACE + "idempotency:" + ENCODE([scope, key]).
 */
function entryKey(namespace, scope, key, secret = null) {
  if (scope !== null && typeof scope !== 'string') {
    throw new TypeError(`pg-once: an idempotency scope is a string or null, got ${typeof scope}`);
  }
  if (secret) return `${namespace}idempotency:#hmac-sha256:${mac(secret, ['idempotency-key', scope, key])}`;
  // defaultKey is rule K's NAME + ":" + ENCODE(args), hashed past the server's limit.
  return defaultKey(`${namespace}idempotency`, [scope, key]);
}

/**
 * The default scope (I2): the Authorization header as received, or null. Node's parser
 * hands header values over as latin1 (one character per byte), as Python and Rust read
 * them. It only ever enters the entry's key under the secret, which the default scope needs.
 */
function defaultScope(authorization) {
  if (authorization === undefined || authorization === null) return null;
  return String(authorization);
}

/**
 * The default fingerprint (I3): SHA-256 of METHOD "\n" PATH "\n" QUERY "\n" BODY, the path
 * and query as received (Node's parser hands the request target over as latin1, one
 * character per byte, so latin1 gives the bytes back). Stored as is only without a secret
 * (keyedFingerprint).
 */
function defaultFingerprint({ method, path, query, body }) {
  return createHash('sha256')
    .update(`${method.toUpperCase()}\n${path}\n${query}\n`, 'latin1')
    .update(body)
    .digest();
}

/**
 * I3: a fingerprint as a middleware with a secret claims and stores it,
 * HMAC-SHA-256(secret, ENCODE(["idempotency-fingerprint", hex(fingerprint)])), so that what
 * is stored (once.get, once.entries and its dumps) is no digest of the request a dictionary
 * could be tried against: a token in the query, a password in the body.
 */
function keyedFingerprint(secret, fingerprint) {
  return Buffer.from(mac(secret, ['idempotency-fingerprint', Buffer.from(fingerprint).toString('hex')]), 'hex');
}

/**
 * The request's fingerprint as claimed and stored (I3): the `fingerprint` option's (the
 * default's unless replaced; null for none), keyed by the secret when the middleware has
 * one. An application's fingerprint that is not 1 to 64 bytes is refused before it is keyed.
 */
function requestFingerprint({ fingerprint, secret }, { method, url, body }) {
  if (!fingerprint) return null;
  const { path, query } = splitTarget(url);
  const fp = fingerprint({ method: method.toUpperCase(), path, query, body }) ?? null;
  if (fp === null || !secret) return fp;
  if (!(fp instanceof Uint8Array) || fp.length < 1 || fp.length > 64) {
    throw new TypeError(`pg-once: a fingerprint is 1 to 64 bytes (a Buffer or Uint8Array, e.g. a SHA-256 digest) or null, got ${
      fp instanceof Uint8Array ? `${fp.length} bytes` : typeof fp}`);
  }
  return keyedFingerprint(secret, fp);
}

/** A request target (`/orders?a=1`) as its raw path and query (without `?`, '' when none). */
function splitTarget(url) {
  const at = url.indexOf('?');
  return at === -1 ? { path: url, query: '' } : { path: url.slice(0, at), query: url.slice(at + 1) };
}

// Not stored (I5): hop-by-hop headers, and those the server writes again.
const NOT_STORED = new Set([
  'connection', 'keep-alive', 'proxy-authenticate', 'proxy-authorization', 'te', 'trailer',
  'transfer-encoding', 'upgrade', 'content-length', 'date',
]);

/**
 * The stored form of a response (I2, I5): `{ status, headers: [[name, value], ...],
 * body: base64 | null, fingerprint: hex | null }`, and with a secret `mac`; names in lower
 * case and in order, without the headers above nor set-cookie (unless storeCookies); the
 * body null when `body` is null (longer than maxBody: the caller stopped collecting it).
 * `entry` and `fingerprint` (a Buffer or null) are the request's.
 */
function storedResponse(status, headers, body, { storeCookies = false, secret = null, entry, fingerprint = null } = {}) {
  const kept = [];
  for (const [name, value] of headers) {
    const lower = name.toLowerCase();
    if (NOT_STORED.has(lower) || (lower === 'set-cookie' && !storeCookies)) continue;
    kept.push([lower, String(value)]);
  }
  const form = {
    status,
    headers: kept,
    body: body === null ? null : Buffer.from(body).toString('base64'),
    fingerprint: fingerprint === null ? null : Buffer.from(fingerprint).toString('hex'),
  };
  if (secret) form.mac = responseMac(secret, entry, form);
  return form;
}

/** I5: hex(HMAC-SHA-256(secret, ENCODE(["idempotency-response", entry, status, headers, body, fingerprint]))). */
function responseMac(secret, entry, form) {
  return mac(secret, ['idempotency-response', entry, form.status, form.headers, form.body, form.fingerprint]);
}

// I6: a stored header's name is a token in lower case (I5 writes them so); its value a
// field value (RFC 9110 5.5), one character per byte: no CR, LF, NUL or other control
// character but tab, no whitespace at either end.
const HEADER_NAME = /^[!#$%&'*+\-.^_`|~0-9a-z]+$/;
const HEADER_VALUE = /^(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?$/;
const HEX = /^(?:[0-9a-f]{2}){1,64}$/;
const MAC_HEX = /^[0-9a-f]{64}$/;
const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/;

/**
 * Why a stored entry is not one this middleware wrote for this request (I6), or null.
 * Anyone with pg_once's rights in the key space can write an entry: only one in the
 * middleware's form, holding this request's fingerprint and, with a secret, its MAC, is
 * replayed, and none of its headers can frame the response or set a cookie the middleware
 * would not have stored. `options`: `{ secret, storeCookies }`.
 */
function untrusted({ secret = null, storeCookies = false }, entry, fingerprint, stored) {
  const members = ['body', 'fingerprint', 'headers', 'status', ...(secret ? ['mac'] : [])].sort();
  if (stored === null || typeof stored !== 'object' || Array.isArray(stored)
      || Object.keys(stored).sort().join() !== members.join()) {
    return `its members are not ${members.join(', ')}`;
  }
  const { status, headers, body } = stored;
  if (!Number.isInteger(status) || status < 200 || status > 599) return `its status ${shown(status)} is not 200 to 599`;
  if (!Array.isArray(headers)) return 'its headers are not a list';
  for (const pair of headers) {
    if (!Array.isArray(pair) || pair.length !== 2 || typeof pair[0] !== 'string' || typeof pair[1] !== 'string') {
      return `a header is not a [name, value] pair of strings: ${shown(pair)}`;
    }
    const [name, value] = pair;
    if (!HEADER_NAME.test(name) || !HEADER_VALUE.test(value)) return `header ${JSON.stringify(name)} is not a lower-case token with a field value`;
    if (NOT_STORED.has(name) || name === 'idempotent-replayed' || (name === 'set-cookie' && !storeCookies)) {
      return `it holds a ${name} header, which the middleware never stores`;
    }
  }
  if (body !== null && (typeof body !== 'string' || !BASE64.test(body))) return 'its body is not base64';
  const held = stored.fingerprint;
  if (held !== null && (typeof held !== 'string' || !HEX.test(held))) return 'its fingerprint is not hex';
  if (held !== (fingerprint === null ? null : Buffer.from(fingerprint).toString('hex'))) {
    return "it was not stored for this request's fingerprint";
  }
  if (!secret) return fingerprint === null ? 'the request has no fingerprint and the middleware no secret to check' : null;
  // Lowercase hex first: a latin1 Buffer keeps each character's low byte, so a MAC written
  // with characters past U+00FF would read as the right one.
  if (typeof stored.mac !== 'string' || !MAC_HEX.test(stored.mac)) return "its MAC is not the secret's";
  const want = Buffer.from(responseMac(secret, entry, stored), 'latin1');
  const got = Buffer.from(stored.mac, 'latin1');
  if (got.length !== want.length || !timingSafeEqual(got, want)) return "its MAC is not the secret's";
  return null;
}

/**
 * A stored value as the reason's text shows it: at most 80 characters, and never an
 * exception (JSON.stringify overflows the stack on the thousands of nesting levels jsonb
 * takes, and a planted entry may hold them).
 */
function shown(value) {
  try {
    const text = JSON.stringify(value) ?? String(value);
    return text.length > 80 ? `${text.slice(0, 80)}...` : text;
  } catch {
    return 'a value nested too deep to show';
  }
}

/**
 * Header pairs from what Node's response API takes: an object (values may be arrays, for
 * repeated headers), an array of pairs, a flat [name, value, ...] array, or a Headers.
 */
function headerPairs(headers) {
  if (headers === null || headers === undefined) return [];
  if (typeof headers.entries === 'function' && !Array.isArray(headers)) return [...headers.entries()];
  if (Array.isArray(headers)) {
    if (headers.every((h) => Array.isArray(h))) return headers.map(([n, v]) => [n, v]);
    const pairs = [];
    for (let i = 0; i + 1 < headers.length; i += 2) pairs.push([headers[i], headers[i + 1]]);
    return pairs;
  }
  return Object.entries(headers).flatMap(([n, v]) => (Array.isArray(v) ? v.map((x) => [n, x]) : [[n, v]]))
    .filter(([, v]) => v !== undefined);
}

/**
 * An answer the middleware makes itself (I7): application/problem+json, RFC 9457.
 * `retryAfter` (seconds) adds Retry-After.
 */
function problem(code, detail, { retryAfter } = {}) {
  const status = PROBLEMS[code];
  const headers = [['content-type', 'application/problem+json']];
  if (retryAfter !== undefined) headers.push(['retry-after', String(retryAfter)]);
  const body = Buffer.from(JSON.stringify({
    type: 'about:blank', title: TITLES[status], status, detail, code,
  }));
  return { status, headers, body };
}

/**
 * A stored response as an answer (I6): its status, headers, body, marked replayed, its
 * length the body's. The caller has checked it with untrusted().
 */
function replay(stored) {
  const body = stored.body === null ? Buffer.alloc(0) : Buffer.from(stored.body, 'base64');
  return {
    status: stored.status,
    headers: [...stored.headers, ['idempotent-replayed', 'true'], ['content-length', String(body.length)]],
    body,
  };
}

/** The answer to a request whose entry this middleware did not write (I6, I7). */
function untrustedEntry(header) {
  return problem('untrusted_entry', `The response stored under this ${header} was not written by this service's idempotency middleware, so it is not replayed and the request is not run: send a new key.`);
}

/** The secret (I2) as a Buffer, or null; required with the default scope. */
function secretOption(secret, scope) {
  if (secret === null || secret === undefined) {
    if (!scope) {
      throw new ConfigurationError("pg-once: idempotency: secret is required with the default scope, which comes from the caller's Authorization header: pass secret (at least 32 bytes, the same in every process of the service, e.g. process.env.IDEMPOTENCY_SECRET made with `openssl rand -hex 32`), so that no digest of a credential a dictionary could crack is stored or announced; or pass scope, a function giving the authenticated principal");
    }
    return null;
  }
  if (!(typeof secret === 'string' || secret instanceof Uint8Array)) throw new TypeError('pg-once: idempotency: secret is a string or a Buffer');
  const bytes = Buffer.from(secret);
  if (bytes.length < MIN_SECRET_BYTES) {
    throw new ConfigurationError(`pg-once: idempotency: secret must be at least ${MIN_SECRET_BYTES} bytes (e.g. \`openssl rand -hex 32\`), got ${bytes.length}`);
  }
  return bytes;
}

const IN_FLIGHT = ['conflict', 'wait'];

/**
 * The middleware's options, checked when it is built (I9), with their defaults. Seconds
 * for durations, bytes for sizes.
 */
function idempotencyOptions({
  client = null, connectionString = null, ttl = 24 * 3600, lease = 30, wait = 10, inFlight = 'conflict',
  methods = ['POST', 'PATCH'], header = 'Idempotency-Key', required = false, namespace = '', scope = null,
  fingerprint = defaultFingerprint, maxRequestBody = MiB, maxBody = MiB, store = (status) => status < 500,
  storeCookies = false, onError = undefined, secret = null, ...unknown
} = {}) {
  const names = Object.keys(unknown);
  if (names.length) {
    throw new TypeError(`pg-once: idempotency: unknown option ${names.join(', ')} (options are camelCase: inFlight, maxBody, ...)`);
  }
  if (!client === !connectionString) {
    throw new TypeError('pg-once: idempotency needs either client (an OnceClient) or connectionString');
  }
  if (client && typeof client.claim !== 'function') throw new TypeError('pg-once: idempotency: client must be an OnceClient');
  if (!IN_FLIGHT.includes(inFlight)) {
    throw new TypeError(`pg-once: idempotency: inFlight is 'conflict' (answer 409 at once) or 'wait' (wait for the first request's response), got ${inFlight}`);
  }
  if (!Array.isArray(methods) || methods.length === 0 || !methods.every((m) => typeof m === 'string' && m !== '')) {
    throw new TypeError('pg-once: idempotency: methods is a non-empty array of HTTP methods, e.g. [\'POST\', \'PATCH\']');
  }
  if (typeof header !== 'string' || !/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(header)) {
    throw new TypeError(`pg-once: idempotency: header is a header name, got ${header}`);
  }
  if (typeof namespace !== 'string') throw new TypeError('pg-once: idempotency: namespace is a string (e.g. \'tenant2/\')');
  for (const [name, fn, nullable] of [['scope', scope, true], ['fingerprint', fingerprint, true], ['store', store, false], ['onError', onError, true]]) {
    if (!(typeof fn === 'function' || (nullable && (fn === null || fn === undefined)))) {
      throw new TypeError(`pg-once: idempotency: ${name} must be a function${nullable ? ' or null' : ''}`);
    }
  }
  for (const [name, size] of [['maxRequestBody', maxRequestBody], ['maxBody', maxBody]]) {
    if (!Number.isSafeInteger(size) || size <= 0) throw new RangeError(`pg-once: idempotency: ${name} must be a positive number of bytes, got ${size}`);
  }
  return {
    client,
    connectionString,
    ttl: seconds('ttl', ttl, { allowNull: true }),
    lease: seconds('lease', lease),
    wait: seconds('wait', wait, { allowZero: true }),
    inFlight,
    methods: new Set(methods.map((m) => m.toUpperCase())),
    header: header.toLowerCase(),
    required: Boolean(required),
    namespace,
    scope,
    fingerprint,
    maxRequestBody,
    maxBody,
    store,
    storeCookies: Boolean(storeCookies),
    onError,
    secret: secretOption(secret, scope),
  };
}

module.exports = {
  PROBLEMS,
  parseKeyHeader,
  entryKey,
  defaultScope,
  defaultFingerprint,
  keyedFingerprint,
  requestFingerprint,
  splitTarget,
  storedResponse,
  responseMac,
  untrusted,
  untrustedEntry,
  headerPairs,
  problem,
  replay,
  idempotencyOptions,
};
