// The pure parts of the idempotency middleware (docs/clients.md, rule I): no I/O here, so
// that the conformance vectors (clients/conformance/vectors/idempotency.json) prove them
// byte for byte against the Python and Rust middlewares. http.cjs runs the requests.
'use strict';

const { createHash } = require('node:crypto');
const { defaultKey } = require('./keys.cjs');
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

/** The pg_once key of a request (I2): NAMESPACE + "idempotency:" + ENCODE([scope, key]). */
function entryKey(namespace, scope, key) {
  if (scope !== null && typeof scope !== 'string') {
    throw new TypeError(`pg-once: an idempotency scope is a string or null, got ${typeof scope}`);
  }
  // defaultKey is rule K's NAME + ":" + ENCODE(args), hashed past the server's limit.
  return defaultKey(`${namespace}idempotency`, [scope, key]);
}

/**
 * The default scope (I2): the lowercase hex SHA-256 of the Authorization header's bytes, or
 * null. Node's parser hands header values over as latin1 (one character per byte), so
 * latin1 gives the bytes back, as Python and Rust hash them.
 */
function defaultScope(authorization) {
  if (authorization === undefined || authorization === null) return null;
  return createHash('sha256').update(String(authorization), 'latin1').digest('hex');
}

/**
 * The default fingerprint (I3): SHA-256 of METHOD "\n" PATH "\n" QUERY "\n" BODY, the path
 * and query as received (Node's parser hands the request target over as latin1, one
 * character per byte, so latin1 gives the bytes back).
 */
function defaultFingerprint({ method, path, query, body }) {
  return createHash('sha256')
    .update(`${method.toUpperCase()}\n${path}\n${query}\n`, 'latin1')
    .update(body)
    .digest();
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
 * body: base64 | null }`, names in lower case and in order, without the headers above nor
 * set-cookie (unless storeCookies); the body null when `body` is null (longer than
 * maxBody: the caller stopped collecting it).
 */
function storedResponse(status, headers, body, { storeCookies = false } = {}) {
  const kept = [];
  for (const [name, value] of headers) {
    const lower = name.toLowerCase();
    if (NOT_STORED.has(lower) || (lower === 'set-cookie' && !storeCookies)) continue;
    kept.push([lower, String(value)]);
  }
  return { status, headers: kept, body: body === null ? null : Buffer.from(body).toString('base64') };
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

/** A stored response as an answer (I6): its status, headers, body, marked replayed. */
function replay(stored) {
  return {
    status: stored.status,
    headers: [...stored.headers, ['idempotent-replayed', 'true']],
    body: stored.body === null ? Buffer.alloc(0) : Buffer.from(stored.body, 'base64'),
  };
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
  storeCookies = false, onError = undefined, ...unknown
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
  };
}

module.exports = {
  PROBLEMS,
  parseKeyHeader,
  entryKey,
  defaultScope,
  defaultFingerprint,
  splitTarget,
  storedResponse,
  headerPairs,
  problem,
  replay,
  idempotencyOptions,
};
